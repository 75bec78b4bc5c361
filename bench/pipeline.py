"""Multi-process pipelines on CPU/gloo: pipecore vs torch.distributed.pipelining vs one process.

    python bench/pipeline.py [--ranks 2] [--steps 20] [--rounds 9] [--out bench/results/pipeline-cpu.json]

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
waiting, and the engine's own work), and its update share: the part of that spent in optimizer steps.
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
from torch import nn

from _machine import machine, write_report
from _ranks import spawn

BATCH, MICRO, WIDTH, DEPTH = 256, 8, 512, 8
SINGLE = "single process (1 thread)"
PIPECORE = ["1f1b", "gpipe", "2bw", "pipedream", "pipemare", "spectrain", "v-timeprest", "i-timeprest", "timeprest"]
TORCH = ["ScheduleGPipe", "Schedule1F1B"]
VARIANTS = ["1f1b+split", "2bw+split", "2bw+slack", "pipedream+slack", "pipedream+accumulate"]
VARIANT_SETTINGS = {"": {}, "split": {"split_backward": True}, "slack": {"slack": 1},
                    "accumulate": {"update_every": MICRO}}
WARMUP_STEPS = 3


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


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(steps)]


def single_process(rank: int, batches) -> Callable[[int], None]:
    """Plain training of the whole model; only rank 0 works, the others wait at the closing barrier."""
    if rank != 0:
        return lambda n: None
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    loss_fn = nn.CrossEntropyLoss()

    def window(n: int) -> None:
        for i in range(n):
            x, y = batches[i % len(batches)]
            for xs, ys in zip(x.chunk(MICRO), y.chunk(MICRO)):
                (loss_fn(model(xs), ys) / MICRO).backward()
            opt.step()
            opt.zero_grad()

    return window


def torch_pipeline(system: str, rank: int, world: int, batches) -> Callable[[int], None]:
    from torch.distributed import pipelining

    model = make_model()
    bounds = [0] + split_points(world) + [len(model)]
    stage_module = model[bounds[rank]: bounds[rank + 1]]
    stage = pipelining.PipelineStage(stage_module, rank, world, torch.device("cpu"))
    schedule = getattr(pipelining, system)(stage, n_microbatches=MICRO, loss_fn=nn.CrossEntropyLoss())
    opt = torch.optim.SGD(stage_module.parameters(), lr=0.01, momentum=0.9, foreach=True)
    first, last = rank == 0, rank == world - 1

    def window(n: int) -> None:
        for i in range(n):
            x, y = batches[i % len(batches)]
            if first:
                schedule.step(x)
            elif last:
                schedule.step(target=y)
            else:
                schedule.step()
            opt.step()
            opt.zero_grad()

    return window


def pipecore_pipeline(system: str, rank: int, world: int, batches) -> Callable[[int], None]:
    import pipecore

    algorithm, _, variant = system.partition("+")
    pipe = pipecore.Pipeline(make_model(), world, algorithm, MICRO, optimizer=pipecore.SGD(lr=0.01, momentum=0.9),
                             loss_fn=nn.CrossEntropyLoss(), partition=split_points(world), timeout=300,
                             **VARIANT_SETTINGS[variant])
    first, last = rank == 0, rank == world - 1

    def window(n: int) -> None:
        for i in range(n):
            x, y = batches[i % len(batches)]
            pipe.step(x if first else None, y if last else None)
        pipe.flush()

    # Seconds this rank's stage has spent in forward, backward and update so far (the rest of a window is
    # messages, waiting and the engine's own work).
    # Split into "compute" (F+B+U) and "update" (U alone).
    window.compute_seconds = lambda: {  # type: ignore[attr-defined]
        "compute": sum(sum(st.seconds.values()) for st in pipe.stages.values()),
        "update": sum(st.seconds.get("U", 0.0) for st in pipe.stages.values()),
    }
    return window


def worker(systems: list[str], steps: int, rounds: int) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    batches = data(steps)
    windows: dict[str, Callable[[int], None]] = {}
    for system in systems:
        if system == SINGLE:
            windows[system] = single_process(rank, batches)
        elif system in TORCH:
            windows[system] = torch_pipeline(system, rank, world, batches)
        else:
            windows[system] = pipecore_pipeline(system, rank, world, batches)
        windows[system](WARMUP_STEPS)
        dist.barrier()
    seconds: dict[str, list[float]] = {s: [] for s in systems}
    compute: dict[str, dict[str, list[float]]] = {
        s: {"compute": [], "update": []} for s in systems if hasattr(windows[s], "compute_seconds")}
    for r in range(rounds):
        for j in range(len(systems)):
            system = systems[(j + r) % len(systems)]  # rotate so no system always follows the same one
            busy = getattr(windows[system], "compute_seconds", None)
            before = busy() if busy else {}
            dist.barrier()
            start = time.perf_counter()
            windows[system](steps)
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
    dist.destroy_process_group()
    return {"seconds": seconds,
            **{f"{part}_share": {s: [shares[r][s][part] for r in range(world)] for s in compute}
               for part in ("compute", "update")}}


def launch(systems: list[str], ranks: int, steps: int, rounds: int) -> dict:
    args = ["--worker", ",".join(systems), "--steps", str(steps), "--rounds", str(rounds)]
    return json.loads(spawn(__file__, args, ranks)[0].strip().splitlines()[-1])


def summarize(measured: dict, steps: int) -> list[dict]:
    """Median samples/s per system, the median over rounds of the per-round ratios to the baselines, and
    for pipecore systems each rank's compute share (median over rounds of the fraction of the window its
    stage spent in forward, backward and update) and update share (the same for updates alone)."""
    seconds: dict[str, list[float]] = measured["seconds"]
    samples = steps * BATCH
    rounds = len(next(iter(seconds.values())))

    def ratios(system: str, baseline: str) -> list[float] | None:
        if baseline not in seconds:
            return None
        return [seconds[baseline][r] / seconds[system][r] for r in range(rounds)]

    results = []
    for system, times in seconds.items():
        row: dict = {"system": system, "seconds_per_window": times,
                     "samples_per_s": samples / statistics.median(times)}
        for key, baseline in (("vs_single_process", SINGLE), ("vs_schedule_1f1b", "Schedule1F1B")):
            per_round = ratios(system, baseline)
            row[key] = None if per_round is None else statistics.median(per_round)
            row[key + "_range"] = None if per_round is None else [min(per_round), max(per_round)]
        row["compute_share_per_rank"] = measured["compute_share"].get(system)
        row["update_share_per_rank"] = measured["update_share"].get(system)
        results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed window")
    parser.add_argument("--rounds", type=int, default=9, help="timed windows per system, interleaved")
    parser.add_argument("--systems", default=",".join(TORCH + PIPECORE + VARIANTS),
                        help="comma-separated; the single-process baseline always runs")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "pipeline-cpu.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker.split(","), args.steps, args.rounds)))
        return
    if DEPTH % args.ranks:
        raise SystemExit(f"--ranks must divide the model's {DEPTH} blocks, got {args.ranks}")
    systems = [SINGLE] + [s for s in args.systems.split(",") if s and s != SINGLE]
    unknown = [s for s in systems[1:] if s not in TORCH + PIPECORE + VARIANTS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {TORCH + PIPECORE + VARIANTS}")
    print(f"{len(systems)} systems on {args.ranks} ranks, {args.rounds} rounds of {args.steps} steps ...", file=sys.stderr)
    results = summarize(launch(systems, args.ranks, args.steps, args.rounds), args.steps)
    print(f"{'system':<28}{'samples/s':>12}{'vs 1 process':>14}{'vs Schedule1F1B':>17}  compute share per rank "
          "(of which updates)")
    for r in results:
        vs_ref = f"{r['vs_schedule_1f1b']:.2f}x" if r["vs_schedule_1f1b"] is not None else "-"
        share = " ".join(f"{x:.0%} ({u:.0%})" for x, u in zip(r["compute_share_per_rank"] or [],
                                                             r["update_share_per_rank"] or []))
        print(f"{r['system']:<28}{r['samples_per_s']:>12.1f}{r['vs_single_process']:>13.2f}x{vs_ref:>17}  {share}")
    report = {
        "benchmark": "pipeline", "device": "cpu", "backend": "gloo", "dtype": "float32",
        "machine": machine(),
        "ranks": args.ranks, "threads_per_rank": 1, "batch": BATCH, "n_microbatches": MICRO,
        "model": f"{DEPTH} x (Linear({WIDTH},{WIDTH}) + ReLU) + Linear({WIDTH},10)",
        "steps_per_window": args.steps, "rounds": args.rounds,
        "method": "systems interleaved in the same processes; ratios are medians of per-round ratios",
        "results": results,
    }
    print(f"wrote {write_report(report, args.out)}", file=sys.stderr)


if __name__ == "__main__":
    main()
