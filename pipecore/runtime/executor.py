"""The local executor: runs every stage's action list in one process, with a timing model.

It first works out how far every stage can get (the dependency closure of the schedule), then runs
each owned stage's actions up to there, handing each to that stage's worker and the produced messages to
the transport, and computes when the action would start and end under the given costs (the stage is
free and the input has arrived, plus a send time). Numerics do not depend on the global order, only on
each stage's own order, which the schedule fixes.

The executor can stop before the end: ``run(available=n)`` executes every action it can without a
stage-0 forward of micro-batch ``n`` or later, so a pipeline can keep running across ``step()`` calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..schedule.ir import Action, B, F, Kind, U
from ..schedule.progress import positions, runnable
from ..schedule.schedule import Schedule, upstream
from ..schedule.validate import ScheduleError
from .transport import LocalTransport, Transport
from .worker import ActionRecord, Message, StageWorker

_RECHECKED = 256


@dataclass(frozen=True)
class Costs:
    """Per-stage times of one forward and one backward of a micro-batch, an update, and a send."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    update: tuple[float, ...]
    send: float = 0.0

    @classmethod
    def uniform(cls, num_stages: int, forward: float = 1.0, backward: float = 2.0, update: float = 0.0,
                send: float = 0.0) -> "Costs":
        return cls((forward,) * num_stages, (backward,) * num_stages, (update,) * num_stages, send)

    def of(self, action: Action) -> float:
        if action.kind is F:
            return self.forward[action.stage]
        if action.kind is B:
            return self.backward[action.stage] * action.count
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
    keep_events: bool = True
    on_event: Callable[[Event], None] | None = None
    #: Further work an action waits for besides its upstream message, as ``(stage, kind, micro-batch)``
    #: (the tied-weight owners' backwards before an update); checked here for stages this process runs.
    needs: Callable[[Action], Sequence[tuple[int, Kind, int]]] | None = None
    events: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.workers, Mapping):
            self.workers = dict(enumerate(self.workers))
        P = self.schedule.num_stages
        bad = [s for s in self.workers if not 0 <= s < P]
        if bad:
            raise ValueError(f"workers given for stages {bad}; the schedule has stages 0..{P - 1}")
        self.cursor = [0] * P
        self.stage_free = [0.0] * P
        self._index = positions(self.schedule)

    def extend(self, schedule: Schedule) -> None:
        """Continue with a longer (or drained) schedule that agrees with everything executed so far.

        Only the last ``_RECHECKED`` executed actions of each stage are compared: comparing them all would
        cost time proportional to the steps since the last flush, at every extension.
        """
        for s, row in enumerate(schedule.stages):
            done = self.cursor[s]
            start = max(0, done - _RECHECKED)
            if len(row) < done or tuple(row[start:done]) != tuple(self.schedule.stages[s][start:done]):
                raise ValueError(f"stage {s}: the new schedule does not continue the executed prefix")
        self.schedule = schedule
        self._index = positions(schedule)

    def run(self, available: int | None = None) -> None:
        """Run every action that can run; with ``available``, forwards of micro-batch ``available`` and
        later cannot (their input has not been given yet). Without it, the schedule must finish."""
        rows = self.schedule.stages
        target = runnable(self.schedule, self.cursor, available, self._index, self.needs)
        if available is None and any(t < len(rows[s]) for s, t in enumerate(target)):
            blocked = next(rows[s][t] for s, t in enumerate(target) if t < len(rows[s]))
            raise ScheduleError("deadlock: no stage can make progress", self.schedule, blocked)
        progressed = True
        while progressed:
            progressed = False
            for s in self.workers:
                while self.cursor[s] < target[s]:
                    action = rows[s][self.cursor[s]]
                    need = upstream(action, self.schedule.num_stages)
                    if need is not None and not self.transport.ready(action.stage, action.kind, need[2]):
                        break
                    if self.needs is not None and not all(
                            self._index[n] < self.cursor[n[0]] for n in self.needs(action) if n[0] in self.workers):
                        break
                    self._execute(action)
                    self.cursor[s] += 1
                    progressed = True
        # Other stages advance in other processes; the local cursors of stages not owned stay behind.
        for s in range(len(rows)):
            if s not in self.workers:
                self.cursor[s] = target[s]

    def _execute(self, action: Action) -> None:
        worker = self.workers[action.stage]
        s, last = action.stage, self.schedule.num_stages - 1
        transport = self.transport
        if action.kind is F:
            incoming = transport.receive(s, F, action.index) if s > 0 else Message(self.source(action.index))
            start = max(self.stage_free[s], incoming.ready_at)
            out, record = worker.forward(action, incoming)
        elif action.kind is B:
            incoming = [transport.receive(s, B, k) if s < last else Message() for k in action.microbatches]
            start = max([self.stage_free[s]] + [m.ready_at for m in incoming])
            outs, record = worker.backward(action, incoming)
        else:
            start = self.stage_free[s]
            record = worker.update(action)
        end = start + self.costs.of(action)
        self.stage_free[s] = end
        if action.kind is F and s < last:
            out.ready_at = end + self.costs.send
            transport.send(s + 1, F, action.index, out)
        elif action.kind is B and s > 0:
            for k, m in zip(action.microbatches, outs):
                m.ready_at = end + self.costs.send
                transport.send(s - 1, B, k, m)
        if action.kind is B:
            worker.finish_backward()  # after the send: the upstream stage waits only for the input gradient
        event = Event(action, start, end, record)
        if self.keep_events:
            self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)
