"""Simulator speed in process CPU time: the first and the warm ``simulate()`` of every algorithm.

Usage: ``python bench/simulate_speed.py [--stages 16] [--microbatches 64] [--minibatches 4] [--repeats 5]
[--algorithms NAME ...] [--baseline DIR] [--out PATH]``.

Each algorithm runs in a fresh process (imports done before timing), which times ``simulate(name, P, m, n)``
(``stages_per_rank=2`` for zb-v and dualpipe-v) with ``time.process_time()``: the first call, which pays the
one-time work (generating the schedule and validating it, which later calls find cached), then ``--repeats``
more. ``warm`` is the least of those (CPU time on a shared machine only grows with the load), with their
median and all runs beside it. ``--baseline DIR`` times another checkout's ``pipecore`` (``DIR/pipecore``) the same
way, alternating with this one, and reports both: a before/after comparison under the same load.
Writes JSON with the machine (``platform``), the sizes and, per algorithm, the seconds and the actions run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from _machine import OUT_HELP, default_out, machine, write_report  # noqa: E402

TARGET_SECONDS = 0.2
TWO_PER_RANK = ("zb-v", "dualpipe-v")  # V-shaped: two stages per rank, always

# Run in a child process: times one algorithm and prints JSON. Imports first, so that they are not timed.
_CHILD = r"""
import json, sys, time
from pipecore.simulate import simulate
name, P, m, n, repeats = sys.argv[1], *map(int, sys.argv[2:6])
options = {"stages_per_rank": 2} if name in %r else {}
runs = []
for _ in range(repeats + 1):
    start = time.process_time()
    trace = simulate(name, P, m, n, **options)
    runs.append(time.process_time() - start)
    actions = len(trace.events)
    del trace
print(json.dumps({"runs": runs, "actions": actions, "options": options}))
""" % (TWO_PER_RANK,)


def time_algorithm(checkout: Path, name: str, P: int, m: int, n: int, repeats: int) -> dict[str, object]:
    """First and warm process-CPU seconds of simulate() for ``name``, in a fresh process importing
    ``checkout/pipecore``."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    done = subprocess.run([sys.executable, "-c", _CHILD, name, str(P), str(m), str(n), str(repeats)],
                          env=env, cwd=checkout, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"timing {name} under {checkout} failed:\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    runs = result["runs"]
    warm = runs[1:]
    return {
        "first_seconds": runs[0],
        "second_seconds": warm[0],
        "warm_seconds": min(warm),
        "warm_median_seconds": statistics.median(warm),
        "warm_runs": warm,
        "actions": result["actions"],
        "options": result["options"],
        "warm_under_target": min(warm) < TARGET_SECONDS,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="warm calls after the first (default 5)")
    parser.add_argument("--algorithms", nargs="*", default=None, help="default: all")
    parser.add_argument("--baseline", default=None, help="another checkout to time the same way (before/after)")
    parser.add_argument("--out", default=default_out("simulate-speed.json"), help=OUT_HELP)
    args = parser.parse_args(argv)
    P, m, n = args.stages, args.microbatches, args.minibatches

    from pipecore import algorithm_names

    names = args.algorithms or algorithm_names()
    checkouts = {"pipecore": ROOT}
    if args.baseline is not None:
        checkouts = {"baseline": Path(args.baseline).resolve(), "pipecore": ROOT}
    results: dict[str, dict[str, object]] = {label: {} for label in checkouts}
    print(f"simulate({P} stages, {m} micro-batches, {n} mini-batches): process CPU seconds, first call and warm "
          f"(least of {args.repeats})")
    for name in names:
        for label, checkout in checkouts.items():  # alternating, so that both see the same load
            results[label][name] = time_algorithm(checkout, name, P, m, n, args.repeats)
        line = f"  {name:<17}"
        for label in checkouts:
            r = results[label][name]
            line += f" {label}: first {r['first_seconds']:.3f} warm {r['warm_seconds']:.3f} (median " \
                    f"{r['warm_median_seconds']:.3f})"
        if "baseline" in results:
            line += f"  x{results['baseline'][name]['warm_seconds'] / results['pipecore'][name]['warm_seconds']:.1f}"
        print(line + f"  [{results['pipecore'][name]['actions']} actions]", flush=True)
    slowest = max(r["warm_seconds"] for r in results["pipecore"].values())
    print(f"slowest warm: {slowest:.3f} s (target {TARGET_SECONDS} s)")

    report = {
        "benchmark": "simulate-speed",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "sizes": {"num_stages": P, "n_microbatches": m, "n_minibatches": n,
                  "stages_per_rank": {name: 2 for name in TWO_PER_RANK}},
        "clock": "time.process_time() of the process running simulate(); one fresh process per algorithm",
        "repeats": args.repeats,
        "target_seconds": TARGET_SECONDS,
        "results": results["pipecore"],
        "slowest_warm_seconds": slowest,
    }
    if "baseline" in results:
        report["baseline"] = {"checkout": str(checkouts["baseline"]), "results": results["baseline"]}
    path = write_report(report, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
