"""Where the cuts go for one split of the memory limit (each stage within its budget): dynamic programming
by parameters and by time (PipeDream's planner), and DawnPiper-style binary partitioning for memory; and the
smallest limit under which they find cuts. :func:`~pipecore.planning.partitioners.partition` describes the
method.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from .memory import StageModel
from .rank_budgets import least_limit, stage_budget


def balanced_by_parameters(sizes: Sequence[int], num_stages: int) -> list[int]:
    """Split points (start index of stages 1..P-1) minimising the largest stage's parameter count.

    Ties are broken towards earlier, more even layer counts. Every stage gets at least one layer.
    """
    n = len(sizes)
    prefix = [0]
    for x in sizes:
        prefix.append(prefix[-1] + x)
    inf = float("inf")
    # best[p][i]: minimal max-stage size for the first i layers in p stages; cut[p][i]: where stage p starts.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for p in range(1, num_stages + 1):
        for i in range(p, n + 1):
            for j in range(p - 1, i):
                cost = max(best[p - 1][j], prefix[i] - prefix[j])
                if cost < best[p][i]:
                    best[p][i], cut[p][i] = cost, j
    splits, i = [], n
    for p in range(num_stages, 0, -1):
        i = cut[p][i]
        splits.append(i)
    return sorted(splits)[1:]


def stage_cuts(model: StageModel, positions: Sequence[int], num_stages: int, objective: str,
               memory_limit: float | None, shares: Sequence[float]) -> list[int]:
    """Position indices of the stage boundaries (0 first, the last position last) for ``objective``, stage
    ``s`` within ``stage_budget(memory_limit, shares[s])``."""
    last = len(positions) - 1
    if objective == "parameters":
        units = [model.params(a, b) for a, b in zip(positions, positions[1:])]
        return [0, *balanced_by_parameters(units, num_stages), last]
    if objective == "time":
        budgets = [stage_budget(memory_limit, c) for c in shares]

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


def smallest_limit(model: StageModel, positions: Sequence[int], num_stages: int, objective: str,
                   shares: Sequence[float]) -> tuple[int, list[int]]:
    """The smallest limit ``L`` under which some partition has every stage ``s`` within
    ``stage_budget(L, shares[s])`` (see :func:`~pipecore.planning.partitioners.smallest_memory_limit`), and
    that partition's position cuts: each stage's bytes are measured as the limit they need
    (:func:`~pipecore.planning.rank_budgets.least_limit`; themselves with one stage per rank)."""
    last = len(positions) - 1
    if objective == "parameters":
        cuts = stage_cuts(model, positions, num_stages, objective, None, shares)
        return max(least_limit(model.memory(positions[u], positions[v], s).total, shares[s])
                   for s, (u, v) in enumerate(zip(cuts, cuts[1:]))), cuts

    def weights(u: int, v: int, s: int) -> float:
        return least_limit(_weights_floor(model, positions[u], positions[v], s), shares[s])

    # Without recomputation or offload: the least largest stage peak, exactly.
    least, best_cuts = _minimax(
        len(positions), num_stages,
        lambda u, v, s: least_limit(model.memory(positions[u], positions[v], s).total, shares[s]), weights)
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
            feasible = max(least_limit(model.smallest_memory(positions[u], positions[v], s), shares[s])
                           for s, (u, v) in enumerate(zip(cuts, cuts[1:])))
            best_cuts = cuts
    return feasible, best_cuts


def _weights_floor(model: StageModel, start: int, end: int, stage: int) -> int:
    """Bytes a stage holds whatever it recomputes or offloads, parameters and optimizer state only; it grows
    with the stage."""
    z = model.sizing
    per_param = z.versions[stage] + 1 + z.derived[stage] + z.buffers[stage]
    return per_param * model.params(start, end) + model.optimizer(start, end)


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
    :func:`~pipecore.planning.partitioners.partition`): the stage set and the node range split in halves."""

    def __init__(self, model: StageModel, positions: Sequence[int], memory_limit: float,
                 shares: Sequence[float] | None = None):
        self.model = model
        self.positions = positions
        self.limit = memory_limit
        # Per stage, its share of the limit (see stage_budget): 1 with one stage per rank.
        self.shares = tuple(shares) if shares is not None else (1.0,) * model.sizing.num_stages
        self.budgets = [stage_budget(memory_limit, c) for c in self.shares]
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
    """The fastest partition under the limit that the recursion can express (see
    :func:`~pipecore.planning.partitioners.partition`)."""

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
