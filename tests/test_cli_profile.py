"""``pipecore train --profile``: a torch.profiler Chrome trace whose action ranges are named as the simulator
names them, through :func:`pipecore.cli.main` on scikit-learn's digits."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import pipecore
from pipecore.cli import main
from pipecore.cli.profile import rank_path

# 4 stages, 4 micro-batches of 100, 3 steps per epoch (1,437 // 400): the whole run is a handful of steps.
SMALL = ["--hidden", "32", "--batch-size", "400", "--no-progress"]
P, M, STEPS_PER_EPOCH = 4, 4, 3
ACTION = re.compile(r"^(\d+)([FBU])(\d+)(?:-(\d+))?(?:@\S+)?$")
HINT = re.compile(r"`(pipecore simulate [^`]*)`")


def train(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``pipecore train ARGV`` in-process; returns (exit code, stdout, stderr)."""
    code = main(["train", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def complete_events(path: Path) -> list[dict[str, Any]]:
    """The trace's complete events (``"ph": "X"``); the file must be valid JSON."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X"]


def actions(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if ACTION.match(e["name"])]


def simulated(algorithm: str, steps: int, num_stages: int = P, **options: Any) -> Counter[str]:
    """The simulator's action names (with their multiplicity) for ``steps`` mini-batches, drained at the end."""
    trace = pipecore.simulate(algorithm, num_stages, M, n_minibatches=steps, **options)
    return Counter(trace._label(e) for e in trace.events)


def parse(name: str) -> tuple[int, str, range]:
    """An action range's stage, kind and the micro-batches it touches (an update touches none)."""
    match = ACTION.match(name)
    assert match, name
    stage, kind, first, last = match.groups()
    touched = range(0) if kind == "U" else range(int(first), int(last if last is not None else first) + 1)
    return int(stage), kind, touched


def ranges(events: list[dict[str, Any]], *names: str) -> list[str]:
    """The training loop's own ranges (``step N``, ``flush``, ``evaluate``) in time order."""
    ours = [e for e in events if e["name"] in names or e["name"].startswith("step ")]
    return [e["name"] for e in sorted(ours, key=lambda e: e["ts"])]


@pytest.mark.parametrize("algorithm, options", [
    ("1f1b", {}), ("pipedream", {}), ("i-timeprest", {}), ("i-timeprest", {"lam": 0.5}),
])
def test_trace_has_the_simulators_actions(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                          algorithm: str, options: dict[str, Any]) -> None:
    """One epoch of 3 steps, all recorded: the trace holds every action the simulator lists for 3 mini-batches
    (drained at the end, as the epoch's flush drains), each once, and nothing else of that form."""
    path = tmp_path / "trace.json"
    flags = [f for k, v in options.items() for f in ("-o", f"{k}={v}")]
    code, out, err = train(capsys, "-a", algorithm, *flags, "--epochs", "1", *SMALL, "--profile", str(path))
    assert code == 0, err
    events = complete_events(path)
    found = Counter(e["name"] for e in actions(events))
    assert found, "no action ranges in the trace"
    assert found == simulated(algorithm, STEPS_PER_EPOCH, **options)
    if algorithm == "i-timeprest":  # nF1B: one backward covers a mini-batch's micro-batches, read derived weights
        assert any(name.startswith("0B4-7@v1~interp(v0,a=") for name in found), sorted(found)
    assert ranges(events, "flush", "evaluate") == ["step 1", "step 2", "step 3", "flush"]

    # The printed line says where the trace went, how to open it, and which simulation to compare it with.
    line = next(line for line in out.splitlines() if line.startswith("wrote the profile"))
    assert f"wrote the profile of 3 training steps to {path}: " in line
    assert "chrome://tracing" in line and "https://ui.perfetto.dev" in line
    hint = HINT.search(line)
    assert hint, line
    argv = shlex.split(hint.group(1))
    assert argv[-2:] == ["--chrome", "sim.json"]
    sim = tmp_path / "sim.json"
    assert main([*argv[1:-1], str(sim)]) == 0  # the command, as printed, with the file in tmp_path
    capsys.readouterr()
    assert Counter(e["name"] for e in actions(complete_events(sim))) == found


def test_stages_run_on_their_own_threads_with_aten_ops_inside(capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path) -> None:
    """Each action range is on a thread that runs only its stage's actions, not the caller's; the aten ops a
    forward ran are nested inside its range on the same thread."""
    path = tmp_path / "trace.json"
    code, _, err = train(capsys, "-a", "pipedream", "--epochs", "1", *SMALL, "--profile", str(path))
    assert code == 0, err
    events = complete_events(path)
    acts = actions(events)
    stage_of_thread: dict[Any, set[int]] = {}
    for e in acts:
        stage_of_thread.setdefault((e["pid"], e["tid"]), set()).add(parse(e["name"])[0])
    assert all(len(stages) == 1 for stages in stage_of_thread.values()), stage_of_thread
    caller = {(e["pid"], e["tid"]) for e in events if e["name"].startswith("step ")}
    assert len(caller) == 1 and not caller & set(stage_of_thread)

    ops = [e for e in events if e["name"] in ("aten::addmm", "aten::linear")]
    assert ops
    for stage in range(P):
        forwards = [e for e in acts if parse(e["name"])[:2] == (stage, "F")]
        assert len(forwards) == M * STEPS_PER_EPOCH
        nested = [
            (f["name"], op["name"]) for f in forwards for op in ops
            if (op["pid"], op["tid"]) == (f["pid"], f["tid"])
            and f["ts"] <= op["ts"] and op["ts"] + op["dur"] <= f["ts"] + f["dur"]
        ]
        assert nested, f"no aten::addmm or aten::linear inside a forward of stage {stage}"


@pytest.mark.parametrize("algorithm", ["1f1b", "pipedream"])
def test_profile_steps_records_only_the_first_steps(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                    algorithm: str) -> None:
    """--profile-steps 2 of 3: only the first 2 mini-batches' forwards, and the backwards and updates those two
    steps ran; the third step, the flush and the evaluation are not recorded."""
    path = tmp_path / "trace.json"
    code, out, err = train(capsys, "-a", algorithm, "--epochs", "1", *SMALL, "--profile", str(path),
                           "--profile-steps", "2")
    assert code == 0, err
    assert f"wrote the profile of 2 training steps to {path}: " in out
    events = complete_events(path)
    found = Counter(e["name"] for e in actions(events))
    assert ranges(events, "flush", "evaluate") == ["step 1", "step 2"]
    first = range(2 * M)  # the micro-batches of the first 2 mini-batches
    assert all(set(parse(name)[2]) <= set(first) for name in found), sorted(found)
    forwards = {(s, j) for s, kind, touched in map(parse, found) if kind == "F" for j in touched}
    assert forwards == {(s, j) for s in range(P) for j in first}
    # Every recorded action is one the whole run performs, with the weights the simulator says it read.
    whole_run = simulated(algorithm, STEPS_PER_EPOCH)
    assert not found - whole_run
    backwards = [j for _, kind, touched in map(parse, found) if kind == "B" for j in touched]
    if algorithm == "1f1b":  # synchronous: each step drains its mini-batch
        assert found == simulated(algorithm, 2)
        assert len(backwards) == P * 2 * M
    else:  # asynchronous: the last backwards of step 2 ran in step 3, which was not recorded
        assert 0 < len(backwards) < P * 2 * M


def test_the_flush_after_the_last_recorded_step_is_recorded(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    """--profile-steps 3 with 2 epochs of 3 steps: the first epoch, its flush drained; not the evaluation
    after it, nor the second epoch."""
    path = tmp_path / "trace.json"
    code, out, err = train(capsys, "-a", "pipedream", "--epochs", "2", *SMALL, "--profile", str(path),
                           "--profile-steps", "3")
    assert code == 0, err
    assert f"wrote the profile of 3 training steps to {path}: " in out
    events = complete_events(path)
    assert Counter(e["name"] for e in actions(events)) == simulated("pipedream", STEPS_PER_EPOCH)
    assert ranges(events, "flush", "evaluate") == ["step 1", "step 2", "step 3", "flush"]


def test_evaluations_between_recorded_steps_are_recorded(capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    """2 epochs, all recorded: the evaluation between them is recorded, the one after the last flush is not.
    A flush ends the pipeline's schedule, so each epoch compares with the simulation of one epoch."""
    path = tmp_path / "trace.json"
    code, out, err = train(capsys, "-a", "pipedream", "--epochs", "2", *SMALL, "--profile", str(path))
    assert code == 0, err
    assert f"wrote the profile of 6 training steps to {path}: " in out
    assert "`pipecore simulate -a pipedream -p 4 -m 4 -n 3 --chrome sim.json`" in out
    events = complete_events(path)
    assert ranges(events, "flush", "evaluate") == [
        "step 1", "step 2", "step 3", "flush", "evaluate", "step 4", "step 5", "step 6", "flush"]
    flush = min((e for e in events if e["name"] == "flush"), key=lambda e: e["ts"])
    end = flush["ts"] + flush["dur"]
    first = Counter(e["name"] for e in actions(events) if e["ts"] < end)
    second = [e["name"] for e in actions(events) if e["ts"] >= end]
    assert first == simulated("pipedream", STEPS_PER_EPOCH)
    assert len(second) == sum(first.values())  # the same work again


@pytest.mark.parametrize("argv, message", [
    (["--profile", "trace.json", "--profile-steps", "0"], "argument --profile-steps: must be an integer >= 1, got '0'"),
    (["--profile", "trace.json", "--profile-steps", "-3"], "argument --profile-steps: must be an integer >= 1"),
    (["--profile", "no-such-dir/trace.json"], "--profile: the directory of no-such-dir/trace.json does not exist"),
    (["--profile", "."], "--profile: . is a directory"),
    (["--profile-steps", "5"], "--profile-steps applies with --profile PATH"),
])
def test_bad_profile_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch, argv: list[str], message: str) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = train(capsys, *argv, "--epochs", "1", *SMALL)
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("pipecore")]
    assert len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err and out == ""  # before loading data or training
    assert list(tmp_path.iterdir()) == []


def test_rank_path_puts_the_rank_before_the_suffix() -> None:
    assert rank_path("trace.json", None) == "trace.json"
    assert rank_path("trace.json", 1) == "trace.rank1.json"
    assert rank_path(os.path.join("out.d", "run.pt.trace.json"), 0) == os.path.join("out.d", "run.pt.trace.rank0.json")
    assert rank_path("trace", 3) == "trace.rank3"


def test_torchrun_survives_communication_after_the_recording(tmp_path: Path) -> None:
    """Training and evaluation go on over the ranks after the recorded steps: messages posted while the
    profiler recorded complete after it stopped. Such a message's profiler event used to crash torch's
    profiler results when freed (a segmentation fault at the export or at exit); the transport posts its
    messages without profiler events."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("TORCHELASTIC")}
    for attempt in range(3):  # the crash did not happen every time
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              "-m", "pipecore", "train", "-a", "pipedream", "--stages", "2", "--epochs", "3", *SMALL,
                              "--profile", "trace.json", "--profile-steps", "2"],
                             cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                             timeout=240)
        assert run.returncode == 0, (attempt, run.stdout + run.stderr)
        assert "wrote the profile of 2 training steps" in run.stdout, run.stdout


def test_torchrun_writes_one_trace_per_rank(tmp_path: Path) -> None:
    """One process per stage: each rank writes its own stage's actions to PATH with its rank before the
    suffix; together they are the simulator's actions."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("TORCHELASTIC")}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "pipecore", "train", "-a", "pipedream", "--stages", "2", "--epochs", "1", *SMALL,
                          "--profile", "trace.json"],
                         cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "wrote the profile of 3 training steps to trace.rank<R>.json (one per rank): " in run.stdout, run.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.rank0.json", "trace.rank1.json"]
    together: Counter[str] = Counter()
    for rank in range(2):
        found = Counter(e["name"] for e in actions(complete_events(tmp_path / f"trace.rank{rank}.json")))
        assert found and all(name.startswith(str(rank)) for name in found), sorted(found)
        together += found
    assert together == simulated("pipedream", STEPS_PER_EPOCH, num_stages=2)
