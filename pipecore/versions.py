"""Per-stage weight-version bookkeeping, shared by the simulator and the real runtime.

A :class:`VersionBook` follows one stage through its actions: which version is live, which versions a
forward or backward reads (asking the algorithm's version policy), which versions are pinned by
in-flight micro-batches, and which versions must still be held. It knows nothing about tensors; the
real stage uses its answers to pick ring slots, the symbolic stage records them as the trace.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import AbstractSet, NamedTuple

from .algorithms.base import Algorithm, Live, ReadContext, WeightRead, plain_read


_new_tuple = tuple.__new__
_set = object.__setattr__


class VersionError(RuntimeError):
    """A version policy asked for weights the stage no longer (or does not yet) hold."""


class BookMark(NamedTuple):
    """A version book's state at one moment, to go back to (:meth:`VersionBook.rewind`). A named tuple: one
    is taken before every action, and a frozen dataclass costs a Python call and six attribute writes.

    It costs the same however many micro-batches are in flight: instead of copies of the book's in-flight
    reads and pins, it holds the changes the book makes to them after it (its journal, oldest first)."""

    live: int
    updates: int
    held: AbstractSet[int]  # not to be changed (the book's own set, which it replaces rather than changes)
    latest_tag: int | None
    # (micro-batch, its in-flight forward read before, after; None: none): a forward sets one (and pins its
    # version), a backward takes one away (and unpins it).
    changes: list[tuple[int, WeightRead | None, WeightRead | None]]
    # The versions held for updates to read (micro-batch -> version) and those the last update read, when the
    # algorithm's update reads the weights its gradients were computed at; None otherwise.
    awaiting: tuple[dict[int, int], tuple[int, ...]] | None


@dataclass(frozen=True)
class UpdateInfo:
    """The result of one update at a stage."""

    new_version: int
    keeps_previous: bool  # the previous live version is still needed, so the new one needs its own slot
    lr_scale: float
    index: int  # the stage's updates before this one (since construction or a checkpoint): lr_scale's index

    def __init__(self, new_version: int, keeps_previous: bool, lr_scale: float, index: int):
        # The dataclass's own __init__ in one write (see WeightRead.__init__): one per update.
        _set(self, "__dict__", {"new_version": new_version, "keeps_previous": keeps_previous, "lr_scale": lr_scale,
                                "index": index})


class VersionBook:
    """Version state of one stage: live version, pins, held versions, and the reads of in-flight work."""

    def __init__(self, algorithm: Algorithm, stage: int):
        self.algorithm = algorithm
        self.stage = stage
        self.live = 0
        self.held: set[int] = {0}  # replaced, never changed in place (a BookMark may share it)
        self.pins: Counter[int] = Counter()
        self.forward_reads: dict[int, WeightRead] = {}
        self.latest_tag: int | None = None
        self.peak_versions = 1
        self.updates = 0
        self.base = 0
        # The algorithm's policy, read once: forward, backward and _refresh run once per action.
        self._pins_forward = algorithm.pins_forward_weights
        self._stash = algorithm.backward_rule == "stash"  # a backward reads what its forward read
        self._oldest_is_live = algorithm.oldest_needed_is_live  # nothing older than live is named again
        plain = type(algorithm) is Algorithm  # not a subclass that may answer otherwise than its spec
        # Algorithm.forward_read's and backward_read's answers, without the calls that only forward to the rules.
        self._resolve_forward = algorithm.spec.forward.resolve if plain else None
        self._resolve_backward = algorithm.spec.backward.resolve if plain and not self._stash else None
        # Live's answer (the synchronous schedules' forward rule) needs no context: the live version's read.
        self._forward_is_live = plain and type(algorithm.spec.forward) is Live
        self._unscaled = plain and algorithm.spec.lr_scale is None  # Algorithm.lr_scale is 1.0
        # The latest mark's journal (see BookMark); None: no mark to go back to.
        self._changes: list[tuple[int, WeightRead | None, WeightRead | None]] | None = None
        # What every read context of this stage holds besides the action's own (see forward).
        self._num_stages, self._n_microbatches, self._options = (algorithm.num_stages, algorithm.n_microbatches,
                                                                 algorithm.options)
        # What the last _refresh left: the held set (the object) and a version older than which every held
        # version was pinned. While the held set is that object, a refresh need look only at the versions whose
        # pin count has dropped to zero since (_unpinned) and at those from there up to the oldest still needed.
        self._settled: tuple[AbstractSet[int], int] | None = None
        self._unpinned: list[int] = []
        # The algorithm's oldest_needed(stage, live, latest_tag), and the (live, latest_tag) it was asked for.
        self._needed = 0
        self._needed_for: tuple[int, int | None] | None = None
        # An update that reads the weights its gradients were computed at (a gradient transform such as delay
        # compensation): each backward's version stays held (one more pin) until the update that applies its
        # gradient has run. ``awaiting``: micro-batch -> version, until that update; ``update_reads``: the versions
        # the latest update's gradients were computed at (still held until the book's next action).
        transform = algorithm.gradient_transform(stage)
        self._hold_for_update = transform is not None and transform.reads_gradient_weights
        self.awaiting: dict[int, int] = {}
        self.update_reads: tuple[int, ...] = ()

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
        self.awaiting, self.update_reads = {}, ()
        self._changes = None  # the state was replaced: no mark can be gone back to

    def _check_held(self, read: WeightRead, what: str) -> None:
        for v in (read.version, read.other):
            if v is not None and v not in self.held:
                state = "not produced yet" if v > self.live else "no longer held"
                raise VersionError(
                    f"stage {self.stage}: {what} reads version {v}, which is {state} "
                    f"(live v{self.live}, held {sorted(self.held)})"
                )

    def _refresh(self) -> None:
        """Drop the held versions no future read names (older than the oldest needed) and no in-flight
        micro-batch pins; the live one stays."""
        live, held = self.live, self.held
        if len(held) == 1 and live in held:
            # Only the live version is held (the synchronous schedules, after every action): nothing to drop. What
            # the rule below keeps (the oldest needed, the settled versions) is a cache it recomputes when stale.
            self._unpinned.clear()
            return
        # Reads after a restart are counted from ``base``, so nothing older than it is named again.
        if self._oldest_is_live:
            needed = live
        else:  # asked again only when what it depends on changed (a rule's answer is a function of these)
            key = (live, self.latest_tag)
            if key != self._needed_for:
                self._needed = self.algorithm.oldest_needed(self.stage, live, self.latest_tag)
                self._needed_for = key
            needed = self._needed
        oldest = max(needed, self.base)
        settled, unpinned = self._settled, self._unpinned
        if settled is not None and settled[0] is held and live in held:
            # Every held version older than settled[1] is pinned, but those unpinned since: the rule below can
            # drop only those, and the versions from settled[1] up to ``oldest``.
            known = settled[1]
            if oldest > known:
                if oldest == known + 1:  # the usual step (an update): one version to look at
                    candidates = [known] if known in held else []
                else:
                    candidates = [v for v in held if known <= v < oldest]
                candidates += unpinned
                known = oldest
            else:
                candidates = unpinned
            if candidates:
                pins = self.pins
                gone = None
                for v in candidates:
                    if v < oldest and v != live and pins.get(v, 0) <= 0 and v in held:
                        gone = [v] if gone is None else gone + [v]
                if gone is not None:
                    held = self.held = held.difference(gone)
                unpinned.clear()
            if held is not settled[0] or known != settled[1]:
                self._settled = (held, known)
        else:
            if live not in held or min(held) < oldest:  # else every held version stays: the set is unchanged
                pins = self.pins
                held = self.held = {v for v in held if v >= oldest or pins.get(v, 0) > 0} | {live}
            unpinned.clear()
            self._settled = (held, oldest)
        if len(held) > self.peak_versions:
            self.peak_versions = len(held)

    def forward(self, microbatch: int, tag: int | None) -> tuple[WeightRead, int]:
        """Resolve the weights the forward of ``microbatch`` reads. Returns the read and the tag to send on.

        Stage 0 assigns the tag (its live version); later stages pass the received tag along.
        """
        if self.stage == 0 or tag is None:
            tag = self.live
        latest = self.latest_tag
        self.latest_tag = tag if latest is None or tag > latest else latest
        if self._forward_is_live:
            read = plain_read(self.live)
        else:
            ctx = ReadContext(self.stage, self._num_stages, microbatch, self._n_microbatches, self.live, tag, None,
                              self.base)
            resolve = self._resolve_forward
            read = self.algorithm.forward_read(ctx) if resolve is None else resolve(ctx, self._options)
        held = self.held
        if read.version not in held or (read.other is not None and read.other not in held):
            self._check_held(read, f"F of micro-batch {microbatch}")
        forward_reads = self.forward_reads
        if self._changes is not None:
            self._changes.append((microbatch, forward_reads.get(microbatch), read))
        forward_reads[microbatch] = read
        if self._pins_forward:
            pins = self.pins
            pins[read.version] = pins.get(read.version, 0) + 1
        self._refresh()
        return read, tag

    def backward(self, microbatch: int) -> tuple[WeightRead, WeightRead]:
        """Resolve the backward read of ``microbatch``; returns ``(backward read, forward read)``."""
        forward_reads = self.forward_reads
        forward_read = forward_reads.get(microbatch)
        if forward_read is None:
            raise VersionError(f"stage {self.stage}: backward of micro-batch {microbatch} before its forward")
        if self._stash:  # Algorithm.backward_read's answer, without the context it does not look at
            read = forward_read
        else:
            ctx = ReadContext(self.stage, self._num_stages, microbatch, self._n_microbatches, self.live, None,
                              forward_read.version, self.base)
            resolve = self._resolve_backward
            read = (self.algorithm.backward_read(ctx, forward_read) if resolve is None
                    else resolve(ctx, self._options))
        held = self.held
        if read.version not in held or (read.other is not None and read.other not in held):
            self._check_held(read, f"B of micro-batch {microbatch}")
        # The read is settled: the micro-batch leaves the in-flight ones (nothing below raises).
        del forward_reads[microbatch]
        if self._changes is not None:
            self._changes.append((microbatch, forward_read, None))
        if self._pins_forward:
            pins = self.pins
            version = forward_read.version
            left = pins.get(version, 0) - 1
            if left:
                pins[version] = left
            else:
                del pins[version]  # a long run would otherwise keep one entry per version
                self._unpinned.append(version)  # it may now be dropped (see _refresh)
        if self._hold_for_update:  # held until the update that applies this gradient has read it
            pins = self.pins
            pins[read.version] = pins.get(read.version, 0) + 1
            self.awaiting[microbatch] = read.version
        return read, forward_read

    def release_backward(self) -> None:
        """Drop versions the finished backward no longer needs (call after its compute)."""
        self._refresh()

    def update(self) -> UpdateInfo:
        """Advance the live version by one update."""
        index = self.updates
        lr_scale = 1.0 if self._unscaled else self.algorithm.lr_scale(self.stage, index)
        previous = self.live
        if self._hold_for_update:
            reads = self._take_awaiting(previous)
        self.live += 1
        self.updates += 1
        held = self.held
        self.held = held | {self.live}
        settled = self._settled
        if settled is not None and settled[0] is held and self.live >= settled[1]:
            self._settled = (self.held, settled[1])  # what _refresh knew of the held versions still holds
        self._refresh()
        info = UpdateInfo(self.live, previous in self.held, lr_scale, index)
        if self._hold_for_update:
            # Counted above (the ring holds them while the update writes the new version); the next refresh drops
            # them, after the stage's update has read them.
            self._release(v for v in reads if v != previous)
        return info

    def _take_awaiting(self, previous: int) -> tuple[int, ...]:
        """The versions the gradients of the update about to run were computed at (every backward since the last
        update), now :attr:`update_reads`. A hold of the live version ``previous`` goes at once: the update reads
        the live weights before its step overwrites them, so that version need not outlive it."""
        reads = tuple(self.awaiting.values())
        self.awaiting, self.update_reads = {}, reads
        self._release(v for v in reads if v == previous)
        return reads

    def _release(self, versions) -> None:
        pins = self.pins
        for v in versions:
            left = pins.get(v, 0) - 1
            if left > 0:
                pins[v] = left
            else:
                pins.pop(v, None)
                self._unpinned.append(v)

    def mark(self) -> BookMark:
        """The state now, for :meth:`rewind` (which goes back to the latest mark only)."""
        # tuple.__new__: the named tuple without its Python-level __new__ (this runs before every action). The
        # held set is replaced, never changed in place, so the mark can share it; the in-flight reads and the
        # pins are journaled from here on rather than copied (a stage may have dozens of micro-batches in flight).
        changes: list[tuple[int, WeightRead | None, WeightRead | None]] = []
        self._changes = changes
        awaiting = (dict(self.awaiting), self.update_reads) if self._hold_for_update else None
        return _new_tuple(BookMark, (self.live, self.updates, self.held, self.latest_tag, changes, awaiting))

    def rewind(self, mark: BookMark) -> None:
        """Go back to ``mark``, the latest (an action that failed before it changed anything else is undone this
        way)."""
        if mark.changes is not self._changes:
            raise ValueError(f"stage {self.stage}: a version book goes back to its latest mark only, and not across "
                             "a discard or a load")
        self.live, self.updates, self.latest_tag = mark.live, mark.updates, mark.latest_tag
        self.held = set(mark.held)
        forward_reads, pins, pinning = self.forward_reads, self.pins, self._pins_forward
        for k, before, after in reversed(mark.changes):
            if before is None:
                forward_reads.pop(k, None)
            else:
                forward_reads[k] = before
            if pinning:  # a forward pinned its read's version, a backward unpinned its forward's
                version, count = (after.version, pins.get(after.version, 0) - 1) if after is not None else \
                    (before.version, pins.get(before.version, 0) + 1)  # type: ignore[union-attr]
                if count:
                    pins[version] = count
                else:
                    pins.pop(version, None)
        if mark.awaiting is not None:  # the holds for updates as they were: put back those released, drop newer ones
            awaiting, self.update_reads = mark.awaiting
            for k, v in self.awaiting.items():
                if awaiting.get(k) != v:
                    self._release((v,))
            for k, v in awaiting.items():
                if self.awaiting.get(k) != v:
                    pins[v] = pins.get(v, 0) + 1
            self.awaiting = dict(awaiting)
        mark.changes.clear()

    def discard(self, first: int, live: int, updates: int, latest_tag: int | None) -> None:
        """Forget micro-batches ``first`` and later (their forwards, and the updates after version ``live``),
        keeping the earlier micro-batches in flight: live version ``live`` after ``updates`` updates."""
        self.forward_reads = {k: r for k, r in self.forward_reads.items() if k < first}
        self.pins = Counter(r.version for r in self.forward_reads.values()) if self.algorithm.pins_forward_weights \
            else Counter()
        if self._hold_for_update:  # the earlier micro-batches' gradients still wait for their update
            self.awaiting = {k: v for k, v in self.awaiting.items() if k < first}
            self.pins.update(self.awaiting.values())
            self.update_reads = ()
        self.live, self.updates, self.latest_tag = live, updates, latest_tag
        self.held = {v for v in self.held if v <= live} | {live}
        self._changes = None  # the state was replaced: no mark can be gone back to
        self._refresh()

    def in_flight(self) -> int:
        """Micro-batches forwarded here whose backward has not run yet."""
        return len(self.forward_reads)
