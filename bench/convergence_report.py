"""The convergence study's results (``bench/convergence.py``): targets, per-group aggregates, the gap of every
algorithm to its matched sequential baseline and to the best sequential configuration, the tables and the
per-epoch plots.

Records are what the runs produced and nothing else; everything that depends on a task's target is computed
here, per task, because two tasks may share a run (sequential training does not depend on the pipeline's
depth) but not their targets' use.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

import pipecore
from convergence_runs import (
    ABLATION_TASKS, AT_SEQUENTIAL, BEST, LAMBDAS, PIPEMARE_ABLATIONS, Group, Plan, algorithms,
    is_sequential, lam_label, matched_sequential, method_label, methods, sequential_method,
)
from convergence_tasks import Task


# -- targets -----------------------------------------------------------------------------------------------


def reached(task: Task, point: dict[str, float], target: float) -> bool:
    value = point[task.metric]
    return value >= target if task.higher_is_better else value <= target


def task_target(task: Task, plan: Plan, records: dict[tuple, dict]) -> dict[str, Any]:
    """A fixed target, or one derived from sequential training with an update per mini-batch (the task's
    ``target_rule``: its mean held-out loss halfway through, or its mean final loss plus a margin)."""
    if task.target is not None:
        return {"value": task.target, "metric": task.metric, "rule": f"fixed: test accuracy >= {task.target:.0%}"}
    reference = sequential_method(task.microbatches)
    group = plan.group(task, reference)
    curves = [records[k]["curve"] for k in group.keys] if group else []
    if task.target_rule == "final":
        values = [c[-1][task.metric] for c in curves if len(c) == task.epochs]
        value = statistics.fmean(values) * (1 + task.target_margin) if values else None
        seeds = f"{len(values)} seed{'s' if len(values) != 1 else ''}"
        return {"value": value, "metric": task.metric, "rule": f"held-out loss <= {1 + task.target_margin:g} x the "
                f"mean final loss of {method_label(task, reference)} ({seeds})"}
    half = math.ceil(task.epochs / 2)
    values = [c[half - 1][task.metric] for c in curves if len(c) >= half]
    return {"value": statistics.fmean(values) if values else None, "metric": task.metric,
            "rule": f"held-out loss <= the mean of {method_label(task, reference)}'s seeds after epoch {half} of "
                    f"{task.epochs}"}


def steps_to_target(task: Task, curve: list[dict[str, float]], target: float | None) -> float | None:
    """Mini-batches to the target: linear interpolation between the last evaluation that missed it and the first
    that met it (the first evaluation's step if that one met it already); None if never."""
    if target is None:
        return None
    previous = None
    for point in curve:
        if reached(task, point, target):
            if previous is None:
                return float(point["step"])
            before, after = previous[task.metric], point[task.metric]
            fraction = 1.0 if after == before else (target - before) / (after - before)
            return previous["step"] + fraction * (point["step"] - previous["step"])
        previous = point
    return None


def epochs_to_target(task: Task, curve: list[dict[str, float]], target: float | None) -> int | None:
    """The first evaluation (epoch) at which the target is met; None if never."""
    if target is None:
        return None
    return next((c["epoch"] for c in curve if reached(task, c, target)), None)


# -- aggregates ------------------------------------------------------------------------------------------------


def summary(values: list[float]) -> dict[str, float | None]:
    """Mean, std (sample; 0 for one value), min and max; None when empty."""
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None}
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": std, "min": min(values), "max": max(values)}


def mean_stage_costs(runs: list[dict[str, Any]]) -> list[dict[str, float]] | None:
    """Per stage, the mean over runs of each action kind's median seconds."""
    measured = [r["stage_costs"] for r in runs if r.get("stage_costs")]
    if not measured:
        return None
    stages = len(measured[0])
    return [{kind: statistics.fmean(m[s][kind] for m in measured if kind in m[s])
             for kind in measured[0][s]} for s in range(stages)]


def aggregate(task: Task, group: Group, records: dict[tuple, dict], target: float | None) -> dict[str, Any]:
    """Per group: final metric statistics over the seeds that neither diverged nor failed, divergences, time
    to target over the seeds that reached it, wall time, weight-version bytes, the stages' measured costs."""
    runs = [records[k] for k in group.keys]
    seeds = [k[-4] for k in group.keys]  # Job.key: (..., method, seed, lr, optimizer options, options)
    done = [(s, r) for s, r in zip(seeds, runs) if not r["diverged"] and not r["error"] and r["curve"]]
    to_target = [(r, steps_to_target(task, r["curve"], target)) for _, r in done]
    hit = [(r, steps) for r, steps in to_target if steps is not None]
    out: dict[str, Any] = {
        "seeds": len(runs), "diverged": sum(r["diverged"] for r in runs), "failed": sum(bool(r["error"]) for r in runs),
        "final": summary([r["curve"][-1][task.metric] for _, r in done]),
        "final_by_seed": {str(s): r["curve"][-1][task.metric] for s, r in done},
        "reached_target": len(hit),
        "epochs_to_target": (statistics.fmean(epochs_to_target(task, r["curve"], target) for r, _ in hit)
                             if hit else None),
        "steps_to_target": statistics.fmean(steps for _, steps in hit) if hit else None,
        "updates_to_target": (statistics.fmean(steps * r["updates_per_epoch"] / r["steps_per_epoch"]
                                               for r, steps in hit) if hit else None),
        "update_every": runs[0].get("update_every") if runs else None,
        "wall_s": statistics.fmean(r["wall_s"] for r in runs) if runs else None,
        "weight_version_bytes": max((r.get("weight_version_bytes") or 0) for r in runs) or None,
        "stage_costs": mean_stage_costs(runs),
    }
    if task.model == "gpt":
        out["final_perplexity"] = summary([r["curve"][-1]["perplexity"] for _, r in done])
    return out


def shortfall(task: Task, value: float, reference: float) -> float:
    """How much worse ``value`` is than ``reference``: relative for a loss (0.01 = 1% higher), in accuracy
    points for the digits tasks (0.01 = one point lower). Negative: better."""
    if task.higher_is_better:
        return reference - value
    return value / reference - 1


def paired_gap(task: Task, agg: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any] | None:
    """The shortfall of ``agg``'s mean final metric against ``reference``'s over the seeds both finished, and the
    per-seed shortfalls' range (the same seed: the same initial weights and batches)."""
    common = sorted(set(agg["final_by_seed"]) & set(reference["final_by_seed"]))
    if not common:
        return None
    a = statistics.fmean(agg["final_by_seed"][s] for s in common)
    b = statistics.fmean(reference["final_by_seed"][s] for s in common)
    per_seed = [shortfall(task, agg["final_by_seed"][s], reference["final_by_seed"][s]) for s in common]
    return {"gap": shortfall(task, a, b), "seeds": len(common), "min": min(per_seed), "max": max(per_seed)}


def best_sequential(task: Task, groups: dict[str, dict[str, Any]]) -> str | None:
    """The sequential group (any update frequency, the task's or its best grid point's hyper-parameters) with
    the best mean final metric."""
    candidates = [g for g in groups.values() if g["task"] == task.name and is_sequential(g["algorithm"])
                  and g["setting"] in (AT_SEQUENTIAL, BEST) and g["final"]["mean"] is not None]
    if not candidates:
        return None
    sign = 1 if task.higher_is_better else -1
    best = max(candidates, key=lambda g: sign * g["final"]["mean"])
    return f"{best['task']}|{best['algorithm']}|{best['setting']}"


def add_gaps(task: Task, groups: dict[str, dict[str, Any]]) -> None:
    """Each algorithm group's matched sequential baseline and its gaps to it and to the best sequential one."""
    best = best_sequential(task, groups)
    for g in groups.values():
        if g["task"] != task.name or is_sequential(g["algorithm"]) or g["setting"].startswith("grid"):
            continue
        # A best grid point's baseline is sequential at its own best; elsewhere the task's hyper-parameters.
        setting = BEST if g["setting"] == BEST else AT_SEQUENTIAL
        matched = f"{task.name}|{matched_sequential(task, g['algorithm'], g['options'])}|{setting}"
        g["matched_sequential"] = matched
        g["gap_to_matched"] = paired_gap(task, g, groups[matched]) if matched in groups else None
        g["best_sequential"] = best
        g["gap_to_best_sequential"] = None if best is None else paired_gap(task, g, groups[best])


# -- tables ---------------------------------------------------------------------------------------------


def fmt_metric(task: Task, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if task.higher_is_better else f"{value:.3f}"


def fmt_gap(task: Task, gap: dict[str, Any] | None) -> str:
    """``+1.2% [+0.8, +1.9]`` (loss) or ``+0.4 pt [...]`` (accuracy): mean and per-seed range."""
    if gap is None:
        return "-"
    if task.higher_is_better:
        text = f"{100 * gap['gap']:+.1f} pt"
        spread = f"[{100 * gap['min']:+.1f}, {100 * gap['max']:+.1f}]"
    else:
        text = f"{100 * gap['gap']:+.1f}%"
        spread = f"[{100 * gap['min']:+.1f}, {100 * gap['max']:+.1f}]"
    return text + (f" {spread}" if gap["seeds"] > 1 else " (1 seed)")


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
    else:
        text += " (1 seed)"
    if task.model == "gpt":
        text += f" (ppl {agg['final_perplexity']['mean']:.2f})"
    return text + (f" ({', '.join(lost)})" if lost else "")


def fmt_to_target(agg: dict[str, Any]) -> tuple[str, str, str]:
    """Mean epochs, steps and updates to target over the seeds that reached it, and how many did."""
    if agg["epochs_to_target"] is None:
        return f"never (0/{agg['seeds']})", "-", "-"
    return (f"{agg['epochs_to_target']:.1f} ({agg['reached_target']}/{agg['seeds']})",
            f"{agg['steps_to_target']:.0f}", f"{agg['updates_to_target']:.0f}")


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def aggregates_by_group(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f"{g['task']}|{g['algorithm']}|{g['setting']}": g for g in report["groups"]}


def fmt_point(task: Task, group: dict[str, Any] | None) -> str:
    if group is None:
        return "-"
    return task.describe_optimizer(group["lr"], [tuple(kv) for kv in group["optimizer_options"]])


def task_table(task: Task, groups: dict[str, dict[str, Any]], target: dict[str, Any]) -> str:
    """Every method at the task's hyper-parameters: final metric, gaps, time to target, best grid point,
    wall time and memory."""
    rows = []
    for method in methods(task):
        agg = groups.get(f"{task.name}|{method}|{AT_SEQUENTIAL}")
        if agg is None:
            continue
        epochs, steps, updates = fmt_to_target(agg)
        best = groups.get(f"{task.name}|{method}|{BEST}")
        matched = "-" if is_sequential(method) else fmt_gap(task, agg.get("gap_to_matched"))
        to_best = "-" if is_sequential(method) else fmt_gap(task, agg.get("gap_to_best_sequential"))
        rows.append([method_label(task, method), str(agg["update_every"]), fmt_final(task, agg), matched, to_best,
                     epochs, steps, updates, "-" if best is None else fmt_point(task, best),
                     "-" if best is None else fmt_final(task, best), f"{agg['wall_s']:.1f}",
                     f"{agg['weight_version_bytes']:,}" if agg["weight_version_bytes"] else "-"])
    goal = fmt_metric(task, target["value"])
    worse = "points below" if task.higher_is_better else "% above"
    best = best_sequential(task, groups)
    if best is None:
        best_text = "-"
    else:
        where = "its best grid point" if groups[best]["setting"] == BEST else "task hyper-parameters"
        best_text = (f"{method_label(task, groups[best]['algorithm'])} ({where}, "
                     f"{fmt_metric(task, groups[best]['final']['mean'])})")
    header = ["method", "update every", f"final {'test accuracy' if task.higher_is_better else 'held-out loss'}",
              "vs matched sequential", "vs best sequential", f"epochs to {goal}", "steps to target",
              "updates to target", "best grid point", "final at best", "wall s", "weight-version bytes"]
    return (f"### {task.name}: {task.describe()}\n\nTarget: {target['rule']} ({goal}). Final: mean ± std "
            f"[min, max] over seeds. \"vs matched sequential\": {worse} sequential training with the same optimizer "
            f"and update frequency, mean over the seeds both ran [per-seed range]; best sequential: {best_text}. "
            f"Epochs, steps (mini-batches, interpolated between evaluations) and updates to target: mean over the "
            f"seeds that reached it.{closest_line(task, groups)}\n\n{markdown(header, rows)}")


def closest(task: Task, groups: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The algorithm that is not exact (it has staleness) whose mean final metric is nearest its matched
    sequential baseline's, at the task's hyper-parameters."""
    candidates = [g for g in groups.values() if g["task"] == task.name and g["setting"] == AT_SEQUENTIAL
                  and not is_sequential(g["algorithm"]) and not g.get("exact") and g.get("gap_to_matched")]
    return min(candidates, key=lambda g: g["gap_to_matched"]["gap"], default=None)


def closest_line(task: Task, groups: dict[str, dict[str, Any]]) -> str:
    best = closest(task, groups)
    if best is None:
        return ""
    return (f" Closest to its matched sequential baseline among the algorithms with staleness: "
            f"**{best['algorithm']}**, {fmt_gap(task, best['gap_to_matched'])}.")


def ablation_rows(task: Task, groups: dict[str, dict[str, Any]], names: Sequence[tuple[str, str]]) -> list[list[str]]:
    rows = []
    for label, key in names:
        agg = groups.get(key)
        if agg is None:
            rows.append([label, "skipped: options not accepted (see below)", "-", "-", "-"])
            continue
        rows.append([label, fmt_final(task, agg), fmt_gap(task, agg.get("gap_to_matched")), *fmt_to_target(agg)[::2]])
    return rows


def ablation_tables(tasks: Sequence[Task], groups: dict[str, dict[str, Any]]) -> list[str]:
    """PipeMare without T1 / T2 and I-TiMePReSt over lam, per ablation task."""
    out = []
    header = ["variant", "final", "vs matched sequential", "epochs to target", "updates to target"]
    for task in (t for t in tasks if t.name in ABLATION_TASKS):
        if "pipemare" in algorithms():
            pm = [("PipeMare (T1 + T2)", f"{task.name}|pipemare|{AT_SEQUENTIAL}")]
            pm += [(f"PipeMare {label}", f"{task.name}|pipemare|ablation {label}") for label in PIPEMARE_ABLATIONS]
            out.append(f"### Ablation: PipeMare on {task.name} (P={task.stages})\n\n"
                       f"{markdown(header, ablation_rows(task, groups, pm))}")
        if "i-timeprest" in algorithms():
            default_lam = pipecore.get_algorithm("i-timeprest", task.stages, task.microbatches).options["lam"]
            lams = [(lam_label(lam) + (" (default)" if lam == default_lam else ""),
                     f"{task.name}|i-timeprest|ablation {lam_label(lam)}") for lam in LAMBDAS]
            table = markdown(header, ablation_rows(task, groups, lams))
            out.append(f"### Ablation: I-TiMePReSt lam on {task.name} (P={task.stages}; alpha(d) = exp(-lam*d): "
                       f"0 reads the stash, inf the live weights)\n\n{table}")
    return out


#: The corrections table's rows: PipeDream's stash uncorrected, then the methods that correct its staleness.
CORRECTIONS = (("pipedream", AT_SEQUENTIAL, "pipedream (stash, uncorrected)"),
               ("spectrain", AT_SEQUENTIAL, "spectrain (weight prediction)"),
               ("pipedream-dc", AT_SEQUENTIAL, "pipedream-dc (lam 0.04)"),
               ("pipedream-dc", "ablation adaptive", "pipedream-dc adaptive (DC-ASGD-a, lam 2)"),
               ("nesterov-async", AT_SEQUENTIAL, "nesterov-async"))


def corrections_table(tasks: Sequence[Task], groups: dict[str, dict[str, Any]]) -> str | None:
    """PipeDream and the staleness corrections on its stash, on every task, against their matched baseline
    (all update after every micro-batch)."""
    rows = []
    for task in tasks:
        for method, setting, label in CORRECTIONS:
            agg = groups.get(f"{task.name}|{method}|{setting}")
            if agg is None:
                continue
            rows.append([task.name, str(task.stages), task.optimizer, label, fmt_final(task, agg),
                         fmt_gap(task, agg.get("gap_to_matched")), fmt_to_target(agg)[0]])
    if not rows:
        return None
    header = ["task", "P", "optimizer", "method", "final (task hyper-parameters)", "vs matched sequential",
              "epochs to target"]
    return (f"### Staleness corrections beside PipeDream\n\nEvery method here updates after every micro-batch; "
            f"\"vs matched sequential\" compares it with sequential training that does too, with the same optimizer "
            f"(a method missing on a task refuses its optimizer: see Skipped).\n\n{markdown(header, rows)}")


# -- per-epoch plots -------------------------------------------------------------------------------------


def plot_task(task: Task, plan: Plan, records: dict[tuple, dict], target: float | None, path: Any) -> None:
    """Test metric and training loss per epoch, one line per method (mean over seeds, min..max shaded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_metric, ax_loss) = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.get_cmap("tab20")
    scale = 100 if task.higher_is_better else 1
    for i, method in enumerate(methods(task)):
        group = plan.group(task, method)
        if group is None:
            continue
        curves = [records[k]["curve"] for k in group.keys]
        style = ({"color": "black", "linewidth": 2.5, "linestyle": "--" if i == 0 else ":"} if is_sequential(method)
                 else {"color": colors(i % 20), "linewidth": 1.4})
        for ax, key, factor in ((ax_metric, task.metric, scale), (ax_loss, "loss", 1)):
            plot_spread(ax, curves, key, factor, method_label(task, method), style)
    if target is not None:
        ax_metric.axhline(target * scale, color="grey", linewidth=0.8, linestyle=":", label="target")
    label = "test accuracy (%)" if task.higher_is_better else "held-out loss per character"
    ax_metric.set(xlabel="epoch", ylabel=label, title=f"{label} (mean over seeds, min..max shaded)")
    # Cross entropy per character spans a narrow range: a linear axis reads better there.
    ax_loss.set(xlabel="epoch", ylabel="training loss (epoch mean)", title="training loss",
                yscale="log" if task.higher_is_better else "linear")
    for ax in (ax_metric, ax_loss):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_metric.legend(fontsize=7, ncol=2, loc="best")
    fig.suptitle(f"{task.name}: {task.describe()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_spread(ax: Any, curves: list[list[dict]], key: str, factor: float, label: str, style: dict,
                x_scale: float | None = None) -> None:
    """Mean over the curves that reached each evaluation, and their min..max; x is the epoch, or (with
    ``x_scale``) the step times ``x_scale``."""
    longest = max((len(c) for c in curves), default=0)
    if not longest:
        return
    points = range(1, longest + 1)
    values = [[factor * c[e - 1][key] for c in curves if len(c) >= e] for e in points]
    longest_curve = max(curves, key=len)
    xs = list(points) if x_scale is None else [longest_curve[e - 1]["step"] * x_scale for e in points]
    ax.plot(xs, [statistics.fmean(v) for v in values], label=label, **style)
    ax.fill_between(xs, [min(v) for v in values], [max(v) for v in values], color=style["color"], alpha=0.10)

