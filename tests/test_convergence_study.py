"""The convergence study's own logic (``bench/convergence*.py``): one run's record, divergence, the learning-rate
convention, the matched sequential baselines, targets, gaps and aggregates, and time to quality. The study
itself is a benchmark; these check, on tiny sizes, that what it reports is what it says it computes."""

from __future__ import annotations

import importlib
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import pipecore

BENCH = Path(__file__).resolve().parent.parent / "bench"
MODULES = ("convergence_tasks", "convergence_runs", "convergence_report", "convergence_ttq", "convergence")


@pytest.fixture(scope="module")
def study():
    """The study's modules, imported as the command imports them (``bench/`` on the path)."""
    path = list(sys.path)
    sys.path.insert(0, str(BENCH))
    before = set(sys.modules)
    try:
        yield {name.split("_")[-1]: importlib.import_module(name) for name in MODULES}
    finally:
        # Every module loaded from bench/ goes (the study's and the helpers they import, such as bench/_ranks.py),
        # so that a later test's ``import _ranks`` finds its own, tests/_ranks.py.
        for name in set(sys.modules) - before:
            if str(getattr(sys.modules[name], "__file__", None) or "").startswith(str(BENCH)):
                del sys.modules[name]
        sys.path[:] = path  # bench/convergence.py puts bench/ on the path too


def tiny(study, **changes):
    """mlp4 at a tenth of its width, for 2 epochs."""
    tasks = study["tasks"]
    return replace(tasks.TASKS["mlp4"], sizes={"hidden": 12, "depth": 3}, epochs=2, grid=(), **changes)


def job(study, task, method, seed=0, lr=None, options=()):
    runs = study["runs"]
    return runs.Job(task, method, seed, task.lr if lr is None else lr, task.optimizer_options, tuple(options))


def test_a_run_records_one_point_per_epoch_and_gpipe_matches_sequential(study):
    runs = study["runs"]
    task = tiny(study)
    records = {m: runs.run_job(job(study, task, m)) for m in ("sequential/4", "gpipe")}
    for record in records.values():
        assert record["error"] is None and not record["diverged"]
        assert [c["epoch"] for c in record["curve"]] == [1, 2]
        assert [c["step"] for c in record["curve"]] == [22, 44]  # 1437 training samples // 64 per epoch
        assert [c["updates"] for c in record["curve"]] == [22, 44]
        assert len(record["stage_costs"]) == (1 if record is records["sequential/4"] else 4)
    # The same computation (gpipe accumulates the same micro-batches before one step), up to float32 rounding.
    for a, b in zip(records["sequential/4"]["curve"], records["gpipe"]["curve"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert records["gpipe"]["weight_version_bytes"] == records["sequential/4"]["weight_version_bytes"]


@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
@pytest.mark.parametrize("every", [1, 2, 4])
def test_sequential_is_plain_training_with_the_update_frequency(study, optimizer, every):
    """``sequential/k``: k micro-batches' mean loss per update at lr * k / m, m / k updates per mini-batch, as
    plain torch does it with the same optimizer."""
    runs, tasks = study["runs"], study["tasks"]
    options = (("momentum", 0.9),) if optimizer == "SGD" else (("weight_decay", 0.01),)
    task = replace(tiny(study), optimizer=optimizer, lr=0.05 if optimizer == "SGD" else 0.01,
                   optimizer_options=options)
    torch.manual_seed(0)
    model = tasks.build_model(task)
    reference = tasks.build_model(task)
    reference.load_state_dict(model.state_dict())
    trainer = runs.Trainer(job(study, task, f"sequential/{every}"), model)
    lr = task.lr * every / task.microbatches
    torch_optimizer = (torch.optim.SGD(reference.parameters(), lr=lr, momentum=0.9) if optimizer == "SGD"
                       else torch.optim.AdamW(reference.parameters(), lr=lr, weight_decay=0.01))
    loss_fn = nn.CrossEntropyLoss()
    batches = tasks.train_batches(task, 0, 0)
    for _ in range(3):
        x, y = next(batches)
        loss = trainer.step(x, y)
        expected = []
        for xs, ys in zip(x.chunk(task.microbatches // every), y.chunk(task.microbatches // every)):
            for xm, ym in zip(xs.chunk(every), ys.chunk(every)):
                micro = loss_fn(reference(xm), ym)
                (micro / every).backward()
                expected.append(float(micro.detach()))
            torch_optimizer.step()
            torch_optimizer.zero_grad()
        assert loss == pytest.approx(sum(expected) / len(expected), rel=1e-5)
    trainer.flush()
    assert trainer.updates == 3 * task.microbatches // every
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)


def test_the_matched_baseline_has_the_algorithms_update_frequency(study):
    runs = study["runs"]
    task = tiny(study)
    for algorithm in pipecore.algorithm_names():
        every = pipecore.get_algorithm(algorithm, task.stages, task.microbatches).update_every
        assert runs.matched_sequential(task, algorithm) == f"sequential/{every}"
        assert runs.update_every(task, f"sequential/{every}") == every
    # Read off the configured algorithm, options included, not from its name.
    assert runs.matched_sequential(task, "pipedream", {"update_every": 2}) == "sequential/2"
    assert runs.matched_sequential(task, "pipedream") == "sequential/1"
    assert runs.matched_sequential(task, "gpipe") == "sequential/4"
    # The plan runs every baseline an algorithm group needs, with the same seeds and hyper-parameters.
    plan = runs.Plan()
    runs.plan_first_phase(plan, [task], [0, 1])
    for group in plan.groups.values():
        if not runs.is_sequential(group.method):
            baseline = plan.group(task, runs.matched_sequential(task, group.method, group.options))
            assert baseline is not None and len(baseline.keys) == 2
            assert (baseline.lr, baseline.optimizer_options) == (task.lr, task.optimizer_options)


def test_learning_rate_is_per_minibatch(study):
    runs, tasks = study["runs"], study["tasks"]
    task = tiny(study)
    per_microbatch = runs.Trainer(job(study, task, "pipedream", lr=0.05), tasks.build_model(task))
    assert [st.optimizer.lr for st in per_microbatch.pipe.stages.values()] == [0.05 / 4] * 4
    per_minibatch = runs.Trainer(job(study, task, "2bw", lr=0.05), tasks.build_model(task))
    assert [st.optimizer.lr for st in per_minibatch.pipe.stages.values()] == [0.05] * 4
    sequential = runs.Trainer(job(study, task, "sequential/1", lr=0.05), tasks.build_model(task))
    assert [st.optimizer.lr for st in sequential.pipe.stages.values()] == [0.05 / 4]


def test_a_diverging_run_is_recorded_as_diverged_not_as_a_failure(study):
    runs = study["runs"]
    task = tiny(study)
    record = runs.run_job(job(study, task, "pipedream", lr=1e30))
    assert record["diverged"] and record["error"] is None
    assert len(record["curve"]) < task.epochs


def test_an_optimizer_is_looked_up_on_pipecore_by_name(study):
    tasks = study["tasks"]
    task = tiny(study)
    assert type(tasks.make_optimizer(task, 0.1, task.optimizer_options)) is pipecore.SGD
    adamw = tasks.with_optimizer(task, "AdamW")
    assert adamw.optimizer_options == () and adamw.grid == ()  # SGD's momentum is not AdamW's
    with pytest.raises(ValueError, match=r"this pipecore has no optimizer 'NoSuchAdam' \(pipecore.NoSuchAdam\); "
                                         r"it has .*AdamW"):
        tasks.with_optimizer(task, "NoSuchAdam")
    with pytest.raises(ValueError, match="takes no option"):
        tasks.check_optimizer(replace(task, optimizer="AdamW"))


def test_exact_algorithms_run_fewer_seeds_and_sequential_runs_are_shared_across_depths(study):
    runs, tasks = study["runs"], study["tasks"]
    large = tasks.quick_tasks()
    p4, p8 = large["gpt-large-p4"], large["gpt-large-p8"]
    assert runs.is_exact(p4, "gpipe") and runs.is_exact(p4, "1f1b") and not runs.is_exact(p4, "pipedream")
    assert runs.seeds_for(p4, "gpipe", [0, 1, 2]) == [0]
    assert runs.seeds_for(p4, "pipedream", [0, 1, 2]) == [0, 1, 2]
    assert runs.seeds_for(p4, "sequential/8", [0, 1, 2]) == [0, 1, 2]
    plan = runs.Plan()
    jobs = runs.plan_first_phase(plan, [p4, p8], [0, 1, 2])
    sequential = [j for j in jobs if runs.is_sequential(j.method)]
    assert len(sequential) == 2 * 3  # per update frequency and seed, once for both depths
    assert plan.group(p4, "sequential/8").keys == plan.group(p8, "sequential/8").keys


def test_an_algorithm_that_refuses_the_tasks_optimizer_is_skipped_and_listed(study):
    """nesterov-async takes its look-ahead from the optimizer's momentum: AdamW has none, SGD's momentum and NAdam
    do. A refused method runs nothing and is listed with the pipeline's reason."""
    runs, tasks = study["runs"], study["tasks"]
    adamw = tasks.with_optimizer(tiny(study), "AdamW")
    assert "AdamW" in runs.refuses_optimizer(adamw, "nesterov-async", {})
    assert runs.refuses_optimizer(adamw, "pipedream", {}) is None
    assert runs.refuses_optimizer(tiny(study), "nesterov-async", {}) is None  # SGD with momentum 0.9
    plan = runs.Plan()
    jobs = runs.plan_first_phase(plan, [adamw], [0])
    assert not any(j.method == "nesterov-async" for j in jobs) and plan.group(adamw, "nesterov-async") is None
    assert [(s["algorithm"], s["setting"]) for s in plan.skipped] == [("nesterov-async", runs.AT_SEQUENTIAL)]
    assert any(j.method == "pipedream" for j in jobs)


def test_the_small_gpt_variants_differ_only_in_depth_and_optimizer(study):
    tasks = study["tasks"].TASKS
    gpt = tasks["gpt"]
    for name, stages, optimizer in (("gpt-p8", 8, "AdamW"), ("gpt-nadam", 4, "NAdam"), ("gpt-nadam-p8", 8, "NAdam")):
        task = tasks[name]
        assert (task.stages, task.microbatches, task.optimizer) == (stages, stages, optimizer)
        assert (task.sizes, task.batch_size, task.epochs, task.steps_per_epoch, task.lr) == \
            (gpt.sizes, gpt.batch_size, gpt.epochs, gpt.steps_per_epoch, gpt.lr)
    nadam = dict(tasks["gpt-nadam"].optimizer_options)
    assert nadam == {"betas": (0.99, 0.999), "momentum_decay": 0.004, "weight_decay": 0.01,
                     "decoupled_weight_decay": True}
    built = study["tasks"].make_optimizer(tasks["gpt-nadam"], 1e-3, tasks["gpt-nadam"].optimizer_options)
    assert type(built) is pipecore.NAdam


def test_the_corrections_table_lists_pipedream_and_each_correction_against_its_baseline(study):
    runs, report = study["runs"], study["report"]
    task = replace(tiny(study), name="t")
    gap = {"gap": 0.005, "min": 0.005, "max": 0.005, "seeds": 1}
    groups = {f"t|{method}|{setting}": {"final": {"mean": 0.95, "std": 0.0, "min": 0.95, "max": 0.95}, "seeds": 1,
                                        "diverged": 0, "failed": 0, "gap_to_matched": gap, "epochs_to_target": 2.0,
                                        "reached_target": 1, "steps_to_target": 20.0, "updates_to_target": 80.0}
              for method, setting in (("pipedream", runs.AT_SEQUENTIAL), ("pipedream-dc", "ablation adaptive"))}
    table = report.corrections_table([task], groups)
    lines = [line for line in table.splitlines() if line.startswith("| t |")]
    assert len(lines) == 2
    assert "pipedream (stash, uncorrected)" in lines[0] and "DC-ASGD-a" in lines[1]
    assert all("+0.5 pt (1 seed)" in line for line in lines)
    assert report.corrections_table([task], {}) is None


def curve(study, values, per_epoch=10, key="accuracy"):
    return [{"epoch": e + 1, "step": per_epoch * (e + 1), "updates": per_epoch * (e + 1), key: v, "loss": 1.0}
            for e, v in enumerate(values)]


def record(study, values, diverged=False, key="accuracy", every=4):
    return {"key": None, "curve": curve(study, values, key=key), "diverged": diverged, "error": None, "wall_s": 1.0,
            "weight_version_bytes": 8, "stage_costs": None, "update_every": every, "updates_per_epoch": 40 // every,
            "steps_per_epoch": 10}


def test_targets_and_aggregates(study):
    runs, report = study["runs"], study["report"]
    task = tiny(study, target=0.9)
    plan = runs.Plan()
    plan.add(task, "sequential/4", runs.AT_SEQUENTIAL, [0, 1, 2], task.lr, task.optimizer_options)
    group = plan.group(task, "sequential/4")
    keys = group.keys
    records = {keys[0]: record(study, [0.5, 0.92, 0.95]), keys[1]: record(study, [0.91, 0.93, 0.97]),
               keys[2]: record(study, [0.2], True)}
    target = report.task_target(task, plan, records)
    assert target["value"] == 0.9
    agg = report.aggregate(task, group, records, target["value"])
    assert agg["diverged"] == 1 and agg["reached_target"] == 2
    assert agg["final"]["mean"] == pytest.approx(0.96) and agg["final"]["min"] == 0.95
    assert agg["epochs_to_target"] == 1.5
    # Steps: interpolated between evaluations (0.5 at step 10, 0.92 at 20: 0.9 at 10 + 10 * 0.4 / 0.42), or the
    # first evaluation's step when it met the target already.
    assert agg["steps_to_target"] == pytest.approx((10 + 10 * 0.4 / 0.42 + 10) / 2)
    assert agg["updates_to_target"] == pytest.approx(agg["steps_to_target"])  # one update per step (k = m)
    assert agg["final_by_seed"] == {"0": 0.95, "1": 0.97}
    assert runs.selection_score(task, records[keys[2]]) == -math.inf


def test_a_derived_target_and_the_gaps_to_sequential(study):
    runs, report = study["runs"], study["report"]
    task = replace(study["tasks"].quick_tasks()["gpt-large-p4"], epochs=3)
    plan = runs.Plan()
    for method in ("sequential/8", "sequential/1", "pipedream"):
        plan.add(task, method, runs.AT_SEQUENTIAL, [0, 1], task.lr, task.optimizer_options)
    losses = {"sequential/8": ([3.0, 2.5, 2.0], [3.0, 2.6, 2.2]), "sequential/1": ([2.8, 2.3, 1.9], [2.9, 2.4, 1.9]),
              "pipedream": ([3.0, 2.5, 2.09], [3.0, 2.6, 2.09])}
    records = {}
    for method, per_seed in losses.items():
        for key, values in zip(plan.group(task, method).keys, per_seed):
            records[key] = record(study, values, key="test_loss", every=8 if method == "sequential/8" else 1)
            for point in records[key]["curve"]:
                point["perplexity"] = math.exp(point["test_loss"])
    target = report.task_target(task, plan, records)
    assert target["value"] == pytest.approx(2.1 * (1 + task.target_margin))  # mean final of sequential/8, +2%
    groups = {}
    for group in plan.groups.values():
        groups[group.name] = {"task": group.task, "algorithm": group.method, "setting": group.setting,
                              "options": group.options, **report.aggregate(task, group, records, target["value"])}
    report.add_gaps(task, groups)
    pipedream = groups[f"{task.name}|pipedream|{runs.AT_SEQUENTIAL}"]
    assert pipedream["matched_sequential"] == f"{task.name}|sequential/1|{runs.AT_SEQUENTIAL}"
    assert pipedream["gap_to_matched"]["gap"] == pytest.approx(2.09 / 1.9 - 1)
    assert pipedream["best_sequential"] == f"{task.name}|sequential/1|{runs.AT_SEQUENTIAL}"
    assert pipedream["gap_to_best_sequential"]["gap"] == pytest.approx(2.09 / 1.9 - 1)
    assert (pipedream["gap_to_matched"]["min"], pipedream["gap_to_matched"]["max"]) == pytest.approx(
        (2.09 / 1.9 - 1, 2.09 / 1.9 - 1))
    assert report.closest(task, groups) is pipedream


def uniform_costs(stages, forward=1.0, backward=2.0, update=0.5):
    return [{"F": forward, "B": backward, "U": update} for _ in range(stages)]


def test_the_predicted_step_is_the_simulators_steady_state_with_the_measured_costs(study):
    ttq = study["ttq"]
    task = tiny(study)  # P=4, m=4
    costs = uniform_costs(4)
    # gpipe with a flush: (m + P - 1) forwards and backwards on the critical path, then the update.
    gpipe = ttq.predicted_step(task, "gpipe", {}, costs)
    assert gpipe["step_s"] == pytest.approx((4 + 4 - 1) * 3 + 0.5)
    assert gpipe["devices"] == 4
    assert gpipe["work_s"] == pytest.approx(4 * (4 * 3 + 0.5))
    assert gpipe["bubble"] == pytest.approx(1 - (4 * 3 + 0.5) / (7 * 3 + 0.5))
    # An asynchronous 1F1B in its steady state has no bubble: m forwards, backwards and updates per mini-batch.
    pipedream = ttq.predicted_step(task, "pipedream", {}, costs)
    assert pipedream["step_s"] == pytest.approx(4 * (3 + 0.5))
    assert pipedream["bubble"] == pytest.approx(0.0, abs=1e-9)
    # The same as running the simulator by hand with the documented costs, past the warm-up.
    algorithm = pipecore.get_algorithm("2bw", 4, 4)
    by_hand = {"forward": [1.0] * 4, "backward": [1.0] * 4, "weight": [1.0] * 4, "update": [0.5] * 4}
    first = algorithm.warmup_minibatches + 1
    spans = [pipecore.simulate(algorithm, 4, 4, n_minibatches=n, costs=by_hand).makespan for n in (first, first + 2)]
    assert ttq.predicted_step(task, "2bw", {}, costs)["step_s"] == pytest.approx((spans[1] - spans[0]) / 2)
    # A backward over a whole mini-batch (TiMePReSt's nF1B) is measured once for m micro-batches.
    per_backward = ttq.simulator_costs(pipecore.get_algorithm("timeprest", 4, 4), uniform_costs(4, backward=8.0))
    assert per_backward["backward"] == [1.0] * 4 and per_backward["weight"] == [1.0] * 4
    # Sequential training: one device, m forwards and backwards and m / k updates per mini-batch.
    whole = [{"F": 4.0, "B": 8.0, "U": 2.0}]
    assert ttq.predicted_step(task, "sequential/4", {}, whole) == {"step_s": 4 * 12 + 2.0, "devices": 1,
                                                                    "work_s": 4 * 12 + 2.0,
                                                                    "bubble": pytest.approx(0.0, abs=1e-9)}
    assert ttq.predicted_step(task, "sequential/1", {}, whole)["step_s"] == pytest.approx(4 * 12 + 4 * 2.0)


def test_time_to_quality_is_steps_to_target_times_the_predicted_step(study):
    runs, ttq = study["runs"], study["ttq"]
    task = tiny(study)

    def group(method, steps, reached=3, seeds=3, exact=False):
        every = runs.update_every(task, method)
        return {"task": task.name, "algorithm": method, "setting": runs.AT_SEQUENTIAL, "options": {},
                "update_every": every, "steps_to_target": steps, "reached_target": reached, "seeds": seeds,
                "exact": exact, "matched_sequential": f"{task.name}|{runs.matched_sequential(task, method)}|"
                                                      f"{runs.AT_SEQUENTIAL}" if method != "sequential/4" else None}

    groups = {f"{task.name}|{g['algorithm']}|{runs.AT_SEQUENTIAL}": g for g in (
        group("sequential/4", 100.0), group("gpipe", 90.0, seeds=1, exact=True), group("pipedream", 80.0),
        group("spectrain", 10.0, reached=2))}
    costs = {"sequential/4": [{"F": 4.0, "B": 8.0, "U": 0.0}], "gpipe": uniform_costs(4, update=0.0),
             "pipedream": uniform_costs(4, update=0.0), "spectrain": uniform_costs(4, update=0.0)}
    rows = {r["method"]: r for r in ttq.ttq_rows(task, groups, costs, runs.AT_SEQUENTIAL)}
    for method, row in rows.items():
        assert row["time_to_target_s"] == pytest.approx(row["steps_to_target"] * row["step_s"])
    assert rows["sequential/4"]["step_s"] == 48.0 and rows["pipedream"]["step_s"] == pytest.approx(12.0)
    # An exact algorithm that ran fewer seeds takes its baseline's steps (it computes the same updates).
    assert rows["gpipe"]["steps_to_target"] == 100.0 and rows["gpipe"]["steps_from"] == "sequential/4"
    assert rows["pipedream"]["steps_from"] is None
    # The first to the target among the methods every seed of which reached it: not spectrain (2 of 3).
    ordered = ttq.ttq_rows(task, groups, costs, runs.AT_SEQUENTIAL)
    assert ttq.winner(ordered)["method"] == "pipedream"
    assert [r["method"] for r in ordered][-1] == "spectrain"
    # The exact algorithms' work is equal when their costs are: no spread to report as measurement noise.
    assert ttq.noise_floor(ordered) is None  # one exact algorithm only
    assert ttq.noise_floor([{"exact": True, "work_s": 10.0}, {"exact": True, "work_s": 12.0},
                            {"exact": False, "work_s": 30.0}]) == pytest.approx(0.2)


def test_the_costs_of_a_stage_are_the_least_of_its_rounds_medians(study):
    ttq = study["ttq"]
    rounds = [{"task": "t", "method": "m", "round": r, "error": None,
               "stage_costs": [{"F": 1.0 + r, "B": 3.0 - r, "U": 0.1}]} for r in range(3)]
    assert ttq.combine_costs(rounds) == {"t": {"m": [{"F": 1.0, "B": 1.0, "U": 0.1}]}}


def test_costs_are_measured_per_stage_for_every_action_kind(study):
    ttq, runs = study["ttq"], study["runs"]
    task = tiny(study)
    for method, stages in (("pipedream", 4), ("sequential/1", 1)):
        result = ttq.measure_costs(ttq.CostJob(task, method, (), 0, 2))
        assert result["error"] is None
        assert len(result["stage_costs"]) == stages
        assert all(set(c) == {"F", "B", "U"} and all(v > 0 for v in c.values()) for c in result["stage_costs"])
    assert runs.Plan().group(task, "pipedream") is None


def test_flattening_is_less_than_the_tolerance_over_the_window(study):
    flat_epoch = study["convergence"].flat_epoch
    assert flat_epoch([3.0, 2.5, 2.2, 2.0, 1.9, 1.88, 1.875, 1.87], window=2, tolerance=0.01) == 8
    assert flat_epoch([3.0, 2.0, 1.0], window=2, tolerance=0.01) is None


def test_a_decaying_learning_rate_follows_the_data_seen_whatever_the_update_frequency(study):
    tasks, runs = study["tasks"], study["runs"]
    task = replace(tiny(study), cosine_to=0.1)  # 2 epochs of 22 mini-batches, m = 4
    per_minibatch, per_microbatch = tasks.lr_schedule(task, 4), tasks.lr_schedule(task, 1)
    assert per_minibatch(0) == 1.0 and per_minibatch(44) == pytest.approx(0.1)
    assert per_minibatch(22) == pytest.approx(0.55)
    for u in range(44):
        assert per_microbatch(4 * u) == pytest.approx(per_minibatch(u))
    assert tasks.lr_schedule(tiny(study), 4) is None
    trainer = runs.Trainer(job(study, task, "pipedream"), tasks.build_model(task))
    for x, y in list(tasks.train_batches(task, 0, 0))[:11]:
        trainer.step(x, y)
    trainer.flush()
    assert trainer.updates == 44
    assert trainer.pipe.stats()[0]["lr"] == pytest.approx(task.lr / 4 * per_minibatch(11))
