"""Surviving a dead worker: ``torchrun --max-restarts`` with ``--resume auto`` (a worker killed with SIGKILL part
way through ends with an uninterrupted run's weights), the restarted round's process groups, and the runnable
example of docs/distributed.md."""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipecore.checkpoint import load_state
from pipecore.cli import main
from pipecore.runtime import elastic
from pipecore.runtime.link import PeerError

from _same import assert_same

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "train_elastic.py")
WAIT = 240  # seconds: a bound on every wait (a busy machine starts torch slowly), never a measurement
SMALL = ["--hidden", "32", "--batch-size", "32", "--no-progress"]


def _outside_any_rank() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("TORCHELASTIC")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun's workers), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue  # ended meanwhile
            # The second field (the command) is in parentheses and may hold spaces; the parent follows the state.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds torchrun's workers through /proc (Linux)")
def test_a_worker_killed_at_a_random_step_is_restarted_and_the_run_ends_as_an_uninterrupted_one(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``torchrun --max-restarts 1 ... --resume auto --save-every-steps 10``: once the first checkpoint exists,
    one worker, chosen at random, is killed with SIGKILL after a random delay (the seed is in the failure
    message). torchrun restarts both workers; the new round connects (it used to fail in Gloo's connectFullMesh,
    reading the dead round's addresses from torchrun's store), resumes from the last save, and the final
    checkpoint equals a run that was never interrupted, tensor for tensor, with the same history."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    args = ["--stages", "2", "--epochs", "4", *SMALL, "--save-every-steps", "10"]
    ckpt = tmp_path / "ckpt.pt"
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--monitor-interval", "0.1",
         "-m", "pipecore", "train", *args, "--save", str(ckpt), "--resume", "auto"],
        cwd=tmp_path, env=_outside_any_rank(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + WAIT
        while not ckpt.exists():
            assert torchrun.poll() is None, f"torchrun ended before the first checkpoint: {torchrun.communicate()}"
            assert time.monotonic() < deadline, "no checkpoint within the wait"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))
        workers = sorted(_children(torchrun.pid))
        assert len(workers) == 2, f"seed {seed}: expected torchrun's 2 workers, found {workers}"
        victim = rng.choice(workers)
        os.kill(victim, signal.SIGKILL)
        out, err = torchrun.communicate(timeout=WAIT)
    finally:
        if torchrun.poll() is None:
            torchrun.kill()
            torchrun.communicate()
    assert torchrun.returncode == 0, f"seed {seed}:\n{out}\n{err}"
    assert "connectFullMesh" not in err, f"seed {seed}: {err}"
    assert f"(pid: {victim})" in err, f"seed {seed}: torchrun does not report the killed worker:\n{err}"
    assert out.count("--resume auto: no checkpoint at") == 1, f"seed {seed}:\n{out}"  # the first round only
    assert out.count("--resume auto: resumed from") + out.count("nothing left to train") == 1, f"seed {seed}:\n{out}"

    reference = tmp_path / "reference.pt"
    assert main(["train", *args, "--save", str(reference)]) == 0
    capsys.readouterr()
    a, b = _load(ckpt), _load(reference)
    assert_same(a["pipeline"], b["pipeline"], f"seed {seed}")
    assert a["history"] == b["history"] and (a["epoch"], a["step"]) == (b["epoch"], b["step"]) == (4, 0)


def test_the_example_resumes_from_its_last_checkpoint_and_ends_as_a_run_that_never_stopped(tmp_path: Path) -> None:
    """examples/train_elastic.py in one process: 40 steps, then the same command for 100 resumes at step 40 and
    ends with the weights and optimizer state of 100 steps straight."""
    def run(steps: int, directory: str) -> str:
        proc = subprocess.run([sys.executable, EXAMPLE, "--steps", str(steps), "--checkpoint", directory],
                              cwd=tmp_path, env=_outside_any_rank(), capture_output=True, text=True, timeout=WAIT)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    assert run(40, "killed").splitlines()[0] == "starting at step 0"
    resumed = run(100, "killed")
    assert resumed.splitlines()[0] == "resumed from killed at step 40"
    assert "step 20:" not in resumed and "step 100:" in resumed
    run(100, "straight")
    assert_same(load_state(tmp_path / "killed"), load_state(tmp_path / "straight"))


def test_a_group_that_cannot_connect_is_a_peer_error_that_says_why_and_what_to_do(
        monkeypatch: pytest.MonkeyPatch) -> None:
    raw = ("Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:152] "
           "timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:40868$0")

    def refused(*args, **kwargs):
        raise RuntimeError(raw)

    monkeypatch.setattr(dist, "new_group", refused)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    with pytest.raises(PeerError) as caught:
        elastic.new_group([0, 1], "the link of stages 0 and 1", datetime.timedelta(seconds=5))
    message = str(caught.value)
    assert message.startswith("rank 1: could not connect to the other ranks while creating the link of stages 0 "
                              "and 1 (Gloo connectFullMesh failed with timed out connecting: SO_ERROR: Connection "
                              "refused, remote=[127.0.0.1]:40868$0); another rank died or never got here")
    assert "\n" not in message and "pair.cc" not in message and "--resume auto" in message
    # In a restarted round whose default group torch's env:// joined, the cause is the store's stale keys.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setattr(elastic, "_joined_with", None)
    with pytest.raises(PeerError, match=r"this is restart 1 of a torchrun job and the default process group was "
                                        r"initialised outside pipecore: .* pipecore.init_process_group\(\)"):
        elastic.new_group([0, 1], "the link of stages 0 and 1", datetime.timedelta(seconds=5))


def test_a_usage_error_of_new_group_is_not_taken_for_a_dead_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    def invalid(*args, **kwargs):
        raise ValueError("Invalid rank 7")

    monkeypatch.setattr(dist, "new_group", invalid)
    with pytest.raises(ValueError, match="Invalid rank 7"):
        elastic.new_group([0, 7], "the link of stages 0 and 1", datetime.timedelta(seconds=5))


def test_the_store_prefix_changes_with_every_restart_of_a_torchrun_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "4")
    prefixes = []
    for restart in ("0", "1", "2"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
        prefixes.append(elastic.round_prefix())
    assert prefixes == ["pipecore/job/restart-0/world-4/", "pipecore/job/restart-1/world-4/",
                        "pipecore/job/restart-2/world-4/"]


def test_the_loop_in_the_docs_runs_saves_its_progress_and_resumes_at_the_end(tmp_path: Path) -> None:
    """The Python block of docs/distributed.md's "Surviving a dead worker", as written, in one process: it trains
    300 steps and commits step 300; run again, it resumes there and trains nothing more."""
    import re

    text = (ROOT / "docs" / "distributed.md").read_text()
    section = text[text.index("## Surviving a dead worker"):text.index("## Messages and the ordering rule")]
    (block,) = re.findall(r"```python\n(.*?)```", section, re.S)
    script = tmp_path / "loop.py"
    script.write_text(block + "print('step', pipe.minibatches)\n")
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_outside_any_rank(),
                              capture_output=True, text=True, timeout=WAIT)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        manifest = tmp_path / "checkpoints" / "train_elastic" / "manifest.json"
        assert json.loads(manifest.read_text())["extra"] == {"step": 300}
    assert proc.stdout == "step 0\n"  # the second run found step 300 committed and gave no mini-batch


def test_a_rank_whose_peer_never_joins_is_told_why_in_one_line(tmp_path: Path) -> None:
    """Rank 0 of 2 alone (rank 1 died before joining): building the pipeline raises a PeerError after its
    timeout that names the group, the backend's reason and what to do."""
    from _ranks import free_port

    script = ("import pipecore\nfrom torch import nn\n"
              "model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))\n"
              "try:\n"
              "    pipecore.Pipeline(model, 2, '1f1b', 2, loss_fn=nn.CrossEntropyLoss(), timeout=2)\n"
              "except pipecore.PeerError as error:\n"
              "    print(error)\n")
    env = {**_outside_any_rank(), "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "TORCHELASTIC_RESTART_COUNT": "0"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=WAIT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = proc.stdout.splitlines()
    assert line.startswith("rank 0: could not connect to the other ranks while creating the default process group ("
                           ), line
    assert "another rank died or never got here" in line, line
