"""Schedules with several stages (model chunks) per rank and/or a split backward.

Five families, each ``f(num_stages, n_microbatches, n_minibatches=1, stages_per_rank=...) -> Schedule``, built
with :meth:`Schedule.from_ranks`: one action list per rank, its stages' actions interleaved in the order the
rank runs them. ``num_stages`` counts model chunks; the pipeline has ``R = num_stages // stages_per_rank``
ranks. Two placements occur:

* looped: rank ``r`` holds stages ``r, r + R, r + 2R, ...`` (interleaved 1F1B, looped BFS, ZB-H1/ZB1P);
* V: rank ``r`` holds stages ``r`` and ``2R - 1 - r`` (ZB-V, DualPipeV), so the first and the last stage are
  both on rank 0, and stages ``R - 1`` and ``R`` on rank ``R - 1``.

Split schedules write the backward as ``B`` (the input gradient, which the upstream stage waits for) and ``W``
(the weight gradients, which only need their own ``B``); every stage of a split schedule has a ``W`` for every
micro-batch. Where an original schedule runs a full (unsplit) backward on a split stage, it is written as its
``B`` immediately followed by its ``W``.

Micro-batches are numbered globally (mini-batch ``j`` holds ``j*m .. j*m+m-1``); these schedules are
synchronous: every rank runs all of mini-batch ``j``'s actions before any of ``j + 1``'s (a flush), each
mini-batch with the same shape.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from .ir import Action, B, F, Kind, W
from .schedule import Schedule

RankRows = list[list[Action]]


# --------------------------------------------------------------------------- sizes and assembly


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_sizes(name: str, num_stages: int, n_microbatches: int, n_minibatches: int, stages_per_rank: int,
                 allowed_per_rank: tuple[int, ...] | None = None) -> int:
    """Check the common sizes; return the number of ranks ``num_stages // stages_per_rank``."""
    for what, value in (("num_stages", num_stages), ("n_microbatches", n_microbatches),
                        ("n_minibatches", n_minibatches), ("stages_per_rank", stages_per_rank)):
        if not _is_int(value):
            raise ValueError(f"{name}: {what} must be an integer >= 1, got {value!r}")
        if value < 1:
            raise ValueError(f"{name}: {what} must be >= 1, got {value}")
    if allowed_per_rank is not None and stages_per_rank not in allowed_per_rank:
        allowed = " or ".join(str(v) for v in allowed_per_rank)
        raise ValueError(f"{name}: stages_per_rank must be {allowed} (the schedule places exactly that many stages "
                         f"on each rank), got {stages_per_rank}")
    if num_stages % stages_per_rank != 0:
        raise ValueError(f"{name}: num_stages ({num_stages}) must be a multiple of stages_per_rank "
                         f"({stages_per_rank}) so that every rank holds the same number of stages")
    return num_stages // stages_per_rank


def _check_rounds(name: str, n_microbatches: int, ranks: int, stages_per_rank: int) -> None:
    if stages_per_rank > 1 and n_microbatches % ranks != 0:
        raise ValueError(f"{name}: with stages_per_rank > 1, n_microbatches ({n_microbatches}) must be a multiple "
                         f"of the number of ranks ({ranks} = num_stages // stages_per_rank): micro-batches go "
                         f"round the loop of stages in groups of {ranks}")


def _assemble(one: Callable[[int], list[Action]], ranks: int, num_stages: int, m: int, n: int) -> Schedule:
    """The schedule whose every mini-batch runs ``one(rank)`` (written for micro-batches 0..m-1), flushed."""
    base = [one(r) for r in range(ranks)]
    rows: RankRows = [[] for _ in range(ranks)]
    for j in range(n):
        for r in range(ranks):
            rows[r] += [a if j == 0 else Action(a.stage, a.kind, a.index + j * m) for a in base[r]]
    return Schedule.from_ranks(rows, num_stages, m, n)


# --------------------------------------------------------------------------- interleaved 1F1B and ZB1P


def _looped_rank(rank: int, ranks: int, per_rank: int, m: int, zero_bubble: bool, slack: int = 0) -> list[Action]:
    """One rank's list of interleaved 1F1B (depth first), or of ZB1P when ``zero_bubble``.

    Forward op ``k`` (0 .. v*m-1) runs local chunk ``(k // g) % v`` on micro-batch ``(k // (g*v)) * g + k % g``
    with ``g`` micro-batches per round (``R`` when v > 1); backward op ``k`` does the same with the chunks
    visited last to first. Warm-up ``(v-1)*g + (1+slack)*(R-1-r)`` forwards, then forward op / backward op
    pairs, then the remaining backwards. ZB1P splits the backwards and, from its ``r``-th backward on, follows
    each ``B`` with the oldest pending ``W``; the rest of the ``W``s close the list.
    """
    v = per_rank
    total = v * m
    group = ranks if v > 1 else m

    def op(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // group) % v
        if backward:
            chunk = v - 1 - chunk
        return chunk * ranks + rank, (k // (group * v)) * group + k % group

    warmup = min((v - 1) * group + (1 + slack) * (ranks - 1 - rank), total)
    out: list[Action] = []
    pending: deque[tuple[int, int]] = deque()

    def backward(i: int) -> None:
        stage, k = op(i, True)
        out.append(Action(stage, B, k))
        if zero_bubble:
            pending.append((stage, k))
            if i >= rank:
                weight(*pending.popleft())

    def weight(stage: int, k: int) -> None:
        out.append(Action(stage, W, k))

    for k in range(warmup):
        stage, mb = op(k, False)
        out.append(Action(stage, F, mb))
    for i in range(total - warmup):
        stage, k = op(warmup + i, False)
        out.append(Action(stage, F, k))
        backward(i)
    for i in range(total - warmup, total):
        backward(i)
    while pending:
        weight(*pending.popleft())
    return out


def interleaved_one_f_one_b(num_stages: int, n_microbatches: int, n_minibatches: int = 1,
                            stages_per_rank: int = 1, slack: int = 1) -> Schedule:
    """Interleaved (virtual-pipeline) 1F1B, depth first: Megatron-LM's ``forward_backward_pipelining_with_
    interleaving`` (Narayanan et al., SC'21, "Efficient Large-Scale Language Model Training on GPU Clusters
    Using Megatron-LM"); torch's ``ScheduleInterleaved1F1B``.

    Shape: ``R = num_stages // stages_per_rank`` ranks, looped placement (rank ``r`` holds stages ``r, r+R,
    ...``; ``v = stages_per_rank`` chunks each). Micro-batches go round the loop in groups of ``R``: a rank
    forwards ``R`` micro-batches through its first chunk, the same ``R`` through its second, ..., then the next
    group. Rank ``r`` warms up with ``(v-1)*R + (1+slack)*(R-1-r)`` forwards, then alternates one forward and one
    backward (backwards visit the chunks last to first, in the same groups), then drains. The bubble is about
    ``1/v`` of 1F1B's.

    ``slack`` (default 1): extra warm-up forwards per rank downstream. Megatron and torch warm up with two
    forwards per hop (``slack=1``, this order exactly): when a message takes time to arrive, the first
    backward reaches an early rank later than the forwards ahead of it, and the extra forwards fill that wait
    (with F = B = 1 and no latency the makespan is the same either way). ``slack=0`` holds as few activations
    as 1F1B (rank ``r``'s ``R-r`` micro-batches' worth), and with ``stages_per_rank=1`` it is exactly
    :func:`~pipecore.schedule.generators.one_f_one_b`.

    Requires ``num_stages % stages_per_rank == 0`` and, when ``stages_per_rank > 1``,
    ``n_microbatches % R == 0``.
    """
    name = "interleaved_one_f_one_b"
    ranks = _check_sizes(name, num_stages, n_microbatches, n_minibatches, stages_per_rank)
    _check_rounds(name, n_microbatches, ranks, stages_per_rank)
    if not _is_int(slack) or slack < 0:
        raise ValueError(f"{name}: slack must be an integer >= 0 (extra warm-up forwards per rank downstream), "
                         f"got {slack!r}")
    return _assemble(lambda r: _looped_rank(r, ranks, stages_per_rank, n_microbatches, False, slack),
                     ranks, num_stages, n_microbatches, n_minibatches)


def zero_bubble_h1(num_stages: int, n_microbatches: int, n_minibatches: int = 1,
                   stages_per_rank: int = 1) -> Schedule:
    """ZB-H1 (Qi et al., ICLR'24, "Zero Bubble Pipeline Parallelism"; sail-sg/zero-bubble-pipeline-parallelism),
    and with ``stages_per_rank > 1`` its interleaved form ZB1P (torch's ``ScheduleInterleavedZeroBubble``).

    Shape: 1F1B (interleaved 1F1B for v > 1, looped placement) with every backward split into ``B`` (input
    gradient) and ``W`` (weight gradients). Rank ``r`` warms up like 1F1B (``(v-1)*R + R-1-r`` forwards), then
    runs F, B pairs; the first ``r`` of them without a ``W``, every later ``B`` followed by the oldest pending
    ``W``; the cooldown runs B, W pairs and the deferred ``W``s end the list, filling the cooldown bubble. A
    micro-batch's activations are held from its ``F`` to its ``W``, and no rank holds more of them than 1F1B's
    first rank (``R`` micro-batches of a rank's layers). With F = B = W the makespan is ``3*v*m + R - 1``
    chunk-times against 1F1B's ``3*v*m + 3*(R-1)``: a third of the bubble time.

    Requires ``num_stages % stages_per_rank == 0`` and, when ``stages_per_rank > 1``,
    ``n_microbatches % R == 0``.
    """
    name = "zero_bubble_h1"
    ranks = _check_sizes(name, num_stages, n_microbatches, n_minibatches, stages_per_rank)
    _check_rounds(name, n_microbatches, ranks, stages_per_rank)
    return _assemble(lambda r: _looped_rank(r, ranks, stages_per_rank, n_microbatches, True),
                     ranks, num_stages, n_microbatches, n_minibatches)


# --------------------------------------------------------------------------- looped BFS


def looped_bfs(num_stages: int, n_microbatches: int, n_minibatches: int = 1, stages_per_rank: int = 1) -> Schedule:
    """Looped BFS, breadth-first pipeline parallelism (Lamy-Poirier, 2022, arXiv:2211.05953; torch's
    ``ScheduleLoopedBFS``).

    Shape: looped placement (rank ``r`` holds stages ``r, r+R, ...``). Each rank forwards all ``m``
    micro-batches through its first stage, then all through its next stage, ...; then runs the backwards of
    its stages last stage first, each stage's micro-batches in order (torch runs them last to first; in order,
    a stage accumulates its gradients in the order sequential training does, bit for bit, and a group's last
    micro-batch is its last backward, which tied weights and the global gradient norm wait for). With
    ``stages_per_rank=1`` it is GPipe.

    Requires ``num_stages % stages_per_rank == 0``.
    """
    ranks = _check_sizes("looped_bfs", num_stages, n_microbatches, n_minibatches, stages_per_rank)
    m = n_microbatches

    def one(r: int) -> list[Action]:
        mine = range(r, num_stages, ranks)
        out = [Action(s, F, k) for s in mine for k in range(m)]
        out += [Action(s, B, k) for s in reversed(mine) for k in range(m)]
        return out

    return _assemble(one, ranks, num_stages, m, n_minibatches)


# --------------------------------------------------------------------------- V placement: ZB-V and DualPipeV


def _check_v(name: str, num_stages: int, n_microbatches: int, n_minibatches: int, stages_per_rank: int) -> int:
    ranks = _check_sizes(name, num_stages, n_microbatches, n_minibatches, stages_per_rank, allowed_per_rank=(2,))
    return ranks


class _Row:
    """One rank's list under construction, with per-(stage, kind) micro-batch counters."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.count: dict[tuple[int, Kind], int] = {}

    def add(self, stage: int, kind: Kind) -> int:
        k = self.count.get((stage, kind), 0)
        self.count[(stage, kind)] = k + 1
        self.actions.append(Action(stage, kind, k))
        return k


def zero_bubble_v(num_stages: int, n_microbatches: int, n_minibatches: int = 1, stages_per_rank: int = 2) -> Schedule:
    """ZB-V (Qi et al., ICLR'24, "Zero Bubble Pipeline Parallelism", section 6; torch's
    ``ScheduleZBVZeroBubble``).

    Shape: V placement, exactly two stages per rank (rank ``r`` holds stages ``r`` and ``2R-1-r``), backward
    split into ``B`` and ``W``. Rank ``r`` warms up with ``2(R-r)-1`` forwards of its first stage, then ``r``
    pairs (second-stage F, first-stage F), then ``R-r`` triples (second-stage F, B, W); in the steady state it
    repeats first-stage F, B, W and second-stage F, B, W; the cooldown runs ``r`` pairs of B's (first stage,
    second stage), then ``R-r`` first-stage (B, W) pairs, then the deferred ``W``s. With F = B = W the bubble
    is the ramp-up alone (``R-1`` per rank) for ``m >= 2R``, and each rank holds at most ``2R`` stage
    activations (``R`` micro-batches of a rank's layers, 1F1B's first rank's peak). Smaller ``m`` is run as
    the ``m = 2R-1`` schedule with the missing micro-batches left out.

    Requires ``stages_per_rank == 2`` and an even ``num_stages``.
    """
    ranks = _check_v("zero_bubble_v", num_stages, n_microbatches, n_minibatches, stages_per_rank)
    m = n_microbatches

    def one(rank: int) -> list[Action]:
        n_micro = max(2 * ranks - 1, m)
        first, second = rank, num_stages - 1 - rank
        row = _Row()
        for _ in range(2 * (ranks - rank) - 1):
            row.add(first, F)
        for _ in range(rank):
            row.add(second, F)
            row.add(first, F)
        for _ in range(ranks - rank):
            row.add(second, F)
            row.add(second, B)
            row.add(second, W)
        c = row.count
        while c.get((second, F), 0) < c.get((first, F), 0) or c.get((first, F), 0) < n_micro:
            if c.get((first, F), 0) < n_micro:
                row.add(first, F)
            row.add(first, B)
            row.add(first, W)
            row.add(second, F)
            row.add(second, B)
            row.add(second, W)
        # Cooldown: B's first; their W's after (counters of W continue from the B's already W'd).
        for _ in range(rank):
            row.add(first, B)
            row.add(second, B)
        for _ in range(ranks - rank):
            row.add(first, B)
            row.add(first, W)
        while c.get((second, W), 0) < c.get((second, B), 0):
            row.add(second, W)
        while c.get((first, W), 0) < c.get((first, B), 0):
            row.add(first, W)
        return [a for a in row.actions if a.index < m]

    return _assemble(one, ranks, num_stages, m, n_minibatches)


def dualpipe_v(num_stages: int, n_microbatches: int, n_minibatches: int = 1, stages_per_rank: int = 2) -> Schedule:
    """DualPipeV: DeepSeek's DualPipe (DeepSeek-V3 technical report, arXiv:2412.19437) folded onto half the
    ranks ("cut-in-half", deepseek-ai/DualPipe's ``dualpipev.py``; torch's ``ScheduleDualPipeV``).

    Shape: V placement, exactly two stages per rank (rank ``r`` holds stages ``r`` and ``2R-1-r``), backward
    split into ``B`` and ``W``. Rank ``r`` runs, in eight steps: ``2(R-r-1)`` first-stage forwards; ``r+1``
    pairs of forwards (first stage, second stage); ``R-r-1`` triples (second-stage B, the oldest pending W,
    second-stage F); the main phase, ``m - 2R + r + 1`` times an overlapped (first-stage F, second-stage full
    backward) then an overlapped (second-stage F, first-stage full backward); ``R-r-1`` times a second-stage
    full backward and an overlapped (second-stage F, first-stage full backward); ``r+1`` pairs of backwards
    (second stage, first stage), split into B-only from the middle on; ``R-r-1`` times (oldest pending W,
    first-stage B); and the remaining ``W``s. An overlapped forward/backward pair (issued together, the
    forward's compute hiding the backward's communication) is written as two consecutive actions, the F first;
    a full backward as its B followed at once by its W.

    Requires ``stages_per_rank == 2`` and ``n_microbatches >= num_stages``.
    """
    name = "dualpipe_v"
    ranks = _check_v(name, num_stages, n_microbatches, n_minibatches, stages_per_rank)
    m = n_microbatches
    if m < num_stages:
        raise ValueError(f"{name}: n_microbatches ({m}) must be >= num_stages ({num_stages}, twice the number of "
                         "ranks) to fill the V in both directions")

    def one(rank: int) -> list[Action]:
        first, second = rank, num_stages - 1 - rank
        row = _Row()
        pending: deque[tuple[int, int]] = deque()

        def split_b(stage: int) -> None:
            pending.append((stage, row.add(stage, B)))

        def full_b(stage: int) -> None:
            row.actions.append(Action(stage, W, row.add(stage, B)))

        def oldest_w() -> None:
            if pending:
                stage, k = pending.popleft()
                row.actions.append(Action(stage, W, k))

        def overlapped(forward: int, backward: int) -> None:
            row.add(forward, F)
            full_b(backward)

        for _ in range(2 * (ranks - rank - 1)):
            row.add(first, F)
        for _ in range(rank + 1):
            row.add(first, F)
            row.add(second, F)
        for _ in range(ranks - rank - 1):
            split_b(second)
            oldest_w()
            row.add(second, F)
        for _ in range(m - 2 * ranks + rank + 1):
            # (torch does not overlap the last rank's first pair; in a list the order is the same)
            overlapped(first, second)
            overlapped(second, first)
        for _ in range(ranks - rank - 1):
            full_b(second)
            overlapped(second, first)
        split = False
        steps = rank + 1
        for i in range(steps):
            if i == steps // 2 and rank % 2 == 1:
                split = True
            (split_b if split else full_b)(second)
            if i == steps // 2 and rank % 2 == 0:
                split = True
            (split_b if split else full_b)(first)
        for _ in range(ranks - rank - 1):
            oldest_w()
            (split_b if split else full_b)(first)
        while pending:
            oldest_w()
        return row.actions

    return _assemble(one, ranks, num_stages, m, n_minibatches)


MODERN_FAMILIES: dict[str, Callable[..., Schedule]] = {
    "interleaved-1f1b": interleaved_one_f_one_b,
    "looped-bfs": looped_bfs,
    "zb-h1": zero_bubble_h1,
    "zb-v": zero_bubble_v,
    "dualpipe-v": dualpipe_v,
}
