"""Data x pipeline parallelism in the planner: choose ``(W, P)`` for ``N = W x P`` devices (PipeDream-2BW's
planner), see docs/planning.md "Data x pipeline parallelism".

For every factorisation ``N = W x P`` (``W`` replicas of a pipeline of ``P`` ranks, ``P x stages_per_rank``
stages), the ``P``-rank pipeline is planned as :func:`~pipecore.planning.plan_costs` plans it, for the mini-batch
of one replica (the global batch divided by ``W``). Its step time is then simulated (the algorithm's schedule
with each stage's predicted forward and backward, bubbles included), with every update of a stage costing the
ring all-reduce of its gradients over the ``W`` replicas (``2 (W-1)/W x gradient bytes / bandwidth``) on its
rank. The fastest configuration whose every rank fits the memory limit is chosen; the others are kept with the
reason each was rejected.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

from ..algorithms import Algorithm, get_algorithm, get_spec
from .bandwidth import Bandwidth, given, measure_allreduce, ring_allreduce_seconds
from .costs import GraphCosts
from .memory import StageModel
from .byte_units import format_bytes
from .partitioners import InfeasibleMemoryLimit, cut_positions

# Why a configuration was not chosen (Configuration.status).
CHOSEN, SLOWER, NO_FIT, BATCH, CUTS, ALGORITHM = "chosen", "slower", "does not fit", "batch", "cut points", "algorithm"


@dataclass(frozen=True)
class Configuration:
    """One factorisation ``N = W x P`` the planner considered, with its predictions and verdict.

    Attributes:
        data_parallel: ``W``, the replicas.
        pipeline_ranks: ``P``, the ranks of each replica's pipeline.
        num_stages: ``P x stages_per_rank``.
        batch_size: the global mini-batch (samples).
        replica_batch: samples per replica per mini-batch (``batch_size / W``), None if it does not divide.
        pipeline_time: predicted seconds per mini-batch of one replica without the all-reduce (steady state of
            the simulated schedule), or None where not planned.
        step_time: the same with every update paying its all-reduce: the seconds per global mini-batch.
        allreduce_time: seconds per mini-batch the busiest rank spends all-reducing (the sums of all its
            updates, before overlap); 0 with one replica.
        gradient_bytes: the largest rank's gradient bytes (its stages' summed).
        memory: the largest rank's predicted peak bytes; for a configuration that does not fit, the smallest
            per-device limit the planner meets for it.
        status: ``"chosen"``, ``"slower"``, ``"does not fit"``, ``"batch"``, ``"cut points"`` or ``"algorithm"``.
        reason: why it was rejected, in words (empty for the chosen one).
        plan: the replica's plan (None where none was made).
    """

    data_parallel: int
    pipeline_ranks: int
    num_stages: int
    batch_size: int
    replica_batch: int | None
    pipeline_time: float | None = None
    step_time: float | None = None
    allreduce_time: float | None = None
    gradient_bytes: int | None = None
    memory: int | None = None
    status: str = ""
    reason: str = ""
    plan: Any = None

    @property
    def samples_per_s(self) -> float | None:
        """Predicted global samples per second: the global mini-batch over the step time."""
        if self.step_time is None:
            return None
        return float("inf") if self.step_time <= 0 else self.batch_size / self.step_time

    @property
    def fits(self) -> bool:
        return self.status in (CHOSEN, SLOWER)


@dataclass(frozen=True)
class World:
    """What ``plan(..., world_size=N)`` considered: every factorisation, the one chosen, the bandwidth.

    Attributes:
        world_size: ``N``, the devices.
        batch_size: the global mini-batch.
        memory_limit: bytes per device, or None.
        bandwidth: the all-reduce bandwidth used (None when no configuration with ``W > 1`` was timed).
        configurations: one per factorisation, by increasing ``W``.
    """

    world_size: int
    batch_size: int
    memory_limit: float | None
    bandwidth: Bandwidth | None
    configurations: tuple[Configuration, ...]

    @property
    def chosen(self) -> Configuration:
        return next(c for c in self.configurations if c.status == CHOSEN)

    @property
    def alternatives(self) -> tuple[Configuration, ...]:
        """The configurations not chosen, each with its reason."""
        return tuple(c for c in self.configurations if c.status != CHOSEN)

    def summary(self) -> str:
        c = self.chosen
        return (f"chosen: W={c.data_parallel} replica{'s' if c.data_parallel != 1 else ''} x P={c.pipeline_ranks} "
                f"pipeline rank{'s' if c.pipeline_ranks != 1 else ''} ({c.num_stages} stage"
                f"{'s' if c.num_stages != 1 else ''}) on {self.world_size} device{'s' if self.world_size != 1 else ''}"
                f", global batch {self.batch_size} = {c.data_parallel} x {c.replica_batch}; predicted step "
                f"{_ms(c.step_time)} ms (pipeline {_ms(c.pipeline_time)} ms), {_rate(c.samples_per_s)} samples/s")

    def table(self) -> str:
        """Every configuration: W, P, stages, samples per replica, step time, what the all-reduce adds, global
        samples per second, the fullest rank's memory, and the verdict."""
        from .planner import aligned_columns

        rows = [("W", "P", "stages", "batch/replica", "step (ms)", "all-reduce (ms)", "samples/s", "memory",
                 "verdict")]
        for c in self.configurations:
            exposed = None if c.step_time is None or c.pipeline_time is None else c.step_time - c.pipeline_time
            memory = "-" if c.memory is None else (("needs " if c.status == NO_FIT else "") + format_bytes(c.memory))
            ar = "-" if c.allreduce_time is None else f"{_ms(c.allreduce_time)} ({_ms(exposed)} exposed)"
            rows.append((str(c.data_parallel), str(c.pipeline_ranks), str(c.num_stages),
                         "-" if c.replica_batch is None else str(c.replica_batch), _ms(c.step_time), ar,
                         _rate(c.samples_per_s), memory, "chosen" if c.status == CHOSEN else c.reason))
        return "\n".join(aligned_columns(rows))


def factorisations(world_size: int) -> list[tuple[int, int]]:
    """Every ``(W, P)`` with ``W x P = world_size``, by increasing ``W``."""
    world_size = check_world_size(world_size)
    return [(w, world_size // w) for w in range(1, world_size + 1) if world_size % w == 0]


def check_world_size(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"world_size must be a positive int (the devices: data-parallel replicas x pipeline ranks), "
                         f"got {value!r}")
    if value < 1:
        raise ValueError(f"world_size must be at least 1, got {value}")
    return value


def stages_per_rank(algorithm: str, options: dict) -> int:
    """How many stages the algorithm places on each rank with ``options`` (its default otherwise)."""
    value = options.get("stages_per_rank")
    if value is None:
        value = get_spec(algorithm).defaults.get("stages_per_rank", 1)
    return 1 if value is None else int(value)


def configure(algorithm: str | Algorithm, world_size: int, n_microbatches: int,
              options: dict) -> dict[int, Algorithm | str]:
    """Per pipeline size ``P`` of ``world_size``'s factorisations, the algorithm configured for ``P`` ranks, or the
    algorithm's error. Raises the error at once if no ``P`` can be configured (a bad name or option), so that it
    fails before the model is profiled."""
    if isinstance(algorithm, Algorithm):
        raise ValueError("with world_size, name the algorithm (a string) and pass its options: the planner "
                         "configures it for every pipeline size P")
    per_rank = stages_per_rank(algorithm, options)
    out: dict[int, Algorithm | str] = {}
    first: Exception | None = None
    for _, p in factorisations(world_size):
        try:
            out[p] = get_algorithm(algorithm, p * per_rank, n_microbatches, **options)
        except ValueError as exc:
            first = first or exc
            out[p] = str(exc)
    if first is not None and not any(isinstance(a, Algorithm) for a in out.values()):
        raise first
    return out


def plan_world(
    costs: GraphCosts,
    world_size: int,
    algorithm: str,
    batch_size: int,
    n_microbatches: int,
    memory_limit: float | None = None,
    objective: str = "memory",
    allowed_cuts: Iterable[int] | None = None,
    allreduce_gbps: float | None = None,
    bandwidth: Bandwidth | None = None,
    recover: bool = True,
    **algorithm_options: Any,
):
    """Choose ``(W, P)`` with ``W x P = world_size`` and plan it: the fastest configuration whose every rank fits
    ``memory_limit``, returned as the replica's :class:`~pipecore.planning.Plan` with ``world`` (every
    configuration, why each other one was rejected, the bandwidth) and ``data_parallel = W``.

    ``batch_size`` is the global mini-batch: each of the ``W`` replicas plans and trains on ``batch_size / W``
    samples in ``n_microbatches`` micro-batches. The all-reduce bandwidth is ``allreduce_gbps`` GB/s (10^9 bytes
    per second of bus bandwidth) when given, else ``bandwidth``, else measured (:func:`measure_allreduce`) the
    first time a configuration with ``W > 1`` is timed. ``recover`` is the pipeline's (see :func:`plan_costs`).
    Raises :class:`InfeasibleMemoryLimit` when no configuration fits the limit (naming the smallest limit one
    meets), ``ValueError`` when none can be planned.
    """
    from .planner import check_batch, plan_costs

    world_size = check_world_size(world_size)
    if not isinstance(n_microbatches, int) or isinstance(n_microbatches, bool) or n_microbatches < 1:
        raise ValueError(f"n_microbatches must be a positive int, got {n_microbatches!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if allreduce_gbps is not None:
        bandwidth = given(allreduce_gbps)
    configured = configure(algorithm, world_size, n_microbatches, dict(algorithm_options))
    positions = cut_positions(len(costs), allowed_cuts)
    cuttable = len([c for c in positions if c not in set(costs.uncuttable)]) - 2  # cut positions inside the graph

    found: list[Configuration] = []
    for w, p in factorisations(world_size):
        alg = configured[p]
        stages = alg.num_stages if isinstance(alg, Algorithm) else p * stages_per_rank(algorithm, algorithm_options)
        base = Configuration(w, p, stages, batch_size, batch_size // w if batch_size % w == 0 else None)
        if batch_size % (w * n_microbatches):
            found.append(dataclasses.replace(
                base, status=BATCH, reason=f"batch {batch_size} is not divisible into W x micro-batches = {w} x "
                                           f"{n_microbatches} = {w * n_microbatches}"))
            continue
        if stages - 1 > cuttable:
            found.append(dataclasses.replace(
                base, status=CUTS, reason=f"{stages} stages need {stages - 1} cuts; the model's cut points allow "
                                          f"{max(cuttable, 0)}"))
            continue
        if not isinstance(alg, Algorithm):
            found.append(dataclasses.replace(base, status=ALGORITHM, reason=f"{algorithm}: {alg}"))
            continue
        replica_batch = check_batch(batch_size // w, n_microbatches)
        try:
            plan = plan_costs(costs, stages, alg, replica_batch, n_microbatches, memory_limit=memory_limit,
                              objective=objective, allowed_cuts=allowed_cuts, recover=recover)
        except InfeasibleMemoryLimit as exc:
            found.append(dataclasses.replace(
                base, memory=exc.smallest_limit, status=NO_FIT,
                reason=f"does not fit: needs at least {format_bytes(exc.smallest_limit)} per device"))
            continue
        if w > 1 and bandwidth is None:
            bandwidth = measure_allreduce()
        timing = step_times(plan, alg, w, None if bandwidth is None else bandwidth.bytes_per_s)
        found.append(dataclasses.replace(base, plan=plan, memory=max(plan.rank_memory), **timing))

    fitting = [c for c in found if c.plan is not None]
    if not fitting:
        no_fit = [c for c in found if c.status == NO_FIT]
        listing = "; ".join(f"W={c.data_parallel} x P={c.pipeline_ranks}: {c.reason}" for c in found)
        if no_fit:
            least = min(c.memory for c in no_fit)
            raise InfeasibleMemoryLimit(
                f"no (W, P) with W x P = {world_size} fits memory_limit={memory_limit:.0f} bytes "
                f"({format_bytes(memory_limit)}) per device; the smallest limit one meets is {least} bytes "
                f"({format_bytes(least)}) ({listing})", least)
        raise ValueError(f"no (W, P) with W x P = {world_size} can be planned: {listing}")
    # The fastest; among equals the least memory, then the most replicas (fewer pipeline stages to tune).
    best = min(fitting, key=lambda c: (round(c.step_time, 12), c.memory, -c.data_parallel))
    configurations = []
    for c in found:
        if c is best:
            c = dataclasses.replace(c, status=CHOSEN)
        elif c.plan is not None:
            ratio = c.step_time / best.step_time if best.step_time > 0 else float("inf")
            c = dataclasses.replace(c, status=SLOWER, reason=f"slower: {_ms(c.step_time)} ms per step, {ratio:.2f}x "
                                                             "the chosen's")
        configurations.append(c)
    world = World(world_size, batch_size, memory_limit, bandwidth, tuple(configurations))
    return dataclasses.replace(best.plan, world=world)


def step_times(plan, algorithm: Algorithm, replicas: int, bytes_per_s: float | None) -> dict:
    """Predicted seconds per mini-batch of one replica under ``plan``, without and with the all-reduce over
    ``replicas``: the steady state of the algorithm's schedule simulated with each stage's forward and backward
    (its forward time, and the rest of its predicted time: backward, recomputation, loss, offload link) and
    each update costing the ring all-reduce of the stage's gradient buffer on its rank (the rank waits for it,
    *inferred*: overlap with the rank's other actions is not credited). A split backward (zero bubble) is taken
    as half input gradient (B), half weight gradient (W) (*inferred*)."""
    from ..runtime.executor import Costs

    scaled = plan.costs.at_microbatch_size(plan.microbatch_size)
    model = StageModel(scaled, plan.sizing)
    forward = tuple(model.forward(a, b) for a, b in plan.bounds())
    backward = tuple(max(0.0, t - f) for t, f in zip(plan.stage_time, forward))
    gradients = tuple(m.gradients for m in plan.memory_breakdown())
    if replicas > 1 and bytes_per_s is None:
        raise ValueError("timing W > 1 replicas needs the all-reduce bandwidth")
    allreduce = tuple(0.0 if replicas == 1 else ring_allreduce_seconds(g, replicas, bytes_per_s) for g in gradients)
    half = tuple(b / 2 for b in backward)
    without = _steady_state(algorithm, Costs(forward, half, (0.0,) * len(forward), 0.0, half))
    with_sum = without if not any(allreduce) else _steady_state(algorithm, Costs(forward, half, allreduce, 0.0, half))
    updates = plan.n_microbatches / algorithm.update_every  # updates per mini-batch
    per_rank = [0.0] * plan.num_ranks
    grad_rank = [0] * plan.num_ranks
    for s, r in enumerate(plan.placement):
        per_rank[r] += allreduce[s] * updates
        grad_rank[r] += gradients[s]
    return {"pipeline_time": without, "step_time": with_sum, "allreduce_time": max(per_rank),
            "gradient_bytes": max(grad_rank)}


def _steady_state(algorithm: Algorithm, costs: Any) -> float:
    """Seconds per mini-batch once the schedule is in its steady state: the makespan's growth per mini-batch
    between two runs past the algorithm's warm-up."""
    from ..simulate import simulate

    first = algorithm.warmup_minibatches + 1
    times = [simulate(algorithm, algorithm.num_stages, algorithm.n_microbatches, n_minibatches=k, costs=costs).makespan
             for k in (first, first + 2)]
    return (times[1] - times[0]) / 2


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else ("inf" if value == float("inf") else f"{value:.1f}")
