"""pipecore's in-turn executor against a hand-written loop that runs the same schedule in the same order.

``python bench/hand_written.py [--width 512] [--layers 8] [--batches 256,1024] [--microbatches 8]
[--stages 2] [--algorithms gpipe,1f1b] [--warmup 3] [--window 3] [--rounds 9]
[--out PATH]``

An in-turn pipeline (``concurrent=False``) computes what plain training computes, yet its step takes longer.
This benchmark splits that extra time in two, on one thread (``torch.set_num_threads(1)``):

* what the schedule's *order* costs, whoever runs it: a pipeline keeps several micro-batches in flight, so
  a micro-batch's activations have left the caches by the time its backward reads them;
* what *pipecore* costs on top: its executor, weight ring, gradient buffer and bookkeeping.

Configurations, timed in the same rounds (a window of steps each, in an order rotated every round):

* ``sequential``: plain micro-batched training (``bench/engine.py``'s: per micro-batch forward, ``loss / m``,
  backward; then ``torch.optim.SGD(momentum=0.9, foreach=True)``).
* ``cut``: the model as the same ``--stages`` stage modules (plain ``nn.Sequential`` slices, the cut pipecore
  makes), each micro-batch's forward and backward straight after each other: what cutting alone costs (the
  detached hand-over and the gradient passed back).
* ``<alg>/hand``: those stage modules running the forwards and backwards of pipecore's ``<alg>`` schedule,
  stage by stage in the order pipecore's in-turn executor runs them (a stage runs its next actions until one
  waits for another stage), and an optimizer step where the schedule updates. Only flushing schedules
  (gpipe, 1f1b): their weights change only after every backward of the mini-batch, which plain modules and
  ``torch.optim`` can do.
* ``<alg>/pipecore``: ``pipecore.Pipeline(concurrent=False)`` with ``pipecore.SGD(momentum=0.9)``, with the
  bookkeeping off (``track_memory=False, recover=False``), and ``<alg>/pipecore+defaults`` with the defaults.

Reported per batch and algorithm: ``order_cost`` = hand-written step / cut step (what the order costs),
``pipecore_cost`` = pipecore step / hand-written step (lean and defaults), ``cut_cost`` = cut step /
sequential step; each the median of per-round ratios, with the range. Every configuration trains from the
same weights on the same data; before timing, each trains 3 steps and its weights must match sequential
training's (bit for bit is not expected: pipecore's fused SGD rounds differently from torch's; the largest
difference is reported and must stay below 1e-5, or the exit status is 1).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, ContextManager

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipecore  # noqa: E402
from _machine import OUT_HELP, default_out, machine, write_report  # noqa: E402
from engine import (LR, Config, make_model, measure, median_range, mlp_data, rotating,  # noqa: E402
                    sequential_trainer, torch_threads)
from pipecore.algorithms import get_algorithm  # noqa: E402
from pipecore.schedule.ir import B, F, U, Kind  # noqa: E402
from pipecore.schedule.schedule import upstream  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FLUSHING = ("gpipe", "1f1b")  # the schedules a plain module and torch.optim can run (see the docstring)
MAX_WEIGHT_DIFF = 1e-5
LEAN = {"track_memory": False, "recover": False}


def stage_modules(model: nn.Sequential, stages: int) -> list[nn.Sequential]:
    """``model`` cut into ``stages`` equal runs of its children (the cut :func:`cuts` gives pipecore)."""
    per = len(model) // stages
    return [model[s * per:(s + 1) * per] for s in range(stages)]


def cuts(model: nn.Sequential, stages: int) -> list[int]:
    """Where stages ``1..P-1`` start, as ``Pipeline(partition=...)`` takes it."""
    per = len(model) // stages
    return [s * per for s in range(1, stages)]


def in_turn_order(name: str, stages: int, m: int) -> list[tuple[int, Kind, int]]:
    """One mini-batch of ``name``'s schedule as ``(stage, kind, micro-batch)``, in the order the in-turn
    executor runs it: each stage in turn runs its next actions until one waits for another stage's, round
    after round until every stage is done."""
    rows = get_algorithm(name, stages, m).schedule(1).stages
    done: set[tuple[int, Kind, int]] = set()
    cursor = [0] * stages
    order: list[tuple[int, Kind, int]] = []
    while any(cursor[s] < len(rows[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while cursor[s] < len(rows[s]):
                action = rows[s][cursor[s]]
                need = upstream(action, stages)
                if need is not None and need not in done:
                    break
                if action.kind in (F, B):
                    if action.count != 1:
                        raise ValueError(f"{name}: action {action} covers {action.count} micro-batches")
                    done.add((s, action.kind, action.index))
                order.append((s, action.kind, action.index))
                cursor[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{name}'s schedule waits forever in turn at {cursor}")
    return order


def run_in_order(parts: list[nn.Module], order: list[tuple[int, Kind, int]], x: torch.Tensor, y: torch.Tensor,
                 m: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 update: Callable[[int], None], forward_context: Callable[[], ContextManager] = nullcontext
                 ) -> torch.Tensor:
    """One mini-batch through the stage modules ``parts`` in ``order``, by hand: forwards with the hand-over
    detached, backwards passing the gradient back, ``update(s)`` for a stage's update action; each forward runs
    inside ``forward_context()`` (autocast, say). Returns the mean micro-batch loss."""
    stages = len(parts)
    xs, ys = x.chunk(m), y.chunk(m)
    received: dict[tuple[int, int], torch.Tensor] = {}  # (stage, k) -> its input, a leaf below stage 0
    sent: dict[tuple[int, int], torch.Tensor] = {}      # (stage, k) -> its output, or the loss / m
    grads: dict[tuple[int, int], torch.Tensor] = {}     # (stage, k) -> the gradient of its output
    losses = []
    for s, kind, k in order:
        if kind is F:
            h = xs[k] if s == 0 else sent[(s - 1, k)].detach().requires_grad_(True)
            received[(s, k)] = h
            with forward_context():
                out = parts[s](h)
                if s == stages - 1:
                    loss = loss_fn(out, ys[k])
                    losses.append(loss.detach())
                    out = loss / m
            sent[(s, k)] = out
        elif kind is B:
            out = sent.pop((s, k))
            out.backward(None if s == stages - 1 else grads.pop((s, k)))
            h = received.pop((s, k))
            if s > 0:
                grads[(s - 1, k)] = h.grad
        else:  # a flushing schedule updates a stage after all of its backwards
            update(s)
    return torch.stack(losses).mean()


def hand_written_trainer(model: nn.Sequential, stages: int, m: int, order: list[tuple[int, Kind, int]]
                         ) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """A step: the ``stages`` stage modules of ``model`` run ``order`` (forwards and backwards by hand, with
    the hand-over detached and its gradient passed back; an update: one step of the stage's optimizer)."""
    parts = stage_modules(model, stages)
    optimizers = [torch.optim.SGD(part.parameters(), lr=LR, momentum=0.9, foreach=True) for part in parts]
    loss_fn = nn.CrossEntropyLoss()

    def update(s: int) -> None:
        optimizers[s].step()
        optimizers[s].zero_grad(set_to_none=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        return float(run_in_order(parts, order, x, y, m, loss_fn, update))

    return step


def cut_trainer(model: nn.Sequential, stages: int, m: int) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """The stage modules with each micro-batch's forward and backward straight after each other."""
    order = [a for k in range(m) for a in
             [(s, F, k) for s in range(stages)] + [(s, B, k) for s in reversed(range(stages))]]
    return hand_written_trainer(model, stages, m, order + [(s, U, 1) for s in range(stages)])


def pipeline(name: str, model: nn.Sequential, stages: int, m: int, lean: bool) -> pipecore.Pipeline:
    return pipecore.Pipeline(model, stages, algorithm=name, n_microbatches=m, partition=cuts(model, stages),
                             optimizer=pipecore.SGD(lr=LR, momentum=0.9), loss_fn=nn.CrossEntropyLoss(),
                             concurrent=False, **(LEAN if lean else {}))


def build(names: list[str], base: nn.Sequential, stages: int, m: int) -> tuple[list[Config], dict[str, nn.Module]]:
    """The configurations, each on its own copy of ``base``; and each one's model (whose parameters it
    trains; a pipeline's: its ``state_dict``)."""
    models = {}

    def own(label: str) -> nn.Sequential:
        models[label] = copy.deepcopy(base)
        return models[label]

    configs = [Config("sequential", sequential_trainer(own("sequential"), m)),
               Config("cut", cut_trainer(own("cut"), stages, m))]
    for name in names:
        configs.append(Config(f"{name}/hand", hand_written_trainer(own(f"{name}/hand"), stages, m,
                                                                   in_turn_order(name, stages, m))))
        for label, lean in ((f"{name}/pipecore", True), (f"{name}/pipecore+defaults", False)):
            pipe = pipeline(name, copy.deepcopy(base), stages, m, lean)
            configs.append(Config(label, pipe.step, pipe))
    return configs, models


def weights_of(config: Config, models: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    if config.pipe is not None:
        config.pipe.flush()
        return {k: v for k, v in config.pipe.state_dict().items() if k != "pipecore"}
    return models[config.name].state_dict()


def largest_weight_diff(configs: list[Config], models: dict[str, nn.Module],
                        data: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Train every configuration on ``data``; each one's largest |weight difference| from sequential's."""
    for c in configs:
        for x, y in data:
            c.step(x, y)
    reference = weights_of(configs[0], models)
    return {c.name: max(float((w - reference[k]).abs().max()) for k, w in weights_of(c, models).items())
            for c in configs[1:]}


def ratios(rates: dict[str, list[float]], slower: str, faster: str) -> dict[str, object]:
    """Per round, ``slower``'s step time over ``faster``'s (samples/s of ``faster`` over ``slower``)."""
    return median_range([f / s for s, f in zip(rates[slower], rates[faster])])


def run_batch(names: list[str], width: int, layers: int, batch: int, stages: int, m: int, warmup: int,
              window: int, rounds: int) -> dict[str, object]:
    base = make_model(width, layers)
    check, models = build(names, base, stages, m)
    diffs = largest_weight_diff(check, models, mlp_data(batch, width, 3))
    configs, _ = build(names, base, stages, m)
    rates = measure(configs, mlp_data(batch, width, window), warmup, rounds, order=rotating(configs))
    step_ms = {name: round(1e3 * batch / statistics.median(r), 2) for name, r in rates.items()}
    per_algorithm = {
        name: {"order_cost": ratios(rates, f"{name}/hand", "cut"),
               "pipecore_cost": ratios(rates, f"{name}/pipecore", f"{name}/hand"),
               "pipecore_cost_defaults": ratios(rates, f"{name}/pipecore+defaults", f"{name}/hand"),
               "pipecore_over_sequential": ratios(rates, f"{name}/pipecore", "sequential")}
        for name in names}
    return {"batch": batch, "step_ms": step_ms, "cut_cost": ratios(rates, "cut", "sequential"),
            "algorithms": per_algorithm, "max_weight_diff_vs_sequential": diffs}


def print_batch(result: dict[str, object]) -> None:
    print(f"batch {result['batch']}: step ms " + ", ".join(f"{k} {v}" for k, v in result["step_ms"].items()))
    print(f"  cut / sequential {result['cut_cost']['median']}")
    for name, r in result["algorithms"].items():
        print(f"  {name}: order (hand / cut) {r['order_cost']['median']}, pipecore / hand "
              f"{r['pipecore_cost']['median']} lean, {r['pipecore_cost_defaults']['median']} defaults")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8, help="Linear+ReLU blocks")
    parser.add_argument("--batches", default="256,1024", help="comma-separated batch sizes")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--algorithms", default=",".join(FLUSHING), help=f"a subset of {','.join(FLUSHING)}")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration")
    parser.add_argument("--window", type=int, default=3, help="steps per timed window")
    parser.add_argument("--rounds", type=int, default=9, help="timed windows per configuration")
    parser.add_argument("--out", default=default_out("hand-written-cpu.json"), help=OUT_HELP)
    args = parser.parse_args(argv)
    names = args.algorithms.split(",")
    if not names or any(n not in FLUSHING for n in names):
        parser.error(f"--algorithms takes a subset of {','.join(FLUSHING)} (flushing schedules), got "
                     f"{args.algorithms!r}")
    if (2 * args.layers) % args.stages:
        parser.error(f"--stages must divide the model's {2 * args.layers} modules, got {args.stages}")
    batches = [int(b) for b in args.batches.split(",")]
    if any(b % args.microbatches for b in batches):
        parser.error(f"every batch must be divisible by --microbatches {args.microbatches}, got {args.batches}")

    results = []
    with torch_threads(1):
        for batch in batches:
            result = run_batch(names, args.width, args.layers, batch, args.stages, args.microbatches,
                               args.warmup, args.window, args.rounds)
            print_batch(result)
            results.append(result)
        description = machine()
    report = {
        "benchmark": "hand_written",
        "command": "python bench/hand_written.py" + ("" if argv is None and len(sys.argv) == 1
                                                     else " " + " ".join(sys.argv[1:] if argv is None else argv)),
        "machine": description,
        "device": "cpu",
        "dtype": "float32",
        "model": f"{args.layers} x (Linear({args.width}, {args.width}) + ReLU), cross-entropy",
        "sizes": {"width": args.width, "layers": args.layers, "batches": batches, "microbatches": args.microbatches,
                  "stages": args.stages},
        "timing": {"warmup_steps": args.warmup, "window_steps": args.window, "rounds": args.rounds,
                   "threads": "torch.set_num_threads(1), one thread for every configuration"},
        "statistic": "step_ms: median over windows; order_cost = <alg>/hand over cut, pipecore_cost = "
                     "<alg>/pipecore (track_memory=False, recover=False) over <alg>/hand, pipecore_cost_defaults "
                     "= with the defaults, pipecore_over_sequential and cut_cost over sequential: step-time "
                     "ratios, median and range of per-round ratios",
        "results": results,
    }
    path = write_report(report, args.out)
    print(f"wrote {path}")
    bad = {(r["batch"], name): d for r in results for name, d in r["max_weight_diff_vs_sequential"].items()
           if d > MAX_WEIGHT_DIFF}
    if bad:
        print(f"weights differ from sequential training by more than {MAX_WEIGHT_DIFF}: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
