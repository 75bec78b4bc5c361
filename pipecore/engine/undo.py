"""Taking a stage back to before the newest mini-batch, when a step fails (``Pipeline`` recovery).

A failed action leaves its mini-batch half done: some stages ran its forwards, backwards, even its
updates. The pipeline undoes that mini-batch and every later one, and completes the earlier ones still in
flight, as ``flush()`` would have done in place of the failed mini-batch. At every step each stage gets an
:class:`UndoPoint`: the first micro-batch of the new mini-batch, the version book's newest tag and copies of
the module's buffers (its forwards update BatchNorm statistics); before the stage's first update of that
mini-batch it also keeps a :class:`StageSnapshot` of its optimizer state, and of its weights once the ring
is about to lose them (an update in place, or a later update reusing their slot: algorithms that keep the
previous version write the next one elsewhere, and most snapshots are dropped first). The point is dropped
once the mini-batch is complete on every stage. Earlier mini-batches' actions at a stage all come before the
later one's updates (each stage runs its backwards and updates in micro-batch order), so going back to the
snapshot undoes only the later mini-batches.

The memory this costs: a copy of each stage's optimizer state, and of its live weights, per mini-batch that
has updated the stage and is not complete everywhere (one or two: asynchronous schedules keep about one
mini-batch in flight), and a copy of its buffers per step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from ..algorithms.base import Algorithm
from ..schedule.ir import Action, Kind, U
from ..schedule.progress import positions, runnable

if TYPE_CHECKING:
    from .stage import TensorStage


class Unrecoverable(RuntimeError):
    """A failed step cannot be undone; the pipeline cannot continue."""


@dataclass
class StageSnapshot:
    """A stage's state before its first update of the mini-batch being undone."""

    update: int  # the update it was taken before (its index in the schedule)
    live: int  # the live version then: the ring holds it until a slot write replaces it (see keep_weights)
    updates: int
    weights: torch.Tensor | None  # version ``live``, copied only when its ring slot was about to be written
    grad: torch.Tensor | None  # kept when the update it precedes belongs to an earlier mini-batch (see of)
    grad_span: tuple[int, int] | None
    optimizer: dict[str, Any]
    lr: float
    velocity: torch.Tensor | None
    ties: tuple[int, int] | None  # the tied-gradient groups posted and applied
    spare_weights: torch.Tensor | None = None  # a pooled snapshot's buffer for the weights, until they are kept

    @classmethod
    def of(cls, stage: "TensorStage", update: int, with_grad: bool) -> "StageSnapshot":
        """The stage's state now, copied into the buffers of a snapshot it no longer needs if it has one (a
        step's copies then cost no allocation: fresh pages of a large tensor cost more than the copy). The
        weights stay in the ring until :meth:`keep_weights`."""
        spare = stage.snapshot_pool.pop() if stage.snapshot_pool else None
        ties = stage.ties
        return cls(
            update, stage.book.live, stage.book.updates, None,
            _copy(stage.grad, spare and spare.grad) if with_grad else None, stage.grad_span,
            _copy_state(stage.optimizer.state_dict(), spare and spare.optimizer), stage.optimizer.lr,
            None if stage.velocity is None else _copy(stage.velocity, spare and spare.velocity),
            None if ties is None else ties.counts(),
            spare_weights=spare and (spare.weights if spare.weights is not None else spare.spare_weights),
        )

    def keep_weights(self, slot: torch.Tensor) -> None:
        """Copy version ``live`` out of ``slot``, the ring slot holding it, which is about to be written."""
        if self.weights is None:
            self.weights = _copy(slot, self.spare_weights)
            self.spare_weights = None


def slot_for_update(stage: "TensorStage", in_place: bool) -> int:
    """The ring slot ``stage``'s next update writes: the live one (``in_place``) or a newly acquired one, once
    every undo snapshot of the version it holds has copied it (acquiring a slot forgets its version, so the
    slots are looked up before)."""
    waiting = {id(p.snapshot): p.snapshot for p in stage.undo_points
               if p.snapshot is not None and p.snapshot.weights is None}.values()
    held = [(snapshot, stage.ring.find(snapshot.live)) for snapshot in waiting]
    slot = stage.ring.live_slot if in_place else stage.ring.acquire()
    for snapshot, where in held:
        if where == slot:
            snapshot.keep_weights(stage.ring.slot(slot))
    return slot


def release(stage: "TensorStage", points: Sequence["UndoPoint"], kept: Sequence["UndoPoint"] = ()) -> None:
    """Give the snapshots of ``points`` that none of ``kept`` shares back to ``stage``, for reuse."""
    keep = {id(p.snapshot) for p in kept}
    for snapshot in {id(p.snapshot): p.snapshot for p in points if p.snapshot is not None}.values():
        if id(snapshot) not in keep and len(stage.snapshot_pool) < _POOL:
            stage.snapshot_pool.append(snapshot)


_POOL = 2  # spare snapshots a stage keeps (one mini-batch in flight, or two)


def _copy(source: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
    if into is not None and (into.shape, into.dtype, into.device) == (source.shape, source.dtype, source.device):
        return into.copy_(source)
    return source.clone()


_IMMUTABLE = (int, float, bool, str, bytes)


def _copy_state(source: Any, into: Any) -> Any:
    """A copy of an optimizer's state (nested dicts and lists of tensors and plain values), into ``into``'s
    tensors where they match."""
    if source is None or type(source) in _IMMUTABLE:  # a step count, a flag: nothing to copy (once per update)
        return source
    if isinstance(source, torch.Tensor):
        return _copy(source, into if isinstance(into, torch.Tensor) else None)
    if isinstance(source, dict):
        return {k: _copy_state(v, into.get(k) if isinstance(into, dict) else None) for k, v in source.items()}
    if isinstance(source, (list, tuple)):
        parts = into if isinstance(into, (list, tuple)) and len(into) == len(source) else [None] * len(source)
        return type(source)(_copy_state(v, i) for v, i in zip(source, parts))
    return copy.deepcopy(source)


@dataclass
class UndoPoint:
    """Where a stage goes back to if the mini-batch starting at micro-batch ``first`` fails."""

    first: int
    latest_tag: int | None
    buffers: list[tuple[torch.nn.Module, str, torch.Tensor]]  # module, buffer name, copy
    snapshot: StageSnapshot | None = field(default=None)

    @classmethod
    def at(cls, stage: "TensorStage", first: int) -> "UndoPoint":
        buffers = [(m, name, b.detach().clone()) for m in stage.modules_with_buffers
                   for name, b in m._buffers.items() if b is not None]
        return cls(first, stage.book.latest_tag, buffers)


def undo(stage: "TensorStage", point: UndoPoint) -> None:
    """Take ``stage`` back to ``point``: forget the forwards, backwards and updates of micro-batch
    ``point.first`` and later; earlier micro-batches stay in flight. The stage keeps no undo point after."""
    first, snap = point.first, point.snapshot
    span = stage.grad_span
    if snap is None and span is not None and span[1] >= first and span[0] < first:
        raise Unrecoverable(f"stage {stage.stage}: its gradient buffer holds micro-batches {span[0]}..{span[1]} of "
                            f"an update group that straddles the failed mini-batch")
    for k in [k for k in stage.in_flight if k >= first]:
        del stage.in_flight[k]
    stage.memory.forget(first)
    for table in (stage.losses, stage._unread_losses):
        for k in [k for k in table if k >= first]:
            del table[k]
    every = stage.algorithm.update_every
    stage.poisoned_groups = {g for g in stage.poisoned_groups if g * every < first}
    waiting = sum(1 for k in stage._deferred if k < first)  # backwarded, their weight gradients still to come
    stage._deferred = {k: d for k, d in stage._deferred.items() if k < first}
    live, updates = (stage.book.live, stage.book.updates) if snap is None else (snap.live, snap.updates)
    stage.book.discard(first, live, updates, point.latest_tag)
    stage.sync_ring()  # unpins the versions only the discarded micro-batches held
    if snap is not None:
        if not stage.ring.rewind(snap.live):
            if snap.weights is None:
                raise Unrecoverable(f"stage {stage.stage}: weight version {snap.live} is neither in the ring nor "
                                    "copied by its undo snapshot")
            slot = stage.ring.acquire()
            stage.ring.slot(slot).copy_(snap.weights)
            stage.ring.publish(slot, snap.live)
        stage.sync_ring()
        stage.optimizer.load_state_dict(snap.optimizer)
        stage.optimizer.set_lr(snap.lr)
        if snap.velocity is not None:
            stage.velocity.copy_(snap.velocity)
    if stage.ties is not None:
        # Every earlier micro-batch had its forward here; those not in flight any more had their backward (and,
        # unless waiting for their W, posted their tied gradients).
        stage.ties.undo(first - len(stage.in_flight) - waiting, None if snap is None else snap.ties[1])
    if snap is not None and snap.grad is not None:
        stage.grad.copy_(snap.grad)
        stage.grad_span = snap.grad_span
    elif snap is not None or (span is not None and span[0] >= first):
        stage.grad.zero_()
        stage.grad_span = None
    with torch.no_grad():
        for module, name, saved in point.buffers:
            buffer = module._buffers[name]
            # Only those written since (BatchNorm's statistics; its kernel does not count as a write for
            # autograd's version counter, so compare values): a graph in flight may have saved the others.
            if not torch.equal(buffer, saved):
                buffer.copy_(saved)
    stage._bind_module_to_live()
    release(stage, stage.undo_points)
    stage.undo_points = []


def minibatches_in_flight(algorithm: Algorithm, needs: Callable[[Action], Sequence[tuple[int, Kind, int]]] | None,
                          steps: int = 3) -> int:
    """How many mini-batches can be incomplete on some stage when a step begins (the steps after the warm-up
    of ``algorithm``'s schedule): with one process per stage a rank cannot see the others' progress, so it
    keeps that many undo points."""
    m, every = algorithm.n_microbatches, algorithm.update_every
    start = algorithm.warmup_minibatches + 1
    schedule = algorithm.schedule(start + steps + 1)
    index = positions(schedule)
    deepest = 1
    for f in range(start, start + steps):
        done = runnable(schedule, [0] * schedule.num_stages, f * m, index, needs)
        oldest = f
        for row, position in zip(schedule.stages, done):
            if position < len(row):
                a = row[position]
                oldest = min(oldest, ((a.index - 1) * every if a.kind is U else a.index) // m)
        deepest = max(deepest, f - oldest)
    return deepest
