"""Time to quality (``bench/convergence.py``): which method reaches the task's target first on a real pipeline.

For each method, the study has the mini-batches it needs to reach the target (from its runs, the mean over the
seeds that reached it) and each stage's measured cost of a forward, a backward and an update (on this machine,
measured after the runs as :data:`COST_ROUNDS` describes, one thread; or a cost file measured elsewhere). The simulator
(``pipecore.simulate``) runs the method's schedule with those costs on one device per rank, and the steady
state of its timeline (the makespan's growth per mini-batch past the schedule's warm-up, as the planner's
``step_times`` does) is the predicted step time. Time to quality is steps x step time.

Assumptions (stated in ``docs/convergence.md``): every device is as fast as the one the costs come from; sending
activations and gradients costs nothing (or is hidden behind compute); a backward that a zero-bubble schedule
splits is half input gradient, half weight gradient (as ``pipecore.plan`` takes it); the costs of an action do
not depend on what the other devices do. Sequential training runs on one device.
"""

from __future__ import annotations

import json
import statistics
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pipecore
from convergence_report import fmt_metric, markdown, plot_spread
from convergence_runs import (
    ONE_STAGE_ALGORITHM, Job, Plan, Trainer, is_sequential, method_label, methods, sequential_every,
)
from convergence_tasks import Task, build_model, options_tuple, train_batches

#: Where the committed GPU results are; a file there with a ``convergence_costs`` section is a cost source.
GPU_RESULTS = "gpu-*.json"
#: This machine's costs: every method of a task trains COST_STEPS mini-batches from a fresh model, in
#: COST_ROUNDS rounds (every method once per round, so a burst of other load falls on different methods in
#: different rounds); a stage's cost of an action kind is the least of its rounds' medians.
COST_ROUNDS = 6
COST_STEPS = 8
#: Steps trained before the measured ones (first calls, graph capture): the stages' medians (over their last
#: 1,024 actions of each kind) then rest on the measured steps' actions, which outnumber these several times.
COST_WARMUP_STEPS = 3


@dataclass(frozen=True)
class CostJob:
    """One round of measuring one method's stage costs on a task."""

    task: Task
    method: str
    options: tuple[tuple[str, Any], ...]
    round: int
    steps: int


def plan_cost_jobs(tasks: Sequence[Task], plan: Plan, rounds: int, steps: int) -> list[CostJob]:
    """Every method of every task (with the options its runs used), ``rounds`` times, round after round."""
    jobs = []
    for r in range(rounds):
        for task in tasks:
            for method in methods(task):
                group = plan.group(task, method)
                if group is not None:
                    jobs.append(CostJob(task, method, options_tuple(group.options), r, steps))
    return jobs


def measure_costs(job: CostJob) -> dict[str, Any]:
    """Train COST_WARMUP_STEPS and then ``job.steps`` mini-batches and read each stage's median seconds per
    forward, backward and update (one thread runs the stages in turn). Runs in a worker process."""
    import torch

    out: dict[str, Any] = {"task": job.task.name, "method": job.method, "round": job.round, "stage_costs": None,
                           "error": None}
    try:
        torch.manual_seed(0)
        trainer = Trainer(Job(job.task, job.method, 0, job.task.lr, job.task.optimizer_options, job.options),
                          build_model(job.task))
        batches = (b for epoch in range(10 ** 6) for b in train_batches(job.task, 0, epoch))
        for _ in range(COST_WARMUP_STEPS + job.steps):
            trainer.step(*next(batches))
        trainer.flush()
        out["stage_costs"] = trainer.stage_costs()
    except Exception:  # reported with the results; the study goes on
        out["error"] = traceback.format_exc()
    return out


def combine_costs(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, list[dict[str, float]]]]:
    """Per task and method, each stage's least median over the rounds, per action kind."""
    rounds: dict[tuple[str, str], list[list[dict[str, float]]]] = {}
    for r in results:
        if r["stage_costs"]:
            rounds.setdefault((r["task"], r["method"]), []).append(r["stage_costs"])
    out: dict[str, dict[str, list[dict[str, float]]]] = {}
    for (task, method), measured in rounds.items():
        out.setdefault(task, {})[method] = [
            {kind: min(m[s][kind] for m in measured if kind in m[s]) for kind in measured[0][s]}
            for s in range(len(measured[0]))]
    return out


def configured(task: Task, method: str, options: dict[str, Any]) -> tuple[Any, float]:
    """The algorithm the method's runs configured, and how many of its steps make one of the task's
    mini-batches (sequential training with an update every ``k`` micro-batches steps ``m / k`` times)."""
    if is_sequential(method):
        k = sequential_every(method)
        return pipecore.get_algorithm(ONE_STAGE_ALGORITHM, 1, k), task.microbatches / k
    return pipecore.get_algorithm(method, task.stages, task.microbatches, **options), 1.0


def simulator_costs(algorithm: Any, stage_costs: Sequence[dict[str, float]]) -> dict[str, list[float]]:
    """Per-stage costs for ``pipecore.simulate`` from measured medians: the forward of a micro-batch, its backward
    (a measured backward that covers ``c`` micro-batches counts ``1/c`` per micro-batch), split half input
    gradient and half weight gradient, and the update."""
    schedule = algorithm.schedule(2)
    forward, backward, update = [], [], []
    for s, costs in enumerate(stage_costs):
        counts = [a.count for a in schedule.stages[s] if a.kind.value == "B"]
        per_backward = statistics.fmean(counts) if counts else 1.0
        forward.append(costs.get("F", 0.0))
        backward.append(costs.get("B", 0.0) / per_backward)
        update.append(costs.get("U", 0.0))
    half = [b / 2 for b in backward]
    return {"forward": forward, "backward": half, "weight": half, "update": update}


def steady_state(algorithm: Any, costs: dict[str, list[float]]) -> tuple[float, int]:
    """Seconds per step once the schedule is in its steady state (the makespan's growth per mini-batch between
    two runs past its warm-up), and the devices (ranks) it runs on."""
    first = algorithm.warmup_minibatches + 1
    traces = [pipecore.simulate(algorithm, algorithm.num_stages, algorithm.n_microbatches, n_minibatches=n,
                                costs=costs) for n in (first, first + 2)]
    return (traces[1].makespan - traces[0].makespan) / 2, traces[0].num_ranks


def predicted_step(task: Task, method: str, options: dict[str, Any],
                   stage_costs: Sequence[dict[str, float]]) -> dict[str, Any]:
    """The predicted seconds per mini-batch of the task, the devices, the work (every action's time per
    mini-batch, summed over stages) and the bubble: the share of the devices' time per mini-batch that no action
    uses."""
    algorithm, steps_per_minibatch = configured(task, method, options)
    if len(stage_costs) != algorithm.num_stages:
        raise ValueError(f"{task.name} {method}: costs for {len(stage_costs)} stages, the method has "
                         f"{algorithm.num_stages}")
    costs = simulator_costs(algorithm, stage_costs)
    step, devices = steady_state(algorithm, costs)
    updates_per_step = algorithm.n_microbatches / algorithm.update_every
    busy = sum(algorithm.n_microbatches * (f + b + w) + updates_per_step * u
               for f, b, w, u in zip(costs["forward"], costs["backward"], costs["weight"], costs["update"]))
    return {"step_s": step * steps_per_minibatch, "devices": devices, "work_s": busy * steps_per_minibatch,
            "bubble": 1 - busy / (devices * step) if step > 0 else 0.0}


def steps_source(task: Task, group: dict[str, Any], groups: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Where a method's steps to target come from: its own runs, or, for an exact algorithm that ran fewer seeds
    than its matched baseline (``Task.exact_seeds``), the baseline's (it computes the same updates)."""
    matched = groups.get(group.get("matched_sequential") or "")
    if group.get("exact") and matched is not None and group["seeds"] < matched["seeds"]:
        return {**matched, "from": matched["algorithm"]}
    return {**group, "from": None}


def ttq_rows(task: Task, groups: dict[str, dict[str, Any]], costs: dict[str, list[dict[str, float]]],
             setting: str) -> list[dict[str, Any]]:
    """Per method with costs: the predicted step, the steps to target and their product, fastest first (the
    methods that never reached the target last)."""
    rows = []
    for method in methods(task):
        group = groups.get(f"{task.name}|{method}|{setting}")
        if group is None or method not in costs:
            continue
        step = predicted_step(task, method, group["options"], costs[method])
        source = steps_source(task, group, groups)
        steps = source["steps_to_target"]
        rows.append({"method": method, **step, "update_every": group["update_every"], "exact": group.get("exact"),
                     "steps_to_target": steps,
                     "reached": source["reached_target"], "seeds": source["seeds"], "steps_from": source["from"],
                     "time_to_target_s": None if steps is None else steps * step["step_s"]})
    rows.sort(key=lambda r: (r["time_to_target_s"] is None, r["reached"] < r["seeds"],
                             r["time_to_target_s"] or 0.0))
    return rows


def noise_floor(rows: list[dict[str, Any]]) -> float | None:
    """How far apart the measured work of the exact (synchronous) algorithms is, max / min - 1: they run the same
    forwards, backwards and updates, so this is what measurement alone makes of equal costs."""
    work = [r["work_s"] for r in rows if r.get("exact")]
    return max(work) / min(work) - 1 if len(work) > 1 and min(work) > 0 else None


def winner(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The method that reaches the target first, among those whose every seed reached it."""
    return next((r for r in rows if r["time_to_target_s"] is not None and r["reached"] == r["seeds"]), None)


def load_cost_sources(paths: Sequence[str], results_dir: Path) -> list[dict[str, Any]]:
    """Cost files: each given path, and every committed GPU result (``bench/results/gpu-*.json``) that has a
    ``convergence_costs`` section (``{"device": ..., "tasks": {task: {method: [per-stage {"F", "B", "U"}]}}}``,
    seconds). Returns the sources found, each with its path."""
    found = []
    candidates = [Path(p) for p in paths] + sorted(results_dir.glob(GPU_RESULTS))
    for path in candidates:
        data = json.loads(path.read_text())
        section = data.get("convergence_costs", data if "tasks" in data and "device" in data else None)
        if section is None:
            if str(path) in paths:
                raise ValueError(f"--costs {path}: no convergence_costs section (see bench/convergence_ttq.py)")
            continue
        found.append({"path": str(path), "device": section["device"], "tasks": section["tasks"]})
    return found


def time_to_quality(tasks: Sequence[Task], groups: dict[str, dict[str, Any]], targets: dict[str, dict],
                    sources: Sequence[dict[str, Any]], setting: str) -> list[dict[str, Any]]:
    """Per cost source (this machine's measurement first, then the cost files) and task: the rows and the
    method first to the target (JSON-ready)."""
    out = []
    for source in sources:
        for task in tasks:
            if targets[task.name]["value"] is None:
                continue
            costs = source["tasks"].get(task.name, {})
            if not costs:
                continue
            rows = ttq_rows(task, groups, costs, setting)
            best = winner(rows)
            out.append({"task": task.name, "device": source["device"], "costs_path": source["path"],
                        "stages": task.stages, "rows": rows, "first": None if best is None else best["method"],
                        "noise_floor": noise_floor(rows)})
    return out


def ttq_table(task: Task, entry: dict[str, Any], target: dict[str, Any]) -> str:
    """The time-to-quality table of one task and cost source, and which method reaches the target first."""
    rows = entry["rows"]
    best = winner(rows)
    lines = []
    for r in rows:
        steps = "never" if r["steps_to_target"] is None else f"{r['steps_to_target']:.0f}"
        source = f", {method_label(task, r['steps_from'])}'s" if r["steps_from"] else ""
        steps += f" ({r['reached']}/{r['seeds']}{source})"
        ttq = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        ratio = ("-" if r["time_to_target_s"] is None or best is None
                 else f"{r['time_to_target_s'] / best['time_to_target_s']:.2f}x")
        lines.append([method_label(task, r["method"]), str(r["devices"]), str(r["update_every"]),
                      f"{1e3 * r['work_s']:.1f}", f"{1e3 * r['step_s']:.1f}", f"{r['bubble']:.2f}", steps, ttq, ratio])
    header = ["method", "devices", "update every", "work per mini-batch (ms)", "predicted step (ms)", "bubble",
              "steps to target", "predicted time to target (s)", "vs first"]
    floor = entry.get("noise_floor")
    noise = ("" if floor is None else f" The exact algorithms do the same work, measured {100 * floor:.0f}% apart at "
             "most: differences of that size between predictions are the measurement's, not the algorithms'.")
    first = ("no method reached the target on every seed" if best is None else
             f"**first to the target with P={task.stages}: {method_label(task, best['method'])}** "
             f"({best['time_to_target_s']:.1f} s predicted)")
    return (f"### Time to quality: {task.name} (P={task.stages}; {entry['device']})\n\n"
            f"Target {fmt_metric(task, target['value'])} ({target['rule']}); {first}. Predicted step: the simulator's "
            f"steady state with the measured per-stage costs; steps to target: mean over the seeds that reached it "
            f"(reached/seeds); work: every action's measured time per mini-batch, summed over stages.{noise}\n\n"
            f"{markdown(header, lines)}")


def plot_ttq(task: Task, plan: Plan, records: dict[tuple, dict], entry: dict[str, Any], target: float | None,
             path: Any) -> None:
    """Test metric against predicted wall time (step x predicted step time), one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    colors = plt.get_cmap("tab20")
    scale = 100 if task.higher_is_better else 1
    order = methods(task)
    for r in entry["rows"]:
        group = plan.group(task, r["method"])
        if group is None:
            continue
        i = order.index(r["method"])
        style = ({"color": "black", "linewidth": 2.2, "linestyle": "--" if i == 0 else ":"}
                 if is_sequential(r["method"]) else {"color": colors(i % 20), "linewidth": 1.3})
        curves = [records[k]["curve"] for k in group.keys]
        label = f"{method_label(task, r['method'])} ({r['devices']} device{'s' if r['devices'] > 1 else ''})"
        plot_spread(ax, curves, task.metric, scale, label, style, x_scale=r["step_s"])
    if target is not None:
        ax.axhline(target * scale, color="grey", linewidth=0.8, linestyle=":", label="target")
    label = "test accuracy (%)" if task.higher_is_better else "held-out loss per character"
    ax.set(xlabel="predicted wall time (s): steps x the simulator's step time", ylabel=label, xscale="log",
           title=f"{task.name}: {label} against predicted wall time, P={task.stages}\n{entry['device']}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
