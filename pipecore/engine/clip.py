"""Gradient clipping by norm: ``Pipeline(..., clip_grad_norm=max_norm)``.

Synchronous algorithms (schedules that finish every mini-batch before the next begins: gpipe, 1f1b) clip by
the **global** norm of one update group's gradient over all stages, as ``torch.nn.utils.clip_grad_norm_`` does
on the whole model: every stage's update waits for every stage's last backward of its group (one process) or
gathers the stages' squared norms (one process per stage). A tied weight, whose gradient is the owners' sum,
counts once. Asynchronous algorithms update the stages at different times, so waiting for the other stages'
gradients would stall the pipeline: each stage clips by the norm of its own gradient of the update group, and
a tied weight (the same gradient on every owner) by its own norm, so that its copies stay identical.

The squared norm of a stage is the sum of the squared norms of its pieces, in order: the ranges of its flat
gradient between tied weights, then the tied weights it is the first owner of. Both ways of forming the total
(reading every stage's buffer in one process, gathering the stages' sums over ranks) add the same numbers in
stage order, so the results are bit-identical.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from ..schedule.ir import Action, B, Kind, U, W
from ..schedule.schedule import Schedule
from .tied import StageTies


class ClippedStage(Protocol):
    """What clipping reads of a stage (a :class:`~pipecore.engine.stage.TensorStage`)."""

    @property
    def stage(self) -> int:
        """The stage's index."""

    @property
    def grad(self) -> torch.Tensor:
        """The stage's flat gradient buffer, complete for the update group (scaled in place)."""

    @property
    def ties(self) -> StageTies | None:
        """The stage's share of tied weights, None when it shares none."""

#: torch.nn.utils.clip_grad_norm_'s guard against division by zero.
EPS = 1e-6


def check_max_norm(max_norm: Any) -> float | None:
    """``clip_grad_norm`` as given to the pipeline: None, or a finite number > 0."""
    if max_norm is None:
        return None
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not math.isfinite(max_norm) \
            or max_norm <= 0:
        raise ValueError(f"clip_grad_norm must be a finite number > 0 (the largest gradient norm) or None, got "
                         f"{max_norm!r}")
    return float(max_norm)


def flushes_every_minibatch(schedule: Schedule, n_microbatches: int, update_every: int) -> bool:
    """Whether every stage finishes each mini-batch (its forwards, backwards and updates) before it starts the
    next one's: then an update can wait for the other stages' gradients of its group without stalling.
    ``schedule`` must span at least two mini-batches."""
    for row in schedule.stages:
        last_of_first, first_of_next = -1, len(row)
        for position, action in enumerate(row):
            if action.kind is U:  # U index i applies group i - 1
                minibatch = (action.index - 1) * update_every // n_microbatches
            else:
                minibatch = min(action.microbatches) // n_microbatches
                if max(action.microbatches) // n_microbatches != minibatch:
                    return False
            if minibatch == 0:
                last_of_first = position
            elif first_of_next == len(row):
                first_of_next = position
        if last_of_first > first_of_next:
            return False
    return True


#: A span of a stage's flat gradient: ``(start, stop, tie name or None, owners of the tie or ())``.
Piece = tuple[int, int, "str | None", tuple[int, ...]]


def pieces(stage: ClippedStage) -> list[Piece]:
    """The spans covering a stage's flat gradient in order: its tied weights, and the ranges between them."""
    n = stage.grad.numel()
    if stage.ties is None:
        return [(0, n, None, ())]
    out: list[Piece] = []
    position = 0
    for start, stop, name, owners in stage.ties.ranges(stage.grad):
        if start > position:
            out.append((position, start, None, ()))
        out.append((start, stop, name, owners))
        position = stop
    if position < n:
        out.append((position, n, None, ()))
    return out


def _squared(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2


def stage_squared_norm(stage: ClippedStage, tied_sum: Callable[[str], torch.Tensor]) -> float:
    """The stage's share of the global squared norm: its untied ranges, then the tied weights it is the
    first owner of (``tied_sum(name)``: the owners' summed gradient of that tied weight)."""
    total = 0.0
    spans = pieces(stage)
    for start, stop, name, _ in spans:
        if name is None:
            total += _squared(stage.grad[start:stop])
    for _, _, name, owners in spans:
        if name is not None and owners[0] == stage.stage:
            total += _squared(tied_sum(name))
    return total


def clip_coefficient(norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: ``max_norm / (norm + 1e-6)``, at most 1."""
    return min(1.0, max_norm / (norm + EPS))


class ClipDependencies:
    """For a synchronous schedule in one process: each update also waits for the other stages' last
    backward of its group (composed with any other dependencies, e.g. tied weights')."""

    def __init__(self, num_stages: int, update_every: int,
                 other: Callable[[Action], Sequence[tuple[int, Kind, int]]] | None = None,
                 weight_actions: bool = False):
        self.num_stages, self.update_every, self.other = num_stages, update_every, other
        self.completes = W if weight_actions else B  # the action that completes a micro-batch's gradients

    def __call__(self, action: Action) -> list[tuple[int, Kind, int]]:
        found = list(self.other(action)) if self.other is not None else []
        if action.kind is U:
            last = action.index * self.update_every - 1  # U index i applies group i - 1
            found += [(t, self.completes, last) for t in range(self.num_stages) if t != action.stage]
        return found


class GlobalNorm(ABC):
    """The global gradient norm of each update group, for synchronous schedules."""

    def before_ties(self, stage: ClippedStage, update: int) -> None:
        """Called by every stage's update before it applies the tied gradients (its buffer still holds its
        own gradient). Nothing to do unless the norm is read from the stages' own gradients."""

    @abstractmethod
    def after_ties(self, stage: ClippedStage, update: int) -> float:
        """Called next, after the tied gradients are applied: the global norm of this update group."""

    def discard(self, first_update: int) -> None:
        """Forget what is kept of updates ``first_update`` and later (counted like the stages' updates, from
        construction; they were undone)."""


class LocalGlobalNorm(GlobalNorm):
    """Every stage in this process: the first stage to reach an update reads every stage's buffer (all of
    them are complete, by :class:`ClipDependencies`, and untouched: every update starts here) and keeps the
    norm for the others."""

    def __init__(self, stages: Mapping[int, ClippedStage]):
        self.stages = stages
        self._norms: dict[int, tuple[float, set[int]]] = {}
        self._lock = threading.Lock()

    def before_ties(self, stage: ClippedStage, update: int) -> None:
        with self._lock:
            if update not in self._norms:
                self._norms[update] = (self._compute(), set())

    def after_ties(self, stage: ClippedStage, update: int) -> float:
        with self._lock:
            norm, seen = self._norms[update]
            seen.add(stage.stage)
            if len(seen) == len(self.stages):
                del self._norms[update]
            return norm

    def discard(self, first_update: int) -> None:
        with self._lock:
            for update in [u for u in self._norms if u >= first_update]:
                del self._norms[update]

    def _compute(self) -> float:
        return math.sqrt(self.squared())

    def squared(self) -> float:
        """The squared norm over every stage here (their buffers complete and untouched), added in stage order."""
        total = 0.0
        for s in sorted(self.stages):
            st = self.stages[s]

            def tied_sum(name: str, st: ClippedStage = st) -> torch.Tensor:
                # The owners' own gradients of this tied weight, added in stage order as the exchange adds them.
                parts = [self.stages[o].ties.views[name] for o in st.ties.owners[name]]
                out = torch.add(parts[0], parts[1].to(parts[0].device))
                for part in parts[2:]:
                    out.add_(part.to(out.device))
                return out

            total += stage_squared_norm(st, tied_sum)
        return total


class DistributedGlobalNorm(GlobalNorm):
    """One process per stage: each rank sends its squared norm to every other rank and adds all of them in
    stage order (after the tied gradients are applied, when its tied weights hold the owners' sum).

    Point-to-point frames on the link layer (:mod:`pipecore.runtime.link`: one ``float64`` squared norm and the
    update's index, on a gloo group of its own) rather than a collective, so that a failed rank can stop the
    others' wait: its failure notice comes in place of its norm (:meth:`notify_failure`), and after the failure
    every rank takes and drops what is left on its streams (:meth:`resync`)."""

    _TAG = 60

    def __init__(self, rank: int, num_stages: int, timeout: float, grid: Sequence[Sequence[int]] | None = None,
                 replica: int = 0):
        import datetime

        import torch.distributed as dist

        from ..runtime.elastic import new_group
        from ..runtime.link import TRAILER_BYTES, Links

        self.rank, self.num_stages = rank, num_stages
        wait = datetime.timedelta(seconds=timeout)
        self.links = Links(rank, wait, torch.device("cpu"))
        # One group per pipeline replica (data parallel; grid[i][r]: the global rank of pipeline rank r of replica
        # i), created by every process in the same order; ranks here are pipeline ranks.
        rows = [list(range(dist.get_world_size()))] if grid is None else [list(row) for row in grid]
        for i, row in enumerate(rows):
            group = new_group(row if grid is not None else None, "the gradient norms' exchange", wait, backend="gloo")
            if i == replica:
                mine, in_group = group, {r: dist.get_group_rank(group, g) for r, g in enumerate(row)}
        size = 8 + 8 + TRAILER_BYTES  # the squared norm, the update's index, the trailer
        self._streams = {}
        for peer in range(num_stages):
            if peer != rank:
                outgoing = self.links.send_to("norm", mine, in_group[peer], peer, self._TAG, "gradient norms", size)
                incoming = self.links.receive_from("norm", mine, in_group[peer], peer, self._TAG,
                                                   "the next gradient norm", size)
                self.links.pair(outgoing, incoming)  # each norm taken acknowledges the peer's earlier ones
                self._streams[peer] = (outgoing, incoming)

    def after_ties(self, stage: ClippedStage, update: int) -> float:
        own = stage_squared_norm(stage, lambda name: stage.ties.views[name])  # tied views hold the sum now
        return self._exchange(own, update)

    def _exchange(self, own: float, update: int) -> float:
        """The global norm of ``update``: this rank's squared share ``own`` sent to every other rank, theirs taken,
        all added in rank order."""
        from ..runtime.link import TRAILER, PeerError

        norm = torch.tensor([own], dtype=torch.float64)
        for outgoing, _ in self._streams.values():
            outgoing.send(norm, (update,))
        parts = {self.rank: own}
        for peer, (_, incoming) in self._streams.items():
            buffer, _, tail = incoming.take(f"its gradient norm of update {update}")
            got = tail[-TRAILER - 1]
            if got != update:
                raise PeerError(f"rank {self.rank} expected rank {peer}'s gradient norm of update {update} but got "
                                f"update {got}: the ranks are out of step")
            parts[peer] = float(buffer[:8].view(torch.float64).item())
        return math.sqrt(sum(parts[r] for r in range(self.num_stages)))

    def notify_failure(self, text: str) -> None:
        """Send every other rank a failure notice in place of a norm (best effort, once until :meth:`resync`)."""
        self.links.notify_failure(text)

    def sent_counts(self) -> dict[Any, int]:
        """Frames sent so far to each rank; after a failure the ranks take as many (:meth:`resync`)."""
        return self.links.sent_counts()

    def resync(self, counts: Sequence[Mapping[Any, int]]) -> None:
        """After a failure, with every rank's :meth:`sent_counts` (in rank order): take and drop what is left on
        the streams to this rank (the norms of undone updates and failure notices)."""
        self.links.resync(counts, lambda stream, buffer, array, tail: None)

    def close(self) -> None:
        self.links.close(deliver=False)


class RankGlobalNorm(DistributedGlobalNorm):
    """One process per rank, several stages on each: the first of this rank's stages to reach an update reads
    the buffers of them all (complete: a rank runs a group's updates after all its actions of that group, and
    untouched: every update starts here), as :class:`LocalGlobalNorm` does, and exchanges that sum with the
    other ranks as :class:`DistributedGlobalNorm` does. Needs every tied weight's owners on one rank (the
    tied weights' summed gradient is then read here)."""

    def __init__(self, stages: Mapping[int, ClippedStage], rank: int, num_ranks: int, timeout: float,
                 grid: Sequence[Sequence[int]] | None = None, replica: int = 0):
        crossing = sorted({name for st in stages.values() if st.ties is not None
                           for name, owners in st.ties.owners.items() if any(o not in stages for o in owners)})
        if crossing:
            raise ValueError(
                f"clip_grad_norm with several stages per rank needs each tied weight's owners on one rank; "
                f"{crossing} is held by stages on other ranks too (the V placements, zb-v and dualpipe-v, put the "
                "first and last stage on one rank)")
        super().__init__(rank, num_ranks, timeout, grid, replica)
        self._local = LocalGlobalNorm(stages)
        self._norms: dict[int, tuple[float, set[int]]] = {}

    def before_ties(self, stage: ClippedStage, update: int) -> None:
        if update in self._norms:
            return
        self._norms[update] = (self._exchange(self._local.squared(), update), set())

    def after_ties(self, stage: ClippedStage, update: int) -> float:
        norm, seen = self._norms[update]
        seen.add(stage.stage)
        if len(seen) == len(self._local.stages):
            del self._norms[update]
        return norm

    def discard(self, first_update: int) -> None:
        for update in [u for u in self._norms if u >= first_update]:
            del self._norms[update]


class GradClip:
    """One stage's clipping: the norm of each update group's gradient, and the gradient scaled down to
    ``max_norm`` when it is larger. ``global_norm`` is None for asynchronous algorithms (per-stage norms)."""

    def __init__(self, max_norm: float, global_norm: GlobalNorm | None):
        self.max_norm = max_norm
        self.global_norm = global_norm
        self.last_norm: float | None = None

    def before_ties(self, stage: ClippedStage, update: int) -> None:
        if self.global_norm is not None:
            self.global_norm.before_ties(stage, update)

    def apply(self, stage: ClippedStage, update: int) -> None:
        """Scale the stage's gradient buffer (after the tied gradients are applied)."""
        grad = stage.grad
        if self.global_norm is not None:
            norm = self.global_norm.after_ties(stage, update)
            self.last_norm = norm
            coef = clip_coefficient(norm, self.max_norm)
            if coef < 1.0:
                grad.mul_(coef)
            return
        spans = pieces(stage)
        untied = math.sqrt(sum(_squared(grad[a:b]) for a, b, name, _ in spans if name is None))
        self.last_norm = untied
        coef = clip_coefficient(untied, self.max_norm)
        for a, b, name, _ in spans:
            # A tied weight has the same gradient on every owner: clipped by its own norm, the copies stay equal.
            c = coef if name is None else clip_coefficient(math.sqrt(_squared(grad[a:b])), self.max_norm)
            if c < 1.0:
                grad[a:b].mul_(c)
