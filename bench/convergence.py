"""Convergence study: which pipeline algorithm should I use?

    python bench/convergence.py [--quick] [--tasks mlp4,mlp8,resnet,gpt] [--seeds 3] [--workers 2]
                                [--out PATH]

Trains every pipecore algorithm (``pipecore.algorithm_names()``) and plain sequential training (plain torch,
no pipeline) on four tasks and records how well and how fast each converges. Every pipeline runs all its
stages in one process (pipecore's local executor), so what differs between algorithms is the mathematics of
their weight versions (staleness, stashing, prediction, corrections), not the speed of a real pipeline.

Tasks (hyper-parameters fixed per task, tuned for sequential training; see ``TASKS``):

* ``mlp4``: scikit-learn's digits (``pipecore.cli.tasks.load_data``; the split is fixed, seed 0), MLP
  64-96-96-96-10 (``build_mlp``, PyTorch's default init), 4 stages, 4 micro-batches, batch 64, SGD lr 0.05
  momentum 0.9, 15 epochs (sequential plateaus at about 96% from epoch 8). Metric: test accuracy; target 90%.
* ``mlp8``: the same data, MLP 64-96x7-10 with He (Kaiming-normal) init (with PyTorch's default init seven
  hidden layers sit at chance for about ten epochs), 8 stages, 8 micro-batches (2BW needs m >= P), batch 64,
  SGD lr 0.025 momentum 0.9 (sequential's best of 0.0125, 0.025, 0.05), 12 epochs. Test accuracy; target 90%.
* ``resnet``: ``pipecore.models.ResNet`` (width 16, 3 blocks) on the digits images, 4 stages, 4 micro-batches,
  batch 64, SGD lr 0.05 momentum 0.9, 8 epochs (sequential reaches about 98.5%). Test accuracy; target 95%
  (sequential passes 90% within 2 epochs, too soon to tell algorithms apart).
* ``gpt``: ``pipecore.models.GPT`` (4 layers, 4 heads, embedding 64, context 64) on
  ``pipecore.models.load_char_data``, 4 stages, 4 micro-batches, batch 32 windows, 6 epochs of 20 batches
  (120 steps a run, 3,600 for the task's 30 runs; sequential's held-out loss: 3.3 after one epoch, 2.35 after 6),
  AdamW lr 1e-3 (weight decay 0.01). Metric: held-out loss per character (lower is better) and perplexity,
  on 64 windows spread over the held-out text (``held_out_windows``). Target: the mean held-out loss that
  sequential training reaches halfway through its epochs (derived from this study's sequential runs).

Every (task, algorithm) runs with ``--seeds`` seeds (default 3; the seed fixes the initial weights and the
batch order); sequential training uses the same seeds. The learning rate is per mini-batch: an algorithm
that updates after every ``k`` of its ``m`` micro-batches gets ``lr * k / m`` per update (linear scaling, as
``pipecore train`` does), so that an epoch moves the weights as far as one sequential epoch. Sequential
training accumulates the same ``m`` micro-batches (``loss / m``, backward) before each optimizer step, so it
computes what gpipe does (BatchNorm statistics included). PipeMare's ``warmup_steps`` (that of any algorithm
with that option) is set to its updates in the first 5 epochs, as ``pipecore train`` does; every other option
is the algorithm's default.

Hyper-parameter grid (tasks with a ``grid``: ``mlp4`` and ``mlp8``): every algorithm and sequential runs
each (lr, momentum) of the grid once, with a seed of its own (``GRID_SEED``, not one of the evaluation seeds,
so the choice is not scored on the runs that report it). The best point (highest mean test accuracy over the
last 3 epochs; a diverged run is the worst) then runs with the evaluation seeds. The table reports each
algorithm both at sequential's hyper-parameters and at its own best.

Ablations (on ``mlp4``, ``mlp8`` and ``gpt``, evaluation seeds, sequential's hyper-parameters): PipeMare
without T1 (``lr_rescheduling=False``) and without T2 (``discrepancy_correction=False``); I-TiMePReSt with
``lam`` in {0, 0.5, 1, 2, inf}; SpecTrain beside PipeDream on every task (P=4 and P=8). An ablation whose
options this pipecore does not accept is skipped, said so on stderr, and listed under ``skipped`` in the JSON.

Recorded per run: training loss and test metric after every epoch (asynchronous algorithms are flushed at
the end of every epoch), the final metric, epochs and optimizer updates (per stage) to reach the target
(None if never), wall seconds (the whole run, in its worker), and weight-version bytes (summed over stages:
``weight_version_bytes + scratch_bytes + buffer_bytes`` of ``Pipeline.stats()``: every weight-sized buffer
the algorithm keeps; sequential: the model's parameter bytes).
A run whose loss becomes NaN or infinite (``pipecore.NonFiniteLoss``) is recorded as diverged, with its
curve up to then. A run that fails otherwise is recorded with its error, and the script exits with status 1
after writing everything.

Runs are independent and go to a pool of ``--workers`` (default 2) spawned processes, one torch thread each.

Outputs, next to ``--out``:

* ``--out`` (JSON): ``machine()``, the study's settings (tasks, hyper-parameters, seeds, targets, grid), every
  run's record, and per (task, algorithm, setting) aggregates: mean, std, min and max of the final metric,
  divergences, mean epochs and updates to target and how many seeds reached it, mean wall seconds,
  weight-version bytes; the chosen best grid point per (task, algorithm).
* ``convergence-<task>.png``: test metric and training loss against epoch, one line per algorithm at
  sequential's hyper-parameters (mean over seeds, min..max shaded).
* ``convergence.md``: the tables (also printed to stdout).

``--quick`` is a smoke check of a minute or two: 1 seed, 2 to 5 epochs, a 2-point grid on mlp4 only. The full
study (no flags) plans 334 runs, then up to 60 more at best grid points that differ from sequential's
hyper-parameters; on a 2-core Intel Xeon machine it ran 361 runs in 18 minutes (an estimate is printed at
the start; other load on the machine slows it down).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402
from torch import nn  # noqa: E402

import pipecore  # noqa: E402
from _machine import OUT_HELP, default_out, machine, write_report  # noqa: E402
from pipecore.cli._args import positive_int  # noqa: E402
from pipecore.cli.tasks import (  # noqa: E402
    WARMUP_EPOCHS, build_mlp, epoch_batches, evaluate, held_out_loss, held_out_windows, load_data,
    mlp_shape, sequence_loss, stage_partition,
)

SEQUENTIAL = "sequential"
#: The digits split is the same for every run; seeds change the initial weights and the batch order.
SPLIT_SEED = 0
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
#: The grid: learning rate per mini-batch x momentum.
GRID = tuple((lr, mom) for lr in (0.0125, 0.025, 0.05, 0.1) for mom in (0.0, 0.9))
#: Seconds per epoch of one run at the full study's sizes, for the time estimate printed at the start:
#: (sequential, a pipeline algorithm's typical). Measured on a 2-core machine with both workers busy (the
#: algorithms with an update per micro-batch, and mlp8's, vary up to 1.5x around these).
SECONDS_PER_EPOCH = {"mlp4": (0.08, 0.25), "mlp8": (0.25, 0.85), "resnet": (1.0, 1.4), "gpt": (2.5, 3.0)}
#: Seconds each run spends outside its epochs (building the pipeline, evaluation set-up).
SECONDS_PER_RUN = 0.4


# -- the study's description ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """One task: data, model, pipeline shape and the fixed hyper-parameters (tuned for sequential)."""

    name: str
    model: str  # "mlp", "resnet" or "gpt"
    sizes: dict[str, int]
    stages: int
    microbatches: int
    batch_size: int
    epochs: int
    optimizer: str  # "sgd" or "adamw"
    lr: float  # per mini-batch
    momentum: float | None = None  # SGD only
    weight_decay: float = 0.0  # AdamW's
    init: str = "default"  # "default" (PyTorch's) or "he" (Kaiming normal, zero biases; MLP only)
    steps_per_epoch: int | None = None  # gpt: batches of random windows per epoch
    target: float | None = None  # digits: test accuracy; gpt: None = derived from sequential
    grid: tuple[tuple[float, float], ...] = ()

    @property
    def metric(self) -> str:
        """The record key of the test metric."""
        return "test_loss" if self.model == "gpt" else "accuracy"

    @property
    def higher_is_better(self) -> bool:
        return self.model != "gpt"

    def describe(self) -> str:
        """One line: model, shape, hyper-parameters."""
        if self.model == "mlp":
            what = f"MLP {mlp_shape(64, self.sizes['hidden'], self.sizes['depth'], 10)} ({self.init} init) on digits"
        elif self.model == "resnet":
            what = f"ResNet width {self.sizes['width']}, {self.sizes['blocks']} blocks on digits"
        else:
            s = self.sizes
            what = (f"GPT {s['layers']} layers, {s['heads']} heads, embd {s['embd']}, context {s['block_size']} on "
                    f"Python's help texts ({self.steps_per_epoch} batches per epoch)")
        opt = (f"SGD lr {self.lr:g} momentum {self.momentum:g}" if self.optimizer == "sgd"
               else f"AdamW lr {self.lr:g} weight decay {self.weight_decay:g}")
        return (f"{what}; P={self.stages}, m={self.microbatches}, batch {self.batch_size}, {opt}, "
                f"{self.epochs} epochs")


TASKS: dict[str, Task] = {
    "mlp4": Task("mlp4", "mlp", {"hidden": 96, "depth": 3}, 4, 4, 64, 15, "sgd", 0.05, 0.9, target=0.9, grid=GRID),
    "mlp8": Task("mlp8", "mlp", {"hidden": 96, "depth": 7}, 8, 8, 64, 12, "sgd", 0.025, 0.9, init="he", target=0.9,
                 grid=GRID),
    "resnet": Task("resnet", "resnet", {"width": 16, "blocks": 3}, 4, 4, 64, 8, "sgd", 0.05, 0.9, target=0.95),
    "gpt": Task("gpt", "gpt", {"layers": 4, "heads": 4, "embd": 64, "block_size": 64, "eval_windows": 64}, 4, 4,
                32, 6, "adamw", 1e-3, weight_decay=0.01, steps_per_epoch=20),
}


def quick_tasks() -> dict[str, Task]:
    """``--quick``: fewer epochs, a 2-point grid on mlp4 only."""
    return {
        "mlp4": replace(TASKS["mlp4"], epochs=5, grid=((0.025, 0.9), (0.05, 0.9))),
        "mlp8": replace(TASKS["mlp8"], epochs=3, grid=()),
        "resnet": replace(TASKS["resnet"], epochs=2),
        "gpt": replace(TASKS["gpt"], epochs=2, steps_per_epoch=10),
    }


@dataclass(frozen=True)
class Job:
    """One training run: a task, an algorithm (or sequential), a seed and the hyper-parameters."""

    task: Task
    algorithm: str
    seed: int
    lr: float
    momentum: float | None
    options: tuple[tuple[str, Any], ...] = ()  # algorithm options, sorted by name

    @property
    def key(self) -> tuple:
        """Identical jobs (same run, bit for bit) share one key, so they run once."""
        return (self.task.name, self.algorithm, self.seed, self.lr, self.momentum, self.options)


@dataclass
class Group:
    """The runs of one (task, algorithm, setting): the same hyper-parameters over several seeds."""

    task: str
    algorithm: str
    setting: str
    lr: float
    momentum: float | None
    options: dict[str, Any]
    keys: list[tuple] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.task}|{self.algorithm}|{self.setting}"


# -- one run (in a worker process) -------------------------------------------------------------------


class Diverged(FloatingPointError):
    """The training loss or the test metric became NaN or infinite."""


_DATA: dict[str, Any] = {}


def _digits() -> Any:
    if "digits" not in _DATA:
        _DATA["digits"] = load_data(SPLIT_SEED)
    return _DATA["digits"]


def _text(task: Task) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The character corpus and its held-out evaluation windows (cached per worker)."""
    from pipecore.models import load_char_data

    key = ("text", task.sizes["block_size"], task.sizes["eval_windows"])
    if key not in _DATA:
        data = load_char_data(task.sizes["block_size"])
        x, y = held_out_windows(data.test, task.sizes["block_size"], task.sizes["eval_windows"])
        _DATA[key] = (data, x, y)
    return _DATA[key]


def build_model(task: Task) -> nn.Module:
    """The task's model, initialised from torch's current random state."""
    s = task.sizes
    if task.model == "mlp":
        model = build_mlp(64, s["hidden"], s["depth"], 10)
        if task.init == "he":
            for layer in model:
                if isinstance(layer, nn.Linear):
                    nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
                    nn.init.zeros_(layer.bias)
        return model
    if task.model == "resnet":
        from pipecore.models import ResNet

        return ResNet(in_channels=1, num_classes=10, width=s["width"], blocks=s["blocks"])
    from pipecore.models import GPT

    return GPT(_text(task)[0].vocab_size, s["block_size"], n_layer=s["layers"], n_head=s["heads"], n_embd=s["embd"])


def steps_per_epoch(task: Task) -> int:
    """Mini-batches per epoch (digits: full batches of the training split)."""
    if task.model == "gpt":
        return int(task.steps_per_epoch or 0)
    return len(_digits().y_train) // task.batch_size


def train_batches(task: Task, seed: int, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of ``epoch``, a function of ``(seed, epoch)`` alone (as ``pipecore train`` draws them)."""
    if task.model == "gpt":
        from pipecore.models import batches

        data = _text(task)[0]
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        for _ in range(steps_per_epoch(task)):
            yield batches(data.train, task.sizes["block_size"], task.batch_size, generator)
        return
    d = _digits()
    for idx in epoch_batches(len(d.y_train), task.batch_size, seed, epoch):
        yield d.x_train[idx], d.y_train[idx]


def test_metrics(task: Task, model: nn.Module) -> dict[str, float]:
    """Test accuracy (digits) or held-out loss and perplexity (gpt) of the live weights."""
    if task.model == "gpt":
        _, x, y = _text(task)
        loss = held_out_loss(model, x, y)
        if not math.isfinite(loss):
            raise Diverged(f"held-out loss {loss}")
        return {"test_loss": loss, "perplexity": math.exp(min(loss, 700.0))}
    d = _digits()
    return {"accuracy": evaluate(model, d.x_test, d.y_test)[0]}


def update_every(job: Job) -> int:
    """Micro-batches per optimizer update (sequential: the whole mini-batch)."""
    if job.algorithm == SEQUENTIAL:
        return job.task.microbatches
    task = job.task
    return pipecore.get_algorithm(job.algorithm, task.stages, task.microbatches, **dict(job.options)).update_every


class SequentialTrainer:
    """Plain torch: per micro-batch forward, ``loss / m``, backward; then one optimizer step."""

    def __init__(self, job: Job, model: nn.Module) -> None:
        task = job.task
        self.model, self.m = model, task.microbatches
        if task.optimizer == "sgd":
            momentum = job.momentum or 0.0
            self.opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=job.lr, momentum=momentum)
        else:
            self.opt = torch.optim.AdamW(model.parameters(), lr=job.lr, weight_decay=task.weight_decay)
        self.loss_fn = loss_function(task)
        self.updates = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        losses = []
        for xs, ys in zip(x.chunk(self.m), y.chunk(self.m)):
            loss = self.loss_fn(self.model(xs), ys)
            (loss / self.m).backward()
            losses.append(float(loss.detach()))
        self.opt.step()
        self.opt.zero_grad()
        self.updates += 1
        return statistics.fmean(losses)

    def flush(self) -> None:
        """Nothing is in flight."""

    def version_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


class PipelineTrainer:
    """A :class:`pipecore.Pipeline` of the job's algorithm (one process, all stages)."""

    def __init__(self, job: Job, model: nn.Module) -> None:
        task = job.task
        # Linear scaling: lr is per mini-batch; an update over k of the m micro-batches takes lr * k / m.
        lr = job.lr * update_every(job) / task.microbatches
        optimizer = (pipecore.SGD(lr=lr, momentum=job.momentum or 0.0) if task.optimizer == "sgd"
                     else pipecore.AdamW(lr=lr, weight_decay=task.weight_decay))
        partition = stage_partition(model, task.stages) if task.model == "mlp" else None
        self.pipe = pipecore.Pipeline(model, task.stages, job.algorithm, task.microbatches, optimizer=optimizer,
                                      loss_fn=loss_function(task), partition=partition, **dict(job.options))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return self.pipe.step(x, y)

    def flush(self) -> None:
        self.pipe.flush()

    @property
    def updates(self) -> int:
        """Optimizer updates per stage so far (every stage makes as many, once flushed)."""
        return max(st["live_version"] for st in self.pipe.stats())

    def version_bytes(self) -> int:
        return sum(st["weight_version_bytes"] + st["scratch_bytes"] + st["buffer_bytes"] for st in self.pipe.stats())


def loss_function(task: Task) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return sequence_loss if task.model == "gpt" else nn.CrossEntropyLoss()


def train_epoch(trainer: SequentialTrainer | PipelineTrainer, job: Job, epoch: int) -> float:
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
                              "weight_version_bytes": None, "train_s": 0.0}
    try:
        _train(job, record)
    except Diverged as error:
        record.update(diverged=True, diverged_epoch=len(record["curve"]) + 1, reason=str(error))
    except Exception:  # a bug, not a divergence: keep the study going, report it at the end
        record["error"] = traceback.format_exc()
    record["wall_s"] = time.perf_counter() - started
    return record


def _train(job: Job, record: dict[str, Any]) -> None:
    """Fill ``record``'s weight-version bytes, curve (one point per epoch) and training seconds as it goes."""
    every = update_every(job)
    record.update(update_every=every, lr_per_update=job.lr * every / job.task.microbatches,
                  updates_per_epoch=steps_per_epoch(job.task) * job.task.microbatches // every)
    torch.manual_seed(job.seed)
    model = build_model(job.task)
    trainer = SequentialTrainer(job, model) if job.algorithm == SEQUENTIAL else PipelineTrainer(job, model)
    record["weight_version_bytes"] = trainer.version_bytes()  # before any step: a diverged run reports it too
    for epoch in range(job.task.epochs):
        t0 = time.perf_counter()
        loss = train_epoch(trainer, job, epoch)
        record["train_s"] += time.perf_counter() - t0
        record["curve"].append({"epoch": epoch + 1, "loss": loss, "updates": trainer.updates,
                                **test_metrics(job.task, model)})


def _init_worker() -> None:
    """One thread; then a tiny pipeline and sequential step each, so that the first run's wall time does not
    include the worker's one-time costs (lazy imports, first graph capture, data loading)."""
    torch.set_num_threads(1)
    tiny = replace(TASKS["mlp4"], sizes={"hidden": 8, "depth": 3}, epochs=1)
    for method in (SEQUENTIAL, "1f1b"):
        trainer_type = SequentialTrainer if method == SEQUENTIAL else PipelineTrainer
        job = Job(tiny, method, 0, tiny.lr, tiny.momentum)
        trainer = trainer_type(job, build_model(tiny))
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


class Plan:
    """The groups of the study and the distinct jobs they need."""

    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}
        self.jobs: dict[tuple, Job] = {}
        self.skipped: list[dict[str, str]] = []

    def add(self, task: Task, algorithm: str, setting: str, seeds: Iterable[int], lr: float,
            momentum: float | None, options: dict[str, Any] | None = None) -> list[Job]:
        """A group of runs; returns the jobs not planned before (identical runs are shared between groups)."""
        opts = algorithm_options(task, algorithm, options) if algorithm != SEQUENTIAL else {}
        group = Group(task.name, algorithm, setting, lr, momentum, opts)
        new = []
        for seed in seeds:
            job = Job(task, algorithm, seed, lr, momentum, tuple(sorted(opts.items())))
            group.keys.append(job.key)
            if job.key not in self.jobs:
                self.jobs[job.key] = job
                new.append(job)
        self.groups[group.name] = group
        return new

    def skip(self, task: Task, algorithm: str, setting: str, reason: str) -> None:
        print(f"SKIPPED {task.name} {algorithm} {setting}: this pipecore does not accept it: {reason}",
              file=sys.stderr)
        self.skipped.append({"task": task.name, "algorithm": algorithm, "setting": setting, "reason": reason})


def methods() -> list[str]:
    """Sequential, then every pipecore algorithm."""
    return [SEQUENTIAL] + pipecore.algorithm_names()


def plan_first_phase(plan: Plan, tasks: Sequence[Task], seeds: Sequence[int]) -> list[Job]:
    """Every method at sequential's hyper-parameters, the grid, and the ablations."""
    jobs: list[Job] = []
    for task in tasks:
        for method in methods():
            jobs += plan.add(task, method, AT_SEQUENTIAL, seeds, task.lr, task.momentum)
            for lr, momentum in task.grid:
                jobs += plan.add(task, method, grid_setting(lr, momentum), [GRID_SEED], lr, momentum)
        if task.name in ABLATION_TASKS:
            jobs += plan_ablations(plan, task, seeds)
    return jobs


def grid_setting(lr: float, momentum: float) -> str:
    return f"grid lr={lr:g} momentum={momentum:g}"


def lam_label(lam: float) -> str:
    return f"lam={'inf' if math.isinf(lam) else f'{lam:g}'}"


def plan_ablations(plan: Plan, task: Task, seeds: Sequence[int]) -> list[Job]:
    """PipeMare without T1 / T2; I-TiMePReSt over ``LAMBDAS`` (its default lam shares the main runs)."""
    jobs: list[Job] = []
    variants = [("pipemare", label, opts) for label, opts in PIPEMARE_ABLATIONS.items()]
    default_lam = pipecore.get_algorithm("i-timeprest", task.stages, task.microbatches).options["lam"]
    variants += [("i-timeprest", lam_label(lam), {} if lam == default_lam else {"lam": lam}) for lam in LAMBDAS]
    for algorithm, label, opts in variants:
        setting = f"ablation {label}"
        problem = accepted(task, algorithm, opts)
        if problem:
            plan.skip(task, algorithm, setting, problem)
            continue
        jobs += plan.add(task, algorithm, setting, seeds, task.lr, task.momentum, opts)
    return jobs


def plan_best(plan: Plan, tasks: Sequence[Task], seeds: Sequence[int], records: dict[tuple, dict]) -> list[Job]:
    """Each method's best grid point with the evaluation seeds (shared with the main runs when it is sequential's)."""
    jobs: list[Job] = []
    for task in tasks:
        if not task.grid:
            continue
        for method in methods():
            lr, momentum = best_grid_point(plan, task, method, records)
            jobs += plan.add(task, method, BEST, seeds, lr, momentum)
    return jobs


def best_grid_point(plan: Plan, task: Task, method: str, records: dict[tuple, dict]) -> tuple[float, float]:
    """The grid point whose run scores best (first in grid order on a tie)."""
    def score(point: tuple[float, float]) -> float:
        group = plan.groups[f"{task.name}|{method}|{grid_setting(*point)}"]
        return selection_score(task, records[group.keys[0]])

    return max(task.grid, key=score)


def selection_score(task: Task, record: dict[str, Any]) -> float:
    """Mean test metric over the last 3 epochs, larger is better; a diverged or failed run scores -inf."""
    if record["diverged"] or record["error"] or not record["curve"]:
        return -math.inf
    value = statistics.fmean(c[task.metric] for c in record["curve"][-3:])
    return value if task.higher_is_better else -value


def estimate_seconds(jobs: Iterable[Job]) -> float:
    """Worker-seconds the jobs take, from ``SECONDS_PER_EPOCH`` (scaled by GPT batches per epoch)."""
    total = 0.0
    for job in jobs:
        sequential, pipeline = SECONDS_PER_EPOCH[job.task.name]
        per_epoch = sequential if job.algorithm == SEQUENTIAL else pipeline
        if job.task.model == "gpt":
            per_epoch *= steps_per_epoch(job.task) / TASKS["gpt"].steps_per_epoch
        total += SECONDS_PER_RUN + per_epoch * job.task.epochs
    return total


def run_all(pool: Any, jobs: list[Job], desc: str) -> list[dict[str, Any]]:
    """Run ``jobs`` in the pool (longest first), with a progress bar; their records as they finish."""
    from tqdm import tqdm

    ordered = sorted(jobs, key=lambda j: -estimate_seconds([j]))
    out = []
    with tqdm(total=len(ordered), desc=desc, unit="run", file=sys.stderr, dynamic_ncols=True) as bar:
        for record in pool.imap_unordered(run_job, ordered, chunksize=1):
            out.append(record)
            if record["diverged"] or record["error"]:
                task, algorithm, seed = record["key"][:3]
                bar.write(f"{task} {algorithm} seed {seed}: "
                          f"{'diverged' if record['diverged'] else 'FAILED'}", file=sys.stderr)
            bar.update()
    return out


# -- results ------------------------------------------------------------------------------------------


def apply_targets(tasks: Sequence[Task], plan: Plan, records: dict[tuple, dict]) -> dict[str, dict[str, Any]]:
    """Each task's target (GPT: derived from sequential's curves) and every record's epochs/updates to it."""
    by_name = {task.name: task for task in tasks}
    targets = {task.name: task_target(task, plan, records) for task in tasks}
    for key, record in records.items():
        task, target = by_name[key[0]], targets[key[0]]["value"]
        hit = None if target is None else next((c for c in record["curve"] if reached(task, c, target)), None)
        record["epochs_to_target"] = None if hit is None else hit["epoch"]
        record["updates_to_target"] = None if hit is None else hit["updates"]
    return targets


def reached(task: Task, point: dict[str, float], target: float) -> bool:
    value = point[task.metric]
    return value >= target if task.higher_is_better else value <= target


def task_target(task: Task, plan: Plan, records: dict[tuple, dict]) -> dict[str, Any]:
    """A fixed target, or (GPT) the mean held-out loss of sequential's seeds halfway through training."""
    if task.target is not None:
        return {"value": task.target, "metric": task.metric, "rule": f"fixed: test accuracy >= {task.target:.0%}"}
    half = math.ceil(task.epochs / 2)
    curves = [records[k]["curve"] for k in plan.groups[f"{task.name}|{SEQUENTIAL}|{AT_SEQUENTIAL}"].keys]
    values = [c[half - 1][task.metric] for c in curves if len(c) >= half]
    return {"value": statistics.fmean(values) if values else None, "metric": task.metric,
            "rule": f"held-out loss <= the mean of sequential's seeds after epoch {half} of {task.epochs}"}


def summary(values: list[float]) -> dict[str, float | None]:
    """Mean, std (sample; 0 for one value), min and max; None when empty."""
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None}
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": std, "min": min(values), "max": max(values)}


def aggregate(task: Task, group: Group, records: dict[tuple, dict]) -> dict[str, Any]:
    """Per group: final metric statistics over the seeds that neither diverged nor failed, divergences, time
    to target over the seeds that reached it, wall time, weight-version bytes."""
    runs = [records[k] for k in group.keys]
    done = [r for r in runs if not r["diverged"] and not r["error"]]
    hit = [r for r in done if r["epochs_to_target"] is not None]
    out: dict[str, Any] = {
        "seeds": len(runs), "diverged": sum(r["diverged"] for r in runs), "failed": sum(bool(r["error"]) for r in runs),
        "final": summary([r["curve"][-1][task.metric] for r in done]),
        "reached_target": len(hit),
        "epochs_to_target": statistics.fmean(r["epochs_to_target"] for r in hit) if hit else None,
        "updates_to_target": statistics.fmean(r["updates_to_target"] for r in hit) if hit else None,
        "wall_s": statistics.fmean(r["wall_s"] for r in runs),
        "weight_version_bytes": max((r.get("weight_version_bytes") or 0) for r in runs) or None,
    }
    if task.model == "gpt":
        out["final_perplexity"] = summary([r["curve"][-1]["perplexity"] for r in done])
    return out


def jsonable(value: Any) -> Any:
    """Infinite floats as the strings "inf"/"-inf" (JSON has no infinity), tuples as lists, recursively."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def run_record(job: Job, record: dict[str, Any]) -> dict[str, Any]:
    """A record with its job's settings spelled out."""
    rest = {k: v for k, v in record.items() if k != "key"}
    return {"task": job.task.name, "algorithm": job.algorithm, "seed": job.seed, "lr": job.lr,
            "momentum": job.momentum, "options": dict(job.options), **rest}


def build_report(tasks: Sequence[Task], seeds: Sequence[int], plan: Plan, records: dict[tuple, dict],
                 targets: dict[str, dict], quick: bool, workers: int, elapsed: float) -> dict[str, Any]:
    """The JSON result: machine, settings, skipped ablations, per-group aggregates (``runs``: indices into the
    report's ``runs``), the best grid point per (task, method), and every run's record."""
    by_name = {task.name: task for task in tasks}
    index = {key: i for i, key in enumerate(plan.jobs)}
    groups = []
    for group in plan.groups.values():
        groups.append({"task": group.task, "algorithm": group.algorithm, "setting": group.setting, "lr": group.lr,
                       "momentum": group.momentum, "options": group.options, "runs": [index[k] for k in group.keys],
                       **aggregate(by_name[group.task], group, records)})
    best = {f"{t.name}|{m}": {"lr": plan.groups[f"{t.name}|{m}|{BEST}"].lr,
                               "momentum": plan.groups[f"{t.name}|{m}|{BEST}"].momentum}
            for t in tasks if t.grid for m in methods()}
    return jsonable({
        "benchmark": "convergence", "device": "cpu", "dtype": "float32", "machine": machine(),
        "settings": {
            "quick": quick, "workers": workers, "threads_per_worker": 1, "seeds": list(seeds), "grid_seed": GRID_SEED,
            "digits_split_seed": SPLIT_SEED, "tasks": {t.name: {**asdict(t), "description": t.describe(),
                                                               "steps_per_epoch": steps_per_epoch(t)}
                                                      for t in tasks},
            "targets": targets, "methods": methods(),
            "lr_rule": "lr is per mini-batch; an update over k of m micro-batches uses lr * k / m",
            "warmup": f"algorithms with a warmup_steps option (PipeMare): its updates in the first {WARMUP_EPOCHS} "
                      "epochs",
            "grid_selection": "highest mean test metric over the last 3 epochs of the grid seed's run",
            "ablation_tasks": [t for t in ABLATION_TASKS if t in by_name],
        },
        "skipped": plan.skipped, "wall_s": elapsed, "best_grid_point": best, "groups": groups,
        "runs": [run_record(job, records[key]) for key, job in plan.jobs.items()],
    })

# -- tables ---------------------------------------------------------------------------------------------


def fmt_metric(task: Task, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if task.higher_is_better else f"{value:.3f}"


def fmt_final(task: Task, agg: dict[str, Any]) -> str:
    """``mean ± std [min, max]`` of the final metric, with divergences and failures."""
    final, n = agg["final"], agg["seeds"]
    lost = []
    if agg["diverged"]:
        lost.append(f"{agg['diverged']}/{n} diverged")
    if agg["failed"]:
        lost.append(f"{agg['failed']}/{n} FAILED")
    if final["mean"] is None:
        return ", ".join(lost)
    text = fmt_metric(task, final["mean"])
    if n > 1:
        spread = f"{100 * final['std']:.1f}" if task.higher_is_better else f"{final['std']:.3f}"
        text += f" ± {spread} [{fmt_metric(task, final['min'])}, {fmt_metric(task, final['max'])}]"
    if task.model == "gpt":
        text += f" (ppl {agg['final_perplexity']['mean']:.2f})"
    return text + (f" ({', '.join(lost)})" if lost else "")


def fmt_to_target(agg: dict[str, Any]) -> tuple[str, str]:
    """Mean epochs and updates to target over the seeds that reached it, and how many did."""
    if agg["epochs_to_target"] is None:
        return f"never (0/{agg['seeds']})", "-"
    return (f"{agg['epochs_to_target']:.1f} ({agg['reached_target']}/{agg['seeds']})",
            f"{agg['updates_to_target']:.0f}")


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def aggregates_by_group(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f"{g['task']}|{g['algorithm']}|{g['setting']}": g for g in report["groups"]}


def task_table(task: Task, groups: dict[str, dict[str, Any]], target: dict[str, Any]) -> str:
    """Every method at sequential's hyper-parameters, its best grid point (if a grid ran), time and memory."""
    rows = []
    for method in methods():
        agg = groups[f"{task.name}|{method}|{AT_SEQUENTIAL}"]
        epochs, updates = fmt_to_target(agg)
        best = groups.get(f"{task.name}|{method}|{BEST}")
        point = "-" if best is None else f"lr {best['lr']:g}, momentum {best['momentum']:g}"
        rows.append([method, fmt_final(task, agg), epochs, updates, point,
                     "-" if best is None else fmt_final(task, best), f"{agg['wall_s']:.1f}",
                     f"{agg['weight_version_bytes']:,}" if agg["weight_version_bytes"] else "-"])
    goal = fmt_metric(task, target["value"])
    header = ["algorithm", f"final {'test accuracy' if task.higher_is_better else 'held-out loss'} (sequential's "
              "hyper-parameters)", f"epochs to {goal}", "updates to target", "best grid point", "final at best",
              "wall s", "weight-version bytes"]
    return (f"### {task.name}: {task.describe()}\n\nTarget: {target['rule']} ({goal}). Final: mean ± std "
            f"[min, max] over seeds; epochs and updates (per stage) to target: mean over the seeds that reached "
            f"it.\n\n{markdown(header, rows)}")


def ablation_rows(task: Task, groups: dict[str, dict[str, Any]], names: Sequence[tuple[str, str]]) -> list[list[str]]:
    rows = []
    for label, key in names:
        agg = groups.get(key)
        if agg is None:
            rows.append([label, "skipped: options not accepted (see below)", "-", "-"])
            continue
        rows.append([label, fmt_final(task, agg), *fmt_to_target(agg)])
    return rows


def ablation_tables(tasks: Sequence[Task], groups: dict[str, dict[str, Any]]) -> list[str]:
    """PipeMare without T1 / T2 and I-TiMePReSt over lam, per ablation task."""
    out = []
    header = ["variant", "final", "epochs to target", "updates to target"]
    for task in (t for t in tasks if t.name in ABLATION_TASKS):
        pm = [("PipeMare (T1 + T2)", f"{task.name}|pipemare|{AT_SEQUENTIAL}")]
        pm += [(f"PipeMare {label}", f"{task.name}|pipemare|ablation {label}") for label in PIPEMARE_ABLATIONS]
        out.append(f"### Ablation: PipeMare on {task.name} (P={task.stages})\n\n"
                   f"{markdown(header, ablation_rows(task, groups, pm))}")
        default_lam = pipecore.get_algorithm("i-timeprest", task.stages, task.microbatches).options["lam"]
        lams = [(lam_label(lam) + (" (default)" if lam == default_lam else ""),
                 f"{task.name}|i-timeprest|ablation {lam_label(lam)}") for lam in LAMBDAS]
        out.append(f"### Ablation: I-TiMePReSt lam on {task.name} (P={task.stages}; alpha(d) = exp(-lam*d): "
                   f"0 reads the stash, inf the live weights)\n\n{markdown(header, ablation_rows(task, groups, lams))}")
    return out


def spectrain_table(tasks: Sequence[Task], groups: dict[str, dict[str, Any]]) -> str | None:
    """SpecTrain beside PipeDream on every task (P=4 and P=8)."""
    rows = []
    for task in tasks:
        for method in ("pipedream", "spectrain"):
            agg = groups[f"{task.name}|{method}|{AT_SEQUENTIAL}"]
            best = groups.get(f"{task.name}|{method}|{BEST}")
            rows.append([task.name, str(task.stages), method, fmt_final(task, agg), fmt_to_target(agg)[0],
                         "-" if best is None else f"lr {best['lr']:g}, momentum {best['momentum']:g}",
                         "-" if best is None else fmt_final(task, best)])
    if not rows:
        return None
    header = ["task", "P", "algorithm", "final (sequential's hyper-parameters)", "epochs to target",
              "best grid point", "final at best"]
    return f"### SpecTrain vs PipeDream\n\n{markdown(header, rows)}"


def all_tables(tasks: Sequence[Task], report: dict[str, Any]) -> str:
    groups = aggregates_by_group(report)
    parts = [f"## Convergence study ({'quick' if report['settings']['quick'] else 'full'}; seeds "
             f"{report['settings']['seeds']}; {report['wall_s'] / 60:.1f} min on {report['settings']['workers']} "
             f"workers)"]
    parts += [task_table(task, groups, report["settings"]["targets"][task.name]) for task in tasks]
    parts += ablation_tables(tasks, groups)
    pair = spectrain_table(tasks, groups)
    if pair:
        parts.append(pair)
    if report["skipped"]:
        parts.append("Skipped (options this pipecore does not accept):\n\n" + "\n".join(
            f"* {s['task']} {s['algorithm']} {s['setting']}: {s['reason']}" for s in report["skipped"]))
    return "\n\n".join(parts) + "\n"


# -- plots ----------------------------------------------------------------------------------------------


def plot_task(task: Task, plan: Plan, records: dict[tuple, dict], target: float | None, path: Path) -> None:
    """Test metric and training loss per epoch, one line per method (mean over seeds, min..max shaded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_metric, ax_loss) = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.get_cmap("tab10")
    for i, method in enumerate(methods()):
        curves = [records[k]["curve"] for k in plan.groups[f"{task.name}|{method}|{AT_SEQUENTIAL}"].keys]
        style = {"color": "black", "linewidth": 2.5, "linestyle": "--"} if method == SEQUENTIAL else \
            {"color": colors(i - 1), "linewidth": 1.4}
        scale = 100 if task.higher_is_better else 1
        for ax, key, factor in ((ax_metric, task.metric, scale), (ax_loss, "loss", 1)):
            plot_spread(ax, curves, key, factor, method, style)
    if target is not None:
        ax_metric.axhline(target * (100 if task.higher_is_better else 1), color="grey", linewidth=0.8,
                          linestyle=":", label="target")
    label = "test accuracy (%)" if task.higher_is_better else "held-out loss per character"
    ax_metric.set(xlabel="epoch", ylabel=label, title=f"{label} (mean over seeds, min..max shaded)")
    # Cross entropy per character spans a narrow range: a linear axis reads better there.
    ax_loss.set(xlabel="epoch", ylabel="training loss (epoch mean)", title="training loss",
                yscale="log" if task.higher_is_better else "linear")
    for ax in (ax_metric, ax_loss):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_metric.legend(fontsize=8, ncol=2, loc="best")
    fig.suptitle(f"{task.name}: {task.describe()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_spread(ax: Any, curves: list[list[dict]], key: str, factor: float, label: str, style: dict) -> None:
    """Mean over the curves that reached each epoch, and their min..max."""
    longest = max((len(c) for c in curves), default=0)
    if not longest:
        return
    epochs = list(range(1, longest + 1))
    values = [[factor * c[e - 1][key] for c in curves if len(c) >= e] for e in epochs]
    ax.plot(epochs, [statistics.fmean(v) for v in values], label=label, **style)
    ax.fill_between(epochs, [min(v) for v in values], [max(v) for v in values], color=style["color"], alpha=0.12)


# -- the command -----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke check in a minute or two: 1 seed, 2-5 epochs, 2-point grid on mlp4 only")
    parser.add_argument("--tasks", default=",".join(TASKS),
                        help=f"comma-separated, from {','.join(TASKS)} (default all)")
    parser.add_argument("--seeds", type=positive_int, help="evaluation seeds 0..N-1 (default 3; --quick: 1)")
    parser.add_argument("--workers", type=positive_int, default=2, help="worker processes, one thread each (default 2)")
    parser.add_argument("--out", default=default_out("convergence-cpu.json"),
                        help=f"{OUT_HELP}; the PNGs and convergence.md go next to it")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.tasks.split(",") if n.strip()]
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        parser.error(f"--tasks: unknown task(s) {unknown}; choose from {', '.join(TASKS)}" if unknown
                     else "--tasks: give at least one task")
    args.tasks = list(dict.fromkeys(names))
    args.seeds = args.seeds or (1 if args.quick else 3)
    if not args.out.endswith(".json"):
        parser.error(f"--out must name a .json file, got {args.out!r}")
    return args


def write_outputs(tasks: Sequence[Task], plan: Plan, records: dict[tuple, dict], report: dict[str, Any],
                  out: Path) -> str:
    """The JSON, one PNG per task and the markdown tables; returns the tables."""
    written = [write_report(report, out)]
    for task in tasks:
        path = out.parent / f"convergence-{task.name}.png"
        plot_task(task, plan, records, report["settings"]["targets"][task.name]["value"], path)
        written.append(path)
    tables = all_tables(tasks, report)
    md = out.parent / "convergence.md"
    md.write_text(tables)
    written.append(md)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return tables


def announce(tasks: Sequence[Task], seeds: Sequence[int], first: list[Job], workers: int) -> None:
    """The study's size and its estimated duration."""
    later = [Job(t, m, s, t.lr, t.momentum) for t in tasks if t.grid for m in methods() for s in seeds]
    first_min = estimate_seconds(first) / workers / 60
    later_min = estimate_seconds(later) / workers / 60
    print(f"{len(first)} runs on {workers} workers ({', '.join(t.name for t in tasks)}; seeds {list(seeds)}): "
          f"estimated {first_min:.1f} min, then up to {len(later)} runs at best grid points (at most "
          f"{later_min:.1f} min more; fewer where the best is sequential's hyper-parameters)", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SystemExit(f"--out: cannot create {out.parent}: {error.strerror or error}") from None
    catalogue = quick_tasks() if args.quick else TASKS
    tasks = [catalogue[name] for name in args.tasks]
    seeds = list(range(args.seeds))
    plan = Plan()
    first = plan_first_phase(plan, tasks, seeds)
    announce(tasks, seeds, first, args.workers)
    started = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(args.workers, initializer=_init_worker) as pool:
        records = {r["key"]: r for r in run_all(pool, first, "runs")}
        second = plan_best(plan, tasks, seeds, records)
        if second:
            records.update((r["key"], r) for r in run_all(pool, second, "best grid points"))
    targets = apply_targets(tasks, plan, records)
    report = build_report(tasks, seeds, plan, records, targets, args.quick, args.workers,
                          time.perf_counter() - started)
    print(write_outputs(tasks, plan, records, report, out))
    failed = [r for r in report["runs"] if r["error"]]
    for r in failed:
        print(f"FAILED {r['task']} {r['algorithm']} seed {r['seed']} lr {r['lr']} momentum {r['momentum']} "
              f"options {r['options']}:\n{r['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
