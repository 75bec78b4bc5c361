"""Several stages per rank: which splits of a rank's limit into stage budgets the partitioner judges, the
search over them for the best partition, and each rank's limit shared afresh among its stages for the cuts
found (see :func:`~pipecore.planning.partitioners.partition` and :mod:`~pipecore.planning.rank_budgets`).
"""

from __future__ import annotations

import math
from typing import Sequence

from .cut_search import smallest_limit, stage_cuts
from .memory import Choice, StageFit, StageModel
from .rank_budgets import equal_shares, proportional_shares, rank_sums, stage_budget

# Splits partition() judges at most, the ones it always tries included; and refinements of the smallest limit.
_SPLITS = 6
_REFINEMENTS = 3
# Cut moves the local search judges at most (see SplitSearch.move_cuts).
_MOVES = 400


def share_candidates(model: StageModel, num_stages: int) -> list[tuple[float, ...]]:
    """The splits of a rank's limit among its stages that :func:`~pipecore.planning.partitioners.partition`
    always tries: one (every share 1) with one stage per rank; else the even split, then the split by each
    stage's estimated peak were every stage to take an equal part of the graph (its weight copies and
    optimizer state, and its micro-batches in flight times the saved bytes: a V's first stage holds more
    micro-batches than the last, on one rank)."""
    placement = model.sizing.placement
    equal = equal_shares(placement)
    if model.sizing.num_ranks == num_stages:
        return [equal]
    z, n = model.sizing, model.num_nodes
    params, optimizer = model.params(0, n) / num_stages, model.optimizer(0, n) / num_stages
    saved = (model.saved(0, n) + model.costs.loss_saved_bytes) / num_stages
    crossing = sum(model.crossing(c) for c in range(n + 1)) / max(1, n) * 2
    estimate = [(z.versions[s] + 1 + z.derived[s] + z.buffers[s]) * params + optimizer
                + z.in_flight[s] * (0 if z.recompute_all else saved + crossing) for s in range(num_stages)]
    estimated = proportional_shares(placement, estimate)
    return [equal] if estimated is None or estimated == equal else [equal, estimated]


def smallest_split(model: StageModel, positions: Sequence[int], num_stages: int,
                   objective: str) -> tuple[int, tuple[float, ...]]:
    """The smallest limit under which some partition has every stage within its budget for some split of the
    rank's limit that the planner tries, and that split (with one stage per rank: the smallest limit, and
    every share 1). The splits: :func:`share_candidates`, then, from the one with the smallest limit, the
    split by the least peaks its partition's stages reach (its cuts then fit any limit their ranks' sums of
    least peaks fit, so the smallest limit never grows), while that lowers the limit."""
    placement = model.sizing.placement
    found = [(*smallest_limit(model, positions, num_stages, objective, shares), shares)
             for shares in share_candidates(model, num_stages)]
    limit, cuts, shares = min(found, key=lambda item: item[0])
    if model.sizing.num_ranks == num_stages:
        return limit, shares
    for _ in range(_REFINEMENTS):
        least = [model.smallest_memory(positions[u], positions[v], s, objective == "memory")
                 for s, (u, v) in enumerate(zip(cuts, cuts[1:]))]
        refined = proportional_shares(placement, least)
        if refined is None or refined == shares:
            break
        refined_limit, refined_cuts = smallest_limit(model, positions, num_stages, objective, refined)
        if refined_limit >= limit:
            break
        limit, cuts, shares = refined_limit, refined_cuts, refined
    return limit, shares


class SplitSearch:
    """The best partition over the splits of the limit judged so far (see
    :func:`~pipecore.planning.partitioners.partition`): within the limit on every rank (with one stage per
    rank: every stage within its limit), then the slowest stage's time least, then the fullest rank's bytes;
    while none is within the limit, the one whose fullest rank is least over it."""

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
        cuts = stage_cuts(m, positions, self.num_stages, self.objective, limit, shares)
        fits = [m.fit(positions[u], positions[v], s, stage_budget(limit, shares[s]), self.trade_time)
                for s, (u, v) in enumerate(zip(cuts, cuts[1:]))]
        return self._keep(fits)

    def _keep(self, fits: list[StageFit]) -> bool:
        """Share each rank's limit among its stages afresh (:func:`allocate_ranks`), and keep the partition if
        it is the best so far (True)."""
        m, limit = self.model, self.limit
        if self.trade_time and self.several:
            fits = allocate_ranks(m, fits, limit, self._fronts)
        fullest = max(rank_sums([f.memory.total for f in fits], m.sizing.placement))
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
        (:func:`allocate_ranks`); the best move is kept, and the cuts are gone over again until none moves,
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
        shares = proportional_shares(m.sizing.placement, weights)
        if shares is None or shares in self.tried:
            return False
        self.judge(shares)
        return True


def allocate_ranks(model: StageModel, fits: list[StageFit], limit: float,
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
        for path in model.memory_paths(a, b, s):
            path.extend_all()
            choices += path.steps
    front: list[Choice] = []
    for c in sorted(choices, key=lambda c: (c.time, c.memory.total)):
        if not front or c.memory.total < front[-1].memory.total:
            front.append(c)
    return front
