"""How many dtype casts one training step runs under bf16 autocast: plain torch and pipecore.

``python bench/autocast_casts.py [--microbatches 8] [--stages 4] [--out PATH]``

On the GPU, pipecore 1f1b with bf16 autocast was slower than with float32 (bench/results/gpu-h100.json) while
plain torch gets faster. One reason is visible on the CPU as a count of operations, not a time: autocast keeps
each weight's cast in a cache that is emptied when the outermost autocast context exits. Plain training with
gradient accumulation enters one context for the step, so each weight is cast once per step; a context per
micro-batch casts every weight once per micro-batch. The script counts ``aten::_to_copy`` calls (the casts)
with torch's profiler for: plain torch with one context per step, plain torch with one per micro-batch, and
pipecore 1f1b with ``autocast=torch.bfloat16``. The difference between the first two is the weight casts that
a per-step context saves: ``(microbatches - 1) x weights``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import OUT_HELP, default_out, machine, write_report  # noqa: E402

import pipecore  # noqa: E402

WIDTH, LAYERS, BATCH = 64, 8, 64


def _mlp() -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])


def _casts(step) -> int:
    """``aten::_to_copy`` calls in one step (after one step that warms up)."""
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--out", default=default_out("autocast-casts-cpu.json"), help=OUT_HELP)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    loss_fn = nn.MSELoss()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    m = args.microbatches

    def plain_one_context() -> None:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for xs, ys in zip(x.chunk(m), y.chunk(m)):
                loss_fn(model(xs).float(), ys).backward()
        opt.step()

    def plain_context_per_microbatch() -> None:
        opt.zero_grad()
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model(xs).float(), ys)
            loss.backward()
        opt.step()

    pipe = pipecore.Pipeline(_mlp(), num_stages=args.stages, algorithm="1f1b", n_microbatches=m, loss_fn=loss_fn,
                             optimizer=pipecore.SGD(lr=0.01), example_input=x, autocast=torch.bfloat16)
    weights = sum(1 for _ in model.parameters())
    results = {
        "plain, one autocast context per step": _casts(plain_one_context),
        "plain, one autocast context per micro-batch": _casts(plain_context_per_microbatch),
        "pipecore 1f1b": _casts(lambda: pipe.step(x, y)),
    }
    for name, count in results.items():
        print(f"{name:45s} {count:5d} casts per step")
    print(f"weights: {weights}; a context per micro-batch re-casts them {m - 1} more times: "
          f"{(m - 1) * weights} casts")
    report = {"benchmark": "autocast_casts", "command": "python bench/autocast_casts.py " + " ".join(argv or sys.argv[1:]),
              "machine": machine(), "device": "cpu", "dtype": "bfloat16 autocast, float32 weights",
              "model": f"MLP {LAYERS} x Linear({WIDTH}, {WIDTH}) + ReLU", "batch": BATCH, "microbatches": m,
              "stages": args.stages, "weights": weights, "casts_per_step": results}
    print(f"wrote {write_report(report, args.out)}")
    return report


if __name__ == "__main__":
    main()
