"""How far a schedule can run: the dependency closure every executor and the validator share."""

from __future__ import annotations

from typing import Callable, Sequence

from .ir import Action, F, Kind
from .periodic import PeriodicRow, microbatch_positions
from .schedule import Schedule, upstream


class Positions:
    """Index of each (stage, kind, micro-batch) in its stage's list (a backward block indexes all it covers).

    Periodic rows answer by arithmetic, so indexing a long asynchronous schedule costs nothing per action.
    """

    def __init__(self, schedule: Schedule):
        self._rows = schedule.stages
        self._tables: list[dict[tuple[Kind, int], int] | None] = [
            None if isinstance(row, PeriodicRow) else microbatch_positions(row) for row in schedule.stages
        ]

    def get(self, key: tuple[int, Kind, int]) -> int | None:
        s, kind, k = key
        table = self._tables[s]
        if table is None:
            row = self._rows[s]
            assert isinstance(row, PeriodicRow)
            return row.position(kind, k)
        return table.get((kind, k))

    def __getitem__(self, key: tuple[int, Kind, int]) -> int:
        i = self.get(key)
        if i is None:
            raise KeyError(key)
        return i

    def __contains__(self, key: tuple[int, Kind, int]) -> bool:
        return self.get(key) is not None


def positions(schedule: Schedule) -> Positions:
    """The :class:`Positions` index of ``schedule``."""
    return Positions(schedule)


def runnable(
    schedule: Schedule,
    cursors: Sequence[int],
    available: int | None = None,
    index: Positions | None = None,
    needs: Callable[[Action], Sequence[tuple[int, Kind, int]]] | None = None,
) -> list[int]:
    """Advance every stage's cursor as far as dependencies allow.

    ``cursors[s]`` is the number of stage ``s``'s actions already executed. With ``available``, forwards of
    micro-batch ``available`` and later cannot run (their input has not been given). Returns the cursors
    after every action that can run has run; the result does not depend on the order stages are visited.
    ``needs`` names further work an action waits for (e.g. the other owners' gradients of tied weights before
    an update), as ``(stage, kind, micro-batch)``.
    """
    index = positions(schedule) if index is None else index
    P = schedule.num_stages
    cur = list(cursors)
    if schedule.ranks is not None:
        return _runnable_ranks(schedule, cur, available, index, needs)
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
                if needs is not None and not all(index[n] < cur[n[0]] for n in needs(a)):
                    break
                cur[s] += 1
                progressed = True
    return cur


def rank_cursor(schedule: Schedule, cursors: Sequence[int], rank: int) -> int:
    """Where rank ``rank`` is in its list, given every stage's cursor: its stages' actions so far, summed (a
    rank runs a prefix of its list, which holds each stage's actions in that stage's order)."""
    if schedule.ranks is None:
        return cursors[rank]
    return sum(cursors[s] for s in schedule.stages_of(rank))


def _runnable_ranks(schedule: Schedule, cur: list[int], available: int | None, index: Positions,
                    needs: Callable[[Action], Sequence[tuple[int, Kind, int]]] | None) -> list[int]:
    """:func:`runnable` for several stages per rank: each rank goes down its own list, in its order."""
    P = schedule.num_stages
    rows = schedule.rank_rows
    at = [rank_cursor(schedule, cur, r) for r in range(len(rows))]
    progressed = True
    while progressed:
        progressed = False
        for r, row in enumerate(rows):
            while at[r] < len(row):
                a = row[at[r]]
                if available is not None and a.kind is F and a.index >= available:
                    break
                need = upstream(a, P)
                if need is not None and not index[need] < cur[need[0]]:
                    break
                if needs is not None and not all(index[n] < cur[n[0]] for n in needs(a)):
                    break
                cur[a.stage] += 1
                at[r] += 1
                progressed = True
    return cur
