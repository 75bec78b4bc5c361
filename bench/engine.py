"""Engine throughput: pipecore's local executor against plain sequential training of the same model.

Usage: ``python bench/engine.py [--only engine,graph,gpt,concurrent] [--width 512] [--layers 8] [--batch 256]
[--microbatches 8] [--stages 4] [--warmup 3] [--window 3] [--rounds 9] [--graph-window 1] [--graph-rounds 40]
[--gpt-batch 32] [--gpt-window 1] [--gpt-rounds 15] [--threads 1,2] [--concurrent-batches 256,1024]
[--concurrent-algorithms gpipe,1f1b,2bw,pipedream] [--gpu-width 2048] [--gpu-batch 4096]
[--pipeline-options track_memory=False,recover=False] [--out PATH]
[--profile ALGORITHM]``.

Four parts (``--only`` selects some; default all four; a partial run writes ``engine-cpu-<parts>.json``
unless ``--out`` is given). The first three measure the single-thread executor: every ``Pipeline`` they build
passes ``concurrent=False`` (the stages run in turn on the calling thread; ``concurrent=True`` is the default
in one process), so the ideal ratio to sequential training stays 1.0.

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
* ``concurrent``: what a worker thread per stage (``concurrent=True``) gains. The MLP below as 2 stages, m
  micro-batches, at each batch of ``--concurrent-batches``, under ``torch.set_num_threads(1)`` (one intra-op
  thread per stage thread; the previous count is restored after): sequential training, and per algorithm of
  ``--concurrent-algorithms`` (``pipecore.SGD(momentum=0.9)``) ``<alg>`` (``concurrent=False``),
  ``<alg>+threads`` (``concurrent=True``: ``step()`` returns settled) and ``<alg>+overlap`` (also
  ``overlap_steps=True``: the stage threads go on after ``step()`` returns its loss; a window ends after
  ``synchronize()``), interleaved in rounds (rotated each round). Reported: samples/s, the median and range of
  per-round ratios to sequential, and of each threaded configuration / in turn. The machine's own limit is
  measured in the same rounds: one thread running one stage's matrix products for a step (per micro-batch and
  Linear: the forward ``addmm``, the input- and weight-gradient ``mm`` of (batch/m) x width by width x width,
  on its own tensors; each thread sets torch's thread count itself, since ``torch.set_num_threads`` on the
  calling thread does not reach MKL on a new thread) against two threads each running theirs; limit =
  2 t_one / t_two. Per threaded configuration, ``fraction_of_limit`` = (its speedup over sequential) / limit.
  Targets (printed PASS/FAIL, stored), for ``+threads`` and ``+overlap`` alike: at batch 1024 2bw at least 0.9
  and 1f1b at least 0.8 of the limit; at batch 256 1f1b and 2bw at least the two-process gloo figures of
  ``bench/results/pipeline-cpu.json`` (``vs_single_process`` of its 1f1b and 2bw rows). Before timing, every
  algorithm's threaded pipelines and its ``concurrent=False`` one train 3 steps on the same data and must end
  bit-identical (so must the timed ones after the run; the exit status is 1 otherwise). Where the time goes
  (``stage_time``, per pipeline configuration): each stage's seconds in its actions per step, and the speedup
  over sequential as the product of ``sequential_over_actions`` (what the actions cost against the plain
  step), ``balance`` (the busiest stage's share) and ``busiest_busy`` (how much of the step the busiest stage
  computes); ``schedule_step_ms``, the step the simulator gives the schedule with those action times, and
  ``executor_efficiency`` = schedule_step_ms / step. Each threaded configuration's ``ceiling`` is the fraction
  of the limit it would reach if its threads ran every action as fast as in turn, slowed only as much as the
  limit's threads, and lost nothing between actions: sequential step / (2 x the in-turn schedule_step_ms).
  Where ``torch.cuda.is_available()``, the same comparison also runs on one GPU (key ``gpu``): 4 stages on
  ``cuda:0`` of ``--layers`` x ``--gpu-width`` blocks, batch ``--gpu-batch``, windows timed between
  ``torch.cuda.synchronize()`` calls, sequential reading its loss once per step.

The model is ``layers x (Linear(width, width) + ReLU)`` in float32 on the CPU, trained with cross-entropy on
random data. *Sequential* is what a user writes without pipecore: per micro-batch forward, ``loss / m``,
backward; then ``torch.optim.SGD(momentum=0.9, foreach=True).step()`` and ``zero_grad()`` (the same math as
pipecore's ``gpipe``). Every pipecore algorithm trains its own copy of the model as ``--stages`` stages with
``pipecore.SGD(momentum=0.9)``. All configurations run in one process with one thread count (the engine, graph
and gpt parts once per ``--threads`` entry; the concurrent part once, with 1).

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

``--pipeline-options`` passes ``recover=`` and ``track_memory=`` to every pipeline of the run (recorded as
``pipeline_options``): the pipelines' bookkeeping, without which the figures show the engine alone.

``--profile NAME`` instead runs cProfile over steps of one configuration (``sequential`` or an algorithm)
and prints the functions with the most time per step.
"""

from __future__ import annotations

import argparse
import cProfile
import copy
import json
import os
import pstats
import statistics
import sys
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pipecore  # noqa: E402
from _machine import OUT_HELP, default_out, machine, write_report  # noqa: E402
from pipecore.models import GPT  # noqa: E402

TARGET_RATIO = 0.9  # gpipe and 1f1b: engine overhead at most 10%
TARGET_ALGORITHMS = ("gpipe", "1f1b")
LR = 1e-3
PARTS = ("engine", "graph", "gpt", "concurrent")
GRAPH_ALGORITHMS = ("gpipe", "1f1b", "2bw")
GRAPH_TARGET = 0.95  # the graph path at least 0.95x as fast as Sequential stage modules
GPT_ALGORITHMS = ("gpipe", "1f1b", "2bw")
GPT_SIZES = {"vocab_size": 96, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}
GPT_WEIGHT_DECAY = 0.01
CONCURRENT_ALGORITHMS = ("gpipe", "1f1b", "2bw", "pipedream")
CONCURRENT_BATCHES = (256, 1024)
CONCURRENT_STAGES = 2
THREADS = "+threads"  # the configuration with a thread per stage (concurrent=True)
OVERLAP = "+overlap"  # a thread per stage going on after step() returns (concurrent=True, overlap_steps=True)
THREADED = (THREADS, OVERLAP)
LIMIT_ONE, LIMIT_TWO = "limit:1 thread", "limit:2 threads"  # the machine's limit, measured with the rounds
LIMIT_TARGET_BATCH = 1024
LIMIT_TARGETS = {"2bw": 0.9, "1f1b": 0.8}  # +threads speedup over sequential, as a fraction of the limit
GLOO_TARGET_BATCH = 256
GLOO_ALGORITHMS = ("1f1b", "2bw")  # +threads at least the two-process gloo figure (vs single process)
GLOO_RESULTS = ROOT / "bench" / "results" / "pipeline-cpu.json"
GPU_STAGES = 4


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


def sequential_trainer(model: nn.Module, m: int, defer_loss: bool = False
                       ) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """Plain training with gradient accumulation over ``m`` micro-batches (gpipe's math)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, foreach=True)
    return accumulating_trainer(model, optimizer, nn.CrossEntropyLoss(), m, defer_loss)


def accumulating_trainer(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable, m: int,
                         defer_loss: bool = False) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """A step: per micro-batch forward, ``loss / m``, backward; then one optimizer step. With ``defer_loss``
    the micro-batch losses are summed on their device and read once per step (on a GPU: no wait for the
    device after every micro-batch, as pipecore reads its losses)."""

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        total: float | torch.Tensor = 0.0
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            loss = loss_fn(model(xs), ys)
            (loss / m).backward()
            total += loss.detach() if defer_loss else loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(total) / m

    return step


# Further Pipeline keyword arguments for every pipeline of the run (``--pipeline-options``), e.g.
# {"track_memory": False}; set once by main() before anything is built.
PIPELINE_OPTIONS: dict[str, bool] = {}


def parse_pipeline_options(text: str | None) -> dict[str, bool]:
    """``--pipeline-options``: comma-separated ``name=True|False`` of ``recover`` and ``track_memory``."""
    options: dict[str, bool] = {}
    for item in filter(None, (text or "").split(",")):
        name, _, value = item.partition("=")
        if name not in ("recover", "track_memory") or value not in ("True", "False"):
            raise ValueError(f"--pipeline-options takes recover=True|False and track_memory=True|False, got {item!r}")
        options[name] = value == "True"
    return options


def pipeline(name: str, model: nn.Module, stages: int, m: int, concurrent: bool = False,
             devices: str | None = None, overlap_steps: bool = False) -> pipecore.Pipeline:
    """``name`` with ``pipecore.SGD(momentum=0.9)``; by default the stages run in turn on the calling thread
    (``concurrent=False``), which is what the engine, graph and gpt parts measure."""
    return pipecore.Pipeline(model, stages, algorithm=name, n_microbatches=m,
                             optimizer=pipecore.SGD(lr=LR, momentum=0.9), loss_fn=nn.CrossEntropyLoss(),
                             concurrent=concurrent, devices=devices, overlap_steps=overlap_steps,
                             **PIPELINE_OPTIONS)


def threaded(name: str, suffix: str, model: nn.Module, stages: int, m: int, devices: str | None = None
             ) -> pipecore.Pipeline:
    """``name``'s pipeline with a thread per stage: ``+threads`` (step() returns settled) or ``+overlap``."""
    return pipeline(name, model, stages, m, concurrent=True, devices=devices, overlap_steps=suffix == OVERLAP)


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


def stage_busy_seconds(pipe: pipecore.Pipeline) -> list[dict[str, float]]:
    """Seconds each stage has spent in its actions' compute so far, per action kind (``TensorStage.seconds``:
    ``F``, ``B``, ``U``), in stage order; read when the pipeline is settled."""
    return [{kind: st.seconds.get(kind, 0.0) for kind in "FBU"} for _, st in sorted(pipe.stages.items())]


def measure(configs: list[Config], data: list[tuple[torch.Tensor, torch.Tensor]], warmup: int, rounds: int,
            order: Callable[[int], list[Config]] | None = None,
            sync: Callable[[], None] | None = None,
            busy: dict[str, list[dict[str, float]]] | None = None) -> dict[str, list[float]]:
    """Samples/s of every window (one pass over ``data``) of every configuration, windows interleaved round by
    round (in ``order(round)`` if given, else in list order). ``sync`` (e.g. ``torch.cuda.synchronize``) runs
    before a window's clock starts and before it stops. With ``busy``, it receives per pipeline configuration
    each stage's seconds in its actions per timed step, per action kind (:func:`stage_busy_seconds` over the
    windows)."""
    window, batch = len(data), len(data[0][0])
    wait = sync or (lambda: None)
    for c in configs:
        for i in range(warmup):
            c.step(*data[i % window])
        if c.pipe is not None:
            c.pipe.synchronize()
    busy_before = {c.name: stage_busy_seconds(c.pipe) for c in configs if c.pipe is not None}
    rates: dict[str, list[float]] = {c.name: [] for c in configs}
    for r in range(rounds):
        for c in (order(r) if order else configs):
            wait()
            start = time.perf_counter()
            for x, y in data:
                c.step(x, y)
            if c.pipe is not None:
                c.pipe.synchronize()  # a window ends when its work is done (overlap_steps goes on after step())
            wait()
            rates[c.name].append(window * batch / (time.perf_counter() - start))
    if busy is not None:
        for c in configs:
            if c.pipe is not None:
                busy[c.name] = [{kind: (after[kind] - before[kind]) / (rounds * window) for kind in after}
                                for before, after in zip(busy_before[c.name], stage_busy_seconds(c.pipe))]
    return rates


def rotating(configs: list[Config]) -> Callable[[int], list[Config]]:
    """An ``order`` for ``measure`` that rotates the list by one every round, so that no configuration always
    follows the same one."""

    def order(r: int) -> list[Config]:
        k = r % len(configs)
        return configs[k:] + configs[:k]

    return order


def weights_diff(a: pipecore.Pipeline, b: pipecore.Pipeline) -> float:
    """Largest |difference| between two pipelines' weights, after flushing both (0: bit-identical)."""
    a.flush()
    b.flush()
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa if k != "pipecore")


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
        pair = [c.pipe for c in configs if c.name.startswith(name + ":") and c.pipe is not None]
        diff = weights_diff(*pair)
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
                                 partition=gpt_cuts(P), concurrent=False, **PIPELINE_OPTIONS)
        configs.append(Config(name, pipe.step, pipe))

    rates = measure(configs, gpt_data(batch, window), warmup, rounds, rotating(configs))
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


# -- concurrent stages -------------------------------------------------------------------------------------


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` inside the block, and restored after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def median_range(values: list[float], digits: int = 3) -> dict[str, object]:
    """The median of ``values`` with their range [min, max]."""
    return {"median": round(statistics.median(values), digits),
            "range": [round(min(values), digits), round(max(values), digits)]}


def concurrent_matches(name: str, base: nn.Module, width: int, batch: int, stages: int, m: int,
                       devices: str | None = None, steps: int = 3) -> dict[str, float]:
    """Per threaded configuration of ``name`` (``+threads``, ``+overlap``): the largest |weight difference| from
    the ``concurrent=False`` pipeline after ``steps`` steps on the same data (0: bit-identical)."""
    in_turn = pipeline(name, copy.deepcopy(base), stages, m, devices=devices)
    pipes = {name + suffix: threaded(name, suffix, copy.deepcopy(base), stages, m, devices) for suffix in THREADED}
    for x, y in mlp_data(batch, width, steps):
        for pipe in [in_turn, *pipes.values()]:
            pipe.step(x, y)
    return {config: weights_diff(pipe, in_turn) for config, pipe in pipes.items()}


def build_concurrent(names: list[str], base: nn.Module, stages: int, m: int, devices: str | None = None
                     ) -> list[Config]:
    """Sequential training of a copy of ``base`` (on ``devices``, there reading its loss once per step), and per
    algorithm the pipeline with its stages in turn on the calling thread (``name``), with a thread per stage
    (``name+threads``) and with threads going on after ``step()`` returns (``name+overlap``), all its stages on
    ``devices`` if given."""
    model = copy.deepcopy(base).to(devices or "cpu")
    configs = [Config("sequential", sequential_trainer(model, m, defer_loss=devices is not None))]
    for name in names:
        pipe = pipeline(name, copy.deepcopy(base), stages, m, devices=devices)
        configs.append(Config(name, pipe.step, pipe))
        for suffix in THREADED:
            pipe = threaded(name, suffix, copy.deepcopy(base), stages, m, devices)
            configs.append(Config(name + suffix, pipe.step, pipe))
    return configs


def in_turn_name(config: str) -> str | None:
    """The in-turn configuration a threaded one (``2bw+threads``, ``2bw+overlap``) is compared with; None for
    the others."""
    return next((config[: -len(x)] for x in THREADED if config.endswith(x)), None)


class StageMatmuls:
    """One stage's matrix products for one step, on tensors of its own: per micro-batch and per Linear layer of
    the stage, the forward ``addmm`` (rows x width by width x width), the input gradient (``mm`` by the weight)
    and the weight gradient (``mm`` of the transposed output gradient by the input)."""

    def __init__(self, rows: int, width: int, layers: int, m: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.layers = [(torch.randn(rows, width, generator=gen), torch.randn(width, width, generator=gen),
                        torch.randn(width, generator=gen), torch.randn(rows, width, generator=gen))
                       for _ in range(layers)]
        self.m = m

    def run(self) -> None:
        for _ in range(self.m):
            for x, w, b, grad in self.layers:
                torch.addmm(b, x, w.t())
                torch.mm(grad, w)
                torch.mm(grad.t(), x)


def on_threads(works: list[StageMatmuls]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A step (for ``measure``; it ignores the mini-batch) running every work once, each on its own thread
    (started per step: its cost is negligible against a step's matrix products). Each thread first sets torch's thread
    count to the caller's: ``torch.set_num_threads`` on one thread does not reach MKL on a new one, whose
    matrix products would otherwise run on MKL's default thread count (all cores), oversubscribing them."""

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        count = torch.get_num_threads()

        def run(work: StageMatmuls) -> None:
            torch.set_num_threads(count)
            work.run()

        threads = [threading.Thread(target=run, args=(w,)) for w in works]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    return step


def limit_configs(batch: int, width: int, layers: int, stages: int, m: int) -> list[Config]:
    """The machine's own limit as two configurations of equal work per thread: one thread running one stage's
    matrix products for a step, and two threads each running their own."""

    def work(seed: int) -> StageMatmuls:
        return StageMatmuls(batch // m, width, layers // stages, m, seed)

    return [Config(LIMIT_ONE, on_threads([work(10)])), Config(LIMIT_TWO, on_threads([work(11), work(12)]))]


def machine_limit(rates: dict[str, list[float]]) -> list[float]:
    """Per round: 2 t_one / t_two, the speedup two threads of independent work get over one (its windows hold
    the same steps, so the time ratio is the inverse rate ratio)."""
    return [2 * two / one for one, two in zip(rates[LIMIT_ONE], rates[LIMIT_TWO])]


def compare_to_sequential(configs: list[Config], rates: dict[str, list[float]], names: list[str], batch: int
                          ) -> dict[str, object]:
    """Per configuration: median samples/s, ms/step, the median (and range) of its per-round ratios to
    sequential, its windows; per algorithm: the per-round ratio ``name+threads`` / ``name`` (median, range)."""
    seq = rates["sequential"]
    results: dict[str, object] = {}
    for c in configs:
        median = statistics.median(rates[c.name])
        results[c.name] = {
            "samples_per_s": round(median, 1), "ms_per_step": round(1e3 * batch / median, 2),
            "vs_sequential": median_range([r / b for r, b in zip(rates[c.name], seq)]),
            "windows_samples_per_s": [round(r, 1) for r in rates[c.name]],
        }
    over_in_turn = {n + x: median_range([t / s for t, s in zip(rates[n + x], rates[n])]) for n in names for x in THREADED}
    return {"results": results, "over_in_turn": over_in_turn}


def run_concurrent_batch(names: list[str], width: int, layers: int, batch: int, m: int, warmup: int,
                         window: int, rounds: int) -> dict[str, object]:
    """One batch size of the concurrent part on the CPU: sequential, every algorithm in turn and with threads,
    and the machine's limit, interleaved round by round; each algorithm's threaded speedup over sequential as a
    fraction of the limit."""
    configs = build_concurrent(names, make_model(width, layers), CONCURRENT_STAGES, m)
    limits = limit_configs(batch, width, layers, CONCURRENT_STAGES, m)
    every = configs + limits
    busy: dict[str, list[dict[str, float]]] = {}
    rates = measure(every, mlp_data(batch, width, window), warmup, rounds, rotating(every), busy=busy)
    out = compare_to_sequential(configs, rates, names, batch)
    limit = machine_limit(rates)
    out["machine_limit"] = {**median_range(limit), "per_round": [round(v, 3) for v in limit]}
    results = out["results"]
    out["stage_time"] = stage_time(busy, rates, batch, {c.name: c.pipe for c in configs if c.pipe is not None})
    ceiling = ceilings(out["stage_time"], 1e3 * mean_step(rates, "sequential", batch), names)
    out["fraction_of_limit"] = {
        c: {"of_medians": round(results[c]["vs_sequential"]["median"] / statistics.median(limit), 3),
            **median_range([r / b / lim for r, b, lim in zip(rates[c], rates["sequential"], limit)]),
            "ceiling": ceiling[c]}
        for c in (n + x for n in names for x in THREADED)}
    for c in configs:  # the timed threaded ones trained on the same data in the same order as their in-turn one
        partner_name = in_turn_name(c.name)
        if c.pipe is not None and partner_name is not None:
            partner = next(p.pipe for p in configs if p.name == partner_name)
            results[c.name]["max_weight_diff_vs_in_turn"] = weights_diff(c.pipe, partner)
    return out


def stage_time(busy: dict[str, list[dict[str, float]]], rates: dict[str, list[float]], batch: int,
               pipes: dict[str, pipecore.Pipeline]) -> dict[str, object]:
    """Where each pipeline's step time goes, from its stages' seconds in their actions (the hooks' compute,
    ``busy``, per action kind) and the mean step times over the same windows (``rates``). The speedup over
    sequential is the product of three factors: ``sequential_over_actions`` (the sequential step / the sum of
    the stages' action time: below 1 the actions cost more than the plain step), ``balance`` (that sum / the
    busiest stage's time: at most the number of stages) and ``busiest_busy`` (the busiest stage's action time
    / the step: the rest of its step it waits for messages or runs the executor's own work).
    ``schedule_step_ms`` is the step the simulator gives the pipeline's schedule with these action times (each
    stage's mean forward, backward and update; steps overlapping): the step of an executor that loses nothing
    between actions. ``executor_efficiency`` = schedule_step_ms / step_ms."""
    sequential = mean_step(rates, "sequential", batch)
    out: dict[str, object] = {}
    for name, per_kind in busy.items():
        seconds = [sum(kinds.values()) for kinds in per_kind]
        total, busiest, step = sum(seconds), max(seconds), mean_step(rates, name, batch)
        scheduled = schedule_step(pipes[name], per_kind)
        out[name] = {"busy_ms_per_step": [round(1e3 * b, 2) for b in seconds], "step_ms": round(1e3 * step, 2),
                     "sequential_over_actions": round(sequential / total, 3), "balance": round(total / busiest, 3),
                     "busiest_busy": round(busiest / step, 3), "schedule_step_ms": round(1e3 * scheduled, 2),
                     "executor_efficiency": round(scheduled / step, 3)}
    return out


SCHEDULE_STEPS = (4, 12)  # mini-batches simulated: the steady step is the makespan's growth between the two


def schedule_step(pipe: pipecore.Pipeline, per_kind: list[dict[str, float]]) -> float:
    """Seconds per step of ``pipe``'s schedule in the simulator, its stages' actions taking the measured time
    (``per_kind``: per stage, seconds per step in forwards, backwards and updates): the steady-state step, the
    makespan's growth per mini-batch between ``SCHEDULE_STEPS`` mini-batches."""
    m = pipe.n_microbatches
    updates = m // pipe.algorithm.update_every
    costs = {"forward": [k["F"] / m for k in per_kind], "backward": [k["B"] / m for k in per_kind],
             "update": [k["U"] / updates for k in per_kind]}
    first, last = (pipecore.simulate(pipe.algorithm.name, len(per_kind), m, n, costs=costs).makespan
                   for n in SCHEDULE_STEPS)
    return (last - first) / (SCHEDULE_STEPS[1] - SCHEDULE_STEPS[0])


def mean_step(rates: dict[str, list[float]], name: str, batch: int) -> float:
    """Mean seconds per step of configuration ``name`` over its windows."""
    return statistics.fmean(batch / r for r in rates[name])


def ceilings(stage_times: dict[str, dict[str, object]], sequential_ms: float, names: list[str]) -> dict[str, float]:
    """Per threaded configuration: the fraction of the machine's limit it would reach if its stage threads ran
    each action as fast as the in-turn pipeline does, slowed only as much as the limit's two threads are
    (t_two / t_one = 2 / limit), and lost nothing between actions: speedup = sequential step / (in-turn
    schedule_step_ms x 2 / limit), so the fraction is sequential step / (2 x in-turn schedule_step_ms)."""
    return {n + x: round(sequential_ms / (2 * stage_times[n]["schedule_step_ms"]), 3) for n in names for x in THREADED}


def gloo_reference(path: Path = GLOO_RESULTS) -> dict[str, object] | None:
    """The two-process gloo figures of bench/pipeline.py's result: ``vs_single_process`` of its ``results`` rows
    whose ``system`` is 1f1b or 2bw; None without the file."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    rows = {r.get("system"): r for r in report.get("results", []) if isinstance(r, dict)}
    found = {n: rows[n]["vs_single_process"] for n in GLOO_ALGORITHMS if "vs_single_process" in rows.get(n, {})}
    return {"file": str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path),
            "batch": report.get("batch"), "ranks": report.get("ranks"), "model": report.get("model"),
            "threads_per_rank": report.get("threads_per_rank"), "date": report.get("date"),
            "vs_single_process": found}


def concurrent_targets(batches: dict[str, dict[str, object]], gloo: dict[str, object] | None
                       ) -> list[dict[str, object]]:
    """The benchmark's targets, each with its measured value and ``passed`` (None where it cannot be judged)."""
    targets: list[dict[str, object]] = []
    at_limit = batches.get(str(LIMIT_TARGET_BATCH))
    for name, share in LIMIT_TARGETS.items():
        for config in (name + x for x in THREADED):
            if at_limit is not None and config in at_limit["fraction_of_limit"]:
                value = at_limit["fraction_of_limit"][config]["of_medians"]
                targets.append({"batch": LIMIT_TARGET_BATCH, "configuration": config,
                                "measure": "fraction_of_limit", "value": value, "at_least": share,
                                "passed": value >= share})
    at_gloo = batches.get(str(GLOO_TARGET_BATCH))
    reference = gloo["vs_single_process"] if gloo else {}
    for name in GLOO_ALGORITHMS:
        for config in (name + x for x in THREADED):
            if at_gloo is None or config not in at_gloo["results"]:
                continue
            value = at_gloo["results"][config]["vs_sequential"]["median"]
            bound = reference.get(name)
            targets.append({"batch": GLOO_TARGET_BATCH, "configuration": config, "measure": "vs_sequential",
                            "value": value, "at_least": bound,
                            "reference": f"two-process gloo {name}, vs_single_process",
                            "passed": None if bound is None else value >= bound})
    return targets


def run_concurrent(names: list[str], width: int, layers: int, batches: list[int], m: int, warmup: int,
                   window: int, rounds: int) -> dict[str, object]:
    """The concurrent part on the CPU, with one torch thread per (stage) thread: the bit-identity check of every
    algorithm, then each batch size, then the targets."""
    with torch_threads(1):
        base = make_model(width, layers)
        weights = {n: concurrent_matches(n, base, width, min(batches), CONCURRENT_STAGES, m) for n in names}
        by_batch = {str(b): run_concurrent_batch(names, width, layers, b, m, warmup, window, rounds) for b in batches}
    gloo = gloo_reference()
    return {"max_weight_diff_vs_in_turn": weights, "batches": by_batch, "gloo_reference": gloo,
            "targets": concurrent_targets(by_batch, gloo)}


def run_concurrent_gpu(names: list[str], width: int, layers: int, batch: int, m: int, warmup: int, window: int,
                       rounds: int, device: str = "cuda:0") -> dict[str, object]:
    """``GPU_STAGES`` stages of the MLP on one GPU: every algorithm in turn and with a thread (and stream) per
    stage against sequential training on the same GPU, windows timed between ``torch.cuda.synchronize()``."""
    base = make_model(width, layers)
    weights = {n: concurrent_matches(n, base, width, batch, GPU_STAGES, m, devices=device) for n in names}
    configs = build_concurrent(names, base, GPU_STAGES, m, device)
    data = [(x.to(device), y.to(device)) for x, y in mlp_data(batch, width, window)]
    rates = measure(configs, data, warmup, rounds, rotating(configs), sync=torch.cuda.synchronize)
    return {"device": torch.cuda.get_device_name(device), "torch_threads": torch.get_num_threads(),
            "model": f"{layers} x (Linear({width},{width}) + ReLU), cross-entropy",
            "sizes": {"width": width, "layers": layers, "batch": batch, "microbatches": m, "stages": GPU_STAGES},
            "dtype": "float32", "algorithms": names,
            "timing": {"warmup_steps": warmup, "window_steps": window, "rounds": rounds,
                       "statistic": "torch.cuda.synchronize() before a window's clock starts and before it stops; "
                                    "otherwise as the CPU part"},
            "max_weight_diff_vs_in_turn": weights,
            **compare_to_sequential(configs, rates, names, batch)}


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


def concurrent_description(args: argparse.Namespace, results: dict[str, object]) -> dict[str, object]:
    """The concurrent part's JSON: what was run and how it was timed, then its results."""
    return {
        "what": "throughput of Pipeline(concurrent=True) (a worker thread per stage; +threads: step() returns "
                "settled, +overlap: overlap_steps=True, the threads go on after step() returns its loss) and "
                "concurrent=False (the stages in turn on the calling thread) against plain sequential training, "
                "with the machine's own limit for two threads",
        "model": f"{args.layers} x (Linear({args.width},{args.width}) + ReLU), cross-entropy",
        "sizes": {"width": args.width, "layers": args.layers, "batches": [int(b) for b in results["batches"]],
                  "microbatches": args.microbatches, "stages": CONCURRENT_STAGES},
        "dtype": "float32", "device": "cpu",
        "torch_threads": 1,
        "environment": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
        "threads": "torch.set_num_threads(1): one intra-op thread for sequential, for the in-turn pipelines, and "
                   "for each stage thread of +threads and +overlap (restored afterwards)",
        "algorithms": args.concurrent_algorithms.split(","),
        "optimizer": {"pipecore": f"pipecore.SGD(lr={LR}, momentum=0.9)",
                      "sequential": f"torch.optim.SGD(lr={LR}, momentum=0.9, foreach=True)"},
        "machine_limit": "per round, 2 t_one / t_two: t_one = one thread running one stage's matrix products for "
                         "window steps (per step, per micro-batch and per Linear of the stage: addmm forward, "
                         "input-gradient mm, weight-gradient mm, of (batch/m) x width by width x width, on its own "
                         "tensors; a thread started per step, which first calls torch.set_num_threads(1) itself), "
                         "t_two = two threads each doing that at once; measured as two more configurations in "
                         "the rounds",
        "timing": {"warmup_steps": args.warmup, "window_steps": args.window, "rounds": args.rounds,
                   "statistic": "samples_per_s: median over windows (a window ends after synchronize()); "
                                "vs_sequential, over_in_turn: median and range of per-round ratios; configurations "
                                "(and the limit's two) rotate from round to round; fraction_of_limit.of_medians = "
                                "vs_sequential median of the configuration / machine_limit median (the targets "
                                "use it), fraction_of_limit.median/range: of the per-round (configuration / "
                                "sequential) / limit"},
        "targets_definition": {
            f"batch {LIMIT_TARGET_BATCH}": {n + x: f"fraction_of_limit >= {v}" for n, v in LIMIT_TARGETS.items()
                                            for x in THREADED},
            f"batch {GLOO_TARGET_BATCH}": {n + x: "vs_sequential >= the two-process gloo vs_single_process"
                                           for n in GLOO_ALGORITHMS for x in THREADED}},
        "stage_time": "per pipeline configuration and batch: busy_ms_per_step = each stage's seconds in its "
                      "actions (TensorStage.seconds: forward, backward and update hooks) per timed step; the "
                      "speedup over sequential (mean step times over the timed windows) = sequential_over_actions "
                      "(sequential step / sum of busy) x balance (sum of busy / busiest stage's busy) x "
                      "busiest_busy (busiest stage's busy / step); schedule_step_ms = the steady-state step the "
                      "simulator gives the schedule with the stages' measured mean forward, backward and update "
                      "times (mini-batches 4 to 12), executor_efficiency = schedule_step_ms / step_ms",
        "ceiling": "fraction_of_limit[c].ceiling, per threaded configuration: sequential step / (2 x schedule_step_ms "
                   "of the in-turn pipeline): what it would reach if each stage thread ran every action as fast as "
                   "in turn, slowed only as much as the limit's threads (t_two / t_one = 2 / limit), losing "
                   "nothing between actions; with steps overlapping (an upper bound for +threads)",
        "weights": "max_weight_diff_vs_in_turn (top level): per algorithm and threaded configuration, after 3 "
                   "steps on the same data, before timing (0: bit-identical); in each batch's results: the timed "
                   "configuration against its in-turn one after the run",
        **results,
    }


def concurrent_identical(part: dict[str, object] | None) -> bool:
    """Whether every threads / in-turn pair of the concurrent part (CPU or GPU) ended with bit-identical weights."""
    if part is None:
        return True
    diffs = [d for per_config in part["max_weight_diff_vs_in_turn"].values() for d in per_config.values()]
    diffs += [r["max_weight_diff_vs_in_turn"] for b in part.get("batches", {}).values()
              for r in b["results"].values() if "max_weight_diff_vs_in_turn" in r]
    return all(d == 0 for d in diffs)


def print_concurrent(conc: dict[str, object], m: int) -> None:
    """Per batch size: the machine's limit and every configuration against sequential; then the targets."""
    for batch, b in conc["batches"].items():
        lim = b["machine_limit"]
        print(f"\nbatch {batch} ({int(batch) // m} rows per micro-batch); machine limit (two threads of independent "
              f"stage matmuls / one): {lim['median']:.2f} [{lim['range'][0]:.2f}, {lim['range'][1]:.2f}]")
        print_concurrent_table(b)
        print_stage_time(b["stage_time"])
    print_identity(conc["max_weight_diff_vs_in_turn"])
    print_targets(conc["targets"], conc["gloo_reference"])


def print_identity(weights: dict[str, dict[str, float]]) -> None:
    print("threaded vs in turn, weights after 3 steps: " + ", ".join(
        f"{c} {'identical' if d == 0 else f'DIFFER by {d:.2e}'}" for per_config in weights.values()
        for c, d in per_config.items()))


def print_concurrent_table(b: dict[str, object]) -> None:
    """One batch size's (or the GPU's) configurations: throughput, ratio to sequential, and for the threaded ones
    the ratio to the same algorithm in turn and the fraction of the machine's limit (where measured)."""
    def span(r: dict[str, object]) -> str:
        return f"{r['median']:.3f} [{r['range'][0]:.3f}, {r['range'][1]:.3f}]"

    print(f"{'configuration':<17}  {'samples/s':>9}  {'ms/step':>8}  {'vs sequential [range]':<22}  "
          f"{'vs in turn [range]':<23}  {'of limit [per-round range]':<26}  {'ceiling':>7}")
    fractions = b.get("fraction_of_limit", {})
    for name, r in b["results"].items():
        ratio = span(b["over_in_turn"][name]) if name in b["over_in_turn"] else "-"
        f = fractions.get(name)
        share = f"{f['of_medians']:.3f} [{f['range'][0]:.3f}, {f['range'][1]:.3f}]" if f else "-"
        ceiling = f"{f['ceiling']:.3f}" if f and "ceiling" in f else "-"
        print(f"{name:<17}  {r['samples_per_s']:>9,.0f}  {r['ms_per_step']:>8.2f}  {span(r['vs_sequential']):<22}  "
              f"{ratio:<23}  {share:<26}  {ceiling:>7}")


def print_stage_time(stage_time: dict[str, dict[str, object]]) -> None:
    """Per pipeline configuration: its stages' action time per step and the three factors of its speedup."""
    print(f"\n{'configuration':<17}  {'busy ms/step per stage':<24}  {'step ms':>8}  {'seq/actions':>11}  "
          f"{'balance':>7}  {'busiest busy':>12}  {'schedule ms':>11}  {'executor eff.':>13}")
    for name, t in stage_time.items():
        busy = ", ".join(f"{b:.1f}" for b in t["busy_ms_per_step"])
        print(f"{name:<17}  {busy:<24}  {t['step_ms']:>8.2f}  {t['sequential_over_actions']:>11.3f}  "
              f"{t['balance']:>7.3f}  {t['busiest_busy']:>12.3f}  {t['schedule_step_ms']:>11.2f}  "
              f"{t['executor_efficiency']:>13.3f}")


def print_targets(targets: list[dict[str, object]], gloo: dict[str, object] | None) -> None:
    if gloo is None:
        print(f"two-process gloo comparison unavailable: {GLOO_RESULTS.relative_to(ROOT)} not found")
    for t in targets:
        where = f"batch {t['batch']} {t['configuration']}"
        if t["measure"] == "fraction_of_limit":
            print(f"{'PASS' if t['passed'] else 'FAIL'}  {where}: {t['value']:.3f} of the machine's limit "
                  f"(target >= {t['at_least']:.2f})")
        elif t["passed"] is None:
            print(f"n/a   {where}: {t['value']:.3f}x sequential; comparison unavailable ({t['reference']}: not "
                  "found)")
        else:
            print(f"{'PASS' if t['passed'] else 'FAIL'}  {where}: {t['value']:.3f}x sequential (target >= "
                  f"{t['at_least']:.3f}, {t['reference']})")


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
    parser.add_argument("--concurrent-batches", default=",".join(map(str, CONCURRENT_BATCHES)),
                        help="comma-separated batch sizes, concurrent part")
    parser.add_argument("--concurrent-algorithms", default=",".join(CONCURRENT_ALGORITHMS),
                        help="comma-separated algorithms, concurrent part")
    parser.add_argument("--gpu-width", type=int, default=2048, help="MLP width, concurrent part on a GPU")
    parser.add_argument("--gpu-batch", type=int, default=4096, help="batch, concurrent part on a GPU")
    parser.add_argument("--pipeline-options", help="Pipeline options for every pipeline of the run, e.g. "
                                                   "track_memory=False,recover=False (default: the defaults)")
    parser.add_argument("--out", help=f"{OUT_HELP}; the default file is engine-cpu.json, with --only "
                                      "engine-cpu-<parts>.json")
    parser.add_argument("--profile", metavar="NAME", help="profile one configuration instead of benchmarking")
    parser.add_argument("--profile-steps", type=int, default=20)
    args = parser.parse_args(argv)
    names = args.algorithms.split(",") if args.algorithms else pipecore.algorithm_names()
    parts = [p for p in PARTS if p in args.only.split(",")] if args.only else list(PARTS)
    unknown = sorted(set(args.only.split(",")) - set(PARTS)) if args.only else []
    if unknown or not parts:
        parser.error(f"--only takes parts of {','.join(PARTS)}, got {args.only!r}")
    out_path = args.out or default_out(
        "engine-cpu.json" if parts == list(PARTS) else f"engine-cpu-{'-'.join(parts)}.json")
    P, m = args.stages, args.microbatches
    thread_counts = parse_threads(args.threads)
    try:
        PIPELINE_OPTIONS.update(parse_pipeline_options(args.pipeline_options))
    except ValueError as exc:
        parser.error(str(exc))

    if args.profile:
        torch.set_num_threads(thread_counts[-1])
        chosen = [] if args.profile == "sequential" else [args.profile]
        config = next(c for c in build(chosen, args.width, args.layers, P, m) if c.name == args.profile)
        profile(config, args.batch, args.width, args.profile_steps)
        return 0

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    diff = gpipe_matches_sequential(args.width, args.layers, args.batch, P, m) if "engine" in parts else None
    per_thread_count = [p for p in parts if p != "concurrent"]  # the parts run once per --threads entry
    runs = []
    for threads in thread_counts if per_thread_count else []:
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
    concurrent = gpu = None
    if "concurrent" in parts:
        conc_names = args.concurrent_algorithms.split(",")
        conc_batches = [int(b) for b in args.concurrent_batches.split(",")]
        start = time.perf_counter()
        concurrent = run_concurrent(conc_names, args.width, args.layers, conc_batches, m, args.warmup,
                                    args.window, args.rounds)
        concurrent["wall_seconds"] = round(time.perf_counter() - start, 1)
        if torch.cuda.is_available():
            start = time.perf_counter()
            gpu = run_concurrent_gpu(conc_names, args.gpu_width, args.layers, args.gpu_batch, m, args.warmup,
                                     args.window, args.rounds)
            gpu["wall_seconds"] = round(time.perf_counter() - start, 1)

    info = machine()
    info["load_average_1min"] = {"before": load_before, "after": info["load_average_1min"]}
    report: dict[str, object] = {
        "benchmark": "engine",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python bench/engine.py", *(argv if argv is not None else sys.argv[1:])]),
        "parts": parts,
        "machine": info,
        "dtype": "float32",
        "device": "cpu",
        "pipeline_options": dict(PIPELINE_OPTIONS),
    }
    if per_thread_count:
        report.update({
            "model": f"{args.layers} x (Linear({args.width},{args.width}) + ReLU), cross-entropy",
            "sizes": {"width": args.width, "layers": args.layers, "batch": args.batch, "microbatches": m, "stages": P,
                      "parameters": sum(p.numel() for p in make_model(args.width, args.layers).parameters()),
                      "overhead_width": args.overhead_width},
            "executor": "concurrent=False: the stages run in turn on the calling thread",
            "timing": {"warmup_steps": args.warmup, "window_steps": args.window, "rounds": args.rounds,
                       "statistic": "median samples/s over windows, configurations interleaved; ratio = median / "
                                    "sequential median; ratio_paired = median of per-round ratios"},
        })
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
    if per_thread_count:
        report["runs"] = runs
    if concurrent is not None:
        report["concurrent"] = concurrent_description(args, concurrent)
    if gpu is not None:
        report["gpu"] = gpu
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
    if concurrent is not None:
        print(f"\nconcurrent: {report['concurrent']['model']}, {CONCURRENT_STAGES} stages, {m} micro-batches, "
              f"float32, 1 torch thread per thread; sequential, each algorithm with its stages in turn (concurrent="
              f"False), a thread per stage (+threads) and threads going on after step() (+overlap); median of {args.rounds} windows of {args.window} steps, "
              "ratios: median [min, max] of per-round ratios")
        print_concurrent(concurrent, m)
    if gpu is not None:
        print(f"\nconcurrent on {gpu['device']}: {gpu['model']}, batch {args.gpu_batch}, {GPU_STAGES} stages, {m} "
              f"micro-batches, float32; median of {args.rounds} windows of {args.window} steps")
        print_concurrent_table(gpu)
        print_identity(gpu["max_weight_diff_vs_in_turn"])
    print(f"\nwrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    checks = [r.get("check", "ok") for run in runs for r in run.get("results", {}).values()]
    identical = all(r["max_weight_diff"] == 0 for run in runs for part in run.get("graph_vs_sequential_modules", {}).values()
                    for r in part.values())
    return 0 if (all(c == "ok" for c in checks) and (diff is None or diff < 1e-5) and identical
                 and concurrent_identical(concurrent) and concurrent_identical(gpu)) else 1


if __name__ == "__main__":
    sys.exit(main())
