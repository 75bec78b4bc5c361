"""What taking failed steps back costs: step time with ``recover=True`` (the default) over ``recover=False``.

``python bench/recovery.py [--out bench/results/recovery-cpu.json]``

With ``recover=True`` each stage copies its live weights and optimizer state once per step (before its first
update of the step) and its buffers, so that a failed step can be undone. The model is bench/engine.py's
concurrent one: 2 stages in one process, each on its own thread, 8 x (Linear(512) + ReLU), m = 8, SGD with
momentum, float32, one intra-op thread per stage thread. Both settings are timed in the same rounds (a window
of steps each, in alternating order); the ratio is the median of per-round ratios (above 1: recovery costs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipecore  # noqa: E402
from _machine import machine, write_report  # noqa: E402


def model(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(width, 10))


def pipeline(args: argparse.Namespace, algorithm: str, recover: bool) -> pipecore.Pipeline:
    return pipecore.Pipeline(model(args.width, args.layers), 2, algorithm, args.microbatches, recover=recover,
                             optimizer=pipecore.SGD(lr=0.001, momentum=0.9), loss_fn=nn.CrossEntropyLoss())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batches", default="256,1024", help="comma-separated mini-batch sizes")
    parser.add_argument("--algorithms", default="1f1b,2bw,pipedream")
    parser.add_argument("--window", type=int, default=3, help="steps per timed window")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "recovery-cpu.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for batch in map(int, args.batches.split(",")):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch, args.width, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        for algorithm in args.algorithms.split(","):
            pipes = {flag: pipeline(args, algorithm, flag) for flag in (True, False)}
            for pipe in pipes.values():
                for _ in range(3):
                    pipe.step(x, y)
            seconds: dict[bool, list[float]] = {True: [], False: []}
            for r in range(args.rounds):
                for flag in ((True, False) if r % 2 == 0 else (False, True)):
                    pipe = pipes[flag]
                    start = time.perf_counter()
                    for _ in range(args.window):
                        pipe.step(x, y)
                    pipe.synchronize()
                    seconds[flag].append((time.perf_counter() - start) / args.window)
            for pipe in pipes.values():
                pipe.close()
            ratio = statistics.median(a / b for a, b in zip(seconds[True], seconds[False]))
            row = {"algorithm": algorithm, "batch": batch, "recover_over_not": round(ratio, 3),
                   "step_ms_recover": round(1e3 * statistics.median(seconds[True]), 2),
                   "step_ms_not": round(1e3 * statistics.median(seconds[False]), 2)}
            rows.append(row)
            print(f"batch {batch:>5}  {algorithm:<10}  recover/not {ratio:.3f}  "
                  f"({row['step_ms_recover']:.1f} ms vs {row['step_ms_not']:.1f} ms per step)", flush=True)
    sizes = {k: v for k, v in vars(args).items() if k != "out"}
    report = {
        "benchmark": "recovery", "command": "python bench/recovery.py", "machine": machine(), "device": "cpu",
        "dtype": "float32", "model": f"{args.layers} x (Linear({args.width},{args.width}) + ReLU), 2 stages, "
        f"{args.microbatches} micro-batches, one thread per stage", "sizes": sizes, "results": rows,
    }
    print(f"wrote {write_report(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
