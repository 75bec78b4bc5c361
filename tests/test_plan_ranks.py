"""Plans for schedules with several stages per rank: the placement in Sizing, memory per rank (the sum of its
stages' peaks) held to the per-device limit, the table, the PNG, and ``pipecore plan --stages-per-rank``."""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import pytest
import torch

import pipecore
from pipecore.algorithms import get_algorithm
from pipecore.cli import main
from pipecore.engine.graph import CapturedModel
from pipecore.planning.cuts import module_units
from pipecore.planning import (
    GraphCosts, InfeasibleMemoryLimit, Sizing, partition, smallest_memory_limit, stage_memory,
)
from pipecore.planning import plan_costs as _plan_costs
from pipecore.simulate import simulate
from test_plan_api import gpt, lm_loss, tokens  # the same small GPT as the planner's API tests

def plan_costs(*args, **kwargs):
    """:func:`pipecore.planning.plan_costs` for a pipeline without undo copies (``recover=False``): these tests'
    figures and limits are those of the other terms, and their pipelines train with ``recover=False``."""
    return _plan_costs(*args, recover=False, **kwargs)


# (algorithm, options): every schedule with several stages per rank, as 4 stages on 2 ranks.
SEVERAL = [("zb-v", {}), ("dualpipe-v", {}), ("interleaved-1f1b", {"stages_per_rank": 2}),
           ("looped-bfs", {"stages_per_rank": 2}), ("zb-h1", {"stages_per_rank": 2})]

_SIZINGS: dict = {}


def sizing(name: str, num_stages: int = 4, n_microbatches: int = 4, **options) -> Sizing:
    key = (name, num_stages, n_microbatches, tuple(sorted(options.items())))
    if key not in _SIZINGS:
        _SIZINGS[key] = Sizing.of(name, num_stages, n_microbatches, recover=False, **options)
    return _SIZINGS[key]


def graph(seed: int, n: int = 10) -> GraphCosts:
    """A synthetic graph: activations heavy early, parameters heavy late."""
    rng = random.Random(seed)
    forward = [rng.uniform(0.2, 2.0) for _ in range(n)]
    saved = [int(rng.uniform(0.5, 1.5) * 4000 * (n - i) / n) for i in range(n)]
    params = [int(rng.uniform(0.5, 1.5) * 3000 * (i + 1) / n) for i in range(n)]
    output = [max(1, s // 2) for s in saved]
    return GraphCosts(tuple(f"n{i}" for i in range(n)), tuple(forward), tuple(2 * f for f in forward), tuple(output),
                      tuple(saved), tuple(params), tuple(2 * p for p in params), tuple(output[:-1]), input_bytes=100)


def check(plan_or_partition, costs: GraphCosts, z: Sizing, limit) -> None:
    """Every stage's figures are the cost model's; every rank's memory is the sum of its stages', within the
    limit."""
    edges = [0, *plan_or_partition.starts, len(costs)]
    for s, (a, b) in enumerate(zip(edges, edges[1:])):
        m = stage_memory(costs, a, b, s, z, plan_or_partition.recomputed[s], plan_or_partition.offloaded[s])
        assert plan_or_partition.stage_memory[s] == m.total
    ranks = plan_or_partition.rank_memory
    assert len(ranks) == z.num_ranks
    for r in range(z.num_ranks):
        assert ranks[r] == sum(plan_or_partition.stage_memory[s] for s in z.stages_of(r))
        if limit is not None:
            assert ranks[r] <= limit


# -- the placement -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, options, placement", [
    ("zb-v", {}, (0, 1, 1, 0)),
    ("dualpipe-v", {}, (0, 1, 1, 0)),
    ("interleaved-1f1b", {"stages_per_rank": 2}, (0, 1, 0, 1)),
    ("looped-bfs", {"stages_per_rank": 2}, (0, 1, 0, 1)),
    ("zb-h1", {"stages_per_rank": 2}, (0, 1, 0, 1)),
    ("pipedream", {}, (0, 1, 2, 3)),
])
def test_sizing_records_the_schedules_placement(name, options, placement):
    z = sizing(name, **options)
    algorithm = get_algorithm(name, 4, 4, **options)
    assert z.placement == placement == algorithm.schedule(1).placement
    assert z.num_ranks == algorithm.schedule(1).num_ranks == max(placement) + 1
    assert z.stages_per_rank == 4 // z.num_ranks
    for r in range(z.num_ranks):
        assert z.stages_of(r) == algorithm.schedule(1).stages_of(r)
    # The in-flight counts per stage are the simulator's, as for every algorithm (held until W when split).
    trace = simulate(name, 4, 4, n_minibatches=algorithm.warmup_minibatches, **options)
    assert z.in_flight == tuple(trace.peak_activations(s) for s in range(4))


def test_a_hand_made_sizing_has_one_stage_per_rank():
    z = Sizing("x", 3, 2, (1, 1, 1), (False,) * 3, (0,) * 3, (2, 1, 1))
    assert z.placement == (0, 1, 2) and z.num_ranks == 3 and z.stages_of(1) == (1,)
    assert Sizing("x", 2, 2, (1, 1), (False,) * 2, (0,) * 2, (2, 1), placement=[0, 0]).num_ranks == 1
    with pytest.raises(ValueError, match="Sizing.placement has 1 entries for 2 stages"):
        Sizing("x", 2, 2, (1, 1), (False,) * 2, (0,) * 2, (2, 1), placement=(0,))
    with pytest.raises(ValueError, match="every rank 0..R-1 at least one stage"):
        Sizing("x", 2, 2, (1, 1), (False,) * 2, (0,) * 2, (2, 1), placement=(0, 2))
    with pytest.raises(ValueError, match="rank must lie in 0..2"):
        z.stages_of(3)


# -- memory per rank -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, options", SEVERAL)
@pytest.mark.parametrize("objective", ["memory", "time", "parameters"])
def test_rank_memory_is_the_sum_of_its_stages_and_within_the_limit(name, options, objective):
    costs = graph(1)
    z = sizing(name, **options)
    smallest = smallest_memory_limit(costs, 4, objective, z)
    for scale in (1.0, 1.2):
        limit = smallest * scale
        plan = plan_costs(costs, 4, name, 4, 4, memory_limit=limit, objective=objective, **options)
        assert plan.placement == z.placement and plan.num_ranks == 2
        check(plan, costs, z, limit)
        assert plan.rank_time == tuple(sum(plan.stage_time[s] for s in z.stages_of(r)) for r in range(2))
        for r in range(2):  # the breakdown sums to the same
            assert plan.rank_memory[r] == sum(plan.memory_breakdown()[s].total for s in plan.stages_of(r))
        result = partition(costs, 4, objective, z, limit)
        check(result, costs, z, limit)
        assert result.placement == z.placement and result.starts == plan.starts


def test_plans_on_random_graphs_keep_every_rank_within_the_limit():
    """Limits around the smallest the planner meets: every plan it returns fits per rank, and a refusal names a
    limit that it meets."""
    rng = random.Random(3)
    refused = recomputing = 0
    for trial in range(24):
        name, options = SEVERAL[trial % len(SEVERAL)]
        z = sizing(name, **options)
        costs = graph(100 + trial, rng.randint(6, 10))
        smallest = smallest_memory_limit(costs, 4, "memory", z)
        limit = smallest * rng.uniform(0.85, 1.3)
        try:
            result = partition(costs, 4, "memory", z, limit)
        except InfeasibleMemoryLimit as error:
            refused += 1
            assert error.smallest_limit == smallest > limit
            check(partition(costs, 4, "memory", z, error.smallest_limit), costs, z, error.smallest_limit)
            continue
        check(result, costs, z, limit)
        recomputing += any(result.recomputed)
    assert refused >= 2 and recomputing >= 8, (refused, recomputing)


def test_a_limit_every_stage_fits_but_no_rank_does_is_refused():
    """Planned as if each stage had a device of its own, every stage fits the limit; two stages on one device
    do not, so the plan is refused (nothing recomputed), or (recomputing) cut and recomputed so that each
    rank's sum fits."""
    costs = graph(7)
    z = sizing("zb-v")
    alone = dataclasses.replace(z, placement=None)  # the same stages, one per rank
    limit = smallest_memory_limit(costs, 4, "time", alone)
    per_stage = partition(costs, 4, "time", alone, limit)
    assert max(per_stage.stage_memory) <= limit
    sums = [per_stage.stage_memory[a] + per_stage.stage_memory[b] for a, b in ((0, 3), (1, 2))]
    assert max(sums) > limit  # the same cuts on 2 ranks
    with pytest.raises(InfeasibleMemoryLimit, match=r"the planner finds no partition into 4 stages on 2 ranks that "
                                                    r"meets memory_limit=.* per device \(a rank holds the sum of its "
                                                    r"stages' peaks\) under zb-v with objective 'time'") as info:
        partition(costs, 4, "time", z, limit)
    assert info.value.smallest_limit > limit
    with pytest.raises(InfeasibleMemoryLimit, match="the smallest per-device limit the planner meets is"):
        plan_costs(costs, 4, "zb-v", 4, 4, memory_limit=limit, objective="time")
    # Recomputing: at the smallest limit the planner meets on 2 ranks, the plan made as if each stage had a
    # device does not fit 2 ranks; the plan made for them cuts or recomputes otherwise.
    limit = smallest_memory_limit(costs, 4, "memory", z)
    per_stage = partition(costs, 4, "memory", alone, limit)
    assert max(per_stage.stage_memory) <= limit
    assert max(per_stage.stage_memory[a] + per_stage.stage_memory[b] for a, b in ((0, 3), (1, 2))) > limit
    result = partition(costs, 4, "memory", z, limit)
    check(result, costs, z, limit)
    assert (result.starts, result.recomputed) != (per_stage.starts, per_stage.recomputed)


def test_one_stage_per_rank_plans_as_before():
    """With one stage per rank the limit is each stage's, and nothing about ranks shows."""
    costs = graph(2)
    z = sizing("1f1b")
    limit = smallest_memory_limit(costs, 4, "memory", z) * 1.1
    plan = plan_costs(costs, 4, "1f1b", 4, 4, memory_limit=limit)
    assert plan.placement == (0, 1, 2, 3) and plan.rank_memory == plan.stage_memory
    assert "rank" not in plan.table() and "per stage" in plan.table().splitlines()[0]
    assert partition(costs, 4, "memory", z, limit).placement == ()


def test_max_batch_size_bounds_the_fullest_rank():
    costs = graph(4)
    z = sizing("zb-v")
    limit = smallest_memory_limit(costs.at_microbatch_size(2), 4, "memory", z) * 1.5
    plan = plan_costs(costs, 4, "zb-v", 8, 4, memory_limit=limit)
    best = plan.max_batch_size()

    def fullest(batch: int) -> int:
        totals = [m.total for m in plan.memory_breakdown(batch)]
        return max(sum(totals[s] for s in plan.stages_of(r)) for r in range(plan.num_ranks))

    assert best >= 8 and fullest(best) <= limit < fullest(best + 4)


def test_the_table_shows_ranks():
    costs = graph(5)
    z = sizing("interleaved-1f1b", stages_per_rank=2)
    limit = smallest_memory_limit(costs, 4, "memory", z) * 1.05
    plan = plan_costs(costs, 4, "interleaved-1f1b", 4, 4, memory_limit=limit, stages_per_rank=2)
    lines = plan.table().splitlines()
    assert lines[0].startswith("interleaved-1f1b, 4 stages on 2 ranks, batch 4 = 4 x 1 samples, objective memory, "
                               "limit ") and lines[0].endswith(" per device (rank)")
    assert lines[1].split() == ["stage", "rank", "nodes", "time", "(ms)", "memory", "recomputed", "offloaded"]
    for s in range(4):
        assert lines[2 + s].split()[:2] == [str(s), str(s % 2)]
    assert lines[6].startswith("per rank (memory: its stages' peaks summed, an upper bound")
    assert lines[7].split() == ["rank", "stages", "time", "(ms)", "memory", "/", "limit"]
    for r in range(2):
        row = re.split(r"\s{2,}", lines[8 + r])
        assert row[:2] == [str(r), f"{r}, {r + 2}"]
        assert row[2] == f"{plan.rank_time[r] * 1e3:.3f}"
        assert f"({plan.rank_memory[r] / limit:.0%})" in row[3]


# -- the model API and the CLI -------------------------------------------------------------------------------




def test_bad_combinations_fail_before_profiling(monkeypatch):
    def no_profile(*args, **kwargs):
        raise AssertionError("profiled")

    monkeypatch.setattr("pipecore.planning.api.profile", no_profile)
    with pytest.raises(ValueError, match="algorithm '1f1b' runs one stage per rank"):
        pipecore.plan(gpt(), tokens(4), 4, "1f1b", stages_per_rank=2)
    with pytest.raises(ValueError, match="stages_per_rank must be 2"):
        pipecore.plan(gpt(), tokens(4), 4, "zb-v", stages_per_rank=1)


@pytest.fixture(scope="module")
def gpt_costs():
    """The GPT's profile (SGD with momentum, with the loss) and where its modules start."""
    model = gpt()
    costs = pipecore.profile(model, tokens(8), optimizer=pipecore.SGD(lr=0.01, momentum=0.9), loss_fn=lm_loss,
                             example_target=tokens(8))
    return costs, [a for a, _ in module_units(CapturedModel(model, (), tokens(8)))][1:]


@pytest.mark.parametrize("name, options", [("zb-v", {}), ("interleaved-1f1b", {"stages_per_rank": 2})])
def test_a_recomputing_plan_trains_with_each_stage_as_predicted(gpt_costs, name, options):
    """Planned for the smallest per-device limit the planner meets (so it recomputes), the pipeline's measured
    per-stage peaks are the predicted ones (within 10%), and each rank's predicted sum is within the limit."""
    costs, cuts = gpt_costs
    model = gpt()
    optimizer = pipecore.SGD(lr=0.01, momentum=0.9)
    with pytest.raises(InfeasibleMemoryLimit) as info:
        plan_costs(costs, 4, name, 32, 4, memory_limit=1, allowed_cuts=cuts, **options)
    limit = info.value.smallest_limit
    plan = plan_costs(costs, 4, name, 32, 4, memory_limit=limit, allowed_cuts=cuts, **options)
    assert any(plan.recomputed) and max(plan.rank_memory) <= limit
    pipe = pipecore.Pipeline(model, 4, name, 4, loss_fn=lm_loss, partition=plan, optimizer=optimizer, recover=False,
                             track_memory=True, **options)
    assert pipe.placement == plan.placement
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        pipe.step(torch.randint(0, 32, (32, 16), generator=g), torch.randint(0, 32, (32, 16), generator=g))
    measured = [s["peak_bytes"] for s in pipe.stats()]
    for s, (predicted, got) in enumerate(zip(plan.stage_memory, measured)):
        assert abs(predicted - got) <= 0.1 * got, f"stage {s}: predicted {predicted} bytes, measured {got}"


def test_plot_draws_memory_per_rank(tmp_path: Path):
    costs = graph(6)
    plan = plan_costs(costs, 4, "zb-v", 4, 4, memory_limit=smallest_memory_limit(costs, 4, "memory", sizing("zb-v")))
    plan.plot(str(tmp_path / "plan.png"))
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, ranks", [
    (["-a", "interleaved-1f1b", "--stages-per-rank", "2"], ["0, 2", "1, 3"]),
    (["-a", "zb-v"], ["0, 3", "1, 2"]),
    (["-a", "zb-v", "--stages-per-rank", "2"], ["0, 3", "1, 2"]),
])
def test_cli_plans_several_stages_per_rank(capsys, tmp_path: Path, argv, ranks):
    png = tmp_path / "plan.png"
    code = main(["plan", "--model", "mlp", "--stages", "4", "--memory-limit", "1GiB", "--png", str(png), *argv])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r", 4 stages on 2 ranks, batch \d+ = 4 x \d+ samples, objective memory, limit 1.00 GiB per "
                     r"device \(rank\)", out)
    assert "per rank (memory: its stages' peaks summed" in out
    for r, stages in enumerate(ranks):
        assert re.search(rf"^{r}\s+{stages}\s+[0-9.]+\s+.* / 1.00 GiB \(\d+%\)$", out, re.MULTILINE)
    assert "largest mini-batch within the limit" in out and png.exists()


@pytest.mark.parametrize("argv, error", [
    (["-a", "1f1b", "--stages-per-rank", "2"], "algorithm '1f1b' runs one stage per rank; stages_per_rank > 1 is for"),
    (["-a", "zb-v", "--stages-per-rank", "1"], "zb-v: stages_per_rank must be 2"),
    (["-a", "interleaved-1f1b", "--stages-per-rank", "3"], "must be a multiple of stages_per_rank"),
    (["-a", "looped-bfs", "--stages-per-rank", "2", "-o", "stages_per_rank=4"],
     "--stages-per-rank 2 and --option stages_per_rank=4 disagree"),
    (["-a", "looped-bfs", "--stages-per-rank", "0"], "--stages-per-rank: must be an integer >= 1"),
    (["-a", "interleaved-1f1b", "--stages-per-rank", "2", "--memory-limit", "1KiB"],
     "the smallest per-device limit the planner meets is"),
])
def test_cli_errors(capsys, argv, error):
    code = main(["plan", "--model", "mlp", "--stages", "4", "--objective", "time", *argv])
    captured = capsys.readouterr()
    assert code == 2
    assert error in captured.err
    assert "Traceback" not in captured.err
    if "--memory-limit" not in argv:  # refused before the model is built and profiled
        assert captured.out == ""
