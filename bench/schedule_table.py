"""The modern schedules' simulated bubble and activation memory against the published figures.

Usage: ``python bench/schedule_table.py [--ranks 4] [--microbatches 8,16] [--out PATH]``.

Every schedule runs one mini-batch on ``--ranks`` ranks with F = B = W = 1 per rank's share of the model and no
send time (a backward that is not split costs B + W = 2; a rank holding ``v`` chunks spends ``1/v`` on each
chunk's action, so that makespans compare). ``b = (p-1)/(m+p-1)`` is 1F1B's bubble. Activations are the most a rank holds at
once, counted in micro-batches of the rank's share of the model (a rank with ``v`` chunks holds ``1/v`` of a
micro-batch's activations per chunk), so that they compare with 1F1B's ``p``. Prints a Markdown table (the
one in docs/simulator.md) and writes JSON with the machine and every figure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from _machine import OUT_HELP, default_out, machine, write_report  # noqa: E402
from pipecore import simulate  # noqa: E402

COSTS = {"forward": 1, "backward": 1, "weight": 1}
#: (label, algorithm, stages per rank, the published expectation)
SCHEDULES = [
    ("1F1B", "1f1b", 1, "b"),
    ("interleaved 1F1B, v=2", "interleaved-1f1b", 2, "about b/2"),
    ("looped BFS, v=2", "looped-bfs", 2, "about b/2, all m in flight"),
    ("ZB-H1", "zb-h1", 1, "about b/3, 1F1B's memory"),
    ("ZB1P (ZB-H1, v=2)", "zb-h1", 2, "below ZB-H1"),
    ("ZB-V", "zb-v", 2, "about 0 for m >= 2p, 1F1B's memory"),
    ("DualPipeV", "dualpipe-v", 2, "below 1F1B"),
]


def row(label: str, name: str, v: int, expected: str, ranks: int, m: int) -> dict[str, object]:
    options = {} if v == 1 else {"stages_per_rank": v}
    t = simulate(name, ranks * v, m, 1, costs={key: cost / v for key, cost in COSTS.items()}, **options)
    b = (ranks - 1) / (m + ranks - 1)
    return {
        "schedule": label, "algorithm": name, "stages_per_rank": v, "ranks": ranks, "microbatches": m,
        "makespan": t.makespan, "bubble": t.bubble_fraction, "bubble_over_b": t.bubble_fraction / b,
        "activations": max(t.rank_peak_activations(r) for r in range(t.num_ranks)) / v, "expected": expected,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", default="8,16", help="comma-separated micro-batch counts")
    parser.add_argument("--out", default=default_out("schedules-sim.json"), help=OUT_HELP)
    args = parser.parse_args()
    sizes = [int(v) for v in args.microbatches.split(",")]
    rows = [row(*spec, args.ranks, m) for m in sizes for spec in SCHEDULES]
    print(f"{args.ranks} ranks, one mini-batch, F = B = W = 1 per rank's share of the model; b = 1F1B's bubble; "
          "activations in micro-batches of a rank's share of the model")
    print()
    print("| schedule | m | makespan | bubble | bubble / b | activations per rank | published |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['schedule']} | {r['microbatches']} | {r['makespan']:g} | {r['bubble']:.3f} | "
              f"{r['bubble_over_b']:.2f} | {r['activations']:g} | {r['expected']} |")
    path = write_report({"benchmark": "schedule_table", "machine": machine(), "costs": COSTS, "ranks": args.ranks,
                         "microbatches": sizes, "rows": rows}, args.out)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
