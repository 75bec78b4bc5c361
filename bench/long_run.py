"""A long asynchronous run without flush(): does the step cost or the memory grow with the step count?

    python bench/long_run.py [--steps 16384] [--algorithm 2bw] [--out PATH]

A tiny model (4 x Linear(8, 8), 2 stages, 8 micro-batches, float32, one thread), so that the runtime's own
cost is what is measured. At every power of two from 512 steps it records the mean step time so far, the
slowest single step so far, the Python objects the garbage collector tracks, and the process's peak RSS.
A runtime whose state grows with the steps shows rising objects and RSS and ever slower worst steps.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time

import torch
from torch import nn
from tqdm import tqdm

from _machine import OUT_HELP, default_out, machine, write_report


def run(algorithm: str, steps: int) -> list[dict]:
    import pipecore

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    x, y = torch.randn(64, 8), torch.randn(64, 8)
    pipe = pipecore.Pipeline(model, 2, algorithm, 8, loss_fn=nn.MSELoss())
    pipe.step(x, y)  # the first step imports torch's lazily loaded modules; not part of the question
    rows, total, worst = [], 0.0, 0.0
    for i in tqdm(range(1, steps + 1), desc=algorithm, file=sys.stderr, mininterval=2.0):
        start = time.perf_counter()
        pipe.step(x, y)
        took = time.perf_counter() - start
        total, worst = total + took, max(worst, took)
        if i >= 512 and i & (i - 1) == 0:
            rows.append({
                "steps": i, "mean_step_ms": 1e3 * total / i, "worst_step_ms": 1e3 * worst,
                "gc_tracked_objects": len(gc.get_objects()),
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            })
    pipe.flush()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16384)
    parser.add_argument("--algorithm", default="2bw")
    parser.add_argument("--out", default=default_out("long-run-cpu.json"), help=OUT_HELP)
    args = parser.parse_args()
    if args.steps < 512:
        raise SystemExit(f"--steps must be at least 512 (the first checkpoint), got {args.steps}")
    torch.set_num_threads(1)
    rows = run(args.algorithm, args.steps)
    print(f"{'steps':>8}{'mean step ms':>14}{'worst step ms':>15}{'GC objects':>12}{'peak RSS MiB':>14}")
    for r in rows:
        print(f"{r['steps']:>8}{r['mean_step_ms']:>14.2f}{r['worst_step_ms']:>15.1f}{r['gc_tracked_objects']:>12}"
              f"{r['peak_rss_mib']:>14.0f}")
    report = {
        "benchmark": "long_run", "device": "cpu", "dtype": "float32", "machine": machine(),
        "algorithm": args.algorithm, "num_stages": 2, "n_microbatches": 8, "batch": 64,
        "model": "4 x Linear(8, 8)", "flush": "none until the end", "results": rows,
    }
    print(f"wrote {write_report(report, args.out)}", file=sys.stderr)


if __name__ == "__main__":
    main()
