"""Engine throughput: pipecore's local executor against plain sequential training of the same model.

Usage: ``python bench/engine.py [--width 512] [--layers 8] [--batch 256] [--microbatches 8] [--stages 4]
[--warmup 3] [--window 3] [--rounds 9] [--threads 1,2] [--out bench/results/engine-cpu.json]
[--profile ALGORITHM]``.

The model is ``layers x (Linear(width, width) + ReLU)`` in float32 on the CPU, trained with cross-entropy on
random data. *Sequential* is what a user writes without pipecore: per micro-batch forward, ``loss / m``,
backward; then ``torch.optim.SGD(momentum=0.9, foreach=True).step()`` and ``zero_grad()`` (the same math as
pipecore's ``gpipe``). Every pipecore algorithm trains its own copy of the model as ``--stages`` stages with
``pipecore.SGD(momentum=0.9)``. All configurations run in one process with one thread count.

Timing: ``--warmup`` steps per configuration are excluded; then ``--rounds`` rounds each time one window of
``--window`` steps of every configuration in turn (interleaved, so that load from other processes hits all
of them alike); a configuration's samples/s is the median over its windows, and its ratio is that over the
sequential median. The local executor runs all stages in one process, so the ideal ratio is 1.0: what is
lost is the engine's overhead (plus derived-weight work for the algorithms that compute it). Each thread
count in ``--threads`` (default 1 and torch's default) is one run. The engine's fixed overhead is measured
separately: the step-time difference to sequential for the same model at ``--overhead-width`` (16), where
compute is negligible.

It also checks ``Pipeline.stats()``'s weight-version bytes per stage against each algorithm's formula
(versions per stage x parameters x 4 bytes; TiMePReSt and I-TiMePReSt: the versions the simulator
reports), and that gpipe's weights equal sequential training's after a few steps.

``--profile NAME`` instead runs cProfile over steps of one configuration (``sequential`` or an algorithm)
and prints the functions with the most time per step.
"""

from __future__ import annotations

import argparse
import cProfile
import copy
import os
import pstats
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402
from torch import nn  # noqa: E402

import pipecore  # noqa: E402
from _machine import machine, write_report  # noqa: E402

TARGET_RATIO = 0.9  # gpipe and 1f1b: engine overhead at most 10%
TARGET_ALGORITHMS = ("gpipe", "1f1b")
LR = 1e-3


def make_model(width: int, layers: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    modules: list[nn.Module] = []
    for _ in range(layers):
        modules += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*modules)


@dataclass
class Config:
    """One timed configuration: a name and a function training one mini-batch."""

    name: str
    step: Callable[[torch.Tensor, torch.Tensor], object]
    pipe: pipecore.Pipeline | None = None


def sequential_trainer(model: nn.Module, m: int) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """Plain training with gradient accumulation over ``m`` micro-batches (gpipe's math)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, foreach=True)
    loss_fn = nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        total = 0.0
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            loss = loss_fn(model(xs), ys)
            (loss / m).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total / m

    return step


def pipeline(name: str, model: nn.Module, stages: int, m: int) -> pipecore.Pipeline:
    return pipecore.Pipeline(model, stages, algorithm=name, n_microbatches=m,
                             optimizer=pipecore.SGD(lr=LR, momentum=0.9), loss_fn=nn.CrossEntropyLoss())


def expected_versions(name: str, stages: int, m: int) -> list[int]:
    """Weight versions per stage by each algorithm's formula (the simulator's count for TiMePReSt, I-TiMePReSt)."""
    if name in ("gpipe", "1f1b", "pipemare", "spectrain", "v-timeprest"):
        return [1] * stages
    if name == "2bw":
        return [2] * stages
    if name == "pipedream":
        return [stages - s for s in range(stages)]
    trace = pipecore.simulate(name, stages, m, 4 * stages)
    return [trace.weight_versions(s) for s in range(stages)]


def check_bytes(pipe: pipecore.Pipeline, name: str, stages: int, m: int) -> dict[str, object]:
    """Weight-version bytes per stage from stats() against the formula."""
    stats = pipe.stats()
    versions = expected_versions(name, stages, m)
    expected = [v * st["parameters"] * 4 for v, st in zip(versions, stats)]
    measured = [st["weight_version_bytes"] for st in stats]
    return {"versions_per_stage": [st["weight_versions"] for st in stats], "expected_versions": versions,
            "bytes_per_stage": measured, "expected_bytes": expected,
            "check": "ok" if measured == expected else "MISMATCH"}


def gpipe_matches_sequential(width: int, layers: int, batch: int, stages: int, m: int, steps: int = 3) -> float:
    """Largest absolute weight difference between gpipe and sequential training after ``steps`` steps."""
    reference, piped = make_model(width, layers), make_model(width, layers)
    step = sequential_trainer(reference, m)
    pipe = pipeline("gpipe", piped, stages, m)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(batch, width, generator=gen), torch.randint(0, width, (batch,), generator=gen)
        step(x, y)
        pipe.step(x, y)
    ref, got = reference.state_dict(), pipe.state_dict()
    return max(float((ref[k] - got[k]).abs().max()) for k in ref)


def build(names: list[str], width: int, layers: int, stages: int, m: int) -> list[Config]:
    """The sequential trainer and one pipeline per algorithm, each on its own copy of one initialisation."""
    base = make_model(width, layers)
    configs = [Config("sequential", sequential_trainer(copy.deepcopy(base), m))]
    for name in names:
        pipe = pipeline(name, copy.deepcopy(base), stages, m)
        configs.append(Config(name, pipe.step, pipe))
    return configs


def measure(configs: list[Config], batch: int, width: int, warmup: int, window: int,
            rounds: int) -> dict[str, list[float]]:
    """Samples/s of every window of every configuration, windows interleaved round by round."""
    gen = torch.Generator().manual_seed(2)
    data = [(torch.randn(batch, width, generator=gen), torch.randint(0, width, (batch,), generator=gen))
            for _ in range(window)]
    for c in configs:
        for i in range(warmup):
            c.step(*data[i % window])
    rates: dict[str, list[float]] = {c.name: [] for c in configs}
    for _ in range(rounds):
        for c in configs:
            start = time.perf_counter()
            for x, y in data:
                c.step(x, y)
            rates[c.name].append(window * batch / (time.perf_counter() - start))
    return rates


def run_benchmark(names: list[str], width: int, layers: int, batch: int, P: int, m: int, warmup: int, window: int,
                  rounds: int) -> dict[str, dict[str, object]]:
    """Per configuration: median samples/s, its ratio to sequential (of medians, and the median of the
    per-round ratios), all windows, and for pipelines the weight-version bytes check."""
    configs = build(names, width, layers, P, m)
    rates = measure(configs, batch, width, warmup, window, rounds)
    base = statistics.median(rates["sequential"])
    results: dict[str, dict[str, object]] = {}
    for c in configs:
        median = statistics.median(rates[c.name])
        paired = statistics.median(r / b for r, b in zip(rates[c.name], rates["sequential"]))
        entry: dict[str, object] = {
            "samples_per_s": round(median, 1), "ms_per_step": round(1e3 * batch / median, 2),
            "ratio": round(median / base, 3), "ratio_paired": round(paired, 3),
            "windows_samples_per_s": [round(r, 1) for r in rates[c.name]],
        }
        if c.pipe is not None:
            c.pipe.flush()
            entry.update(check_bytes(c.pipe, c.name, P, m))
        results[c.name] = entry
    return results


def profile(config: Config, batch: int, width: int, steps: int, top: int = 25) -> None:
    """cProfile ``steps`` steps of one configuration; print the top functions by own time, per step."""
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(batch, width, generator=gen), torch.randint(0, width, (batch,), generator=gen)
    for _ in range(3):
        config.step(x, y)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        config.step(x, y)
    profiler.disable()
    elapsed = time.perf_counter() - start
    print(f"{config.name}: {1e3 * elapsed / steps:.2f} ms per step under cProfile ({steps} steps)")
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]  # by tottime
    print(f"{'ms/step own':>11}  {'ms/step cum':>11}  {'calls/step':>10}  function")
    for (path, line, func), (_, calls, tottime, cumtime, _) in rows:
        where = f"{Path(path).name}:{line}" if line else path
        print(f"{1e3 * tottime / steps:>11.3f}  {1e3 * cumtime / steps:>11.3f}  {calls / steps:>10.1f}  "
              f"{func} ({where})")


def parse_threads(text: str | None) -> list[int]:
    """``--threads``: comma-separated thread counts; default 1 and torch's default (if more)."""
    if text is None:
        return sorted({1, torch.get_num_threads()})
    return [int(t) for t in text.split(",")]


def print_table(run: dict[str, object]) -> None:
    print(f"{'configuration':<13}  {'samples/s':>9}  {'ms/step':>7}  {'ratio':>5}  {'overhead':>8}  "
          f"{'versions/stage':<14}  {'bytes/stage':<40}  formula")
    for name, r in run["results"].items():
        versions = " ".join(map(str, r.get("versions_per_stage", []))) or "-"
        nbytes = " ".join(f"{b:,}" for b in r.get("bytes_per_stage", [])) or "-"
        overhead = run["overhead_ms_per_step"].get(name)
        print(f"{name:<13}  {r['samples_per_s']:>9,.0f}  {r['ms_per_step']:>7.2f}  {r['ratio']:>5.2f}  "
              f"{'-' if overhead is None else f'{overhead:+.2f}':>8}  {versions:<14}  {nbytes:<40}  "
              f"{r.get('check', '-')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8, help="Linear+ReLU blocks")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration")
    parser.add_argument("--window", type=int, default=3, help="steps per timed window")
    parser.add_argument("--rounds", type=int, default=9, help="timed windows per configuration")
    parser.add_argument("--threads", help="comma-separated torch thread counts, one run each (default: 1 and "
                                          "torch's default)")
    parser.add_argument("--overhead-width", type=int, default=16,
                        help="width of the tiny model whose step time difference is the engine's fixed overhead")
    parser.add_argument("--algorithms", help="comma-separated subset (default: all)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine-cpu.json"))
    parser.add_argument("--profile", metavar="NAME", help="profile one configuration instead of benchmarking")
    parser.add_argument("--profile-steps", type=int, default=20)
    args = parser.parse_args(argv)
    names = args.algorithms.split(",") if args.algorithms else pipecore.algorithm_names()
    P, m = args.stages, args.microbatches
    thread_counts = parse_threads(args.threads)

    if args.profile:
        torch.set_num_threads(thread_counts[-1])
        chosen = [] if args.profile == "sequential" else [args.profile]
        config = next(c for c in build(chosen, args.width, args.layers, P, m) if c.name == args.profile)
        profile(config, args.batch, args.width, args.profile_steps)
        return 0

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    diff = gpipe_matches_sequential(args.width, args.layers, args.batch, P, m)
    runs = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        results = run_benchmark(names, args.width, args.layers, args.batch, P, m, args.warmup, args.window, args.rounds)
        # The same model shrunk to --overhead-width: compute is negligible, the step-time difference to
        # sequential is what the engine adds per step.
        tiny = run_benchmark(names, args.overhead_width, args.layers, args.batch, P, m, args.warmup, 4 * args.window,
                             args.rounds)
        overhead = {n: round(tiny[n]["ms_per_step"] - tiny["sequential"]["ms_per_step"], 2)
                    for n in tiny if n != "sequential"}
        targets = {n: results[n]["ratio"] >= TARGET_RATIO for n in TARGET_ALGORITHMS if n in results}
        runs.append({"threads": threads, "results": results, "overhead_ms_per_step": overhead,
                     "overhead_sequential_ms_per_step": tiny["sequential"]["ms_per_step"], "target_met": targets})

    info = machine()
    info["load_average_1min"] = {"before": load_before, "after": info["load_average_1min"]}
    report = {
        "benchmark": "engine",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python bench/engine.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": info,
        "model": f"{args.layers} x (Linear({args.width},{args.width}) + ReLU), cross-entropy",
        "sizes": {"width": args.width, "layers": args.layers, "batch": args.batch, "microbatches": m,
                  "stages": P, "parameters": sum(p.numel() for p in make_model(args.width, args.layers).parameters()),
                  "overhead_width": args.overhead_width},
        "dtype": "float32",
        "device": "cpu",
        "timing": {"warmup_steps": args.warmup, "window_steps": args.window, "rounds": args.rounds,
                   "statistic": "median samples/s over windows, configurations interleaved; ratio = median / "
                                "sequential median; ratio_paired = median of per-round ratios"},
        "gpipe_vs_sequential_max_weight_diff": diff,
        "target": {"ratio": TARGET_RATIO, "algorithms": list(TARGET_ALGORITHMS)},
        "runs": runs,
    }
    out = write_report(report, args.out).resolve()

    print(f"{report['model']}, batch {args.batch} = {m} micro-batches, {P} stages, float32; "
          f"median of {args.rounds} windows of {args.window} steps; overhead: ms/step over sequential at width "
          f"{args.overhead_width}")
    print(f"gpipe vs sequential weights after 3 steps: max |diff| = {diff:.2e}")
    for run in runs:
        print(f"\n{run['threads']} thread{'s' if run['threads'] > 1 else ''}:")
        print_table(run)
        print("target (gpipe, 1f1b >= 0.9x sequential): "
              + ", ".join(f"{n} {'met' if ok else 'MISSED'}" for n, ok in run["target_met"].items()))
    print(f"\nwrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    checks = [r.get("check", "ok") for run in runs for r in run["results"].values()]
    return 0 if all(c == "ok" for c in checks) and diff < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
