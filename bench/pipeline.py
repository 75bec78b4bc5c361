"""Multi-process pipelines on CPU/gloo: pipecore vs torch.distributed.pipelining vs one process.

    python bench/pipeline.py [--ranks 2] [--steps 20] [--gpt-steps 3] [--rounds 9] [--systems ...]
                             [--out PATH]

Same model (an MLP of 8 Linear(512, 512)+ReLU layers and a Linear(512, 10) head, float32), same split
points, batch 256, 8 micro-batches, one thread per rank, momentum SGD. Variants: ``+split`` is the same
algorithm with ``split_backward=True``; ``+slack`` is the same algorithm with the option ``slack=1`` (one
more warm-up forward per downstream stage, which hides message latency; 2BW's weights and losses do not
change with it, PipeDream's staleness grows by one update per downstream stage); ``+accumulate`` is
PipeDream with ``update_every=8``: one optimizer step per mini-batch like every other system, where
published PipeDream steps after every micro-batch (8 optimizer steps per mini-batch).

Every system runs in the same ``--ranks`` worker processes, interleaved: each round times one window of
``--steps`` steps of every system, in an order that rotates from round to round, so that all systems see
the same machine load. Asynchronous pipecore algorithms flush at the end of every window, inside the
timing. The baseline is plain training in one process with one thread (rank 0, while the other ranks wait
at a barrier): each micro-batch forward+backward, then the optimizer step. Reported: the median
samples/s over rounds, and the median over rounds of each round's ratio to the baselines (ratios taken
within a round cancel the load drifts of a shared machine). For pipecore systems, also each rank's compute
share: the fraction of a window its stage spent in forward, backward and update (the rest is messages,
waiting, and the engine's own work), and its update share: the part of that spent in optimizer steps. For
every system, each rank's process CPU time per window (all its threads, median over rounds) and its sum over
the ranks: with more ranks than cores, the sum is what competes for the cores.

GPT rows (systems ``gpt:...``): ``pipecore.models.GPT(vocab_size=96, block_size=64, n_layer=4, n_head=4,
n_embd=128)``, whose LM head is tied to the token embedding, split at ``blocks.2`` (2 ranks: blocks 0-1 with
the embeddings, blocks 2-3 with the final LayerNorm and the head); batch 32 sequences of 64 tokens, 8
micro-batches, token-level cross-entropy, AdamW(lr=1e-3, weight_decay=0.01); ``--gpt-steps`` steps per window.
pipecore (1f1b, 2bw; ``pipecore.AdamW``) holds the tied weight on both ranks and sums its gradients before
each update. ``gpt:Schedule1F1B`` is ``torch.distributed.pipelining.pipeline(model, mb_args=(one
micro-batch,), split_spec={"blocks.2": SplitPoint.BEGINNING})`` with its own tracer, ``Schedule1F1B`` and
``torch.optim.AdamW(foreach=True)`` on each rank's stage. torch 2.13's tracer accepts the tied model but
replicates the tied weight into both stages and never sums their gradients (the copies drift apart), so the
torch row trains an explicitly untied copy (``head.weight`` a clone of ``tok_emb.weight``): the same compute,
without the tied-gradient exchange pipecore does. GPT ratios are to the GPT baselines
(``gpt:single process (1 thread)``, plain training of the tied model with ``torch.optim.AdamW``, and
``gpt:Schedule1F1B``).

Schedules with two stages per rank (``MODERN``: ``interleaved-1f1b``, ``looped-bfs``, ``zb-h1``, ``zb-v``,
``dualpipe-v``), each beside torch's same-named schedule (``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``,
``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``): the same MLP cut into
``2 x --ranks`` chunks at Linear+ReLU pairs (8 chunks on 4 ranks: one pair each, the last with the head), the
same batches, 8 micro-batches, momentum SGD stepped once per mini-batch. pipecore runs
``Pipeline(model, 2 x ranks, algorithm, 8, stages_per_rank=2)``; the torch rows wrap each chunk's
``nn.Sequential`` in a ``PipelineStage`` (stage ids ``r, r+R`` on rank ``r`` for the looped schedules,
``r, 2R-1-r`` for the V ones, as pipecore places them) under one ``torch.optim.SGD(foreach=True)`` per rank.
Their ``vs torch`` ratio is to that twin. Every row records its first step's loss (the same for every MLP
row: same weights, same batch); a torch schedule that refuses the configuration is reported with its error.

Data x pipeline parallelism (systems ``ALGORITHM@WxP`` and ``gpt:ALGORITHM@WxP``, ``W x P = --ranks``, e.g.
``1f1b@4x1``, ``2bw@2x2``, ``gpt:1f1b@1x4``): ``Pipeline(model, P, algorithm, 8, data_parallel=W)``, W replicas
of a P-stage pipeline (the MLP cut at Linear+ReLU pairs as above, the GPT at blocks as above, ``P = 1``: the
whole model in one stage); every rank is handed the global mini-batch and each replica trains on its
``1/W`` share (``torch.tensor_split``), split into the same 8 micro-batches. Their reference is ``DDP@Wx1``
(``gpt:DDP@Wx1``, W = --ranks): ``torch.nn.parallel.DistributedDataParallel`` over the whole model on every
rank, each rank its ``torch.tensor_split`` share of the mini-batch in 8 micro-batches with gradient
accumulation (``no_sync()`` for all but the last), then one ``torch.optim.SGD(momentum=0.9, foreach=True)``
(GPT: ``torch.optim.AdamW(foreach=True)``) step. ``vs DDP`` is the median per-round ratio to that row. Every
data-parallel row records the global mini-batch loss of its warm-up steps (DDP's: its ranks' losses averaged),
to be compared with DDP's (the same weights and batch: the first step's loss must agree).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from _machine import OUT_HELP, default_out, machine, write_report
from _ranks import spawn

BATCH, MICRO, WIDTH, DEPTH = 256, 8, 512, 8
SINGLE = "single process (1 thread)"
PIPECORE = ["1f1b", "gpipe", "2bw", "pipedream", "pipemare", "spectrain", "v-timeprest", "i-timeprest", "timeprest"]
TORCH = ["ScheduleGPipe", "Schedule1F1B"]
# Schedules with two stages per rank: pipecore's algorithm -> torch's same-named schedule (its "twin").
MODERN = {"interleaved-1f1b": "ScheduleInterleaved1F1B", "looped-bfs": "ScheduleLoopedBFS",
          "zb-h1": "ScheduleInterleavedZeroBubble", "zb-v": "ScheduleZBVZeroBubble", "dualpipe-v": "ScheduleDualPipeV"}
MODERN_TORCH = {twin: algorithm for algorithm, twin in MODERN.items()}
V_SHAPED = {"zb-v", "dualpipe-v"}  # rank r holds stages r and 2R-1-r (the others: r and r+R)
STAGES_PER_RANK = 2
VARIANTS = ["1f1b+split", "2bw+split", "2bw+slack", "pipedream+slack", "pipedream+accumulate"]
VARIANT_SETTINGS = {"": {}, "split": {"split_backward": True}, "slack": {"slack": 1},
                    "accumulate": {"update_every": MICRO}}
WARMUP_STEPS = 3
GPT = "gpt:"  # prefix of the GPT systems
GPT_SIZES = {"vocab_size": 96, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}
GPT_BATCH, GPT_LR, GPT_WEIGHT_DECAY = 32, 1e-3, 0.01
GPT_SINGLE, GPT_TORCH = GPT + SINGLE, GPT + "Schedule1F1B"
GPT_PIPECORE = [GPT + "1f1b", GPT + "2bw"]
GPT_SYSTEMS = [GPT_TORCH] + GPT_PIPECORE
# Data x pipeline parallelism: systems "[gpt:]ALGORITHM@WxP", W replicas of a P-stage pipeline; "DDP@Wx1" is torch's
# DistributedDataParallel over the whole model, the reference of those rows.
DDP = "DDP"
DP_ALGORITHMS = ["1f1b", "2bw"]
TORCH_TIE = ("torch.distributed.pipelining (torch 2.13) traces the tied GPT without complaint but replicates the "
             "tied tok_emb/head weight into both stages and never sums their gradients (in a check, the two copies "
             "differed by 6e-3 after 3 AdamW steps); the torch row therefore trains an explicitly untied copy "
             "(head.weight = a clone of tok_emb.weight): same compute, no tied-gradient exchange")


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    layers.append(nn.Linear(WIDTH, 10))
    return nn.Sequential(*layers)


def split_points(ranks: int) -> list[int]:
    """Stage boundaries at Linear+ReLU pairs, as even as the depth allows (the same for every system)."""
    per = DEPTH // ranks
    return [2 * per * r for r in range(1, ranks)]


def modern_stage_ids(algorithm: str, rank: int, world: int) -> list[int]:
    """The stages rank ``rank`` holds under a two-stages-per-rank schedule: looped or V placement."""
    return [rank, 2 * world - 1 - rank] if algorithm in V_SHAPED else [rank, rank + world]


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(steps)]


def single_process(rank: int, batches) -> Callable[[int], None]:
    """Plain training of the whole model; only rank 0 works, the others wait at the closing barrier."""
    if rank != 0:
        return lambda n: None
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    return _sequential_window(model, opt, nn.CrossEntropyLoss(), batches)


def _sequential_window(model: nn.Module, opt: torch.optim.Optimizer, loss_fn, batches) -> Callable[[int], None]:
    """A window of ``n`` steps of plain training: each micro-batch's ``loss / MICRO`` backward, one step."""

    def window(n: int) -> None:
        for i in range(n):
            x, y = batches[i % len(batches)]
            total = 0.0
            for xs, ys in zip(x.chunk(MICRO), y.chunk(MICRO)):
                loss = loss_fn(model(xs), ys) / MICRO
                loss.backward()
                if window.losses is not None:
                    total += loss.item()
            opt.step()
            opt.zero_grad()
            if window.losses is not None:
                window.losses.append(total)

    window.losses = []  # type: ignore[attr-defined]  # mini-batch losses while not None (the warm-up's)
    return window


def torch_pipeline(system: str, rank: int, world: int, batches) -> Callable[[int], None]:
    from torch.distributed import pipelining

    model = make_model()
    bounds = [0] + split_points(world) + [len(model)]
    stage_module = model[bounds[rank]: bounds[rank + 1]]
    stage = pipelining.PipelineStage(stage_module, rank, world, torch.device("cpu"))
    schedule = getattr(pipelining, system)(stage, n_microbatches=MICRO, loss_fn=nn.CrossEntropyLoss())
    opt = torch.optim.SGD(stage_module.parameters(), lr=0.01, momentum=0.9, foreach=True)
    return _torch_window(schedule, opt, rank == 0, rank == world - 1, batches)


def torch_modern_pipeline(system: str, rank: int, world: int, batches) -> Callable[[int], None]:
    """torch's schedule ``system`` over this rank's two chunks of the MLP (pipecore's cuts and placement), one
    ``PipelineStage`` per chunk, one SGD over both. Raises what torch raises for a configuration it refuses."""
    from torch.distributed import pipelining

    model, chunks = make_model(), STAGES_PER_RANK * world
    bounds = [0] + split_points(chunks) + [len(model)]
    ids = modern_stage_ids(MODERN_TORCH[system], rank, world)
    modules = [model[bounds[s]: bounds[s + 1]] for s in ids]
    stages = [pipelining.PipelineStage(m, s, chunks, torch.device("cpu")) for m, s in zip(modules, ids)]
    schedule = getattr(pipelining, system)(stages, n_microbatches=MICRO, loss_fn=nn.CrossEntropyLoss())
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.01, momentum=0.9, foreach=True)
    return _torch_window(schedule, opt, 0 in ids, chunks - 1 in ids, batches)


def _torch_window(schedule, opt: torch.optim.Optimizer, first: bool, last: bool, batches) -> Callable[[int], None]:
    """A window of ``n`` steps of a ``torch.distributed.pipelining`` schedule and its optimizer; ``first`` and
    ``last``: whether this rank holds the first stage (reads the inputs) and the last (the targets)."""

    def window(n: int) -> None:
        for i in range(n):
            x, y = batches[i % len(batches)]
            losses = [] if last and window.losses is not None else None
            schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses)
            opt.step()
            opt.zero_grad()
            if losses is not None:
                window.losses.append(statistics.fmean(v.detach().item() for v in losses))

    window.losses = []  # type: ignore[attr-defined]  # mini-batch losses while not None, on the last stage's rank
    return window


def pipecore_pipeline(system: str, rank: int, world: int, batches) -> Callable[[int], None]:
    import pipecore

    algorithm, _, variant = system.partition("+")
    pipe = pipecore.Pipeline(make_model(), world, algorithm, MICRO, optimizer=pipecore.SGD(lr=0.01, momentum=0.9),
                             loss_fn=nn.CrossEntropyLoss(), partition=split_points(world), timeout=300,
                             **VARIANT_SETTINGS[variant])
    return _pipecore_window(pipe, batches)


def pipecore_modern_pipeline(system: str, world: int, batches) -> Callable[[int], None]:
    """pipecore's ``system`` over ``2 x world`` chunks of the MLP, two stages per rank."""
    import pipecore

    chunks = STAGES_PER_RANK * world
    pipe = pipecore.Pipeline(make_model(), chunks, system, MICRO, optimizer=pipecore.SGD(lr=0.01, momentum=0.9),
                             loss_fn=nn.CrossEntropyLoss(), partition=split_points(chunks), timeout=300,
                             stages_per_rank=STAGES_PER_RANK)
    expected = modern_stage_ids(system, pipe.rank, world)
    if sorted(pipe.stages) != sorted(expected):
        raise RuntimeError(f"{system}: rank {pipe.rank} holds stages {sorted(pipe.stages)}, the torch twin {expected}")
    return _pipecore_window(pipe, batches)


def _pipecore_window(pipe, batches) -> Callable[[int], None]:
    first, last = 0 in pipe.stages, pipe.num_stages - 1 in pipe.stages

    def window(n: int) -> None:
        for i in range(n):
            x, y = batches[i % len(batches)]
            loss = pipe.step(x if first else None, y if last else None)
            if window.losses is not None:
                window.losses.append(loss)
        pipe.flush()

    window.losses = []  # type: ignore[attr-defined]  # mini-batch losses while not None (the warm-up's)

    # Seconds this rank's stage has spent in forward, backward and update so far (the rest of a window is
    # messages, waiting and the engine's own work).
    # Split into "compute" (F+B+U) and "update" (U alone).
    window.compute_seconds = lambda: {  # type: ignore[attr-defined]
        "compute": sum(sum(st.seconds.values()) for st in pipe.stages.values()),
        "update": sum(st.seconds.get("U", 0.0) for st in pipe.stages.values()),
    }
    return window


def make_gpt():
    from pipecore.models import GPT as GPTModel

    torch.manual_seed(0)
    return GPTModel(**GPT_SIZES)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-level cross-entropy: logits [B, T, V], targets [B, T]."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt_cuts(ranks: int) -> list[str]:
    """Stage starts at block boundaries, as even as the depth allows (the same for every system)."""
    n = GPT_SIZES["n_layer"]
    return [f"blocks.{round(n * r / ranks)}" for r in range(1, ranks)]


def gpt_data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape, vocab = (GPT_BATCH, GPT_SIZES["block_size"]), GPT_SIZES["vocab_size"]
    return [(torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g))
            for _ in range(steps)]


def gpt_single_process(rank: int, batches) -> Callable[[int], None]:
    """Plain training of the whole (tied) GPT on rank 0; the other ranks wait at the closing barrier."""
    if rank != 0:
        return lambda n: None
    model = make_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=GPT_LR, weight_decay=GPT_WEIGHT_DECAY, foreach=True)
    return _sequential_window(model, opt, lm_loss, batches)


def gpt_torch_pipeline(rank: int, world: int, batches) -> Callable[[int], None]:
    """torch.distributed.pipelining's own tracer and split of the GPT (untied: see TORCH_TIE), Schedule1F1B."""
    from torch.distributed import pipelining

    model = make_gpt()
    model.head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())  # untie (see TORCH_TIE)
    example = batches[0][0].chunk(MICRO)[0]
    pipe = pipelining.pipeline(model, mb_args=(example,),
                               split_spec={cut: pipelining.SplitPoint.BEGINNING for cut in gpt_cuts(world)})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    schedule = pipelining.Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=lm_loss)
    opt = torch.optim.AdamW(stage.submod.parameters(), lr=GPT_LR, weight_decay=GPT_WEIGHT_DECAY, foreach=True)
    return _torch_window(schedule, opt, rank == 0, rank == world - 1, batches)


def gpt_pipecore_pipeline(system: str, rank: int, world: int, batches) -> Callable[[int], None]:
    import pipecore

    pipe = pipecore.Pipeline(make_gpt(), world, system.removeprefix(GPT), MICRO,
                             optimizer=pipecore.AdamW(lr=GPT_LR, weight_decay=GPT_WEIGHT_DECAY), loss_fn=lm_loss,
                             partition=gpt_cuts(world), timeout=300)
    return _pipecore_window(pipe, batches)


def dp_layout(system: str) -> tuple[str, int, int] | None:
    """``(algorithm or "DDP", W, P)`` for a data x pipeline system ``[gpt:]ALGORITHM@WxP``, else None."""
    name, at, shape = system.removeprefix(GPT).partition("@")
    w, x, p = shape.partition("x")
    if not (at and x and w.isdigit() and p.isdigit()):
        return None
    return name, int(w), int(p)


def dp_systems(ranks: int, gpt: bool = False) -> list[str]:
    """Every data x pipeline layout of ``ranks`` processes for 1f1b and 2bw, widest first, and DDP's row."""
    layouts = [(ranks // p, p) for p in range(1, ranks + 1) if ranks % p == 0]
    prefix = GPT if gpt else ""
    return ([f"{prefix}{DDP}@{ranks}x1"]
            + [f"{prefix}{a}@{w}x{p}" for a in DP_ALGORITHMS for w, p in layouts])


def dp_reference(system: str) -> str:
    """The DDP row a data x pipeline system's ``vs DDP`` ratio is taken to (same model, every rank a replica)."""
    _, w, p = dp_layout(system)  # type: ignore[misc]
    return f"{GPT if system.startswith(GPT) else ''}{DDP}@{w * p}x1"


def pipecore_dp_pipeline(system: str, batches) -> Callable[[int], None]:
    """W replicas of a P-stage pipecore pipeline (``data_parallel=W``) for the system ``[gpt:]ALGORITHM@WxP``;
    every rank is handed the global mini-batch, each replica trains on its share."""
    import pipecore

    algorithm, w, p = dp_layout(system)  # type: ignore[misc]
    if system.startswith(GPT):
        pipe = pipecore.Pipeline(make_gpt(), p, algorithm, MICRO,
                                 optimizer=pipecore.AdamW(lr=GPT_LR, weight_decay=GPT_WEIGHT_DECAY), loss_fn=lm_loss,
                                 partition=gpt_cuts(p), timeout=300, data_parallel=w)
    else:
        pipe = pipecore.Pipeline(make_model(), p, algorithm, MICRO, optimizer=pipecore.SGD(lr=0.01, momentum=0.9),
                                 loss_fn=nn.CrossEntropyLoss(), partition=split_points(p), timeout=300,
                                 data_parallel=w)
    if (pipe.data_parallel, pipe.num_ranks) != (w, p):
        raise RuntimeError(f"{system}: pipecore runs {pipe.data_parallel} replicas of {pipe.num_ranks} ranks")
    return _pipecore_window(pipe, batches)


def ddp(system: str, rank: int, world: int, batches) -> Callable[[int], None]:
    """torch's DistributedDataParallel over the whole model on every rank: each rank its ``tensor_split`` share of
    the mini-batch in ``MICRO`` micro-batches, gradients accumulated under ``no_sync()`` but for the last one (whose
    backward all-reduces them, averaged over the ranks), one optimizer step per mini-batch."""
    import contextlib

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    gpt = system.startswith(GPT)
    model = DistributedDataParallel(make_gpt() if gpt else make_model())
    if gpt:
        opt = torch.optim.AdamW(model.parameters(), lr=GPT_LR, weight_decay=GPT_WEIGHT_DECAY, foreach=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    loss_fn = lm_loss if gpt else nn.CrossEntropyLoss()

    def window(n: int) -> None:
        for i in range(n):
            x, y = batches[i % len(batches)]
            xs, ys = torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]
            total = torch.zeros(())
            for k, (xm, ym) in enumerate(zip(torch.tensor_split(xs, MICRO), torch.tensor_split(ys, MICRO))):
                with model.no_sync() if k < MICRO - 1 else contextlib.nullcontext():
                    loss = loss_fn(model(xm), ym) / MICRO
                    loss.backward()
                if window.losses is not None:
                    total += loss.detach()
            opt.step()
            opt.zero_grad()
            if window.losses is not None:  # the global mini-batch loss: the ranks' (equal-sized shards) averaged
                dist.all_reduce(total)
                window.losses.append(total.item() / world)

    window.losses = []  # type: ignore[attr-defined]  # mini-batch losses while not None (the warm-up's)
    return window


def worker(systems: list[str], steps: int, gpt_steps: int, rounds: int) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    batches = data(steps)
    gpt_batches = gpt_data(gpt_steps) if any(s.startswith(GPT) for s in systems) else []
    windows: dict[str, Callable[[int], None]] = {}
    refused: dict[str, str] = {}  # torch schedules that refused the configuration: their error
    first_loss: dict[str, list[float] | None] = {}  # the warm-up steps' losses
    for system in systems:
        layout = dp_layout(system)
        if layout is not None and layout[0] == DDP:
            windows[system] = ddp(system, rank, world, gpt_batches if system.startswith(GPT) else batches)
        elif layout is not None:
            windows[system] = pipecore_dp_pipeline(system, gpt_batches if system.startswith(GPT) else batches)
        elif system in MODERN_TORCH:
            # A refusal at construction is the same on every rank; agree before any rank steps.
            try:
                built: Callable[[int], None] | None = torch_modern_pipeline(system, rank, world, batches)
                error = None
            except Exception as exc:  # noqa: BLE001 - recorded in the report
                built, error = None, f"{type(exc).__name__}: {exc}"
            errors: list[str | None] = [None] * world
            dist.all_gather_object(errors, error)
            if any(errors):
                refused[system] = next(e for e in errors if e)
                continue
            windows[system] = built  # type: ignore[assignment]
        elif system in MODERN:
            windows[system] = pipecore_modern_pipeline(system, world, batches)
        elif system == SINGLE:
            windows[system] = single_process(rank, batches)
        elif system in TORCH:
            windows[system] = torch_pipeline(system, rank, world, batches)
        elif system == GPT_SINGLE:
            windows[system] = gpt_single_process(rank, gpt_batches)
        elif system == GPT_TORCH:
            windows[system] = gpt_torch_pipeline(rank, world, gpt_batches)
        elif system in GPT_PIPECORE:
            windows[system] = gpt_pipecore_pipeline(system, rank, world, gpt_batches)
        else:
            windows[system] = pipecore_pipeline(system, rank, world, batches)
        windows[system](WARMUP_STEPS)
        recorded = getattr(windows[system], "losses", None)
        first_loss[system] = recorded or None
        windows[system].losses = None  # type: ignore[attr-defined]  # stop recording: timed windows do not
        dist.barrier()
    systems = [s for s in systems if s not in refused]
    seconds: dict[str, list[float]] = {s: [] for s in systems}
    cpu: dict[str, list[float]] = {s: [] for s in systems}  # this process's CPU seconds (all its threads) per window
    compute: dict[str, dict[str, list[float]]] = {
        s: {"compute": [], "update": []} for s in systems if hasattr(windows[s], "compute_seconds")}
    for r in range(rounds):
        for j in range(len(systems)):
            system = systems[(j + r) % len(systems)]  # rotate so no system always follows the same one
            busy = getattr(windows[system], "compute_seconds", None)
            before = busy() if busy else {}
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            windows[system](gpt_steps if system.startswith(GPT) else steps)
            cpu[system].append(time.process_time() - cpu_start)
            dist.barrier()
            seconds[system].append(time.perf_counter() - start)
            if busy:
                for part, total in busy().items():
                    compute[system][part].append((total - before[part]) / seconds[system][-1])
        if rank == 0:
            print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    # every rank's compute and update shares, for rank 0's report
    shares: list[dict[str, dict[str, float]]] = [{}] * world
    dist.all_gather_object(shares, {s: {part: statistics.median(v) for part, v in parts.items()}
                                    for s, parts in compute.items()})
    cpu_seconds: list[dict[str, float]] = [{}] * world
    dist.all_gather_object(cpu_seconds, {s: statistics.median(v) for s, v in cpu.items()})
    # the warm-up steps' losses of every system, from whichever rank saw them (the last stage's, for torch)
    seen: list[dict[str, list[float] | None]] = [{}] * world
    dist.all_gather_object(seen, first_loss)
    dist.destroy_process_group()
    return {"seconds": seconds, "refused": refused,
            "cpu_seconds": {s: [cpu_seconds[r][s] for r in range(world)] for s in systems},
            "warmup_losses": {s: next((r[s] for r in seen if r.get(s) is not None), None) for s in first_loss},
            **{f"{part}_share": {s: [shares[r][s][part] for r in range(world)] for s in compute}
               for part in ("compute", "update")}}


def launch(systems: list[str], ranks: int, steps: int, gpt_steps: int, rounds: int) -> dict:
    args = ["--worker", ",".join(systems), "--steps", str(steps), "--gpt-steps", str(gpt_steps),
            "--rounds", str(rounds)]
    return json.loads(spawn(__file__, args, ranks)[0].strip().splitlines()[-1])


def summarize(measured: dict, steps: int, gpt_steps: int) -> list[dict]:
    """Median samples/s per system, the median over rounds of the per-round ratios to the baselines (the GPT
    systems' to the GPT baselines), and for pipecore systems each rank's compute share (median over rounds of
    the fraction of the window its stage spent in forward, backward and update) and update share (the same
    for updates alone)."""
    seconds: dict[str, list[float]] = measured["seconds"]
    rounds = len(next(iter(seconds.values())))

    def ratios(system: str, baseline: str) -> list[float] | None:
        if baseline not in seconds:
            return None
        return [seconds[baseline][r] / seconds[system][r] for r in range(rounds)]

    results = []
    for system, times in seconds.items():
        gpt = system.startswith(GPT)
        samples = gpt_steps * GPT_BATCH if gpt else steps * BATCH
        row: dict = {"system": system, "model": "gpt" if gpt else "mlp", "seconds_per_window": times,
                     "samples_per_s": samples / statistics.median(times)}
        if gpt:
            row["tokens_per_s"] = row["samples_per_s"] * GPT_SIZES["block_size"]
        twin = MODERN.get(system, MODERN_TORCH.get(system))
        row["torch_twin"] = twin if system in MODERN else None
        row["stages_per_rank"] = STAGES_PER_RANK if twin else 1
        layout = dp_layout(system)
        if layout is not None:
            row["data_parallel"], row["pipeline_stages"] = layout[1], layout[2]
        for key, baseline in (("vs_single_process", SINGLE), ("vs_schedule_1f1b", "Schedule1F1B"),
                              ("vs_torch_twin", MODERN.get(system)),
                              ("vs_ddp", None if layout is None else dp_reference(system).removeprefix(GPT))):
            per_round = None if baseline is None else ratios(system, GPT + baseline if gpt else baseline)
            row[key] = None if per_round is None else statistics.median(per_round)
            row[key + "_range"] = None if per_round is None else [min(per_round), max(per_round)]
        warmup = measured["warmup_losses"].get(system)
        row["first_step_loss"] = warmup[0] if warmup else None
        row["warmup_losses"] = warmup  # the losses of the untimed warm-up steps 1..3 (step 2 on: after updates)
        row["compute_share_per_rank"] = measured["compute_share"].get(system)
        # each rank's process CPU time (all threads) per window, median over rounds, and its sum over the ranks
        row["cpu_seconds_per_window_per_rank"] = measured["cpu_seconds"].get(system)
        row["cpu_seconds_per_window"] = (sum(row["cpu_seconds_per_window_per_rank"])
                                         if row["cpu_seconds_per_window_per_rank"] else None)
        row["update_share_per_rank"] = measured["update_share"].get(system)
        results.append(row)
    for system, error in measured["refused"].items():
        results.append({"system": system, "model": "mlp", "stages_per_rank": STAGES_PER_RANK, "refused": error})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed window")
    parser.add_argument("--gpt-steps", type=int, default=3, help="steps per timed window of the GPT systems")
    parser.add_argument("--rounds", type=int, default=9, help="timed windows per system, interleaved")
    parser.add_argument("--systems", default=",".join(TORCH + PIPECORE + VARIANTS + GPT_SYSTEMS),
                        help="comma-separated; the single-process baseline always runs (and the GPT one with any "
                             f"GPT system, {','.join(GPT_SYSTEMS)}); two stages per rank, each beside its torch "
                             f"twin: {','.join(f'{a},{t}' for a, t in MODERN.items())}; data x pipeline "
                             f"parallelism, W replicas of P stages, W x P = --ranks: ALGORITHM@WxP beside "
                             f"{DDP}@Wx1 (torch's DistributedDataParallel), e.g. on 4 ranks "
                             f"{','.join(dp_systems(4))} and the same with the prefix {GPT}")
    parser.add_argument("--out", default=default_out("pipeline-cpu.json"), help=OUT_HELP)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker.split(","), args.steps, args.gpt_steps, args.rounds)))
        return
    chosen = [s for s in args.systems.split(",") if s and s not in (SINGLE, GPT_SINGLE)]
    if DEPTH % args.ranks and any(not s.startswith(GPT) and dp_layout(s) is None for s in chosen):
        raise SystemExit(f"--ranks must divide the model's {DEPTH} blocks, got {args.ranks}")
    known = TORCH + PIPECORE + VARIANTS + GPT_SYSTEMS + list(MODERN) + list(MODERN_TORCH)
    unknown = [s for s in chosen if s not in known and dp_layout(s) is None]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {known}, or ALGORITHM@WxP, {DDP}@Wx1 "
                         f"(with or without {GPT}), W x P = --ranks")
    for system in chosen:
        layout = dp_layout(system)
        if layout is None:
            continue
        name, w, p = layout
        blocks = GPT_SIZES["n_layer"] if system.startswith(GPT) else DEPTH
        if name not in PIPECORE + [DDP] or w * p != args.ranks or w < 1 or p < 1 or blocks % p:
            raise SystemExit(f"{system}: ALGORITHM@WxP needs an algorithm of {PIPECORE} (or {DDP}), W x P = --ranks "
                             f"({args.ranks}) and P dividing the model's {blocks} blocks")
        if name == DDP and p != 1:
            raise SystemExit(f"{system}: DDP runs the whole model on every rank: {DDP}@{args.ranks}x1")
        batch = GPT_BATCH if system.startswith(GPT) else BATCH
        if batch % (w * MICRO):
            # DDP averages its ranks' gradients: the global mean only when every rank's micro-batches are equal
            raise SystemExit(f"{system}: the batch of {batch} must split into {w} x {MICRO} equal micro-batches")
        if name != DDP and dp_reference(system) not in chosen:
            chosen.append(dp_reference(system))  # the reference of the row's vs DDP ratio
    modern = [s for s in chosen if s in MODERN or s in MODERN_TORCH]
    if modern and DEPTH % (STAGES_PER_RANK * args.ranks):
        raise SystemExit(f"{modern} cut the model's {DEPTH} blocks into {STAGES_PER_RANK} x --ranks chunks: "
                         f"--ranks must divide {DEPTH // STAGES_PER_RANK}, got {args.ranks}")
    if any(s.startswith(GPT) and dp_layout(s) is None for s in chosen) and GPT_SIZES["n_layer"] % args.ranks:
        raise SystemExit(f"--ranks must divide the GPT's {GPT_SIZES['n_layer']} blocks, got {args.ranks}")
    mlp, gpt = [s for s in chosen if not s.startswith(GPT)], [s for s in chosen if s.startswith(GPT)]
    systems = [SINGLE] + mlp + ([GPT_SINGLE] + gpt if gpt else [])
    print(f"{len(systems)} systems on {args.ranks} ranks, {args.rounds} rounds of {args.steps} steps ...", file=sys.stderr)
    results = summarize(launch(systems, args.ranks, args.steps, args.gpt_steps, args.rounds), args.steps,
                        args.gpt_steps)
    gpt_model = (f"GPT({', '.join(f'{k}={v}' for k, v in GPT_SIZES.items())}), LM head tied to the token "
                 f"embedding")
    for model, title in (("mlp", None), ("gpt", f"{gpt_model}; batch {GPT_BATCH} x {GPT_SIZES['block_size']} "
                                                f"tokens, {MICRO} micro-batches, cut at {', '.join(gpt_cuts(args.ranks))} "
                                                "(ALGORITHM@WxP rows: at the P-stage cuts), AdamW; ratios to the GPT "
                                                "baselines, median [min, max] over rounds")):
        rows = [r for r in results if r["model"] == model]
        if not rows:
            continue
        if title:
            print(f"\n{title}" + (f"\n{TORCH_TIE}" if any(r["system"] == GPT_TORCH for r in rows) else ""))
        keys = ["vs_single_process", "vs_schedule_1f1b"]
        if any(r.get("stages_per_rank", 1) > 1 for r in rows):
            keys.append("vs_torch_twin")
        if any("data_parallel" in r for r in rows):
            keys.append("vs_ddp")
        heads = {"vs_single_process": "vs 1 process", "vs_schedule_1f1b": "vs Schedule1F1B",
                 "vs_torch_twin": "vs torch twin", "vs_ddp": "vs DDP"}
        print(f"{'system':<32}{'samples/s':>10}{''.join(f'{heads[k]:>26}' for k in keys)}  first loss  CPU s  "
              "compute share per rank (of which updates)")
        for r in rows:
            if "refused" in r:
                print(f"{r['system']:<32} refused: {r['refused']}")
                continue
            cells = []
            for key in keys:
                cells.append("-" if r[key] is None else
                             f"{r[key]:.2f}x [{r[key + '_range'][0]:.2f}, {r[key + '_range'][1]:.2f}]")
            share = " ".join(f"{x:.0%} ({u:.0%})" for x, u in zip(r["compute_share_per_rank"] or [],
                                                                 r["update_share_per_rank"] or []))
            loss = "-" if r["first_step_loss"] is None else f"{r['first_step_loss']:.6f}"
            cpu = "-" if r["cpu_seconds_per_window"] is None else f"{r['cpu_seconds_per_window']:.1f}"
            print(f"{r['system']:<32}{r['samples_per_s']:>10.1f}{''.join(f'{c:>26}' for c in cells)}  {loss:>10}  "
                  f"{cpu:>5}  {share}")
        same = [r["warmup_losses"] for r in rows
                if r.get("warmup_losses") and (r["system"] in MODERN or r["system"] in MODERN_TORCH)]
        if same:
            spread = [max(ls[i] for ls in same) - min(ls[i] for ls in same) for i in range(min(map(len, same)))]
            print("two-stages-per-rank rows, warm-up losses (steps 1..): largest difference between rows "
                  + ", ".join(f"{d:.1e}" for d in spread))
        for r in rows:
            if "data_parallel" in r and dp_layout(r["system"])[0] != DDP:  # type: ignore[index]
                reference = next((q for q in rows if q["system"] == dp_reference(r["system"])), None)
                if reference is None or not r["warmup_losses"] or not reference["warmup_losses"]:
                    continue
                r["warmup_loss_minus_ddp"] = [a - b for a, b in zip(r["warmup_losses"], reference["warmup_losses"])]
                print(f"{r['system']}: warm-up losses (steps 1..) minus {reference['system']}'s "
                      + ", ".join(f"{d:+.1e}" for d in r["warmup_loss_minus_ddp"]))
    report = {
        "benchmark": "pipeline", "device": "cpu", "backend": "gloo", "dtype": "float32",
        "machine": machine(),
        "ranks": args.ranks, "threads_per_rank": 1, "batch": BATCH, "n_microbatches": MICRO,
        "model": f"{DEPTH} x (Linear({WIDTH},{WIDTH}) + ReLU) + Linear({WIDTH},10)",
        "steps_per_window": args.steps, "rounds": args.rounds,
        "gpt": {"model": gpt_model, "parameters": sum(p.numel() for p in make_gpt().parameters()),
                "batch_sequences": GPT_BATCH, "sequence_length": GPT_SIZES["block_size"],
                "n_microbatches": MICRO, "split_at": gpt_cuts(args.ranks), "steps_per_window": args.gpt_steps,
                "loss": "token-level cross-entropy on random tokens",
                "optimizer": {"pipecore": f"pipecore.AdamW(lr={GPT_LR}, weight_decay={GPT_WEIGHT_DECAY})",
                              "torch": f"torch.optim.AdamW(lr={GPT_LR}, weight_decay={GPT_WEIGHT_DECAY}, foreach=True)"},
                "torch_split": "torch.distributed.pipelining.pipeline(model, mb_args=(one micro-batch,), "
                               f"split_spec={{{', '.join(repr(c) + ': SplitPoint.BEGINNING' for c in gpt_cuts(args.ranks))}}}), "
                               "Schedule1F1B",
                "torch_tied_weights": TORCH_TIE, "torch_row_untied": True,
                "baselines": "GPT rows' vs_single_process and vs_schedule_1f1b are to gpt:single process (1 thread) "
                             "and gpt:Schedule1F1B"} if any(r["model"] == "gpt" for r in results) else None,
        "two_stages_per_rank": {
            "chunks": STAGES_PER_RANK * args.ranks, "stages_per_rank": STAGES_PER_RANK,
            "split_at": split_points(STAGES_PER_RANK * args.ranks),
            "placement": {a: {r: modern_stage_ids(a, r, args.ranks) for r in range(args.ranks)} for a in MODERN},
            "torch_twins": MODERN,
            "torch_stages": "one torch.distributed.pipelining.PipelineStage per chunk (the same nn.Sequential slices "
                            "as pipecore's cuts), one torch.optim.SGD(lr=0.01, momentum=0.9, foreach=True) per rank",
            "pipecore": "pipecore.Pipeline(model, chunks, algorithm, 8, optimizer=pipecore.SGD(lr=0.01, momentum=0.9), "
                        "stages_per_rank=2)",
            "vs_torch_twin": "per round, the twin's window seconds / this system's (above 1: pipecore faster)",
            "torch_refused": {r["system"]: r["refused"] for r in results if "refused" in r},
        } if any(r.get("stages_per_rank", 1) > 1 for r in results) else None,
        "data_x_pipeline": {
            "systems": "ALGORITHM@WxP: pipecore.Pipeline(model, P, algorithm, 8, data_parallel=W), W replicas of a P-stage "
                       "pipeline on W x P ranks (process (i, s) is global rank i*P + s); every rank is handed the global "
                       "mini-batch, each replica trains on its torch.tensor_split share in 8 micro-batches; MLP cut at "
                       "Linear+ReLU pairs, GPT at blocks (split_at); pipecore.SGD(lr=0.01, momentum=0.9) / "
                       f"pipecore.AdamW(lr={GPT_LR}, weight_decay={GPT_WEIGHT_DECAY})",
            "split_at": {f"{p}": {"mlp": split_points(p), "gpt": gpt_cuts(p)}
                         for p in range(1, args.ranks + 1) if args.ranks % p == 0},
            "reference": f"{DDP}@{args.ranks}x1: torch.nn.parallel.DistributedDataParallel (default buckets) over the "
                         "whole model on every rank, each rank its torch.tensor_split share of the mini-batch in 8 "
                         "micro-batches, loss / 8 per micro-batch, no_sync() for all but the last, one "
                         "torch.optim.SGD(lr=0.01, momentum=0.9, foreach=True) / torch.optim.AdamW(lr="
                         f"{GPT_LR}, weight_decay={GPT_WEIGHT_DECAY}, foreach=True) step per mini-batch",
            "vs_ddp": "per round, the DDP row's window seconds / this system's (above 1: faster than DDP)",
            "losses": "warmup_losses: the global mini-batch loss of the 3 untimed warm-up steps (DDP: its ranks' "
                      "losses averaged over the equal shards); warmup_loss_minus_ddp: the difference to DDP's, step by step",
        } if any("data_parallel" in r for r in results) else None,
        "method": "systems interleaved in the same processes; ratios are medians of per-round ratios",
        "results": results,
    }
    print(f"wrote {write_report(report, args.out)}", file=sys.stderr)


if __name__ == "__main__":
    main()
