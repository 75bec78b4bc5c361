"""Engine throughput: pipecore's local executor against plain sequential training of the same model.

Usage: ``python bench/engine.py [--only engine,graph,gpt] [--width 512] [--layers 8] [--batch 256]
[--microbatches 8] [--stages 4] [--warmup 3] [--window 3] [--rounds 9] [--graph-window 1] [--graph-rounds 40]
[--gpt-batch 32] [--gpt-window 1] [--gpt-rounds 15] [--threads 1,2] [--out bench/results/engine-cpu.json]
[--profile ALGORITHM]``.

Three parts (``--only`` selects some; default all three; a partial run writes ``engine-cpu-<parts>.json``
unless ``--out`` is given):

* ``engine``: every algorithm against plain sequential training of the MLP below (the original benchmark).
* ``graph``: the cost of the graph path. ``Pipeline`` captures every model with ``torch.fx`` and runs each
  stage as a generated ``torch.fx.GraphModule``. The reference is the same pipeline (same schedule, same
  weight ring, same optimizer) whose stage modules are replaced by ``nn.Sequential`` slices of the same layer
  objects under the same child names (so parameter names, the flat layout and the per-call parameter swap
  are unchanged; the ``_parameter_slots`` table is rebuilt as ``TensorStage.__init__`` builds it). A non-last
  stage's Sequential returns its output as a 1-tuple, as the generated module does (the values that cross
  the cut). Reported: the time per step ratio graph / Sequential for gpipe, 1f1b and 2bw (median over
  rounds of per-round ratios of adjacent windows, with range and quartiles); target: at most 1/0.95 (the
  graph path at least 0.95x as fast). The same pair is also run at ``--overhead-width``, where compute is
  negligible: the ms/step difference there is the graph path's fixed cost, and 1 + that cost / the
  Sequential step time at full width is the ratio it implies (far less noisy than timing 50 ms steps on a
  shared machine). Both run the same data in the same order, so their weights must end bit-identical
  (checked; the exit status is 1 otherwise).
* ``gpt``: ``pipecore.models.GPT(vocab_size=96, block_size=64, n_layer=4, n_head=4, n_embd=128)`` (LM head
  tied to the token embedding) as ``--stages`` stages (cut at ``blocks.1``, ``blocks.2``, ``blocks.3``) under
  gpipe, 1f1b and 2bw with ``pipecore.AdamW``, against plain sequential training of the same model (same
  micro-batches, loss / m, backward, then ``torch.optim.AdamW(foreach=True)``); token-level cross-entropy on
  random tokens, batch ``--gpt-batch`` sequences of 64 tokens.

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
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pipecore  # noqa: E402
from _machine import machine, write_report  # noqa: E402
from pipecore.models import GPT  # noqa: E402

TARGET_RATIO = 0.9  # gpipe and 1f1b: engine overhead at most 10%
TARGET_ALGORITHMS = ("gpipe", "1f1b")
LR = 1e-3
PARTS = ("engine", "graph", "gpt")
GRAPH_ALGORITHMS = ("gpipe", "1f1b", "2bw")
GRAPH_TARGET = 0.95  # the graph path at least 0.95x as fast as Sequential stage modules
GPT_ALGORITHMS = ("gpipe", "1f1b", "2bw")
GPT_SIZES = {"vocab_size": 96, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}
GPT_WEIGHT_DECAY = 0.01


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
    return accumulating_trainer(model, optimizer, nn.CrossEntropyLoss(), m)


def accumulating_trainer(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable, m: int
                         ) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """A step: per micro-batch forward, ``loss / m``, backward; then one optimizer step."""

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


def mlp_data(batch: int, width: int, window: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``window`` random mini-batches for the MLP (inputs, class targets)."""
    gen = torch.Generator().manual_seed(2)
    return [(torch.randn(batch, width, generator=gen), torch.randint(0, width, (batch,), generator=gen))
            for _ in range(window)]


def measure(configs: list[Config], data: list[tuple[torch.Tensor, torch.Tensor]], warmup: int, rounds: int,
            order: Callable[[int], list[Config]] | None = None) -> dict[str, list[float]]:
    """Samples/s of every window (one pass over ``data``) of every configuration, windows interleaved round by
    round (in ``order(round)`` if given, else in list order)."""
    window, batch = len(data), len(data[0][0])
    for c in configs:
        for i in range(warmup):
            c.step(*data[i % window])
    rates: dict[str, list[float]] = {c.name: [] for c in configs}
    for r in range(rounds):
        for c in (order(r) if order else configs):
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
    rates = measure(configs, mlp_data(batch, width, window), warmup, rounds)
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


# -- graph path vs Sequential stage modules ---------------------------------------------------------------


class TupleSequential(nn.Sequential):
    """An ``nn.Sequential`` that returns its output as a 1-tuple, as a non-last stage's generated module does
    (it returns the tuple of values that cross its cut)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:  # type: ignore[override]
        return (super().forward(x),)


def use_sequential_stage_modules(pipe: pipecore.Pipeline, model: nn.Sequential) -> None:
    """Replace every stage's generated GraphModule by an ``nn.Sequential`` of the same layer objects under the
    same child names, and rebuild the stage's parameter-swap table as ``TensorStage.__init__`` builds it.
    Parameter names, the flat layout, the weight ring and the optimizer stay exactly as they were."""
    last = pipe.num_stages - 1
    for s, st in pipe.stages.items():
        kind = nn.Sequential if s == last else TupleSequential
        module = kind(OrderedDict((name, model._modules[name]) for name in st.boundary.modules))
        names = [name for name, _ in module.named_parameters()]
        if names != list(st.layout.names):
            raise RuntimeError(f"stage {s}: the Sequential's parameters {names} are not the stage's {st.layout.names}")
        if any(module.get_submodule(n) is not st.module.get_submodule(n) for n in st.boundary.modules):
            raise RuntimeError(f"stage {s}: the generated module holds other layer objects than the model")
        index = {id(p): i for i, (_, p) in enumerate(module.named_parameters())}
        st._parameter_slots = [
            (module.get_submodule(full.rpartition(".")[0]), full.rpartition(".")[2], index[id(p)])
            for full, p in module.named_parameters(remove_duplicate=False)
        ]
        st.module = module


def run_graph_comparison(width: int, layers: int, batch: int, P: int, m: int, warmup: int, window: int,
                         rounds: int) -> dict[str, dict[str, object]]:
    """Per algorithm: the generated-GraphModule pipeline against the same pipeline with Sequential stage
    modules, windows interleaved (the pair's order alternates from round to round)."""
    base = make_model(width, layers)
    configs: list[Config] = []
    for name in GRAPH_ALGORITHMS:
        graph_model, seq_model = copy.deepcopy(base), copy.deepcopy(base)
        graph_pipe, seq_pipe = pipeline(name, graph_model, P, m), pipeline(name, seq_model, P, m)
        use_sequential_stage_modules(seq_pipe, seq_model)
        configs += [Config(f"{name}:graph", graph_pipe.step, graph_pipe),
                    Config(f"{name}:sequential", seq_pipe.step, seq_pipe)]

    def order(r: int) -> list[Config]:
        pairs = [configs[i: i + 2] for i in range(0, len(configs), 2)]
        return [c for pair in pairs for c in (pair if r % 2 == 0 else pair[::-1])]

    rates = measure(configs, mlp_data(batch, width, window), warmup, rounds, order)
    results: dict[str, dict[str, object]] = {}
    for name in GRAPH_ALGORITHMS:
        graph, seq = rates[f"{name}:graph"], rates[f"{name}:sequential"]
        ms_graph = [1e3 * batch / r for r in graph]  # ms per step, per window
        ms_seq = [1e3 * batch / r for r in seq]
        time_ratios = [g / q for g, q in zip(ms_graph, ms_seq)]  # graph time / Sequential time, per round
        quartiles = statistics.quantiles(time_ratios, n=4)
        median = statistics.median(time_ratios)
        states = []
        for c in configs:
            if c.name.startswith(name + ":"):
                assert c.pipe is not None
                c.pipe.flush()
                states.append(c.pipe.state_dict())
        diff = max(float((states[0][k] - states[1][k]).abs().max()) for k in states[0] if k != "pipecore")
        results[name] = {
            "graph_ms_per_step": round(statistics.median(ms_graph), 3),
            "sequential_modules_ms_per_step": round(statistics.median(ms_seq), 3),
            "time_ratio": round(median, 4),
            "time_ratio_range": [round(min(time_ratios), 4), round(max(time_ratios), 4)],
            "time_ratio_quartiles": [round(quartiles[0], 4), round(quartiles[2], 4)],
            "time_ratio_of_fastest_windows": round(min(ms_graph) / min(ms_seq), 4),
            "ms_per_step_difference": round(statistics.median(g - q for g, q in zip(ms_graph, ms_seq)), 3),
            "speed_ratio": round(1 / median, 4),
            "target_met": median <= 1 / GRAPH_TARGET,
            "max_weight_diff": diff,
            "windows_ms_per_step": {"graph": [round(t, 2) for t in ms_graph],
                                    "sequential_modules": [round(t, 2) for t in ms_seq]},
        }
    return results


def graph_part(width: int, overhead_width: int, layers: int, batch: int, P: int, m: int, warmup: int, window: int,
               rounds: int) -> dict[str, object]:
    """The graph comparison at ``width``, and at ``overhead_width`` where compute is negligible: there the
    per-round difference in ms/step is the graph path's fixed cost, which divided by the Sequential stage
    modules' ms/step at ``width`` gives the time ratio that cost implies (1 + cost / step time)."""
    full = run_graph_comparison(width, layers, batch, P, m, warmup, window, rounds)
    tiny = run_graph_comparison(overhead_width, layers, batch, P, m, warmup, 4 * window, rounds)
    for name, r in full.items():
        fixed = tiny[name]["ms_per_step_difference"]
        r["fixed_cost_ms_per_step"] = fixed
        r["time_ratio_implied_by_fixed_cost"] = round(1 + fixed / r["sequential_modules_ms_per_step"], 4)
    return {"width": full, "overhead_width": tiny}


# -- GPT ---------------------------------------------------------------------------------------------------


def make_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(**GPT_SIZES)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-level cross-entropy: logits [B, T, V], targets [B, T]."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt_data(batch: int, window: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    shape = (batch, GPT_SIZES["block_size"])
    return [(torch.randint(0, GPT_SIZES["vocab_size"], shape, generator=gen),
             torch.randint(0, GPT_SIZES["vocab_size"], shape, generator=gen)) for _ in range(window)]


def gpt_sequential_trainer(model: nn.Module, m: int) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """Plain training of the GPT with gradient accumulation over ``m`` micro-batches and torch's AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=GPT_WEIGHT_DECAY, foreach=True)
    return accumulating_trainer(model, optimizer, lm_loss, m)


def gpt_cuts(P: int) -> list[str]:
    """Stage starts at block boundaries, as even as the depth allows."""
    n = GPT_SIZES["n_layer"]
    return [f"blocks.{round(n * s / P)}" for s in range(1, P)]


def run_gpt(batch: int, P: int, m: int, warmup: int, window: int, rounds: int) -> dict[str, object]:
    """Sequential GPT training against pipecore's gpipe, 1f1b and 2bw with ``P`` stages in this process."""
    base = make_gpt()
    seq_model = copy.deepcopy(base)
    configs = [Config("sequential", gpt_sequential_trainer(seq_model, m))]
    for name in GPT_ALGORITHMS:
        pipe = pipecore.Pipeline(copy.deepcopy(base), P, algorithm=name, n_microbatches=m,
                                 optimizer=pipecore.AdamW(lr=LR, weight_decay=GPT_WEIGHT_DECAY), loss_fn=lm_loss,
                                 partition=gpt_cuts(P))
        configs.append(Config(name, pipe.step, pipe))

    def order(r: int) -> list[Config]:  # rotate, so that no configuration always follows the same one
        return configs[r % len(configs):] + configs[: r % len(configs)]

    rates = measure(configs, gpt_data(batch, window), warmup, rounds, order)
    seq = rates["sequential"]
    tokens = GPT_SIZES["block_size"]
    results: dict[str, object] = {}
    for c in configs:
        per_round = [r / b for r, b in zip(rates[c.name], seq)]
        median = statistics.median(rates[c.name])
        entry: dict[str, object] = {
            "sequences_per_s": round(median, 2), "tokens_per_s": round(median * tokens, 1),
            "ms_per_step": round(1e3 * batch / median, 2),
            "ratio": round(median / statistics.median(seq), 3),
            "ratio_paired": round(statistics.median(per_round), 3),
            "ratio_paired_range": [round(min(per_round), 3), round(max(per_round), 3)],
            "windows_sequences_per_s": [round(r, 2) for r in rates[c.name]],
        }
        if c.pipe is not None:
            c.pipe.flush()
            if c.name == "gpipe":
                # Same data, same steps: gpipe's weights against sequential training's (float32, AdamW).
                got, ref = c.pipe.state_dict(), seq_model.state_dict()
                entry["max_weight_diff_vs_sequential"] = max(
                    float((ref[k] - got[k]).abs().max()) for k in got if k != "pipecore")
        results[c.name] = entry
    return {"tied": [f"{name}: " + ", ".join(f"stage {s} ({local})" for s, local in held)
                     for name, held in configs[1].pipe.ties.items()] if configs[1].pipe else [],
            "results": results}


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


def print_graph_table(graph: dict[str, dict[str, object]]) -> None:
    print(f"{'algorithm':<10}  {'graph ms':>8}  {'Seq ms':>7}  {'time ratio [min, max]':<24}  {'quartiles':<15}  "
          f"{'fixed ms':>8}  {'implied':>7}  {'target':<6}  weights")
    for name, r in graph["width"].items():
        lo, hi = r["time_ratio_range"]
        q1, q3 = r["time_ratio_quartiles"]
        print(f"{name:<10}  {r['graph_ms_per_step']:>8.2f}  {r['sequential_modules_ms_per_step']:>7.2f}  "
              f"{r['time_ratio']:.3f} [{lo:.3f}, {hi:.3f}]{'':<4}  [{q1:.3f}, {q3:.3f}]  "
              f"{r['fixed_cost_ms_per_step']:>+8.3f}  {r['time_ratio_implied_by_fixed_cost']:>7.4f}  "
              f"{'met' if r['target_met'] else 'MISSED':<6}  "
              f"{'identical' if r['max_weight_diff'] == 0 else r['max_weight_diff']}")


def print_gpt_table(gpt: dict[str, object]) -> None:
    print(f"{'configuration':<13}  {'seq/s':>7}  {'tokens/s':>9}  {'ms/step':>8}  {'ratio':>5}  {'paired [range]':<22}")
    for name, r in gpt["results"].items():
        lo, hi = r["ratio_paired_range"]
        print(f"{name:<13}  {r['sequences_per_s']:>7.1f}  {r['tokens_per_s']:>9,.0f}  {r['ms_per_step']:>8.2f}  "
              f"{r['ratio']:>5.2f}  {r['ratio_paired']:.3f} [{lo:.3f}, {hi:.3f}]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help=f"comma-separated parts to run, of {','.join(PARTS)} (default: all)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8, help="Linear+ReLU blocks")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration")
    parser.add_argument("--window", type=int, default=3, help="steps per timed window")
    parser.add_argument("--rounds", type=int, default=9, help="timed windows per configuration")
    parser.add_argument("--graph-window", type=int, default=1, help="steps per timed window, graph part (4x that "
                                                                     "at --overhead-width)")
    parser.add_argument("--graph-rounds", type=int, default=40, help="timed windows per configuration, graph part")
    parser.add_argument("--gpt-batch", type=int, default=32, help="sequences of 64 tokens per mini-batch, gpt part")
    parser.add_argument("--gpt-window", type=int, default=1, help="steps per timed window, gpt part")
    parser.add_argument("--gpt-rounds", type=int, default=15, help="timed windows per configuration, gpt part")
    parser.add_argument("--threads", help="comma-separated torch thread counts, one run each (default: 1 and "
                                          "torch's default)")
    parser.add_argument("--overhead-width", type=int, default=16,
                        help="width of the tiny model whose step time difference is the engine's fixed overhead")
    parser.add_argument("--algorithms", help="comma-separated subset (default: all)")
    parser.add_argument("--out", help="JSON result (default: bench/results/engine-cpu.json; with --only, "
                                      "bench/results/engine-cpu-<parts>.json)")
    parser.add_argument("--profile", metavar="NAME", help="profile one configuration instead of benchmarking")
    parser.add_argument("--profile-steps", type=int, default=20)
    args = parser.parse_args(argv)
    names = args.algorithms.split(",") if args.algorithms else pipecore.algorithm_names()
    parts = [p for p in PARTS if p in args.only.split(",")] if args.only else list(PARTS)
    unknown = sorted(set(args.only.split(",")) - set(PARTS)) if args.only else []
    if unknown or not parts:
        parser.error(f"--only takes parts of {','.join(PARTS)}, got {args.only!r}")
    out_path = args.out or str(ROOT / "bench" / "results" / (
        "engine-cpu.json" if parts == list(PARTS) else f"engine-cpu-{'-'.join(parts)}.json"))
    P, m = args.stages, args.microbatches
    thread_counts = parse_threads(args.threads)

    if args.profile:
        torch.set_num_threads(thread_counts[-1])
        chosen = [] if args.profile == "sequential" else [args.profile]
        config = next(c for c in build(chosen, args.width, args.layers, P, m) if c.name == args.profile)
        profile(config, args.batch, args.width, args.profile_steps)
        return 0

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    diff = gpipe_matches_sequential(args.width, args.layers, args.batch, P, m) if "engine" in parts else None
    runs = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        run: dict[str, object] = {"threads": threads}
        seconds: dict[str, float] = {}
        start = time.perf_counter()
        if "engine" in parts:
            results = run_benchmark(names, args.width, args.layers, args.batch, P, m, args.warmup, args.window,
                                    args.rounds)
            # The same model shrunk to --overhead-width: compute is negligible, the step-time difference to
            # sequential is what the engine adds per step.
            tiny = run_benchmark(names, args.overhead_width, args.layers, args.batch, P, m, args.warmup,
                                 4 * args.window, args.rounds)
            overhead = {n: round(tiny[n]["ms_per_step"] - tiny["sequential"]["ms_per_step"], 2)
                        for n in tiny if n != "sequential"}
            targets = {n: results[n]["ratio"] >= TARGET_RATIO for n in TARGET_ALGORITHMS if n in results}
            run.update({"results": results, "overhead_ms_per_step": overhead,
                        "overhead_sequential_ms_per_step": tiny["sequential"]["ms_per_step"], "target_met": targets})
            seconds["engine"], start = round(time.perf_counter() - start, 1), time.perf_counter()
        if "graph" in parts:
            run["graph_vs_sequential_modules"] = graph_part(
                args.width, args.overhead_width, args.layers, args.batch, P, m, args.warmup, args.graph_window,
                args.graph_rounds)
            seconds["graph"], start = round(time.perf_counter() - start, 1), time.perf_counter()
        if "gpt" in parts:
            run["gpt"] = run_gpt(args.gpt_batch, P, m, args.warmup, args.gpt_window, args.gpt_rounds)
            seconds["gpt"] = round(time.perf_counter() - start, 1)
        run["wall_seconds_per_part"] = seconds
        runs.append(run)

    info = machine()
    info["load_average_1min"] = {"before": load_before, "after": info["load_average_1min"]}
    report: dict[str, object] = {
        "benchmark": "engine",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python bench/engine.py", *(argv if argv is not None else sys.argv[1:])]),
        "parts": parts,
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
    }
    if "engine" in parts:
        report.update({"gpipe_vs_sequential_max_weight_diff": diff,
                       "target": {"ratio": TARGET_RATIO, "algorithms": list(TARGET_ALGORITHMS)}})
    if "graph" in parts:
        report["graph"] = {
            "what": "time per step of the normal Pipeline (stages run generated torch.fx GraphModules) over the "
                    "same Pipeline whose stage modules are nn.Sequential slices of the same layer objects under "
                    "the same child names (non-last stages return a 1-tuple, as the generated module does), "
                    "with _parameter_slots rebuilt as TensorStage.__init__ builds it; everything else identical",
            "model": "the MLP above (default partition), at width and at overhead_width",
            "algorithms": list(GRAPH_ALGORITHMS),
            "optimizer": f"pipecore.SGD(lr={LR}, momentum=0.9)",
            "timing": {"warmup_steps": args.warmup, "window_steps": args.graph_window,
                       "window_steps_at_overhead_width": 4 * args.graph_window, "rounds": args.graph_rounds,
                       "statistic": "time_ratio = median over rounds of (graph window time / Sequential window "
                                    "time), with its range and quartiles; the pair's order alternates from round "
                                    "to round. fixed_cost_ms_per_step: the median per-round ms/step difference "
                                    "graph - Sequential at overhead_width (compute negligible); "
                                    "time_ratio_implied_by_fixed_cost = 1 + that / Sequential ms/step at width; "
                                    "time_ratio_of_fastest_windows = fastest graph window / fastest Sequential "
                                    "window (single windows: as noisy as the range on a loaded machine)"},
            "target": {"speed_ratio": GRAPH_TARGET, "time_ratio_at_most": round(1 / GRAPH_TARGET, 4)},
            "weights": "max_weight_diff: largest |difference| of the two pipelines' weights after the run "
                       "(same data, same steps; 0 = bit-identical)",
        }
    if "gpt" in parts:
        report["gpt"] = {
            "model": f"pipecore.models.GPT({', '.join(f'{k}={v}' for k, v in GPT_SIZES.items())}), LM head tied "
                     "to the token embedding",
            "parameters": sum(p.numel() for p in make_gpt().parameters()),
            "sizes": {"batch_sequences": args.gpt_batch, "sequence_length": GPT_SIZES["block_size"],
                      "tokens_per_step": args.gpt_batch * GPT_SIZES["block_size"], "microbatches": m,
                      "stages": P, "partition": gpt_cuts(P)},
            "loss": "token-level cross-entropy on random tokens",
            "optimizer": {"pipecore": f"pipecore.AdamW(lr={LR}, weight_decay={GPT_WEIGHT_DECAY})",
                          "sequential": f"torch.optim.AdamW(lr={LR}, weight_decay={GPT_WEIGHT_DECAY}, foreach=True)"},
            "baseline": "sequential: per micro-batch forward, loss / m, backward; then AdamW step and zero_grad",
            "timing": {"warmup_steps": args.warmup, "window_steps": args.gpt_window, "rounds": args.gpt_rounds,
                       "statistic": "ratio = median / sequential median; ratio_paired = median of per-round "
                                    "ratios (range: min, max); configurations rotate from round to round"},
        }
    report["runs"] = runs
    out = write_report(report, out_path).resolve()

    if "engine" in parts:
        print(f"{report['model']}, batch {args.batch} = {m} micro-batches, {P} stages, float32; "
              f"median of {args.rounds} windows of {args.window} steps; overhead: ms/step over sequential at width "
              f"{args.overhead_width}")
        print(f"gpipe vs sequential weights after 3 steps: max |diff| = {diff:.2e}")
    for run in runs:
        threads = run["threads"]
        print(f"\n{threads} thread{'s' if threads > 1 else ''}:")
        if "results" in run:
            print_table(run)
            print("target (gpipe, 1f1b >= 0.9x sequential): "
                  + ", ".join(f"{n} {'met' if ok else 'MISSED'}" for n, ok in run["target_met"].items()))
        if "graph_vs_sequential_modules" in run:
            print(f"\ngraph path vs nn.Sequential stage modules ({report['model']}, batch {args.batch}, {m} "
                  f"micro-batches, {P} stages; ms/step; time ratio graph/Sequential: median of {args.graph_rounds} "
                  f"per-round ratios; fixed ms: median graph - Sequential ms/step at width {args.overhead_width}; "
                  f"implied: 1 + fixed / Seq ms; target: time ratio <= {1 / GRAPH_TARGET:.3f}):")
            print_graph_table(run["graph_vs_sequential_modules"])
        if "gpt" in run:
            print(f"\nGPT ({report['gpt']['model']}; batch {args.gpt_batch} x {GPT_SIZES['block_size']} tokens, "
                  f"{m} micro-batches, {P} stages, AdamW) vs sequential; median of {args.gpt_rounds} windows of "
                  f"{args.gpt_window} steps; tied: {'; '.join(run['gpt']['tied']) or '-'}")
            print_gpt_table(run["gpt"])
            gdiff = run["gpt"]["results"].get("gpipe", {}).get("max_weight_diff_vs_sequential")
            if gdiff is not None:
                print(f"gpipe vs sequential GPT weights after the run: max |diff| = {gdiff:.2e}")
    print(f"\nwrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    checks = [r.get("check", "ok") for run in runs for r in run.get("results", {}).values()]
    identical = all(r["max_weight_diff"] == 0 for run in runs for part in run.get("graph_vs_sequential_modules", {}).values()
                    for r in part.values())
    return 0 if all(c == "ok" for c in checks) and (diff is None or diff < 1e-5) and identical else 1


if __name__ == "__main__":
    sys.exit(main())
