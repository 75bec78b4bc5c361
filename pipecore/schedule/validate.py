"""Validation: reject schedules that cannot run, printing the table with the offending action marked."""

from __future__ import annotations

from .ir import Action, B, F, Kind, U
from .schedule import Schedule, upstream


class ScheduleError(ValueError):
    """An impossible schedule. ``action`` is the offending action (None when the problem is global)."""

    def __init__(self, message: str, schedule: Schedule, action: Action | None = None):
        self.action = action
        super().__init__(f"{message}\n{schedule.table(mark=action)}")


def validate(schedule: Schedule) -> Schedule:
    """Check a schedule and return it unchanged, or raise :class:`ScheduleError`.

    Checks: every stage forwards and backwards every micro-batch exactly once, each backward after its own
    forward; multi-micro-batch backwards cover the same ranges on every stage; updates are numbered
    1, 2, 3, ...; and the lists can run to completion (no dependency cycle between stages).
    """
    P = schedule.num_stages
    if len(schedule.stages) != P:
        raise ScheduleError(f"schedule declares {P} stages but has {len(schedule.stages)} rows", schedule)
    total = schedule.total_microbatches
    ranges_by_stage = []
    for s, row in enumerate(schedule.stages):
        forwarded: set[int] = set()
        backwarded: set[int] = set()
        ranges = []
        updates = 0
        for a in row:
            if a.stage != s:
                raise ScheduleError(f"action {a} belongs to stage {a.stage} but sits in stage {s}'s list", schedule, a)
            if a.kind is F:
                if a.index >= total:
                    raise ScheduleError(f"{a} names micro-batch {a.index}; the schedule has {total}", schedule, a)
                if a.index in forwarded:
                    raise ScheduleError(f"{a} forwards micro-batch {a.index} a second time", schedule, a)
                forwarded.add(a.index)
            elif a.kind is B:
                for k in a.microbatches:
                    if k not in forwarded:
                        raise ScheduleError(f"{a} runs a backward of micro-batch {k} before its forward", schedule, a)
                    if k in backwarded:
                        raise ScheduleError(f"{a} backwards micro-batch {k} a second time", schedule, a)
                    backwarded.add(k)
                ranges.append((a.index, a.count))
            elif a.kind is U:
                updates += 1
                if a.index != updates:
                    raise ScheduleError(f"{a} should produce version {updates} (updates count 1, 2, 3, ...)", schedule, a)
        missing_f = sorted(set(range(total)) - forwarded)
        missing_b = sorted(forwarded - backwarded)
        if missing_f or missing_b:
            what = []
            if missing_f:
                what.append(f"no forward for micro-batch(es) {missing_f[:8]}")
            if missing_b:
                what.append(f"no backward for micro-batch(es) {missing_b[:8]}")
            raise ScheduleError(f"stage {s} is unbalanced: " + "; ".join(what), schedule)
        ranges_by_stage.append(ranges)
    for s in range(P - 1):
        if sorted(ranges_by_stage[s]) != sorted(ranges_by_stage[s + 1]):
            raise ScheduleError(
                f"stages {s} and {s + 1} group micro-batches into backwards differently", schedule
            )
    _check_runs_to_completion(schedule)
    return schedule


def _check_runs_to_completion(schedule: Schedule) -> None:
    P = schedule.num_stages
    done: set[tuple[int, Kind, int]] = set()
    cursor = [0] * P
    rows = schedule.stages
    remaining = sum(len(r) for r in rows)
    while remaining:
        progressed = False
        for s in range(P):
            while cursor[s] < len(rows[s]):
                a = rows[s][cursor[s]]
                need = upstream(a, P)
                if need is not None and need not in done:
                    break
                for k in a.microbatches:
                    done.add((s, a.kind, k))
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = [rows[s][cursor[s]] for s in range(P) if cursor[s] < len(rows[s])]
            waits = ", ".join(f"{a} waits for {_describe(upstream(a, P))}" for a in blocked)
            raise ScheduleError(f"deadlock: no stage can make progress ({waits})", schedule, blocked[0])


def _describe(need: tuple[int, Kind, int] | None) -> str:
    if need is None:
        return "nothing"
    stage, kind, k = need
    return f"{stage}{kind.value}{k}"
