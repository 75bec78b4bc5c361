"""Validation: reject schedules that cannot run, printing the table with the offending action marked."""

from __future__ import annotations

from typing import Sequence

from .ir import Action, B, F, Kind, U
from .progress import runnable
from .schedule import Schedule, upstream


class ScheduleError(ValueError):
    """An impossible schedule. ``action`` is the offending action (None when the problem is global).

    ``at`` lists the ``(stage, position)`` of every action to mark in the printed table; without it every
    occurrence of ``action`` is marked.
    """

    def __init__(
        self,
        message: str,
        schedule: Schedule,
        action: Action | None = None,
        at: Sequence[tuple[int, int]] = (),
    ):
        self.action = action
        self.at = tuple(at)
        table = schedule.table(mark_at=self.at) if self.at else schedule.table(mark=action)
        super().__init__(f"{message}\n{table}")


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
        for i, a in enumerate(row):
            at = [(s, i)]
            if a.stage != s:
                raise ScheduleError(
                    f"action {a} belongs to stage {a.stage} but sits in stage {s}'s list", schedule, a, at
                )
            if a.kind is F:
                if a.index >= total:
                    raise ScheduleError(f"{a} names micro-batch {a.index}; the schedule has {total}", schedule, a, at)
                if a.index in forwarded:
                    raise ScheduleError(f"{a} forwards micro-batch {a.index} a second time", schedule, a, at)
                forwarded.add(a.index)
            elif a.kind is B:
                for k in a.microbatches:
                    if k not in forwarded:
                        raise ScheduleError(
                            f"{a} runs a backward of micro-batch {k} before its forward", schedule, a, at
                        )
                    if k in backwarded:
                        raise ScheduleError(f"{a} backwards micro-batch {k} a second time", schedule, a, at)
                    backwarded.add(k)
                ranges.append((a.index, a.count))
            elif a.kind is U:
                updates += 1
                if a.index != updates:
                    raise ScheduleError(
                        f"{a} should produce version {updates} (updates count 1, 2, 3, ...)", schedule, a, at
                    )
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
    rows = schedule.stages
    cursor = runnable(schedule, [0] * P)
    if any(cursor[s] < len(rows[s]) for s in range(P)):
        heads = [(s, cursor[s]) for s in range(P) if cursor[s] < len(rows[s])]
        waits = ", ".join(f"{rows[s][i]} waits for {_describe(upstream(rows[s][i], P))}" for s, i in heads)
        culprits = [(s, i, why) for s, i in heads if (why := _out_of_order(schedule, s, i))]
        if culprits:
            s, i, _ = culprits[0]
            reasons = "; ".join(why for _, _, why in culprits)
            raise ScheduleError(
                f"deadlock: no stage can make progress ({waits}); {reasons}",
                schedule, rows[s][i], [(s, i) for s, i, _ in culprits],
            )
        s, i = heads[0]
        raise ScheduleError(f"deadlock: no stage can make progress ({waits})", schedule, rows[s][i], heads)


def _out_of_order(schedule: Schedule, stage: int, position: int) -> str | None:
    """Why the blocked action at ``(stage, position)`` breaks its neighbour's order, if it does.

    A deadlock is a cycle, so every blocked action is on it; the one worth pointing at is an F that comes
    before a micro-batch its upstream stage forwards earlier, or a B that comes before a micro-batch its
    downstream stage backwards earlier.
    """
    P = schedule.num_stages
    row = schedule.stages[stage]
    a = row[position]
    if a.kind is F and stage > 0:
        neighbour, kind = stage - 1, F
    elif a.kind is B and stage < P - 1:
        neighbour, kind = stage + 1, B
    else:
        return None
    order = {x.index: n for n, x in enumerate(x for x in schedule.stages[neighbour] if x.kind is kind)}
    for later in row[position + 1:]:
        if later.kind is kind and order[later.index] < order[a.index]:
            verb = "forwards" if kind is F else "backwards"
            return (
                f"{a} runs before {later}, but stage {neighbour} {verb} micro-batch {later.index} "
                f"before micro-batch {a.index}"
            )
    return None


def _describe(need: tuple[int, Kind, int] | None) -> str:
    if need is None:
        return "nothing"
    stage, kind, k = need
    return f"{stage}{kind.value}{k}"
