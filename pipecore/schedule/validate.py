"""Validation: reject schedules that cannot run, printing the table with the offending action marked."""

from __future__ import annotations

from typing import Sequence

from .ir import Action, B, F, Kind, U, W
from .progress import rank_cursor, runnable
from .schedule import Schedule, immutable, upstream


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
    forward; a stage that splits backwards runs the weight-gradient part (``W``) of every micro-batch once,
    after its ``B``; multi-micro-batch backwards cover the same ranges on every stage; updates are numbered
    1, 2, 3, ...; with several stages per rank, each stage is on one rank whose list holds its actions in the
    stage's order; and the lists can run to completion (no dependency cycle between stages or within a rank).
    A schedule whose lists cannot change (tuples or periodic rows) is checked once: validating it again
    returns at once.
    """
    if schedule.__dict__.get("_valid"):
        return schedule  # checked before, and its lists cannot change (see below)
    P = schedule.num_stages
    if len(schedule.stages) != P:
        raise ScheduleError(f"schedule declares {P} stages but has {len(schedule.stages)} rows", schedule)
    total = schedule.total_microbatches
    ranges_by_stage = []
    for s, row in enumerate(schedule.stages):
        forwarded: set[int] = set()
        backwarded: set[int] = set()
        weighted: set[int] = set()
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
            elif a.kind is W:
                if a.index not in backwarded:
                    raise ScheduleError(f"{a} computes micro-batch {a.index}'s weight gradients before its backward",
                                        schedule, a, at)
                if a.index in weighted:
                    raise ScheduleError(f"{a} computes micro-batch {a.index}'s weight gradients a second time",
                                        schedule, a, at)
                weighted.add(a.index)
            elif a.kind is U:
                updates += 1
                if a.index != updates:
                    raise ScheduleError(
                        f"{a} should produce version {updates} (updates count 1, 2, 3, ...)", schedule, a, at
                    )
        missing_f = sorted(set(range(total)) - forwarded)
        missing_b = sorted(forwarded - backwarded)
        missing_w = sorted(backwarded - weighted) if weighted else []
        if missing_f or missing_b or missing_w:
            what = []
            if missing_f:
                what.append(f"no forward for micro-batch(es) {missing_f[:8]}")
            if missing_b:
                what.append(f"no backward for micro-batch(es) {missing_b[:8]}")
            if missing_w:
                what.append(f"no weight-gradient action (W) for micro-batch(es) {missing_w[:8]} though the stage "
                            "splits its other backwards")
            raise ScheduleError(f"stage {s} is unbalanced: " + "; ".join(what), schedule)
        ranges_by_stage.append(ranges)
    for s in range(P - 1):
        if sorted(ranges_by_stage[s]) != sorted(ranges_by_stage[s + 1]):
            raise ScheduleError(
                f"stages {s} and {s + 1} group micro-batches into backwards differently", schedule
            )
    if schedule.ranks is not None:
        _check_ranks(schedule)
    _check_runs_to_completion(schedule)
    if immutable(schedule):
        schedule.__dict__["_valid"] = True  # as functools.cached_property keeps its values
    return schedule


def is_valid(schedule: Schedule) -> bool:
    """Whether :func:`validate` accepted ``schedule`` (this object, whose lists cannot change) before."""
    return schedule.__dict__.get("_valid", False)


def _check_ranks(schedule: Schedule) -> None:
    """Each stage on one rank, whose list holds exactly the stage's actions in the stage's order."""
    owner: dict[int, int] = {}
    for r, row in enumerate(schedule.ranks or ()):
        mine: dict[int, list[Action]] = {}
        for a in row:
            if owner.setdefault(a.stage, r) != r:
                raise ScheduleError(f"stage {a.stage} has actions on ranks {owner[a.stage]} and {r}; a stage runs on "
                                    "one rank", schedule, a)
            mine.setdefault(a.stage, []).append(a)
        for s, actions in mine.items():
            if tuple(actions) != tuple(schedule.stages[s]):
                at = next((i for i, (x, y) in enumerate(zip(actions, schedule.stages[s])) if x != y),
                          min(len(actions), len(schedule.stages[s])))
                raise ScheduleError(f"rank {r}'s list does not hold stage {s}'s actions in the stage's order (first "
                                    f"difference at the stage's action {at})", schedule,
                                    schedule.stages[s][at] if at < len(schedule.stages[s]) else None)
    unplaced = sorted(set(range(schedule.num_stages)) - set(owner))
    if unplaced:
        raise ScheduleError(f"stages {unplaced} are on no rank", schedule)


def _check_runs_to_completion(schedule: Schedule) -> None:
    P = schedule.num_stages
    rows = schedule.stages
    cursor = runnable(schedule, [0] * P)
    if schedule.ranks is not None and any(cursor[s] < len(rows[s]) for s in range(P)):
        heads = []
        for r, row in enumerate(schedule.ranks):
            at = rank_cursor(schedule, cursor, r)
            if at < len(row):
                heads.append(f"rank {r} at {row[at]} waits for {_describe(upstream(row[at], P))}")
        blocked = next(rows[s][cursor[s]] for s in range(P) if cursor[s] < len(rows[s]))
        raise ScheduleError(f"deadlock: no rank can make progress ({', '.join(heads)})", schedule, blocked)
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
