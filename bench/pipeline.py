"""Multi-process pipelines on CPU/gloo: pipecore vs torch.distributed.pipelining vs one process.

    python bench/pipeline.py [--ranks 2] [--steps 20] [--windows 3] [--out bench/results/pipeline-cpu.json]

Same model (an MLP of 8 Linear(512, 512)+ReLU layers and a Linear(512, 10) head, float32), same split
points, batch 256, 8 micro-batches, one thread per rank, momentum SGD. Each system runs 3 warm-up steps,
then ``--windows`` timed windows of ``--steps`` steps (asynchronous pipecore algorithms flush at the end of
every window, inside the timing); the median window gives samples/s. The baseline is plain training in
one process with one thread: each micro-batch forward+backward, then the optimizer step.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

from _machine import machine

BATCH, MICRO, WIDTH, DEPTH = 256, 8, 512, 8
PIPECORE = ["1f1b", "gpipe", "2bw", "pipedream", "pipemare", "spectrain", "v-timeprest", "i-timeprest", "timeprest"]
TORCH = ["ScheduleGPipe", "Schedule1F1B"]


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


def data(steps: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(steps)]


def timed_windows(run_window, steps: int, windows: int, sync) -> list[float]:
    times = []
    for _ in range(windows):
        sync()
        start = time.perf_counter()
        run_window(steps)
        sync()
        times.append(time.perf_counter() - start)
    return times


def worker(system: str, steps: int, windows: int) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    first, last = rank == 0, rank == world - 1
    batches = data(steps)
    loss_fn = nn.CrossEntropyLoss()
    if system in TORCH:
        from torch.distributed import pipelining

        model = make_model()
        bounds = [0] + split_points(world) + [len(model)]
        stage_module = model[bounds[rank]: bounds[rank + 1]]
        stage = pipelining.PipelineStage(stage_module, rank, world, torch.device("cpu"))
        schedule = getattr(pipelining, system)(stage, n_microbatches=MICRO, loss_fn=loss_fn)
        opt = torch.optim.SGD(stage_module.parameters(), lr=0.01, momentum=0.9, foreach=True)

        def one(i: int) -> None:
            x, y = batches[i % len(batches)]
            if first:
                schedule.step(x)
            elif last:
                schedule.step(target=y)
            else:
                schedule.step()
            opt.step()
            opt.zero_grad()

        def run_window(n: int) -> None:
            for i in range(n):
                one(i)
    else:
        import pipecore

        pipe = pipecore.Pipeline(make_model(), world, system, MICRO, optimizer=pipecore.SGD(lr=0.01, momentum=0.9),
                                 loss_fn=loss_fn, partition=split_points(world), timeout=300)

        def one(i: int) -> None:
            x, y = batches[i % len(batches)]
            pipe.step(x if first else None, y if last else None)

        def run_window(n: int) -> None:
            for i in range(n):
                one(i)
            pipe.flush()

    for i in range(3):
        one(i)
    if system not in TORCH:
        pipe.flush()
    times = timed_windows(run_window, steps, windows, dist.barrier)
    dist.destroy_process_group()
    return {"system": system, "seconds_per_window": times}


def sequential(steps: int, windows: int) -> dict:
    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    loss_fn = nn.CrossEntropyLoss()
    batches = data(steps)

    def one(i: int) -> None:
        x, y = batches[i % len(batches)]
        for xs, ys in zip(x.chunk(MICRO), y.chunk(MICRO)):
            (loss_fn(model(xs), ys) / MICRO).backward()
        opt.step()
        opt.zero_grad()

    def run_window(n: int) -> None:
        for i in range(n):
            one(i)

    for i in range(3):
        one(i)
    return {"system": "single process, 1 thread", "seconds_per_window": timed_windows(run_window, steps, windows, lambda: None)}


def launch(system: str, ranks: int, steps: int, windows: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(ranks):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", system, "--steps", str(steps),
                                       "--windows", str(windows)], env=env, stdout=subprocess.PIPE, text=True))
    outputs = [p.communicate()[0] for p in procs]
    for p, out in zip(procs, outputs):
        if p.returncode:
            raise SystemExit(f"{system}: a rank failed:\n{out}")
    return json.loads(outputs[0].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--systems", default=",".join(TORCH + PIPECORE))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "pipeline-cpu.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.windows)))
        return
    results = [sequential(args.steps, args.windows)]
    for system in args.systems.split(","):
        print(f"running {system} on {args.ranks} ranks ...", file=sys.stderr)
        results.append(launch(system, args.ranks, args.steps, args.windows))
    samples = args.steps * BATCH
    for r in results:
        r["samples_per_s"] = samples / statistics.median(r["seconds_per_window"])
    base = results[0]["samples_per_s"]
    ref = next((r["samples_per_s"] for r in results if r["system"] == "Schedule1F1B"), None)
    print(f"{'system':<28}{'samples/s':>12}{'vs 1 process':>14}{'vs Schedule1F1B':>17}")
    for r in results:
        r["vs_single_process"] = r["samples_per_s"] / base
        r["vs_schedule_1f1b"] = r["samples_per_s"] / ref if ref else None
        vs_ref = f"{r['vs_schedule_1f1b']:.2f}x" if ref else "-"
        print(f"{r['system']:<28}{r['samples_per_s']:>12.1f}{r['vs_single_process']:>13.2f}x{vs_ref:>17}")
    report = {
        "benchmark": "pipeline", "device": "cpu", "backend": "gloo", "dtype": "float32",
        "machine": machine(),
        "ranks": args.ranks, "threads_per_rank": 1, "batch": BATCH, "n_microbatches": MICRO,
        "model": f"{DEPTH} x (Linear({WIDTH},{WIDTH}) + ReLU) + Linear({WIDTH},10)",
        "steps_per_window": args.steps, "windows": args.windows, "results": results,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
