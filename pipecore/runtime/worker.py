"""The stage worker: one stage's version logic around three compute hooks.

The executor hands a worker its actions in order. The worker asks its :class:`VersionBook` which weights
each action reads, runs the compute hook, and reports what happened. The symbolic worker (simulator)
has empty hooks; the tensor worker (training engine) fills them. Both go through this one class, so
the simulator's trace is exactly what the runtime does.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, Sequence

from ..algorithms.base import Algorithm, WeightRead
from ..schedule.ir import Action
from ..versions import BookMark, UpdateInfo, VersionBook


@dataclass
class Message:
    """What travels between stages: a payload (activation or gradient) and the stage-0 version tag."""

    payload: Any = None
    tag: int | None = None
    ready_at: float = 0.0  # simulated time at which the message reaches its consumer
    poisoned: bool = False  # the micro-batch had a non-finite loss; its update group must be skipped
    event: Any = None  # on a CUDA stream: the event the payload is ready at (None: ready now)


class Tally:
    """Running count, mean and maximum of integer observations (here: how stale the weights an action read
    were)."""

    __slots__ = ("count", "total", "max")

    def __init__(self) -> None:
        self.count, self.total, self.max = 0, 0, 0

    def add(self, value: int) -> None:
        self.count += 1
        self.total += value
        if value > self.max:
            self.max = value

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


_NO_READS: Mapping[int, WeightRead] = MappingProxyType({})
_new_tuple = tuple.__new__


class ActionRecord(NamedTuple):
    """What one action did: the reads per micro-batch, the live version then, and update info. A named tuple:
    one is made per action, built by ``tuple.__new__`` on the hot path (no Python call)."""

    reads: Mapping[int, WeightRead] = _NO_READS
    forward_reads: Mapping[int, WeightRead] = _NO_READS
    live: int = 0
    update: UpdateInfo | None = None


_NO_RECORD = ActionRecord()  # what a forward or backward returns when its worker keeps no records


class StageWorker:
    """Runs one stage's actions. Subclasses override the ``compute_*`` hooks to do real work.

    ``running``, ``action_range``, ``accept`` and ``stamp`` are overridden in a subclass, not set on an object:
    a worker whose class keeps the no-op ``action_range``, ``accept`` and ``stamp`` skips them (and what it
    would build only for them) on every action.
    """

    def __init__(self, algorithm: Algorithm, stage: int):
        self.algorithm = algorithm
        self.stage = stage
        self.book = VersionBook(algorithm, stage)
        # Update groups (micro-batch // update_every, counted from the schedule's start) whose loss was
        # non-finite; their updates are skipped. Learned from the backward messages, so it works across ranks.
        self.poisoned_groups: set[int] = set()
        # Set by a compute hook once the action has changed state it cannot give back (gradients added,
        # weights written): an action that fails before that point is undone and can run again.
        self.mutated = False
        #: The last action started, and whether, if it raised, it left no trace (the version book is back
        #: where it was, so it can run again).
        self.last_action: Action | None = None
        self.failed_cleanly = False
        #: Set by the executor before a backward whose W comes right after it on the rank: the stage may compute
        #: the weight gradients in the backward itself (one autograd pass instead of two).
        self.weights_at_once = False
        # Whether this class keeps the default no-op action_range, accept and stamp (the symbolic stage): the
        # actions then skip them, and the per-micro-batch objects made only for them.
        cls = type(self)
        self._bare = (cls.action_range is StageWorker.action_range and cls.accept is StageWorker.accept
                      and cls.stamp is StageWorker.stamp)
        # A subclass whose hooks are no-ops while nothing profiles (see plain_messages) sets these: the actions
        # then skip the hooks while ``_profiling()`` is false, one call in place of three.
        self._plain: bool = False
        self._profiling: Any = None
        #: What the completed actions read: ``staleness``, the live version minus the version read (every read);
        #: ``delays``, the live version at a backward minus the version its forward read.
        self.staleness = Tally()
        self.delays = Tally()
        #: Whether forwards and backwards report their reads in the :class:`ActionRecord` they return (the
        #: simulator's trace is made of them); False: an empty record (a training pipeline reads none).
        self.records = True

    def plain_messages(self, plain: bool) -> None:
        """Whether this stage's messages need nothing done to them: ``accept`` would return the payload as it
        is and ``stamp`` the message, and ``action_range`` None while nothing profiles (a subclass that says so
        sets ``_profiling``). Its caller knows where the messages come from (say, stages on the CPU of one
        process)."""
        self._plain = plain and self._profiling is not None

    # Hooks: the symbolic stage does no compute.
    def compute_forward(self, action: Action, read: WeightRead, payload: Any) -> Any:
        return None

    def compute_backward(
        self, action: Action, reads: Sequence[WeightRead], forward_reads: Sequence[WeightRead], payloads: Sequence[Any]
    ) -> list[Any]:
        return [None] * len(reads)

    def compute_weight_gradients(self) -> None:
        """Finish the last backward, if ``compute_backward`` left its weight gradients for after the send."""
        return None

    def compute_weight(self, action: Action) -> None:
        """A ``W`` action: the weight gradients its micro-batch's ``B`` left (zero-bubble schedules)."""
        return None

    def compute_update(self, action: Action, info: UpdateInfo) -> None:
        return None

    # Hooks for where and how the compute runs; the symbolic stage needs none of them.
    def running(self) -> AbstractContextManager[Any]:
        """Entered by the thread that runs this stage's actions, around a run of them (a tensor stage on
        CUDA makes its own stream current there)."""
        return nullcontext()

    def action_range(self, action: Action, reads: Mapping[int, WeightRead]) -> AbstractContextManager[Any] | None:
        """Around each action's compute: a profiler range named like the simulator's action (``"2B5@v3"``), or
        None when there is nothing to record (the action then runs without entering a context)."""
        return None

    def accept(self, message: Message) -> Any:
        """The payload of a received message, ready to compute with on this stage (e.g. on its device)."""
        return message.payload

    def stamp(self, message: Message) -> Message:
        """An outgoing message, marked with when its payload is ready (e.g. a CUDA event)."""
        return message

    # The version logic, shared by every kind of stage.
    def forward(self, action: Action, message: Message) -> tuple[Message, ActionRecord]:
        book = self.book
        live = book.live
        # _begin, inline: this runs once per action.
        self.last_action, self.mutated, self.failed_cleanly = action, False, False
        mark = book.mark()
        k = action.index
        try:
            read, tag = book.forward(k, message.tag)
            if self._bare or (self._plain and not self._profiling()):
                payload = self.compute_forward(action, read, message.payload)
            else:
                around = self.action_range(action, {k: read})
                if around is None:
                    payload = self.compute_forward(action, read, self.accept(message))
                else:
                    with around:
                        payload = self.compute_forward(action, read, self.accept(message))
        except BaseException:
            self._failed(mark)
            raise
        self.staleness.add(live - read.version)
        out = Message(payload, tag)
        record = _new_tuple(ActionRecord, ({k: read}, _NO_READS, live, None)) if self.records else _NO_RECORD
        return out if self._bare or self._plain else self.stamp(out), record

    def backward(self, action: Action, messages: Sequence[Message]) -> tuple[list[Message], ActionRecord]:
        book = self.book
        live = book.live
        every = self.algorithm.update_every
        poisoned = self.poisoned_groups
        if action.count == 1 and len(messages) == 1:  # the common case, without the per-micro-batch lists
            k = action.index
            if messages[0].poisoned:
                poisoned.add(k // every)
            # _begin, inline: this runs once per action.
            self.last_action, self.mutated, self.failed_cleanly = action, False, False
            mark = book.mark()
            try:
                read, forward_read = book.backward(k)
                reads, forward_reads = [read], [forward_read]
                record = (_new_tuple(ActionRecord, ({k: read}, {k: forward_read}, live, None)) if self.records
                          else _NO_RECORD)
                if self._bare or (self._plain and not self._profiling()):
                    payloads = self.compute_backward(action, reads, forward_reads, [messages[0].payload])
                else:
                    around = self.action_range(action, {k: read})
                    if around is None:
                        payloads = self.compute_backward(action, reads, forward_reads, [self.accept(messages[0])])
                    else:
                        with around:
                            payloads = self.compute_backward(action, reads, forward_reads, [self.accept(messages[0])])
            except BaseException:
                self._failed(mark)
                raise
            book.release_backward()
            self.staleness.add(live - read.version)
            self.delays.add(live - forward_read.version)
            if not payloads:
                return [], record
            out = Message(payloads[0], poisoned=k // every in poisoned)
            return [out if self._bare or self._plain else self.stamp(out)], record
        microbatches = action.microbatches  # a property that builds a range: once per action
        for k, m in zip(microbatches, messages):
            if m.poisoned:
                poisoned.add(k // every)
        self.last_action, self.mutated, self.failed_cleanly = action, False, False
        mark = book.mark()
        try:
            pairs = [book.backward(k) for k in microbatches]
            reads = [p[0] for p in pairs]
            forward_reads = [p[1] for p in pairs]
            record = ActionRecord(dict(zip(microbatches, reads)), dict(zip(microbatches, forward_reads)),
                                  live=live)
            with self.action_range(action, record.reads) or nullcontext():
                payloads = self.compute_backward(action, reads, forward_reads, [self.accept(m) for m in messages])
        except BaseException:
            self._failed(mark)
            raise
        book.release_backward()
        for read, forward_read in zip(reads, forward_reads):
            self.staleness.add(live - read.version)
            self.delays.add(live - forward_read.version)
        stamp = self.stamp
        outs = [stamp(Message(p, poisoned=k // every in poisoned)) for k, p in zip(microbatches, payloads)]
        return outs, record

    def finish_backward(self) -> None:
        """Complete the last backward after its messages were sent (weight gradients, if deferred)."""
        self.compute_weight_gradients()

    def weight(self, action: Action) -> ActionRecord:
        """Run a ``W`` action. It reads the weights its ``B`` read (the graph that B kept) and asks the version
        book nothing: schedules that split backwards are synchronous."""
        live = self.book.live
        self.last_action, self.mutated, self.failed_cleanly = action, False, False
        try:
            if self._bare:
                self.compute_weight(action)
            else:
                with self.action_range(action, {}) or nullcontext():
                    self.compute_weight(action)
        except BaseException:
            self.failed_cleanly = not self.mutated
            raise
        return ActionRecord(live=live)

    def restart(self) -> None:
        """Begin a new schedule after a flush: version offsets and update groups count from here."""
        self.book.restart()
        self.poisoned_groups.clear()

    def update(self, action: Action) -> ActionRecord:
        live = self.book.live
        # _begin, inline: this runs once per action.
        self.last_action, self.mutated, self.failed_cleanly = action, False, False
        mark = self.book.mark()
        try:
            info = self.book.update()
            if info.new_version != self.book.base + action.index:
                raise RuntimeError(
                    f"stage {self.stage}: update {action} (schedule started at v{self.book.base}) would produce "
                    f"version {info.new_version}; the schedule "
                    "and the stage disagree on the update count"
                )
            if self._bare:
                self.compute_update(action, info)
            else:
                with self.action_range(action, {}) or nullcontext():
                    self.compute_update(action, info)
        except BaseException:
            self._failed(mark)
            raise
        return ActionRecord(live=live, update=info)

    def _begin(self, action: Action) -> BookMark:
        self.last_action, self.mutated, self.failed_cleanly = action, False, False
        return self.book.mark()

    def _failed(self, mark: BookMark) -> None:
        """An action raised: undo its bookkeeping if its compute had not changed anything yet."""
        self.failed_cleanly = not self.mutated
        if self.failed_cleanly:
            self.book.rewind(mark)
