"""The CPU memory model against the CPU account: predicted and measured peak per stage and per term, every
algorithm, a GPT and a ResNet, cut by parameters and by time.

``python bench/memory_cpu.py [--models gpt,resnet] [--algorithms all] [--objectives parameters,time]
[--steps N] [--out PATH]``

The models are those of ``tests/test_plan_api.py``: a GPT (4 blocks of width 64, 32 tokens, a vocabulary of 64)
as 4 stages and a ResNet (width 16, 3 blocks, 8x8 images) as 3 stages (4 for the algorithms that place two
stages per rank: interleaved-1f1b and looped-bfs with ``stages_per_rank=2``, zb-v, dualpipe-v); float32, SGD
with momentum, 4 micro-batches of 8 samples. Each model is profiled once (:func:`pipecore.profile`, with its
loss); each algorithm and objective is planned with :func:`pipecore.planning.plan_costs` (module cuts), trained
at the plan with ``track_memory=True`` and the default ``recover=True`` for the schedule's warm-up plus 3
mini-batches (``--steps`` to override), and each stage's ``peak_bytes`` is compared with the plan's.

Per stage, beside each term of ``Plan.memory_breakdown()``, what the stage measures for it: the ring
(weights), the gradient and scratch buffers, the declared buffers, the optimizer state, the undo copies (the
snapshots its undo points and pool hold), and the account's per-micro-batch peak (activations, boundary and the
recomputation transient together: the account sees them as one). ``error`` is ``(predicted - measured) /
measured`` of the peak. The JSON (``--out``) holds every case, stage and term, and the largest error per
model and algorithm.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipecore  # noqa: E402
from _machine import OUT_HELP, default_out, machine, write_report  # noqa: E402
from pipecore.algorithms import algorithm_names, get_algorithm  # noqa: E402
from pipecore.engine.graph import CapturedModel  # noqa: E402
from pipecore.engine.memory import storage_bytes  # noqa: E402
from pipecore.models import GPT, ResNet  # noqa: E402
from pipecore.planning import plan_costs  # noqa: E402
from pipecore.planning.cuts import module_units  # noqa: E402

MICROBATCHES, SAMPLES = 4, 8  # micro-batches per mini-batch, samples per micro-batch
TWO_PER_RANK = {"interleaved-1f1b": {"stages_per_rank": 2}, "looped-bfs": {"stages_per_rank": 2}, "zb-v": {},
                "dualpipe-v": {}}
TERMS = ("weights", "gradients", "scratch", "buffers", "optimizer", "undo", "per_microbatch")


def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


MODELS = {
    "gpt": (4, lambda: GPT(vocab_size=64, block_size=32, n_layer=4, n_head=2, n_embd=64),
            lambda n: torch.randint(0, 64, (n, 32)), lambda n: torch.randint(0, 64, (n, 32)), lm_loss),
    "resnet": (3, lambda: ResNet(in_channels=1, num_classes=10, width=16, blocks=3),
               lambda n: torch.randn(n, 1, 8, 8), lambda n: torch.randint(0, 10, (n,)), nn.CrossEntropyLoss()),
}


def measured_terms(stage: object) -> dict[str, int]:
    """What a CPU stage holds, by the model's terms (the account's per-micro-batch peak as one)."""
    state = stage.state
    parts = {"weights": storage_bytes(state.ring.buffer), "gradients": storage_bytes(state.grad),
             "scratch": storage_bytes(state.scratch), "buffers": storage_bytes(list(state.buffers.values())),
             "optimizer": storage_bytes(state.optimizer.state_dict())}
    parts["undo"] = stage.static_bytes() - storage_bytes(state.tensors())
    parts["per_microbatch"] = stage.memory.peak
    return parts


def predicted_terms(m: object) -> dict[str, int]:
    return {"weights": m.weights, "gradients": m.gradients, "scratch": m.scratch, "buffers": m.buffers,
            "optimizer": m.optimizer, "undo": m.undo,
            "per_microbatch": m.activations + m.recomputation + m.boundary}


def run_case(name: str, algorithm: str, objective: str, costs: object, cuts: list[int], steps: int | None) -> dict:
    default_stages, make, inputs, targets, loss_fn = MODELS[name]
    options = TWO_PER_RANK.get(algorithm)
    num_stages = default_stages if options is None else 4
    options = options or {}
    optimizer = pipecore.SGD(lr=0.01, momentum=0.9)
    batch = MICROBATCHES * SAMPLES
    plan = plan_costs(costs, num_stages, algorithm, batch, MICROBATCHES, objective=objective, allowed_cuts=cuts,
                      **options)
    torch.manual_seed(0)
    pipe = pipecore.Pipeline(make(), num_stages, algorithm, MICROBATCHES, loss_fn=loss_fn, partition=plan,
                             optimizer=optimizer, track_memory=True, **options)
    count = steps if steps is not None else get_algorithm(algorithm, num_stages, MICROBATCHES,
                                                          **options).warmup_minibatches + 3
    try:
        for _ in range(count):
            pipe.step(inputs(batch), targets(batch))
        peaks = [s["peak_bytes"] for s in pipe.stats()]
        stages = []
        for s, (predicted, m) in enumerate(zip(plan.stage_memory, plan.memory_breakdown())):
            got = peaks[s]
            stages.append({"stage": s, "predicted": predicted, "measured": got, "error": (predicted - got) / got,
                           "predicted_terms": predicted_terms(m), "measured_terms": measured_terms(pipe.stages[s])})
    finally:
        pipe.close()
    return {"model": name, "algorithm": algorithm, "objective": objective, "num_stages": num_stages,
            "options": options, "steps": count, "starts": list(plan.starts),
            "max_abs_error": max(abs(s["error"]) for s in stages), "stages": stages}


def table(case: dict) -> list[str]:
    head = f"{'stage':>5} {'predicted':>10} {'measured':>10} {'error':>7}  " + "  ".join(
        f"{t:>21}" for t in TERMS)
    lines = [head]
    for s in case["stages"]:
        cells = [f"{s['predicted_terms'][t]:>10}/{s['measured_terms'][t]:<10}" for t in TERMS]
        lines.append(f"{s['stage']:>5} {s['predicted']:>10} {s['measured']:>10} {s['error']:>+7.1%}  "
                     + "  ".join(cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,resnet", help="comma-separated: gpt, resnet")
    parser.add_argument("--algorithms", default="all", help="comma-separated names, or all")
    parser.add_argument("--objectives", default="parameters,time", help="comma-separated: parameters, time")
    parser.add_argument("--steps", type=int, default=None,
                        help="mini-batches trained per case (default: the schedule's warm-up plus 3)")
    parser.add_argument("--out", default=default_out("memory-cpu.json"), help=OUT_HELP)
    args = parser.parse_args()
    models = args.models.split(",")
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    algorithms = algorithm_names() if args.algorithms == "all" else args.algorithms.split(",")
    objectives = args.objectives.split(",")
    cases, worst = [], {}
    started = time.perf_counter()
    for name in models:
        _, make, inputs, targets, loss_fn = MODELS[name]
        torch.manual_seed(0)
        model = make()
        costs = pipecore.profile(model, inputs(SAMPLES), optimizer=pipecore.SGD(lr=0.01, momentum=0.9),
                                 loss_fn=loss_fn, example_target=targets(SAMPLES))
        cuts = [a for a, _ in module_units(CapturedModel(model, (), inputs(SAMPLES)))][1:]
        for algorithm in algorithms:
            for objective in objectives:
                t0 = time.perf_counter()
                case = run_case(name, algorithm, objective, costs, cuts, args.steps)
                cases.append(case)
                key = f"{name}/{algorithm}"
                worst[key] = max(worst.get(key, 0.0), case["max_abs_error"])
                print(f"[{len(cases)}] {name} {algorithm} objective={objective} stages={case['num_stages']} "
                      f"steps={case['steps']}: max |error| {case['max_abs_error']:.1%} "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)
                for line in table(case):
                    print("    " + line)
    print("\nlargest |error| of a stage's peak, per model and algorithm (both objectives):")
    for key, err in worst.items():
        print(f"  {key:<28} {err:7.1%}")
    report = {
        "benchmark": "memory_cpu", "device": "cpu", "dtype": "float32", "machine": machine(),
        "sizes": {"microbatches": MICROBATCHES, "samples_per_microbatch": SAMPLES,
                  "gpt": "4 blocks, width 64, 32 tokens, vocabulary 64, 4 stages",
                  "resnet": "width 16, 3 blocks, 1x8x8 images, 3 stages"},
        "optimizer": "SGD(lr=0.01, momentum=0.9)", "recover": True,
        "terms": list(TERMS), "max_abs_error": worst, "cases": cases,
        "seconds": time.perf_counter() - started,
    }
    print(f"wrote {write_report(report, args.out)}")


if __name__ == "__main__":
    main()
