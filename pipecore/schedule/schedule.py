"""A schedule: one ordered action list per stage, plus the sizes it was generated for."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Collection, Iterable, Sequence

from .ir import Action, B, F, Kind, U, W


class ImmutableRow(Sequence[Action]):
    """An action list other than a tuple that never changes once made, such as a
    :class:`~pipecore.schedule.periodic.PeriodicRow` computed on demand.

    A schedule keeps what it derives from its lists (placement, positions, validity) only when none of them
    can change; a row type declares that it cannot by deriving from this class, so that the schedule need
    not know the row types there are.
    """

    __slots__ = ()


@dataclass(frozen=True)
class Schedule:
    """Per-stage action lists. ``stages[s]`` is stage ``s``'s list in execution order: a tuple, or for long
    asynchronous schedules a :class:`~pipecore.schedule.periodic.PeriodicRow` computed on demand.

    ``ranks``, when given, places several stages on one rank (one worker thread or process): ``ranks[r]`` is
    rank ``r``'s single list, its stages' actions interleaved in the order the rank runs them (each stage's
    actions in the order of ``stages[s]``, which :func:`~pipecore.schedule.validate.validate` checks). Without
    it every stage is its own rank. Numerics depend only on each stage's own order; the interleaving decides
    when a rank is busy, and whether the lists can run at all.
    """

    num_stages: int
    n_microbatches: int
    n_minibatches: int
    stages: tuple[Sequence[Action], ...]
    ranks: tuple[Sequence[Action], ...] | None = None

    @classmethod
    def from_ranks(cls, ranks: Sequence[Sequence[Action]], num_stages: int, n_microbatches: int,
                   n_minibatches: int = 1) -> "Schedule":
        """A schedule given as one list per rank (several stages each); the per-stage lists are read off it."""
        stages: list[list[Action]] = [[] for _ in range(num_stages)]
        for row in ranks:
            for a in row:
                if not 0 <= a.stage < num_stages:
                    raise ValueError(f"action {a} names stage {a.stage}; the schedule has stages 0..{num_stages - 1}")
                stages[a.stage].append(a)
        return cls(num_stages, n_microbatches, n_minibatches, tuple(tuple(r) for r in stages),
                   tuple(tuple(r) for r in ranks))

    @property
    def num_ranks(self) -> int:
        """How many ranks run this schedule (``num_stages`` without ``ranks``)."""
        return self.num_stages if self.ranks is None else len(self.ranks)

    @property
    def rank_rows(self) -> tuple[Sequence[Action], ...]:
        """Each rank's list in execution order (the stage lists when every stage is its own rank)."""
        return self.stages if self.ranks is None else self.ranks

    @property
    def placement(self) -> tuple[int, ...]:
        """The rank of every stage."""
        return self._derived("_placement", _placement)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` runs, in increasing order."""
        if 0 <= rank < self.num_ranks:
            return self._derived("_rank_stages", _rank_stages)[rank]
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    def splits_backward(self, stage: int) -> bool:
        """Whether ``stage``'s list splits backwards into ``B`` (input gradient) and ``W`` (weight gradients)."""
        return self._derived("_splits", _splits)[stage]

    def __getstate__(self) -> dict[str, Any]:
        # What is kept on the schedule (see _derived) is rebuilt where needed rather than pickled.
        return {k: v for k, v in self.__dict__.items() if k in _FIELDS}

    def _derived(self, name: str, compute: Callable[["Schedule"], Any]) -> Any:
        """``compute(self)``, kept on the schedule (as ``functools.cached_property`` keeps its values) when its
        lists cannot change."""
        value = self.__dict__.get(name)
        if value is None:
            value = compute(self)
            if immutable(self):
                self.__dict__[name] = value
        return value

    @classmethod
    def from_strings(
        cls, rows: Sequence[Iterable[str] | str], n_microbatches: int, n_minibatches: int = 1
    ) -> "Schedule":
        """Build a schedule from action strings, one row per stage (a row may be one space-separated string)."""
        stages = []
        for s, row in enumerate(rows):
            tokens = row.split() if isinstance(row, str) else list(row)
            actions = tuple(Action.parse(t) for t in tokens if t not in (".", ""))
            for a in actions:
                if a.stage != s:
                    raise ValueError(f"action {a} is in row {s}; each row must hold only its own stage's actions")
            stages.append(actions)
        return cls(len(stages), n_microbatches, n_minibatches, tuple(stages))

    @property
    def total_microbatches(self) -> int:
        return self.n_microbatches * self.n_minibatches

    def __len__(self) -> int:
        return sum(len(row) for row in self.stages)

    def table(
        self,
        mark: Action | None = None,
        tags: dict[Action, str] | None = None,
        mark_at: Collection[tuple[int, int]] = (),
    ) -> str:
        """Text table, one row per stage. ``mark`` is bracketed as ``>>1B3<<`` wherever it occurs;
        ``mark_at`` brackets the actions at the given ``(stage, position)`` only; ``tags`` adds ``@v..``.
        A schedule with several stages per rank adds one row per rank, in the order the rank runs them."""
        marked = set(mark_at)
        lines = []

        def cells(row: Sequence[Action], stage: int | None) -> str:
            out = []
            for i, a in enumerate(row):
                text = str(a) + (f"@{tags[a]}" if tags and a in tags else "")
                out.append(f">>{text}<<" if a == mark or (stage is not None and (stage, i) in marked) else text)
            return " ".join(out)

        for s, row in enumerate(self.stages):
            lines.append(f"stage {s}: " + cells(row, s))
        if self.ranks is not None:
            for r, row in enumerate(self.ranks):
                lines.append(f"rank {r}: " + cells(row, None))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def diff(self, other: "Schedule") -> str:
        """Human-readable differences between two schedules ("" when equal)."""
        out = []
        if self.num_stages != other.num_stages:
            out.append(f"stage count: {self.num_stages} != {other.num_stages}")
        for s, (a, b) in enumerate(zip(self.stages, other.stages)):
            for i in range(max(len(a), len(b))):
                x = str(a[i]) if i < len(a) else "-"
                y = str(b[i]) if i < len(b) else "-"
                if x != y:
                    out.append(f"stage {s} position {i}: {x} != {y}")
                    break
        return "\n".join(out)

    def with_updates(self, every: int) -> "Schedule":
        """Insert an update after each backward that completes ``every`` more micro-batches at that stage.

        Stages count their own backwarded micro-batches; an update closes each group of ``every``. A backward
        covering several micro-batches (nF1B) counts all of them; in a stage list that splits backwards, the
        weight-gradient actions (``W``) count, since they complete the gradients. Any trailing partial group is
        left without an update (``flush`` semantics belong to the caller, which sizes ``every`` to divide the
        work). With several stages per rank, a rank runs its stages' updates of a group once it has run every
        action of that group (an update may wait for the other stages' gradients: tied weights, a global
        gradient norm; one of them may be on the same rank).
        """
        if every < 1:
            raise ValueError(f"update interval must be >= 1 micro-batch, got {every}")
        stages = []
        for s, row in enumerate(self.stages):
            completes = W if self.splits_backward(s) else B
            out, done, version = [], 0, 0
            for a in row:
                if a.kind is U:
                    raise ValueError(f"schedule already holds updates ({a}); insert them once")
                out.append(a)
                if a.kind is completes:
                    done += a.count
                    while done >= every:
                        done -= every
                        version += 1
                        out.append(Action(s, U, version))
            stages.append(tuple(out))
        ranks = None
        if self.ranks is not None:
            ranks = tuple(_merge_updates(row, stages, every) for row in self.ranks)
        return Schedule(self.num_stages, self.n_microbatches, self.n_minibatches, tuple(stages), ranks)


_FIELDS = frozenset(f.name for f in fields(Schedule))


def _merge_updates(row: Sequence[Action], stages: Sequence[Sequence[Action]], every: int) -> tuple[Action, ...]:
    """Rank list ``row`` with the updates of ``stages`` (lists with updates) put in: a stage's update after its
    group's last action, and after every other action of the rank on micro-batches of that group or earlier."""
    merged: list[Action] = []
    cursor: dict[int, int] = {}
    pending: list[Action] = []  # updates of this rank not placed yet, in the order they became due
    for a in row:
        if pending and a.index >= pending[0].index * every:  # an action of a later group: updates go first
            merged += pending
            pending = []
        own = stages[a.stage]
        i = cursor.get(a.stage, 0)
        merged.append(own[i])
        i += 1
        while i < len(own) and own[i].kind is U:
            pending.append(own[i])
            i += 1
        cursor[a.stage] = i
    return tuple(merged + pending)


def immutable(schedule: Schedule) -> bool:
    """Whether ``schedule``'s lists cannot change (tuples, or :class:`ImmutableRow` such as periodic rows):
    then what is derived from them (positions, validity) may be kept on the schedule object."""
    return all(type(row) is tuple or isinstance(row, ImmutableRow)
               for row in (schedule.stages if schedule.ranks is None else schedule.stages + schedule.ranks))


def _placement(schedule: Schedule) -> tuple[int, ...]:
    if schedule.ranks is None:
        return tuple(range(schedule.num_stages))
    placement = [-1] * schedule.num_stages
    for r, row in enumerate(schedule.rank_rows):
        for a in row:
            placement[a.stage] = r
            # A rank's first actions name all its stages well before its list ends; stop once every stage has one.
            if -1 not in placement:
                return tuple(placement)
    return tuple(placement)


def _rank_stages(schedule: Schedule) -> tuple[tuple[int, ...], ...]:
    placement = schedule.placement
    return tuple(tuple(s for s, r in enumerate(placement) if r == rank) for rank in range(schedule.num_ranks))


def _splits(schedule: Schedule) -> tuple[bool, ...]:
    # A stage that splits does so from its first mini-batch, whose actions (m each of F, B and W, and its
    # updates) come first in its list: a bounded scan, so that a long periodic list is not walked.
    n = 4 * schedule.n_microbatches + 4
    return tuple(any(a.kind is W for a in row[:n]) for row in schedule.stages)


def upstream(action: Action, num_stages: int) -> tuple[int, Kind, int] | None:
    """The remote work an F or B waits for, as ``(stage, kind, micro-batch)``; None for local-only work.

    F at stage s needs F of the same micro-batch at s-1. B at stage s < P-1 needs the backward of the same
    micro-batches at s+1 (checked through the last micro-batch it covers). B at the last stage needs only
    its own forwards, which the stage's order guarantees; a W (weight gradients) its own B, likewise.
    """
    if action.kind is F and action.stage > 0:
        return (action.stage - 1, F, action.index)
    if action.kind is B and action.stage < num_stages - 1:
        return (action.stage + 1, B, action.index + action.count - 1)
    return None
