"""The local executor: runs every stage's action list in one process, with a timing model.

It first works out how far every stage can get (the dependency closure of the schedule), then runs
each owned stage's actions up to there, handing each to that stage's worker and the produced messages to
the transport, and (keeping events, as the simulator does) computes when the action would start and end
under the given costs (the stage is free and the input has arrived, plus a send time). Numerics do not depend on the global order, only on
each stage's own order, which the schedule fixes.

The executor can stop before the end: ``run(available=n)`` executes every action it can without a
stage-0 forward of micro-batch ``n`` or later, so a pipeline can keep running across ``step()`` calls.

A schedule with several stages per rank (``Schedule.ranks``) runs each rank's single list in its order: one
thread per rank, and a rank is busy with one action at a time in the timing model. Weight-gradient actions
(``W``) finish a split backward on their stage.

Two ways to run the same actions: in turn on the calling thread, or (given ``threads``) each rank on its
own worker thread, which waits for its next action's message in a mailbox (and, for tied weights, for the other
owners' progress) without holding the GIL. Either way every stage executes the same actions in the same
order, which is all its numerics depend on, so both give the same bits. With threads, a run queues each
stage's share as a job and may return before the jobs are done (``run(until=...)``); later runs queue behind
them, and :meth:`Executor.settle` waits for all.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping, Sequence

from .. import _C
from ..schedule.ir import Action, B, F, Kind, W
from ..schedule.periodic import PeriodicRow
from ..schedule.progress import positions, rank_cursor, runnable
from ..schedule.schedule import Schedule
from ..schedule.validate import ScheduleError, is_valid
from .threads import StageThreads
from .transport import KEY_SHIFT, LocalTransport, Transport
from .worker import ActionRecord, Message, StageWorker

_RECHECKED = 64
_POLL = 0.05  # seconds between the caller's checks for Ctrl-C while it waits for a stage thread
_NO_WINDOW: tuple[int, int, Sequence[Action]] = (0, 0, ())  # no block of a row read yet (see _block_of)
_NO_GRADIENT = Message()  # what the last stage's backward receives (no gradient travels to it); never changed


def _block_of(row: Sequence[Action], i: int) -> tuple[int, Sequence[Action]]:
    """The run of ``row``'s actions that holds position ``i``, as ``(start, actions)``: a periodic row's
    head, body copy or tail (indexing one action of it is a Python call), any other row whole."""
    return row.block(i) if type(row) is PeriodicRow else (0, row)


def _mailbox_of(transport: Transport) -> Any:
    """The mailbox of a :class:`LocalTransport` whose ``ready`` and ``send`` are its class's (not a subclass's,
    nor replaced on the object, which may add to them), else None: the hot path checks for and posts messages
    there directly, under the transport's keys (one C call instead of two Python calls and one)."""
    if type(transport) is not LocalTransport or "ready" in vars(transport) or "send" in vars(transport):
        return None
    return transport.mailbox


@dataclass(frozen=True)
class Costs:
    """Per-stage times of one forward and one backward of a micro-batch, an update, and a send.

    ``weight`` is the weight-gradient part of a backward: a schedule that splits backwards runs it as its own
    action (``W``) and its ``B`` costs ``backward``; one that does not pays ``backward + weight`` for a ``B``.
    A send between two stages on the same rank costs nothing.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    update: tuple[float, ...]
    send: float = 0.0
    weight: tuple[float, ...] | None = None  # None: zeros

    def __post_init__(self) -> None:
        if self.weight is None:
            object.__setattr__(self, "weight", (0.0,) * len(self.forward))

    @classmethod
    def uniform(cls, num_stages: int, forward: float = 1.0, backward: float = 2.0, update: float = 0.0,
                send: float = 0.0, weight: float = 0.0) -> "Costs":
        return cls((forward,) * num_stages, (backward,) * num_stages, (update,) * num_stages, send,
                   (weight,) * num_stages)

    def of(self, action: Action, split: bool = False) -> float:
        """The time of ``action``; ``split``: its stage's schedule splits backwards (a B without its W part)."""
        if action.kind is F:
            return self.forward[action.stage]
        if action.kind is B:
            assert self.weight is not None
            whole = self.backward[action.stage] + (0.0 if split else self.weight[action.stage])
            return whole * action.count
        if action.kind is W:
            assert self.weight is not None
            return self.weight[action.stage]
        return self.update[action.stage]


@dataclass
class Event:
    """One executed action with its simulated start and end time and what the worker reported."""

    action: Action
    start: float
    end: float
    record: ActionRecord


@dataclass
class Executor:
    """Executes a schedule over the workers of the stages this process owns. See :meth:`run`.

    In one process ``workers`` holds every stage and the transport is a mailbox; under ``torch.distributed``
    it holds this rank's stage and the transport sends tensors to the neighbouring ranks. Simulated times
    travel with the messages (``Message.ready_at``), so the timeline is exact for the local case.
    """

    schedule: Schedule
    workers: Mapping[int, StageWorker]
    costs: Costs
    transport: Transport = field(default_factory=LocalTransport)
    source: Callable[[int], Any] = lambda microbatch: None
    #: Place every action on the simulated timeline and keep its :class:`Event` in ``events`` (the simulator);
    #: False: no timeline at all (a training pipeline reads no simulated times; messages keep ``ready_at`` 0).
    keep_events: bool = True
    #: Called with each action of the ``recorded_stages`` and its worker's record (empty where the worker keeps
    #: no records, see ``StageWorker.records``) once the action has run (both fixed at construction).
    on_record: Callable[[Action, ActionRecord], None] | None = None
    #: The stages whose actions ``on_record`` is told of (None: every stage's).
    recorded_stages: frozenset[int] | None = None
    #: Further work an action waits for besides its upstream message, as ``(stage, kind, micro-batch)``
    #: (the tied-weight owners' backwards before an update); checked here for stages this process runs.
    needs: Callable[[Action], Sequence[tuple[int, Kind, int]]] | None = None
    #: Run each stage that has work on its own thread of this pool (the transport must block in ``receive``
    #: and support ``abort``, as :class:`LocalTransport` does); None: run the stages in turn on this thread.
    threads: StageThreads | None = None
    #: Entered around every run of actions on the calling thread (in turn), as a stage thread's setup runs on
    #: that thread (e.g. the stages' intra-op thread count, on which a reduction's bits depend); None: nothing.
    calling_thread: Callable[[], AbstractContextManager[Any]] | None = None
    events: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.workers, Mapping):
            self.workers = dict(enumerate(self.workers))
        P = self.schedule.num_stages
        bad = [s for s in self.workers if not 0 <= s < P]
        if bad:
            raise ValueError(f"workers given for stages {bad}; the schedule has stages 0..{P - 1}")
        self.cursor = [0] * P
        self._layout(self.schedule)
        # Per stage: whether on_record hears of its actions (one list lookup per action).
        self._recorded = [self.on_record is not None and (self.recorded_stages is None or s in self.recorded_stages)
                          for s in range(P)]
        # The ranks this process runs: those whose every stage has a worker here.
        self.lanes = [r for r in range(self.schedule.num_ranks)
                      if all(s in self.workers for s in self.schedule.stages_of(r))]
        partial_ranks = sorted({self._rank[s] for s in self.workers} - set(self.lanes))
        if partial_ranks:
            raise ValueError(f"workers given for some of the stages of ranks {partial_ranks}; a rank's stages run "
                             "on one thread, so give a worker for each or for none")
        self.lane_cursor = [0] * self.schedule.num_ranks
        self.rank_free = [0.0] * self.schedule.num_ranks
        # In-process mailboxes: a stage whose message is not there yet can wait for another stage's turn.
        self._local = isinstance(self.transport, LocalTransport)
        self._mailbox = _mailbox_of(self.transport)
        self._index = positions(self.schedule)
        # Actions handed out: every stage will have run up to here once the stage threads settle (the
        # cursors are where each stage is now).
        self.planned = [0] * P
        self._progress: Any = None  # per-stage cursors (stage threads): tied-weight updates and the caller wait on them
        self._failures: list[tuple[int, Action | None, BaseException]] = []  # appended by the stage threads
        # The error that stopped a run: the action it interrupted is half done, so no run can follow (until
        # :meth:`recover`).
        self.failure: BaseException | None = None
        # The actions that raised, each with whether it left no trace (it can run again): a stage thread's error
        # stops the others between actions.
        self.failed_actions: list[tuple[Action, bool]] = []

    def extend(self, schedule: Schedule) -> None:
        """Continue with a longer (or drained) schedule that agrees with everything executed so far.

        Only the last ``_RECHECKED`` executed actions of each stage are compared: comparing them all would
        cost time proportional to the steps since the last flush, at every extension.
        """
        for s, row in enumerate(schedule.stages):
            done = self.planned[s]  # what stage threads are running agrees as well
            old = self.schedule.stages[s]
            if isinstance(row, PeriodicRow) and row.shares_prefix(old, done):
                continue  # one more copy of the same form (each step's extension): agrees by construction
            start = max(0, done - _RECHECKED)
            if len(row) < done or tuple(row[start:done]) != tuple(old[start:done]):
                raise ValueError(f"stage {s}: the new schedule does not continue the executed prefix")
        self.schedule = schedule
        self._index = positions(schedule)
        self._layout(schedule)

    def _layout(self, schedule: Schedule) -> None:
        """Per-stage facts the hot path reads: each stage's rank, whether its B leaves a W, and the rank lists."""
        placement = schedule.placement
        if hasattr(self, "_rank") and tuple(self._rank) != placement:
            raise ValueError(f"the new schedule places the stages on ranks {placement}, not {tuple(self._rank)}")
        self._rank = list(placement)
        self._last = schedule.num_stages - 1
        self._split = [schedule.splits_backward(s) for s in range(schedule.num_stages)]
        self._rank_rows = schedule.rank_rows

    def run(self, available: int | None = None, until: tuple[int, Kind, int] | None = None) -> None:
        """Run every action that can run; with ``available``, forwards of micro-batch ``available`` and
        later cannot (their input has not been given yet). Without it, the schedule must finish.

        With stage threads and ``until`` (an action ``(stage, kind, micro-batch)`` of a stage this process
        runs, among those this run can reach), return as soon as that action has run: the threads go on
        with the rest while the caller works, and :meth:`settle` waits for them.
        """
        self._check_failure()
        self._mailbox = _mailbox_of(self.transport)  # the transport may have been replaced since
        rows = self.schedule.stages
        if (self.threads is None and self._local and len(self.workers) == self.schedule.num_stages
                and (available is not None
                     or (self.needs is None and is_valid(self.schedule) and not any(self.planned)))):
            # Every stage is here and runs on this thread: the dependency closure is what running in turn
            # until no rank can go on reaches, so it need not be computed first (a walk over every action).
            # Without ``available`` the schedule must finish: a validated schedule does, from its start.
            try:
                with self._on_calling_thread():
                    self._run_in_turn(None, available)
            except BaseException as exc:
                self.failure = exc
                raise
            self.planned = list(self.cursor)
            return
        target = runnable(self.schedule, self.planned, available, self._index, self.needs)
        if available is None and any(t < len(rows[s]) for s, t in enumerate(target)):
            blocked = next(rows[s][t] for s, t in enumerate(target) if t < len(rows[s]))
            raise ScheduleError("deadlock: no stage can make progress", self.schedule, blocked)
        stages_of = self.schedule.stages_of
        busy = [r for r in self.lanes if any(self.planned[s] < target[s] for s in stages_of(r))]
        threads = self.threads
        if threads is not None and (threads.pending or self._failures or len(busy) > 1):
            self._submit(busy, target)
            self.planned = list(target)
            if until is None or until[0] not in self.workers:
                self.settle()
            else:
                self._wait_until(until)
        else:
            try:
                with self._on_calling_thread():
                    self._run_in_turn(target)
            except BaseException as exc:
                self.failure = exc
                raise
            self.planned = list(target)
        # Other stages advance in other processes; the local cursors of stages not owned stay behind.
        for s in range(len(rows)):
            if s not in self.workers:
                self.cursor[s] = target[s]

    def _on_calling_thread(self) -> AbstractContextManager[Any]:
        return nullcontext() if self.calling_thread is None else self.calling_thread()

    def settle(self) -> None:
        """Wait until the stage threads have run every action handed to them. Raises the first error a stage
        thread met (noting the stage and action), or ``KeyboardInterrupt`` if the caller was interrupted
        while waiting, once every stage thread has stopped. Returns at once without stage threads."""
        self._check_failure(settling=True)
        threads = self.threads
        if threads is None or (not threads.pending and not self._failures):
            return
        try:
            try:
                threads.wait(on_interrupt=self._interrupted)
            finally:
                self.transport.resume()
                self._progress.reset()
            if self._failures:
                s, action, exc = self._failures[0]
                exc.add_note(f"raised by stage {s}'s worker thread" + (f", running {action}" if action is not None else ""))
                raise exc
        except BaseException as exc:
            self.failure = exc
            raise

    def check(self) -> None:
        """Raise the error a stage thread met after the last run returned (``run(until=...)``), if any."""
        self._check_failure()

    def _check_failure(self, settling: bool = False) -> None:
        if self.failure is not None:
            raise RuntimeError(
                f"an earlier run stopped at an error ({type(self.failure).__name__}: {self.failure}); the action it "
                "interrupted cannot be resumed, so this schedule cannot continue"
            ) from self.failure
        if self._failures and not settling:
            self.settle()  # a stage thread failed after the last run returned: raise its error now

    def _run_in_turn(self, target: Sequence[int] | None, available: int | None = None) -> None:
        """Run the ranks in turn on this thread, each as far as its messages allow, up to ``target`` (per stage;
        None: as far as they go without forwards of micro-batch ``available`` or later)."""
        rows = self.schedule.rank_rows
        last = self.schedule.num_stages - 1
        ready, needs, cursor, lane_cursor, workers, execute = self.transport.ready, self.needs, self.cursor, \
            self.lane_cursor, self.workers, self._execute
        contains = None if self._mailbox is None else self._mailbox.contains
        windows: dict[int, tuple[int, int, Sequence[Action]]] = {}  # rank -> the block of its row being run
        progressed = True
        while progressed:
            progressed = False
            for r in self.lanes:
                row = rows[r]
                end = len(row)
                c = lane_cursor[r]
                start, stop, block = windows.get(r, _NO_WINDOW)
                while c < end:
                    if c >= stop:  # (a rank's cursor only moves on within a run)
                        start, block = _block_of(row, c)
                        stop = start + len(block)
                        windows[r] = (start, stop, block)
                    action = block[c - start]
                    s, kind = action.stage, action.kind
                    if target is not None and cursor[s] >= target[s]:
                        break
                    # The upstream message (see schedule.upstream), checked inline: this runs once per action.
                    if kind is F:
                        if available is not None and action.index >= available:
                            break
                        if s > 0 and not (ready(s, F, action.index) if contains is None
                                          else contains(action.index << KEY_SHIFT | s << 1)):
                            break
                    elif kind is B and s < last and not (
                            ready(s, B, action.index + action.count - 1) if contains is None
                            else contains((action.index + action.count - 1) << KEY_SHIFT | s << 1 | 1)):
                        break
                    if needs is not None and not all(
                            self._index[n] < cursor[n[0]] for n in needs(action) if n[0] in workers):
                        break
                    execute(action)
                    c += 1
                    lane_cursor[r] = c
                    cursor[s] += 1
                    progressed = True

    def _submit(self, lanes: Sequence[int], target: Sequence[int]) -> None:
        """Queue, on each of ``lanes``' (ranks') threads, a job running that rank up to ``target`` (per stage). The
        first error stops every thread (a waiting one is woken by aborting the mailboxes and the progress
        counters); :meth:`settle` raises it."""
        assert self.threads is not None
        if self._progress is None:
            self._progress = _C.Progress(self.schedule.num_stages)
        if not self.threads.pending:  # the threads are idle: their cursors are final until these jobs start
            for s in self.workers:
                self._progress.set(s, self.cursor[s])
        # The caller's torch thread-local state (grad mode, autocast, an active profiler) applies on every
        # stage thread, as it does when the stages run in turn on the caller's thread.
        caller = _C.ThreadState()
        ends = tuple(target)
        self.threads.submit({r: partial(self._work, r, ends, caller) for r in lanes})

    def _work(self, r: int, ends: Sequence[int], caller: Any) -> None:
        """Rank ``r``'s job on its thread: run its list while its stages are short of ``ends``."""
        failures, progress, needs, index = self._failures, self._progress, self.needs, self._index
        cursor, lane_cursor = self.cursor, self.lane_cursor
        action = None
        try:
            with caller.enter(), ExitStack() as running:
                for s in self.schedule.stages_of(r):
                    running.enter_context(self.workers[s].running())
                row = self.schedule.rank_rows[r]
                start, stop, block = _NO_WINDOW
                while lane_cursor[r] < len(row) and not failures:
                    c = lane_cursor[r]
                    if c >= stop:  # (the rank's cursor only moves on within a job)
                        start, block = _block_of(row, c)
                        stop = start + len(block)
                    action = block[c - start]
                    s = action.stage
                    if cursor[s] >= ends[s]:
                        break
                    if needs is not None:
                        for n in needs(action):
                            if n[0] in self.workers:
                                progress.wait_at_least(n[0], index[n] + 1)
                    self._execute(action)
                    lane_cursor[r] += 1
                    cursor[s] += 1
                    progress.set(s, cursor[s])
        except _C.Aborted:
            pass  # another stage failed first; its error is the one raised
        except BaseException as exc:  # noqa: B902 - re-raised on the calling thread by settle()
            if action is not None and not any(a == action for a, _ in self.failed_actions):
                self.failed_actions.append((action, True))  # it failed waiting, before it started
            failures.append((action.stage if action is not None else r, action, exc))
            self._stop_all(f"stage {action.stage if action is not None else r} failed")

    def _stop_all(self, reason: str) -> None:
        self.transport.abort(reason)
        self._progress.abort(reason)

    def _interrupted(self) -> None:
        self._failures.append((-1, None, KeyboardInterrupt()))
        self._stop_all("the run was interrupted")

    def _wait_until(self, until: tuple[int, Kind, int]) -> None:
        """Wait for the action ``until`` on its stage thread; a stage's error or an interrupt settles."""
        s, position = until[0], self._index[until] + 1
        try:
            while not self._failures:
                try:
                    self._progress.wait_at_least(s, position, _POLL)
                    return
                except TimeoutError:
                    continue  # short waits, so that Ctrl-C is seen (see StageThreads.wait)
        except _C.Aborted:
            pass  # a stage failed: settle() raises its error
        except BaseException:
            self._interrupted()
        self.settle()

    def recover(self, schedule: Schedule, keep: Callable[[Action], bool],
                drop_message: Callable[[int, Kind, int], bool]) -> None:
        """After a failed run, go on with ``schedule`` as if only the executed actions that ``keep`` accepts had
        run (the stages' state was taken back to match): those must be the start of each stage's new action
        list. Messages for which ``drop_message(stage, kind, micro-batch)`` is true are thrown away; the others
        stay for their consumers. The stage threads must have stopped (the failed run settled)."""
        # Stages of other processes start the new schedule from the beginning: the dependency closure then
        # lets them run as far as they can, as it always assumes for them.
        new_cursor = [0] * schedule.num_stages
        for s in self.workers:
            kept = [a for a in self.schedule.stages[s][:self.cursor[s]] if keep(a)]
            row = schedule.stages[s]
            if tuple(row[:len(kept)]) != tuple(kept):
                raise ValueError(f"stage {s}: the actions kept ({kept[-4:]}...) do not start the new schedule's "
                                 f"({list(row[:len(kept)])[-4:]}...)")
            new_cursor[s] = len(kept)
        self.cursor = new_cursor
        self.planned = list(new_cursor)
        self.schedule = schedule
        self._index = positions(schedule)
        self._layout(schedule)
        self.lane_cursor = [rank_cursor(schedule, new_cursor, r) for r in range(schedule.num_ranks)]
        self.transport.resume()
        self.transport.drop(drop_message)
        if self._progress is not None:
            self._progress.reset()
            for s in self.workers:
                self._progress.set(s, self.cursor[s])
        self.failure = None
        self._failures.clear()
        self.failed_actions.clear()

    def _execute(self, action: Action) -> None:
        """Run one action on its stage's worker and hand its messages on; with ``keep_events``, place it on the
        simulated timeline. An action that raises is noted in ``failed_actions``, with whether it left no
        trace. (One method: this runs once per action.)"""
        s = action.stage
        worker = self.workers[s]
        try:
            kind = action.kind
            timeline = self.keep_events
            if kind is F:
                k = action.index
                incoming = self.transport.receive(s, F, k) if s > 0 else Message(self.source(k))
                try:
                    out, record = worker.forward(action, incoming)
                except BaseException:
                    if worker.failed_cleanly and s > 0:
                        self.transport.give_back(s, F, k, incoming)  # the action can run again: give its input back
                    raise
                if timeline:
                    start, end = self._clock(s, (incoming,), self.costs.forward[s])
                if s < self._last:
                    if timeline:
                        out.ready_at = self._arrival(s, s + 1, end)
                    if self._mailbox is None:
                        self.transport.send(s + 1, F, k, out)
                    else:
                        self._mailbox.put(k << KEY_SHIFT | (s + 1) << 1, out)
            elif kind is B:
                last = self._last
                if action.count == 1:  # one micro-batch: its gradient, without the lists of several
                    k = action.index
                    incoming = [self.transport.receive(s, B, k) if s < last else _NO_GRADIENT]
                else:
                    microbatches = action.microbatches  # a property that builds a range: once per action
                    incoming = self._receive_gradients(s, microbatches) if s < last else \
                        [_NO_GRADIENT] * len(microbatches)
                split = self._split[s]
                if split:
                    # Whether this B's own W comes next on the rank (see StageWorker.weights_at_once).
                    row = self._rank_rows[self._rank[s]]
                    i = self.lane_cursor[self._rank[s]] + 1
                    following = row[i] if i < len(row) else None
                    worker.weights_at_once = (following is not None and following.kind is W
                                              and following.stage == s and following.index == action.index)
                try:
                    outs, record = worker.backward(action, incoming)
                except BaseException:
                    if worker.failed_cleanly and s < last:
                        for k, m in zip(action.microbatches, incoming):
                            self.transport.give_back(s, B, k, m)
                    raise
                if timeline:
                    costs = self.costs
                    start, end = self._clock(s, incoming, (costs.backward[s] + (0.0 if split else costs.weight[s]))
                                             * action.count)
                if s > 0:
                    if timeline:
                        ready_at = self._arrival(s, s - 1, end)
                    mailbox = self._mailbox
                    for k, m in zip(action.microbatches if action.count > 1 else (action.index,), outs):
                        if timeline:
                            m.ready_at = ready_at
                        if mailbox is None:
                            self.transport.send(s - 1, B, k, m)
                        else:
                            mailbox.put(k << KEY_SHIFT | (s - 1) << 1 | 1, m)
                if not split:
                    worker.finish_backward()  # after the send: the upstream stage waits only for the input gradient
            elif kind is W:
                record = worker.weight(action)
                if timeline:
                    start, end = self._clock(s, (), self.costs.weight[s])
            else:
                record = worker.update(action)
                if timeline:
                    start, end = self._clock(s, (), self.costs.update[s])
            if timeline:
                self.events.append(Event(action, start, end, record))
            if self._recorded[s]:
                self.on_record(action, record)
        except BaseException:
            self.failed_actions.append((action, worker.failed_cleanly if worker.last_action == action else True))
            raise

    def _clock(self, stage: int, incoming: Sequence[Message], duration: float) -> tuple[float, float]:
        """The simulated start and end of an action of ``stage`` that takes ``duration``: it starts once its
        rank is free and its ``incoming`` messages have arrived, and keeps the rank busy until it ends."""
        rank = self._rank[stage]
        start = max([self.rank_free[rank]] + [m.ready_at for m in incoming])
        end = self.rank_free[rank] = start + duration
        return start, end

    def _arrival(self, stage: int, to: int, end: float) -> float:
        """When a message ``stage`` sends at ``end`` reaches stage ``to``: a send costs time between ranks only."""
        return end + (self.costs.send if self._rank[to] != self._rank[stage] else 0.0)

    def _receive_gradients(self, stage: int, microbatches: Sequence[int]) -> list[Message]:
        """The gradients a backward of several micro-batches takes. If one receive fails (the run was aborted
        while the stage waited, or before), those already taken go back to the mailbox: the action runs again
        after a recovery and needs them all."""
        received: list[Message] = []
        try:
            for k in microbatches:
                received.append(self.transport.receive(stage, B, k))
        except BaseException:
            for k, message in zip(microbatches, received):
                self.transport.give_back(stage, B, k, message)
            raise
        return received

