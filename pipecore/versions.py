"""Per-stage weight-version bookkeeping, shared by the simulator and the real runtime.

A :class:`VersionBook` follows one stage through its actions: which version is live, which versions a
forward or backward reads (asking the algorithm's version policy), which versions are pinned by
in-flight micro-batches, and which versions must still be held. It knows nothing about tensors; the
real stage uses its answers to pick ring slots, the symbolic stage records them as the trace.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

from .algorithms.base import Algorithm, ReadContext, WeightRead


_new_tuple = tuple.__new__


class VersionError(RuntimeError):
    """A version policy asked for weights the stage no longer (or does not yet) hold."""


class BookMark(NamedTuple):
    """A version book's state at one moment, to go back to (:meth:`VersionBook.rewind`). A named tuple: one
    is taken before every action, and a frozen dataclass costs a Python call and six attribute writes."""

    live: int
    updates: int
    held: frozenset[int]
    pins: tuple[tuple[int, int], ...]
    forward_reads: tuple[tuple[int, WeightRead], ...]
    latest_tag: int | None


@dataclass(frozen=True)
class UpdateInfo:
    """The result of one update at a stage."""

    new_version: int
    keeps_previous: bool  # the previous live version is still needed, so the new one needs its own slot
    lr_scale: float
    index: int  # the stage's updates before this one (since construction or a checkpoint): lr_scale's index


class VersionBook:
    """Version state of one stage: live version, pins, held versions, and the reads of in-flight work."""

    def __init__(self, algorithm: Algorithm, stage: int):
        self.algorithm = algorithm
        self.stage = stage
        self.live = 0
        self.held: set[int] = {0}
        self.pins: Counter[int] = Counter()
        self.forward_reads: dict[int, WeightRead] = {}
        self.latest_tag: int | None = None
        self.peak_versions = 1
        self.updates = 0
        self.base = 0

    def restart(self) -> None:
        """Start a new schedule (after a flush): micro-batch numbering and version offsets begin again."""
        if self.forward_reads:
            raise VersionError(f"stage {self.stage}: cannot restart with micro-batches in flight {sorted(self.forward_reads)}")
        self.base = self.live
        self.latest_tag = None

    def load(self, live: int, updates: int) -> None:
        """Adopt a restored state: one held version ``live`` and ``updates`` updates so far."""
        self.restart()
        self.live = self.base = live
        self.updates = updates
        self.held = {live}
        self.pins.clear()

    def _context(self, microbatch: int, tag: int | None, forward_version: int | None) -> ReadContext:
        a = self.algorithm
        return ReadContext(
            self.stage, a.num_stages, microbatch, a.n_microbatches, self.live, tag, forward_version, self.base
        )

    def _check_held(self, read: WeightRead, what: str) -> None:
        for v in (read.version, read.other):
            if v is not None and v not in self.held:
                state = "not produced yet" if v > self.live else "no longer held"
                raise VersionError(
                    f"stage {self.stage}: {what} reads version {v}, which is {state} "
                    f"(live v{self.live}, held {sorted(self.held)})"
                )

    def _refresh(self) -> None:
        # Reads after a restart are counted from ``base``, so nothing older than it is named again.
        oldest = max(self.algorithm.oldest_needed(self.stage, self.live, self.latest_tag), self.base)
        self.held = {v for v in self.held if v >= oldest or self.pins[v] > 0} | {self.live}
        self.peak_versions = max(self.peak_versions, len(self.held))

    def forward(self, microbatch: int, tag: int | None) -> tuple[WeightRead, int]:
        """Resolve the weights the forward of ``microbatch`` reads. Returns the read and the tag to send on.

        Stage 0 assigns the tag (its live version); later stages pass the received tag along.
        """
        if self.stage == 0 or tag is None:
            tag = self.live
        self.latest_tag = tag if self.latest_tag is None else max(self.latest_tag, tag)
        read = self.algorithm.forward_read(self._context(microbatch, tag, None))
        self._check_held(read, f"F of micro-batch {microbatch}")
        self.forward_reads[microbatch] = read
        if self.algorithm.pins_forward_weights:
            self.pins[read.version] += 1
        self._refresh()
        return read, tag

    def backward(self, microbatch: int) -> tuple[WeightRead, WeightRead]:
        """Resolve the backward read of ``microbatch``; returns ``(backward read, forward read)``."""
        forward_read = self.forward_reads.pop(microbatch, None)
        if forward_read is None:
            raise VersionError(f"stage {self.stage}: backward of micro-batch {microbatch} before its forward")
        ctx = self._context(microbatch, None, forward_read.version)
        read = self.algorithm.backward_read(ctx, forward_read)
        self._check_held(read, f"B of micro-batch {microbatch}")
        if self.algorithm.pins_forward_weights:
            self.pins[forward_read.version] -= 1
            if not self.pins[forward_read.version]:
                del self.pins[forward_read.version]  # a long run would otherwise keep one entry per version
        return read, forward_read

    def release_backward(self) -> None:
        """Drop versions the finished backward no longer needs (call after its compute)."""
        self._refresh()

    def update(self) -> UpdateInfo:
        """Advance the live version by one update."""
        index = self.updates
        lr_scale = self.algorithm.lr_scale(self.stage, index)
        previous = self.live
        self.live += 1
        self.updates += 1
        self.held.add(self.live)
        self._refresh()
        return UpdateInfo(self.live, previous in self.held, lr_scale, index)

    def mark(self) -> BookMark:
        """The state now, for :meth:`rewind`."""
        # tuple.__new__: the named tuple without its Python-level __new__ (this runs before every action).
        return _new_tuple(BookMark, (self.live, self.updates, frozenset(self.held), tuple(self.pins.items()),
                                     tuple(self.forward_reads.items()), self.latest_tag))

    def rewind(self, mark: BookMark) -> None:
        """Go back to ``mark`` (an action that failed before it changed anything else is undone this way)."""
        self.live, self.updates, self.latest_tag = mark.live, mark.updates, mark.latest_tag
        self.held = set(mark.held)
        self.pins = Counter(dict(mark.pins))
        self.forward_reads = dict(mark.forward_reads)

    def discard(self, first: int, live: int, updates: int, latest_tag: int | None) -> None:
        """Forget micro-batches ``first`` and later (their forwards, and the updates after version ``live``),
        keeping the earlier micro-batches in flight: live version ``live`` after ``updates`` updates."""
        self.forward_reads = {k: r for k, r in self.forward_reads.items() if k < first}
        self.pins = Counter(r.version for r in self.forward_reads.values()) if self.algorithm.pins_forward_weights \
            else Counter()
        self.live, self.updates, self.latest_tag = live, updates, latest_tag
        self.held = {v for v in self.held if v <= live} | {live}
        self._refresh()

    def in_flight(self) -> int:
        """Micro-batches forwarded here whose backward has not run yet."""
        return len(self.forward_reads)
