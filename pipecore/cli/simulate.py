"""``pipecore simulate``: run an algorithm symbolically and print its version grid and summary."""

from __future__ import annotations

import argparse
import math
from typing import Any, Sequence

from ._args import algorithm_option, positive_int

HELP = "simulate an algorithm's schedule and weight versions (grid, summary, PNG, Chrome trace)"

DESCRIPTION = """\
Simulate an algorithm's schedule on symbolic stages: prints the grid (every action with the weight
version it read) and a per-stage summary (weight versions held, in-flight activations, staleness and
delay), and optionally draws the timeline (--png) or writes a Chrome trace (--chrome).

Costs are per micro-batch: --costs F,B[,W] sets every stage (default 1,1,1: a backward takes 2, its
input-gradient part B 1 and its weight-gradient part W 1, which zero-bubble schedules run as an action of
its own; --costs F,B makes B the whole backward); --forward-costs, --backward-costs and --weight-costs take
one value or one value per stage and override --costs; a backward covering several micro-batches (nF1B)
costs B times their number.

--compare runs every algorithm on the same --stages: the schedules that place several stages on a rank
(zb-v and dualpipe-v always 2) run them on fewer ranks, which the table's ranks column and a note under it
say.

examples:
  pipecore simulate --algorithm pipedream --stages 4 --microbatches 4 --minibatches 2
  pipecore simulate -a i-timeprest -p 3 -m 2 --option lam=0.5 --option alpha=inverse
  pipecore simulate -a 1f1b -p 4 -m 8 --forward-costs 1,1,2,1 --backward-costs 2,2,4,2 --png 1f1b.png
  pipecore simulate --compare --stages 4 --microbatches 4
"""


def _cost(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{text!r} is not a finite non-negative number")
    return value


def _cost_list(text: str) -> tuple[float, ...]:
    """A comma-separated list of costs (argparse type)."""
    try:
        return tuple(_cost(part) for part in text.split(","))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error} (expected comma-separated numbers, e.g. 1,2)") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``simulate`` arguments."""
    parser.add_argument("-a", "--algorithm", metavar="NAME",
                        help="algorithm name or alias (see --compare for the list)")
    parser.add_argument("-p", "--stages", type=positive_int, required=True, metavar="P",
                        help="number of pipeline stages")
    parser.add_argument("-m", "--microbatches", type=positive_int, required=True, metavar="M",
                        help="micro-batches per mini-batch")
    parser.add_argument("-n", "--minibatches", type=positive_int, default=4, metavar="N",
                        help="mini-batches to simulate (default 4)")
    parser.add_argument("--costs", type=_cost_list, metavar="F,B[,W]",
                        help="forward and backward time of one micro-batch on every stage, and the weight-gradient "
                             "part W of the backward (default 1,1,1: a backward takes 2, of which W=1 runs as its own "
                             "action in zero-bubble schedules; with two values, or with --backward-costs and no "
                             "--weight-costs, B is the whole backward and W costs 0)")
    parser.add_argument("--forward-costs", type=_cost_list, metavar="LIST",
                        help="forward time per micro-batch: one value, or one per stage (e.g. 1,1,2,1)")
    parser.add_argument("--backward-costs", type=_cost_list, metavar="LIST",
                        help="backward time per micro-batch: one value, or one per stage")
    parser.add_argument("--weight-costs", type=_cost_list, metavar="LIST",
                        help="weight-gradient time per micro-batch (W): one value, or one per stage")
    parser.add_argument("--stages-per-rank", type=positive_int, metavar="V",
                        help="stages (model chunks) per rank for the schedules that take several: interleaved-1f1b, "
                             "looped-bfs, zb-h1 (default 1); zb-v and dualpipe-v always take 2")
    parser.add_argument("--update-costs", type=_cost_list, metavar="LIST",
                        help="optimizer update time: one value, or one per stage (default 0)")
    parser.add_argument("--send-cost", type=_cost_list, metavar="T",
                        help="time to move one activation or gradient between stages (default 0)")
    parser.add_argument("-o", "--option", type=algorithm_option, action="append", default=[], metavar="KEY=VALUE",
                        help="algorithm option, repeatable (e.g. lam=0.5, alpha=inverse, update_every=2)")
    parser.add_argument("--png", metavar="PATH", help="draw the timeline to a PNG file")
    parser.add_argument("--chrome", metavar="PATH", help="write a Chrome trace (Perfetto, chrome://tracing)")
    parser.add_argument("--no-grid", action="store_true", help="print only the summary")
    parser.add_argument("--compare", action="store_true",
                        help="simulate every algorithm for the same P, M, N and costs, side by side")


def costs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``costs`` mapping for :func:`pipecore.simulate` from the cost flags."""
    P = args.stages
    # Without a backward cost given, the backward's 2 splits into B=1 and W=1; a backward cost given without a
    # weight part is the whole backward (W=0), as with pipecore.simulate's costs.
    split_default = args.costs is None and args.backward_costs is None
    forward, backward, weight = (1.0, 1.0, 1.0) if split_default else (1.0, 2.0, 0.0)
    if args.costs is not None:
        if len(args.costs) not in (2, 3):
            raise ValueError(f"--costs takes F,B or F,B,W (two or three numbers), got {len(args.costs)} values")
        forward, backward, weight = args.costs if len(args.costs) == 3 else (*args.costs, 0.0)

    def per_stage(flag: str, values: Sequence[float] | None, default: float) -> float | list[float]:
        if values is None:
            return default
        if len(values) == 1:
            return values[0]
        if len(values) != P:
            raise ValueError(f"{flag} takes one value or one per stage ({P}), got {len(values)}")
        return list(values)

    send = 0.0
    if args.send_cost is not None:
        if len(args.send_cost) != 1:
            raise ValueError(f"--send-cost takes one number, got {len(args.send_cost)}")
        send = args.send_cost[0]
    return {
        "forward": per_stage("--forward-costs", args.forward_costs, forward),
        "backward": per_stage("--backward-costs", args.backward_costs, backward),
        "weight": per_stage("--weight-costs", args.weight_costs, weight),
        "update": per_stage("--update-costs", args.update_costs, 0.0),
        "send": send,
    }


def describe_costs(costs: dict[str, Any]) -> str:
    """``F=1 B=2`` style description of a costs mapping."""
    def fmt(value: Any) -> str:
        return ",".join(f"{v:g}" for v in value) if isinstance(value, list) else f"{value:g}"

    parts = [f"F={fmt(costs['forward'])}", f"B={fmt(costs['backward'])}"]
    if costs.get("weight", 0.0) != 0.0:
        parts.append(f"W={fmt(costs['weight'])}")
    if costs["update"] != 0.0:
        parts.append(f"U={fmt(costs['update'])}")
    if costs["send"]:
        parts.append(f"send={fmt(costs['send'])}")
    return " ".join(parts)


def compare_table(num_stages: int, n_microbatches: int, n_minibatches: int, costs: dict[str, Any],
                  stages_per_rank: int | None = None) -> str:
    """Every algorithm simulated with the same sizes and costs, one row each.

    Columns: bubble fraction (idle share of ranks x makespan), makespan, ranks, the most micro-batch
    activations a rank holds (over its stages), weight versions held per stage, staleness of all reads
    (mean/max), delay of all backwards (mean/max), stages computing derived weights. ``stages_per_rank`` goes
    to the schedules that take several stages per rank (the V-shaped ones always take 2). Algorithms whose
    constraints reject the sizes show the reason instead.
    """
    from ..algorithms import algorithm_names, get_spec
    from ..simulate import simulate

    header = ("algorithm", "bubble", "makespan", "ranks", "act/rank", "versions/stage", "staleness", "delay",
              "derived")
    rows: list[tuple[str, ...]] = []  # a full row, or (name, reason) for a rejected algorithm
    for name in algorithm_names():
        options = {}
        if stages_per_rank is not None and "stages_per_rank" in get_spec(name).defaults and \
                get_spec(name).defaults["stages_per_rank"] == 1:
            options["stages_per_rank"] = stages_per_rank
        try:
            trace = simulate(name, num_stages, n_microbatches, n_minibatches, costs=costs, **options)
        except ValueError as error:
            reason = str(error)
            prefix = f"{name}: "
            rows.append((name, "rejected: " + (reason[len(prefix):] if reason.startswith(prefix) else reason)))
            continue
        # Every stage reads weights for the F and the B of every micro-batch, so the mean over all reads is
        # the mean of the per-stage means.
        stages = [trace.stage_summary(s) for s in range(num_stages)]
        rows.append((
            name,
            f"{trace.bubble_fraction:.3f}",
            f"{trace.makespan:g}",
            str(trace.num_ranks),
            str(max(trace.rank_peak_activations(r) for r in range(trace.num_ranks))),
            " ".join(str(x.weight_versions) for x in stages),
            f"{sum(x.mean_staleness for x in stages) / num_stages:.2f}/{max(x.max_staleness for x in stages)}",
            f"{sum(x.mean_delay for x in stages) / num_stages:.2f}/{max(x.max_delay for x in stages)}",
            ",".join(str(x.stage) for x in stages if x.derived_weights) or "-",
        ))
    widths = [max([len(header[i])] + [len(r[i]) for r in rows if len(r) == len(header)]) for i in range(len(header))]
    widths[0] = max(widths[0], *(len(r[0]) for r in rows))

    def line(cells: Sequence[str]) -> str:
        text = [cells[0].ljust(widths[0])]
        text += [c.rjust(w) if i in (1, 2, 3, 4) else c.ljust(w)
                 for i, (c, w) in enumerate(zip(cells[1:], widths[1:]), 1)]
        return "  ".join(text).rstrip()

    out = [
        f"{num_stages} stages, {n_microbatches} micro-batches x {n_minibatches} mini-batches, "
        f"costs {describe_costs(costs)} (staleness and delay: mean/max)",
        line(header),
    ]
    for row in rows:
        out.append(line(row) if len(row) == len(header) else f"{row[0].ljust(widths[0])}  {row[1]}")
    out += ranks_notes(num_stages, {row[0]: int(row[3]) for row in rows if len(row) == len(header)})
    return "\n".join(out)


def ranks_notes(num_stages: int, ranks: dict[str, int]) -> list[str]:
    """Lines under the comparison naming the algorithms that ran the stages on fewer ranks than the others
    (several stages per rank): their bubble and makespan are those of fewer workers."""
    if not ranks:
        return []
    counts = sorted(set(ranks.values()), reverse=True)
    most = counts[0]  # one stage per rank, unless every algorithm shown places several on each
    notes = []
    for count in counts[1:]:
        names = [name for name, r in ranks.items() if r == count]
        per_rank = num_stages // count
        listed = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        place, they, their = ("place", "they run", "their") if len(names) > 1 else ("places", "it runs", "its")
        notes.append(f"note: {listed} {place} {per_rank} stages on each rank: {they} these {num_stages} stages on "
                     f"{count} ranks, the others on {most}, so {their} makespan is that of {count} workers, not "
                     f"{most} (on {most} ranks: --stages {most * per_rank})")
    return notes


def run(args: argparse.Namespace) -> int:
    """Execute ``pipecore simulate``."""
    from ..simulate import simulate

    costs = costs_from_args(args)
    if args.compare:
        for flag, given in (("--algorithm", args.algorithm), ("--option", args.option),
                            ("--png", args.png), ("--chrome", args.chrome)):
            if given:
                raise ValueError(f"{flag} applies to one algorithm; --compare runs them all")
        print(compare_table(args.stages, args.microbatches, args.minibatches, costs, args.stages_per_rank))
        return 0
    if args.algorithm is None:
        raise ValueError("--algorithm is required (or use --compare to run every algorithm)")
    options = dict(args.option)
    if args.stages_per_rank is not None:
        options["stages_per_rank"] = args.stages_per_rank
    trace = simulate(args.algorithm, args.stages, args.microbatches, args.minibatches, costs=costs, **options)
    written = []
    # Files first, so that an unwritable path fails before anything is printed.
    for path, write, what in ((args.png, trace.plot, "timeline"), (args.chrome, trace.to_chrome_trace, "Chrome trace")):
        if path:
            try:
                write(path)
            except OSError as error:
                raise ValueError(f"cannot write {path}: {error.strerror or error}") from None
            written.append(f"wrote {what} to {path}")
    if not args.no_grid:
        print(trace.grid())
        print()
    print(trace.summary())
    for line in written:
        print(line)
    return 0
