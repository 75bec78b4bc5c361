"""Convergence study: which pipeline algorithm should I use?

    python bench/convergence.py [--quick] [--tasks mlp4,mlp8,resnet,gpt,gpt-large] [--seeds 3] [--workers 2]
                                [--optimizer TASK=NAME] [--costs PATH] [--out PATH]
    python bench/convergence.py --calibrate TASK [--epochs N]     # how many steps a task needs (see below)

Trains every pipecore algorithm (``pipecore.algorithm_names()``: new algorithms join without a change here)
and sequential training on a set of tasks, and records how well and how fast each converges.

Fairness. Every algorithm is compared with sequential training that uses the same optimizer and the same
update frequency: its *matched baseline*, ``sequential/k`` with ``k`` the configured algorithm's
``update_every`` (``pipecore.get_algorithm(...).update_every``: an update per micro-batch for pipedream,
pipemare and spectrain, per mini-batch for gpipe, 1f1b, 2bw and the TiMePReSt family). Sequential training is
the whole model as one pipecore stage (``ONE_STAGE_ALGORITHM``), fed ``k`` micro-batches per update, with the
same pipecore optimizer object as the pipelines, so that nothing but the pipeline's staleness differs. Every
algorithm's gap to its matched baseline is reported (mean over the seeds both ran, with the per-seed range),
and its gap to the best sequential configuration overall (any update frequency; on a task with a grid, at its
best point too). The learning rate is per mini-batch: an update over ``k`` of the ``m`` micro-batches takes
``lr * k / m`` (linear scaling, as ``pipecore train`` does), for the algorithms and their baselines alike.

Tasks (``convergence_tasks.TASKS``; hyper-parameters fixed per task, tuned for sequential training):

* ``mlp4``, ``mlp8``, ``resnet``: scikit-learn's digits (fixed split), test accuracy; SGD with momentum; a small
  lr x momentum grid on the MLPs (every method runs each point once with a seed of its own, ``GRID_SEED``;
  its best point then runs with the evaluation seeds).
* ``gpt``: ``pipecore.models.GPT`` (4 layers, width 64, context 64) on ``pipecore.models.load_char_data``,
  P=4, m=4, batch 32, AdamW lr 1e-3, 6 evaluations of 20 steps; target: sequential's held-out loss halfway.
* ``gpt-large`` (= ``gpt-large-p4`` and ``gpt-large-p8``): GPT 6 layers, width 128, 4 heads, context 64, batch
  16 in m=8 micro-batches, AdamW lr 1e-3 (weight decay 0.01), 16 evaluations of 50 steps (800 steps: where
  sequential training's held-out loss flattens, chosen with ``--calibrate``), P=4 and P=8. Both share their
  sequential runs (which do not depend on P), so they share the target: sequential's (update per mini-batch)
  mean final held-out loss plus 2%. The synchronous algorithms, which compute their baseline's updates up to
  rounding (``Task.exact_seeds``), run one seed there; the asynchronous ones three.

Time to quality (``convergence_ttq``): every run records each stage's median forward, backward and update
time (``Pipeline.stats()``'s ``seconds_per_action``; one thread runs the stages in turn, so an action's time is
its own compute). ``pipecore.simulate`` runs each method's schedule with those costs, one device per rank, and
its steady state is the predicted step of a real pipeline; times the steps the method needed to reach the
task's target, that is its predicted time to quality. A table per task names the method that gets there first,
and a plot draws the test metric against predicted wall time. ``--costs PATH`` adds the same for costs measured
elsewhere (a GPU), as does any ``bench/results/gpu-*.json`` with a ``convergence_costs`` section.

``--calibrate TASK`` runs sequential training (update per mini-batch, seed 0) for ``--epochs`` evaluations and
prints its held-out loss curve and the first evaluation after which it improved by less than
``FLAT_TOLERANCE`` (relative) over ``FLAT_WINDOW`` evaluations: the number of epochs a task is trained for.

Ablations (``mlp4``, ``mlp8``, ``gpt``): PipeMare without T1 / T2, I-TiMePReSt over ``lam``. On every task:
pipedream-dc's adaptive variant beside its constant ``lam``, and a table of the staleness corrections
(spectrain, pipedream-dc, nesterov-async) beside PipeDream. An ablation whose options this pipecore does not
accept, and an algorithm that refuses a task's optimizer (nesterov-async takes its look-ahead from the
optimizer's momentum: not AdamW; the ``gpt-nadam`` tasks train with NAdam), is skipped and listed.

``--optimizer TASK=NAME`` trains a task with another pipecore optimizer (``getattr(pipecore, NAME)``, e.g.
``gpt-large=NAdam``; a clear error if this pipecore lacks it), keeping the options it accepts.

Recorded per run: training loss and test metric at every evaluation (asynchronous algorithms are flushed
first), the step, updates, weight-version bytes (``weight_version_bytes + scratch_bytes + buffer_bytes``),
the stages' costs, wall seconds; a NaN or infinite loss makes a run *diverged* (its curve kept up to then); any
other failure is recorded with its error and the script exits with status 1 after writing everything.
Runs are independent and go to a pool of ``--workers`` (default 2) spawned processes, one torch thread each.

Outputs, next to ``--out`` (default ``bench/out/convergence-cpu.json``): the JSON (machine, settings, every
run, per-group aggregates with gaps, time-to-quality rows), ``convergence.md`` (the tables, also printed),
``convergence-<task>.png`` (metric and loss per epoch) and ``convergence-ttq-<task>.png`` (metric against
predicted wall time).

``--quick`` is a smoke check of a few minutes: 1 seed, 2 to 5 epochs, tiny GPT-large. The full study prints
its estimated duration at the start (see ``docs/convergence.md`` for the last measured one).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the study's modules, when imported from elsewhere

import pipecore  # noqa: E402
from _machine import OUT_HELP, RESULTS, default_out, machine, write_report  # noqa: E402
from pipecore.cli._args import positive_int  # noqa: E402
from pipecore.cli.tasks import WARMUP_EPOCHS  # noqa: E402

from convergence_report import (  # noqa: E402
    ablation_tables, add_gaps, aggregate, aggregates_by_group, corrections_table, plot_task, task_table,
    task_target,
)
from convergence_runs import (  # noqa: E402
    AT_SEQUENTIAL, BEST, GRID_SEED, ONE_STAGE_ALGORITHM, Job, Plan, estimate_seconds, init_worker, is_exact,
    is_sequential, methods, plan_best, plan_first_phase, run_all, run_job, seconds_per_step, sequential_method,
)
from convergence_tasks import (  # noqa: E402
    SPLIT_SEED, TASK_FAMILIES, TASKS, Task, check_optimizer, quick_tasks, steps_per_epoch, with_optimizer,
)
from convergence_ttq import (  # noqa: E402
    COST_ROUNDS, COST_STEPS, COST_WARMUP_STEPS, combine_costs, load_cost_sources, measure_costs, plan_cost_jobs,
    plot_ttq, time_to_quality, ttq_table,
)

#: ``--calibrate``: the loss is flat once it improved by less than this fraction over FLAT_WINDOW evaluations.
FLAT_TOLERANCE = 0.01
FLAT_WINDOW = 4


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
    return {"task": job.task.name, "algorithm": job.method, "seed": job.seed, "lr": job.lr,
            "optimizer_options": dict(job.optimizer_options), "options": dict(job.options), **rest}


def build_report(tasks: Sequence[Task], seeds: Sequence[int], plan: Plan, records: dict[tuple, dict],
                 args: argparse.Namespace, elapsed: float, cost_sources: Sequence[dict],
                 cost_errors: Sequence[dict]) -> dict[str, Any]:
    """The JSON result: machine, settings, skipped ablations, per-group aggregates (``runs``: indices into the
    report's ``runs``) with their gaps, this machine's stage costs (``convergence_costs``, the section a cost
    file has), time to quality per cost source, and every run's record."""
    by_name = {task.name: task for task in tasks}
    targets = {task.name: task_target(task, plan, records) for task in tasks}
    index = {key: i for i, key in enumerate(plan.jobs)}
    groups = {}
    for group in plan.groups.values():
        task = by_name[group.task]
        groups[group.name] = {
            "task": group.task, "algorithm": group.method, "setting": group.setting, "lr": group.lr,
            "optimizer_options": group.optimizer_options, "options": group.options,
            "exact": not is_sequential(group.method) and is_exact(task, group.method, group.options),
            "runs": [index[k] for k in group.keys],
            **aggregate(task, group, records, targets[group.task]["value"])}
    for task in tasks:
        add_gaps(task, groups)
    ttq = time_to_quality(tasks, groups, targets, cost_sources, AT_SEQUENTIAL)
    best = {f"{g.task}|{g.method}": {"lr": g.lr, "optimizer_options": g.optimizer_options}
            for g in plan.groups.values() if g.setting == BEST}
    return jsonable({
        "benchmark": "convergence", "device": "cpu", "dtype": "float32", "machine": machine(),
        "settings": {
            "quick": args.quick, "epochs": args.epochs, "constant_lr": args.constant_lr, "workers": args.workers,
            "threads_per_worker": 1, "seeds": list(seeds), "grid_seed": GRID_SEED,
            "digits_split_seed": SPLIT_SEED, "algorithms": pipecore.algorithm_names(),
            "tasks": {t.name: {**asdict(t), "description": t.describe(), "steps_per_epoch": steps_per_epoch(t),
                               "methods": methods(t)} for t in tasks},
            "targets": targets, "sequential": f"one pipecore stage ({ONE_STAGE_ALGORITHM}), k micro-batches per update",
            "lr_rule": "lr is per mini-batch; an update over k of m micro-batches uses lr * k / m",
            "warmup": f"algorithms with a warmup_steps option (PipeMare): its updates in the first {WARMUP_EPOCHS} "
                      "epochs",
            "grid_selection": "highest mean test metric over the last 3 epochs of the grid seed's run",
            "cost_sources": [s["path"] for s in cost_sources[1:]],
        },
        "skipped": plan.skipped, "wall_s": elapsed, "best_grid_point": best, "groups": list(groups.values()),
        "convergence_costs": {k: cost_sources[0][k] for k in ("device", "rounds", "steps", "tasks")},
        "cost_errors": list(cost_errors), "time_to_quality": ttq,
        "runs": [run_record(job, records[key]) for key, job in plan.jobs.items()],
    })


def all_tables(tasks: Sequence[Task], report: dict[str, Any]) -> str:
    groups = aggregates_by_group(report)
    targets = report["settings"]["targets"]
    kind = "quick" if report["settings"]["quick"] else "partial" if report["settings"]["epochs"] else "full"
    parts = [f"## Convergence study ({kind}; seeds "
             f"{report['settings']['seeds']}; {report['wall_s'] / 60:.1f} min on {report['settings']['workers']} "
             f"workers)"]
    parts += [task_table(task, groups, targets[task.name]) for task in tasks]
    by_name = {t.name: t for t in tasks}
    parts += [ttq_table(by_name[e["task"]], e, targets[e["task"]]) for e in report["time_to_quality"]]
    parts += ablation_tables(tasks, groups)
    corrections = corrections_table(tasks, groups)
    if corrections:
        parts.append(corrections)
    if report["skipped"]:
        parts.append("Skipped (options or an optimizer the algorithm does not accept):\n\n" + "\n".join(
            f"* {s['task']} {s['algorithm']} {s['setting']}: {s['reason']}" for s in report["skipped"]))
    return "\n\n".join(parts) + "\n"


def write_outputs(tasks: Sequence[Task], plan: Plan, records: dict[tuple, dict], report: dict[str, Any],
                  out: Path) -> str:
    """The JSON, the PNGs and the markdown tables; returns the tables."""
    written = [write_report(report, out)]
    targets = report["settings"]["targets"]
    for task in tasks:
        path = out.parent / f"convergence-{task.name}.png"
        plot_task(task, plan, records, targets[task.name]["value"], path)
        written.append(path)
    by_name = {t.name: t for t in tasks}
    for entry in report["time_to_quality"]:
        suffix = "" if entry["costs_path"] is None else "-" + Path(entry["costs_path"]).stem
        path = out.parent / f"convergence-ttq-{entry['task']}{suffix}.png"
        plot_ttq(by_name[entry["task"]], plan, records, entry, targets[entry["task"]]["value"], path)
        written.append(path)
    tables = all_tables(tasks, report)
    md = out.parent / "convergence.md"
    md.write_text(tables)
    written.append(md)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return tables


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke check in a few minutes: 1 seed, 2-5 epochs, 2-point grid on mlp4 only")
    names = list(TASKS) + list(TASK_FAMILIES)
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, from {','.join(names)} "
                        "(default all; gpt-large = gpt-large-p4,gpt-large-p8)")
    parser.add_argument("--seeds", type=positive_int, help="evaluation seeds 0..N-1 (default 3; --quick: 1)")
    parser.add_argument("--workers", type=positive_int, default=2, help="worker processes, one thread each (default 2)")
    parser.add_argument("--optimizer", action="append", default=[], metavar="TASK=NAME",
                        help="train TASK (or a family, e.g. gpt-large) with pipecore.NAME instead (repeatable)")
    parser.add_argument("--costs", action="append", default=[], metavar="PATH",
                        help="per-stage costs measured elsewhere (a JSON with a convergence_costs section): adds "
                             "a time-to-quality table and plot per task for them (repeatable)")
    parser.add_argument("--constant-lr", action="store_true",
                        help="keep the learning rate constant on every task (no task's cosine decay)")
    parser.add_argument("--calibrate", metavar="TASK", help="run sequential training (update per mini-batch, seed "
                        "0) on TASK for --epochs evaluations and print where its held-out loss flattens")
    parser.add_argument("--epochs", type=positive_int, help="with --calibrate: evaluations to run (default the "
                        "task's if its lr decays, else 3x); otherwise a partial study, every chosen task cut to N "
                        "epochs (to time it)")
    parser.add_argument("--out", default=default_out("convergence-cpu.json"),
                        help=f"{OUT_HELP}; the PNGs and convergence.md go next to it")
    args = parser.parse_args(argv)
    chosen = [n.strip() for n in args.tasks.split(",") if n.strip()]
    expanded = [t for n in chosen for t in TASK_FAMILIES.get(n, (n,))]
    unknown = [n for n in expanded if n not in TASKS]
    if unknown or not expanded:
        parser.error(f"--tasks: unknown task(s) {unknown}; choose from {', '.join(names)}" if unknown
                     else "--tasks: give at least one task")
    args.tasks = list(dict.fromkeys(expanded))
    args.seeds = args.seeds or (1 if args.quick else 3)
    if not args.out.endswith(".json"):
        parser.error(f"--out must name a .json file, got {args.out!r}")
    catalogue = quick_tasks() if args.quick else dict(TASKS)
    for spec in args.optimizer:
        name, _, optimizer = spec.partition("=")
        targets = TASK_FAMILIES.get(name, (name,))
        if not optimizer or any(t not in catalogue for t in targets):
            parser.error(f"--optimizer: expected TASK=NAME with TASK from {', '.join(names)}, got {spec!r}")
        try:
            for t in targets:
                catalogue[t] = with_optimizer(catalogue[t], optimizer)
        except ValueError as error:
            parser.error(f"--optimizer {spec}: {error}")
    if args.constant_lr:
        catalogue = {name: replace(task, cosine_to=None) for name, task in catalogue.items()}
    if args.epochs and not args.calibrate:
        catalogue = {name: replace(task, epochs=min(task.epochs, args.epochs)) for name, task in catalogue.items()}
    if args.calibrate and args.calibrate not in catalogue:
        parser.error(f"--calibrate: unknown task {args.calibrate!r}; choose from {', '.join(TASKS)}")
    args.catalogue = catalogue
    return args


def flat_epoch(values: Sequence[float], window: int = FLAT_WINDOW, tolerance: float = FLAT_TOLERANCE) -> int | None:
    """The first evaluation (1-based) whose loss is less than ``tolerance`` (relative) below the loss ``window``
    evaluations earlier: from there on, training at this learning rate gains little. None if never."""
    for i in range(window, len(values)):
        if values[i - window] - values[i] < tolerance * values[i]:
            return i + 1
    return None


def calibrate(task: Task, epochs: int) -> int:
    """``--calibrate``: one sequential run, printed as it is evaluated, and where its held-out loss flattens."""
    import torch

    torch.set_num_threads(1)
    job = Job(replace(task, epochs=epochs), sequential_method(task.microbatches), 0, task.lr, task.optimizer_options)
    print(f"{task.name}: {task.describe()}; calibrating with {epochs} evaluations of {steps_per_epoch(task)} steps "
          f"(sequential, update per mini-batch, seed 0)", file=sys.stderr)
    started = time.perf_counter()
    record = run_job(job)
    if record["error"] or record["diverged"]:
        print(record["error"] or f"diverged: {record.get('reason')}", file=sys.stderr)
        return 1
    values = [c[task.metric] for c in record["curve"]]
    for c in record["curve"]:
        print(f"epoch {c['epoch']:3d}  step {c['step']:6d}  training loss {c['loss']:.4f}  {task.metric} "
              f"{c[task.metric]:.4f}")
    flat = flat_epoch(values)
    seconds = (time.perf_counter() - started) / epochs
    print(f"{seconds:.1f} s per epoch; " + (
        f"the held-out loss improved by less than {FLAT_TOLERANCE:.0%} over {FLAT_WINDOW} evaluations first at epoch "
        f"{flat} (step {flat * steps_per_epoch(task)})" if flat else
        f"it still improved by {FLAT_TOLERANCE:.0%} or more over every {FLAT_WINDOW} evaluations: run longer"))
    return 0


def announce(tasks: Sequence[Task], seeds: Sequence[int], first: list[Job], costs: list[Any], workers: int) -> None:
    """The study's size and its estimated duration (``SECONDS_PER_EPOCH``: a machine as loaded as the one that
    measured them; other load slows it down)."""
    later = [Job(t, m, s, t.lr, t.optimizer_options) for t in tasks if t.grid for m in methods(t) for s in seeds]
    first_min = estimate_seconds(first) / workers / 60
    later_min = estimate_seconds(later) / workers / 60
    cost_min = sum(seconds_per_step(c.task, c.method) * (c.steps + COST_WARMUP_STEPS) for c in costs) / workers / 60
    print(f"{len(first)} runs on {workers} workers ({', '.join(t.name for t in tasks)}; seeds {list(seeds)}; "
          f"algorithms {', '.join(pipecore.algorithm_names())}): estimated {first_min:.1f} min, then up to "
          f"{len(later)} runs at best grid points (at most {later_min:.1f} min more; fewer where the best is the "
          f"task's own hyper-parameters), then {len(costs)} cost measurements ({cost_min:.1f} min)",
          file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.calibrate:
        task = args.catalogue[args.calibrate]
        return calibrate(task, args.epochs or (task.epochs if task.cosine_to is not None else 3 * task.epochs))
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SystemExit(f"--out: cannot create {out.parent}: {error.strerror or error}") from None
    tasks = [args.catalogue[name] for name in args.tasks]
    try:
        for task in tasks:
            check_optimizer(task)
            for _, options in task.grid:
                check_optimizer(task, options)
        cost_sources = load_cost_sources(args.costs, RESULTS)
    except (ValueError, OSError) as error:
        raise SystemExit(f"error: {error}") from None
    seeds = list(range(args.seeds))
    plan = Plan()
    first = plan_first_phase(plan, tasks, seeds)
    rounds, steps = (1, 4) if args.quick else (COST_ROUNDS, COST_STEPS)
    cost_jobs = plan_cost_jobs(tasks, plan, rounds, steps)
    announce(tasks, seeds, first, cost_jobs, args.workers)
    started = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(args.workers, initializer=init_worker) as pool:
        records = {r["key"]: r for r in run_all(pool, first, "runs")}
        second = plan_best(plan, tasks, seeds, records)
        if second:
            records.update((r["key"], r) for r in run_all(pool, second, "best grid points"))
        measured = list(pool.imap(measure_costs, cost_jobs, chunksize=1))
    errors = [m for m in measured if m["error"]]
    here = {"device": f"this machine's CPU ({machine()['cpu']}), one thread per device", "path": None,
            "rounds": rounds, "steps": steps, "tasks": combine_costs(measured)}
    report = build_report(tasks, seeds, plan, records, args, time.perf_counter() - started, [here, *cost_sources],
                          errors)
    print(write_outputs(tasks, plan, records, report, out))
    failed = [r for r in report["runs"] if r["error"]]
    for r in failed:
        print(f"FAILED {r['task']} {r['algorithm']} seed {r['seed']} lr {r['lr']} options {r['options']}:\n"
              f"{r['error']}", file=sys.stderr)
    for e in errors:
        print(f"FAILED measuring the costs of {e['task']} {e['method']} (round {e['round']}):\n{e['error']}",
              file=sys.stderr)
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
