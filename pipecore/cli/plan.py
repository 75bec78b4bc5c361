"""``pipecore plan``: profile one of the built-in models and cut it into stages for time and memory.

Profiles the model of ``pipecore train --model ...`` (same flags, same defaults) on one micro-batch of its
data, then plans ``--stages`` stages for ``--algorithm`` with :func:`pipecore.plan` and prints the table
(stage, nodes, predicted time, predicted memory of the limit, recomputed and offloaded segments); ``--png``
draws it. ``--device cuda`` profiles on the GPU, which also measures the link to pinned host memory: the plan
may then offload activations. ``--stages-per-rank V`` places ``V`` stages on each rank for the algorithms that
take several (interleaved-1f1b, looped-bfs, zb-h1; zb-v and dualpipe-v always take 2): ``--memory-limit`` is
then per device, and the table adds each rank's stages and summed peak. ``--world-size N`` (instead of
``--stages``) chooses data x pipeline parallelism: ``W`` replicas of a ``P``-rank pipeline for every ``W x P = N``,
the fastest that fits (all-reduce bandwidth measured between two local gloo processes, or ``--allreduce-gbps``),
and prints the alternatives with the reason each was rejected.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ._args import algorithm_option, positive_int
from .tasks import MODELS, add_model_arguments, resolve_defaults, task_for

if TYPE_CHECKING:
    import torch

HELP = "profile a built-in model and plan its stages for time and memory (DawnPiper)"
DESCRIPTION = """\
Profile a built-in model (the one `pipecore train --model ...` trains, with the same size flags) and plan
its stages: where to cut, what to recompute, and each stage's predicted time and peak memory.

objectives:
  memory      DawnPiper's binary partitioning: the fastest cut whose stages each fit --memory-limit,
              recomputing (or, profiled on CUDA, offloading to pinned host memory) the segments that free
              the most bytes per second of added time (default)
  time        PipeDream's planner: the slowest stage as fast as possible (no recomputation)
  parameters  balanced parameter bytes (the pipeline's default partition)

--world-size N chooses data x pipeline parallelism (PipeDream-2BW's planner): for every N = W x P, W replicas
of a P-rank pipeline (P x stages-per-rank stages), each on 1/W of every mini-batch (--batch-size is the global
one), their gradients summed by ring all-reduces (2 (W-1)/W x bytes / bandwidth per update); it prints the
fastest (W, P) that fits --memory-limit, its plan, and the alternatives with why each was rejected. The
bandwidth is measured (an all-reduce of 4 MiB between two local gloo processes: this host's loopback) unless
--allreduce-gbps gives it.

--memory-limit is per device (rank). With several stages per rank (--stages-per-rank V for interleaved-1f1b,
looped-bfs and zb-h1; zb-v and dualpipe-v always place 2), a rank holds the sum of its stages' peaks.

examples:
  pipecore plan --model gpt --stages 4 --algorithm pipedream --memory-limit 2GiB
  pipecore plan --model gpt --layers 8 --stages 4 -a 2bw --memory-limit 40MiB --objective time
  pipecore plan --model resnet --stages 2 --memory-limit 4MiB --png plan.png
  pipecore plan --model gpt --stages 4 --memory-limit 2GiB --device cuda
  pipecore plan --model gpt --layers 8 --stages 8 -a interleaved-1f1b --stages-per-rank 2 --memory-limit 2GiB
  pipecore plan --model gpt --stages 4 -a zb-v --memory-limit 2GiB
  pipecore plan --model gpt --world-size 8 -a 1f1b --memory-limit 2GiB
  pipecore plan --model gpt --world-size 8 -a 2bw --memory-limit 2GiB --allreduce-gbps 25
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=MODELS, default="mlp", help="the model to plan (default mlp)")
    parser.add_argument("-a", "--algorithm", default="pipedream", metavar="NAME",
                        help="algorithm name or alias (default pipedream)")
    parser.add_argument("-p", "--stages", type=positive_int, metavar="P",
                        help="pipeline stages, i.e. model chunks (default 4; not with --world-size)")
    parser.add_argument("--world-size", type=positive_int, metavar="N",
                        help="devices: choose W replicas x P pipeline ranks with W x P = N, the fastest that fits "
                             "(instead of --stages)")
    parser.add_argument("--allreduce-gbps", type=float, metavar="G",
                        help="with --world-size: all-reduce bus bandwidth in GB/s (10^9 bytes per second, not "
                             "gigabits); default: measured between two local gloo processes")
    parser.add_argument("--stages-per-rank", type=positive_int, metavar="V",
                        help="stages (model chunks) per rank for the algorithms that take several: interleaved-1f1b, "
                             "looped-bfs, zb-h1 (default 1); zb-v and dualpipe-v always take 2. The stages run on "
                             "P / V ranks and --memory-limit is per rank")
    parser.add_argument("-m", "--microbatches", type=positive_int, default=4, metavar="M",
                        help="micro-batches per mini-batch (default 4)")
    parser.add_argument("-b", "--batch-size", type=positive_int, metavar="N",
                        help="mini-batch size, divisible by --microbatches (default: pipecore train's for the model)")
    parser.add_argument("--memory-limit", metavar="BYTES",
                        help="memory per device (rank; per stage with one stage per rank): bytes or a size with a "
                             "unit, e.g. 2GiB, 512MiB, 1.5GB (needed by --objective memory)")
    parser.add_argument("--objective", choices=("memory", "time", "parameters"), default="memory",
                        help="what the partition optimises (default memory)")
    parser.add_argument("--cuts", choices=("modules", "nodes"), default="modules",
                        help="cut only where a module starts (default, as the pipeline's own partition) or anywhere")
    parser.add_argument("--optimizer", choices=("sgd", "adamw", "nadam"),
                        help="its state counts in the memory (default: pipecore train's for the model)")
    add_model_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    parser.add_argument("-o", "--option", type=algorithm_option, action="append", default=[], metavar="KEY=VALUE",
                        help="algorithm option, repeatable (e.g. slack=1)")
    parser.add_argument("--device", default="cpu",
                        help="where to profile: cpu (default) or cuda, cuda:N (also measures the link to pinned "
                             "host memory, so that the plan may offload activations)")
    parser.add_argument("--png", metavar="PATH", help="draw the plan (memory terms per stage, time) to a PNG file")
    parser.add_argument("--progress", action="store_true", help="show a progress bar while profiling")
    parser.add_argument("--threads", type=positive_int, metavar="N",
                        help="torch intra-op threads per stage, as Pipeline(threads_per_stage=N) trains with "
                             "(default: cores // ranks, at least 1)")


def run(args: argparse.Namespace) -> int:
    import torch

    from ..algorithms import get_algorithm
    from ..engine import SGD, AdamW, NAdam
    from ..planning import parse_bytes, plan

    from ..planning.bandwidth import check_gbps
    from ..planning.world import configure

    world = args.world_size
    if world is not None and args.stages is not None:
        raise ValueError("give --stages or --world-size, not both: with --world-size the planner chooses the stages")
    if args.allreduce_gbps is not None:
        if world is None:
            raise ValueError("--allreduce-gbps is for --world-size")
        check_gbps(args.allreduce_gbps)
    if world is None and args.stages is None:
        args.stages = 4
    if args.objective == "memory" and args.memory_limit is None:
        raise ValueError("--objective memory needs --memory-limit (e.g. --memory-limit 2GiB)")
    limit = None if args.memory_limit is None else parse_bytes(args.memory_limit)
    options = dict(args.option)
    if args.stages_per_rank is not None:
        if "stages_per_rank" in options and options["stages_per_rank"] != args.stages_per_rank:
            raise ValueError(f"--stages-per-rank {args.stages_per_rank} and --option stages_per_rank="
                             f"{options['stages_per_rank']} disagree; give one")
        options["stages_per_rank"] = args.stages_per_rank
    # The algorithm and its options first (e.g. --stages-per-rank 2 for an algorithm that runs one stage per
    # rank), before the model is built and profiled.
    if world is None:
        get_algorithm(args.algorithm, args.stages, args.microbatches, **options)
    else:
        configure(args.algorithm, world, args.microbatches, options)
    device = _device(args.device)
    for name, value in (("epochs", None), ("steps_per_epoch", None), ("eval_windows", None)):
        setattr(args, name, getattr(args, name, value))
    if world is not None:
        args.stages = world  # not used: only so that resolve_defaults leaves the stages alone
    resolve_defaults(args)
    if world is not None:
        args.stages = None
    if args.batch_size % args.microbatches:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by --microbatches {args.microbatches}")
    torch.manual_seed(args.seed)
    task = task_for(args)
    model = task.build().to(device)
    x, y = next(iter(task.batches(0)))
    example, target = x[: args.batch_size // args.microbatches], y[: args.batch_size // args.microbatches]
    example, target = example.to(device), target.to(device)
    optimizer = {"adamw": AdamW(lr=1e-3), "nadam": NAdam(lr=1e-3)}.get(args.optimizer, SGD(lr=0.05, momentum=0.9))
    print(f"{task.name(model)}; profiling {len(example)} samples per micro-batch")
    if world is not None:
        options.update(world_size=world, allreduce_gbps=args.allreduce_gbps)
    result = plan(model, example, args.stages, args.algorithm, args.batch_size, args.microbatches, limit,
                  args.objective, optimizer=optimizer, loss_fn=task.loss_fn, example_target=target, cuts=args.cuts,
                  progress=args.progress, threads_per_stage=args.threads, **options)
    if result.world is not None:
        bandwidth = result.world.bandwidth
        print(bandwidth.describe() if bandwidth is not None else "all-reduce bandwidth: not needed (no W > 1 planned)")
        print(result.world.summary())
    print(result.table())
    if limit is not None:
        print(f"largest mini-batch within the limit with these cuts: {result.max_batch_size()}"
              + (" per replica" if result.world is not None else ""))
    if result.world is not None:
        print(f"configurations of {world} devices (W replicas x P pipeline ranks):")
        print(result.world.table())
    if args.png:
        result.plot(args.png)
        print(f"plan drawn to {args.png}")
    return 0


def _device(spec: str) -> "torch.device":
    import torch

    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {spec!r} is not a device: give cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {spec!r}: plans are profiled on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {spec!r}, but CUDA is not available on this machine")
    return device
