"""Partitioners: where to cut a graph of per-node costs into stages, by parameters, time, or memory.

All three share the stage cost model of :class:`~pipecore.planning.memory.StageModel`; they differ in what they
minimise and whether they may recompute or offload:

* ``"parameters"``: balanced parameter bytes (the runtime's default partition); no recomputation or offload.
* ``"time"``: PipeDream's planner: the slowest stage's forward + backward time, exactly, by dynamic
  programming; with a memory limit, stages over it are ruled out (PipeDream neither recomputes nor offloads).
* ``"memory"``: DawnPiper's binary partitioning (a reconstruction, see :func:`partition`): stages may
  recompute segments to fit the limit, paying their forward time again, or offload them to host memory
  (with a measured host bandwidth, ``GraphCosts.host_bytes_per_s``), paying the link's time where it
  exceeds the compute.

The memory limit is per device, i.e. per rank. With one stage per rank that is the stage's limit. With several
stages per rank (``Sizing.placement``: interleaved, looped and V-shaped schedules) a rank must hold the sum of
its stages' peaks, a constraint that couples stages far apart in the pipeline (rank 0 of a V holds the first
and the last stage), which the recursion over contiguous halves of the stage set cannot express. So the
limit is split into per-stage budgets, a share of the rank's limit for each of its stages, the partitioners
run unchanged with those budgets, and the result is checked per rank (see :func:`partition`).

This module holds the entry points (:func:`partition`, :func:`smallest_memory_limit`) and their result; the
searches for cuts are in :mod:`~pipecore.planning.cut_search`, and what several stages per rank add in
:mod:`~pipecore.planning.rank_budgets` (the arithmetic of per-stage budgets) and
:mod:`~pipecore.planning.rank_split` (the search over splits of a rank's limit).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Iterable, Sequence

from .byte_units import format_bytes
from .costs import GraphCosts
from .cut_search import stage_cuts
from .memory import Segment, Sizing, StageFit, StageMemory, StageModel
from .rank_budgets import equal_shares, rank_sums
from .rank_split import SplitSearch, share_candidates, smallest_split

OBJECTIVES = ("parameters", "time", "memory")


@dataclass(frozen=True)
class Partition:
    """Stages of a graph and their predicted costs.

    Attributes:
        starts: node indices where stages ``1..P-1`` start.
        recomputed: per stage, the node ranges ``(i, j)`` recomputed in its backward.
        offloaded: per stage, the node ranges ``(i, j)`` whose saved tensors go to host memory after their
            forward and come back for their backward.
        stage_time: per stage, predicted forward + backward seconds of one micro-batch, recomputation and
            offload included.
        stage_memory: per stage, predicted peak bytes.
        memory: per stage, the predicted peak term by term.
        objective: the objective the cuts were chosen for.
        placement: the rank of every stage (``Sizing.placement``; empty: one stage per rank).
    """

    starts: tuple[int, ...]
    recomputed: tuple[tuple[Segment, ...], ...]
    offloaded: tuple[tuple[Segment, ...], ...]
    stage_time: tuple[float, ...]
    stage_memory: tuple[int, ...]
    memory: tuple[StageMemory, ...]
    objective: str
    placement: tuple[int, ...] = ()

    @property
    def slowest(self) -> float:
        """The slowest stage's time, which sets the pipeline's throughput (with one stage per rank)."""
        return max(self.stage_time)

    @property
    def rank_memory(self) -> tuple[int, ...]:
        """Per rank (device), the sum of its stages' predicted peaks: an upper bound of the device's peak, as
        the stages' peaks need not coincide."""
        return rank_sums(self.stage_memory, self.placement or tuple(range(len(self.stage_memory))))

    def bounds(self, num_nodes: int) -> list[tuple[int, int]]:
        """Each stage's node range ``[start, end)`` in a graph of ``num_nodes`` nodes."""
        edges = [0, *self.starts, num_nodes]
        return list(zip(edges, edges[1:]))


class InfeasibleMemoryLimit(ValueError):
    """No partition meets the memory limit; ``smallest_limit`` is the smallest per-stage (per-device) limit that
    does (with several stages per rank: the smallest per-device limit that the planner's split of it among the
    rank's stages meets, see :func:`partition`)."""

    def __init__(self, message: str, smallest_limit: int):
        super().__init__(message)
        self.smallest_limit = smallest_limit


def partition(
    costs: GraphCosts,
    num_stages: int,
    objective: str,
    sizing: Sizing,
    memory_limit: float | None = None,
    allowed_cuts: Iterable[int] | None = None,
) -> Partition:
    """Cut ``costs`` into ``num_stages`` stages for ``objective`` (``"parameters"``, ``"time"`` or
    ``"memory"``), with every stage's peak under ``memory_limit`` bytes when one is given.

    ``sizing`` says what the algorithm makes each stage hold (:meth:`Sizing.of`). ``allowed_cuts`` lists the
    node indices where a stage may start (e.g. where a module starts); None allows every node.

    The ``"memory"`` objective is DawnPiper's binary partitioning as reconstructed here (the paper's text was
    not available; every step below is inferred):

    * the stage set is split in halves, the right half taking one more when the count is odd, together
      with the node range, recursively down to single stages; a stage is judged by the cost model
      (:meth:`StageModel.fit`: its time with the recomputation and offload that fit it under the limit, or
      infinite);
    * each cut is searched first between the cut that balances compute per stage and the cut that balances
      memory per stage (estimated at each half's average weight copies and in-flight micro-batches): the
      reading of DawnPiper's theorem that the best cut lies between them; every candidate is judged by the
      best partition of both halves (memoised);
    * the interval is then widened one cut at a time on either side while a lower bound of a further cut's
      slowest stage (each half's share of the compute) beats the best so far, and cuts where a half cannot
      hold its parameters and optimizer state at all are skipped. So the search finds the best partition
      its recursion can express, and a feasible one whenever one exists, while judging few cuts outside
      the interval in practice.

    Without a limit, the memory objective plans for the smallest limit that some partition meets without
    recomputation or offload (the most even memory), and takes the fastest partition under it.

    ``memory_limit`` is per device: with several stages per rank (``sizing.placement``) it bounds the sum of
    the rank's stages' peaks (an upper bound of the device's peak: the stages' peaks need not coincide). The
    partitioners judge one stage at a time, over contiguous ranges of stages, and a rank's stages are not
    contiguous, so the search keeps its structure and the rank's limit is split into per-stage budgets
    (shares summing to 1 on each rank), with every stage under its budget (:mod:`~pipecore.planning.rank_split`):

    * a few splits are tried (:func:`~.rank_split.share_candidates`: even; by each stage's estimated peak from
      its weight copies and micro-batches in flight), then splits by the best partition's own stages, at most
      ``rank_split._SPLITS`` in all; if none fits, the split that meets the smallest limit the planner can
      (:func:`~.rank_split.smallest_split`), in case it meets this one;
    * each partition's ranks then share their limit among their stages afresh
      (:func:`~.rank_split.allocate_ranks`: a stage recomputes less where another of its rank leaves room),
      and the best partition is kept: every rank within the limit, then the slowest stage, then the fullest
      rank;
    * last, a local search moves one cut at a time while that makes the partition better
      (:meth:`~.rank_split.SplitSearch.move_cuts`).

    Every partition this returns has each rank within the limit. It is a heuristic: it may be slower than the
    best partition under the per-rank limit, and refuse a limit that some partition meets (the budgets are
    sufficient, not necessary). The time it minimises is still the slowest stage's. With one stage per rank
    every budget is the limit, and none of this applies.

    Raises ValueError for an unknown objective, a non-positive limit, a stage count that the cut positions
    cannot hold, and :class:`InfeasibleMemoryLimit` (naming the smallest limit that works for the
    objective) when no partition fits.
    """
    positions = _check(costs, num_stages, objective, sizing, memory_limit, allowed_cuts)
    model = StageModel(costs, sizing)
    trade_time = objective == "memory"  # only it may recompute or offload
    placement = sizing.placement
    several = sizing.num_ranks < num_stages and objective != "parameters"  # the split of the limit matters
    candidates = share_candidates(model, num_stages)
    limit = memory_limit
    if limit is None and trade_time:
        # Without a limit: the smallest one that any partition meets as it is, then the fastest under it.
        limit, shares = smallest_split(model, positions, num_stages, "time")
        candidates = [shares, *candidates]
    split = several and limit is not None
    if not split:  # the budgets are the limit itself, or there is none
        candidates = candidates[:1]
    search = SplitSearch(model, positions, num_stages, objective, limit)
    for shares in candidates:
        search.judge(shares)
    while split and search.refine():
        pass
    smallest = None
    if search.over and split:
        # No split judged so far fits: the split that meets the smallest limit the planner can (named below
        # if this one is smaller), judged in case it meets this one.
        smallest, shares = smallest_split(model, positions, num_stages, objective)
        if smallest <= limit:
            search.judge(shares)
            assert not search.over
            while search.refine():
                pass
    if split:
        search.move_cuts()
    if search.over:
        assert memory_limit is not None
        if smallest is None:
            smallest = _smallest_any(model, positions, num_stages, objective)
    if search.over:
        if sizing.num_ranks == num_stages:
            what, per, works = f"no partition into {num_stages} stages", "", "the smallest per-stage limit that works is"
        else:
            what = f"the planner finds no partition into {num_stages} stages on {sizing.num_ranks} ranks that"
            per = " per device (a rank holds the sum of its stages' peaks)"
            works = "the smallest per-device limit the planner meets is"
        raise InfeasibleMemoryLimit(
            f"{what} meets memory_limit={memory_limit:.0f} bytes "
            f"({format_bytes(memory_limit)}){per} under {sizing.algorithm} with objective {objective!r}"
            f"{'' if trade_time else ' (no recomputation or offload)'}; {works} "
            f"{smallest} bytes ({format_bytes(smallest)})", smallest)
    return _result(search.fits, objective, placement if sizing.num_ranks < num_stages else ())


def smallest_memory_limit(costs: GraphCosts, num_stages: int, objective: str, sizing: Sizing,
                          allowed_cuts: Iterable[int] | None = None) -> int:
    """The smallest per-stage limit (bytes) under which :func:`partition` finds a partition for
    ``objective``: for ``"time"`` the least largest stage peak over all partitions (dynamic programming);
    for ``"memory"`` the least largest stage minimum (:meth:`StageModel.smallest_memory`: with the cost
    model's recomputation and offload) over all partitions (bisection over the limit, each step an exact
    search for any partition that fits); for ``"parameters"`` the largest stage peak of the
    parameter-balanced cuts.

    With several stages per rank (``sizing.placement``): the smallest per-device limit under which some
    partition has every stage within its budget, for one of the splits of the limit that :func:`partition`
    always tries (the same searches, each stage's peak measured against its share); :func:`partition` meets
    it, and may meet a smaller one where a stage leaves room for another of its rank."""
    positions = _check(costs, num_stages, objective, sizing, None, allowed_cuts)
    return _smallest_any(StageModel(costs, sizing), positions, num_stages, objective)


def _smallest_any(model: StageModel, positions: Sequence[int], num_stages: int, objective: str) -> int:
    """See :func:`smallest_memory_limit`."""
    if objective == "parameters":
        # The cuts do not depend on the limit: the fullest rank of the parameter-balanced cuts.
        cuts = stage_cuts(model, positions, num_stages, objective, None, equal_shares(model.sizing.placement))
        peaks = [model.memory(positions[u], positions[v], s).total for s, (u, v) in enumerate(zip(cuts, cuts[1:]))]
        return max(rank_sums(peaks, model.sizing.placement))
    return smallest_split(model, positions, num_stages, objective)[0]


def _check(costs: GraphCosts, num_stages: int, objective: str, sizing: Sizing, memory_limit: float | None,
           allowed_cuts: Iterable[int] | None) -> list[int]:
    """Validate the arguments of :func:`partition`; return the positions where stages may start."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; allowed: {', '.join(OBJECTIVES)}")
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if sizing.num_stages != num_stages:
        raise ValueError(f"sizing is for {sizing.num_stages} stages, the partition asks for {num_stages}")
    if memory_limit is not None and (
        isinstance(memory_limit, bool) or not isinstance(memory_limit, numbers.Real)
        or not math.isfinite(memory_limit) or memory_limit <= 0
    ):
        raise ValueError(f"memory_limit must be a positive number of bytes (or None), got {memory_limit!r}")
    positions = cut_positions(len(costs), allowed_cuts)
    if costs.uncuttable:  # a value that is not a tensor would cross there
        positions = [c for c in positions if c not in set(costs.uncuttable)]
    if num_stages > len(positions) - 1:
        raise ValueError(f"num_stages={num_stages} needs {num_stages - 1} cut positions; the graph of {len(costs)} "
                         f"nodes allows {len(positions) - 2}" + (" (allowed_cuts)" if allowed_cuts is not None else "")
                         + (" (values that are not tensors cross the others)" if costs.uncuttable else ""))
    return positions


def cut_positions(num_nodes: int, allowed_cuts: Iterable[int] | None) -> list[int]:
    """Node indices where stages may start, with 0 first and ``num_nodes`` (the end) last."""
    if allowed_cuts is None:
        return list(range(num_nodes + 1))
    cuts = list(allowed_cuts)
    bad = [c for c in cuts if isinstance(c, bool) or not isinstance(c, numbers.Integral) or not 0 <= c < num_nodes]
    if bad:
        raise ValueError(f"allowed_cuts must be node indices in 0..{num_nodes - 1}, got {bad}")
    return [0, *sorted({int(c) for c in cuts} - {0}), num_nodes]


def _result(fits: Sequence[StageFit], objective: str, placement: tuple[int, ...] = ()) -> Partition:
    return Partition(
        tuple(f.start for f in fits[1:]),
        tuple(f.recomputed for f in fits),
        tuple(f.offloaded for f in fits),
        tuple(f.time for f in fits),
        tuple(f.memory.total for f in fits),
        tuple(f.memory for f in fits),
        objective,
        placement,
    )
