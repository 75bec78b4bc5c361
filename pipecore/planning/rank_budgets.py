"""Several stages per rank: the arithmetic of a rank's memory limit split into per-stage budgets.

The partitioners judge a stage alone (StageModel.fit under a limit) and recurse over contiguous ranges of
stages, memoised; a rank's limit bounds a sum over stages that are not contiguous (looped: s, s+R, ...; V:
r and 2R-1-r), which would couple the memoised halves. Rather than a new search, the rank's limit is split
into budgets, shares of it that sum to 1 over the rank's stages: a partition with every stage within its
budget has every rank within the limit. Which split is best depends on the cuts, so
:func:`~pipecore.planning.partitioners.partition` tries a few and keeps the fastest;
:func:`~pipecore.planning.rank_split.allocate_ranks` then shares each rank's limit among its stages for the
cuts found (exactly), and a local search over the cuts judges partitions that way. With one stage per rank
every share is 1 and the budget is the limit itself: the partitioners do exactly what they did before.
"""

from __future__ import annotations

import math
from typing import Sequence


def stage_budget(limit: float | None, share: float) -> float | None:
    """Stage budget: ``share`` of the rank's ``limit`` (the limit itself, exactly, for a share of 1)."""
    if limit is None or share == 1:
        return limit
    return limit * share


def least_limit(nbytes: float, share: float) -> float:
    """The smallest integer limit whose budget for ``share`` holds ``nbytes`` (``nbytes`` for a share of 1)."""
    if share == 1 or nbytes in (math.inf, -math.inf):
        return nbytes
    limit = math.ceil(nbytes / share)
    while nbytes > limit * share:  # float rounding, either way
        limit += 1
    while limit > 0 and nbytes <= (limit - 1) * share:
        limit -= 1
    return limit


def rank_sums(values: Sequence[float], placement: Sequence[int]) -> tuple:
    """Per rank, the sum of its stages' ``values``."""
    sums = [0] * (max(placement) + 1)
    for value, rank in zip(values, placement):
        sums[rank] += value
    return tuple(sums)


def equal_shares(placement: Sequence[int]) -> tuple[float, ...]:
    """Each stage's share of its rank's limit when the rank splits it evenly (1 with one stage per rank)."""
    count = [0] * (max(placement) + 1)
    for rank in placement:
        count[rank] += 1
    return tuple(1.0 if count[r] == 1 else 1 / count[r] for r in placement)


def proportional_shares(placement: Sequence[int], weights: Sequence[float]) -> tuple[float, ...] | None:
    """Shares proportional to ``weights`` within each rank (None when a rank's weights are not all positive)."""
    sums = rank_sums(weights, placement)
    if any(w <= 0 or not math.isfinite(w) for w in weights):
        return None
    return tuple(1.0 if w == sums[r] else w / sums[r] for w, r in zip(weights, placement))
