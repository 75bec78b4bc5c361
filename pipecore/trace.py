"""Version traces: which weights every forward and backward read, when, and at what cost."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from .algorithms.base import Algorithm, WeightRead
from .runtime.executor import Event
from .schedule.ir import B, F, Kind, U, W, traced
from .schedule.schedule import Schedule

_COLOURS = {F: "#4c78a8", B: "#59a14f", W: "#b07aa1", U: "#9d9d9d"}
_INDEXES = frozenset({"_reads", "_forward_versions", "_stage_events", "_stage_reads"})


@dataclass(frozen=True)
class StageSummary:
    """Per-stage figures of a trace."""

    stage: int
    busy: float
    weight_versions: int
    derived_weights: bool
    peak_activations: int
    mean_staleness: float
    max_staleness: int
    mean_delay: float
    max_delay: int


class Trace:
    """The outcome of a simulation (or of a real run): timeline and version reads.

    Staleness of a read = the stage's live version at that moment minus the version read (for derived
    weights, minus the version they are derived from).
    """

    _reads: dict[tuple[int, int, Kind], tuple[WeightRead, int]]
    _forward_versions: dict[tuple[int, int], int]
    _stage_events: list[list[Event]]
    _stage_reads: list[list[tuple[int, Kind, WeightRead, int]]]

    def __init__(self, algorithm: Algorithm, schedule: Schedule, events: Sequence[Event], peak_versions: Sequence[int]):
        self.algorithm = algorithm
        self.schedule = schedule
        self.events = list(events)
        self._peak_versions = list(peak_versions)
        # The indexes over the events (_INDEXES) are built on first use (see __getattr__): a simulation
        # returns a trace, and a caller that reads only its events or makespan need not pay for them.

    def __getattr__(self, name: str) -> Any:
        # Called only for attributes not set yet: build the indexes once, then they are plain attributes.
        if name in _INDEXES:
            self._index()
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _index(self) -> None:
        """The lookups behind the per-action and per-stage figures, in one pass over the events."""
        reads: dict[tuple[int, int, Kind], tuple[WeightRead, int]] = {}
        forward_versions: dict[tuple[int, int], int] = {}
        # Per-stage views, so that per-stage figures cost one pass over that stage rather than the trace.
        stage_events: list[list[Event]] = [[] for _ in range(self.num_stages)]
        for e in self.events:
            action, record = e.action, e.record
            s = action.stage
            stage_events[s].append(e)
            if record.reads:
                kind, live = action.kind, record.live
                for k, read in record.reads.items():
                    reads[(s, k, kind)] = (read, live)
            if record.forward_reads:
                for k, read in record.forward_reads.items():
                    forward_versions[(s, k)] = read.version
        stage_reads: list[list[tuple[int, Kind, WeightRead, int]]] = [[] for _ in range(self.num_stages)]
        for (s, k, kind), (read, live) in reads.items():
            stage_reads[s].append((k, kind, read, live))
        self.__dict__.update(_reads=reads, _forward_versions=forward_versions, _stage_events=stage_events,
                             _stage_reads=stage_reads)

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages

    def _lookup(self, stage: int, microbatch: int, kind: str | Kind) -> tuple[WeightRead, int]:
        key = (stage, microbatch, Kind(kind))
        if key not in self._reads:
            raise KeyError(f"no {Kind(kind).value} of micro-batch {microbatch} at stage {stage} in this trace")
        return self._reads[key]

    def read(self, stage: int, microbatch: int, kind: str | Kind) -> WeightRead:
        """The full read (version, derivation and its parameters) of an F or B."""
        return self._lookup(stage, microbatch, kind)[0]

    def version(self, stage: int, microbatch: int, kind: str | Kind) -> int:
        """The version the F or B of ``microbatch`` reads at ``stage`` (derived weights: their base)."""
        return self._lookup(stage, microbatch, kind)[0].version

    def live_version(self, stage: int, microbatch: int, kind: str | Kind) -> int:
        """The stage's live version when that F or B ran."""
        return self._lookup(stage, microbatch, kind)[1]

    def staleness(self, stage: int, microbatch: int, kind: str | Kind) -> int:
        read, live = self._lookup(stage, microbatch, kind)
        return live - read.version

    def delay(self, stage: int, microbatch: int) -> int:
        """Updates between a micro-batch's forward-read version and its backward at ``stage``: how old the
        forward's weights are when the gradient they produced is applied."""
        return self.live_version(stage, microbatch, B) - self._forward_versions[(stage, microbatch)]

    def weight_versions(self, stage: int) -> int:
        """Peak number of weight versions the stage holds (derived, transient weights not counted)."""
        return self._peak_versions[stage]

    def derived_weights(self, stage: int) -> bool:
        """Whether the stage computes derived weights (prediction, interpolation, correction): one scratch buffer."""
        return any(r.derivation for _, _, r, _ in self._stage_reads[stage])

    def peak_activations(self, stage: int) -> int:
        """Peak number of micro-batches whose forward ran at the stage and whose backward has not (for a
        stage that splits backwards: whose weight gradients, W, have not: W still needs the saved inputs)."""
        return self._peak_in_flight(self._stage_events[stage])

    def held_activations(self, stage: int) -> tuple[tuple[int, int], ...]:
        """The stage's micro-batch activations at its peaks, split in two: ``(pending, waiting)``, the micro-batches
        whose forward ran and whose backward (B) has not, and those whose B ran and whose W has not (a stage
        that splits backwards; 0 otherwise). Every pair the trace reaches that no other reached pair exceeds in
        both counts, by decreasing ``pending``: whichever bytes each kind holds, the stage peaks at one of
        them. Their largest sum is :meth:`peak_activations`."""
        reached = self._held(self._stage_events[stage])
        return tuple(sorted((p for p in reached if not any(q != p and q[0] >= p[0] and q[1] >= p[1]
                                                           for q in reached)), reverse=True))

    def rank_peak_activations(self, rank: int) -> int:
        """Peak number of micro-batch activations a rank holds at once, over all its stages (as
        :meth:`peak_activations`; with one stage per rank the two agree)."""
        stages = set(self.schedule.stages_of(rank))
        return self._peak_in_flight([e for e in self.events if e.action.stage in stages])

    def _peak_in_flight(self, events: Sequence[Event]) -> int:
        """Activations are held from a forward's start to the end of the action that last needs them: the W of a
        stage that splits backwards, else the B (one freed at the moment another is taken does not overlap it)."""
        return max(pending + waiting for pending, waiting in self._held(events))

    def _held(self, events: Sequence[Event]) -> set[tuple[int, int]]:
        """Every ``(pending, waiting)`` pair of micro-batch counts the events reach (see :meth:`held_activations`),
        over their stages together."""
        splits = {s: self.schedule.splits_backward(s) for s in {e.action.stage for e in events}}
        changes = []
        for e in events:
            kind = e.action.kind
            if kind is F:
                changes.append((e.start, 1, 1, 0))
            elif kind is B:
                moved = e.action.count if splits[e.action.stage] else 0
                changes.append((e.end, 0, -e.action.count, moved))
            elif kind is W and splits[e.action.stage]:
                changes.append((e.end, 0, 0, -e.action.count))
        pending = waiting = 0
        reached = {(0, 0)}
        for _, _, dp, dw in sorted(changes):
            pending, waiting = pending + dp, waiting + dw
            reached.add((pending, waiting))
        return reached

    @property
    def makespan(self) -> float:
        return max((e.end for e in self.events), default=0.0)

    @property
    def num_ranks(self) -> int:
        """Ranks (worker threads or processes) that ran the schedule: ``num_stages`` unless several stages
        share one (``stages_per_rank``)."""
        return self.schedule.num_ranks

    def busy(self, stage: int) -> float:
        """Time the stage spends computing (sum of its actions' durations)."""
        return sum(e.end - e.start for e in self._stage_events[stage])

    def rank_busy(self, rank: int) -> float:
        """Time the rank spends computing, over all its stages."""
        return sum(self.busy(s) for s in self.schedule.stages_of(rank))

    @property
    def bubble_fraction(self) -> float:
        """Idle share of ``ranks * makespan`` (a rank is busy while any of its stages computes)."""
        total = self.num_ranks * self.makespan
        return 0.0 if total == 0 else 1.0 - sum(self.busy(s) for s in range(self.num_stages)) / total

    def stage_summary(self, stage: int) -> StageSummary:
        """All per-stage figures: busy time, versions, derived weights, activations, staleness, delay."""
        reads = self._stage_reads[stage]
        stale = [live - r.version for _, _, r, live in reads]
        delays = [live - self._forward_versions[(stage, k)] for k, kind, _, live in reads if kind is B]
        return StageSummary(
            stage, self.busy(stage), self.weight_versions(stage), self.derived_weights(stage),
            self.peak_activations(stage), statistics.fmean(stale) if stale else 0.0, max(stale, default=0),
            statistics.fmean(delays) if delays else 0.0, max(delays, default=0),
        )

    def _label(self, e: Event) -> str:
        return traced(e.action, e.record.reads)

    def grid(self) -> str:
        """Text table: one row per stage (per rank when ranks hold several stages), actions in order, F/B
        tagged with the version read."""
        placement = self.schedule.placement
        by_rank = self.schedule.ranks is not None
        rows: list[list[str]] = [[] for _ in range(self.num_ranks if by_rank else self.num_stages)]
        for e in sorted(self.events, key=lambda e: e.start) if by_rank else self.events:
            rows[placement[e.action.stage] if by_rank else e.action.stage].append(self._label(e))
        # Events arrive in execution order; a stage's own events are in its schedule order (and a rank's,
        # by their start times, in its list's order).
        name = "rank" if by_rank else "stage"
        return "\n".join(f"{name} {s}: " + " ".join(r) for s, r in enumerate(rows))

    def summary(self) -> str:
        """Bubble fraction, makespan and per-stage versions/staleness as text."""
        lines = [
            f"algorithm {self.algorithm.name}: {self.num_stages} stages, {self.schedule.n_microbatches} micro-batches "
            f"x {self.schedule.n_minibatches} mini-batch{'es' if self.schedule.n_minibatches != 1 else ''}",
            f"makespan {self.makespan:g}, bubble fraction {self.bubble_fraction:.3f}"
            + (f", {self.num_ranks} ranks (stages per rank: {self.num_stages // self.num_ranks}), peak activations per "
               f"rank {[self.rank_peak_activations(r) for r in range(self.num_ranks)]}"
               if self.schedule.ranks is not None else ""),
            "stage  versions  derived  activations  staleness(mean/max)  delay(mean/max)",
        ]
        for s in range(self.num_stages):
            x = self.stage_summary(s)
            lines.append(
                f"{s:>5}  {x.weight_versions:>8}  {'yes' if x.derived_weights else 'no':>7}  {x.peak_activations:>11}  "
                f"{x.mean_staleness:>14.2f}/{x.max_staleness:<4}  {x.mean_delay:>10.2f}/{x.max_delay}"
            )
        return "\n".join(lines)

    def _rows(self) -> tuple[list[str], list[int]]:
        """Timeline rows: their names, and each stage's row (ranks when ranks hold several stages)."""
        if self.schedule.ranks is None:
            return [f"stage {s}" for s in range(self.num_stages)], list(range(self.num_stages))
        names = [f"rank {r} (stages {', '.join(map(str, self.schedule.stages_of(r)))})" for r in range(self.num_ranks)]
        return names, list(self.schedule.placement)

    def to_chrome_trace(self, path: str) -> None:
        """Write a Chrome trace (open in Perfetto or chrome://tracing); one row per stage (per rank when ranks
        hold several stages; each action is labelled with its stage), 1 unit = 1 ms."""
        events = [
            {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"pipecore {self.algorithm.name}"}},
        ]
        names, row_of = self._rows()
        for i, name in enumerate(names):
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": name}})
        for e in self.events:
            args = {"live": e.record.live}
            if e.record.reads:
                args["reads"] = {str(k): str(r) for k, r in e.record.reads.items()}
                args["staleness"] = max(e.record.live - r.version for r in e.record.reads.values())
            events.append({
                "name": self._label(e), "cat": e.action.kind.value, "ph": "X", "pid": 0, "tid": row_of[e.action.stage],
                "ts": e.start * 1000.0, "dur": max(e.end - e.start, 1e-3) * 1000.0, "args": args,
            })
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)

    def plot(self, path: str, title: str | None = None) -> None:
        """Draw the timeline as a PNG: stages as rows, colour by action kind, darker = staler weights."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        names, row_of = self._rows()
        labelled = self.schedule.ranks is not None  # rows are ranks: each action says its stage
        fig_w = min(max(8.0, self.makespan * 0.25), 40.0)
        fig, ax = plt.subplots(figsize=(fig_w, 1.0 + 0.6 * len(names)))
        max_stale = max((self.staleness(s, k, kind) for (s, k, kind) in self._reads), default=0) or 1
        for e in self.events:
            a = e.action
            width = max(e.end - e.start, 0.15)
            stale = max((e.record.live - r.version for r in e.record.reads.values()), default=0)
            alpha = 0.45 + 0.55 * stale / max_stale
            row = row_of[a.stage]
            ax.barh(row, width, left=e.start, height=0.8, color=_COLOURS[a.kind], alpha=alpha, edgecolor="white")
            if a.kind is not U and width >= 0.6:
                text = f"{a.index}" + (f"-{a.index + a.count - 1}" if a.count > 1 else "")
                if labelled:
                    text = f"{a.stage}:{text}"
                ax.text(e.start + width / 2, row, text, ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
        ax.set_xlabel("time")
        ax.set_title(title or f"{self.algorithm.name}: bubble {self.bubble_fraction:.1%}, "
                              f"versions per stage {[self.weight_versions(s) for s in range(self.num_stages)]}")
        kinds = ((F, "forward"), (B, "backward"), (W, "weight gradients"), (U, "update"))
        present = {e.action.kind for e in self.events}
        ax.legend(handles=[Patch(color=_COLOURS[k], label=n) for k, n in kinds if k in present or k is not W]
                  + [Patch(color="black", alpha=0.9, label="darker = staler weights")],
                  loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5, fontsize=8, frameon=False)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
