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
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from .costs import GraphCosts
from .memory import Choice, Segment, Sizing, StageFit, StageMemory, StageModel

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
        return _rank_sums(self.stage_memory, self.placement or tuple(range(len(self.stage_memory))))

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
    (shares summing to 1 on each rank), with every stage under its budget:

    * a few splits are tried (:func:`_share_candidates`: even; by each stage's estimated peak from its weight
      copies and micro-batches in flight), then splits by the best partition's own stages, at most
      ``_SPLITS`` in all; if none fits, the split that meets the smallest limit the planner can
      (:func:`_smallest_split`), in case it meets this one;
    * each partition's ranks then share their limit among their stages afresh (:func:`_allocate_ranks`: a
      stage recomputes less where another of its rank leaves room), and the best partition is kept: every
      rank within the limit, then the slowest stage, then the fullest rank;
    * last, a local search moves one cut at a time while that makes the partition better
      (:meth:`_SplitSearch.move_cuts`).

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
    candidates = _share_candidates(model, num_stages)
    limit = memory_limit
    if limit is None and trade_time:
        # Without a limit: the smallest one that any partition meets as it is, then the fastest under it.
        limit, shares = _smallest_split(model, positions, num_stages, "time")
        candidates = [shares, *candidates]
    split = several and limit is not None
    if not split:  # the budgets are the limit itself, or there is none
        candidates = candidates[:1]
    search = _SplitSearch(model, positions, num_stages, objective, limit)
    for shares in candidates:
        search.judge(shares)
    while split and search.refine():
        pass
    smallest = None
    if search.over and split:
        # No split judged so far fits: the split that meets the smallest limit the planner can (named below
        # if this one is smaller), judged in case it meets this one.
        smallest, shares = _smallest_split(model, positions, num_stages, objective)
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
        cuts = _cuts(model, positions, num_stages, objective, None, _equal_shares(model.sizing.placement))
        peaks = [model.memory(positions[u], positions[v], s).total for s, (u, v) in enumerate(zip(cuts, cuts[1:]))]
        return max(_rank_sums(peaks, model.sizing.placement))
    return _smallest_split(model, positions, num_stages, objective)[0]


def _smallest_split(model: StageModel, positions: Sequence[int], num_stages: int,
                    objective: str) -> tuple[int, tuple[float, ...]]:
    """The smallest limit under which some partition has every stage within its budget for some split of the
    rank's limit that the planner tries, and that split (with one stage per rank: the smallest limit, and
    every share 1). The splits: :func:`_share_candidates`, then, from the one with the smallest limit, the
    split by the least peaks its partition's stages reach (its cuts then fit any limit their ranks' sums of
    least peaks fit, so the smallest limit never grows), while that lowers the limit."""
    placement = model.sizing.placement
    found = [(*_smallest_limit(model, positions, num_stages, objective, shares), shares)
             for shares in _share_candidates(model, num_stages)]
    limit, cuts, shares = min(found, key=lambda item: item[0])
    if model.sizing.num_ranks == num_stages:
        return limit, shares
    for _ in range(_REFINEMENTS):
        least = [model.smallest_memory(positions[u], positions[v], s, objective == "memory")
                 for s, (u, v) in enumerate(zip(cuts, cuts[1:]))]
        refined = _normalised(placement, least)
        if refined is None or refined == shares:
            break
        refined_limit, refined_cuts = _smallest_limit(model, positions, num_stages, objective, refined)
        if refined_limit >= limit:
            break
        limit, cuts, shares = refined_limit, refined_cuts, refined
    return limit, shares


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
    positions = _positions(len(costs), allowed_cuts)
    if costs.uncuttable:  # a value that is not a tensor would cross there
        positions = [c for c in positions if c not in set(costs.uncuttable)]
    if num_stages > len(positions) - 1:
        raise ValueError(f"num_stages={num_stages} needs {num_stages - 1} cut positions; the graph of {len(costs)} "
                         f"nodes allows {len(positions) - 2}" + (" (allowed_cuts)" if allowed_cuts is not None else "")
                         + (" (values that are not tensors cross the others)" if costs.uncuttable else ""))
    return positions


def _cuts(model: StageModel, positions: Sequence[int], num_stages: int, objective: str,
          memory_limit: float | None, shares: Sequence[float]) -> list[int]:
    """Position indices of the stage boundaries (0 first, the last position last) for ``objective``, stage
    ``s`` within ``_budget(memory_limit, shares[s])``."""
    last = len(positions) - 1
    if objective == "parameters":
        # Imported here: engine imports the planner (Pipeline takes a Plan), which imports this module.
        from ..engine.partition import balanced_by_parameters

        units = [model.params(a, b) for a, b in zip(positions, positions[1:])]
        return [0, *balanced_by_parameters(units, num_stages), last]
    if objective == "time":
        budgets = [_budget(memory_limit, c) for c in shares]

        def seconds(u: int, v: int, s: int) -> float:
            fit = model.fit(positions[u], positions[v], s, budgets[s], trade_time=False)
            return fit.time if fit.fits else math.inf

        def least_seconds(u: int, v: int, s: int) -> float:
            # Longer stages take longer; past the limit's reach (weights alone) they never fit.
            if memory_limit is not None and _weights_floor(model, positions[u], positions[v], s) > budgets[s]:
                return math.inf
            return model.time(positions[u], positions[v])

        return _minimax(len(positions), num_stages, seconds, least_seconds)[1]
    assert memory_limit is not None
    return _BinarySearch(model, positions, memory_limit, shares).solve(0, last, 0, num_stages)[1]


def _smallest_limit(model: StageModel, positions: Sequence[int], num_stages: int, objective: str,
                    shares: Sequence[float]) -> tuple[int, list[int]]:
    """The smallest limit ``L`` under which some partition has every stage ``s`` within
    ``_budget(L, shares[s])`` (see :func:`smallest_memory_limit`), and that partition's position cuts: each
    stage's bytes are measured as the limit they need (:func:`_need`; themselves with one stage per rank)."""
    last = len(positions) - 1
    if objective == "parameters":
        cuts = _cuts(model, positions, num_stages, objective, None, shares)
        return max(_need(model.memory(positions[u], positions[v], s).total, shares[s])
                   for s, (u, v) in enumerate(zip(cuts, cuts[1:]))), cuts

    def weights(u: int, v: int, s: int) -> float:
        return _need(_weights_floor(model, positions[u], positions[v], s), shares[s])

    # Without recomputation or offload: the least largest stage peak, exactly.
    least, best_cuts = _minimax(
        len(positions), num_stages,
        lambda u, v, s: _need(model.memory(positions[u], positions[v], s).total, shares[s]), weights)
    no_recompute = int(least)
    if objective == "time":
        return no_recompute, best_cuts
    # With it: a stage fits a limit exactly when its least memory (StageModel.smallest_memory) does, so the
    # answer is the least, over partitions, of the largest stage's least memory. Bisection over the limit
    # between the weights' own floor and the answer without recomputation; each step asks whether any
    # partition fits (_FitSearch), and a partition that fits lowers the upper end to what it needs.
    infeasible = int(_minimax(len(positions), num_stages, weights, weights)[0]) - 1
    feasible = no_recompute
    while feasible - infeasible > 1:
        middle = (infeasible + feasible) // 2
        cuts = _FitSearch(model, positions, middle, shares).solve(0, last, 0, num_stages)
        if cuts is None:
            infeasible = middle
        else:
            feasible = max(_need(model.smallest_memory(positions[u], positions[v], s), shares[s])
                           for s, (u, v) in enumerate(zip(cuts, cuts[1:])))
            best_cuts = cuts
    return feasible, best_cuts


# -- several stages per rank: the rank's limit split into per-stage budgets --------------------------------
#
# The partitioners judge a stage alone (StageModel.fit under a limit) and recurse over contiguous ranges of
# stages, memoised; a rank's limit bounds a sum over stages that are not contiguous (looped: s, s+R, ...; V:
# r and 2R-1-r), which would couple the memoised halves. Rather than a new search, the rank's limit is split
# into budgets, shares of it that sum to 1 over the rank's stages: a partition with every stage within its
# budget has every rank within the limit. Which split is best depends on the cuts, so partition() tries a
# few and keeps the fastest; _allocate_ranks then shares each rank's limit among its stages for the cuts
# found (exactly), and a local search over the cuts judges partitions that way. With one stage per rank
# every share is 1 and the budget is the limit itself: the partitioners do exactly what they did before.


def _budget(limit: float | None, share: float) -> float | None:
    """Stage budget: ``share`` of the rank's ``limit`` (the limit itself, exactly, for a share of 1)."""
    if limit is None or share == 1:
        return limit
    return limit * share


def _need(nbytes: float, share: float) -> float:
    """The smallest integer limit whose budget for ``share`` holds ``nbytes`` (``nbytes`` for a share of 1)."""
    if share == 1 or nbytes in (math.inf, -math.inf):
        return nbytes
    limit = math.ceil(nbytes / share)
    while nbytes > limit * share:  # float rounding, either way
        limit += 1
    while limit > 0 and nbytes <= (limit - 1) * share:
        limit -= 1
    return limit


def _rank_sums(values: Sequence[float], placement: Sequence[int]) -> tuple:
    """Per rank, the sum of its stages' ``values``."""
    sums = [0] * (max(placement) + 1)
    for value, rank in zip(values, placement):
        sums[rank] += value
    return tuple(sums)


def _equal_shares(placement: Sequence[int]) -> tuple[float, ...]:
    """Each stage's share of its rank's limit when the rank splits it evenly (1 with one stage per rank)."""
    count = [0] * (max(placement) + 1)
    for rank in placement:
        count[rank] += 1
    return tuple(1.0 if count[r] == 1 else 1 / count[r] for r in placement)


def _normalised(placement: Sequence[int], weights: Sequence[float]) -> tuple[float, ...] | None:
    """Shares proportional to ``weights`` within each rank (None when a rank's weights are not all positive)."""
    sums = _rank_sums(weights, placement)
    if any(w <= 0 or not math.isfinite(w) for w in weights):
        return None
    return tuple(1.0 if w == sums[r] else w / sums[r] for w, r in zip(weights, placement))


def _share_candidates(model: StageModel, num_stages: int) -> list[tuple[float, ...]]:
    """The splits of a rank's limit among its stages that :func:`partition` always tries: one (every share 1)
    with one stage per rank; else the even split, then the split by each stage's estimated peak were every
    stage to take an equal part of the graph (its weight copies and optimizer state, and its micro-batches in
    flight times the saved bytes: a V's first stage holds more micro-batches than the last, on one rank)."""
    placement = model.sizing.placement
    equal = _equal_shares(placement)
    if model.sizing.num_ranks == num_stages:
        return [equal]
    z, n = model.sizing, model.num_nodes
    params, optimizer = model.params(0, n) / num_stages, model.optimizer(0, n) / num_stages
    saved = (model.saved(0, n) + model.costs.loss_saved_bytes) / num_stages
    crossing = sum(model.crossing(c) for c in range(n + 1)) / max(1, n) * 2
    estimate = [(z.versions[s] + 1 + z.derived[s] + z.buffers[s]) * params + optimizer
                + z.in_flight[s] * (0 if z.recompute_all else saved + crossing) for s in range(num_stages)]
    estimated = _normalised(placement, estimate)
    return [equal] if estimated is None or estimated == equal else [equal, estimated]


# Splits partition() judges at most, the ones it always tries included; and refinements of the smallest limit.
_SPLITS = 6
_REFINEMENTS = 3
# Cut moves the local search judges at most (see _SplitSearch.move_cuts).
_MOVES = 400


class _SplitSearch:
    """The best partition over the splits of the limit judged so far (see :func:`partition`): within the limit
    on every rank (with one stage per rank: every stage within its limit), then the slowest stage's time
    least, then the fullest rank's bytes; while none is within the limit, the one whose fullest rank is least
    over it."""

    def __init__(self, model: StageModel, positions: Sequence[int], num_stages: int, objective: str,
                 limit: float | None):
        self.model, self.positions, self.num_stages, self.objective, self.limit = \
            model, positions, num_stages, objective, limit
        self.trade_time = objective == "memory"
        self.several = model.sizing.num_ranks < num_stages and limit is not None
        self.tried: set[tuple[float, ...]] = set()
        self.key: tuple[bool, float, float] | None = None
        self.fits: list[StageFit] = []
        self._fronts: dict[tuple[int, int, int], list[Choice]] = {}

    @property
    def over(self) -> bool:
        """Whether no partition judged so far has every rank within the limit."""
        return self.key is None or self.key[0]

    def judge(self, shares: tuple[float, ...]) -> bool:
        """Partition with every stage within its share of the limit, hand each rank's room to its stages that
        recompute, and keep the result if it is the best so far (True)."""
        if shares in self.tried:
            return False
        self.tried.add(shares)
        m, positions, limit = self.model, self.positions, self.limit
        cuts = _cuts(m, positions, self.num_stages, self.objective, limit, shares)
        fits = [m.fit(positions[u], positions[v], s, _budget(limit, shares[s]), self.trade_time)
                for s, (u, v) in enumerate(zip(cuts, cuts[1:]))]
        return self._keep(fits)

    def _keep(self, fits: list[StageFit]) -> bool:
        """Share each rank's limit among its stages afresh (:func:`_allocate_ranks`), and keep the partition if
        it is the best so far (True)."""
        m, limit = self.model, self.limit
        if self.trade_time and self.several:
            fits = _allocate_ranks(m, fits, limit, self._fronts)
        fullest = max(_rank_sums([f.memory.total for f in fits], m.sizing.placement))
        slowest = max(f.time for f in fits)
        over = limit is not None and fullest > limit
        key = (True, fullest, slowest) if over else (False, slowest, fullest)
        if self.key is None or key < self.key:
            self.key, self.fits = key, fits
            return True
        return False

    def move_cuts(self) -> None:
        """Local search from the best partition, one cut at a time: every allowed position between its
        neighbours, nearest first, each partition judged with the whole limit shared on each rank
        (:func:`_allocate_ranks`); the best move is kept, and the cuts are gone over again until none moves,
        or ``_MOVES`` partitions have been judged. This reaches cuts that no split of the limit into fixed
        budgets finds (the best split depends on the cuts)."""
        m, positions, limit = self.model, self.positions, self.limit
        index = {p: i for i, p in enumerate(positions)}
        cuts = [0, *(index[f.start] for f in self.fits[1:]), len(positions) - 1]
        judged = 0
        moved = True
        while moved and judged < _MOVES:
            moved = False
            for k in range(1, self.num_stages):
                here = cuts[k]
                for c in sorted(range(cuts[k - 1] + 1, cuts[k + 1]), key=lambda c: (abs(c - here), c)):
                    if c == here or judged >= _MOVES:
                        continue
                    judged += 1
                    trial = [*cuts[:k], c, *cuts[k + 1:]]
                    # Only the two stages beside the cut change.
                    fits = list(self.fits)
                    for s in (k - 1, k):
                        fits[s] = m.fit(positions[trial[s]], positions[trial[s + 1]], s, limit, self.trade_time)
                    if self._keep(fits):
                        cuts, moved = trial, True

    def refine(self) -> bool:
        """Judge the split by the best partition's own stages; False when there is nothing new to judge. Within
        the limit: by their peaks as chosen (the same cuts keep fitting, each stage with at least the room it
        uses, the rank's room shared out in proportion); over it: by the least peaks they reach (under which
        those cuts fit if any split makes them fit)."""
        if len(self.tried) >= _SPLITS or not self.fits:
            return False
        m = self.model
        if self.over:
            weights = [m.smallest_memory(f.start, f.end, f.stage, self.trade_time) for f in self.fits]
        else:
            weights = [f.memory.total for f in self.fits]
        shares = _normalised(m.sizing.placement, weights)
        if shares is None or shares in self.tried:
            return False
        self.judge(shares)
        return True


def _allocate_ranks(model: StageModel, fits: list[StageFit], limit: float,
                    fronts: dict[tuple[int, int, int], list[Choice]] | None = None) -> list[StageFit]:
    """For the cuts of ``fits``, choose again what each stage of a rank with several stages recomputes or
    offloads, sharing the rank's ``limit`` among them rather than holding each to its budget: among every step
    of the stages' memory paths (:meth:`StageModel.memory_path`, both paths with a host link, and no step),
    the least time ``T`` for the rank's slowest stage such that the stages' least peaks at time ``T`` or less
    sum within the limit (exact: a threshold search over the steps' times); then what room is left goes to
    the stages, slowest first, each taking the fastest step it can. A rank whose stages cannot fit together
    keeps ``fits``, as does one where this is not faster. Ranks of one stage keep theirs. ``fronts`` keeps
    each stage's choices (:func:`_front`) from call to call."""
    fits = list(fits)
    z = model.sizing
    cache = {} if fronts is None else fronts
    for rank in range(z.num_ranks):
        stages = z.stages_of(rank)
        if len(stages) < 2:
            continue
        fronts = {}
        for s in stages:
            key = (fits[s].start, fits[s].end, s)
            if key not in cache:
                cache[key] = _front(model, fits[s])
            fronts[s] = cache[key]

        def least(s: int, seconds: float) -> Choice | None:
            """The step of stage ``s`` with the least peak among those taking ``seconds`` or less."""
            within = [c for c in fronts[s] if c.time <= seconds]
            return within[-1] if within else None  # a front: later steps are slower and smaller

        def need(seconds: float) -> float:
            chosen = [least(s, seconds) for s in stages]
            return math.inf if None in chosen else sum(c.memory.total for c in chosen)

        times = sorted({c.time for s in stages for c in fronts[s]})
        lo, hi = 0, len(times)  # the first time whose need fits (hi: none)
        while lo < hi:
            middle = (lo + hi) // 2
            if need(times[middle]) <= limit:
                hi = middle
            else:
                lo = middle + 1
        if lo == len(times):
            continue
        chosen = {s: least(s, times[lo]) for s in stages}
        room = limit - sum(c.memory.total for c in chosen.values())
        for s in sorted(stages, key=lambda s: -chosen[s].time):
            faster = [c for c in fronts[s] if c.memory.total <= chosen[s].memory.total + room]
            room += chosen[s].memory.total - faster[0].memory.total
            chosen[s] = faster[0]
        mine = [fits[s] for s in stages]
        was_within = sum(f.memory.total for f in mine) <= limit
        if was_within and (max(f.time for f in mine), sum(f.time for f in mine)) <= \
                (max(c.time for c in chosen.values()), sum(c.time for c in chosen.values())):
            continue
        for s in stages:
            c = chosen[s]
            fits[s] = StageFit(fits[s].start, fits[s].end, s, c.recomputed, c.offloaded, c.time, c.memory, True)
    return fits


def _front(model: StageModel, fit: StageFit) -> list[Choice]:
    """Every choice a stage has (no step, and each step of its memory paths), fastest first, keeping only
    those smaller than every faster one."""
    a, b, s = fit.start, fit.end, fit.stage
    choices = [Choice((), (), model.memory(a, b, s), model.time(a, b))]
    if not model.sizing.recompute_all:
        for path in model._paths_of(a, b, s):
            path.extend_all()
            choices += path.steps
    front: list[Choice] = []
    for c in sorted(choices, key=lambda c: (c.time, c.memory.total)):
        if not front or c.memory.total < front[-1].memory.total:
            front.append(c)
    return front


def _weights_floor(model: StageModel, start: int, end: int, stage: int) -> int:
    """Bytes a stage holds whatever it recomputes or offloads, parameters and optimizer state only; it grows
    with the stage."""
    z = model.sizing
    per_param = z.versions[stage] + 1 + z.derived[stage] + z.buffers[stage]
    return per_param * model.params(start, end) + model.optimizer(start, end)


def _positions(num_nodes: int, allowed_cuts: Iterable[int] | None) -> list[int]:
    """Node indices where stages may start, with 0 first and ``num_nodes`` (the end) last."""
    if allowed_cuts is None:
        return list(range(num_nodes + 1))
    cuts = list(allowed_cuts)
    bad = [c for c in cuts if isinstance(c, bool) or not isinstance(c, numbers.Integral) or not 0 <= c < num_nodes]
    if bad:
        raise ValueError(f"allowed_cuts must be node indices in 0..{num_nodes - 1}, got {bad}")
    return [0, *sorted({int(c) for c in cuts} - {0}), num_nodes]


def _minimax(num_positions: int, num_stages: int, cost: Callable[[int, int, int], float],
             bound: Callable[[int, int, int], float]) -> tuple[float, list[int]]:
    """The least ``max_s cost(c_s, c_s+1, s)`` over position indices ``0 = c_0 < ... < c_P = num_positions - 1``,
    and those indices (exact). ``bound(u, v, s)`` is a lower bound of ``cost`` that grows as ``u`` falls: a
    stage's start stops moving back once it reaches the best so far. Ties go to the first minimum found."""
    last = num_positions - 1
    # best[p][v]: least largest cost of positions 0..v in p stages; back[p][v]: where the p-th stage starts
    # (-1: not reached yet; infinite costs still get a path, so that an infeasible optimum has cuts).
    best = [[math.inf] * num_positions for _ in range(num_stages + 1)]
    back = [[-1] * num_positions for _ in range(num_stages + 1)]
    best[0][0] = -math.inf
    for p in range(1, num_stages + 1):
        # Stage p-1 starts after the p-1 stages before it and leaves one position to each stage after it.
        for v in range(p, last - (num_stages - p) + 1):
            for u in range(v - 1, p - 2, -1) if p > 1 else (0,):
                if back[p][v] >= 0 and bound(u, v, p - 1) >= best[p][v]:
                    break
                value = max(best[p - 1][u], cost(u, v, p - 1))
                if value < best[p][v] or back[p][v] < 0:
                    best[p][v], back[p][v] = value, u
    cuts, v = [last], last
    for p in range(num_stages, 0, -1):
        v = back[p][v]
        cuts.append(v)
    return best[num_stages][last], cuts[::-1]


Key = tuple[float, int]  # (slowest stage's seconds, inf when a stage cannot fit; largest stage's bytes)


class _Halving:
    """The recursion of DawnPiper-style binary partitioning under a memory limit, over position indices (see
    :func:`partition`): the stage set and the node range split in halves."""

    def __init__(self, model: StageModel, positions: Sequence[int], memory_limit: float,
                 shares: Sequence[float] | None = None):
        self.model = model
        self.positions = positions
        self.limit = memory_limit
        # Per stage, its share of the limit (see _budget): 1 with one stage per rank.
        self.shares = tuple(shares) if shares is not None else (1.0,) * model.sizing.num_stages
        self.budgets = [_budget(memory_limit, c) for c in self.shares]
        z = model.sizing
        # Per stage, the bytes one parameter byte and one saved byte cost there.
        self._per_param = [z.versions[s] + 1 + z.derived[s] + z.buffers[s] for s in range(z.num_stages)]
        self._per_saved = list(z.in_flight)

    def _cut_range(self, u: int, v: int, s0: int, s1: int) -> tuple[int, int, int]:
        """Where stages ``s0..s1-1`` over ``[u, v]`` split (the first stage of the right half), and the
        lowest and highest cuts worth judging (lowest > highest: none)."""
        mid = s0 + (s1 - s0) // 2  # an odd count of stages: the right half gets one more, and nodes in proportion
        k_left, k_right = mid - s0, s1 - mid
        # Cuts where a side cannot fit whatever it recomputes are not judged: too long a left side (high
        # cuts) or right side (low cuts).
        lowest = _first(u + k_left, v - k_right + 1, lambda c: self._may_fit(c, v, mid, s1))
        highest = _first(u + k_left, v - k_right + 1, lambda c: not self._may_fit(u, c, s0, mid)) - 1
        return mid, lowest, highest

    def _memory_balanced(self, u: int, v: int, s0: int, mid: int, s1: int, lowest: int, highest: int) -> int:
        """The cut that balances memory per stage (estimated, see :meth:`_memory`)."""
        left, right = sum(self.shares[s0:mid]), sum(self.shares[mid:s1])  # the stage counts, for shares of 1
        return _balanced(lowest, highest, lambda c: self._memory(u, c, s0, mid) / left,
                         lambda c: self._memory(c, v, mid, s1) / right)

    def _may_fit(self, x: int, y: int, s0: int, s1: int) -> bool:
        """Whether stages ``s0..s1-1`` over positions ``[x, y]`` may fit the limit: each holds its
        parameters and their optimizer state ``mult_s * params_s + opt_s <= limit * c_s`` whatever it
        recomputes (with ``mult_s`` the copies of its weights, ``c_s`` its share of the limit, 1 with one
        stage per rank), so ``params + opt / max(mult) <= limit * sum c_s/mult_s`` and
        ``opt <= limit * sum c_s``. Once false for a range, false for every range holding it."""
        a, b, m, limit = self.positions[x], self.positions[y], self.model, self.limit
        per_param, shares = self._per_param[s0:s1], self.shares[s0:s1]
        params, optimizer = m.params(a, b), m.optimizer(a, b)
        return params + optimizer / max(per_param) <= limit * sum(c / w for c, w in zip(shares, per_param)) and \
            optimizer <= limit * sum(shares)

    def _memory(self, x: int, y: int, s0: int, s1: int) -> float:
        """Estimated bytes of nodes ``[x, y)`` spread over stages ``s0..s1-1``, at those stages' average
        multipliers; boundary buffers left out."""
        a, b, m = self.positions[x], self.positions[y], self.model
        n = s1 - s0
        per_param, per_saved = sum(self._per_param[s0:s1]) / n, sum(self._per_saved[s0:s1]) / n
        return per_param * m.params(a, b) + m.optimizer(a, b) + per_saved * m.saved(a, b)


class _BinarySearch(_Halving):
    """The fastest partition under the limit that the recursion can express (see :func:`partition`)."""

    def __init__(self, model: StageModel, positions: Sequence[int], memory_limit: float,
                 shares: Sequence[float] | None = None):
        super().__init__(model, positions, memory_limit, shares)
        self._solved: dict[tuple[int, int, int, int], tuple[Key, list[int]]] = {}

    def leaf(self, u: int, v: int, s: int) -> Key:
        fit = self.model.fit(self.positions[u], self.positions[v], s, self.budgets[s])
        return (fit.time if fit.fits else math.inf, fit.memory.total)

    def solve(self, u: int, v: int, s0: int, s1: int) -> tuple[Key, list[int]]:
        """The best key and position cuts (``u`` first, ``v`` last) for stages ``s0..s1-1`` over ``[u, v]``."""
        memo = (u, v, s0, s1)
        if memo not in self._solved:
            self._solved[memo] = (self.leaf(u, v, s0), [u, v]) if s1 - s0 == 1 else self._split(u, v, s0, s1)
        return self._solved[memo]

    def _split(self, u: int, v: int, s0: int, s1: int) -> tuple[Key, list[int]]:
        mid, lowest, highest = self._cut_range(u, v, s0, s1)
        if lowest > highest:
            return (math.inf, 0), [*range(u, u + s1 - s0), v]
        k_left, k_right = mid - s0, s1 - mid

        def share(x: int, y: int, k: int) -> float:
            return self.model.time(self.positions[x], self.positions[y]) / k

        # The reduced search space: between the cut that balances compute per stage (where the lower bound
        # below is least, too) and the cut that balances memory per stage.
        c_time = _balanced(lowest, highest, lambda c: share(u, c, k_left), lambda c: share(c, v, k_right))
        c_memory = self._memory_balanced(u, v, s0, mid, s1, lowest, highest)
        lo, hi = min(c_time, c_memory), max(c_time, c_memory)
        best = min((self._judge(u, v, s0, mid, s1, c), c) for c in range(lo, hi + 1))
        # Widening: the next cut outside on either side is judged while a lower bound of its slowest stage
        # (each side's share of the compute; recomputation and offload only add time) beats the best so far,
        # the side with the lower bound first; the bound only grows outwards. Every cut that could be better
        # is judged, so the search is as exact as its sides, yet few outside cuts usually are.
        below, above = lo - 1, hi + 1
        while below >= lowest or above <= highest:
            bound_below = max(share(u, below, k_left), share(below, v, k_right)) if below >= lowest else math.inf
            bound_above = max(share(u, above, k_left), share(above, v, k_right)) if above <= highest else math.inf
            if min(bound_below, bound_above) >= best[0][0]:
                break
            if bound_below <= bound_above:
                c, below = below, below - 1
            else:
                c, above = above, above + 1
            best = min(best, (self._judge(u, v, s0, mid, s1, c), c))
        key, c = best
        return key, self.solve(u, c, s0, mid)[1][:-1] + self.solve(c, v, mid, s1)[1]

    def _judge(self, u: int, v: int, s0: int, mid: int, s1: int, c: int) -> Key:
        left, right = self.solve(u, c, s0, mid)[0], self.solve(c, v, mid, s1)[0]
        return (max(left[0], right[0]), max(left[1], right[1]))


class _FitSearch(_Halving):
    """Some partition that fits the limit, or None when none does: the recursion of :class:`_BinarySearch`
    asking only whether each side fits (not how fast), so it stops at the first cut where both do, trying
    cuts from the memory-balanced one outwards. It judges every cut worth judging before it answers None,
    and any partition can be expressed by the recursion, so None means that no partition fits."""

    def __init__(self, model: StageModel, positions: Sequence[int], memory_limit: float,
                 shares: Sequence[float] | None = None):
        super().__init__(model, positions, memory_limit, shares)
        self._solved: dict[tuple[int, int, int, int], list[int] | None] = {}

    def solve(self, u: int, v: int, s0: int, s1: int) -> list[int] | None:
        """Position cuts (``u`` first, ``v`` last) of stages ``s0..s1-1`` over ``[u, v]`` that fit, or None."""
        memo = (u, v, s0, s1)
        if memo not in self._solved:
            if s1 - s0 == 1:
                fits = self.model.fit(self.positions[u], self.positions[v], s0, self.budgets[s0]).fits
                self._solved[memo] = [u, v] if fits else None
            else:
                self._solved[memo] = self._split(u, v, s0, s1)
        return self._solved[memo]

    def _split(self, u: int, v: int, s0: int, s1: int) -> list[int] | None:
        mid, lowest, highest = self._cut_range(u, v, s0, s1)
        if lowest > highest:
            return None
        balanced = self._memory_balanced(u, v, s0, mid, s1, lowest, highest)
        for c in sorted(range(lowest, highest + 1), key=lambda c: (abs(c - balanced), c)):
            left = self.solve(u, c, s0, mid)
            right = self.solve(c, v, mid, s1) if left is not None else None
            if right is not None:
                return left[:-1] + right
        return None


def _first(lo: int, hi: int, holds: Callable[[int], bool]) -> int:
    """The first ``c`` in ``[lo, hi)`` where ``holds`` (false, then true) holds, ``hi`` if nowhere."""
    while lo < hi:
        middle = (lo + hi) // 2
        if holds(middle):
            hi = middle
        else:
            lo = middle + 1
    return lo


def _balanced(lowest: int, highest: int, left: Callable[[int], float], right: Callable[[int], float]) -> int:
    """The cut in ``[lowest, highest]`` where ``max(left(c), right(c))`` is least, for ``left`` growing and
    ``right`` shrinking with ``c``: where the left side reaches the right one, or just before."""
    c = _first(lowest, highest, lambda x: left(x) >= right(x))
    if c > lowest and max(left(c - 1), right(c - 1)) < max(left(c), right(c)):
        return c - 1
    return c


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


def format_bytes(n: float) -> str:
    """Bytes as a short text in binary units (``"512 B"``, ``"1.50 MiB"``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
