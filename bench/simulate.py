"""Simulator speed: one P x m x n simulation per algorithm, median of several runs.

Usage: ``python bench/simulate.py [--stages 16] [--microbatches 64] [--minibatches 4] [--repeats 5]
[--out PATH]``. Times ``pipecore.simulate`` (schedule generation, validation,
execution and trace construction) and, separately, the trace analysis behind ``pipecore simulate``'s
output (grid and summary). Writes JSON with the machine, the sizes and per-algorithm seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from _machine import OUT_HELP, default_out, machine, write_report  # noqa: E402
from pipecore import algorithm_names, simulate  # noqa: E402

TARGET_SECONDS = 0.5


def time_one(name: str, P: int, m: int, n: int, repeats: int) -> dict[str, object]:
    """Median and all run times of simulate() and of the grid+summary for one algorithm."""
    simulate(name, P, m, n)  # warm-up: imports, caches
    sim, report = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        trace = simulate(name, P, m, n)
        middle = time.perf_counter()
        trace.grid()
        trace.summary()
        end = time.perf_counter()
        sim.append(middle - start)
        report.append(end - middle)
    return {
        "seconds": statistics.median(sim),
        "runs": sim,
        "report_seconds": statistics.median(report),
        "actions": len(trace.events),
        "under_target": statistics.median(sim) < TARGET_SECONDS,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=default_out("simulate-cpu.json"), help=OUT_HELP)
    args = parser.parse_args(argv)
    P, m, n = args.stages, args.microbatches, args.minibatches

    results = {}
    for name in algorithm_names():
        results[name] = time_one(name, P, m, n, args.repeats)
        r = results[name]
        print(f"{name:12s} {r['seconds']:.3f} s  ({r['actions']} actions; grid+summary {r['report_seconds']:.3f} s)"
              f"{'' if r['under_target'] else '  ABOVE TARGET'}")
    payload = {
        "benchmark": "simulate",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "sizes": {"stages": P, "microbatches": m, "minibatches": n},
        "repeats": args.repeats,
        "statistic": "median",
        "target_seconds": TARGET_SECONDS,
        "algorithms": results,
    }
    print(f"wrote {write_report(payload, args.out)}")
    return 0 if all(r["under_target"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
