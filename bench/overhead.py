"""Host overhead per action: pipecore against plain training, a hand-written loop and torch's pipelining.

``python bench/overhead.py [--widths 16,256] [--batch 64] [--layers 8] [--stages 4] [--microbatches 8]
[--algorithms 1f1b,2bw,pipedream] [--warmup 3] [--window 10] [--rounds 9] [--no-torch]
[--out PATH]``

``python bench/overhead.py --profile [--width 16] [--steps 5] [--cprofile CONFIG]``

``python bench/overhead.py --example [--example-rounds 3] [--out PATH]``

The model is ``8 x (Linear(w, w) + ReLU)`` (cross-entropy over ``w`` classes), cut into 4 stages of equal
length, 8 micro-batches of a batch of 64, float32, one torch intra-op thread per thread that computes
(``torch.set_num_threads(1)`` for the in-turn configurations; a stage thread of pipecore takes its share,
``threads_per_stage``, which on a 2-core machine with 4 stages is 1 as well). At width 16 the stages compute
almost nothing, so a step's time is what the host spends around the kernels. Configurations:

* ``plain``: plain training with 8-way gradient accumulation (``torch.optim.SGD(momentum=0.9, foreach=True)``).
* ``hand``: the 4 stage modules run by a hand-written loop in 1F1B's in-turn order (``bench/hand_written.py``'s
  ``run_in_order``), an optimizer step per stage after its last backward.
* ``pipecore/<alg>/<turn|threads>/<defaults|lean>``: ``pipecore.Pipeline(algorithm=<alg>,
  concurrent=False|True)`` with ``pipecore.SGD(momentum=0.9)``; ``lean`` is ``recover=False,
  track_memory=False``, ``defaults`` keeps both.
* ``pipecore/<alg>/auto/defaults``: ``concurrent`` left at its default: with every stage on the CPU the
  pipeline times its first steps on its stage threads and in turn and keeps the threads only if they are
  clearly faster, probing again after 100 steps (the JSON row's ``execution`` says which way it ran last).
* ``torch/Interleaved1F1B`` and ``torch/LoopedBFS``: ``torch.distributed.pipelining`` with one gloo rank
  holding all 4 stages (``PipelineStage`` per stage module, the schedule over the 4 stages), the same optimizer.

Every configuration's window (``--window`` steps) is timed with process CPU time (``time.process_time``: every
thread of the process) and wall time, configurations interleaved in rounds whose order rotates every round.
Reported per width: ms per step (median over rounds), and per configuration the median and range of per-round
ratios to ``hand``, to ``torch/LoopedBFS`` and (pipecore) defaults over lean; ``us_per_action_over_plain`` =
(step - plain step) / actions per step, with 2 x m x P + P = 68 actions for every configuration (a forward
and a backward of every micro-batch on every stage, an update per stage).

``--profile``: calls per action of each configuration (``sys.setprofile``/``threading.setprofile`` counting
``call`` events, Python functions, and ``call`` + ``c_call`` events, every call as cProfile counts them,
over ``--steps`` steps, divided by 68 x steps), and the Python bytecode instructions executed per action
(``sys.settrace``/``threading.settrace`` with ``frame.f_trace_opcodes``: ``opcode`` events, every frame's,
the model's and torch's Python too, over the same steps run again);
``--cprofile CONFIG`` also prints that configuration's cProfile listing (top 40 by own time).

``--example``: ``python examples/train_mlp.py`` as a new user runs it (a process, the defaults) against the same
with ``OMP_NUM_THREADS=1``, alternating, ``--example-rounds`` times each: wall time and the children's CPU time
(user + system) per run, and per round the ratio default / ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import os
import pstats
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipecore  # noqa: E402
from _machine import OUT_HELP, default_out, machine, write_report  # noqa: E402
from engine import LR, make_model, median_range, sequential_trainer  # noqa: E402
from hand_written import cuts, hand_written_trainer, in_turn_order, stage_modules  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LEAN = {"track_memory": False, "recover": False}
TORCH_SCHEDULES = ("Interleaved1F1B", "LoopedBFS")


@dataclass
class Config:
    name: str
    step: Callable[[torch.Tensor, torch.Tensor], object]
    pipe: pipecore.Pipeline | None = None
    cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    switches: list[float] = field(default_factory=list)  # the process's context switches per step

    def settle(self) -> None:
        if self.pipe is not None:
            self.pipe.synchronize()


_WAYS = {False: "turn", True: "threads", None: "auto"}  # concurrent= -> the label's part


def pipecore_config(name: str, model: nn.Sequential, stages: int, m: int, threads: bool | None,
                    lean: bool) -> Config:
    pipe = pipecore.Pipeline(model, stages, algorithm=name, n_microbatches=m, partition=cuts(model, stages),
                             optimizer=pipecore.SGD(lr=LR, momentum=0.9), loss_fn=nn.CrossEntropyLoss(),
                             concurrent=threads, **(LEAN if lean else {}))
    label = f"pipecore/{name}/{_WAYS[threads]}/{'lean' if lean else 'defaults'}"
    return Config(label, pipe.step, pipe)


_GROUP_READY = False


def torch_config(schedule: str, model: nn.Sequential, stages: int, m: int) -> Config:
    """torch.distributed.pipelining with one gloo rank holding every stage."""
    global _GROUP_READY
    import torch.distributed as dist
    from torch.distributed import pipelining as tp

    if not _GROUP_READY:
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        _GROUP_READY = True
    parts = stage_modules(model, stages)
    device = torch.device("cpu")
    pipeline_stages = [tp.PipelineStage(part, s, stages, device) for s, part in enumerate(parts)]
    loss_fn = nn.CrossEntropyLoss()
    sched = getattr(tp, f"Schedule{schedule}")(pipeline_stages, n_microbatches=m, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, foreach=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        losses: list[torch.Tensor] = []
        sched.step(x, target=y, losses=losses)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(torch.stack(losses).detach().mean())

    return Config(f"torch/{schedule}", step)


def build(width: int, layers: int, stages: int, m: int, algorithms: list[str], with_torch: bool,
          only: set[str] | None = None, with_auto: bool = True) -> list[Config]:
    base = make_model(width, layers)
    configs = [Config("plain", sequential_trainer(copy.deepcopy(base), m))]
    configs.append(Config("hand", hand_written_trainer(copy.deepcopy(base), stages, m,
                                                       in_turn_order("1f1b", stages, m))))
    for name in algorithms:
        ways = [(False, False), (False, True), (True, False), (True, True)] + ([(None, False)] if with_auto else [])
        for threads, lean in ways:
            label = f"pipecore/{name}/{_WAYS[threads]}/{'lean' if lean else 'defaults'}"
            if only is None or label in only:
                configs.append(pipecore_config(name, copy.deepcopy(base), stages, m, threads, lean))
    if with_torch:
        for schedule in TORCH_SCHEDULES:
            configs.append(torch_config(schedule, copy.deepcopy(base), stages, m))
    if only is not None:
        configs = [c for c in configs if c.name in only]
    return configs


def data(batch: int, width: int, window: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    return [(torch.randn(batch, width, generator=gen), torch.randint(0, width, (batch,), generator=gen))
            for _ in range(window)]


def time_rounds(configs: list[Config], batches: list[tuple[torch.Tensor, torch.Tensor]], warmup: int,
                rounds: int) -> None:
    for c in configs:
        for i in range(warmup):
            c.step(*batches[i % len(batches)])
        c.settle()
    for r in range(rounds):
        for c in configs[r % len(configs):] + configs[:r % len(configs)]:
            switches = _context_switches()
            wall, cpu = time.perf_counter(), time.process_time()
            for x, y in batches:
                c.step(x, y)
            c.settle()
            c.cpu.append((time.process_time() - cpu) / len(batches))
            c.wall.append((time.perf_counter() - wall) / len(batches))
            c.switches.append((_context_switches() - switches) / len(batches))


def _context_switches() -> int:
    """The process's context switches so far, voluntary (a thread waits: a message, the GIL) and involuntary
    (the OS takes its core away)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def per_round(a: list[float], b: list[float]) -> dict[str, object]:
    return median_range([x / y for x, y in zip(a, b)])


def summarize(configs: list[Config], actions: int) -> dict[str, object]:
    by = {c.name: c for c in configs}
    out: dict[str, object] = {}
    for clock in ("cpu", "wall"):
        series = {c.name: getattr(c, clock) for c in configs}
        plain = statistics.median(series["plain"])
        rows = {}
        for name, s in series.items():
            row: dict[str, object] = {"ms_per_step": round(1e3 * statistics.median(s), 3),
                                      "context_switches_per_step": round(statistics.median(by[name].switches), 1),
                                      "us_per_action_over_plain": round(1e6 * (statistics.median(s) - plain)
                                                                        / actions, 1)}
            if name != "hand":
                row["over_hand"] = per_round(s, series["hand"])
            if "torch/LoopedBFS" in series and name != "torch/LoopedBFS":
                row["over_torch_LoopedBFS"] = per_round(s, series["torch/LoopedBFS"])
            if name.endswith("/defaults") and name[:-len("defaults")] + "lean" in by:
                row["defaults_over_lean"] = per_round(s, series[name[:-len("defaults")] + "lean"])
            if by[name].pipe is not None:
                row["execution"] = by[name].pipe.execution  # how its steps ran in the end (auto: the way kept)
            rows[name] = row
        out[clock] = rows
    return out


def print_width(width: int, summary: dict[str, object]) -> None:
    print(f"width {width} (process CPU time; ratios: medians of per-round ratios)")
    print(f"  {'configuration':<34} {'ms/step':>8} {'us/act>plain':>12} {'/hand':>7} {'/LoopedBFS':>10} "
          f"{'def/lean':>8} {'wall ms':>8} {'switches':>8}")
    for name, row in summary["cpu"].items():
        cell = lambda key: f"{row[key]['median']:.3f}" if key in row else "-"  # noqa: E731
        print(f"  {name:<34} {row['ms_per_step']:>8.2f} {row['us_per_action_over_plain']:>12.1f} "
              f"{cell('over_hand'):>7} {cell('over_torch_LoopedBFS'):>10} {cell('defaults_over_lean'):>8} "
              f"{summary['wall'][name]['ms_per_step']:>8.2f} {row['context_switches_per_step']:>8.0f}")


class CallCounter:
    """Counts function calls on every thread while enabled: ``python`` (``call`` events: Python functions)
    and ``c`` (``c_call`` events: builtins and torch's C functions called from Python), as cProfile counts."""

    def __init__(self) -> None:
        self.python = self.c = 0
        self.enabled = False

    def __call__(self, frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
        if self.enabled:
            if event == "call":
                self.python += 1
            elif event == "c_call":
                self.c += 1


class OpcodeCounter:
    """Counts the Python bytecode instructions executed on every thread while enabled (``opcode`` trace
    events: a tracer that asks each frame it sees for them)."""

    def __init__(self) -> None:
        self.count = 0
        self.enabled = False

    def __call__(self, frame, event, arg):  # noqa: ANN001 - sys.settrace's signature
        if not self.enabled:
            return None
        if event == "opcode":
            self.count += 1
        else:
            frame.f_trace_opcodes = True
        return self


def run_counted(config: Config, batches: list[tuple[torch.Tensor, torch.Tensor]],
                install: Callable[[object], None], counter: CallCounter | OpcodeCounter) -> None:
    """Train ``config`` on ``batches`` with ``counter`` enabled and installed on this thread by ``install``
    (``sys.setprofile`` or ``sys.settrace``; stage threads have it from ``threading``'s)."""
    counter.enabled = True
    install(counter)
    for x, y in batches:
        config.step(x, y)
    config.settle()
    install(None)
    counter.enabled = False


def profile(args: argparse.Namespace, algorithms: list[str]) -> int:
    counter = CallCounter()
    threading.setprofile(counter)  # stage threads start on first use, after this
    # Not the default's (auto) pipelines: which way their counted steps run depends on their timing.
    configs = build(args.width, args.layers, args.stages, args.microbatches, algorithms, not args.no_torch,
                    with_auto=False)
    batches = data(args.batch, args.width, args.steps)
    actions = args.stages * (2 * args.microbatches + 1)
    print(f"per action (width {args.width}, {args.steps} steps, {actions} actions per step): Python function "
          "calls, all calls (with builtins and torch's C functions, as cProfile counts), Python bytecode "
          "instructions")
    opcodes = OpcodeCounter()
    threading.settrace(opcodes)
    result = {}
    for c in configs:
        for x, y in batches[:2]:
            c.step(x, y)
        c.settle()
        counter.python = counter.c = opcodes.count = 0
        run_counted(c, batches, sys.setprofile, counter)
        run_counted(c, batches, sys.settrace, opcodes)
        n = actions * len(batches)
        result[c.name] = (counter.python / n, (counter.python + counter.c) / n, opcodes.count / n)
        print(f"  {c.name:<34} {result[c.name][0]:8.1f} {result[c.name][1]:8.1f} {result[c.name][2]:9.0f}")
    threading.setprofile(None)
    threading.settrace(None)
    if args.cprofile:
        config = next(c for c in configs if c.name == args.cprofile)
        profiler = cProfile.Profile()
        profiler.enable()
        for x, y in batches:
            config.step(x, y)
        config.settle()
        profiler.disable()
        stats = pstats.Stats(profiler)
        print(f"\ncProfile of {config.name}: {stats.total_calls / (actions * len(batches)):.1f} calls per action "
              "(this thread only)")
        stats.sort_stats("tottime").print_stats(40)
    for c in configs:
        if c.pipe is not None:
            c.pipe.close()
    return 0


def run_example(env_extra: dict[str, str], cwd: Path) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system, of the child) of one ``python examples/train_mlp.py``."""
    env = dict(os.environ, **env_extra)
    if not env_extra:
        env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "examples" / "train_mlp.py")], cwd=cwd, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def example(args: argparse.Namespace, argv: list[str]) -> int:
    import tempfile

    runs: dict[str, list[tuple[float, float]]] = {"default": [], "OMP_NUM_THREADS=1": []}
    with tempfile.TemporaryDirectory() as cwd:  # the example writes its checkpoint into the working folder
        for r in range(args.example_rounds):
            order = [("default", {}), ("OMP_NUM_THREADS=1", {"OMP_NUM_THREADS": "1"})]
            for name, extra in (order if r % 2 == 0 else order[::-1]):
                runs[name].append(run_example(extra, Path(cwd)))
                print(f"round {r}: {name}: {runs[name][-1][0]:.2f} s wall, {runs[name][-1][1]:.2f} s CPU", flush=True)
    ratio = {clock: median_range([d[i] / o[i] for d, o in zip(runs["default"], runs["OMP_NUM_THREADS=1"])])
             for i, clock in enumerate(("wall", "cpu"))}
    summary = {name: {"wall_s": round(statistics.median(w for w, _ in r), 2),
                      "cpu_s": round(statistics.median(c for _, c in r), 2)} for name, r in runs.items()}
    print(f"median: {summary}; default / OMP_NUM_THREADS=1: wall {ratio['wall']['median']}, cpu {ratio['cpu']['median']}")
    report = {"benchmark": "overhead-example", "command": "python bench/overhead.py " + " ".join(argv),
              "machine": machine(), "device": "cpu", "program": "python examples/train_mlp.py (300 steps)",
              "statistic": "per run: wall seconds and the child's CPU seconds (user + system); medians over rounds; "
                           "default_over_omp1: median and range of per-round ratios",
              "results": summary, "default_over_omp1": ratio,
              "runs": {name: [[round(w, 3), round(c, 3)] for w, c in r] for name, r in runs.items()}}
    print(f"wrote {write_report(report, args.out)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default="16,256")
    parser.add_argument("--width", type=int, default=16, help="--profile: the width profiled")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--algorithms", default="1f1b,2bw,pipedream")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--window", type=int, default=10, help="steps per timed window")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--no-torch", action="store_true", help="leave out torch.distributed.pipelining")
    parser.add_argument("--profile", action="store_true", help="print Python calls per action and exit")
    parser.add_argument("--steps", type=int, default=5, help="--profile: steps counted")
    parser.add_argument("--cprofile", default=None, help="--profile: also a cProfile listing of this configuration")
    parser.add_argument("--example", action="store_true",
                        help="time python examples/train_mlp.py against OMP_NUM_THREADS=1 and exit")
    parser.add_argument("--example-rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help=f"{OUT_HELP}; the default file is overhead-cpu.json "
                        "(--example: overhead-example-cpu.json)")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = default_out("overhead-example-cpu.json" if args.example else "overhead-cpu.json")
    if args.example:
        return example(args, sys.argv[1:] if argv is None else argv)
    algorithms = [a for a in args.algorithms.split(",") if a]
    torch.set_num_threads(1)
    if args.profile:
        return profile(args, algorithms)
    actions = args.stages * (2 * args.microbatches + 1)
    results = []
    for width in map(int, args.widths.split(",")):
        configs = build(width, args.layers, args.stages, args.microbatches, algorithms, not args.no_torch)
        time_rounds(configs, data(args.batch, width, args.window), args.warmup, args.rounds)
        summary = summarize(configs, actions)
        print_width(width, summary)
        results.append({"width": width, **summary})
        for c in configs:
            if c.pipe is not None:
                c.pipe.close()
    report = {
        "benchmark": "overhead",
        "command": "python bench/overhead.py" + ("" if (argv if argv is not None else sys.argv[1:]) == []
                                                 else " " + " ".join(argv if argv is not None else sys.argv[1:])),
        "machine": machine(), "device": "cpu", "dtype": "float32",
        "model": f"{args.layers} x (Linear(w, w) + ReLU), cross-entropy over w classes, {args.stages} stages",
        "sizes": {"batch": args.batch, "microbatches": args.microbatches, "stages": args.stages,
                  "actions_per_step": actions, "widths": args.widths},
        "timing": {"warmup_steps": args.warmup, "window_steps": args.window, "rounds": args.rounds,
                   "threads": "torch.set_num_threads(1) on the calling thread; pipecore's stage threads take "
                              "threads_per_stage (default max(1, cores // stages))"},
        "statistic": "ms_per_step: median over rounds of a window's time per step; over_* and defaults_over_lean: "
                     "median and range of per-round ratios of step times; us_per_action_over_plain: (median step "
                     "- plain's median step) / actions_per_step; context_switches_per_step: median over rounds of "
                     "the process's voluntary and involuntary context switches (getrusage) per step",
        "env": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
        "results": results,
    }
    print(f"wrote {write_report(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
