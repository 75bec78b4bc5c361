"""The stage cost model: predicted peak memory and time of a stage, and what to recompute or offload to fit a
limit.

A stage covers the compute nodes ``[start, end)`` of a :class:`~pipecore.planning.costs.GraphCosts`. What it
holds depends on the algorithm through four per-stage figures that the simulator measures (:class:`Sizing`):
weight versions, whether derived weights need a scratch buffer, how many weight-sized buffers the algorithm
declares (:mod:`pipecore.algorithms.state`), and the
peak number of micro-batches in flight. :class:`StageMemory` lists the terms; :class:`StageModel` evaluates
many ranges of one graph quickly and chooses recomputed and offloaded segments (:meth:`StageModel.fit`).

Which terms come from where:

* weights x versions, gradient buffer, scratch, declared buffers, optimizer state: what ``TensorStage``
  allocates (ring of ``versions`` slots, flat gradient buffer, scratch for derived weights, the algorithm's
  declared buffers); the buffers are assumed to have the weights' dtype (they are float32
  under bf16 weights).
* activations x in-flight micro-batches: DawnPiper's ``(P - s) * |A_s|`` term, with the in-flight count
  taken from the simulator rather than the formula, so that it holds for every schedule.
* recomputed and offloaded segments, their transient, the offload link's time, boundary buffers: inferred
  (DawnPiper's paper was not available); see :meth:`StageModel.memory` and :meth:`StageModel.time`. What a
  segment frees and holds is counted value by value when the costs list the graph's values (a profile does),
  so that it matches what the runtime keeps.
* the weight ring's padding (each version starts at a multiple of 64 elements) is left out.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

from .costs import GraphCosts, ValueCost
from .sizing import Sizing

Segment = tuple[int, int]


@dataclass(frozen=True)
class StageMemory:
    """Predicted peak bytes of one stage, term by term (see :meth:`StageModel.memory`)."""

    weights: int          # the ring: parameter bytes x versions held
    gradients: int        # the flat gradient buffer: 1 x parameter bytes
    scratch: int          # derived weights (prediction, interpolation, correction): 1 x parameter bytes
    buffers: int          # the algorithm's declared buffers: 1 x parameter bytes each
    optimizer: int        # optimizer state of the stage's parameters
    activations: int      # saved-for-backward bytes kept per in-flight micro-batch, x in-flight
    # Transient during one backward: the largest recomputed segment's saved bytes, or the largest offloaded
    # segment's prefetch, whichever is more.
    recomputation: int
    boundary: int         # received inputs and sent outputs of the in-flight micro-batches
    # The copies that undo a failed step (Pipeline(recover=True)): optimizer state and declared buffers, weights
    # and gradients, as many of each as the stage keeps (Sizing.undo_*).
    undo: int = 0

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.scratch + self.buffers + self.optimizer + self.activations
                + self.recomputation + self.boundary + self.undo)


@dataclass(frozen=True)
class StageFit:
    """A stage with the recomputation and offload chosen for a memory limit (:meth:`StageModel.fit`)."""

    start: int
    end: int
    stage: int
    recomputed: tuple[Segment, ...]
    offloaded: tuple[Segment, ...]
    time: float
    memory: StageMemory
    fits: bool


@dataclass(frozen=True)
class Choice:
    """One step of :meth:`StageModel.memory_path`: the segments chosen so far, and the stage's predicted peak
    and time with them."""

    recomputed: tuple[Segment, ...]
    offloaded: tuple[Segment, ...]
    memory: StageMemory
    time: float


class StageModel:
    """The cost model of one graph under one :class:`Sizing`, for many stage ranges.

    Range sums come from prefix sums, so a range costs O(1) however long; the memory path of a range
    (:meth:`memory_path`) is computed once and kept.
    """

    def __init__(self, costs: GraphCosts, sizing: Sizing):
        self.costs = costs
        self.sizing = sizing
        self.num_nodes = n = len(costs)

        def prefix(values: Sequence[float]) -> list:
            out = [0]
            for v in values:
                out.append(out[-1] + v)
            return out

        self._compute = prefix([f + b for f, b in zip(costs.forward_s, costs.backward_s)])
        self._forward = prefix(costs.forward_s)
        self._saved = prefix(costs.saved_bytes)
        self._params = prefix(costs.param_bytes)
        self._optimizer = prefix(costs.optimizer_bytes)
        # Bytes crossing into position c: the graph's inputs at 0, the crossing values inside, nothing at n.
        self._crossing = [costs.input_bytes, *costs.crossing_bytes, 0]
        assert len(self._crossing) == n + 1
        # What of a crossing a stage keeps anyway, because one of its nodes saves it (see GraphCosts).
        self._sent_saved = [*(costs.crossing_saved_before or [0] * n), 0]
        self._received_saved = [*(costs.crossing_saved_after or [0] * n), 0]
        self._paths: dict[tuple[int, int, int, bool], MemoryPath] = {}
        self._waiting: dict[tuple[int, int], int] = {}
        # Per position e, the last node before e that reads a parameter (-1: none): a micro-batch waiting for its
        # W keeps what the nodes up to it save (see memory).
        readers = {i for i, b in enumerate(costs.param_bytes) if b > 0} | {r for t in costs.tied for r in t.readers}
        self._last_reader = [-1]
        for i in range(n):
            self._last_reader.append(i if i in readers else self._last_reader[-1])
        self._values = _Values(costs.values)

    # -- range sums ----------------------------------------------------------------------------------

    def forward(self, start: int, end: int) -> float:
        """Forward seconds of nodes ``[start, end)``: the extra time of recomputing them."""
        return self._forward[end] - self._forward[start]

    def saved(self, start: int, end: int) -> int:
        return self._saved[end] - self._saved[start]

    def params(self, start: int, end: int) -> int:
        return self._params[end] - self._params[start]

    def optimizer(self, start: int, end: int) -> int:
        return self._optimizer[end] - self._optimizer[start]

    def crossing(self, position: int) -> int:
        """Bytes crossing a cut placed before node ``position`` (the graph's inputs at 0, nothing at the end)."""
        return self._crossing[position]

    def waiting(self, start: int, end: int) -> int:
        """Bytes that a micro-batch of stage ``[start, end)`` whose B ran keeps until its deferred W: what the
        nodes up to the stage's last parameter-reading node save (the graph below the weights' junctions, which
        B retains for W), the received values they save included (:meth:`_received_kept`). Its B freed the rest:
        what later nodes and the loss saved, and its boundary tensors that no node saved. 0 for a stage that reads
        no parameter (its B leaves nothing for a W). Recomputed and offloaded segments that end by the last
        parameter-reading node free of it what they free of a micro-batch before its B (:meth:`memory`)."""
        last = self._last_reader[end]
        if last < start:
            return 0
        key = (start, last)
        if key not in self._waiting:
            self._waiting[key] = self.saved(start, last + 1) + self._received_kept(start, last)
        return self._waiting[key]

    def _received_kept(self, start: int, last: int) -> int:
        """Bytes of the values received at ``start`` that nodes ``[start, last]`` save but that are charged to an
        earlier stage's node (their first saver): kept with the retained graph, and in no saved bytes of the
        stage. Without the graph's values, the received bytes that no node of the stage is charged with
        (inferred: a stage's first nodes read, and most often save, its input)."""
        if not self.costs.values:
            return self.crossing(start) - self._received_saved[start]
        v = self._values
        pairs = (v.saver_at >= start) & (v.saver_at <= last)
        values = np.unique(v.saver_of[pairs])
        values = values[(v.producer[values] < start) & (v.first_saver[values] < start) & (v.first_saver[values] >= 0)]
        return int(v.nbytes[values].sum())

    # -- the model -----------------------------------------------------------------------------------

    def check_range(self, start: int, end: int, stage: int) -> None:
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= self.num_nodes):
            raise ValueError(f"a stage covers nodes [start, end) with 0 <= start < end <= {self.num_nodes}, "
                             f"got [{start}, {end})")
        if not (isinstance(stage, int) and 0 <= stage < self.sizing.num_stages):
            raise ValueError(f"stage must lie in 0..{self.sizing.num_stages - 1}, got {stage}")

    def check_segments(self, start: int, end: int, recomputed: Sequence[Segment] = (),
                       offloaded: Sequence[Segment] = ()) -> tuple[tuple[Segment, ...], tuple[Segment, ...]]:
        """Validate the recomputed and offloaded segments of stage ``[start, end)``: together, non-empty and
        non-overlapping ranges ``[i, j)`` inside it; none under ``backward_rule="recompute"``; offload only
        with a measured host bandwidth. Returns both, sorted."""
        recomputed_ = tuple(sorted((int(i), int(j)) for i, j in recomputed))
        offloaded_ = tuple(sorted((int(i), int(j)) for i, j in offloaded))
        if (recomputed_ or offloaded_) and self.sizing.recompute_all:
            raise ValueError(f"{self.sizing.algorithm} recomputes every forward in its backward "
                             "(backward_rule='recompute'); recomputed and offloaded segments do not apply")
        if offloaded_ and self.costs.host_bytes_per_s <= 0:
            raise ValueError(f"offload needs GraphCosts.host_bytes_per_s > 0, measured on a CUDA device; these costs "
                             f"(device {self.costs.device!r}) have {self.costs.host_bytes_per_s}, got offloaded "
                             f"segments {list(offloaded)}")
        previous = start
        for i, j in sorted(recomputed_ + offloaded_):
            if not (previous <= i < j <= end):
                raise ValueError(f"recomputed and offloaded segments, together, must be non-empty, non-overlapping "
                                 f"ranges [i, j) inside the stage's nodes [{start}, {end}), got recomputed "
                                 f"{list(recomputed)} and offloaded {list(offloaded)}")
            previous = j
        return recomputed_, offloaded_

    def time(self, start: int, end: int, recomputed: Sequence[Segment] = (),
             offloaded: Sequence[Segment] = ()) -> float:
        """Predicted seconds of one micro-batch's forward and backward at the stage.

        The compute: the nodes' forward and backward times plus the forward time of every recomputed segment
        (a whole extra forward under ``backward_rule="recompute"``), and the loss's at the last stage.
        Communication between stages is taken to overlap with compute (DawnPiper's objective, as reported
        second-hand).

        With offloaded segments: ``max(compute, X / GraphCosts.host_bytes_per_s)``, ``X`` being the bytes each
        micro-batch copies to host memory (:meth:`offload_bytes`). Inferred: the copies run on a side stream
        alongside compute, and in steady state each micro-batch's ``X`` go out and come back while the stage
        computes one micro-batch (the link is full duplex), so the stage is as slow as the slower of the two.
        """
        if recomputed or offloaded:
            self.check_range(start, end, 0)
            recomputed, offloaded = self.check_segments(start, end, recomputed, offloaded)
        compute = self._compute_seconds(start, end, recomputed)
        if not offloaded:
            return compute
        return max(compute, self._segment_bytes(start, end, (), offloaded)[2] / self.costs.host_bytes_per_s)

    def _compute_seconds(self, start: int, end: int, recomputed: Sequence[Segment]) -> float:
        """The compute part of :meth:`time`, segments unchecked."""
        extra = self.forward(start, end) if self.sizing.recompute_all else 0.0
        loss = self.costs.loss_s if end == self.num_nodes else 0.0  # the last stage's loss
        return (self._compute[end] - self._compute[start] + extra + loss
                + sum(self.forward(i, j) for i, j in recomputed))

    def offload_bytes(self, start: int, end: int, offloaded: Sequence[Segment]) -> int:
        """Bytes that the ``offloaded`` segments of stage ``[start, end)`` copy to host memory per micro-batch
        (and back before their backward): what each segment's nodes save, each value once per segment, the
        stage's received and sent values included (see :meth:`memory`)."""
        self.check_range(start, end, 0)
        _, offloaded = self.check_segments(start, end, (), offloaded)
        return self._segment_bytes(start, end, (), offloaded)[2]

    def memory(self, start: int, end: int, stage: int, recomputed: Sequence[Segment] = (),
               offloaded: Sequence[Segment] = ()) -> StageMemory:
        """Predicted peak bytes of stage ``stage`` covering nodes ``[start, end)``, with the node ranges in
        ``recomputed`` recomputed in the backward and those in ``offloaded`` offloaded to host memory.

        With ``W`` the parameter bytes of the nodes (a tied parameter first read before the stage included),
        ``k`` the in-flight micro-batches of the stage and
        ``S`` the saved bytes of nodes:

        * weights ``versions * W``, gradients ``W``, scratch ``W`` if derived weights, ``W`` per buffer the
          algorithm declares, optimizer state as given;
        * undo (``Pipeline(recover=True)``): per copy of the state the stage keeps to undo a failed step, its
          optimizer state and ``W`` per declared buffer; ``W`` per copy of the weights and per copy of the
          gradient buffer (``Sizing.undo_states``, ``undo_weights``, ``undo_gradients``);
        * activations ``k * (S(stage) - freed)``: recomputed and offloaded segments free what only their
          nodes save, unless the stage keeps it anyway: as its input or output, or as a recomputed segment's
          input (the checkpoint keeps those; an offloaded segment keeps nothing). With the graph's values
          (``GraphCosts.values``) this is exact at the level of storages; without them, a recomputed segment
          ``[i, j)`` frees ``S(segment)`` and keeps the bytes crossing ``i`` (inferred), an offloaded one
          frees ``S(segment)``;
        * recomputation (the transient): during one backward the segments are recomputed or prefetched one
          after the other, each freed after its backward, so the largest one sets the transient peak,
          counted on top of every micro-batch in flight (inferred; the whole stage under
          ``backward_rule="recompute"``). A recomputed segment holds what its nodes save that they also make
          (their inputs exist already); an offloaded one holds what it copied back: what its nodes save,
          each value once, the stage's received and sent values included (moved, not freed: the stage keeps
          them as its boundary buffers);
        * the loss: the last stage keeps what the loss saves (``GraphCosts.loss_saved_bytes``) per
          micro-batch in flight, counted in the activations (in the transient when every forward is
          recomputed);
        * boundary ``k * (crossing(start) + crossing(end))``: each in-flight micro-batch's received input
          and sent output stay alive until its backward (inferred; the first stage's input is
          ``GraphCosts.input_bytes``, the last stage sends nothing that is kept), less what the stage's nodes
          save of them (``GraphCosts.crossing_saved_after`` at the start, ``crossing_saved_before`` at the end),
          which is one tensor counted in the activations;
        * micro-batches waiting for a deferred W (a split backward, ``Sizing.held``): of the ``k`` in flight,
          ``w`` have run their B and keep only :meth:`waiting` each, counted in the activations (no loss, no
          boundary). The stage's ``(k - w, w)`` is the pair of ``Sizing.held`` that holds the most bytes, and
          the activations and boundary terms above count ``k - w`` micro-batches.

        First-order: a value saved before the stage and crossing it to a later one is taken as saved in this
        stage, and transient buffers of one forward or backward are not counted. Offloaded bytes in host
        memory are not counted (they are not the device's).
        """
        self.check_range(start, end, stage)
        recomputed, offloaded = self.check_segments(start, end, recomputed, offloaded)
        z = self.sizing
        w, optimizer = self.params(start, end), self.optimizer(start, end)
        for tied in self.costs.tied:  # held again by a stage with a later reader
            if tied.readers[0] < start and any(start <= r < end for r in tied.readers):
                w, optimizer = w + tied.param_bytes, optimizer + tied.optimizer_bytes
        loss = self.costs.loss_saved_bytes if end == self.num_nodes else 0
        if z.recompute_all:
            kept, transient = 0, self.saved(start, end) + loss
        else:
            freed, transient, _ = self._segment_bytes(start, end, recomputed, offloaded)
            kept = self.saved(start, end) - freed
        # Per micro-batch: the activations and boundary buffers of one pending its B, and what one waiting for its
        # W keeps; the stage peaks at whichever of its held pairs holds the most.
        activations = kept + (0 if z.recompute_all else loss)
        boundary = self.crossing(start) + self.crossing(end) if z.recompute_all else \
            self.crossing(start) - self._received_saved[start] + self.crossing(end) - self._sent_saved[end]
        # (Only a stage that splits its backward has micro-batches waiting: the others need no waiting bytes.)
        waiting = 0
        if max(w for _, w in z.held[stage]):
            # What the segments up to the last parameter-reading node free, a waiting micro-batch is freed of too.
            last = self._last_reader[end]
            early = [[(i, j) for i, j in segments if j <= last + 1] for segments in (recomputed, offloaded)]
            waiting = max(0, self.waiting(start, end) - (0 if z.recompute_all else
                                                         self._segment_bytes(start, end, *early)[0]))
        k, waits = max(z.held[stage], key=lambda pair: (pair[0] * (activations + boundary) + pair[1] * waiting, pair))
        return StageMemory(
            weights=z.versions[stage] * w,
            gradients=w,
            scratch=w if z.derived[stage] else 0,
            buffers=z.buffers[stage] * w,
            optimizer=optimizer,
            activations=k * activations + waits * waiting,
            recomputation=transient,
            # Under recomputation of the whole stage its forward saves nothing: both crossings are kept apart.
            boundary=k * boundary,
            undo=(z.undo_states[stage] * (optimizer + z.buffers[stage] * w)
                  + (z.undo_weights[stage] + z.undo_gradients[stage]) * w),
        )

    def _segment_bytes(self, start: int, end: int, recomputed: Sequence[Segment],
                       offloaded: Sequence[Segment]) -> tuple[int, int, int]:
        """Per micro-batch, for checked segments: the bytes that recomputing and offloading them frees, the
        largest segment's transient, and the bytes offloaded (see :meth:`memory`)."""
        if not recomputed and not offloaded:
            return 0, 0, 0
        if not self.costs.values:
            # Range sums: a recomputed segment keeps the bytes crossing into it, an offloaded one nothing.
            freed = sum(self.saved(i, j) - (self.crossing(i) if i > start else 0) for i, j in recomputed)
            moved = sum(self.saved(i, j) for i, j in offloaded)
            transient = max(self.saved(i, j) for i, j in (*recomputed, *offloaded))
            return freed + moved, transient, moved
        v = self._values
        segments = [*recomputed, *offloaded]
        count, r = len(segments), len(recomputed)  # segments 0..r-1 are recomputed, r.. offloaded
        # The segment of each position -1..N (-1: none), at index position + 1.
        home = np.full(self.num_nodes + 2, -1, dtype=np.int64)
        for k, (i, j) in enumerate(segments):
            home[i + 1:j + 1] = k
        firsts = np.array([i for i, _ in segments], dtype=np.int64)
        # Saved bytes that are no value of the graph (BatchNorm's statistics, say) go with their segment: all a
        # segment's nodes save less the values charged to them (GraphCosts.saved_bytes charges a value to its
        # first saver).
        charged_in = home[v.first_saver + 1]
        charged = np.bincount(charged_in[charged_in >= 0], v.nbytes[charged_in >= 0], minlength=count)
        other = np.maximum(0, np.array([self.saved(i, j) for i, j in segments]) - charged).astype(np.int64)
        received = v.producer < start
        sent = (v.last_use >= end) & (end < self.num_nodes)
        # A recomputed segment's transient: what its nodes save that they also make (their inputs exist already).
        saver_home = home[v.saver_at + 1]
        own = np.zeros(len(v.nbytes), dtype=bool)
        own[v.saver_of[(saver_home >= 0) & (saver_home < r) & (saver_home == home[v.producer[v.saver_of] + 1])]] = True
        made = np.bincount(home[v.producer[own] + 1], v.nbytes[own], minlength=count).astype(np.int64)
        # An offloaded segment's transient and link bytes: each value its nodes save, once, the stage's
        # received and sent values included (the runtime moves every saved activation; those stay on the
        # device as the stage's boundary buffers too, so they are moved but not freed).
        pairs = saver_home >= r
        value_segment = np.unique(v.saver_of[pairs] * count + saver_home[pairs])
        moved = np.bincount(value_segment % count, v.nbytes[value_segment // count],
                            minlength=count).astype(np.int64)
        # Freed: saved by nodes of the stage, all in segments, and kept by the stage for no other reason.
        # (Received and sent values are the stage's boundary buffers.)
        in_stage = (v.saver_at >= start) & (v.saver_at < end)
        saved_here = np.bincount(v.saver_of[in_stage], minlength=len(v.nbytes)) > 0
        kept_by_node = np.bincount(v.saver_of[in_stage & (saver_home < 0)], minlength=len(v.nbytes)) > 0
        # A recomputed segment's checkpoint keeps its inputs; an offloaded segment keeps none.
        user_home = home[v.user_at + 1]
        into = (user_home >= 0) & (user_home < r)
        checkpointed = np.zeros(len(v.nbytes), dtype=bool)
        checkpointed[v.user_of[into][v.producer[v.user_of[into]] < firsts[user_home[into]]]] = True
        freed = saved_here & ~kept_by_node & ~received & ~sent & ~checkpointed
        # A recomputed segment's input that no node of the stage saved is kept now (unless the stage keeps
        # it anyway).
        added = checkpointed & ~saved_here & ~received & ~sent
        transient = np.where(np.arange(count) < r, other + made, other + moved)
        return (int(v.nbytes[freed].sum() - v.nbytes[added].sum() + other.sum()), int(transient.max()),
                int((other + moved)[r:].sum()))

    def memory_path(self, start: int, end: int, stage: int) -> list[Choice]:
        """The recomputation and offload choices in the order the cost model makes them, each with the
        stage's memory and time after it (the first entry: nothing chosen).

        Granularity: any contiguous run of nodes ``[i, j)`` inside the stage that overlaps no segment chosen
        before is a candidate, as a recomputed segment and, when ``GraphCosts.host_bytes_per_s`` is above 0,
        as an offloaded one (a run keeps one input however many nodes it spans, so runs free far more than
        single nodes). Each step takes the candidate freeing the most bytes per second of added time. With
        ``T`` the stage's compute seconds so far, ``X`` its offloaded bytes per micro-batch so far, ``bw`` the
        host bandwidth, ``k`` the micro-batches in flight, and for the run ``S`` its saved bytes, ``I`` its input
        kept, ``f`` its forward seconds and ``G`` the growth of the largest transient:

        * recompute frees ``k * (S - I) - G`` in ``max(T + f, X / bw) - max(T, X / bw)`` seconds (``f`` while
          nothing is offloaded; nothing while the link is the bottleneck);
        * offload frees ``k * S - G`` in ``max(T, (X + S) / bw) - max(T, X / bw)`` seconds (nothing while
          the link has slack).

        Zero-time candidates come first; at equal rates more bytes, then the shorter run, then the earlier
        one, then the one adding fewer seconds, and at a full tie the recomputation (it leaves the link's
        slack to later runs). The path ends when no candidate frees anything. Candidates are scored from
        range sums, so that a step costs O(L^2) (vectorised) for a stage of L nodes; each step's memory and
        time are then :meth:`memory`'s and :meth:`time`'s, exact with the graph's values. The path does not
        depend on the limit: fitting a limit takes the shortest prefix that fits it (:meth:`fit` also tries
        the path that only recomputes, which this one, greedy, can miss).
        """
        path = self._path(start, end, stage)
        path.extend_all()
        return path.steps

    def _path(self, start: int, end: int, stage: int, offload: bool = True) -> "MemoryPath":
        self.check_range(start, end, stage)
        key = (start, end, stage, offload)
        if key not in self._paths:
            self._paths[key] = MemoryPath(self, start, end, stage, offload)
        return self._paths[key]

    def floor(self, start: int, end: int, stage: int) -> int:
        """A lower bound of the stage's memory under any recomputation or offload: every term but the
        activations and the transient."""
        return _floor(self.memory(start, end, stage))

    def fit(self, start: int, end: int, stage: int, memory_limit: float | None = None,
            trade_time: bool = True) -> StageFit:
        """The stage under ``memory_limit`` with the fewest steps of a memory path (none without a limit, or
        with ``trade_time=False``: neither recomputation nor offload). With a host link two paths are tried,
        :meth:`memory_path` and the path that only recomputes, and the faster of their fitting choices is
        taken (the recomputing one at equal time): so that a link never makes a stage slower or a limit
        unreachable, though the greedy mixed path can end above what recomputation alone reaches. When no
        choice fits, ``fits`` is False and the stage is returned with neither."""
        memory = self.memory(start, end, stage)
        if memory_limit is None or memory.total <= memory_limit or not trade_time or \
                _floor(memory) > memory_limit:
            fits = memory_limit is None or memory.total <= memory_limit
            return StageFit(start, end, stage, (), (), self.time(start, end), memory, fits)
        best: Choice | None = None
        for path in self.memory_paths(start, end, stage):
            choice = path.first_within(memory_limit)
            if choice is not None and (best is None or choice.time < best.time):
                best = choice
        if best is None:
            return StageFit(start, end, stage, (), (), self.time(start, end), memory, False)
        return StageFit(start, end, stage, best.recomputed, best.offloaded, best.time, best.memory, True)

    def smallest_memory(self, start: int, end: int, stage: int, trade_time: bool = True) -> int:
        """The least peak bytes the stage reaches: over every step of its memory paths (see :meth:`fit`), or
        with none (``trade_time=False``)."""
        if not trade_time:
            return self.memory(start, end, stage).total
        least = self.memory(start, end, stage).total
        for path in self.memory_paths(start, end, stage):
            path.extend_all()
            least = min(least, min(choice.memory.total for choice in path.steps))
        return least

    def memory_paths(self, start: int, end: int, stage: int) -> list["MemoryPath"]:
        """The paths :meth:`fit` chooses from: recomputation only, then (with a host link) the mixed one."""
        if self.costs.host_bytes_per_s <= 0:
            return [self._path(start, end, stage)]
        return [self._path(start, end, stage, offload=False), self._path(start, end, stage)]


def _floor(memory: StageMemory) -> int:
    """What a stage holds whatever it recomputes or offloads: every term of its memory but the activations and
    the transient (see :meth:`StageModel.floor`)."""
    return memory.total - memory.activations - memory.recomputation


class _Values:
    """``GraphCosts.values`` as arrays: per value its producer, bytes, first saver (-2: none) and last use;
    every (value, saver) and (value, user) pair flattened."""

    def __init__(self, values: Sequence[ValueCost]):
        def ints(items: Iterable[int]) -> np.ndarray:
            return np.fromiter(items, dtype=np.int64)

        self.producer = ints(v.producer for v in values)
        self.nbytes = ints(v.nbytes for v in values)
        # -2 for no saver: it indexes home[-1], position N, which no segment holds.
        self.first_saver = ints(v.savers[0] if v.savers else -2 for v in values)
        self.last_use = ints(v.users[-1] if v.users else -1 for v in values)
        self.saver_of = ints(k for k, v in enumerate(values) for _ in v.savers)
        self.saver_at = ints(x for v in values for x in v.savers)
        self.user_of = ints(k for k, v in enumerate(values) for _ in v.users)
        self.user_at = ints(x for v in values for x in v.users)


class MemoryPath:
    """The memory path of one stage (:meth:`StageModel.memory_path`), extended on demand."""

    def __init__(self, model: StageModel, start: int, end: int, stage: int, offload: bool = True):
        self.model, self.start, self.end, self.stage = model, start, end, stage
        self.steps: list[Choice] = [Choice((), (), model.memory(start, end, stage), model.time(start, end))]
        # The micro-batches in flight (those waiting for a W keep less, and segments free less of them: first-order).
        self.k = model.sizing.in_flight[stage]
        self.done = model.sizing.recompute_all or self.k == 0 or model.saved(start, end) == 0
        self.bandwidth = model.costs.host_bytes_per_s if offload else 0.0  # 0: recomputation only
        self._recomputed: list[Segment] = []
        self._offloaded: list[Segment] = []
        self._offload_bytes = 0  # X: what the chosen offloaded segments move per micro-batch
        self._transient = 0
        self._hold = False  # inside _holding: keep the candidate arrays built (_held) for the next step
        self._held: tuple[np.ndarray, ...] | None = None

    def _candidates(self) -> tuple[np.ndarray, ...]:
        # Every run [i, j) of the stage, as arrays: first node, end, saved bytes, input kept, forward seconds,
        # and whether it overlaps no chosen segment. Held only while the path is being extended (see
        # _holding): a planner visits thousands of stage ranges, and O(L^2) arrays kept for each would hold
        # gigabytes for graphs of 500 nodes.
        if self._held is not None:
            return self._held
        m, a, b = self.model, self.start, self.end
        first, stop = np.triu_indices(b - a + 1, k=1)
        first, stop = first + a, stop + a
        saved_prefix = np.array(m._saved[a:b + 1], dtype=np.int64)
        forward_prefix = np.array(m._forward[a:b + 1], dtype=np.float64)
        saved = saved_prefix[stop - a] - saved_prefix[first - a]
        keeps = np.array([0, *m._crossing[a + 1:b]], dtype=np.int64)[first - a]
        seconds = forward_prefix[stop - a] - forward_prefix[first - a]
        free = np.ones(len(first), dtype=bool)
        for i, j in (*self._recomputed, *self._offloaded):
            free &= (stop <= i) | (first >= j)
        arrays = first, stop, saved, keeps, seconds, free
        if self._hold:
            self._held = arrays
        return arrays

    @contextmanager
    def _holding(self) -> Iterator[None]:
        """Within the block, the candidate arrays are built at most once and kept up to date step by step."""
        if self._hold:
            yield
            return
        self._hold = True
        try:
            yield
        finally:
            self._hold, self._held = False, None

    def _scores(self, candidates: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Bytes freed and seconds added by every candidate: the recomputed runs, then (with a host bandwidth)
        the offloaded ones (see :meth:`StageModel.memory_path`)."""
        first, stop, saved, keeps, forward, _ = candidates
        compute = self.model._compute_seconds(self.start, self.end, self._recomputed)
        link = self._offload_bytes / self.bandwidth if self.bandwidth > 0 else 0.0
        growth = np.maximum(0, saved - self._transient)
        # max(T + f, X / bw) - max(T, X / bw), written so that it is f exactly while the link is idle.
        freed = [self.k * (saved - keeps) - growth]
        seconds = [forward if link <= compute else forward - np.clip(link - compute, 0.0, forward)]
        if self.bandwidth <= 0:
            return freed[0], seconds[0]
        freed.append(self.k * saved - growth)
        seconds.append(np.maximum(compute, (self._offload_bytes + saved) / self.bandwidth) - max(compute, link))
        return np.concatenate(freed), np.concatenate(seconds)

    def first_within(self, memory_limit: float) -> Choice | None:
        """The first step whose peak is within ``memory_limit`` (extending the path as needed), or None."""
        index = 0
        with self._holding():
            while self.steps[index].memory.total > memory_limit:
                index += 1
                if index == len(self.steps) and not self.extend():
                    return None
        return self.steps[index]

    def extend_all(self) -> None:
        """Extend the path to its end."""
        with self._holding():
            while self.extend():
                pass

    def extend(self) -> bool:
        """Take one more step; False when the path has ended."""
        if self.done:
            return False
        candidates = self._candidates()
        first, stop, saved, _, _, free = candidates
        freed, seconds = self._scores(candidates)
        runs_count = len(first)
        kinds = len(freed) // runs_count
        # The open candidates' indices (kind-major: a recomputation comes before the offload of the same run),
        # narrowed below by each criterion in turn.
        index = np.flatnonzero((np.tile(free, kinds) if kinds > 1 else free) & (freed > 0))
        if not len(index):
            self.done = True
            return False
        freed, seconds = freed[index], seconds[index]
        with np.errstate(divide="ignore"):
            rate = np.where(seconds > 0, freed / np.where(seconds > 0, seconds, 1.0), np.inf)
        # Most bytes per second; then more bytes; then the shorter run; then the earlier one; then fewer
        # seconds; then the recomputation (the first of the two kinds).
        keep = rate == rate.max()
        index, freed, seconds = index[keep], freed[keep], seconds[keep]
        keep = freed == freed.max()
        index, seconds = index[keep], seconds[keep]
        runs = index % runs_count
        length = stop[runs] - first[runs]
        keep = length == length.min()
        index, seconds, runs = index[keep], seconds[keep], runs[keep]
        firsts = first[runs]
        keep = firsts == firsts.min()
        index, seconds = index[keep], seconds[keep]
        kind, run = divmod(int(index[seconds == seconds.min()][0]), runs_count)
        i, j = int(first[run]), int(stop[run])
        self._transient = max(self._transient, int(saved[run]))
        (self._offloaded if kind else self._recomputed).append((i, j))
        free &= (stop <= i) | (first >= j)  # in place: the held arrays stay up to date
        m = self.model
        recomputed, offloaded = tuple(sorted(self._recomputed)), tuple(sorted(self._offloaded))
        self._offload_bytes = m._segment_bytes(self.start, self.end, (), offloaded)[2]
        memory = m.memory(self.start, self.end, self.stage, recomputed, offloaded)
        self.steps.append(Choice(recomputed, offloaded, memory, m.time(self.start, self.end, recomputed, offloaded)))
        return True


def stage_memory(costs: GraphCosts, start: int, end: int, stage: int, sizing: Sizing,
                 recomputed: Sequence[Segment] = (), offloaded: Sequence[Segment] = ()) -> StageMemory:
    """Predicted peak bytes of stage ``stage`` covering nodes ``[start, end)`` with the node ranges in
    ``recomputed`` recomputed in the backward and those in ``offloaded`` offloaded to host memory (see
    :meth:`StageModel.memory` for the terms)."""
    return StageModel(costs, sizing).memory(start, end, stage, recomputed, offloaded)


def stage_time(costs: GraphCosts, start: int, end: int, sizing: Sizing, recomputed: Sequence[Segment] = (),
               offloaded: Sequence[Segment] = ()) -> float:
    """Predicted forward + backward seconds of a stage covering ``[start, end)`` (see :meth:`StageModel.time`)."""
    model = StageModel(costs, sizing)
    model.check_range(start, end, 0)
    return model.time(start, end, *model.check_segments(start, end, recomputed, offloaded))


def fit_stage(costs: GraphCosts, start: int, end: int, stage: int, sizing: Sizing,
              memory_limit: float | None = None) -> StageFit:
    """The recomputation and offload the cost model chooses to bring a stage under ``memory_limit`` (see
    :meth:`StageModel.memory_path`)."""
    return StageModel(costs, sizing).fit(start, end, stage, memory_limit)
