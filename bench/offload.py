"""Activation offload on CUDA: what a plan predicts against what training measures (needs a GPU).

``python bench/offload.py [--layers 8] [--width 512] [--block 256] [--batch 64] [--fraction 0.6]
[--out PATH]``

A GPT (``--layers`` blocks of width ``--width``, ``--block`` tokens, a vocabulary of 256) as one stage on one
GPU, so that the device's allocator peak (``torch.cuda.max_memory_allocated``) is the stage's; gpipe with 4
micro-batches, all 4 in flight at the stage, SGD with momentum, float32. The model is profiled on the GPU (which
measures the link to pinned host memory), then planned three ways at the same batch:

* ``plain``: nothing recomputed or offloaded;
* ``recompute``: the memory planner at ``--fraction`` of the plain plan's predicted peak, the link taken as
  absent (``host_bytes_per_s=0``): it may only recompute;
* ``offload``: the memory planner at the same limit with the measured link: it may offload and recompute.

Each trains 3 warm-up steps, then ``--steps`` steps timed with the device synchronised; the peak is read over the
timed steps after ``torch.cuda.reset_peak_memory_stats``. The pipeline is built with the model on the CPU and
``devices=[cuda]``, so that the device holds nothing but the pipeline's own tensors and the data, and with
``recover=False``, as the plans are made (without the copies that undo a failed step). Reported per
configuration: predicted and measured peak bytes, predicted seconds per micro-batch and measured seconds per
step, and the segments chosen; and the measured reductions of the peak against the predicted ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipecore  # noqa: E402
from _machine import OUT_HELP, default_out, machine, write_report  # noqa: E402
from pipecore.models import GPT  # noqa: E402
from pipecore.planning import plan_costs, profile  # noqa: E402

VOCAB, M = 256, 4


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--block", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=64, help="sequences per mini-batch (4 micro-batches)")
    parser.add_argument("--fraction", type=float, default=0.6, help="the limit, as a fraction of the plain peak")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=default_out("offload-cuda.json"), help=OUT_HELP)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/offload.py needs a CUDA device: activation offload does not apply on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())

    def gpt() -> nn.Module:
        torch.manual_seed(0)
        return GPT(VOCAB, args.block, n_layer=args.layers, n_head=8, n_embd=args.width)

    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, VOCAB, (args.batch, args.block), generator=g),
             torch.randint(0, VOCAB, (args.batch, args.block), generator=g)) for _ in range(args.steps)]
    optimizer = pipecore.SGD(lr=0.01, momentum=0.9)
    micro = args.batch // M
    costs = profile(gpt().to(device), data[0][0][:micro].to(device), optimizer=optimizer, loss_fn=loss_fn,
                    example_target=data[0][1][:micro].to(device))
    plain = plan_costs(costs, 1, "gpipe", args.batch, M, None, "parameters", recover=False)
    limit = int(args.fraction * plain.stage_memory[0])
    without_link = dataclasses.replace(costs, host_bytes_per_s=0.0)
    plans = {
        "plain": plain,
        "recompute": plan_costs(without_link, 1, "gpipe", args.batch, M, limit, "memory", recover=False),
        "offload": plan_costs(costs, 1, "gpipe", args.batch, M, limit, "memory", recover=False),
    }
    results = {}
    for name, plan in plans.items():
        torch.cuda.empty_cache()
        pipe = pipecore.Pipeline(gpt(), 1, "gpipe", M, loss_fn=loss_fn, partition=plan, optimizer=optimizer,
                                 devices=[str(device)], recover=False)
        for x, y in data[:3]:
            pipe.step(x, y)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        seconds = []
        for x, y in data:
            start = time.perf_counter()
            pipe.step(x, y)
            torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated(device)
        pipe.close()
        del pipe
        results[name] = {
            "predicted_peak_bytes": plan.stage_memory[0], "measured_peak_bytes": peak,
            "predicted_seconds_per_microbatch": plan.stage_time[0],
            "measured_seconds_per_step": statistics.median(seconds),
            "recomputed": [list(s) for s in plan.recomputed[0]], "offloaded": [list(s) for s in plan.offloaded[0]],
        }
        print(f"{name:<10} peak {peak / 2 ** 20:9.2f} MiB (predicted {plan.stage_memory[0] / 2 ** 20:9.2f})  "
              f"{1e3 * statistics.median(seconds):8.2f} ms/step (predicted {4e3 * plan.stage_time[0]:8.2f} for "
              f"{M} micro-batches)  recomputed {len(plan.recomputed[0])}, offloaded {len(plan.offloaded[0])}",
              flush=True)
    for name in ("recompute", "offload"):
        results[name]["peak_reduction"] = {
            "predicted": plain.stage_memory[0] - results[name]["predicted_peak_bytes"],
            "measured": results["plain"]["measured_peak_bytes"] - results[name]["measured_peak_bytes"]}
    report = {"benchmark": "offload", "command": "python bench/offload.py " + " ".join(argv or sys.argv[1:]),
              "machine": machine(), "device": torch.cuda.get_device_name(device), "dtype": "float32",
              "model": f"GPT {args.layers} blocks, width {args.width}, {args.block} tokens, vocabulary {VOCAB}",
              "stages": 1, "algorithm": "gpipe", "microbatches": M, "batch": args.batch, "limit_bytes": limit,
              "host_bytes_per_s": costs.host_bytes_per_s, "results": results}
    print(f"wrote {write_report(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
