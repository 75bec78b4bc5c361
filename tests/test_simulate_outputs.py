"""What a simulation outputs: the grid (pinned by golden files), the summary, Chrome traces, PNGs, costs.

Golden files live in ``tests/golden``; regenerate them with ``PIPECORE_UPDATE_GOLDEN=1 pytest
tests/test_simulate_outputs.py`` and review the diff.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from pipecore import algorithm_names, simulate
from pipecore.cli import main
from pipecore.runtime import Costs
from pipecore.schedule import U, W, parse_traced
from pipecore.simulate import make_costs

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("PIPECORE_UPDATE_GOLDEN") == "1"


def check_golden(name: str, text: str) -> None:
    """Compare ``text`` with ``tests/golden/<name>`` exactly (or rewrite the file in update mode)."""
    path = GOLDEN / name
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with PIPECORE_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"{name} changed; if intended, regenerate with PIPECORE_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("argv, golden", [
    (["-a", "i-timeprest", "-p", "3", "-m", "2", "-n", "3"], "i-timeprest_P3_m2_n3.txt"),
    (["-a", "pipedream", "-p", "3", "-m", "2", "-n", "2"], "pipedream_P3_m2_n2.txt"),
    (["-a", "timeprest", "-p", "3", "-m", "2", "-n", "4"], "timeprest_P3_m2_n4.txt"),
    (["-a", "2bw", "-p", "2", "-m", "2", "-n", "3"], "2bw_P2_m2_n3.txt"),
    (["--compare", "-p", "4", "-m", "4", "-n", "2"], "compare_P4_m4_n2.txt"),
])
def test_printed_output_matches_golden(capsys, argv, golden):
    assert main(["simulate", *argv]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    check_golden(golden, captured.out)


def test_grid_matches_golden_and_the_trace():
    t = simulate("i-timeprest", 3, 2, 3)
    check_golden("i-timeprest_P3_m2_n3.grid.txt", t.grid() + "\n")
    # Every cell is an action of the schedule with the version it read.
    for s, line in enumerate(t.grid().splitlines()):
        label, cells = line.split(": ")
        assert label == f"stage {s}"
        events = [e for e in t.events if e.action.stage == s]
        assert len(cells.split()) == len(events) == len(t.schedule.stages[s])
        for cell, e in zip(cells.split(), events):
            action, tag = parse_traced(cell)
            assert action == e.action
            if action.kind is U:
                assert tag is None
            else:
                assert {tag} == {str(r) for r in e.record.reads.values()}


def test_summary_lists_bubble_versions_and_staleness():
    t = simulate("pipedream", 4, 4, 2)
    lines = t.summary().splitlines()
    assert lines[0] == "algorithm pipedream: 4 stages, 4 micro-batches x 2 mini-batches"
    assert lines[1] == f"makespan {t.makespan:g}, bubble fraction {t.bubble_fraction:.3f}"
    assert lines[2].split() == ["stage", "versions", "derived", "activations", "staleness(mean/max)",
                                "delay(mean/max)"]
    for s, line in enumerate(lines[3:]):
        x = t.stage_summary(s)
        cells = line.replace("/", " ").split()
        assert cells[:4] == [str(s), str(4 - s), "no", str(4 - s)]
        assert cells[4:6] == [f"{x.mean_staleness:.2f}", str(x.max_staleness)]
        assert cells[6:8] == [f"{x.mean_delay:.2f}", str(3 - s)] and x.max_delay == 3 - s


def test_chrome_trace(tmp_path):
    for name in algorithm_names():
        t = simulate(name, 4, 4, 2)
        path = tmp_path / f"{name}.json"
        t.to_chrome_trace(str(path))
        data = json.loads(path.read_text())
        complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
        assert len(complete) == len(t.events) == len(t.schedule)
        # One row per rank: a stage's own when it has one, else its rank's (V placements hold two each).
        placement = t.schedule.placement
        assert sorted(e["tid"] for e in complete) == sorted(placement[e.action.stage] for e in t.events)
        names = {e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "thread_name"}
        if t.schedule.ranks is None:
            assert names == {f"stage {s}" for s in range(4)}
        else:
            assert names == {f"rank {r} (stages {', '.join(map(str, t.schedule.stages_of(r)))})"
                             for r in range(t.num_ranks)}, name
            if name in ("zb-v", "dualpipe-v"):
                assert names == {f"rank {r} (stages {r}, {3 - r})" for r in range(2)}
        for record, event in zip(complete, t.events):
            action, _ = parse_traced(record["name"])
            assert action == event.action and record["tid"] == placement[action.stage]
            assert record["ts"] == pytest.approx(event.start * 1000.0)
            assert record["cat"] == action.kind.value
            if action.kind is W:  # a weight-gradient action reads no version of its own
                assert "reads" not in record["args"]
            elif action.kind is not U:
                assert record["dur"] == pytest.approx((event.end - event.start) * 1000.0)
                assert record["args"]["staleness"] == max(event.record.live - r.version
                                                          for r in event.record.reads.values())


def test_png(tmp_path):
    path = tmp_path / "timeline.png"
    simulate("i-timeprest", 4, 4, 3).plot(str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 400 and height >= 200
    assert len(data) > 10_000


def test_per_stage_costs_and_send_time():
    # With one micro-batch GPipe is a serial chain: all forwards down, all backwards up.
    fwd, bwd, send = [1.0, 2.0, 0.5, 1.5], [2.0, 3.0, 1.0, 4.0], 0.25
    t = simulate("gpipe", 4, 1, 3, costs={"forward": fwd, "backward": bwd, "update": 0.5, "send": send})
    per_minibatch = sum(fwd) + sum(bwd) + 2 * 3 * send
    # Stage 0 updates last in each mini-batch; the next mini-batch starts after that update.
    assert t.makespan == pytest.approx(3 * (per_minibatch + 0.5))
    for s in range(4):
        assert t.busy(s) == pytest.approx(3 * (fwd[s] + bwd[s] + 0.5))


def test_nf1b_backward_costs_per_microbatch():
    t = simulate("v-timeprest", 2, 3, 2, costs=(1.0, 2.0))
    for e in t.events:
        if e.action.kind.value == "B":
            assert e.end - e.start == 2.0 * 3


def test_cost_forms_agree():
    a = make_costs(3, (1, 2))
    assert a == Costs.uniform(3, 1.0, 2.0)
    assert make_costs(3, {"forward": 1, "backward": [2, 2, 2]}) == a
    # The default splits the backward's 2 into 1 + a weight part of 1: the same time for a schedule that does
    # not split it.
    assert make_costs(3, None) == make_costs(3, {"forward": 1, "backward": 1, "weight": 1})
    assert make_costs(3, {"weight": 1}) == make_costs(3, None)
    unsplit = [(str(e.action), e.start, e.end) for e in simulate("1f1b", 3, 4, 2).events]
    assert unsplit == [(str(e.action), e.start, e.end) for e in simulate("1f1b", 3, 4, 2, costs=(1, 2)).events]
    assert make_costs(3, (1, 2, 0.5)).send == 0.5


@pytest.mark.parametrize("costs, message", [
    ((1,), "must be (forward, backward) or (forward, backward, send)"),
    ({"forward": [1, 2]}, "costs['forward'] has 2 entries; the pipeline has 3 stages"),
    ({"fwd": 1}, "unknown cost keys ['fwd']"),
    ((1, -2), "costs must be finite and non-negative"),
    ((1, float("nan")), "costs must be finite and non-negative"),
    (Costs.uniform(2), "costs.forward has 2 entries; the pipeline has 3 stages"),
])
def test_bad_costs(costs, message):
    with pytest.raises(ValueError) as info:
        simulate("gpipe", 3, 2, 1, costs=costs)
    assert message in str(info.value)


def test_configured_algorithm_takes_no_extra_options():
    from pipecore import get_algorithm

    with pytest.raises(ValueError, match="pass options when naming the algorithm"):
        simulate(get_algorithm("i-timeprest", 3, 2), 3, 2, 1, lam=0.5)
