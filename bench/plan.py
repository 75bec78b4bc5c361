"""The largest mini-batch each partition trains under a per-stage memory limit (DawnPiper vs PipeDream).

``python bench/plan.py [--limit 24MiB] [--draws 5] [--out PATH]`` (default ``--out``: bench/out/plan-cpu.json;
the committed result is ``--out bench/results/plan-cpu.json``)

The GPT of ``pipecore train --model gpt`` (4 blocks, width 64, 64-token windows, a vocabulary of 96), 4 stages,
4 micro-batches, SGD with momentum, float32, cut where modules start. For pipedream and 2bw, three partitions:

* ``memory``: DawnPiper's planner (``objective="memory"``): the largest batch for which it finds cuts and
  recomputed segments that fit the limit (binary search over batches);
* ``time``: PipeDream's planner (the slowest stage as fast as possible, made at the smallest batch), then the
  largest batch its cuts fit (``Plan.max_batch_size``);
* ``parameters``: the pipeline's default, balanced parameters, likewise.

Each maximum is then verified by training 2 steps at that batch and reading every stage's measured peak
(``stats()[s]["peak_bytes"]``, the CPU account; planned and trained with ``recover=False``, without the copies
that undo a failed step); where a peak is over the limit, the batch steps down by the micro-batch count
until none is (``max_batch``; ``predicted_max_batch`` is the plan's). The profile includes the loss (what it
saves counts at the last stage). Last, the three partitions train at the largest batch all of them fit, in
interleaved rounds: the throughput ratio to the time-balanced partition (median of per-round ratios).

The plans follow the profile's measured times, which vary from one profile to the next on a busy machine, and
the memory planner's cuts and recomputed segments with them: one profile is one draw of its maximum. So the
whole of the above is repeated for ``--draws`` profiles, and the result gives every draw and the range.
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
from pipecore.engine.graph import CapturedModel  # noqa: E402
from pipecore.planning.cuts import module_units  # noqa: E402
from pipecore.models import GPT  # noqa: E402
from pipecore.planning import InfeasibleMemoryLimit, parse_bytes, plan_costs, profile  # noqa: E402

VOCAB, BLOCK, STAGES, M = 96, 64, 4, 4
OBJECTIVES = ("memory", "time", "parameters")


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, BLOCK, n_layer=4, n_head=4, n_embd=64)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, BLOCK), generator=torch.Generator().manual_seed(seed))


def largest_memory_plan(costs, algorithm: str, limit: int, cuts, ceiling: int):
    """The plan at the largest batch (a multiple of M) for which the memory planner fits the limit."""
    def attempt(batch: int):
        try:
            return plan_costs(costs, STAGES, algorithm, batch, M, limit, "memory", cuts, recover=False)
        except InfeasibleMemoryLimit:
            return None

    low, best = 0, None  # low: micro-batch samples known to fit
    high = 1
    while high <= ceiling and (found := attempt(high * M)) is not None:
        low, best, high = high, found, high * 2
    high = min(high, ceiling + 1)
    while high - low > 1:
        middle = (low + high) // 2
        found = attempt(middle * M)
        if found is not None:
            low, best = middle, found
        else:
            high = middle
    return best


def train(plan, algorithm: str, batch: int, steps: int) -> tuple[list[int], float]:
    pipe = pipecore.Pipeline(gpt(), STAGES, algorithm, M, loss_fn=loss_fn, partition=plan, recover=False,
                             optimizer=pipecore.SGD(lr=0.01, momentum=0.9), track_memory=True)
    start = time.perf_counter()
    for i in range(steps):
        pipe.step(tokens(batch, i), tokens(batch, 1000 + i))
    seconds = (time.perf_counter() - start) / steps
    peaks = [s["peak_bytes"] for s in pipe.stats()]
    pipe.close()
    return peaks, seconds


def plan_and_verify(costs, cuts, algorithm: str, limit: int, ceiling: int, rounds: int) -> dict:
    """One draw: the three partitions of ``algorithm`` planned from ``costs``, each maximum verified by training,
    then their throughput at the largest batch all of them fit."""
    plans = {"memory": largest_memory_plan(costs, algorithm, limit, cuts, ceiling)}
    for objective in ("time", "parameters"):
        made = plan_costs(costs, STAGES, algorithm, M, M, None, objective, cuts, recover=False)
        plans[objective] = dataclasses.replace(made, memory_limit=limit)
    row: dict = {"partitions": {}}
    for objective, plan in plans.items():
        if plan is None:
            row["partitions"][objective] = {"max_batch": 0}
            continue
        predicted = plan.batch_size if objective == "memory" else plan.max_batch_size()
        batch = predicted
        while True:  # verified: step down until the measured peaks are under the limit
            at_batch = plan_costs(costs, STAGES, algorithm, batch, M, limit, objective, cuts, recover=False)
            peaks, _ = train(at_batch, algorithm, batch, steps=2)
            if max(peaks) <= limit or batch <= M:
                break
            batch -= M
        row["partitions"][objective] = {
            "predicted_max_batch": predicted, "max_batch": batch, "starts": list(at_batch.starts),
            "recomputed": [[list(seg) for seg in r] for r in at_batch.recomputed],
            "predicted_peak_bytes": list(at_batch.stage_memory), "measured_peak_bytes": peaks,
            "measured_under_limit": max(peaks) <= limit,
        }
        print(f"{algorithm:<10} {objective:<10} max batch {batch:>5} (predicted {predicted:>5})  measured peak "
              f"{max(peaks) / 2 ** 20:.2f} MiB of {limit / 2 ** 20:.2f} MiB  recomputed "
              f"{sum(len(r) for r in at_batch.recomputed)} segments", flush=True)
    common = min(p["max_batch"] for p in row["partitions"].values())
    row["common_batch"] = common
    if common >= M:
        fitted = {o: plan_costs(costs, STAGES, algorithm, common, M, limit, o, cuts, recover=False)
                  for o in OBJECTIVES}
        seconds: dict[str, list[float]] = {o: [] for o in OBJECTIVES}
        for r in range(rounds):
            for o in (OBJECTIVES if r % 2 == 0 else tuple(reversed(OBJECTIVES))):
                seconds[o].append(train(fitted[o], algorithm, common, steps=3)[1])
        row["throughput_vs_time"] = {
            o: round(statistics.median(t / s for t, s in zip(seconds["time"], seconds[o])), 3) for o in OBJECTIVES}
        print(f"{algorithm:<10} at batch {common}: throughput vs the time-balanced partition "
              f"{row['throughput_vs_time']}", flush=True)
    time_max = row["partitions"]["time"]["max_batch"]
    row["memory_over_time_max_batch"] = round(row["partitions"]["memory"]["max_batch"] / time_max, 2) \
        if time_max else None
    return row


def spread(values: list[float]) -> dict[str, object]:
    """The draws of one figure: each, and their least, median and greatest."""
    return {"draws": values, "min": min(values), "median": statistics.median(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", default="24MiB", help="memory per stage (default 24MiB)")
    parser.add_argument("--algorithms", default="pipedream,2bw")
    parser.add_argument("--ceiling", type=int, default=512, help="most samples per micro-batch searched")
    parser.add_argument("--draws", type=int, default=5,
                        help="profiles taken, each planned and verified anew: the plans follow the measured times, "
                             "which vary from one profile to the next (default 5)")
    parser.add_argument("--rounds", type=int, default=5, help="throughput rounds per draw")
    parser.add_argument("--out", default=default_out("plan-cpu.json"), help=OUT_HELP)
    args = parser.parse_args(argv)
    if args.draws < 1:
        parser.error(f"--draws must be at least 1, got {args.draws}")
    torch.set_num_threads(1)
    limit = parse_bytes(args.limit)
    algorithms = args.algorithms.split(",")
    model = gpt()
    cuts = [a for a, _ in module_units(CapturedModel(model, (), tokens(4, 0)))][1:]
    draws: dict[str, list[dict]] = {a: [] for a in algorithms}
    for draw in range(args.draws):
        print(f"draw {draw + 1} of {args.draws}: profiling", flush=True)
        costs = profile(gpt(), tokens(4, 0), optimizer=pipecore.SGD(lr=0.01, momentum=0.9), loss_fn=loss_fn,
                        example_target=tokens(4, 1))
        for algorithm in algorithms:
            draws[algorithm].append(plan_and_verify(costs, cuts, algorithm, limit, args.ceiling, args.rounds))
    results = []
    for algorithm in algorithms:
        rows = draws[algorithm]
        summary: dict = {"algorithm": algorithm, "limit_bytes": limit}
        for objective in OBJECTIVES:
            summary[f"{objective}_max_batch"] = spread([r["partitions"][objective]["max_batch"] for r in rows])
        ratios = [r["memory_over_time_max_batch"] for r in rows if r["memory_over_time_max_batch"] is not None]
        if ratios:
            summary["memory_over_time_max_batch"] = spread(ratios)
        for objective in ("memory", "parameters"):
            measured = [r["throughput_vs_time"][objective] for r in rows if "throughput_vs_time" in r]
            if measured:
                summary[f"throughput_{objective}_vs_time"] = spread(measured)
        summary["all_under_limit"] = all(p.get("measured_under_limit", True) for r in rows
                                         for p in r["partitions"].values())
        print(f"{algorithm:<10} over {args.draws} draws: memory planner's max batch "
              f"{summary['memory_max_batch']['min']}-{summary['memory_max_batch']['max']}, time-balanced "
              f"{summary['time_max_batch']['min']}-{summary['time_max_batch']['max']}, ratio "
              + (f"{min(ratios):.2f}-{max(ratios):.2f}x (median {statistics.median(ratios):.2f}x)" if ratios else "-"),
              flush=True)
        results.append({**summary, "draws": rows})
    report = {"benchmark": "plan", "command": "python bench/plan.py", "machine": machine(), "device": "cpu",
              "dtype": "float32", "model": f"GPT 4 blocks, width 64, {BLOCK} tokens, vocabulary {VOCAB}",
              "stages": STAGES, "microbatches": M, "draws": args.draws, "results": results,
              "target": "pipedream: the memory planner's max batch >= 2x the time-balanced one; throughput within "
                        "10% of it at equal batch"}
    print(f"wrote {write_report(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
