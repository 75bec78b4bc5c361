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


@dataclass(frozen=True)
class UndoCopies:
    """What a stage keeps to undo a failed step, in copies of its state's parts (see :func:`undo_copies`)."""

    states: int  # copies of the optimizer state and the declared buffers (one per snapshot)
    weights: int  # weight-sized copies of the weights (kept, or a pooled snapshot's buffer kept for them)
    gradients: int  # copies of the gradient buffer


class _StandInStage(nn.Module):
    """One stage of :func:`undo_copies`'s stand-in: its own ``Linear(1, 1)``, then the tied ones it shares."""

    def __init__(self, tied: Sequence[nn.Module]):
        super().__init__()
        self.own = nn.Linear(1, 1)
        self.tied = nn.ModuleList(tied)  # one module registered under several stages: a tied weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.own(x)
        for module in self.tied:
            x = module(x)
        return x


def undo_copies(algorithm: Algorithm, ties: Sequence[Sequence[int]] = (), steps: int = 3) -> tuple[UndoCopies, ...]:
    """Per stage, the undo copies a pipeline running ``algorithm`` (``recover=True``) holds once its schedule has
    settled: the distinct snapshots of its undo points and its pool, and how many of them hold weights and
    gradients. ``ties`` lists, per tied weight, the stages that hold it.

    How many there are follows from the schedule (mini-batches in flight, when each stage updates), from when
    the weight ring reuses the slot of a version a snapshot waits on (the ring's slot choice), from the pool's
    reuse, and from tied weights (their gradients applied late make a stage snapshot one update group early,
    with its gradient buffer); rather than restate those rules, this trains a stand-in pipeline, one
    ``Linear(1, 1)`` per stage plus one shared by the stages of each tie, for the schedule's warm-up plus
    ``steps`` mini-batches and counts what its stages keep. The counts do not depend on the stages' sizes."""
    import pipecore  # the stand-in is a Pipeline; imported here, as the pipeline imports this module

    num_stages, m = algorithm.num_stages, algorithm.n_microbatches
    with torch.random.fork_rng(devices=[]):  # the caller's random stream stays where it was
        torch.manual_seed(0)
        shared = [nn.Linear(1, 1) for _ in ties]
        model = nn.Sequential(*[_StandInStage([t for t, owners in zip(shared, ties) if s in owners])
                                for s in range(num_stages)])
        pipe = pipecore.Pipeline(model, num_stages, algorithm.name, m, loss_fn=nn.MSELoss(),
                                 optimizer=pipecore.SGD(lr=0.0), partition=[f"{s}.own" for s in range(1, num_stages)],
                                 recover=True, track_memory=False, devices="cpu", **dict(algorithm.options))
        try:
            x = torch.zeros(m, 1)
            for _ in range(algorithm.warmup_minibatches + steps):
                pipe.step(x, x)
            copies = []
            for _, stage in sorted(pipe.stages.items()):
                kept = {id(p.snapshot): p.snapshot for p in stage.undo_points if p.snapshot is not None}
                kept.update((id(s), s) for s in stage.snapshot_pool)
                copies.append(UndoCopies(
                    len(kept), sum(s.weights is not None or s.spare_weights is not None for s in kept.values()),
                    sum(s.grad is not None for s in kept.values())))
        finally:
            pipe.close()
    return tuple(copies)
