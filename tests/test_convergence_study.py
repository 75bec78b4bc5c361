"""The convergence study's own logic (``bench/convergence.py``): one run's record, divergence, the learning-rate
convention, targets and aggregates. The study itself is a benchmark; these check that what it reports is
what happened."""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def study():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("convergence", BENCH / "convergence.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["convergence"] = module  # dataclasses resolve their annotations through it
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("convergence", None)
        sys.path.remove(str(BENCH))


def tiny(study, **changes):
    """mlp4 at a tenth of its width, for 2 epochs."""
    return replace(study.TASKS["mlp4"], sizes={"hidden": 12, "depth": 3}, epochs=2, grid=(), **changes)


def test_a_run_records_one_point_per_epoch_and_gpipe_matches_sequential(study):
    task = tiny(study)
    records = {m: study.run_job(study.Job(task, m, 0, task.lr, task.momentum)) for m in ("sequential", "gpipe")}
    for record in records.values():
        assert record["error"] is None and not record["diverged"]
        assert [c["epoch"] for c in record["curve"]] == [1, 2]
        assert [c["updates"] for c in record["curve"]] == [22, 44]  # 1437 training samples // 64 per epoch
    # The same computation (gpipe accumulates the same micro-batches before one step), up to float32 rounding.
    for a, b in zip(records["sequential"]["curve"], records["gpipe"]["curve"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert records["gpipe"]["weight_version_bytes"] == records["sequential"]["weight_version_bytes"]


def test_learning_rate_is_per_minibatch(study):
    task = tiny(study)
    model = study.build_model(task)
    per_microbatch = study.PipelineTrainer(study.Job(task, "pipedream", 0, 0.05, 0.9), model)
    assert [st.optimizer.lr for st in per_microbatch.pipe.stages.values()] == [0.05 / 4] * 4
    per_minibatch = study.PipelineTrainer(study.Job(task, "2bw", 0, 0.05, 0.9), study.build_model(task))
    assert [st.optimizer.lr for st in per_minibatch.pipe.stages.values()] == [0.05] * 4


def test_a_diverging_run_is_recorded_as_diverged_not_as_a_failure(study):
    task = tiny(study)
    record = study.run_job(study.Job(task, "pipedream", 0, 1e30, 0.9))
    assert record["diverged"] and record["error"] is None
    assert len(record["curve"]) < task.epochs


def test_targets_and_aggregates(study):
    task = tiny(study, target=0.9)
    plan = study.Plan()
    plan.add(task, "sequential", study.AT_SEQUENTIAL, [0, 1, 2], task.lr, task.momentum)
    keys = plan.groups[f"{task.name}|sequential|{study.AT_SEQUENTIAL}"].keys

    def record(accuracies, diverged=False):
        curve = [{"epoch": e + 1, "updates": 10 * (e + 1), "accuracy": a, "loss": 1.0} for e, a in enumerate(accuracies)]
        return {"key": None, "curve": curve, "diverged": diverged, "error": None, "wall_s": 1.0,
                "weight_version_bytes": 8}

    records = {keys[0]: record([0.5, 0.92, 0.95]), keys[1]: record([0.91, 0.93, 0.97]), keys[2]: record([0.2], True)}
    targets = study.apply_targets([task], plan, records)
    assert targets[task.name]["value"] == 0.9
    assert [records[k]["epochs_to_target"] for k in keys] == [2, 1, None]
    agg = study.aggregate(task, plan.groups[f"{task.name}|sequential|{study.AT_SEQUENTIAL}"], records)
    assert agg["diverged"] == 1 and agg["reached_target"] == 2
    assert agg["final"]["mean"] == pytest.approx(0.96) and agg["final"]["min"] == 0.95
    assert agg["epochs_to_target"] == 1.5 and agg["updates_to_target"] == 15
    assert study.selection_score(task, records[keys[2]]) == -math.inf
