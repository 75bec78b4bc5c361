"""A stage's state: everything a stage holds between its actions, apart from the module it computes with.

The weight ring (one slot per weight version) and the versions pinned in it, the flat gradient buffer and the
micro-batches it holds, the optimizer and its state, the scratch buffer for derived weights, and the buffers the
algorithm declares (:mod:`pipecore.algorithms.state`). The stage
(:mod:`pipecore.engine.stage`) computes with them; :class:`StageState` holds them and is the one place that
steps them (:meth:`StageState.step`), copies and restores them to undo a failed step (:meth:`StageState.snapshot`,
:meth:`StageState.restore`), saves and loads them (:meth:`StageState.state_dict`, :meth:`StageState.load`) and
lists what it allocates (:meth:`StageState.tensors`). It never names an algorithm's buffer: it keeps what the
algorithm declares.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..algorithms.state import BufferUpdate, ChangeAverage, GradientTransform
from ..ring import WeightRing
from ..versions import VersionBook
from .flat import FlatLayout
from .optim import LrScales, StageOptimizer


class Unrecoverable(RuntimeError):
    """A failed step cannot be undone; the pipeline cannot continue."""


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of optimizer state and declared buffers for weights of ``dtype``: float64 for float64 weights,
    float32 otherwise (bf16 weights keep float32 state)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class _AfterUpdate:
    """What a declared buffer's update reads (:class:`pipecore.algorithms.state.AfterUpdate`)."""

    previous: torch.Tensor | None
    weights: torch.Tensor
    grad: torch.Tensor
    optimizer: StageOptimizer


@dataclass
class _BeforeStep:
    """What a gradient transform reads (:class:`pipecore.algorithms.state.BeforeStep`)."""

    weights: torch.Tensor
    gradient_weights: torch.Tensor | None
    optimizer: StageOptimizer
    tied: list[tuple[int, int]]
    state: "StageState"

    def buffer(self, name: str) -> torch.Tensor:
        return self.state.buffer(name)


@dataclass
class StateSnapshot:
    """A stage's state before its first update of a mini-batch that may be undone (see :mod:`.undo`)."""

    update: int  # the update it was taken before (its index in the schedule)
    live: int  # the live version then: the ring holds it until a slot write replaces it (see keep_weights)
    updates: int
    weights: torch.Tensor | None  # version ``live``, copied only when its ring slot was about to be written
    grad: torch.Tensor | None  # kept when the update it precedes belongs to an earlier mini-batch
    grad_span: tuple[int, int] | None
    optimizer: dict[str, Any]
    lr: float
    buffers: dict[str, torch.Tensor]
    ties: tuple[int, int] | None  # the stage's tied-gradient groups posted and applied (kept for the stage)
    spare_weights: torch.Tensor | None = None  # a pooled snapshot's buffer for the weights, until they are kept

    def keep_weights(self, slot: torch.Tensor) -> None:
        """Copy version ``live`` out of ``slot``, the ring slot holding it, which is about to be written."""
        if self.weights is None:
            self.weights = copy_into(slot, self.spare_weights)
            self.spare_weights = None

    def tensors(self) -> list[Any]:
        """What the snapshot holds (for byte counts)."""
        return [self.weights, self.spare_weights, self.grad, self.optimizer, list(self.buffers.values())]


class StageState:
    """The weights, gradients, optimizer state and declared buffers of one stage.

    Args:
        stage: the stage's index (for messages).
        layout: the flat layout of the stage's parameters.
        weights: the initial weights, flat in ``layout``'s order (version 0).
        num_slots: weight versions the ring holds at most.
        derived: whether reads derive weights (a scratch buffer is allocated for them).
        optimizer: the stage's optimizer.
        book: the stage's version book (which versions are live and held).
        buffer_updates: the algorithm's declared buffers at this stage, by name, with how each changes after an
            update; each starts at zero, in the optimizer state's dtype. A buffer whose update is not kept with
            this optimizer (:meth:`~pipecore.algorithms.state.BufferUpdate.kept_with`) is not allocated.

    The algorithm's gradient transform at this stage, if it declares one, is read from the version book's algorithm
    (``book.algorithm.gradient_transform(stage)``).
    """

    def __init__(self, stage: int, layout: FlatLayout, weights: torch.Tensor, num_slots: int, derived: bool,
                 optimizer: StageOptimizer, book: VersionBook, buffer_updates: Mapping[str, BufferUpdate]):
        self.stage = stage
        self.layout = layout
        self.book = book
        self.ring = WeightRing.from_flat(weights, num_slots, version=0)
        self.scratch = torch.empty_like(weights) if derived else None
        self.grad = torch.zeros_like(weights)
        # The first and last micro-batch whose gradients the buffer holds (None: it is zero).
        self.grad_span: tuple[int, int] | None = None
        self.optimizer = optimizer
        for update in buffer_updates.values():
            update.check(optimizer)
        self.buffer_updates = {name: u for name, u in buffer_updates.items() if u.kept_with(optimizer)}
        self.transform: GradientTransform | None = book.algorithm.gradient_transform(stage)
        if self.transform is not None:
            self.transform.check(optimizer)
        # The ranges of the flat buffers that hold weights tied to other stages' copies (set with the stage's ties).
        self.tied_ranges: list[tuple[int, int]] = []
        dtype = state_dtype(weights.dtype)
        self.buffers = {name: torch.zeros(layout.buffer_numel, dtype=dtype, device=weights.device)
                        for name in self.buffer_updates}
        # One running average of the weight change is folded into the optimizer's pass; the other updates run after
        # it, the old weights copied first where one reads them and the step overwrites them.
        self._averaged = next((name for name, u in self.buffer_updates.items() if isinstance(u, ChangeAverage)), None)
        self._after = [(name, u) for name, u in self.buffer_updates.items() if name != self._averaged]
        self._reads_previous = any(u.reads_previous_weights for _, u in self._after)
        self.pinned_versions: set[int] = set()

    # -- weights -------------------------------------------------------------------------------

    def slot_of(self, version: int) -> torch.Tensor:
        """The flat weights of ``version``."""
        ring = self.ring._ring  # the extension's ring itself, without the wrapper's checks: versions are ints here
        i = ring.find(version)
        if i is None:
            raise RuntimeError(f"stage {self.stage}: weight version {version} is not in the ring ({self.ring!r})")
        return ring.slot(i)

    def buffer(self, name: str) -> torch.Tensor:
        """The declared buffer ``name``."""
        found = self.buffers.get(name)
        if found is None:
            kept = ", ".join(self.buffers) or "none"
            raise ValueError(f"stage {self.stage} keeps no buffer {name!r} (its algorithm's buffers here: {kept})")
        return found

    def storages(self) -> set[int]:
        """The storages of the ring and the scratch buffer: they never move until :meth:`load`."""
        held = {self.ring.buffer.untyped_storage().data_ptr()}
        if self.scratch is not None:
            held.add(self.scratch.untyped_storage().data_ptr())
        return held

    def sync_ring(self) -> None:
        """Pin exactly the non-live versions the version book still holds; the rest become reusable."""
        book = self.book
        held = book.held
        if not self.pinned_versions and len(held) == 1 and book.live in held:
            return  # only the live version is held, as before (the synchronous schedules, every action)
        wanted = held - {book.live}
        for v in wanted - self.pinned_versions:
            self.ring.pin(self.ring.find(v))
        for v in self.pinned_versions - wanted:
            self.ring.unpin(self.ring.find(v))
        self.pinned_versions = wanted

    # -- updates -------------------------------------------------------------------------------

    def step(self, w: torch.Tensor, out: torch.Tensor, lr_scales: LrScales) -> None:
        """The optimizer's step from weights ``w`` with the gradient buffer into ``out`` (which may be ``w``), then
        every declared buffer's update."""
        grad, optimizer = self.grad, self.optimizer
        if self.transform is not None:
            self._transform(w)
        if not self.buffer_updates:
            optimizer.step(w, grad, out, lr_scales)
            return
        previous = None
        if self._reads_previous:
            previous = w.clone() if out.data_ptr() == w.data_ptr() else w
        if self._averaged is None:
            optimizer.step(w, grad, out, lr_scales)
        else:
            decay = self.buffer_updates[self._averaged].decay  # type: ignore[attr-defined]
            optimizer.step_averaging_change(w, grad, out, lr_scales, self.buffers[self._averaged], decay)
        if self._after:
            after = _AfterUpdate(previous, out, grad, optimizer)
            for name, update in self._after:
                update.apply(self.buffers[name], after)

    def _transform(self, w: torch.Tensor) -> None:
        """The algorithm's gradient transform, on the gradient buffer, before the step from the live weights ``w``."""
        transform = self.transform
        assert transform is not None
        computed_at = None
        if transform.reads_gradient_weights:
            versions = set(self.book.update_reads)
            if len(versions) != 1:
                raise RuntimeError(
                    f"stage {self.stage}: the update's gradients were computed at versions {sorted(versions)}; the "
                    "algorithm's gradient transform reads the one version they were computed at")
            (version,) = versions
            computed_at = self.slot_of(version)  # the live slot when it is the live version (``w``)
        transform.apply(self.grad, _BeforeStep(w, computed_at, self.optimizer, self.tied_ranges, self))

    def clear_gradients(self) -> None:
        """Zero the gradient buffer: it holds no micro-batch."""
        self.grad.zero_()
        self.grad_span = None

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The live version, the update count, the optimizer state and the declared buffers, as live references
        (the caller clones)."""
        return {"version": self.book.live, "updates": self.book.updates, "optimizer": self.optimizer.state_dict(),
                "lr": self.optimizer.lr, "buffers": dict(self.buffers)}

    def load(self, weights: torch.Tensor, version: int, updates: int, optimizer_state: Mapping[str, Any],
             buffers: Mapping[str, torch.Tensor]) -> None:
        """Start again from a checkpoint: ``weights`` (flat) as version ``version`` after ``updates`` updates, the
        optimizer's state, and every declared buffer (``buffers`` must hold exactly those). The ring is new (its
        storage moves), nothing is pinned, the gradient buffer is zero."""
        self.check_load(optimizer_state, buffers)
        # Everything checked: nothing below refuses the checkpoint half-way.
        self.ring = WeightRing.from_flat(weights, self.ring.num_slots, version=version)
        self.optimizer.load_state_dict(dict(optimizer_state))
        self.pinned_versions = set()
        self.book.load(version, updates)
        for name, value in buffers.items():
            self.buffers[name].copy_(value)
        self.clear_gradients()

    def check_load(self, optimizer_state: Mapping[str, Any], buffers: Mapping[str, torch.Tensor]) -> None:
        """Raise, changing nothing, if :meth:`load` would refuse this optimizer state or these buffers (a pipeline
        checks every stage before it loads any)."""
        if set(buffers) != set(self.buffers):
            raise ValueError(f"stage {self.stage}: the checkpoint's buffers {sorted(buffers)} do not match the "
                             f"algorithm's {sorted(self.buffers)}")
        wrong = [name for name, value in buffers.items() if tuple(value.shape) != tuple(self.buffers[name].shape)]
        if wrong:
            raise ValueError(f"stage {self.stage}: the checkpoint's buffers {wrong} have another size than this "
                             "stage's weights")
        self.optimizer.check_state(dict(optimizer_state))

    # -- undo ----------------------------------------------------------------------------------

    def snapshot(self, update: int, with_grad: bool, spare: StateSnapshot | None = None,
                 ties: tuple[int, int] | None = None) -> StateSnapshot:
        """The state now, copied into the buffers of ``spare`` (a snapshot no longer needed) where they match, so
        that a step's copies cost no allocation (fresh pages of a large tensor cost more than the copy). The
        weights stay in the ring until :meth:`StateSnapshot.keep_weights`; the gradient buffer is copied only
        ``with_grad``. ``ties`` is the stage's tie-exchange counts, kept with the snapshot."""
        return StateSnapshot(
            update, self.book.live, self.book.updates, None,
            copy_into(self.grad, spare and spare.grad) if with_grad else None, self.grad_span,
            copy_state(self.optimizer.state_dict(), spare and spare.optimizer), self.optimizer.lr,
            {name: copy_into(b, spare and spare.buffers.get(name)) for name, b in self.buffers.items()},
            ties,
            spare_weights=spare and (spare.weights if spare.weights is not None else spare.spare_weights),
        )

    def restore(self, snap: StateSnapshot) -> None:
        """Take the weights, the optimizer and the declared buffers back to ``snap`` (the version book already
        names ``snap.live`` as live; the gradient buffer is the caller's to restore)."""
        if not self.ring.rewind(snap.live):
            if snap.weights is None:
                raise Unrecoverable(f"stage {self.stage}: weight version {snap.live} is neither in the ring nor "
                                    "copied by its undo snapshot")
            slot = self.ring.acquire()
            self.ring.slot(slot).copy_(snap.weights)
            self.ring.publish(slot, snap.live)
        self.sync_ring()
        self.optimizer.load_state_dict(snap.optimizer)
        self.optimizer.set_lr(snap.lr)
        for name, saved in snap.buffers.items():
            self.buffers[name].copy_(saved)

    # -- memory --------------------------------------------------------------------------------

    def tensors(self) -> list[Any]:
        """What the state allocates once: the ring, the gradient and scratch buffers, the optimizer state and the
        declared buffers (nested lists and dicts of tensors, for byte counts)."""
        return [self.ring.buffer, self.grad, self.scratch, self.optimizer.state_dict(), list(self.buffers.values())]


def copy_into(source: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
    """A copy of ``source``: into ``into`` where it has the same shape, dtype and device, else a new tensor."""
    if into is not None and (into.shape, into.dtype, into.device) == (source.shape, source.dtype, source.device):
        return into.copy_(source)
    return source.clone()


_IMMUTABLE = (int, float, bool, str, bytes)


def copy_state(source: Any, into: Any) -> Any:
    """A copy of an optimizer's state (nested dicts and lists of tensors and plain values), into ``into``'s
    tensors where they match."""
    if source is None or type(source) in _IMMUTABLE:  # a step count, a flag: nothing to copy (once per update)
        return source
    if isinstance(source, torch.Tensor):
        return copy_into(source, into if isinstance(into, torch.Tensor) else None)
    if isinstance(source, dict):
        return {k: copy_state(v, into.get(k) if isinstance(into, dict) else None) for k, v in source.items()}
    if isinstance(source, (list, tuple)):
        parts = into if isinstance(into, (list, tuple)) and len(into) == len(source) else [None] * len(source)
        return type(source)(copy_state(v, i) for v, i in zip(source, parts))
    return copy.deepcopy(source)
