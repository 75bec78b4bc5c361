"""The weight-version ring: K versions of one stage's flat parameter buffer in one allocation.

A pipeline stage keeps its parameters in one flat buffer; asynchronous schedules need several
versions of it at once (the live weights, the versions in-flight micro-batches read in their
forward pass, and the slot the next update writes). :class:`WeightRing` holds ``num_slots`` such
buffers in a single allocation and tracks, per slot, the version it holds and how many in-flight
micro-batches pin it. Module parameters can be views into a slot (see :meth:`WeightRing.views`), so
stashing a version is zero-copy: a micro-batch pins the slot its forward read.

Slot states::

    free --acquire()--> acquired --publish(i, v)--> live --(another slot published)--> stale
      ^                    |                                                         |
      +----release(i)------+                         stale and unpinned: free again  <+

``advance(v)`` records an in-place update of an unpinned live slot (it stays live, now as version
``v``). ``pin``/``unpin`` count references on any slot that holds a version (live, stale, or free but
not yet reused). ``acquire`` never returns the live slot, a pinned slot or a slot another ``acquire``
handed out; it prefers never-used slots, then the oldest version, and drops the version tag of the
slot it returns. Misuse (publishing a slot that was not acquired, unpinning more than pinning,
acquiring when every slot is in use) raises ``RuntimeError`` with the ring's state in the message;
bad arguments (slot index out of range, a version that is not newer than the live one) raise
``ValueError``.

The number of slots is fixed at construction (the engine knows how many versions an algorithm
needs from its schedule); growing would move the allocation and invalidate parameter views.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from pipecore import _C

__all__ = ["WeightRing"]


class WeightRing:
    """``num_slots`` versions of a flat buffer of ``numel`` elements, with versions and pin counts.

    Args:
        numel: elements per slot (the stage's flat parameter count).
        num_slots: number of versions held at once (K).
        dtype: storage dtype, any floating dtype.
        device: where the single allocation lives (CPU or CUDA).

    The buffer is zero-filled. Slot starts are aligned to 64 elements; :attr:`nbytes` counts the
    whole allocation including that padding.
    """

    def __init__(self, numel: int, num_slots: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"WeightRing: dtype must be a torch.dtype, got {type(dtype).__name__}")
        self._ring = _C.WeightRing(operator.index(numel), operator.index(num_slots), dtype, torch.device(device))

    @classmethod
    def from_flat(cls, flat: torch.Tensor, num_slots: int, version: int = 0) -> WeightRing:
        """A ring with the dtype and device of ``flat`` whose live slot holds a copy of it as ``version``."""
        if not isinstance(flat, torch.Tensor):
            raise ValueError(f"WeightRing.from_flat: 'flat' must be a torch.Tensor, got {type(flat).__name__}")
        ring = cls(flat.numel(), num_slots, flat.dtype, flat.device)
        i = ring.acquire()
        with torch.no_grad():
            ring.slot(i).copy_(flat.reshape(-1))
        ring.publish(i, version)
        return ring

    # -- memory -------------------------------------------------------------------------------

    def slot(self, i: int) -> torch.Tensor:
        """1-D view of slot ``i`` (``numel`` elements) sharing the ring's storage.

        Every call returns the same tensor. Each slot has its own autograd version counter, so
        writing one slot does not invalidate autograd graphs that saved views of another slot.
        """
        return self._ring.slot(operator.index(i))

    def views(self, i: int, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Views of slot ``i`` with the given shapes, packed back to back from offset 0.

        Wrapping them in ``nn.Parameter`` (or assigning them to ``param.data``) makes module
        parameters live in the slot without a copy.
        """
        flat = self.slot(i)
        out: list[torch.Tensor] = []
        offset = 0
        for shape in shapes:
            n = 1
            for s in shape:
                n *= int(s)
            if offset + n > flat.numel():
                raise ValueError(f"WeightRing.views: shapes need more than the {flat.numel()} elements of a slot")
            out.append(flat.narrow(0, offset, n).view(*shape))
            offset += n
        return out

    @property
    def buffer(self) -> torch.Tensor:
        """The single allocation behind all slots (``num_slots * slot_stride`` elements)."""
        return self._ring.buffer

    @property
    def numel(self) -> int:
        """Elements per slot."""
        return self._ring.numel

    @property
    def num_slots(self) -> int:
        """Number of slots (K)."""
        return self._ring.num_slots

    @property
    def slot_stride(self) -> int:
        """Distance in elements between the starts of consecutive slots (``numel`` rounded up to 64)."""
        return self._ring.slot_stride

    @property
    def nbytes(self) -> int:
        """Bytes held by the ring's allocation."""
        return self._ring.nbytes

    @property
    def dtype(self) -> torch.dtype:
        return self._ring.buffer.dtype

    @property
    def device(self) -> torch.device:
        return self._ring.buffer.device

    # -- versions -----------------------------------------------------------------------------

    @property
    def live_slot(self) -> int | None:
        """Index of the live slot, or ``None`` before the first :meth:`publish`."""
        return self._ring.live_slot

    @property
    def live_version(self) -> int | None:
        """Version held by the live slot, or ``None`` before the first :meth:`publish`."""
        return self._ring.live_version

    @property
    def live(self) -> torch.Tensor | None:
        """View of the live slot, or ``None`` before the first :meth:`publish`."""
        i = self._ring.live_slot
        return None if i is None else self._ring.slot(i)

    def version_of(self, i: int) -> int | None:
        """Version stored in slot ``i`` (``None`` if it holds none: never used, acquired or released)."""
        return self._ring.version_of(operator.index(i))

    def find(self, version: int) -> int | None:
        """Slot that still holds ``version``, or ``None`` if it was overwritten or never existed."""
        return self._ring.find(operator.index(version))

    def state(self, i: int) -> str:
        """``"free"``, ``"acquired"``, ``"live"`` or ``"stale"`` (not live, pinned)."""
        return self._ring.state(operator.index(i))

    def pin_count(self, i: int) -> int:
        """How many in-flight users pinned slot ``i``."""
        return self._ring.pin_count(operator.index(i))

    # -- transitions --------------------------------------------------------------------------

    def acquire(self) -> int:
        """Reserve a slot that is neither live, pinned nor already acquired, for writing a new version.

        Raises:
            RuntimeError: every slot is in use; the message lists the live, pinned and acquired slots.
        """
        return self._ring.acquire()

    def publish(self, i: int, version: int) -> None:
        """Make acquired slot ``i`` the live slot, holding ``version``.

        The previous live slot becomes stale (still readable while pinned, reusable once unpinned).

        Raises:
            RuntimeError: slot ``i`` was not acquired.
            ValueError: ``version`` is negative or not greater than the live version.
        """
        self._ring.publish(operator.index(i), operator.index(version))

    def advance(self, version: int) -> None:
        """Record that the live slot was updated in place and now holds ``version``.

        Raises:
            RuntimeError: there is no live slot, or it is pinned (its old values are still needed).
            ValueError: ``version`` is not greater than the live version.
        """
        self._ring.advance(operator.index(version))

    def release(self, i: int) -> None:
        """Give back an acquired slot without publishing it.

        Raises:
            RuntimeError: slot ``i`` is not acquired.
        """
        self._ring.release(operator.index(i))

    def rewind(self, version: int) -> bool:
        """Undo updates back to ``version``: every slot holding a newer version forgets it, and the slot that
        still holds ``version`` becomes live again (its pins stay). Returns False, leaving no live slot, when no
        slot holds ``version`` any more (it was updated in place or its slot reused): then :meth:`acquire` a
        slot, write the weights and :meth:`publish` it as ``version``.

        Raises:
            RuntimeError: a slot is acquired, or a newer version is pinned.
        """
        return self._ring.rewind(operator.index(version))

    def pin(self, i: int) -> None:
        """Count one more user of slot ``i`` (a micro-batch whose forward read it).

        Raises:
            RuntimeError: slot ``i`` holds no version (never published, or acquired for writing).
        """
        self._ring.pin(operator.index(i))

    def unpin(self, i: int) -> None:
        """Drop one user of slot ``i``; a stale slot with no users left becomes free.

        Raises:
            RuntimeError: slot ``i`` is not pinned.
        """
        self._ring.unpin(operator.index(i))

    def __len__(self) -> int:
        return self._ring.num_slots

    def __repr__(self) -> str:
        return repr(self._ring)
