"""The convergence study's runs (``bench/convergence.py``): the methods, one training run, and the plan of
runs (groups of seeds, the matched sequential baselines, the grid, the ablations).

A *method* is a pipecore algorithm (any of ``pipecore.algorithm_names()``) or sequential training with an
update every ``k`` micro-batches (``sequential/k``). Every algorithm is compared with the sequential method
of its own update frequency, read off the configured algorithm (``pipecore.get_algorithm(...).update_every``):
same optimizer, same learning rate per update, same number of updates per mini-batch, and nothing else
different but the pipeline's staleness.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Sequence

import torch
from torch import nn

import pipecore
from pipecore.cli.tasks import WARMUP_EPOCHS, stage_partition
from convergence_tasks import (
    TASKS, Diverged, Options, Task, build_model, loss_function, lr_schedule, make_optimizer, options_tuple,
    steps_per_epoch, test_metrics, train_batches,
)

#: Sequential methods are named ``sequential/<k>``: an update after every ``k`` micro-batches.
SEQUENTIAL = "sequential"
#: Sequential training is the whole model as one pipecore stage under this synchronous algorithm: a forward and
#: a backward per micro-batch, gradients summed over the step's micro-batches, one update (the library's tests
#: check that gpipe equals plain training with gradient accumulation; this study's, that one stage equals plain
#: torch). It runs the same optimizer implementation as the pipelines, so a gap is the pipeline's, not the
#: optimizer's rounding.
ONE_STAGE_ALGORITHM = "gpipe"
#: The grid's runs use a seed that is not an evaluation seed.
GRID_SEED = 1000
#: Settings (the third part of a group's key).
AT_SEQUENTIAL, BEST = "sequential-hp", "best"
#: PipeMare ablation: label -> options (added to warmup_steps).
PIPEMARE_ABLATIONS = {"no T1 (lr_rescheduling=False)": {"lr_rescheduling": False},
                      "no T2 (discrepancy_correction=False)": {"discrepancy_correction": False}}
#: I-TiMePReSt's interpolation strengths: alpha(d) = exp(-lam*d); 0 reads the stash, inf the live weights.
LAMBDAS = (0.0, 0.5, 1.0, 2.0, math.inf)
#: The tasks that get the ablations (when chosen with --tasks).
ABLATION_TASKS = ("mlp4", "mlp8", "gpt")
#: Delay compensation's adaptive variant (DC-ASGD-a), beside the constant ``lam`` of pipedream-dc's main runs,
#: on every task: at the constant variant's default ``lam`` the correction is tiny where gradients are small.
DC_ADAPTIVE = ("pipedream-dc", "adaptive", {"adaptive": True})
#: Seconds per epoch of one run at the full study's sizes, for the time estimate printed at the start:
#: (sequential, a pipeline algorithm's typical), measured on a 2-core machine with both workers busy (the
#: algorithms with an update per micro-batch, and mlp8's, vary up to 1.5x around these). GPT tasks scale with
#: their batches per epoch; gpt-large-p8 with its stages too.
SECONDS_PER_EPOCH = {"mlp4": (0.08, 0.25), "mlp8": (0.25, 0.85), "resnet": (1.0, 1.4), "gpt": (2.5, 3.0),
                     "gpt-large-p4": (25.0, 30.0), "gpt-large-p8": (25.0, 36.0)}
#: Seconds each run spends outside its epochs (building the pipeline, evaluation set-up).
SECONDS_PER_RUN = 0.4


def sequential_method(every: int) -> str:
    return f"{SEQUENTIAL}/{every}"


def is_sequential(method: str) -> bool:
    return method.startswith(SEQUENTIAL + "/")


def sequential_every(method: str) -> int:
    return int(method.split("/", 1)[1])


def method_label(task: Task, method: str) -> str:
    """``sequential, update per mini-batch`` for a sequential method, the algorithm's name otherwise."""
    if not is_sequential(method):
        return method
    k = sequential_every(method)
    every = ("per mini-batch" if k == task.microbatches else "per micro-batch" if k == 1
             else f"every {k} micro-batches")
    return f"sequential, update {every}"


def update_every(task: Task, method: str, options: dict[str, Any] | Options = ()) -> int:
    """Micro-batches per optimizer update: the configured algorithm's, or the sequential method's ``k``."""
    if is_sequential(method):
        return sequential_every(method)
    return pipecore.get_algorithm(method, task.stages, task.microbatches, **dict(options)).update_every


def matched_sequential(task: Task, algorithm: str, options: dict[str, Any] | Options = ()) -> str:
    """The sequential method with the algorithm's update frequency (its matched baseline)."""
    return sequential_method(update_every(task, algorithm, options))


def is_exact(task: Task, algorithm: str, options: dict[str, Any] | Options = ()) -> bool:
    """Whether the algorithm computes its matched baseline's updates: in the simulator no read is stale, no
    backward's weights differ from its forward's (delay 0) and no weight is derived. Such an algorithm differs
    from its baseline by float rounding only (the synchronous schedules)."""
    trace = pipecore.simulate(algorithm, task.stages, task.microbatches, n_minibatches=3, **dict(options))
    summaries = [trace.stage_summary(s) for s in range(trace.num_stages)]
    return all(s.max_staleness == 0 and s.max_delay == 0 and not s.derived_weights for s in summaries)


@dataclass(frozen=True)
class Job:
    """One training run: a task, a method, a seed and the hyper-parameters."""

    task: Task
    method: str
    seed: int
    lr: float
    optimizer_options: Options
    options: Options = ()  # algorithm options

    @property
    def key(self) -> tuple:
        """Identical jobs (same run, bit for bit) share one key, so they run once. Sequential runs do not depend
        on the pipeline's depth: tasks that differ only there share them."""
        where = ("shared", self.task.training_identity()) if is_sequential(self.method) else (self.task.name,)
        return (*where, self.method, self.seed, self.lr, self.optimizer_options, self.options)


@dataclass
class Group:
    """The runs of one (task, method, setting): the same hyper-parameters over several seeds."""

    task: str
    method: str
    setting: str
    lr: float
    optimizer_options: Options
    options: dict[str, Any]
    keys: list[tuple] = field(default_factory=list)

    @property
    def name(self) -> str:
        return group_name(self.task, self.method, self.setting)


def group_name(task: str, method: str, setting: str) -> str:
    return f"{task}|{method}|{setting}"


# -- one run (in a worker process) -------------------------------------------------------------------


class Trainer:
    """A :class:`pipecore.Pipeline` for a job: the algorithm's over the task's stages, or (sequential) the whole
    model as one stage. One thread runs the stages in turn (``concurrent=False``, bit-identical to threads), so
    each action's measured time is its own compute, for the time-to-quality prediction."""

    def __init__(self, job: Job, model: nn.Module) -> None:
        task = job.task
        every = update_every(task, job.method, job.options)
        # Linear scaling: lr is per mini-batch; an update over k of the m micro-batches takes lr * k / m.
        optimizer = make_optimizer(task, job.lr * every / task.microbatches, job.optimizer_options)
        common = {"optimizer": optimizer, "loss_fn": loss_function(task), "concurrent": False,
                  "lr_scheduler": lr_schedule(task, every)}
        if is_sequential(job.method):
            # One stage, k micro-batches per pipeline step, m/k steps per mini-batch.
            self.pieces = task.microbatches // every
            self.pipe = pipecore.Pipeline(model, 1, ONE_STAGE_ALGORITHM, every, **common)
        else:
            self.pieces = 1
            partition = stage_partition(model, task.stages) if task.model == "mlp" else None
            self.pipe = pipecore.Pipeline(model, task.stages, job.method, task.microbatches, partition=partition,
                                          **common, **dict(job.options))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One mini-batch; its mean loss."""
        if self.pieces == 1:
            return self.pipe.step(x, y)
        return statistics.fmean(self.pipe.step(xs, ys) for xs, ys in zip(x.chunk(self.pieces), y.chunk(self.pieces)))

    def flush(self) -> None:
        self.pipe.flush()

    @property
    def updates(self) -> int:
        """Optimizer updates per stage so far (every stage makes as many, once flushed)."""
        return max(st["live_version"] for st in self.pipe.stats())

    def version_bytes(self) -> int:
        """Every weight-sized buffer the algorithm keeps, summed over stages."""
        return sum(st["weight_version_bytes"] + st["scratch_bytes"] + st["buffer_bytes"] for st in self.pipe.stats())

    def stage_costs(self) -> list[dict[str, float]]:
        """Per stage, the median seconds of its recent forward, backward and update actions."""
        return [dict(st["seconds_per_action"]) for st in self.pipe.stats()]


def train_epoch(trainer: Trainer, job: Job, epoch: int) -> float:
    """One epoch; returns the mean mini-batch loss. Raises :class:`Diverged` on a NaN or infinite loss."""
    losses = []
    for x, y in train_batches(job.task, job.seed, epoch):
        try:
            loss = trainer.step(x, y)
        except pipecore.NonFiniteLoss as error:
            raise Diverged(str(error)) from None
        if not math.isfinite(loss):
            raise Diverged(f"loss {loss}")
        losses.append(loss)
    try:
        trainer.flush()
    except pipecore.NonFiniteLoss as error:
        raise Diverged(str(error)) from None
    return statistics.fmean(losses)


def run_job(job: Job) -> dict[str, Any]:
    """Train one job to the end (or its divergence); the run's record. Runs in a worker process."""
    started = time.perf_counter()
    record: dict[str, Any] = {"key": job.key, "curve": [], "diverged": False, "error": None,
                              "weight_version_bytes": None, "train_s": 0.0, "stage_costs": None}
    try:
        _train(job, record)
    except Diverged as error:
        record.update(diverged=True, diverged_epoch=len(record["curve"]) + 1, reason=str(error))
    except Exception:  # a bug, not a divergence: keep the study going, report it at the end
        record["error"] = traceback.format_exc()
    record["wall_s"] = time.perf_counter() - started
    return record


def _train(job: Job, record: dict[str, Any]) -> None:
    """Fill ``record``'s settings, curve (one point per epoch), costs and training seconds as it goes."""
    task = job.task
    every = update_every(task, job.method, job.options)
    per_epoch = steps_per_epoch(task)
    record.update(update_every=every, lr_per_update=job.lr * every / task.microbatches,
                  updates_per_epoch=per_epoch * task.microbatches // every, steps_per_epoch=per_epoch)
    torch.manual_seed(job.seed)
    model = build_model(task)
    trainer = Trainer(job, model)
    record["weight_version_bytes"] = trainer.version_bytes()  # before any step: a diverged run reports it too
    try:
        for epoch in range(task.epochs):
            t0 = time.perf_counter()
            loss = train_epoch(trainer, job, epoch)
            record["train_s"] += time.perf_counter() - t0
            record["curve"].append({"epoch": epoch + 1, "step": (epoch + 1) * per_epoch, "loss": loss,
                                    "updates": trainer.updates, **test_metrics(task, model)})
    finally:
        record["stage_costs"] = trainer.stage_costs()


def init_worker() -> None:
    """One thread; then a tiny pipeline and sequential step each, so that the first run's wall time does not
    include the worker's one-time costs (lazy imports, first graph capture, data loading)."""
    torch.set_num_threads(1)
    tiny = replace(TASKS["mlp4"], sizes={"hidden": 8, "depth": 3}, epochs=1)
    for method in (sequential_method(tiny.microbatches), "1f1b"):
        job = Job(tiny, method, 0, tiny.lr, tiny.optimizer_options)
        trainer = Trainer(job, build_model(tiny))
        x, y = next(train_batches(tiny, 0, 0))
        trainer.step(x, y)
        trainer.flush()


# -- planning the runs ----------------------------------------------------------------------------


def warmup_steps(task: Task, algorithm: str, options: dict[str, Any]) -> int:
    """A warm-up's ``warmup_steps``: the algorithm's updates in the first ``WARMUP_EPOCHS`` epochs."""
    every = pipecore.get_algorithm(algorithm, task.stages, task.microbatches, **options).update_every
    return WARMUP_EPOCHS * steps_per_epoch(task) * task.microbatches // every


def algorithm_options(task: Task, algorithm: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The options a run passes: ``extra``, plus ``warmup_steps`` for an algorithm that has one (PipeMare)."""
    from pipecore.algorithms import get_spec

    options = dict(extra or {})
    if "warmup_steps" in get_spec(algorithm).defaults and "warmup_steps" not in options:
        options["warmup_steps"] = warmup_steps(task, algorithm, options)
    return options


def accepted(task: Task, algorithm: str, options: dict[str, Any]) -> str | None:
    """None if this pipecore accepts ``options`` (with the warm-up :func:`algorithm_options` adds) for
    ``algorithm`` at the task's shape, else the reason."""
    try:
        pipecore.get_algorithm(algorithm, task.stages, task.microbatches, **algorithm_options(task, algorithm, options))
    except ValueError as error:
        return str(error)
    return None


def refuses_optimizer(task: Task, algorithm: str, options: dict[str, Any]) -> str | None:
    """None if ``algorithm`` trains with the task's optimizer, else the pipeline's reason (nesterov-async takes
    its look-ahead from the optimizer's momentum and refuses AdamW, whose first moment has none). Asked of a
    pipeline of single-layer stages, built and dropped: the refusal is the one a run would meet."""
    stages = nn.Sequential(*(nn.Linear(2, 2) for _ in range(task.stages)))
    try:
        pipecore.Pipeline(stages, task.stages, algorithm, task.microbatches, concurrent=False,
                          optimizer=make_optimizer(task, task.lr, task.optimizer_options), loss_fn=nn.MSELoss(),
                          **algorithm_options(task, algorithm, options))
    except TypeError as error:
        return str(error).splitlines()[0]
    return None


class Plan:
    """The groups of the study and the distinct jobs they need."""

    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}
        self.jobs: dict[tuple, Job] = {}
        self.skipped: list[dict[str, str]] = []

    def add(self, task: Task, method: str, setting: str, seeds: Iterable[int], lr: float,
            optimizer_options: Options, options: dict[str, Any] | None = None) -> list[Job]:
        """A group of runs; returns the jobs not planned before (identical runs are shared between groups)."""
        opts = {} if is_sequential(method) else algorithm_options(task, method, options)
        group = Group(task.name, method, setting, lr, optimizer_options, opts)
        new = []
        for seed in seeds:
            job = Job(task, method, seed, lr, optimizer_options, options_tuple(opts))
            group.keys.append(job.key)
            if job.key not in self.jobs:
                self.jobs[job.key] = job
                new.append(job)
        self.groups[group.name] = group
        return new

    def group(self, task: Task | str, method: str, setting: str = AT_SEQUENTIAL) -> Group | None:
        return self.groups.get(group_name(getattr(task, "name", task), method, setting))

    def skip(self, task: Task, method: str, setting: str, reason: str,
             why: str = "this pipecore does not accept it") -> None:
        print(f"SKIPPED {task.name} {method} {setting}: {why}: {reason}", file=sys.stderr)
        self.skipped.append({"task": task.name, "algorithm": method, "setting": setting, "reason": reason})


def algorithms() -> list[str]:
    """Every pipecore algorithm: the study takes new ones as they are registered."""
    return pipecore.algorithm_names()


def sequential_methods(task: Task) -> list[str]:
    """The sequential methods of a task: one per update frequency of its algorithms (at their defaults), per
    mini-batch first."""
    everys = {update_every(task, a, algorithm_options(task, a)) for a in algorithms()} | {task.microbatches}
    return [sequential_method(k) for k in sorted(everys, reverse=True)]


def methods(task: Task) -> list[str]:
    """The task's sequential methods, then every pipecore algorithm."""
    return sequential_methods(task) + algorithms()


def seeds_for(task: Task, method: str, seeds: Sequence[int], options: dict[str, Any] | None = None) -> list[int]:
    """The evaluation seeds a method runs: all, or ``task.exact_seeds`` of them for an exact algorithm."""
    if task.exact_seeds is None or is_sequential(method):
        return list(seeds)
    if is_exact(task, method, algorithm_options(task, method, options)):
        return list(seeds)[:task.exact_seeds]
    return list(seeds)


def plan_first_phase(plan: Plan, tasks: Sequence[Task], seeds: Sequence[int]) -> list[Job]:
    """Every method at the task's hyper-parameters, the grid, the ablations and every matched baseline."""
    jobs: list[Job] = []
    for task in tasks:
        for method in methods(task):
            refused = None if is_sequential(method) else refuses_optimizer(task, method, {})
            if refused:
                plan.skip(task, method, AT_SEQUENTIAL, refused, why=f"not with {task.optimizer}")
                continue
            jobs += plan.add(task, method, AT_SEQUENTIAL, seeds_for(task, method, seeds), task.lr,
                             task.optimizer_options)
            for lr, opt_options in task.grid:
                jobs += plan.add(task, method, grid_setting(lr, opt_options), [GRID_SEED], lr, opt_options)
        if task.name in ABLATION_TASKS:
            jobs += plan_ablations(plan, task, seeds)
        jobs += plan_variant(plan, task, seeds, *DC_ADAPTIVE)
        # An ablation may change an algorithm's update frequency: its matched baseline runs too.
        for group in [g for g in plan.groups.values() if g.task == task.name and not is_sequential(g.method)]:
            baseline = matched_sequential(task, group.method, group.options)
            if plan.group(task, baseline) is None:
                jobs += plan.add(task, baseline, AT_SEQUENTIAL, seeds, task.lr, task.optimizer_options)
    return jobs


def grid_setting(lr: float, optimizer_options: Options) -> str:
    return "grid " + " ".join([f"lr={lr:g}"] + [f"{k}={v:g}" for k, v in optimizer_options])


def lam_label(lam: float) -> str:
    return f"lam={'inf' if math.isinf(lam) else f'{lam:g}'}"


def plan_ablations(plan: Plan, task: Task, seeds: Sequence[int]) -> list[Job]:
    """PipeMare without T1 / T2; I-TiMePReSt over ``LAMBDAS`` (its default lam shares the main runs)."""
    jobs: list[Job] = []
    variants = [("pipemare", label, opts) for label, opts in PIPEMARE_ABLATIONS.items()]
    if "i-timeprest" in algorithms():
        default_lam = pipecore.get_algorithm("i-timeprest", task.stages, task.microbatches).options["lam"]
        variants += [("i-timeprest", lam_label(lam), {} if lam == default_lam else {"lam": lam}) for lam in LAMBDAS]
    for algorithm, label, opts in variants:
        jobs += plan_variant(plan, task, seeds, algorithm, label, opts)
    return jobs


def plan_variant(plan: Plan, task: Task, seeds: Sequence[int], algorithm: str, label: str,
                 options: dict[str, Any]) -> list[Job]:
    """An algorithm with other options (setting ``ablation <label>``), if this pipecore has it and accepts them."""
    if algorithm not in algorithms():
        return []
    setting = f"ablation {label}"
    problem = accepted(task, algorithm, options)
    if problem:
        plan.skip(task, algorithm, setting, problem)
        return []
    return plan.add(task, algorithm, setting, seeds, task.lr, task.optimizer_options, options)


def plan_best(plan: Plan, tasks: Sequence[Task], seeds: Sequence[int], records: dict[tuple, dict]) -> list[Job]:
    """Each method's best grid point with the evaluation seeds (shared with the main runs when it is the
    task's own)."""
    jobs: list[Job] = []
    for task in tasks:
        if not task.grid:
            continue
        for method in methods(task):
            if plan.group(task, method) is None:  # skipped: the algorithm refuses the task's optimizer
                continue
            lr, opt_options = best_grid_point(plan, task, method, records)
            jobs += plan.add(task, method, BEST, seeds_for(task, method, seeds), lr, opt_options)
    return jobs


def best_grid_point(plan: Plan, task: Task, method: str, records: dict[tuple, dict]) -> tuple[float, Options]:
    """The grid point whose run scores best (first in grid order on a tie)."""
    def score(point: tuple[float, Options]) -> float:
        group = plan.groups[group_name(task.name, method, grid_setting(*point))]
        return selection_score(task, records[group.keys[0]])

    return max(task.grid, key=score)


def selection_score(task: Task, record: dict[str, Any]) -> float:
    """Mean test metric over the last 3 epochs, larger is better; a diverged or failed run scores -inf."""
    if record["diverged"] or record["error"] or not record["curve"]:
        return -math.inf
    value = statistics.fmean(c[task.metric] for c in record["curve"][-3:])
    return value if task.higher_is_better else -value


def seconds_per_step(task: Task, method: str) -> float:
    """One mini-batch of a method on a task, from ``SECONDS_PER_EPOCH`` (a GPT task of another size scaled by
    its tokens and width)."""
    name = task.name if task.name in SECONDS_PER_EPOCH else "gpt"
    sequential, pipeline = SECONDS_PER_EPOCH[name]
    per_epoch = sequential if is_sequential(method) else pipeline
    reference = TASKS[name]
    if task.model == "gpt":
        per_epoch *= _tokens(task) / _tokens(reference)
    return per_epoch / steps_per_epoch(reference)


def estimate_seconds(jobs: Iterable[Job]) -> float:
    """Worker-seconds the jobs take."""
    return sum(SECONDS_PER_RUN + seconds_per_step(j.task, j.method) * steps_per_epoch(j.task) * j.task.epochs
               for j in jobs)


def _tokens(task: Task) -> float:
    """A GPT task's work per step relative to its size: tokens x (layers x width^2)."""
    s = task.sizes
    return task.batch_size * s["block_size"] * s["layers"] * s["embd"] ** 2


def run_all(pool: Any, jobs: list[Job], desc: str) -> list[dict[str, Any]]:
    """Run ``jobs`` in the pool (longest first), with a progress bar; their records as they finish."""
    from tqdm import tqdm

    ordered = sorted(jobs, key=lambda j: -estimate_seconds([j]))
    out = []
    with tqdm(total=len(ordered), desc=desc, unit="run", file=sys.stderr, dynamic_ncols=True) as bar:
        for record in pool.imap_unordered(run_job, ordered, chunksize=1):
            out.append(record)
            if record["diverged"] or record["error"]:
                job = next(j for j in ordered if j.key == record["key"])
                bar.write(f"{job.task.name} {job.method} seed {job.seed}: "
                          f"{'diverged' if record['diverged'] else 'FAILED'}", file=sys.stderr)
            bar.update()
    return out
