"""What the pipeline's bookkeeping costs: step time with the defaults over step time without each of
``recover`` (undoing failed steps) and ``track_memory`` (the CPU memory account), and without both.

``python bench/bookkeeping.py [--batches 256,1024] [--algorithms 1f1b,2bw,pipedream] [--rounds 9]
[--out PATH]``

* ``recover=True`` (default): each stage copies its optimizer state once per step (before its first
  update of the step), its live weights of then unless the weight ring still holds them when the step
  completes (1f1b updates in place and always copies them; 2bw mostly does not), and its buffers, so that a
  failed step can be undone.
* ``track_memory=True`` (the default until it became opt-in, issue 35): each CPU stage counts what its forwards save for the backward
  (``stats()[s]["peak_bytes"]``) through saved-tensor hooks: a Python call per saved tensor in every forward
  and backward, and with stages on threads a wait for the GIL inside the backward.

The model is bench/engine.py's concurrent one: 2 stages in one process, each on its own thread, 8 x
(Linear(512) + ReLU), m = 8, SGD with momentum, float32, one intra-op thread per stage thread. The four
settings are timed in the same rounds (a window of steps each, in an order rotated every round); each ratio is
the median of per-round ratios (above 1: the bookkeeping costs that much).
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
from _machine import OUT_HELP, default_out, machine, write_report  # noqa: E402

DEFAULTS = "defaults"
# Each setting's keyword arguments; both kept first (named "defaults" as in the results written before
# track_memory became opt-in: the default is now "track_memory=False").
SETTINGS: dict[str, dict[str, bool]] = {
    DEFAULTS: {"recover": True, "track_memory": True},
    "recover=False": {"recover": False, "track_memory": True},
    "track_memory=False": {"recover": True, "track_memory": False},
    "neither": {"recover": False, "track_memory": False},
}


def model(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(width, 10))


def pipeline(args: argparse.Namespace, algorithm: str, options: dict[str, bool]) -> pipecore.Pipeline:
    return pipecore.Pipeline(model(args.width, args.layers), 2, algorithm, args.microbatches,
                             optimizer=pipecore.SGD(lr=0.001, momentum=0.9), loss_fn=nn.CrossEntropyLoss(),
                             **options)


def time_settings(args: argparse.Namespace, algorithm: str, x: torch.Tensor, y: torch.Tensor
                  ) -> dict[str, list[float]]:
    """Seconds per step of every setting, per round."""
    pipes = {name: pipeline(args, algorithm, options) for name, options in SETTINGS.items()}
    for pipe in pipes.values():
        for _ in range(3):
            pipe.step(x, y)
    seconds: dict[str, list[float]] = {name: [] for name in pipes}
    names = list(pipes)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            pipe = pipes[name]
            start = time.perf_counter()
            for _ in range(args.window):
                pipe.step(x, y)
            pipe.synchronize()
            seconds[name].append((time.perf_counter() - start) / args.window)
    for pipe in pipes.values():
        pipe.close()
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batches", default="256,1024", help="comma-separated mini-batch sizes")
    parser.add_argument("--algorithms", default="1f1b,2bw,pipedream")
    parser.add_argument("--window", type=int, default=3, help="steps per timed window")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default=default_out("bookkeeping-cpu.json"), help=OUT_HELP)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for batch in map(int, args.batches.split(",")):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch, args.width, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        for algorithm in args.algorithms.split(","):
            seconds = time_settings(args, algorithm, x, y)
            over = {name: round(statistics.median(a / b for a, b in zip(seconds[DEFAULTS], seconds[name])), 3)
                    for name in SETTINGS if name != DEFAULTS}
            row = {"algorithm": algorithm, "batch": batch, "defaults_over": over,
                   "step_ms": {name: round(1e3 * statistics.median(s), 2) for name, s in seconds.items()}}
            rows.append(row)
            print(f"batch {batch:>5}  {algorithm:<10}  defaults over " +
                  ", ".join(f"{name} {ratio:.3f}" for name, ratio in over.items()) +
                  f"  ({row['step_ms'][DEFAULTS]:.1f} ms per step with the defaults)", flush=True)
    sizes = {k: v for k, v in vars(args).items() if k != "out"}
    report = {
        "benchmark": "bookkeeping", "command": "python bench/bookkeeping.py", "machine": machine(), "device": "cpu",
        "dtype": "float32", "model": f"{args.layers} x (Linear({args.width},{args.width}) + ReLU), 2 stages, "
        f"{args.microbatches} micro-batches, one thread per stage", "sizes": sizes,
        "settings": {name: options for name, options in SETTINGS.items()},
        "statistic": "defaults_over[setting]: median over rounds of (defaults' step time / the setting's)",
        "results": rows,
    }
    print(f"wrote {write_report(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
