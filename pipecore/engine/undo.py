"""Taking a stage back to before the newest mini-batch, when a step fails (``Pipeline`` recovery).

A failed action leaves its mini-batch half done: some stages ran its forwards, backwards, even its
updates. The pipeline undoes that mini-batch and every later one, and completes the earlier ones still in
flight, as ``flush()`` would have done in place of the failed mini-batch. At every step each stage gets an
:class:`UndoPoint`: the first micro-batch of the new mini-batch, the version book's newest tag and copies of
the module's buffers (its forwards update BatchNorm statistics); before the stage's first update of that
mini-batch it also keeps a :class:`~pipecore.engine.state.StateSnapshot` of its state (optimizer state, declared
buffers; :meth:`~pipecore.engine.state.StageState.snapshot`), and of its weights once the ring
is about to lose them (an update in place, or a later update reusing their slot: algorithms that keep the
previous version write the next one elsewhere, and most snapshots are dropped first). The point is dropped
once the mini-batch is complete on every stage. Earlier mini-batches' actions at a stage all come before the
later one's updates (each stage runs its backwards and updates in micro-batch order), so going back to the
snapshot undoes only the later mini-batches. The stage itself forgets its micro-batches and restores its state
(:meth:`~pipecore.engine.stage.TensorStage.undo`).

The memory this costs: a copy of each stage's optimizer state and declared buffers, and of its live weights, per mini-batch that
has updated the stage and is not complete everywhere (one or two: asynchronous schedules keep about one
mini-batch in flight), and a copy of its buffers per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from ..algorithms.base import Algorithm
from ..schedule.ir import Action, Kind, U
from ..schedule.progress import positions, runnable
from .state import StageState, StateSnapshot


@dataclass
class UndoPoint:
    """Where a stage goes back to if the mini-batch starting at micro-batch ``first`` fails."""

    first: int
    latest_tag: int | None
    buffers: list[tuple[nn.Module, str, torch.Tensor]]  # module, buffer name, copy
    snapshot: StateSnapshot | None = field(default=None)

    @classmethod
    def at(cls, modules_with_buffers: Sequence[nn.Module], first: int, latest_tag: int | None) -> "UndoPoint":
        """A point before micro-batch ``first``, with copies of the modules' buffers (forwards update BatchNorm's
        statistics) and the version book's newest tag."""
        buffers = [(m, name, b.detach().clone()) for m in modules_with_buffers
                   for name, b in m._buffers.items() if b is not None]
        return cls(first, latest_tag, buffers)

    def restore_buffers(self) -> None:
        """Put back the module buffers written since the point."""
        with torch.no_grad():
            for module, name, saved in self.buffers:
                buffer = module._buffers[name]
                # Only those written since (BatchNorm's statistics; its kernel does not count as a write for
                # autograd's version counter, so compare values): a graph in flight may have saved the others.
                if not torch.equal(buffer, saved):
                    buffer.copy_(saved)


def slot_for_update(state: StageState, points: Sequence[UndoPoint], in_place: bool) -> int:
    """The ring slot a stage's next update writes: the live one (``in_place``) or a newly acquired one, once every
    undo snapshot of ``points`` of the version it holds has copied it (acquiring a slot forgets its version, so
    the slots are looked up before)."""
    waiting = {id(p.snapshot): p.snapshot for p in points
               if p.snapshot is not None and p.snapshot.weights is None}.values()
    held = [(snapshot, state.ring.find(snapshot.live)) for snapshot in waiting]
    slot = state.ring.live_slot if in_place else state.ring.acquire()
    for snapshot, where in held:
        if where == slot:
            snapshot.keep_weights(state.ring.slot(slot))
    return slot


def release(pool: list[StateSnapshot], points: Sequence[UndoPoint], kept: Sequence[UndoPoint] = ()) -> None:
    """Give the snapshots of ``points`` that none of ``kept`` shares back to ``pool`` (a stage's spare snapshots,
    reused by the next ones)."""
    keep = {id(p.snapshot) for p in kept}
    for snapshot in {id(p.snapshot): p.snapshot for p in points if p.snapshot is not None}.values():
        if id(snapshot) not in keep and len(pool) < POOL:
            pool.append(snapshot)


POOL = 2  # spare snapshots a stage keeps (one mini-batch in flight, or two)


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
