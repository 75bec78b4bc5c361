"""A schedule: one ordered action list per stage, plus the sizes it was generated for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Sequence

from .ir import Action, B, F, Kind, U


@dataclass(frozen=True)
class Schedule:
    """Per-stage action lists. ``stages[s]`` is stage ``s``'s list in execution order: a tuple, or for long
    asynchronous schedules a :class:`~pipecore.schedule.periodic.PeriodicRow` computed on demand."""

    num_stages: int
    n_microbatches: int
    n_minibatches: int
    stages: tuple[Sequence[Action], ...]

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
        ``mark_at`` brackets the actions at the given ``(stage, position)`` only; ``tags`` adds ``@v..``."""
        marked = set(mark_at)
        lines = []
        for s, row in enumerate(self.stages):
            cells = []
            for i, a in enumerate(row):
                text = str(a) + (f"@{tags[a]}" if tags and a in tags else "")
                cells.append(f">>{text}<<" if a == mark or (s, i) in marked else text)
            lines.append(f"stage {s}: " + " ".join(cells))
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
        covering several micro-batches (nF1B) counts all of them. Any trailing partial group is left
        without an update (``flush`` semantics belong to the caller, which sizes ``every`` to divide the work).
        """
        if every < 1:
            raise ValueError(f"update interval must be >= 1 micro-batch, got {every}")
        stages = []
        for s, row in enumerate(self.stages):
            out, done, version = [], 0, 0
            for a in row:
                if a.kind is U:
                    raise ValueError(f"schedule already holds updates ({a}); insert them once")
                out.append(a)
                if a.kind is B:
                    done += a.count
                    while done >= every:
                        done -= every
                        version += 1
                        out.append(Action(s, U, version))
            stages.append(tuple(out))
        return Schedule(self.num_stages, self.n_microbatches, self.n_minibatches, tuple(stages))


def upstream(action: Action, num_stages: int) -> tuple[int, Kind, int] | None:
    """The remote work an F or B waits for, as ``(stage, kind, micro-batch)``; None for local-only work.

    F at stage s needs F of the same micro-batch at s-1. B at stage s < P-1 needs the backward of the same
    micro-batches at s+1 (checked through the last micro-batch it covers). B at the last stage needs only
    its own forwards, which the stage's order guarantees.
    """
    if action.kind is F and action.stage > 0:
        return (action.stage - 1, F, action.index)
    if action.kind is B and action.stage < num_stages - 1:
        return (action.stage + 1, B, action.index + action.count - 1)
    return None
