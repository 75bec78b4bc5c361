"""Data x pipeline planning: ``plan(..., world_size=N)`` / ``pipecore plan --world-size N`` choose ``(W, P)`` with
``W x P = N`` (PipeDream-2BW's planner): the factorisations, memory, bandwidth, the rejected alternatives and their
reasons, the measured bandwidth, the CLI and bad values. Synthetic costs keep it fast."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

import pipecore
from pipecore.algorithms import get_algorithm
from pipecore.cli import main
from pipecore.planning import GraphCosts, InfeasibleMemoryLimit, plan_costs, plan_world
from pipecore.planning import bandwidth as bw
from pipecore.planning.world import factorisations, step_times
from pipecore.simulate import simulate


def graph(n: int = 12, param: int = 3000, saved: int = 4000, seconds: float = 1e-3) -> GraphCosts:
    """A uniform synthetic graph: every node ``seconds`` forward, twice that backward, ``param`` parameter bytes."""
    return GraphCosts(tuple(f"n{i}" for i in range(n)), (seconds,) * n, (2 * seconds,) * n, (100,) * n,
                      (saved,) * n, (param,) * n, (2 * param,) * n, (100,) * (n - 1), input_bytes=100)


def shape(result) -> list[tuple[int, int, int]]:
    return [(c.data_parallel, c.pipeline_ranks, c.num_stages) for c in result.world.configurations]


# -- the factorisations ---------------------------------------------------------------------------------------


def test_factorisations():
    assert factorisations(1) == [(1, 1)]
    assert factorisations(7) == [(1, 7), (7, 1)]
    assert factorisations(12) == [(1, 12), (2, 6), (3, 4), (4, 3), (6, 2), (12, 1)]


def test_every_factorisation_is_considered_with_its_replica_batch():
    result = plan_world(graph(), 6, "1f1b", 48, 4, objective="time", allreduce_gbps=10)
    assert shape(result) == [(1, 6, 6), (2, 3, 3), (3, 2, 2), (6, 1, 1)]
    assert [c.replica_batch for c in result.world.configurations] == [48, 24, 16, 8]
    for c in result.world.configurations:
        assert c.plan.num_stages == c.num_stages and c.plan.num_ranks == c.pipeline_ranks
        assert c.plan.batch_size == c.replica_batch and c.plan.n_microbatches == 4
        assert c.samples_per_s == pytest.approx(48 / c.step_time)
    assert result.data_parallel == result.world.chosen.data_parallel
    assert result.step_time == result.world.chosen.step_time
    assert len(result.alternatives) == 3 and all(c.status == "slower" for c in result.alternatives)


def test_several_stages_per_rank_plan_p_times_v_stages():
    result = plan_world(graph(16), 4, "interleaved-1f1b", 32, 4, objective="time", allreduce_gbps=10,
                        stages_per_rank=2)
    assert shape(result) == [(1, 4, 8), (2, 2, 4), (4, 1, 2)]
    assert result.num_stages == 2 * result.num_ranks
    zbv = plan_world(graph(16), 2, "zb-v", 16, 4, objective="time", allreduce_gbps=10)  # always 2 per rank
    assert shape(zbv) == [(1, 2, 4), (2, 1, 2)]


# -- the time model ---------------------------------------------------------------------------------------------


def test_step_time_is_the_simulated_schedule_plus_the_exposed_ring_all_reduce():
    costs = graph(8)
    for w in (1, 2, 4):
        plan = plan_costs(costs, 2, "gpipe", 8 * 4 // w, 4, objective="time")
        algorithm = get_algorithm("gpipe", 2, 4)
        times = step_times(plan, algorithm, w, 1e6)
        # Without the all-reduce: the steady state of the schedule with the stages' predicted times.
        f = [sum(costs.at_microbatch_size(plan.microbatch_size).forward_s[a:b]) for a, b in plan.bounds()]
        c = {"forward": f, "backward": [t - x for t, x in zip(plan.stage_time, f)]}
        pipeline = simulate("gpipe", 2, 4, n_minibatches=3, costs=c).makespan / 3
        assert times["pipeline_time"] == pytest.approx(pipeline)
        # gpipe: every update at the end of the step; stage 0 finishes its backward last, so its sum is exposed.
        grad = plan.memory_breakdown()[0].gradients
        ring = 2 * (w - 1) / w * grad / 1e6
        assert times["step_time"] == pytest.approx(pipeline + ring)
        assert times["allreduce_time"] == pytest.approx(max(2 * (w - 1) / w * m.gradients / 1e6
                                                            for m in plan.memory_breakdown()))


def test_small_model_fast_link_prefers_replicas_slow_link_prefers_the_pipeline():
    small = graph(param=1000)
    fast = plan_world(small, 8, "1f1b", 64, 4, memory_limit=1e9, allreduce_gbps=1e6)
    assert (fast.data_parallel, fast.num_ranks) == (8, 1)  # no bubble, the sum is free
    slow = plan_world(small, 8, "1f1b", 64, 4, memory_limit=1e9, allreduce_gbps=1e-6)
    assert (slow.data_parallel, slow.num_ranks) == (1, 8)  # the sum costs more than any bubble
    times = {c.data_parallel: c.step_time for c in fast.world.configurations}
    assert times[8] < times[4] < times[2] < times[1]  # the bubble shrinks with P
    assert fast.world.bandwidth.source == "given" and fast.world.bandwidth.bytes_per_s == 1e15


def test_a_limit_the_whole_model_exceeds_on_one_device_leads_to_a_larger_pipeline():
    heavy = graph(param=100_000)  # 1.2 MB of weights (x4 with gradients and momentum-like state)
    result = plan_world(heavy, 8, "1f1b", 64, 4, memory_limit=2e6, allreduce_gbps=1e6)
    assert result.num_ranks > 1 and max(result.rank_memory) <= 2e6
    by_w = {c.data_parallel: c for c in result.world.configurations}
    assert by_w[8].status == "does not fit" and by_w[8].reason.startswith("does not fit: needs at least")
    assert by_w[8].memory > 2e6 and by_w[8].step_time is None
    # Without the limit, the fast link makes W = 8 the choice.
    assert plan_world(heavy, 8, "1f1b", 64, 4, objective="time", allreduce_gbps=1e6).data_parallel == 8


# -- rejected alternatives -----------------------------------------------------------------------------------


def test_rejected_alternatives_and_their_reasons():
    # Batch 24 in 4 micro-batches: W = 4 would need 16 | 24. 3 nodes: P = 4 needs 3 cuts, the graph has 2.
    result = plan_world(graph(3), 4, "1f1b", 24, 4, objective="time", allreduce_gbps=1e6)
    by_w = {c.data_parallel: c for c in result.world.configurations}
    assert by_w[1].status == "cut points" and by_w[1].reason == "4 stages need 3 cuts; the model's cut points allow 2"
    assert by_w[4].status == "batch"
    assert by_w[4].reason == "batch 24 is not divisible into W x micro-batches = 4 x 4 = 16"
    assert by_w[2].status == "chosen" and result.data_parallel == 2
    table = result.world.table()
    assert "cut points allow 2" in table and "not divisible" in table and "chosen" in table

    # interleaved-1f1b with 2 stages per rank needs the micro-batches a multiple of the ranks: P = 3, 6 refused.
    inter = plan_world(graph(16), 6, "interleaved-1f1b", 48, 4, objective="time", allreduce_gbps=1e6,
                       stages_per_rank=2)
    by_p = {c.pipeline_ranks: c for c in inter.world.configurations}
    assert by_p[3].status == by_p[6].status == "algorithm"
    assert "multiple of the number of ranks" in by_p[3].reason
    assert by_p[1].fits and by_p[2].fits

    slower = [c for c in plan_world(graph(), 4, "gpipe", 32, 4, objective="time", allreduce_gbps=1e6).alternatives]
    assert slower and all(re.fullmatch(r"slower: [0-9.]+ ms per step, [0-9.]+x the chosen's", c.reason)
                          for c in slower)


def test_no_configuration_that_fits_names_the_smallest_limit():
    with pytest.raises(InfeasibleMemoryLimit, match="no \\(W, P\\) with W x P = 4 fits") as info:
        plan_world(graph(param=100_000), 4, "1f1b", 32, 4, memory_limit=1e5, allreduce_gbps=1)
    assert info.value.smallest_limit > 1e5
    plan_world(graph(param=100_000), 4, "1f1b", 32, 4, memory_limit=info.value.smallest_limit, allreduce_gbps=1)
    with pytest.raises(ValueError, match="can be planned.*not divisible"):
        plan_world(graph(), 2, "1f1b", 6, 4, allreduce_gbps=1)


# -- the bandwidth ---------------------------------------------------------------------------------------------


def test_the_bandwidth_is_measured_once_when_not_given(monkeypatch):
    calls = []

    def fake() -> bw.Bandwidth:
        calls.append(1)
        return bw.Bandwidth(2e9, "measured", "fake")

    monkeypatch.setattr("pipecore.planning.world.measure_allreduce", fake)
    result = plan_world(graph(), 4, "1f1b", 32, 4, objective="time")
    assert len(calls) == 1 and result.world.bandwidth.bytes_per_s == 2e9
    plan_world(graph(), 1, "1f1b", 32, 4, objective="time")  # W = 1 only: nothing to measure
    assert len(calls) == 1


def test_measure_allreduce_between_two_gloo_processes():
    result = bw.measure_allreduce(nbytes=2 ** 20, repeats=3)
    assert result.bytes_per_s > 0 and math.isfinite(result.bytes_per_s)
    if result.source == "measured":
        assert "2 local gloo processes" in result.detail
    else:  # the measurement failed here: the proxy says so
        assert result.source == "proxy" and "NOT an all-reduce" in result.detail and "failed" in result.detail


def test_a_failed_measurement_falls_back_to_a_labelled_proxy(monkeypatch):
    def broken(*args):
        raise RuntimeError("no gloo here")

    monkeypatch.setattr(bw, "_measure", broken)
    result = bw.measure_allreduce()
    assert result.source == "proxy" and result.bytes_per_s > 0
    assert "memcpy" in result.describe() and "NOT an all-reduce" in result.describe()
    assert "no gloo here" in result.detail


def test_ring_all_reduce_seconds():
    assert bw.ring_allreduce_seconds(1e9, 1, 1e9) == 0
    assert bw.ring_allreduce_seconds(1e9, 2, 1e9) == pytest.approx(1.0)
    assert bw.ring_allreduce_seconds(1e9, 4, 1e9) == pytest.approx(1.5)


# -- bad values ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size, error", [(0, "at least 1"), (-2, "at least 1"), (2.0, "positive int"),
                                               (True, "positive int"), ("4", "positive int"), (None, "positive int")])
def test_bad_world_size(world_size, error):
    with pytest.raises(ValueError, match=f"world_size must be .*{error}"):
        plan_world(graph(), world_size, "1f1b", 32, 4, allreduce_gbps=1)


@pytest.mark.parametrize("gbps", [0, -1.0, float("nan"), float("inf"), True, "10"])
def test_bad_allreduce_gbps(gbps):
    with pytest.raises(ValueError, match="allreduce_gbps must be a positive, finite number of GB/s"):
        plan_world(graph(), 2, "1f1b", 32, 4, allreduce_gbps=gbps)


def test_plan_api_refuses_bad_combinations_before_profiling(monkeypatch):
    def no_profile(*args, **kwargs):
        raise AssertionError("profiled")

    monkeypatch.setattr("pipecore.planning.api.profile", no_profile)
    model, x = nn.Linear(2, 2), torch.zeros(1, 2)
    with pytest.raises(ValueError, match="num_stages or world_size, not both"):
        pipecore.plan(model, x, 2, world_size=4)
    with pytest.raises(ValueError, match="needs num_stages"):
        pipecore.plan(model, x)
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        pipecore.plan(model, x, world_size=0)
    with pytest.raises(ValueError, match="allreduce_gbps is for world_size"):
        pipecore.plan(model, x, 2, allreduce_gbps=1)
    with pytest.raises(ValueError, match="allreduce_gbps must be"):
        pipecore.plan(model, x, world_size=2, allreduce_gbps=0)
    with pytest.raises(ValueError, match="name the algorithm"):
        pipecore.plan(model, x, world_size=2, algorithm=get_algorithm("1f1b", 2, 4))
    with pytest.raises(ValueError, match="unknown algorithm"):
        pipecore.plan(model, x, world_size=2, algorithm="nope")
    with pytest.raises(ValueError, match="runs one stage per rank"):
        pipecore.plan(model, x, world_size=2, algorithm="1f1b", stages_per_rank=2)


def test_plan_api_with_world_size_on_a_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    result = pipecore.plan(model, torch.randn(2, 8), algorithm="1f1b", n_microbatches=2, world_size=2,
                           objective="time", allreduce_gbps=100)
    assert result.world.batch_size == 2 * 2 * 2  # the example's samples x micro-batches x world size
    assert {(c.data_parallel, c.pipeline_ranks) for c in result.world.configurations} == {(1, 2), (2, 1)}
    assert result.batch_size * result.data_parallel == result.world.batch_size


# -- the CLI ---------------------------------------------------------------------------------------------------------


def test_cli_world_size(capsys):
    code = main(["plan", "--model", "mlp", "--world-size", "4", "-a", "1f1b", "--memory-limit", "1GiB",
                 "--allreduce-gbps", "1000", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "all-reduce bandwidth 1e+03 GB/s (given: allreduce_gbps=1000)" in out
    chosen = re.search(r"chosen: W=(\d+) replicas? x P=(\d+) pipeline ranks?", out)
    assert chosen and int(chosen.group(1)) * int(chosen.group(2)) == 4
    assert "configurations of 4 devices" in out
    rows = re.findall(r"^([124])\s+([124])\s+\d+\s+\d+\s+[0-9.]+\s.*(chosen|slower: .*)$", out, re.M)
    assert sorted((int(w), int(p)) for w, p, _ in rows) == [(1, 4), (2, 2), (4, 1)]
    assert sum(v == "chosen" for *_, v in rows) == 1
    assert "per replica" in out


@pytest.mark.parametrize("argv, error", [
    (["--world-size", "4", "--stages", "2"], "--stages or --world-size, not both"),
    (["--stages", "2", "--allreduce-gbps", "1"], "--allreduce-gbps is for --world-size"),
    (["--world-size", "2", "--allreduce-gbps", "0"], "allreduce_gbps must be a positive"),
    (["--world-size", "0"], "--world-size: must be an integer >= 1"),
    (["--world-size", "two"], "--world-size: must be an integer >= 1"),
])
def test_cli_errors(capsys, argv, error):
    code = main(["plan", "--model", "mlp", "--objective", "time", *argv])
    captured = capsys.readouterr()
    assert code == 2
    assert error in captured.err + captured.out
