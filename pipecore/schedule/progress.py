"""How far a schedule can run: the dependency closure every executor and the validator share."""

from __future__ import annotations

from typing import Sequence

from .ir import F, Kind
from .schedule import Schedule, upstream


def positions(schedule: Schedule) -> dict[tuple[int, Kind, int], int]:
    """Index of each (stage, kind, micro-batch) in its stage's list (a backward block indexes all it covers)."""
    table: dict[tuple[int, Kind, int], int] = {}
    for s, row in enumerate(schedule.stages):
        for i, a in enumerate(row):
            for k in a.microbatches:
                table[(s, a.kind, k)] = i
    return table


def runnable(
    schedule: Schedule,
    cursors: Sequence[int],
    available: int | None = None,
    index: dict[tuple[int, Kind, int], int] | None = None,
) -> list[int]:
    """Advance every stage's cursor as far as dependencies allow.

    ``cursors[s]`` is the number of stage ``s``'s actions already executed. With ``available``, forwards of
    micro-batch ``available`` and later cannot run (their input has not been given). Returns the cursors
    after every action that can run has run; the result does not depend on the order stages are visited.
    """
    index = positions(schedule) if index is None else index
    P = schedule.num_stages
    cur = list(cursors)
    rows = schedule.stages
    progressed = True
    while progressed:
        progressed = False
        for s in range(P):
            row = rows[s]
            while cur[s] < len(row):
                a = row[cur[s]]
                if available is not None and a.kind is F and a.index >= available:
                    break
                need = upstream(a, P)
                if need is not None and not index[need] < cur[need[0]]:
                    break
                cur[s] += 1
                progressed = True
    return cur
