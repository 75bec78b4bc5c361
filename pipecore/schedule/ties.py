"""When the stages that share a tied weight exchange its gradients, as dependencies between actions.

A tied weight (a language model's token embedding and output head) is one logical weight held by
several stages. Every owner applies the same gradient at the same update: the sum of all owners'
gradients of one update group. Update ``t`` of a schedule (which produces version ``t`` counted from the
schedule's start) normally consumes the gradients of update group ``t - 1``; for the tied weight it
consumes group ``t - 1 - delay``, and it waits for every other owner's backward that completes that group.

Synchronous schedules run every backward of a mini-batch before any update, so ``delay = 0`` and training
equals the sequential model. Asynchronous schedules update the last stage long before the first stage has
run the backward of the same micro-batches; waiting for it would stop the pipeline from returning the
mini-batch's loss, so the tied weight's gradient is applied ``delay`` updates late, the smallest delay with
which every step completes (:func:`smallest_delay`). The last update of a drained (flushed) schedule
consumes every group still pending, so after ``flush()`` nothing is left over.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from .ir import Action, B, F, Kind, U, W
from .progress import positions, runnable
from .schedule import Schedule


@dataclass(frozen=True)
class TieSync:
    """The tie dependencies of one schedule: ``partners[s]`` are the other stages ``s`` shares a tied weight
    with; updates consume the tied gradients of group ``t - 1 - delay``; ``drain_last[s]``, while a flush
    drains the schedule, is the index of stage ``s``'s last update, which consumes every pending group."""

    partners: Mapping[int, tuple[int, ...]]
    update_every: int
    delay: int = 0
    drain_last: Mapping[int, int] = field(default_factory=dict)
    #: The schedule splits backwards: a micro-batch's gradients are complete after its W, not its B.
    weight_actions: bool = False

    def group_applied(self, stage: int, update: int) -> int:
        """The last tied-gradient group (counted from the schedule's start) consumed by update ``update``."""
        return update - 1 if self.drain_last.get(stage) == update else update - 1 - self.delay

    def needs(self, action: Action) -> list[tuple[int, Kind, int]]:
        """For an update of an owner: the partners' backwards that complete the group it consumes."""
        if action.kind is not U or action.stage not in self.partners:
            return []
        group = self.group_applied(action.stage, action.index)
        if group < 0:
            return []
        last = (group + 1) * self.update_every - 1
        completes = W if self.weight_actions else B
        return [(b, completes, last) for b in self.partners[action.stage]]

    def draining(self, schedule: Schedule) -> "TieSync":
        """The same dependencies while ``schedule`` (a finite, drained one) runs to its end."""
        last = {}
        for s in self.partners:
            updates = [a.index for a in schedule.stages[s] if a.kind is U]
            if updates:
                last[s] = updates[-1]
        return replace(self, drain_last=last)


def partners_of(owners: Sequence[Sequence[int]]) -> dict[int, tuple[int, ...]]:
    """Per stage, the other stages it shares at least one tied weight with (``owners``: one list per tie)."""
    out: dict[int, set[int]] = {}
    for group in owners:
        for s in group:
            out.setdefault(s, set()).update(o for o in group if o != s)
    return {s: tuple(sorted(o)) for s, o in sorted(out.items()) if o}


def smallest_delay(algorithm, partners: Mapping[int, tuple[int, ...]], max_delay: int | None = None) -> int:
    """The smallest tied-gradient delay with which every ``step()`` returns its loss and every ``flush()``
    drains, for ``algorithm``'s schedules (checked symbolically on a few mini-batches past the warm-up)."""
    P, m = algorithm.num_stages, algorithm.n_microbatches
    horizon = algorithm.warmup_minibatches + 3
    limit = max_delay if max_delay is not None else 2 * P * m + 2
    long = algorithm.schedule(horizon)
    index = positions(long)
    split = long.splits_backward(0)
    for delay in range(limit + 1):
        sync = TieSync(partners, algorithm.update_every, delay, weight_actions=split)
        if _completes(algorithm, long, index, sync, horizon, P, m):
            return delay
    raise ValueError(f"{algorithm.name}: no delay up to {limit} updates lets the owners of tied weights "
                     f"(stages {sorted(partners)}) exchange gradients without stalling the pipeline")


def _completes(algorithm, long: Schedule, index, sync: TieSync, horizon: int, P: int, m: int) -> bool:
    for fed in range(1, horizon + 1):
        cursors = [0] * P
        for j in range(fed):
            cursors = runnable(long, cursors, (j + 1) * m, index, sync.needs)
            loss = index.get((P - 1, F, (j + 1) * m - 1))
            if loss is None or loss >= cursors[P - 1]:
                return False
        drained = algorithm.schedule(fed)
        done = runnable(drained, cursors, None, positions(drained), sync.draining(drained).needs)
        if any(c < len(row) for c, row in zip(done, drained.stages)):
            return False
    return True
