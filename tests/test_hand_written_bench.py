"""The hand-written pipeline of ``bench/hand_written.py``, which the benchmark compares pipecore's in-turn
executor with: it must run the schedule in the order that executor runs it, and train what sequential
training trains."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import pipecore

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    loaded = set(sys.modules)
    try:
        spec = importlib.util.spec_from_file_location("hand_written", BENCH / "hand_written.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        for name in set(sys.modules) - loaded:  # engine and _machine, imported from bench/
            if not name.startswith(("pipecore", "torch")):
                del sys.modules[name]
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_the_order_is_the_one_the_in_turn_executor_runs(bench, name, stages, tmp_path):
    model = bench.make_model(width=6, layers=3 * stages)
    m = 4
    pipe = pipecore.Pipeline(model, stages, name, n_microbatches=m, concurrent=False,
                             partition=bench.cuts(model, stages), loss_fn=nn.CrossEntropyLoss(),
                             optimizer=pipecore.SGD(lr=0.1))
    x, y = torch.randn(8, 6), torch.randint(0, 6, (8,))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pipe.step(x, y)
    # The Chrome trace: prof.events() demangles a name such as "2U1" (into "U1", see docs/training.md).
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    ranges = sorted((e["ts"], e["name"]) for e in events
                    if e.get("ph") == "X" and re.fullmatch(r"\d+[FBU]\d+(@\S+)?", e["name"]))
    ran = []
    for _, label in ranges:
        stage, kind, index = re.match(r"(\d+)([FBU])(\d+)", label).groups()
        ran.append((int(stage), kind, int(index)))
    assert ran == [(s, str(kind), k) for s, kind, k in bench.in_turn_order(name, stages, m)]


def test_the_hand_written_loops_train_what_sequential_training_trains(bench):
    base = bench.make_model(width=16, layers=4)
    stages, m = 2, 4
    trainers = {"sequential": bench.sequential_trainer,
                "cut": lambda model, m: bench.cut_trainer(model, stages, m)}
    for name in ("gpipe", "1f1b"):
        order = bench.in_turn_order(name, stages, m)
        trainers[name] = lambda model, m, order=order: bench.hand_written_trainer(model, stages, m, order)
    weights = {}
    for label, make in trainers.items():
        model = copy.deepcopy(base)
        step = make(model, m)
        for x, y in bench.mlp_data(8, 16, 3):
            step(x, y)
        weights[label] = model.state_dict()
    # Same operations on the same values, summed in the same order: the same bits.
    for label in ("cut", "gpipe", "1f1b"):
        for key, value in weights["sequential"].items():
            assert torch.equal(weights[label][key], value), (label, key)
    assert not torch.equal(weights["sequential"]["0.weight"], base.state_dict()["0.weight"])  # it trained
