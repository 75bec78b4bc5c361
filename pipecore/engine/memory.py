"""A stage's memory, as measured while it trains (``Pipeline.stats()[s]["peak_bytes"]``).

On a CUDA device the allocator knows: the peak is ``torch.cuda.max_memory_allocated`` of the stage's
device (shared by the stages on that device). On the CPU nothing tracks allocations, so the stage keeps an
account: what it allocates once (weight versions, gradient buffer, scratch, optimizer state, the buffers its
algorithm declares, the copies that undo a failed step) plus, per micro-batch in flight, the tensors its forward keeps for the
backward (saved by autograd, kept as the stage's inputs and outputs, or kept by a recomputed segment as its
inputs), each byte counted once (a tensor counts the bytes of its storage it spans: a micro-batch's input,
a slice of the mini-batch, counts as the slice); and, during a backward that recomputes, what the
recomputed forward (of the whole stage, or of a recomputed segment) still holds when it ends, on top of
everything in flight including the micro-batch being backwarded. The peak is the largest sum seen. The module's buffers
(BatchNorm's running statistics) are counted in neither part.

A backward whose weight gradients come later (a deferred ``W``, :mod:`pipecore.engine.split_backward`) retains the
graph below the weights' junctions until that ``W``: what those nodes saved stays allocated from the ``B`` to the
``W``, and only the rest (the nodes above, the kept inputs and outputs no node saved) is freed at the ``B``. An
account that ``watch``es keeps a weak reference to each alias its pack hook hands autograd, which lives exactly as
long as the node that saved it: after the ``B`` it counts on the byte ranges some alias of which is still alive,
until the ``W``.

The pack hook hands autograd a detached alias of each saved tensor, not the tensor itself: a node's own output,
saved as itself, would hold its node, which holds it, a cycle through C++ that Python's collector cannot see. A
graph whose nodes all run with ``retain_graph=False`` breaks it, but a deferred ``W`` runs only the nodes between
the junctions and the weights: the graph of every such micro-batch leaked (7 MB a step on the GPT of the tests).

The account sees the saved tensors through saved-tensor hooks, which cost a Python call per saved tensor in
every forward and every backward (and, with stages on threads, a trip through the GIL inside the autograd
engine): an account that is not ``enabled`` (a CUDA stage, whose allocator knows, or
``Pipeline(track_memory=False)``) installs none and counts nothing.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .saved import identity, saving

# The account of the forward (``account``) or backward (``backward``) running on this thread, if counted.
_COUNTING = threading.local()


class Kept:
    """What one micro-batch's forward keeps: per storage, the bytes its kept tensors span (from the lowest to
    the highest byte any of them reaches). A micro-batch's input is a slice of the mini-batch's storage: it
    keeps that slice, as on a device the copy of it would be; a tensor saved whole spans its storage."""

    def __init__(self, excluded: set[int], watch: bool = False):
        self.excluded = excluded
        self.spans: dict[int, tuple[int, int]] = {}  # storage -> (first byte, end byte)
        # With ``watch``: per storage, weak references to the aliases of it autograd saved (see the module docstring).
        self.saved: dict[int, list[weakref.ref]] | None = {} if watch else None

    def add(self, t: Any) -> int | None:
        """Count ``t`` (anything that is not a CPU tensor counts nothing); returns the key of its storage if it
        counts."""
        if not isinstance(t, torch.Tensor) or not t.is_cpu:
            return None
        count = t.numel()
        if count == 0:
            return None
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.excluded:
            return None
        size = t.element_size()
        first = t.storage_offset() * size
        if t.is_contiguous():  # most saved tensors: no need to walk the strides
            end = first + count * size
        else:
            end = min(storage.nbytes(),
                      first + size * (1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))))
        span = self.spans.get(key)
        self.spans[key] = (first, end) if span is None else (min(span[0], first), max(span[1], end))
        return key

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """The saved-tensor pack hook: counts ``t``, hands autograd a detached alias of it (see the module
        docstring) and, when watching, keeps a weak reference to that alias."""
        key = self.add(t)
        alias = t.detach()
        if key is not None and self.saved is not None:
            self.saved.setdefault(key, []).append(weakref.ref(alias))
        return alias

    def ranges(self) -> dict[tuple[int, int, int], int]:
        """The byte ranges kept, each with its bytes."""
        return {(key, lo, hi): hi - lo for key, (lo, hi) in self.spans.items()}

    def nbytes(self) -> int:
        return sum(hi - lo for lo, hi in self.spans.values())


class _NothingKept(Kept):
    """What a disabled account's forward keeps: nothing."""

    def __init__(self) -> None:
        super().__init__(set())

    def add(self, t: Any) -> None:
        return None

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach()


_NOTHING_KEPT = _NothingKept()
# What a disabled account's blocks are: reusable, as they hold nothing.
_COUNT_NOTHING = nullcontext(_NOTHING_KEPT)
_NOTHING = nullcontext()


class MemoryAccount:
    """The per-micro-batch part of a stage's account (see the module docstring); :func:`static_bytes` is the
    rest."""

    def __init__(self, excluded: set[int], module: nn.Module | None = None, enabled: bool = True,
                 watch: bool = False):
        self.enabled = enabled  # False: count nothing, install no hooks (see the module docstring)
        self.watch = watch  # a backward may leave its weight gradients for a later W (see the module docstring)
        self.excluded = excluded  # storages counted elsewhere (the weight ring, the scratch buffer)
        self.module = module  # its buffers (BatchNorm's running statistics) are the stage's, not a micro-batch's
        # The modules that have buffers, found once: the module's structure does not change while it trains.
        self._with_buffers = [m for m in module.modules() if m._buffers] if module is not None else []
        self.in_flight: dict[int, dict[tuple[int, int, int], int]] = {}  # micro-batch -> byte ranges it keeps
        # Micro-batches in flight that keep each byte range: a range several keep is counted once.
        self._holders: dict[tuple[int, int, int], int] = {}
        self.live = 0
        self.peak = 0
        self.backwarding = 0  # bytes the micro-batch whose backward runs releases: held until it ends
        self._kept: Kept | None = None  # while a forward is counted
        # Watching: per micro-batch in flight, what autograd saved (Kept.saved); per micro-batch backwarded whose W
        # is to come, the byte ranges still counted; those whose B may have freed some, not looked at since.
        self._saved: dict[int, dict[int, list[weakref.ref]]] = {}
        self.waiting: dict[int, dict[tuple[int, int, int], int]] = {}
        self._unsettled: list[int] = []

    def note(self, t: torch.Tensor) -> None:
        """Count ``t`` in the forward being counted (a saved-tensor hook calls this)."""
        if self._kept is not None:
            self._kept.add(t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """A saved-tensor pack hook outside a counted forward's own: counts ``t`` in the forward being counted, if
        any, and hands autograd a detached alias (see the module docstring)."""
        kept = self._kept
        return t.detach() if kept is None else kept.pack(t)

    def hooks(self) -> Any:
        """Around a forward inside :meth:`counting`: the saved-tensor hooks that count what it saves (none when
        not enabled)."""
        if not self.enabled:
            return _NOTHING
        # Inside counting(): the forward's own Kept is the pack hook.
        return saving(self.pack if self._kept is None else self._kept.pack, identity)

    def counting(self, kept: Iterable[Any] = ()) -> AbstractContextManager[Kept]:
        """Count what the block's forward saves, plus the tensors in ``kept`` (nothing when not enabled)."""
        return self._counting(kept) if self.enabled else _COUNT_NOTHING

    @contextmanager
    def _counting(self, kept: Iterable[Any]) -> Iterator[Kept]:
        excluded = self.excluded
        if self._with_buffers:  # looked up each time: a buffer may be replaced (buffer_copies, load_state_dict)
            excluded = excluded | {b.untyped_storage().data_ptr() for m in self._with_buffers
                                   for b in m._buffers.values() if b is not None}
        counted = Kept(excluded, self.watch)
        self._kept = counted
        _COUNTING.account = self
        try:
            yield counted
        finally:
            self._kept = None
            _COUNTING.account = None
        for value in kept:
            counted.add(value)

    def forwarded(self, microbatch: int, kept: Kept, outputs: Iterable[Any] = ()) -> None:
        """Micro-batch ``microbatch`` is in flight, keeping ``kept`` (and ``outputs``) until its backward."""
        if not self.enabled:
            return
        self._settle()
        for value in outputs:
            kept.add(value)
        ranges = kept.ranges()
        self.in_flight[microbatch] = ranges
        if kept.saved is not None:
            self._saved[microbatch] = kept.saved
        for key, nbytes in ranges.items():
            self._holders[key] = self._holders.get(key, 0) + 1
            if self._holders[key] == 1:
                self.live += nbytes
        self.peak = max(self.peak, self.live)

    def transient(self, nbytes: int) -> None:
        """A backward holds ``nbytes`` more for a moment (a recomputed forward's saved tensors)."""
        self._settle()
        self.peak = max(self.peak, self.live + self.backwarding + nbytes)

    def backwarded(self, microbatch: int, deferred: bool = False) -> None:
        """Micro-batch ``microbatch``'s backward starts: it is no longer in flight, though what it kept is
        freed only as its backward goes (counted until :meth:`backward`'s block ends). ``deferred``: its weight
        gradients are left for a W (:meth:`weighted`); what its graph still holds stays counted until then."""
        self._settle()
        self.backwarding = 0
        ranges = self.in_flight.pop(microbatch, {})
        if deferred:
            # Until its B's frame is gone nothing tells what the B freed: the next event looks (_settle).
            self.waiting[microbatch] = ranges
            self._unsettled.append(microbatch)
            return
        self._saved.pop(microbatch, None)
        self.backwarding = self._release(ranges)
        self.live -= self.backwarding

    def weighted(self, microbatch: int) -> None:
        """Micro-batch ``microbatch``'s W has run: its graph, and what it still held, is freed."""
        self._settle()
        self._saved.pop(microbatch, None)
        self.live -= self._release(self.waiting.pop(microbatch, {}))

    def _release(self, ranges: dict[tuple[int, int, int], int]) -> int:
        """One holder fewer of each of ``ranges``; the bytes of those no micro-batch holds any more."""
        freed = 0
        for key, nbytes in ranges.items():
            self._holders[key] -= 1
            if not self._holders[key]:
                del self._holders[key]
                freed += nbytes
        return freed

    def _settle(self) -> None:
        """Stop counting what the Bs since the last event freed: the ranges of their micro-batches of which no
        saved alias is alive any more (the kept inputs and outputs no node saved, the nodes above the junctions)."""
        for k in self._unsettled:
            ranges, saved = self.waiting.get(k), self._saved.get(k, {})
            if ranges is None:
                continue
            freed = {key: n for key, n in ranges.items() if not any(ref() is not None for ref in saved.get(key[0], ()))}
            for key in freed:
                del ranges[key]
            self.live -= self._release(freed)
        self._unsettled.clear()

    def released(self) -> None:
        """The backward of the micro-batch last backwarded has ended: what it kept is freed."""
        self.backwarding = 0

    def backward(self) -> AbstractContextManager[None]:
        """The block runs the stage's backward: recomputed segments count their transient here
        (:func:`counting_recomputation`)."""
        return self._backward() if self.enabled else _NOTHING

    @contextmanager
    def _backward(self) -> Iterator[None]:
        _COUNTING.backward = self
        try:
            yield
        finally:
            _COUNTING.backward = None
            self.backwarding = 0

    def forget(self, first: int) -> None:
        """Micro-batches ``first`` and later are no longer in flight nor waiting for their W (a failed step was
        undone)."""
        for k in [k for k in self.in_flight if k >= first]:
            self.backwarded(k)
        for k in [k for k in self.waiting if k >= first]:
            self.weighted(k)


def note_kept(tensors: Iterable[Any]) -> None:
    """Count ``tensors`` as kept for the backward by the forward being counted on this thread, if any (what a
    checkpointed segment keeps outside autograd's saved tensors: its inputs)."""
    account = getattr(_COUNTING, "account", None)
    if account is not None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                account.note(t)


@contextmanager
def counting_recomputation() -> Iterator[None]:
    """Count, as a transient of the backward running on this thread (if its stage keeps an account), what the
    block (a segment's recomputation) allocates and still holds when it ends: the tensors the recomputation
    saved for the segment's backward (the block drops its outputs before it ends). Scratch freed within the
    block is not counted (like every transient of one forward or backward that the account leaves out)."""
    account = getattr(_COUNTING, "backward", None)
    if account is None:
        yield
        return
    created = _CreatedStorages()
    try:
        with created:
            yield
    finally:
        account.transient(created.alive_bytes())


class _CreatedStorages(TorchDispatchMode):
    """Records, weakly, the new CPU storages that the ops run in the block return: not a view of (or an
    in-place result on) one of the op's arguments. A storage's Python object lives exactly as long as the
    storage (torch preserves it), so a weak reference tells whether the storage is still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.created: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                known = self.created.get(key)  # an address freed in the block may be given again
                if key not in given and storage.nbytes() and (known is None or known[0]() is None):
                    self.created[key] = (weakref.ref(storage), storage.nbytes())
        return out

    def alive_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self.created.values() if ref() is not None)


def storage_bytes(values: Any) -> int:
    """The bytes of the storages of the tensors in ``values`` (nested lists, tuples and dicts; None skipped), each
    storage counted once (views of one buffer share it)."""
    seen: dict[int, int] = {}
    _collect(values, seen)
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


def peak_bytes(device: torch.device, account: MemoryAccount, static: Callable[[], int]) -> int | None:
    """A stage's peak: on CUDA, the allocator's peak of its ``device``; elsewhere what it allocates once
    (``static()``) plus the peak of its ``account``, or None where it keeps none (``track_memory=False``, or a
    device that is neither)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if not account.enabled:
        return None
    return static() + account.peak
