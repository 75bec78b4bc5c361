"""Capture time: ``torch.fx.symbolic_trace`` (what pipecore uses) against ``torch.export.export``.

For each model of ``pipecore.models``, each capture runs in a fresh subprocess (so neither pays for the
other's imports or caches) and is timed around the call alone; the JSON keeps every repetition.

    python bench/capture.py            # writes bench/results/capture-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _machine import machine, write_report  # noqa: E402

MODELS = {
    "gpt": ("GPT(vocab_size=96, block_size=64, n_layer=4, n_head=4, n_embd=128)", "(torch.randint(0, 96, (2, 64)),)"),
    "resnet": ("ResNet()", "(torch.randn(2, 64),)"),
    "encoder": ("Encoder(96, 64, 3)", "(torch.randint(0, 96, (2, 64)), torch.ones(2, 64, dtype=torch.bool))"),
}

_CHILD = """
import json, time, torch
from pipecore.models import GPT, ResNet, Encoder
model, args = {model}, {args}
t0 = time.perf_counter()
if {export!r}:
    torch.export.export(model, args)
else:
    torch.fx.symbolic_trace(model)
print(json.dumps(time.perf_counter() - t0))
"""


def capture_seconds(name: str, export: bool) -> float:
    model, args = MODELS[name]
    code = _CHILD.format(model=model, args=args, export=export)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "capture-cpu.json"))
    args = parser.parse_args()
    results = {}
    print(f"{'model':<8} {'torch.fx s':>11} {'torch.export s':>15}")
    for name in MODELS:
        fx = [capture_seconds(name, False) for _ in range(args.repeats)]
        ex = [capture_seconds(name, True) for _ in range(args.repeats)]
        results[name] = {"model": MODELS[name][0], "fx_seconds": fx, "export_seconds": ex,
                         "fx_median": statistics.median(fx), "export_median": statistics.median(ex)}
        print(f"{name:<8} {statistics.median(fx):>11.3f} {statistics.median(ex):>15.3f}")
    report = {"benchmark": "capture", "device": "cpu", "dtype": "float32", "machine": machine(),
              "repeats": args.repeats, "statistic": "median of repeats, each in a fresh process", "results": results}
    print(f"wrote {write_report(report, args.out)}")


if __name__ == "__main__":
    main()
