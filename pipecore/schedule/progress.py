"""How far a schedule can run: the dependency closure every executor and the validator share."""

from __future__ import annotations

from typing import Callable, Sequence

from .ir import Action, B, F, Kind
from .periodic import PeriodicRow, microbatch_positions
from .schedule import Schedule, immutable


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
    """The :class:`Positions` index of ``schedule`` (built once per schedule whose lists cannot change)."""
    cached = schedule.__dict__.get("_positions")
    if cached is None:
        cached = Positions(schedule)
        if immutable(schedule):
            schedule.__dict__["_positions"] = cached  # as functools.cached_property keeps its values
    return cached


def runnable(
    schedule: Schedule,
    cursors: Sequence[int],
    available: int | None = None,
    index: Positions | None = None,
    needs: Callable[[Action], Sequence[tuple[int, Kind, int]]] | None = None,
    ran: list[Action] | None = None,
) -> list[int]:
    """Advance every stage's cursor as far as dependencies allow.

    ``cursors[s]`` is the number of stage ``s``'s actions already executed. With ``available``, forwards of
    micro-batch ``available`` and later cannot run (their input has not been given). Returns the cursors
    after every action that can run has run; the result does not depend on the order stages are visited.
    ``needs`` names further work an action waits for (e.g. the other owners' gradients of tied weights before
    an update), as ``(stage, kind, micro-batch)``. ``ran``, if given, gets every action run, in an order
    the schedule can run them in.
    """
    index = positions(schedule) if index is None else index
    return _advance(schedule, list(cursors), available, index, needs, ran)


def rank_cursor(schedule: Schedule, cursors: Sequence[int], rank: int) -> int:
    """Where rank ``rank`` is in its list, given every stage's cursor: its stages' actions so far, summed (a
    rank runs a prefix of its list, which holds each stage's actions in that stage's order)."""
    if schedule.ranks is None:
        return cursors[rank]
    return sum(cursors[s] for s in schedule.stages_of(rank))


def _advance(schedule: Schedule, cur: list[int], available: int | None, index: Positions,
             needs: Callable[[Action], Sequence[tuple[int, Kind, int]]] | None,
             ran: list[Action] | None = None) -> list[int]:
    """:func:`runnable`: each rank (each stage, without ``ranks``) goes down its own list, in its order, while
    its next action's upstream work (see :func:`~pipecore.schedule.schedule.upstream`, looked up inline: this
    runs once per action) has run."""
    P = schedule.num_stages
    rows = schedule.rank_rows
    stage_rows = schedule.stages
    # Each rank's position in its list; without ranks, a stage's cursor is its rank's.
    at = cur if schedule.ranks is None else [rank_cursor(schedule, cur, r) for r in range(len(rows))]
    tables = index._tables if type(index) is Positions else None  # Positions.get, inline
    progressed = True
    while progressed:
        progressed = False
        for r, row in enumerate(rows):
            end = len(row)
            while at[r] < end:
                a = row[at[r]]
                kind = a.kind
                if kind is F:
                    if available is not None and a.index >= available:
                        break
                    u, k = a.stage - 1, a.index  # -1 at stage 0: no upstream
                elif kind is B and a.stage < P - 1:
                    u, k = a.stage + 1, a.index + a.count - 1
                else:
                    u = -1
                if u >= 0:  # upstream(a, P) is (u, kind, k)
                    if tables is None:
                        i = index[(u, kind, k)]
                    else:
                        table = tables[u]
                        i = table.get((kind, k)) if table is not None else stage_rows[u].position(kind, k)
                        if i is None:
                            raise KeyError((u, kind, k))
                    if not i < cur[u]:
                        break
                if needs is not None and not all(index[n] < cur[n[0]] for n in needs(a)):
                    break
                if at is not cur:
                    at[r] += 1
                cur[a.stage] += 1
                if ran is not None:
                    ran.append(a)
                progressed = True
    return cur
