"""Partitioners and plans against brute force over every cut, on random synthetic graphs."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import re

import pytest

from pipecore.planning.cut_search import balanced_by_parameters
from pipecore.planning import (
    GraphCosts, InfeasibleMemoryLimit, Plan, Sizing, StageModel, partition, smallest_memory_limit, stage_memory,
)
from pipecore.planning import plan_costs as _plan_costs


def plan_costs(*args, **kwargs):
    """:func:`pipecore.planning.plan_costs` for a pipeline without undo copies (``recover=False``): these tests'
    figures and limits are those of the other terms, and their pipelines train with ``recover=False``."""
    return _plan_costs(*args, recover=False, **kwargs)


_SIZINGS: dict[tuple[str, int, int], Sizing] = {}


def sizing(name: str, num_stages: int, n_microbatches: int) -> Sizing:
    key = (name, num_stages, n_microbatches)
    if key not in _SIZINGS:
        _SIZINGS[key] = Sizing.of(name, num_stages, n_microbatches, recover=False)
    return _SIZINGS[key]


def random_costs(rng: random.Random, n: int, profile: str) -> GraphCosts:
    """A synthetic graph. ``conv``: activations heavy early, parameters heavy late (memory and compute pull
    apart, more so where early stages hold more versions); ``even``: similar nodes; ``sparse``: many nodes
    without parameters or saved bytes, crossings that vary a lot."""
    forward = [rng.uniform(0.2, 2.0) for _ in range(n)]
    backward = [f * rng.uniform(1.5, 2.5) for f in forward]
    if profile == "conv":
        saved = [int(rng.uniform(0.5, 1.5) * 4000 * (n - i) / n) for i in range(n)]
        params = [int(rng.uniform(0.5, 1.5) * 3000 * (i + 1) / n) for i in range(n)]
    elif profile == "even":
        saved = [rng.randint(500, 1500) for _ in range(n)]
        params = [rng.randint(500, 1500) for _ in range(n)]
    else:
        saved = [rng.choice([0, rng.randint(1, 3000)]) for _ in range(n)]
        params = [rng.choice([0, 0, rng.randint(1, 5000)]) for _ in range(n)]
    output = [max(1, s // rng.randint(1, 4)) for s in saved]
    crossing = [output[i] + rng.randint(0, 300) for i in range(n - 1)]
    return GraphCosts(tuple(f"n{i}" for i in range(n)), tuple(forward), tuple(backward), tuple(output), tuple(saved),
                      tuple(params), tuple(2 * p for p in params), tuple(crossing), input_bytes=rng.randint(0, 500))


def all_partitions(n: int, num_stages: int, allowed_cuts=None):
    """Every list of stage bounds ``[0, c_1, ..., n]`` with cuts from ``allowed_cuts`` (default: all)."""
    candidates = range(1, n) if allowed_cuts is None else sorted(set(allowed_cuts) - {0})
    for starts in itertools.combinations(candidates, num_stages - 1):
        yield [0, *starts, n]


def brute_force(model: StageModel, num_stages: int, limit, recompute: bool, allowed_cuts=None) -> float:
    """The least slowest-stage time over every partition whose stages all fit ``limit`` (inf if none), each
    stage judged by the same per-stage cost model the planner uses."""
    best = math.inf
    for edges in all_partitions(model.num_nodes, num_stages, allowed_cuts):
        fits = [model.fit(a, b, s, limit, recompute) for s, (a, b) in enumerate(zip(edges, edges[1:]))]
        if all(f.fits for f in fits):
            best = min(best, max(f.time for f in fits))
    return best


def check_partition(result, costs: GraphCosts, z: Sizing, limit) -> None:
    """The partition's reported figures are the model's for its cuts, and within the limit."""
    for s, (a, b) in enumerate(result.bounds(len(costs))):
        m = stage_memory(costs, a, b, s, z, result.recomputed[s])
        assert result.stage_memory[s] == m.total == result.memory[s].total
        assert result.stage_time[s] == pytest.approx(StageModel(costs, z).time(a, b, result.recomputed[s]))
        if limit is not None:
            assert m.total <= limit


@pytest.mark.parametrize("seed", range(5))
def test_time_partition_equals_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(12):
        n, num_stages = rng.randint(4, 11), rng.randint(2, 4)
        costs = random_costs(rng, n, rng.choice(["conv", "even", "sparse"]))
        z = sizing(rng.choice(["pipedream", "1f1b", "gpipe", "2bw"]), num_stages, num_stages)
        allowed = None
        if rng.random() < 0.5:
            allowed = sorted(rng.sample(range(1, n), k=rng.randint(num_stages - 1, n - 1)))
        result = partition(costs, num_stages, "time", z, allowed_cuts=allowed)
        assert result.slowest == pytest.approx(brute_force(StageModel(costs, z), num_stages, None, False, allowed))
        assert all(r == () for r in result.recomputed)
        assert allowed is None or set(result.starts) <= set(allowed)
        check_partition(result, costs, z, None)
        # With a limit, PipeDream's planner rules out stages over it (it does not recompute).
        limit = smallest_memory_limit(costs, num_stages, "time", z, allowed) * rng.uniform(1.0, 1.3)
        best = brute_force(StageModel(costs, z), num_stages, limit, False, allowed)
        result = partition(costs, num_stages, "time", z, limit, allowed)
        assert result.slowest == pytest.approx(best)
        check_partition(result, costs, z, limit)


def test_memory_partition_is_feasible_and_near_best_on_random_graphs():
    rng = random.Random(1234)
    infeasible = recomputing = slower_than_unlimited = 0
    for trial in range(160):
        n, num_stages = rng.randint(5, 11), rng.randint(2, 4)
        name = rng.choice(["pipedream", "pipedream", "2bw", "1f1b", "gpipe", "pipemare"])
        z = sizing(name, num_stages, rng.choice([num_stages, 2 * num_stages]))
        costs = random_costs(rng, n, rng.choice(["conv", "conv", "even", "sparse"]))
        allowed = None if rng.random() < 0.7 else sorted(rng.sample(range(1, n), k=rng.randint(num_stages - 1, n - 1)))
        model = StageModel(costs, z)
        # Limits around the smallest feasible one, some below it.
        limit = smallest_memory_limit(costs, num_stages, "memory", z, allowed) * rng.uniform(0.9, 1.5)
        best = brute_force(model, num_stages, limit, True, allowed)
        if best == math.inf:
            infeasible += 1
            with pytest.raises(InfeasibleMemoryLimit):
                partition(costs, num_stages, "memory", z, limit, allowed)
            continue
        result = partition(costs, num_stages, "memory", z, limit, allowed)
        check_partition(result, costs, z, limit)
        assert allowed is None or set(result.starts) <= set(allowed)
        assert result.slowest <= 1.05 * best, (trial, result, best)
        recomputing += any(result.recomputed)
        slower_than_unlimited += result.slowest > brute_force(model, num_stages, None, False, allowed) * (1 + 1e-9)
    # The sample exercises every regime: infeasible limits, recomputation, limits that cost time.
    assert infeasible >= 10 and recomputing >= 20 and slower_than_unlimited >= 20, \
        (infeasible, recomputing, slower_than_unlimited)


def test_memory_objective_moves_work_off_the_stages_that_hold_more_versions():
    # Identical nodes: compute balance gives every stage 4 nodes, but under PipeDream stage 0 holds 4 weight
    # versions and 4 micro-batches in flight, stage 3 one of each.
    n, num_stages = 16, 4
    costs = GraphCosts(tuple(f"n{i}" for i in range(n)), (1.0,) * n, (2.0,) * n, (100,) * n, (400,) * n,
                       (1000,) * n, (2000,) * n, (100,) * (n - 1))
    z = sizing("pipedream", num_stages, num_stages)
    model = StageModel(costs, z)
    balanced = partition(costs, num_stages, "time", z)
    assert balanced.starts == (4, 8, 12) and balanced.slowest == 12.0
    # stage 0: 4 versions x 4000 + gradients 4000 + optimizer 8000 + 4 in flight x (1600 saved + 100 sent)
    assert balanced.stage_memory == (34800, 29400, 23600, 17700)

    # Under a limit, PipeDream's planner can only move cuts; recomputing costs less time here.
    limit = 0.8 * 34800
    by_time = partition(costs, num_stages, "time", z, limit)
    by_memory = partition(costs, num_stages, "memory", z, limit)
    assert by_time.slowest == 18.0 and all(r == () for r in by_time.recomputed)
    assert by_memory.slowest == 16.0 == brute_force(model, num_stages, limit, True)
    assert any(by_memory.recomputed) and max(by_memory.stage_memory) <= limit

    # Tighter: no cuts fit without recomputation; with it, the first stage gets fewer nodes.
    with pytest.raises(InfeasibleMemoryLimit, match="smallest per-stage limit that works is 26500 bytes"):
        partition(costs, num_stages, "time", z, 26300)
    tight = partition(costs, num_stages, "memory", z, 26300)
    assert tight.starts[0] < 4 and max(tight.stage_memory) <= 26300
    assert tight.slowest == brute_force(model, num_stages, 26300, True)


def test_memory_objective_without_limit_takes_the_smallest_limit_any_cut_meets():
    rng = random.Random(7)
    for _ in range(10):
        costs = random_costs(rng, rng.randint(5, 10), "conv")
        z = sizing("pipedream", 3, 3)
        result = partition(costs, 3, "memory", z)
        smallest = smallest_memory_limit(costs, 3, "time", z)
        assert max(result.stage_memory) <= smallest
        assert result.slowest == pytest.approx(brute_force(StageModel(costs, z), 3, smallest, True))


def test_parameters_objective_is_the_runtime_partition():
    rng = random.Random(3)
    costs = random_costs(rng, 10, "even")
    z = sizing("1f1b", 3, 3)
    assert list(partition(costs, 3, "parameters", z).starts) == balanced_by_parameters(costs.param_bytes, 3)
    allowed = [2, 4, 7, 9]
    units = [sum(costs.param_bytes[a:b]) for a, b in zip([0, *allowed], [*allowed, 10])]
    expected = [[0, *allowed][i] for i in balanced_by_parameters(units, 3)]
    assert list(partition(costs, 3, "parameters", z, allowed_cuts=allowed).starts) == expected


@pytest.mark.parametrize("seed", range(4))
def test_smallest_memory_limit_is_the_least_largest_stage_minimum_over_every_partition(seed):
    # A stage fits a limit exactly when its least memory does, so the smallest limit is a minimax over
    # partitions of StageModel.smallest_memory: computed here by brute force, with and without a host link.
    rng = random.Random(100 + seed)
    for _ in range(10):
        n, num_stages = rng.randint(4, 10), rng.randint(2, 4)
        costs = random_costs(rng, n, rng.choice(["conv", "even", "sparse"]))
        if rng.random() < 0.4:
            costs = dataclasses.replace(costs, host_bytes_per_s=rng.uniform(1e3, 1e4))
        z = sizing(rng.choice(["pipedream", "2bw", "1f1b", "gpipe"]), num_stages, rng.choice([num_stages, 2 * num_stages]))
        allowed = None if rng.random() < 0.7 else sorted(rng.sample(range(1, n), k=rng.randint(num_stages - 1, n - 1)))
        model = StageModel(costs, z)
        expected = min(max(model.smallest_memory(a, b, s) for s, (a, b) in enumerate(zip(edges, edges[1:])))
                       for edges in all_partitions(n, num_stages, allowed))
        assert smallest_memory_limit(costs, num_stages, "memory", z, allowed) == expected


@pytest.mark.parametrize("objective", ["time", "memory", "parameters"])
def test_infeasible_limit_names_the_smallest_that_works(objective):
    rng = random.Random(11)
    for _ in range(6):
        n = rng.randint(5, 9)
        costs = random_costs(rng, n, "conv")
        z = sizing("pipedream", 3, 3)
        smallest = smallest_memory_limit(costs, 3, objective, z)
        partition(costs, 3, objective, z, smallest)
        with pytest.raises(InfeasibleMemoryLimit, match=f"smallest per-stage limit that works is {smallest} bytes") \
                as error:
            partition(costs, 3, objective, z, smallest - 1)
        assert error.value.smallest_limit == smallest
        if objective != "parameters":  # no cuts at all fit one byte less
            model = StageModel(costs, z)
            assert brute_force(model, 3, smallest - 1, objective == "memory") == math.inf
            assert brute_force(model, 3, smallest, objective == "memory") < math.inf


def test_partition_errors():
    costs = random_costs(random.Random(0), 6, "even")
    z = sizing("gpipe", 2, 2)
    with pytest.raises(ValueError, match="unknown objective 'speed'; allowed: parameters, time, memory"):
        partition(costs, 2, "speed", z)
    for bad in (0, -5, math.inf, "1GB"):
        with pytest.raises(ValueError, match="memory_limit must be a positive number of bytes"):
            partition(costs, 2, "memory", z, bad)
    with pytest.raises(ValueError, match="num_stages=2 needs 1 cut positions; the graph of 6 nodes allows 0"):
        partition(costs, 2, "time", z, allowed_cuts=[0])
    with pytest.raises(ValueError, match="num_stages=7 needs 6 cut positions; the graph of 6 nodes allows 5"):
        partition(costs, 7, "time", sizing("gpipe", 7, 7))
    with pytest.raises(ValueError, match="sizing is for 2 stages"):
        partition(costs, 3, "time", z)
    with pytest.raises(ValueError, match=r"allowed_cuts must be node indices in 0..5, got \[6\]"):
        partition(costs, 2, "time", z, allowed_cuts=[2, 6])


# -- plans ----------------------------------------------------------------------------------------------


def plan_graph() -> GraphCosts:
    rng = random.Random(5)
    return random_costs(rng, 9, "conv")


def test_plan_costs_rescales_to_the_micro_batch():
    costs = plan_graph()
    plan = plan_costs(costs, 3, "pipedream", batch_size=24, n_microbatches=3, objective="time")
    assert isinstance(plan, Plan) and plan.costs is costs and plan.microbatch_size == 8
    direct = partition(costs.at_microbatch_size(8), 3, "time", sizing("pipedream", 3, 3))
    assert (plan.starts, plan.stage_time, plan.stage_memory) == (direct.starts, direct.stage_time, direct.stage_memory)
    assert (plan.algorithm, plan.num_stages, plan.n_microbatches, plan.batch_size) == ("pipedream", 3, 3, 24)


def test_max_batch_size_against_a_direct_scan():
    costs = plan_graph()
    for name, limit_scale in (("pipedream", 1.0), ("gpipe", 1.3), ("2bw", 2.0)):
        z = sizing(name, 3, 4)
        small = smallest_memory_limit(costs.at_microbatch_size(2), 3, "memory", z)
        plan = plan_costs(costs, 3, name, batch_size=8, n_microbatches=4, memory_limit=small * limit_scale)

        def fits(batch: int) -> bool:
            scaled = costs.at_microbatch_size(batch // 4)
            return all(stage_memory(scaled, a, b, s, z, plan.recomputed[s]).total <= plan.memory_limit
                       for s, (a, b) in enumerate(plan.bounds()))

        batch = 4
        while fits(batch + 4):
            batch += 4
        assert plan.max_batch_size() == batch >= 8
        assert not fits(batch + 4)


def test_plan_table_lists_every_stage():
    costs = plan_graph()
    limit = smallest_memory_limit(costs, 3, "memory", sizing("pipedream", 3, 3)) * 1.05
    plan = plan_costs(costs, 3, "pipedream", batch_size=3, n_microbatches=3, memory_limit=limit)
    text = plan.table()
    lines = text.splitlines()
    assert lines[0].startswith("pipedream, 3 stages, batch 3 = 3 x 1 samples, objective memory, limit")
    assert lines[1].split() == ["stage", "nodes", "time", "(ms)", "memory", "/", "limit", "recomputed", "offloaded"]
    for s, (a, b) in enumerate(plan.bounds()):
        row = lines[2 + s]
        assert row.startswith(f"{s}  ") and f"{a}-{b - 1} (n{a}" in row
        assert f"{plan.stage_time[s] * 1e3:.3f}" in row
        segments = " ".join(f"[{i}, {j})" for i, j in plan.recomputed[s]) or "-"
        assert re.split(r"\s{2,}", row)[-2:] == [segments, "-"]  # nothing offloaded without a host bandwidth


def test_plan_errors():
    costs = plan_graph()
    with pytest.raises(ValueError, match=r"batch_size=10 is not divisible by n_microbatches=4; use a multiple of 4 "
                                         r"\(e.g. 8 or 12\)"):
        plan_costs(costs, 3, "pipedream", batch_size=10, n_microbatches=4)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        plan_costs(costs, 3, "pipedream", batch_size=0, n_microbatches=4)
    with pytest.raises(ValueError, match="unknown objective 'fast'; allowed: parameters, time, memory"):
        plan_costs(costs, 3, "pipedream", batch_size=4, n_microbatches=4, objective="fast")
    with pytest.raises(ValueError, match="memory_limit must be a positive number"):
        plan_costs(costs, 3, "pipedream", batch_size=4, n_microbatches=4, memory_limit=-1)
    plan = plan_costs(costs, 3, "pipedream", batch_size=4, n_microbatches=4)
    with pytest.raises(ValueError, match="max_batch_size needs a plan made with a memory_limit"):
        plan.max_batch_size()
    with pytest.raises(ValueError, match="unknown option"):
        plan_costs(costs, 3, "pipedream", batch_size=4, n_microbatches=4, lam=0.5)
    smallest = smallest_memory_limit(costs.at_microbatch_size(2), 3, "memory", sizing("pipedream", 3, 2))
    with pytest.raises(InfeasibleMemoryLimit, match=f"smallest per-stage limit that works is {smallest} bytes"):
        plan_costs(costs, 3, "pipedream", batch_size=4, n_microbatches=2, memory_limit=smallest - 1)
