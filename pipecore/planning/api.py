"""``pipecore.plan``: profile a model, then cut it into stages for time and memory (see docs/planning.md)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from torch import nn

from ..algorithms import Algorithm, get_algorithm
from .byte_units import parse_bytes
from .cuts import module_units
from .planner import Plan, plan_costs
from .profiler import profile

_CUTS = ("modules", "nodes")


def plan(
    model: nn.Module,
    example_input: Any,
    num_stages: int | None = None,
    algorithm: str | Algorithm = "pipedream",
    batch_size: int | None = None,
    n_microbatches: int = 4,
    memory_limit: int | str | None = None,
    objective: str = "memory",
    *,
    optimizer: Any = None,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    example_target: Any = None,
    leaf_modules: Sequence[type | str] = (),
    cuts: str = "modules",
    progress: bool = False,
    threads_per_stage: int | None = None,
    world_size: int | None = None,
    allreduce_gbps: float | None = None,
    recover: bool = True,
    **algorithm_options: Any,
) -> Plan:
    """Where to cut ``model`` into ``num_stages`` stages for ``algorithm``, from measured per-node costs.

    Profiles every node of the captured graph on ``example_input`` (:func:`pipecore.profile`, on the device
    the model is on), scales the activation figures to micro-batches of ``batch_size // n_microbatches``
    samples (default ``batch_size``: the example's samples times ``n_microbatches``), and partitions:

    * ``objective="memory"`` (DawnPiper): the fastest partition whose devices each fit ``memory_limit``
      bytes (an int, or a string such as ``"2GiB"``), recomputing or offloading to host memory the
      segments with the most bytes freed per second of added time where a stage would not fit (offload
      only where the costs measured a host bandwidth, ``GraphCosts.host_bytes_per_s``: on CUDA);
    * ``"time"`` (PipeDream's planner): the slowest stage as fast as possible, no recomputation or offload;
    * ``"parameters"``: balanced parameter bytes (the pipeline's default).

    ``cuts="modules"`` (default) cuts only where a module starts, as the pipeline's default partition does
    (a module's internal values, shape arithmetic included, stay in one stage); ``"nodes"`` anywhere.
    ``optimizer`` is the pipeline's (its state counts: SGD with momentum one weight-sized buffer, AdamW two).
    ``loss_fn`` and ``example_target`` (the pipeline's loss and ``example_input``'s targets) let the last
    stage's prediction include the loss's time and what it saves. ``recover`` is the pipeline's
    (``Pipeline(recover=...)``, default True): the copies that undo a failed step count in each stage's
    predicted peak unless it is False.

    ``algorithm_options`` configure the algorithm, e.g. ``stages_per_rank=2`` (interleaved-1f1b, looped-bfs,
    zb-h1; zb-v and dualpipe-v always run two stages per rank): ``num_stages`` stages then run on
    ``num_stages // stages_per_rank`` ranks, placed as the algorithm's schedule places them
    (``Plan.placement``), and ``memory_limit`` is per device, a bound on the sum of each rank's stages'
    peaks (see docs/planning.md). The algorithm and its options are checked before the model is profiled.

    The nodes are timed with the intra-op threads a stage thread of the pipeline will use:
    ``threads_per_stage``, as ``Pipeline`` takes it (default: the process's share, ``cores // ranks``, at
    least 1, at most the caller's ``torch.get_num_threads()``; a rank's stages share its thread).

    Returns a :class:`~pipecore.planning.Plan`: ``starts`` (pass the plan as ``Pipeline(...,
    partition=plan)``), ``recomputed``, ``offloaded``, ``stage_time``, ``stage_memory`` (predicted peak bytes per
    stage), ``max_batch_size()``, ``table()`` and ``plot(path)``. A limit no partition meets raises
    :class:`~pipecore.planning.InfeasibleMemoryLimit`, which names the smallest limit that works.

    **Data x pipeline parallelism** (PipeDream-2BW's planner): with ``world_size=N`` instead of ``num_stages``,
    the planner tries every ``N = W x P``: ``W`` replicas, each a pipeline of ``P`` ranks (``P x
    stages_per_rank`` stages) trained on ``batch_size / W`` samples of every mini-batch (``batch_size`` is then
    the global mini-batch, default the example's samples x ``n_microbatches`` x ``N``). It plans each pipeline as
    above, predicts its step time by simulating the schedule with the stages' predicted times and each update
    paying the ring all-reduce of the stage's gradients over ``W`` replicas (``2 (W-1)/W x bytes /
    bandwidth``), and returns the plan of the fastest ``(W, P)`` whose every rank fits ``memory_limit``, with
    ``Plan.data_parallel`` (``W``), ``Plan.step_time`` and ``Plan.world`` (every configuration, the reason
    each other one was rejected, the bandwidth; ``Plan.world.table()``). The bandwidth is ``allreduce_gbps``
    GB/s (10^9 bytes per second, bus bandwidth) when given, else measured: an all-reduce of 4 MiB between
    two local gloo processes (:func:`pipecore.planning.bandwidth.measure_allreduce`). The nodes are then
    timed with ``cores // N`` threads unless ``threads_per_stage`` says otherwise. See docs/planning.md.
    """
    from ..engine.graph import CapturedModel
    from ..engine.threads import default_threads_per_stage

    from .bandwidth import check_gbps
    from .world import check_world_size, configure, plan_world

    if cuts not in _CUTS:
        raise ValueError(f"cuts must be one of {_CUTS}, got {cuts!r}")
    limit = None if memory_limit is None else parse_bytes(memory_limit)
    if world_size is not None:
        world_size = check_world_size(world_size)
        if num_stages is not None:
            raise ValueError("give num_stages or world_size, not both: with world_size the planner chooses the "
                             "pipeline's size (P ranks x stages_per_rank stages) for each W x P = world_size")
        if allreduce_gbps is not None:
            check_gbps(allreduce_gbps)
        # The algorithm and its options first, for every pipeline size, before the model is profiled.
        configure(algorithm, world_size, n_microbatches, dict(algorithm_options))
        costs = profile(model, example_input, leaf_modules=leaf_modules, optimizer=optimizer, loss_fn=loss_fn,
                        example_target=example_target, progress=progress,
                        threads=(default_threads_per_stage(world_size) if threads_per_stage is None
                                 else threads_per_stage))
        if batch_size is None:
            batch_size = costs.microbatch_size * n_microbatches * world_size
        allowed = None
        if cuts == "modules":
            allowed = [a for a, _ in module_units(CapturedModel(model, leaf_modules, example_input))][1:]
        return plan_world(costs, world_size, algorithm, batch_size, n_microbatches, memory_limit=limit,
                          objective=objective, allowed_cuts=allowed, allreduce_gbps=allreduce_gbps,
                          recover=recover, **algorithm_options)
    if allreduce_gbps is not None:
        raise ValueError("allreduce_gbps is for world_size (data x pipeline planning)")
    if num_stages is None:
        raise ValueError("plan needs num_stages (or world_size, to choose data x pipeline parallelism)")
    # Configured first: a bad algorithm, option or shape (e.g. stages_per_rank=2 for an algorithm that runs one
    # stage per rank) fails here, before the model is profiled.
    if isinstance(algorithm, str):
        algorithm = get_algorithm(algorithm, num_stages, n_microbatches, **algorithm_options)
        algorithm_options = {}
    num_ranks = algorithm.schedule(1).num_ranks if isinstance(algorithm, Algorithm) else num_stages
    costs = profile(model, example_input, leaf_modules=leaf_modules, optimizer=optimizer, loss_fn=loss_fn,
                    example_target=example_target, progress=progress,
                    threads=(default_threads_per_stage(num_ranks) if threads_per_stage is None
                             else threads_per_stage))
    if batch_size is None:
        batch_size = costs.microbatch_size * n_microbatches
    allowed = None
    if cuts == "modules":
        allowed = [a for a, _ in module_units(CapturedModel(model, leaf_modules, example_input))][1:]
    return plan_costs(costs, num_stages, algorithm, batch_size, n_microbatches, memory_limit=limit,
                      objective=objective, allowed_cuts=allowed, recover=recover, **algorithm_options)
