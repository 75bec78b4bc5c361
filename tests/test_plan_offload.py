"""Activation offload in the stage cost model and the planners, against hand-computed numbers."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import re

import pytest

from pipecore.planning import (GraphCosts, InfeasibleMemoryLimit, Sizing, StageModel, ValueCost, partition, plan_costs,
                               smallest_memory_limit, stage_memory, stage_time)

# Five nodes a..e, no parameters; stage 0 = nodes [0, 4), stage 1 = node [4, 5). Each node runs 1 s forward and
# 2 s backward, so stage 0 computes 12 s per micro-batch; the host link moves 20 bytes per second.
#   x (10 bytes): the graph's input, saved by a: stage 0 received it.
#   a's output (20): saved by b, read by b and c.
#   b's output (30): saved by b and by c.
#   c's output (40): saved by c and by d.
#   d's output (50): saved by d, read by e: stage 0 sends it.
#   e's output (60): saved by e, the graph's output.
# Saved bytes per node: each value charged to its first saver, the rest no value (BatchNorm's statistics, say):
#   a: x 10 + 90, b: 20 + 30 + 50, c: 40 + 60, d: 50 + 150, e: 60 + 40. Stage 0 saves 500 in all.
GRAPH = GraphCosts(
    names=("a", "b", "c", "d", "e"),
    forward_s=(1.0,) * 5,
    backward_s=(2.0,) * 5,
    output_bytes=(20, 30, 40, 50, 60),
    saved_bytes=(100, 100, 100, 200, 100),
    param_bytes=(0,) * 5,
    optimizer_bytes=(0,) * 5,
    crossing_bytes=(20, 50, 40, 50),
    input_bytes=10,
    values=(
        ValueCost(-1, 10, savers=(0,), users=(0,)),
        ValueCost(0, 20, savers=(1,), users=(1, 2)),
        ValueCost(1, 30, savers=(1, 2), users=(2,)),
        ValueCost(2, 40, savers=(2, 3), users=(3,)),
        ValueCost(3, 50, savers=(3,), users=(4,)),
        ValueCost(4, 60, savers=(4,), users=(5,)),
    ),
    host_bytes_per_s=20.0,
)
GPIPE = Sizing.of("gpipe", 2, 2, recover=False)  # two micro-batches in flight at each stage


@pytest.mark.parametrize("recomputed, offloaded, freed, transient, moved", [
    # b and c: a's, b's outputs and 110 other bytes go; c's output is moved but d keeps it. Nothing is kept as
    # the segment's input. Moved and prefetched: 20 + 30 + 40 + 110.
    ((), ((1, 3),), 20 + 30 + 110, 200, 200),
    # a: it saves the received x (moved, not freed: the stage keeps its input) and 90 other bytes.
    ((), ((0, 1),), 90, 100, 100),
    # d: c's output is moved (c keeps it), so is the sent d's output (the stage keeps it); 150 other bytes.
    ((), ((3, 4),), 150, 40 + 50 + 150, 40 + 50 + 150),
    # both: the larger prefetch is the transient; the link moves both.
    ((), ((0, 1), (3, 4)), 90 + 150, 240, 100 + 240),
    # a recomputed, b and c offloaded: a's output is freed (no checkpoint reads it); the recomputation of a
    # makes nothing it saves (90), the prefetch of b and c is larger.
    (((0, 1),), ((1, 3),), 90 + 160, 200, 200),
    # b offloaded, c and d recomputed: the checkpoint keeps a's and b's outputs (its inputs), so offloading b
    # frees only its 50 other bytes though it moves 100; c and d free c's output and 60 + 150 other bytes and
    # make 40 + 50 again in their backward.
    (((2, 4),), ((1, 2),), 50 + 40 + 210, 300, 100),
])
def test_offloaded_segments_from_the_values(recomputed, offloaded, freed, transient, moved):
    base = stage_memory(GRAPH, 0, 4, 0, GPIPE)
    m = stage_memory(GRAPH, 0, 4, 0, GPIPE, recomputed, offloaded=offloaded)
    assert (m.activations, m.recomputation) == (2 * (500 - freed), transient)
    assert m.total == base.total - base.activations + m.activations + m.recomputation
    assert m.boundary == base.boundary
    assert StageModel(GRAPH, GPIPE).offload_bytes(0, 4, offloaded) == moved


def test_offload_frees_the_input_that_recomputation_keeps():
    # Recomputing b and c instead: the checkpoint keeps a's output, and the backward makes b's and c's again.
    offloaded = stage_memory(GRAPH, 0, 4, 0, GPIPE, offloaded=((1, 3),))
    recomputed = stage_memory(GRAPH, 0, 4, 0, GPIPE, ((1, 3),))
    assert (offloaded.activations, recomputed.activations) == (2 * (500 - 160), 2 * (500 - 140))
    assert (offloaded.recomputation, recomputed.recomputation) == (200, 110 + 30 + 40)


def test_offload_without_the_values_frees_the_range_sums():
    costs = dataclasses.replace(GRAPH, values=())
    m = stage_memory(costs, 0, 4, 0, GPIPE, offloaded=((1, 3),))
    assert (m.activations, m.recomputation) == (2 * (500 - 200), 200)
    assert StageModel(costs, GPIPE).offload_bytes(0, 4, ((1, 3),)) == 200
    # Recomputed, the same range keeps the 20 bytes crossing into it.
    assert stage_memory(costs, 0, 4, 0, GPIPE, ((1, 3),)).activations == 2 * (500 - 180)


def test_time_is_the_slower_of_compute_and_link():
    # 12 s of compute; the link moves 20 bytes per second each way.
    assert stage_time(GRAPH, 0, 4, GPIPE) == 12.0
    assert stage_time(GRAPH, 0, 4, GPIPE, offloaded=((1, 3),)) == 12.0                  # 200 bytes: 10 s
    assert stage_time(GRAPH, 0, 4, GPIPE, offloaded=((0, 1), (3, 4))) == 17.0            # 340 bytes: 17 s
    assert stage_time(GRAPH, 0, 4, GPIPE, ((0, 1),), offloaded=((3, 4),)) == 13.0        # compute 13, link 12
    assert stage_time(GRAPH, 0, 4, GPIPE, ((0, 1),), offloaded=((1, 3),)) == 13.0        # compute 13, link 10
    faster = dataclasses.replace(GRAPH, host_bytes_per_s=40.0)
    assert stage_time(faster, 0, 4, GPIPE, offloaded=((0, 1), (3, 4))) == 12.0
    assert StageModel(GRAPH, GPIPE).time(0, 4, (), ((0, 1), (3, 4))) == 17.0


# Three nodes of 100 saved bytes each, 10 bytes crossing each cut, one stage with two micro-batches in
# flight: 9 s of compute, and a link of 20 bytes per second (one node's saved bytes in 5 s).
LINE = GraphCosts(("a", "b", "c"), (1.0,) * 3, (2.0,) * 3, (10,) * 3, (100,) * 3, (0,) * 3, (0,) * 3, (10, 10),
                  host_bytes_per_s=20.0)
ONE_STAGE = Sizing.of("gpipe", 1, 2, recover=False)


def test_the_path_offloads_while_the_link_has_slack_then_recomputes():
    """Bytes freed per second of added time (k = 2 in flight):

    1. offloading one node frees 2 * 100 - 100 = 100 in 0 s (5 s of link within 9 s of compute): first of
       the zero-time runs, a;
    2. offloading b frees 2 * 100 = 200 (the transient is paid) in max(9, 10) - 9 = 1 s, against 180 / s
       for recomputing b (it keeps its 10-byte input); the link is now the bottleneck (10 s);
    3. recomputing c frees 2 * 90 = 180 in 0 s (its forward hides under the link: max(10, 10) - 10),
       offloading it 200 in 5 s.
    """
    path = StageModel(LINE, ONE_STAGE).memory_path(0, 3, 0)
    assert [(c.recomputed, c.offloaded) for c in path] == [
        ((), ()), ((), ((0, 1),)), ((), ((0, 1), (1, 2))), (((2, 3),), ((0, 1), (1, 2)))]
    assert [(c.memory.activations, c.memory.recomputation) for c in path] == [(600, 0), (400, 100), (200, 100),
                                                                              (20, 100)]
    assert [c.time for c in path] == [9.0, 9.0, 10.0, 10.0]
    fit = StageModel(LINE, ONE_STAGE).fit(0, 3, 0, 300)
    assert (fit.recomputed, fit.offloaded, fit.memory.total, fit.time, fit.fits) == ((), ((0, 1), (1, 2)), 300, 10.0,
                                                                                    True)


def test_at_a_full_tie_the_path_recomputes():
    # a runs in no time and keeps no input (the stage's first node): recomputing and offloading it both free
    # 100 bytes in 0 s; the recomputation leaves the link's slack to the others.
    zero = dataclasses.replace(LINE, forward_s=(0.0, 1.0, 1.0))
    first = StageModel(zero, ONE_STAGE).memory_path(0, 3, 0)[1]
    assert (first.recomputed, first.offloaded, first.time) == (((0, 1),), (), 8.0)


def test_without_a_host_bandwidth_the_path_only_recomputes():
    # [0, 3) frees 2 * 300 - 300 in 3 s, 100 / s like [0, 1) and [0, 2), but the most bytes.
    model = StageModel(dataclasses.replace(LINE, host_bytes_per_s=0.0), ONE_STAGE)
    path = model.memory_path(0, 3, 0)
    assert [(c.recomputed, c.offloaded, c.memory.total, c.time) for c in path] == [
        ((), (), 600, 9.0), (((0, 3),), (), 300, 12.0)]
    fit = model.fit(0, 3, 0, 300)
    assert (fit.recomputed, fit.offloaded, fit.time) == (((0, 3),), (), 12.0)


def test_a_single_stage_partition_offloads_for_a_limit_recomputation_cannot_meet():
    # At the limit recomputation meets (300 bytes), offload is 2 s faster; at 120 bytes only both together fit.
    offload = partition(LINE, 1, "memory", ONE_STAGE, 300)
    assert (offload.offloaded, offload.recomputed, offload.stage_time, offload.stage_memory) == (
        (((0, 1), (1, 2)),), ((),), (10.0,), (300,))
    without = dataclasses.replace(LINE, host_bytes_per_s=0.0)
    assert partition(without, 1, "memory", ONE_STAGE, 300).stage_time == (12.0,)
    tight = partition(LINE, 1, "memory", ONE_STAGE, 120)
    assert (tight.recomputed, tight.offloaded, tight.stage_memory) == ((((2, 3),),), (((0, 1), (1, 2)),), (120,))
    with pytest.raises(InfeasibleMemoryLimit, match="smallest per-stage limit that works is 300 bytes"):
        partition(without, 1, "memory", ONE_STAGE, 120)
    assert smallest_memory_limit(LINE, 1, "memory", ONE_STAGE) == 120
    # The time and parameter objectives never offload.
    for objective in ("time", "parameters"):
        assert partition(LINE, 1, objective, ONE_STAGE, 600).offloaded == ((),)


def test_memory_partition_with_offload_is_faster_at_equal_limit():
    """The 16 identical nodes of test_plan_partition under PipeDream, limit 27840 bytes: recomputation alone
    reaches 16 s. With 100 bytes per second to host memory, stage 1 = [3, 7) (3 weight versions and micro-batches
    in flight: 3 * 4000 + 4000 + 8000 + 3 * (1600 + 100 + 100) = 29400 bytes) offloads [3, 6): 1200 bytes in
    12 s, within its 12 s of compute, freeing 3 * 1200 - 1200 = 2400; stage 3 = [11, 16) sets 15 s."""
    n = 16
    costs = GraphCosts(tuple(f"n{i}" for i in range(n)), (1.0,) * n, (2.0,) * n, (100,) * n, (400,) * n,
                       (1000,) * n, (2000,) * n, (100,) * (n - 1), host_bytes_per_s=100.0)
    z = Sizing.of("pipedream", 4, 4, recover=False)
    limit = 0.8 * 34800
    result = partition(costs, 4, "memory", z, limit)
    assert result.starts == (3, 7, 11) and result.slowest == 15.0
    assert result.offloaded == ((), ((3, 6),), (), ()) and result.recomputed == ((), (), (), ())
    assert result.stage_memory == (26200, 27000, 23600, 22100) and result.stage_time == (9.0, 12.0, 12.0, 15.0)
    without = partition(dataclasses.replace(costs, host_bytes_per_s=0.0), 4, "memory", z, limit)
    assert without.slowest == 16.0 and without.offloaded == ((),) * 4
    # The best the cost model allows over every cut.
    model = StageModel(costs, z)
    best = math.inf
    for starts in itertools.combinations(range(1, n), 3):
        edges = [0, *starts, n]
        fits = [model.fit(a, b, s, limit) for s, (a, b) in enumerate(zip(edges, edges[1:]))]
        if all(f.fits for f in fits):
            best = min(best, max(f.time for f in fits))
    assert best == 15.0


def previous_recomputation_path(model: StageModel, start: int, end: int, stage: int) -> list[tuple]:
    """The recomputed segments of each step as the cost model chose them before offload: the run freeing the
    most bytes per second of its forward, then more bytes, the shorter, the earlier."""
    k = model.sizing.in_flight[stage]
    steps: list[tuple] = [()]
    if model.sizing.recompute_all or k == 0 or model.saved(start, end) == 0:
        return steps
    chosen: list[tuple[int, int]] = []
    transient = 0
    while True:
        best = None
        for i, j in itertools.combinations(range(start, end + 1), 2):
            if any(i < y and x < j for x, y in chosen):
                continue
            saved = model.saved(i, j)
            freed = k * (saved - (model.crossing(i) if i > start else 0)) - max(0, saved - transient)
            seconds = model.forward(i, j)
            if freed > 0:
                key = (freed / seconds if seconds > 0 else math.inf, freed, i - j, -i)
                if best is None or key > best[0]:
                    best = (key, (i, j), saved)
        if best is None:
            return steps
        chosen.append(best[1])
        transient = max(transient, best[2])
        steps.append(tuple(sorted(chosen)))


@pytest.mark.parametrize("seed", range(3))
def test_without_a_host_bandwidth_plans_are_as_before(seed):
    rng = random.Random(seed)
    for _ in range(8):
        n, num_stages = rng.randint(4, 9), rng.randint(2, 3)
        forward = [rng.choice([0.0, rng.uniform(0.2, 2.0)]) for _ in range(n)]
        saved = [rng.choice([0, rng.randint(1, 3000)]) for _ in range(n)]
        params = [rng.randint(0, 3000) for _ in range(n)]
        costs = GraphCosts(tuple(f"n{i}" for i in range(n)), tuple(forward), tuple(2 * f for f in forward),
                           tuple(max(1, s // 2) for s in saved), tuple(saved), tuple(params),
                           tuple(2 * p for p in params), tuple(rng.randint(0, 500) for _ in range(n - 1)),
                           input_bytes=rng.randint(0, 500))
        assert costs.host_bytes_per_s == 0.0
        z = Sizing.of(rng.choice(["pipedream", "gpipe", "2bw"]), num_stages, 2 * num_stages, recover=False)
        model = StageModel(costs, z)
        for (a, b), s in itertools.product(itertools.combinations(range(n + 1), 2), (0, num_stages - 1)):
            path = model.memory_path(a, b, s)
            assert [c.recomputed for c in path] == previous_recomputation_path(model, a, b, s)
            assert all(c.offloaded == () for c in path)
        limit = smallest_memory_limit(costs, num_stages, "memory", z) * rng.uniform(1.0, 1.2)
        result = partition(costs, num_stages, "memory", z, limit)
        assert result.offloaded == ((),) * num_stages


def test_plan_carries_the_offloaded_segments():
    plan = plan_costs(LINE, 1, "gpipe", batch_size=2, n_microbatches=2, memory_limit=300)
    assert (plan.recomputed, plan.offloaded, plan.stage_time, plan.stage_memory) == (
        ((),), (((0, 1), (1, 2)),), (10.0,), (300,))
    assert plan.memory_breakdown() == [stage_memory(LINE, 0, 3, 0, ONE_STAGE, offloaded=((0, 1), (1, 2)))]
    # Two samples per micro-batch double every activation term: the same offload no longer fits.
    assert plan.memory_breakdown(4)[0].total == 600 and plan.max_batch_size() == 2
    header, row = plan.table().splitlines()[1:]
    assert header.split()[-2:] == ["recomputed", "offloaded"]
    assert re.split(r"\s{2,}", row)[-2:] == ["-", "[0, 1) [1, 2)"]
    assert LINE.at_microbatch_size(4).host_bytes_per_s == 20.0
    for objective in ("time", "parameters"):
        other = plan_costs(LINE, 1, "gpipe", batch_size=2, n_microbatches=2, memory_limit=600, objective=objective)
        assert other.offloaded == ((),)


@pytest.mark.parametrize("recomputed, offloaded, match", [
    (((1, 3),), ((2, 4),), r"together, must be non-empty, non-overlapping ranges \[i, j\) inside the stage's nodes "
                           r"\[0, 4\), got recomputed \[\(1, 3\)\] and offloaded \[\(2, 4\)\]"),
    (((0, 2),), ((0, 2),), "non-overlapping"),
    ((), ((1, 1),), "non-empty"),
    ((), ((3, 5),), r"inside the stage's nodes \[0, 4\)"),
])
def test_bad_segments(recomputed, offloaded, match):
    with pytest.raises(ValueError, match=match):
        stage_memory(GRAPH, 0, 4, 0, GPIPE, recomputed, offloaded=offloaded)
    with pytest.raises(ValueError, match=match):
        stage_time(GRAPH, 0, 4, GPIPE, recomputed, offloaded=offloaded)


def test_offload_needs_a_bandwidth_and_a_stash_rule():
    none = dataclasses.replace(GRAPH, host_bytes_per_s=0.0)
    for call in (lambda: stage_memory(none, 0, 4, 0, GPIPE, offloaded=((1, 3),)),
                 lambda: stage_time(none, 0, 4, GPIPE, offloaded=((1, 3),)),
                 lambda: StageModel(none, GPIPE).time(0, 4, (), ((1, 3),))):
        with pytest.raises(ValueError, match=r"offload needs GraphCosts.host_bytes_per_s > 0, measured on a CUDA "
                                             r"device; these costs \(device 'synthetic'\) have 0.0"):
            call()
    recompute = Sizing.of("pipemare", 2, 2, backward_rule="recompute", recover=False)
    with pytest.raises(ValueError, match="recomputes every forward in its backward.*recomputed and offloaded "
                                         "segments do not apply"):
        stage_memory(GRAPH, 0, 4, 0, recompute, offloaded=((1, 3),))
    assert StageModel(GRAPH, recompute).memory_path(0, 4, 0)[1:] == []


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan, True, "1e9"])
def test_bad_host_bandwidth(bad):
    with pytest.raises(ValueError, match="GraphCosts.host_bytes_per_s must be a finite number of bytes per second "
                                         ">= 0"):
        dataclasses.replace(GRAPH, host_bytes_per_s=bad)


@pytest.mark.parametrize("seed", range(3))
def test_a_host_link_never_makes_a_stage_slower_or_a_limit_unreachable(seed):
    """The greedy mixed path can end above what recomputation alone reaches (an offloaded segment brings its
    whole prefetch back at once); fit and smallest_memory also try the recompute-only path, so that with a link
    every limit recomputation meets is met, at most as slowly."""
    rng = random.Random(100 + seed)
    for _ in range(6):
        n = rng.randint(3, 8)
        forward = [rng.uniform(0.1, 2.0) for _ in range(n)]
        saved = [rng.randint(0, 3000) for _ in range(n)]
        without = GraphCosts(tuple(f"n{i}" for i in range(n)), tuple(forward), tuple(2 * f for f in forward),
                             tuple(max(1, s // 2) for s in saved), tuple(saved), (100,) * n, (200,) * n,
                             tuple(rng.randint(0, 500) for _ in range(n - 1)), input_bytes=rng.randint(0, 500))
        with_link = dataclasses.replace(without, host_bytes_per_s=rng.uniform(100.0, 5000.0))
        z = Sizing.of(rng.choice(["pipedream", "gpipe", "2bw"]), 2, 4, recover=False)
        plain, linked = StageModel(without, z), StageModel(with_link, z)
        for (a, b), s in itertools.product(itertools.combinations(range(n + 1), 2), (0, 1)):
            assert linked.smallest_memory(a, b, s) <= plain.smallest_memory(a, b, s)
            for limit in {c.memory.total for c in plain.memory_path(a, b, s)}:
                recomputing, mixed = plain.fit(a, b, s, limit), linked.fit(a, b, s, limit)
                assert recomputing.fits and mixed.fits and mixed.time <= recomputing.time
                assert mixed.memory.total <= limit
