"""A stage's memory, as measured while it trains (``Pipeline.stats()[s]["peak_bytes"]``).

On a CUDA device the allocator knows: the peak is ``torch.cuda.max_memory_allocated`` of the stage's
device (shared by the stages on that device). On the CPU nothing tracks allocations, so the stage keeps an
account: what it allocates once (weight versions, gradient buffer, scratch, velocity, optimizer state, the
copies that undo a failed step) plus, per micro-batch in flight, the tensors its forward keeps for the
backward (saved by autograd, kept as the stage's inputs and outputs, or kept by a recomputed segment as its
inputs), each storage counted once; and, during a backward that recomputes the whole stage, what the
recomputed forward saves (not yet for a recomputed segment). The peak is the largest sum seen.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch

_COUNTING = threading.local()  # the account of the forward running on this thread, if it is counted

if TYPE_CHECKING:
    from .stage import TensorStage


class MemoryAccount:
    """The per-micro-batch part of a stage's account (see the module docstring); :func:`static_bytes` is the
    rest."""

    def __init__(self, excluded: set[int]):
        self.excluded = excluded  # storages counted elsewhere (the weight ring, the scratch buffer)
        self.in_flight: dict[int, int] = {}  # micro-batch -> bytes its forward keeps
        self.live = 0
        self.peak = 0
        self._seen: dict[int, int] | None = None  # storage -> bytes, while a forward is counted

    def note(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage in the forward being counted (a saved-tensor hook calls this)."""
        seen = self._seen
        if seen is not None and t.device.type == "cpu":
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self.excluded and key not in seen:
                seen[key] = storage.nbytes()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.note(t)
        return t

    @contextmanager
    def counting(self, kept: Iterable[Any] = ()) -> Iterator[dict[int, int]]:
        """Count what the block's forward saves, plus the tensors in ``kept``; the storages are in the dict."""
        seen: dict[int, int] = {}
        self._seen = seen
        _COUNTING.account = self
        try:
            yield seen
        finally:
            self._seen = None
            _COUNTING.account = None
        for value in kept:
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                if value.device.type == "cpu" and storage.data_ptr() not in self.excluded:
                    seen.setdefault(storage.data_ptr(), storage.nbytes())

    def forwarded(self, microbatch: int, seen: dict[int, int], outputs: Iterable[Any] = ()) -> None:
        """Micro-batch ``microbatch`` is in flight, keeping ``seen`` (and ``outputs``) until its backward."""
        for value in outputs:
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                storage = value.untyped_storage()
                seen.setdefault(storage.data_ptr(), storage.nbytes())
        nbytes = sum(seen.values())
        self.in_flight[microbatch] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def transient(self, nbytes: int) -> None:
        """A backward holds ``nbytes`` more for a moment (a recomputed forward's saved tensors)."""
        self.peak = max(self.peak, self.live + nbytes)

    def backwarded(self, microbatch: int) -> None:
        self.live -= self.in_flight.pop(microbatch, 0)

    def forget(self, first: int) -> None:
        """Micro-batches ``first`` and later are no longer in flight (a failed step was undone)."""
        for k in [k for k in self.in_flight if k >= first]:
            self.backwarded(k)


def note_kept(tensors: Iterable[Any]) -> None:
    """Count ``tensors`` as kept for the backward by the forward being counted on this thread, if any (what a
    checkpointed segment keeps outside autograd's saved tensors: its inputs)."""
    account = getattr(_COUNTING, "account", None)
    if account is not None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                account.note(t)


def static_bytes(stage: "TensorStage") -> int:
    """What ``stage`` allocates once: its weight ring, gradient buffer, scratch and velocity buffers, optimizer
    state, and the copies kept to undo a failed step."""
    tensors = [stage.ring.buffer, stage.grad, stage.scratch, stage.velocity, stage.optimizer.state_dict()]
    snapshots = {id(p.snapshot): p.snapshot for p in stage.undo_points if p.snapshot is not None}
    snapshots.update((id(s), s) for s in stage.snapshot_pool)
    for snap in snapshots.values():
        tensors += [snap.weights, snap.grad, snap.optimizer, snap.velocity]
    seen: dict[int, int] = {}
    _collect(tensors, seen)
    return sum(seen.values())


def _collect(value: Any, seen: dict[int, int]) -> None:
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        seen.setdefault(storage.data_ptr(), storage.nbytes())
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, seen)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, seen)


def peak_bytes(stage: "TensorStage") -> int:
    """The stage's peak: on CUDA, the allocator's peak of its device; on the CPU, its account."""
    if stage.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(stage.device))
    return static_bytes(stage) + stage.memory.peak
