"""One stage's share of tied weights: posting its gradients, applying the owners' sum before an update.

Each owner of a tied weight holds a copy in its own flat buffer. After the backward that completes an
update group, the owner posts its gradient of every tied weight; before an update it replaces its own
gradient with the sum of all owners' gradients of the group the :class:`~pipecore.schedule.ties.TieSync`
says that update consumes (added in stage order, so every owner gets the same bits). Same gradients, same
optimizer, same updates: the copies stay bit-identical.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Collection, Mapping

import torch

from ..schedule.ties import TieSync

if TYPE_CHECKING:
    from ..runtime.ties import TiedGradients


class StageTies:
    """The tied weights of one stage: ``views`` maps a tie's name to its slice of the stage's gradient buffer;
    ``owners`` maps it to the stages holding a copy (this one included)."""

    def __init__(self, stage: int, views: Mapping[str, torch.Tensor], exchange: "TiedGradients", sync: TieSync,
                 owners: Mapping[str, tuple[int, ...]] | None = None):
        self.stage = stage
        self.views = dict(views)
        self.owners = {name: tuple(owners[name]) if owners else (stage,) for name in self.views}
        self.exchange = exchange
        self.sync = sync
        self._backwarded = 0   # micro-batches backwarded since the schedule started
        self._posted = 0       # groups posted, counted from construction (or the last load)
        self._applied = 0      # groups consumed by updates, counted the same way
        self._base = 0         # self._applied when the schedule started

    def ranges(self, buffer: torch.Tensor) -> list[tuple[int, int, str, tuple[int, ...]]]:
        """``(start, stop, name, owners)`` of each tied weight inside the flat buffer its views slice (in
        order)."""
        base = buffer.storage_offset()
        spans = [(v.storage_offset() - base, v.storage_offset() - base + v.numel(), name, self.owners[name])
                 for name, v in self.views.items()]
        return sorted(spans)

    def lr_scales(self, buffer: torch.Tensor, own: float,
                  owner_scale: Callable[[int], float]) -> list[tuple[int, int, float]]:
        """The learning-rate scale of each range of the flat ``buffer``: the stage's ``own``, except that a tied
        weight takes the smallest ``owner_scale(owner)`` among its owners at this update (the one of the longest
        delay), so that every copy takes the same step and the copies stay identical under per-stage scaling."""
        n = buffer.numel()
        scales, position = [], 0
        for start, stop, _, owners in self.ranges(buffer):
            shared = min(owner_scale(owner) for owner in owners)
            if shared == own:
                continue
            if start > position:
                scales.append((position, start, own))
            scales.append((start, stop, shared))
            position = stop
        if position < n:
            scales.append((position, n, own))
        return scales

    def restart(self, sync: TieSync) -> None:
        """A new schedule starts (after a flush, which consumed every group)."""
        self.sync = sync
        self._backwarded = 0
        self._base = self._applied

    def reset(self) -> None:
        """Forget the counts (after loading a checkpoint; nothing is pending then)."""
        self._backwarded = self._posted = self._applied = self._base = 0

    def counts(self) -> tuple[int, int]:
        """The groups posted and applied so far, for :meth:`undo`."""
        return self._posted, self._applied

    def group_of(self, microbatch: int) -> int:
        """The update group that micro-batch ``microbatch`` (counted from the schedule's start) belongs to,
        numbered as this stage posts its groups: from construction (or the last load), one per update group
        of micro-batches backwarded, alike on every owner."""
        every = self.sync.update_every
        return self._posted - self._backwarded // every + microbatch // every

    def undo(self, backwarded: int, applied: int | None) -> None:
        """Go back to ``backwarded`` micro-batches backwarded since the schedule started and (if not None)
        ``applied`` groups applied: the later posts are withdrawn and the later reductions given back."""
        every = self.sync.update_every
        posted = self._posted - self._backwarded // every + backwarded // every
        if applied is not None and applied < self._applied:
            self.exchange.unreduce(self.stage, range(applied, self._applied))
            self._applied = applied
        self.exchange.withdraw(self.stage, posted)
        self._backwarded, self._posted = backwarded, posted

    def after_backward(self, microbatches: int) -> None:
        """Post this stage's tied gradients when the backward completed an update group."""
        before = self._backwarded // self.sync.update_every
        self._backwarded += microbatches
        for _ in range(self._backwarded // self.sync.update_every - before):
            self.exchange.post(self.stage, self._posted, {name: v.detach().clone() for name, v in self.views.items()})
            self._posted += 1

    def gather(self, update: int, poisoned: Collection[int]) -> dict[str, torch.Tensor]:
        """The owners' summed gradients that update ``update`` applies (waiting for the other owners' parts):
        zero while the first groups are still in flight, several groups' sum at a drain's last update. A
        group with a non-finite loss (``poisoned``, counted from the schedule's start) contributes nothing.
        Changes nothing in the stage; :meth:`write` puts the sums into its gradient buffer."""
        last = self._base + self.sync.group_applied(self.stage, update)
        total = {name: torch.zeros_like(v) for name, v in self.views.items()}
        while self._applied <= last:
            reduced = self.exchange.reduce(self.stage, self._applied)
            if self._applied - self._base not in poisoned:
                for name, grad in reduced.items():
                    total[name] += grad
            self._applied += 1
        return total

    def write(self, total: dict[str, torch.Tensor]) -> None:
        """Replace this stage's gradients of its tied weights with the owners' sums (:meth:`gather`)."""
        for name, view in self.views.items():
            view.copy_(total[name])
