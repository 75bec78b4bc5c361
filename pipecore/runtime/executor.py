"""The local executor: runs every stage's action list in one process, with a timing model.

It picks, stage by stage, each next action whose input has arrived, hands it to that stage's worker,
routes the produced messages, and computes when the action would start and end under the given costs
(the stage is free and the input has arrived, plus a send time). Numerics do not depend on the global
order, only on each stage's own order, which the schedule fixes.

The executor can stop before the end: ``run(available=n)`` executes every action it can without a
stage-0 forward of micro-batch ``n`` or later, so a pipeline can keep running across ``step()`` calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..schedule.ir import Action, B, F, Kind, U
from ..schedule.schedule import Schedule, upstream
from ..schedule.validate import ScheduleError
from .worker import ActionRecord, Message, StageWorker


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
        if action.kind is U:
            return self.update[action.stage]
        return 0.0


@dataclass
class Event:
    """One executed action with its simulated start and end time and what the worker reported."""

    action: Action
    start: float
    end: float
    record: ActionRecord


@dataclass
class Executor:
    """Executes a schedule over one worker per stage. Reusable across calls; see :meth:`run`."""

    schedule: Schedule
    workers: Sequence[StageWorker]
    costs: Costs
    source: Callable[[int], Any] = lambda microbatch: None
    keep_events: bool = True
    on_event: Callable[[Event], None] | None = None
    events: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        P = self.schedule.num_stages
        if len(self.workers) != P:
            raise ValueError(f"{P} stages need {P} workers, got {len(self.workers)}")
        self.cursor = [0] * P
        self.stage_free = [0.0] * P
        self.finished: dict[tuple[int, Kind, int], float] = {}
        self.mailbox: dict[tuple[int, Kind, int], Message] = {}

    def extend(self, schedule: Schedule) -> None:
        """Continue with a longer (or drained) schedule that agrees with everything executed so far."""
        for s, row in enumerate(schedule.stages):
            done = self.schedule.stages[s][: self.cursor[s]]
            if tuple(row[: len(done)]) != tuple(done):
                raise ValueError(f"stage {s}: the new schedule does not continue the executed prefix")
        self.schedule = schedule

    @property
    def done(self) -> bool:
        return all(c == len(row) for c, row in zip(self.cursor, self.schedule.stages))

    def _ready_at(self, action: Action) -> float | None:
        """When the action's input is available, or None if it has not been produced yet."""
        need = upstream(action, self.schedule.num_stages)
        if need is None:
            return 0.0
        finished = self.finished.get(need)
        return None if finished is None else finished + self.costs.send

    def run(self, available: int | None = None) -> None:
        """Run until every stage is finished or blocked; with ``available``, stage-0 forwards of
        micro-batch ``available`` and later count as blocked (their input has not been given yet)."""
        P = self.schedule.num_stages
        rows = self.schedule.stages
        progressed = True
        while progressed:
            progressed = False
            for s in range(P):
                while self.cursor[s] < len(rows[s]):
                    action = rows[s][self.cursor[s]]
                    if available is not None and s == 0 and action.kind is F and action.index >= available:
                        break
                    ready = self._ready_at(action)
                    if ready is None:
                        break
                    need = upstream(action, P)
                    if need is not None:
                        del self.finished[need]  # each finish time is consumed by exactly one action
                    self._execute(action, max(ready, self.stage_free[s]))
                    self.cursor[s] += 1
                    progressed = True
        if available is None and not self.done:
            blocked = next(rows[s][c] for s, c in enumerate(self.cursor) if c < len(rows[s]))
            raise ScheduleError("deadlock: no stage can make progress", self.schedule, blocked)

    def _execute(self, action: Action, start: float) -> None:
        worker = self.workers[action.stage]
        s, last = action.stage, self.schedule.num_stages - 1
        if action.kind is F:
            incoming = self.mailbox.pop((s, F, action.index), None) if s > 0 else Message(self.source(action.index))
            out, record = worker.forward(action, incoming)
            if s < last:
                self.mailbox[(s + 1, F, action.index)] = out
        elif action.kind is B:
            incoming = [self.mailbox.pop((s, B, k), Message()) for k in action.microbatches]
            outs, record = worker.backward(action, incoming)
            if s > 0:
                for k, out in zip(action.microbatches, outs):
                    self.mailbox[(s - 1, B, k)] = out
        elif action.kind is U:
            record = worker.update(action)
        else:
            raise ValueError(f"the local executor runs F, B and U actions; lowered action {action} is not one")
        end = start + self.costs.of(action)
        self.stage_free[s] = end
        # Record finish times only where a later action waits on them (see ``upstream``).
        if action.kind is F and s < last:
            self.finished[(s, F, action.index)] = end
        elif action.kind is B and s > 0:
            self.finished[(s, B, action.index + action.count - 1)] = end
        event = Event(action, start, end, record)
        if self.keep_events:
            self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)
