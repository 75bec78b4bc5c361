"""How long planning takes: ``plan_costs`` per objective, and the smallest-limit search, on profiled GPTs.

``python bench/planning_time.py [--layers 4,8] [--costs-dir DIR] [--out PATH]``

For each GPT (width 64, 64-token windows, a vocabulary of 96, ``--layers`` blocks), profiled once on the CPU
(the profile's own time is reported too), 4 stages, 4 micro-batches of 16 samples, pipedream: the seconds of

* ``plan_costs`` for the ``"parameters"``, ``"time"`` and ``"memory"`` objectives, the memory one at 1.25x
  the smallest limit it can meet, each with cuts where modules start (``modules``) and, for graphs of at
  most ``--node-cuts-up-to`` nodes (default 400), anywhere (``nodes``): the smallest-limit search with node
  cuts grows steeply with the graph (about a minute for the 8-block GPT's 338 nodes);
* ``smallest_memory_limit(..., "memory")`` (what an infeasible limit's error runs), likewise.

Each figure is the median of ``--repeats`` runs, each on a fresh ``StageModel`` (nothing cached between
runs). Planning is pure Python and numpy on one thread: the figures do not depend on the device the costs
were measured on. They do depend on the profile (its measured times decide what the memory paths recompute),
which differs from run to run: ``--costs-dir DIR`` saves each profile on the first run and loads it on later
ones, so that two versions of the planner can be timed on the same costs, e.g. an earlier commit's through
``PYTHONPATH=<its built checkout> python bench/planning_time.py --costs-dir DIR``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipecore  # noqa: E402
from _machine import OUT_HELP, default_out, machine, write_report  # noqa: E402
from pipecore.engine.graph import CapturedModel  # noqa: E402
from pipecore.planning.cuts import module_units  # noqa: E402
from pipecore.models import GPT  # noqa: E402
from pipecore.planning import Sizing, plan_costs, profile, smallest_memory_limit  # noqa: E402

VOCAB, BLOCK, STAGES, M, SAMPLES = 96, 64, 4, 4, 16


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def seconds(work: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times), 3)


def planner_commit() -> str | None:
    """The git commit of the checkout the timed pipecore was imported from (None outside a git checkout): a
    run with ``PYTHONPATH`` pointing at another checkout times that checkout's planner."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(pipecore.__file__).resolve().parent,
                              capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="4,8", help="comma-separated block counts (default 4,8)")
    parser.add_argument("--algorithm", default="pipedream")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--node-cuts-up-to", type=int, default=400, help="largest graph (nodes) timed with node cuts")
    parser.add_argument("--costs-dir", metavar="DIR",
                        help="keep each GPT's profile in DIR: saved there by the first run, loaded by the next (so "
                             "that two versions of the planner are timed on the same costs)")
    parser.add_argument("--out", default=default_out("planning-time-cpu.json"), help=OUT_HELP)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sizing = Sizing.of(args.algorithm, STAGES, M)
    rows = []
    for layers in (int(n) for n in args.layers.split(",")):
        torch.manual_seed(0)
        model = GPT(VOCAB, BLOCK, n_layer=layers, n_head=4, n_embd=64)
        x = torch.randint(0, VOCAB, (4, BLOCK))
        start = time.perf_counter()
        saved = Path(args.costs_dir) / f"gpt-{layers}-blocks.pt" if args.costs_dir else None
        loaded = saved is not None and saved.exists()
        if loaded:
            costs = torch.load(saved, weights_only=False)
        else:
            costs = profile(model, x, optimizer=pipecore.SGD(lr=0.01, momentum=0.9), loss_fn=loss_fn,
                            example_target=x)
            if saved is not None:
                saved.parent.mkdir(parents=True, exist_ok=True)
                torch.save(costs, saved)
        row: dict = {"layers": layers, "nodes": len(costs), "profile_loaded": loaded,
                     "profile_seconds": None if loaded else round(time.perf_counter() - start, 2)}
        module_cuts = [a for a, _ in module_units(CapturedModel(model, (), x))][1:]
        scaled = costs.at_microbatch_size(SAMPLES)
        for name, cuts in (("modules", module_cuts), ("nodes", None)):
            if name == "nodes" and len(costs) > args.node_cuts_up_to:
                continue
            smallest = smallest_memory_limit(scaled, STAGES, "memory", sizing, cuts)
            timings = {"smallest_memory_limit": seconds(
                lambda: smallest_memory_limit(scaled, STAGES, "memory", sizing, cuts), args.repeats)}
            for objective in ("parameters", "time", "memory"):
                limit = 1.25 * smallest if objective == "memory" else None
                timings[f"plan_{objective}"] = seconds(
                    lambda: plan_costs(costs, STAGES, args.algorithm, SAMPLES * M, M, limit, objective, cuts),
                    args.repeats)
            row[name] = {"positions": len(cuts) + 2 if cuts is not None else len(costs) + 1,
                         "smallest_limit_bytes": smallest, "seconds": timings}
            print(f"{layers} blocks ({len(costs)} nodes), {name} cuts: {timings}", flush=True)
        rows.append(row)
    command = "python bench/planning_time.py " + " ".join(argv or sys.argv[1:])
    report = {"benchmark": "planning_time", "command": command.strip(),
              "machine": machine(), "device": "cpu", "dtype": "float32", "algorithm": args.algorithm,
              "stages": STAGES, "microbatches": M, "samples_per_microbatch": SAMPLES,
              "model": f"GPT width 64, {BLOCK} tokens, vocabulary {VOCAB}", "repeats": args.repeats,
              "node_cuts_up_to": args.node_cuts_up_to, "planner_commit": planner_commit(), "results": rows}
    print(f"wrote {write_report(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
