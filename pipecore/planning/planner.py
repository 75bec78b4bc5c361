"""Plans: a partition of a graph for an algorithm, batch and memory limit, with its predicted costs."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ..algorithms import Algorithm
from .costs import GraphCosts
from .memory import Segment, Sizing, StageMemory, StageModel
from .sizing import tie_owners
from .byte_units import format_bytes
from .partitioners import InfeasibleMemoryLimit, partition
from .rank_budgets import rank_sums

# Doubling the micro-batch past this many samples means memory does not grow with the batch.
_MAX_SAMPLES = 1 << 40


@dataclass(frozen=True)
class Plan:
    """Where to cut a graph, what to recompute or offload, and what each stage is predicted to cost.

    Attributes:
        starts: node indices where stages ``1..P-1`` start.
        recomputed: per stage, the node ranges ``(i, j)`` recomputed in its backward.
        offloaded: per stage, the node ranges ``(i, j)`` whose saved tensors are copied to pinned host memory
            after their forward and back before their backward (CUDA only; empty unless the costs measured a
            host bandwidth, ``GraphCosts.host_bytes_per_s``).
        stage_time: per stage, predicted forward + backward seconds of one micro-batch.
        stage_memory: per stage, predicted peak bytes.
        objective: ``"parameters"``, ``"time"`` or ``"memory"``.
        algorithm: the algorithm's name.
        num_stages, n_microbatches, batch_size: the pipeline shape and the mini-batch (samples).
        memory_limit: the per-device (per-rank) limit in bytes the plan was made for, or None: with one stage
            per rank the stage's limit; with several (``placement``) it bounds :attr:`rank_memory`.
        costs: the graph costs the plan was made from, per micro-batch of ``costs.microbatch_size`` samples.
        sizing: what the algorithm makes each stage hold (from the simulator), and which rank holds each stage.
        world: with ``plan(..., world_size=N)``, the :class:`~pipecore.planning.world.World` the plan was chosen
            from: every ``(W, P)`` with ``W x P = N``, each one's predicted step time and memory, why the others
            were rejected, and the all-reduce bandwidth used; None otherwise. The plan is then one replica's
            (``batch_size`` its share of the global mini-batch), to run ``data_parallel`` times.

    With several stages per rank, :attr:`rank_memory` (a rank's stages' peaks summed) is an upper bound of
    the device's peak: the stages' peaks need not coincide.
    """

    starts: tuple[int, ...]
    recomputed: tuple[tuple[Segment, ...], ...]
    offloaded: tuple[tuple[Segment, ...], ...]
    stage_time: tuple[float, ...]
    stage_memory: tuple[int, ...]
    objective: str
    algorithm: str
    num_stages: int
    n_microbatches: int
    batch_size: int
    memory_limit: float | None
    costs: GraphCosts
    sizing: Sizing
    world: Any = None

    @property
    def data_parallel(self) -> int:
        """``W``, the replicas of this pipeline the plan was chosen for (1 unless planned with ``world_size``)."""
        return 1 if self.world is None else self.world.chosen.data_parallel

    @property
    def alternatives(self) -> tuple:
        """With ``world_size``: the ``(W, P)`` configurations not chosen, each with its predicted step time,
        memory and the reason (:class:`~pipecore.planning.world.Configuration`); empty otherwise."""
        return () if self.world is None else self.world.alternatives

    @property
    def step_time(self) -> float | None:
        """With ``world_size``: predicted seconds per global mini-batch (one replica's step, all-reduce
        included); None otherwise."""
        return None if self.world is None else self.world.chosen.step_time

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.n_microbatches

    @property
    def placement(self) -> tuple[int, ...]:
        """The rank (device) of every stage, from the algorithm's schedule."""
        return self.sizing.placement

    @property
    def num_ranks(self) -> int:
        return self.sizing.num_ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` holds."""
        return self.sizing.stages_of(rank)

    @property
    def rank_memory(self) -> tuple[int, ...]:
        """Per rank, predicted peak bytes: the sum of its stages' peaks (:attr:`stage_memory` with one stage per
        rank). An upper bound: the stages' peaks need not coincide."""
        return rank_sums(self.stage_memory, self.placement)

    @property
    def rank_time(self) -> tuple[float, ...]:
        """Per rank, predicted seconds of one micro-batch's forward and backward through all its stages (a rank
        runs one action at a time): the work per micro-batch that bounds its throughput."""
        return rank_sums(self.stage_time, self.placement)

    def bounds(self) -> list[tuple[int, int]]:
        """Each stage's node range ``[start, end)``."""
        edges = [0, *self.starts, len(self.costs)]
        return list(zip(edges, edges[1:]))

    def memory_breakdown(self, batch_size: int | None = None) -> list[StageMemory]:
        """Each stage's predicted peak term by term, at ``batch_size`` (default: the plan's batch)."""
        batch = self.batch_size if batch_size is None else check_batch(batch_size, self.n_microbatches)
        model = StageModel(self.costs.at_microbatch_size(batch // self.n_microbatches), self.sizing)
        return [model.memory(a, b, s, self.recomputed[s], self.offloaded[s]) for s, (a, b) in enumerate(self.bounds())]

    def max_batch_size(self) -> int:
        """The largest mini-batch, a multiple of ``n_microbatches``, whose predicted per-rank peaks (per-stage
        with one stage per rank) with this plan's cuts, recomputation and offload stay within ``memory_limit``
        (binary search over samples per micro-batch; predicted memory grows with them)."""
        if self.memory_limit is None:
            raise ValueError("max_batch_size needs a plan made with a memory_limit")
        limit = self.memory_limit

        def peak(samples: int) -> int:
            return max(rank_sums([m.total for m in self.memory_breakdown(samples * self.n_microbatches)],
                                  self.placement))

        if peak(1) > limit:
            where = "a stage" if self.num_ranks == self.num_stages else "a rank"
            raise ValueError(f"no batch fits memory_limit={limit:.0f} bytes ({format_bytes(limit)}) with this plan: one "
                             f"sample per micro-batch already needs {peak(1)} bytes ({format_bytes(peak(1))}) on {where}")
        fits, too_big = 1, 2
        while peak(too_big) <= limit:
            fits, too_big = too_big, 2 * too_big
            if too_big > _MAX_SAMPLES:
                raise ValueError("the predicted memory does not grow with the batch (no activation bytes): "
                                 "every batch size fits")
        while too_big - fits > 1:
            middle = (fits + too_big) // 2
            if peak(middle) <= limit:
                fits = middle
            else:
                too_big = middle
        return fits * self.n_microbatches

    def table(self) -> str:
        """A text table: per stage its nodes, predicted time, predicted memory (of the limit), recomputed and
        offloaded node ranges. With several stages per rank, each stage's rank too, and a second table per
        rank: its stages, their time per micro-batch summed, and their peaks summed (of the limit, which is per
        device)."""
        several = self.num_ranks < self.num_stages
        limit = self.memory_limit
        lines = [
            f"{self.algorithm}, {self.num_stages} stage{'s' if self.num_stages != 1 else ''}"
            + (f" on {self.num_ranks} rank{'s' if self.num_ranks != 1 else ''}" if several else "")
            + f", batch {self.batch_size} = {self.n_microbatches} x {self.microbatch_size} samples, objective "
            f"{self.objective}"
            + (f", limit {format_bytes(limit)} per {'device (rank)' if several else 'stage'}" if limit is not None
               else "")
            + (f"; one pipeline of W={self.data_parallel} (global batch {self.world.batch_size} = "
               f"{self.data_parallel} x {self.batch_size})" if self.world is not None else ""),
        ]

        def of_limit(nbytes: int) -> str:
            text = format_bytes(nbytes)
            return text if limit is None else text + f" / {format_bytes(limit)} ({nbytes / limit:.0%})"

        rows = [("stage", *(("rank",) if several else ()), "nodes", "time (ms)",
                 "memory" + (" / limit" if limit is not None and not several else ""), "recomputed", "offloaded")]
        for s, (a, b) in enumerate(self.bounds()):
            names = self.costs.names
            nodes = f"{a}-{b - 1} ({names[a]}{'..' + names[b - 1] if b - a > 1 else ''})"
            # With several stages per rank the limit is the rank's: the stage's peak alone is not held to it.
            memory = format_bytes(self.stage_memory[s]) if several else of_limit(self.stage_memory[s])
            recomputed, offloaded = (" ".join(f"[{i}, {j})" for i, j in segments) or "-"
                                     for segments in (self.recomputed[s], self.offloaded[s]))
            rows.append((str(s), *((str(self.placement[s]),) if several else ()), nodes,
                         f"{self.stage_time[s] * 1e3:.3f}", memory, recomputed, offloaded))
        lines += aligned_columns(rows)
        if several:
            lines.append("per rank (memory: its stages' peaks summed, an upper bound of the device's peak):")
            rows = [("rank", "stages", "time (ms)", "memory" + (" / limit" if limit is not None else ""))]
            for r in range(self.num_ranks):
                rows.append((str(r), ", ".join(map(str, self.stages_of(r))), f"{self.rank_time[r] * 1e3:.3f}",
                             of_limit(self.rank_memory[r])))
            lines += aligned_columns(rows)
        return "\n".join(lines)


    def plot(self, path: str) -> None:
        """Draw the plan to a PNG: per stage, the predicted peak memory split into its terms (with the limit as a
        line) and the predicted time of one micro-batch's forward and backward (recomputation and offload
        included). With several stages per rank the memory is drawn per rank (its stages' terms summed,
        against the per-device limit) and each stage's time bar is labelled with its rank."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        several = self.num_ranks < self.num_stages
        breakdown = self.memory_breakdown()
        terms = [t for t in ("weights", "gradients", "scratch", "buffers", "optimizer", "activations",
                             "recomputation", "boundary") if any(getattr(m, t) for m in breakdown)]
        stages = list(range(self.num_stages))
        # The memory bars: per stage, or per rank (a rank's stages' terms summed).
        groups = [self.stages_of(r) for r in range(self.num_ranks)] if several else [(s,) for s in stages]
        bars = list(range(len(groups)))
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        bottom = [0.0] * len(groups)
        for term in terms:
            values = [sum(getattr(breakdown[s], term) for s in group) / 2 ** 20 for group in groups]
            left.bar(bars, values, bottom=bottom,
                     label="recomputation, prefetch" if term == "recomputation" and any(self.offloaded) else term)
            bottom = [b + v for b, v in zip(bottom, values)]
        if self.memory_limit is not None:
            left.axhline(self.memory_limit / 2 ** 20, color="black", linestyle="--", label="limit")
        if several:
            left.set(xlabel="rank (its stages)", ylabel="predicted peak, stages summed (MiB)", xticks=bars,
                     title="memory per device")
            left.set_xticklabels([f"{r}\n({', '.join(map(str, g))})" for r, g in enumerate(groups)])
        else:
            left.set(xlabel="stage", ylabel="predicted peak (MiB)", xticks=stages, title="memory")
        left.legend(fontsize="small")
        right.bar(stages, [t * 1e3 for t in self.stage_time], color="tab:gray")
        right.set(xlabel="stage (rank)" if several else "stage", ylabel="forward + backward of a micro-batch (ms)",
                  xticks=stages, title="time")
        if several:
            right.set_xticklabels([f"{s}\n({self.placement[s]})" for s in stages])
        fig.suptitle(f"{self.algorithm}, {self.num_stages} stages"
                     + (f" on {self.num_ranks} ranks" if several else "")
                     + f", batch {self.batch_size}, objective {self.objective}")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


# Partitions at most this many more times while the cuts move tied weights between stages (see plan_costs).
_TIE_ROUNDS = 3


def plan_costs(
    costs: GraphCosts,
    num_stages: int,
    algorithm: str | Algorithm,
    batch_size: int,
    n_microbatches: int,
    memory_limit: float | None = None,
    objective: str = "memory",
    allowed_cuts: Iterable[int] | None = None,
    *,
    recover: bool = True,
    **algorithm_options: Any,
) -> Plan:
    """Plan ``num_stages`` stages of ``costs`` for ``algorithm`` at ``batch_size`` samples per mini-batch in
    ``n_microbatches`` micro-batches, each device within ``memory_limit`` bytes when given.

    ``costs`` are per micro-batch of ``costs.microbatch_size`` samples; they are rescaled to
    ``batch_size // n_microbatches`` (:meth:`GraphCosts.at_microbatch_size`). ``objective`` and
    ``allowed_cuts`` are those of :func:`~pipecore.planning.partitioners.partition`; ``algorithm_options`` configure
    a named algorithm (e.g. ``stages_per_rank=2`` for interleaved-1f1b, looped-bfs and zb-h1; zb-v and
    dualpipe-v always place two stages per rank). The ``"memory"`` objective may offload only when
    ``costs.host_bytes_per_s`` is above 0.

    ``num_stages`` counts stages (model chunks); the algorithm's schedule places them on ranks
    (``Plan.placement``), and ``memory_limit`` is per rank: the sum of a rank's stages' peaks. The time the
    partitioners minimise is the slowest stage's forward and backward of one micro-batch, as with one stage
    per rank; the step time is not simulated (``Plan.rank_time`` sums each rank's stages).

    ``recover`` is the pipeline's (``Pipeline(recover=...)``, default True): with it, each stage's predicted peak
    includes the copies it keeps to undo a failed step (``StageMemory.undo``); pass False for a pipeline made
    with ``recover=False``.
    """
    if not isinstance(n_microbatches, int) or isinstance(n_microbatches, bool) or n_microbatches < 1:
        raise ValueError(f"n_microbatches must be a positive int, got {n_microbatches!r}")
    check_batch(batch_size, n_microbatches)
    if isinstance(algorithm, Algorithm):
        if (algorithm.num_stages, algorithm.n_microbatches) != (num_stages, n_microbatches):
            raise ValueError(f"the algorithm is configured for {algorithm.num_stages} stages and "
                             f"{algorithm.n_microbatches} micro-batches, the plan asks for {num_stages} and "
                             f"{n_microbatches}")

        def size(ties: tuple) -> Sizing:
            return Sizing.of(algorithm, recover=recover, ties=ties, **algorithm_options)
    else:
        def size(ties: tuple) -> Sizing:
            return Sizing.of(algorithm, num_stages, n_microbatches, recover=recover, ties=ties, **algorithm_options)
    scaled = costs.at_microbatch_size(batch_size // n_microbatches)
    # Which stages share a tied weight depends on the cuts, and changes the undo copies a stage keeps (see
    # Sizing.of): partition again with the ties the last cuts make until the cuts make the ties they were made
    # with. Should that not settle, the plan's figures are those of its own cuts' ties, checked against the limit.
    sizing = size(())
    result = partition(scaled, num_stages, objective, sizing, memory_limit, allowed_cuts)
    ties: tuple = ()
    for _ in range(_TIE_ROUNDS):
        found = tie_owners(costs, result.starts) if recover else ()
        if found == ties:
            break
        ties, sizing = found, size(found)
        result = partition(scaled, num_stages, objective, sizing, memory_limit, allowed_cuts)
    else:
        sizing = size(tie_owners(costs, result.starts))
        model = StageModel(scaled, sizing)
        edges = [0, *result.starts, len(costs)]
        memory = tuple(model.memory(a, b, s, result.recomputed[s], result.offloaded[s])
                       for s, (a, b) in enumerate(zip(edges, edges[1:])))
        result = dataclasses.replace(result, memory=memory, stage_memory=tuple(m.total for m in memory))
        fullest = max(rank_sums(result.stage_memory, sizing.placement))
        if memory_limit is not None and fullest > memory_limit:
            raise InfeasibleMemoryLimit(
                f"the cuts that meet memory_limit={int(memory_limit)} bytes move the tied weights between stages, "
                f"and with the undo copies of where they end up a rank needs {fullest} bytes; plan with a larger "
                f"limit, or recover=False for a pipeline without undo copies", fullest)
    return Plan(result.starts, result.recomputed, result.offloaded, result.stage_time, result.stage_memory, objective,
                sizing.algorithm, num_stages, n_microbatches, batch_size, memory_limit, costs, sizing)


def aligned_columns(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells as left-aligned columns two spaces apart."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def check_batch(batch_size: int, n_microbatches: int) -> int:
    """``batch_size`` as an int, checked: positive, and divisible into ``n_microbatches`` micro-batches."""
    if not isinstance(batch_size, numbers.Integral) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if batch_size % n_microbatches:
        lower = batch_size - batch_size % n_microbatches
        nearest = f"{lower} or {lower + n_microbatches}" if lower else f"{n_microbatches}"
        raise ValueError(f"batch_size={batch_size} is not divisible by n_microbatches={n_microbatches}; "
                         f"use a multiple of {n_microbatches} (e.g. {nearest})")
    return int(batch_size)
