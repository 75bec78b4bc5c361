"""``pipecore train`` stopped by SIGINT (Ctrl-C) or SIGTERM: a real process, signalled once it has printed
progress; it saves where it stopped, says so in one line with the command that resumes, and exits 130 / 143."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from pipecore.checkpoint import load_model_weights
from pipecore.cli import main
from pipecore.cli.tasks import build_mlp

from _same import assert_same

# Small settings: 44 steps an epoch. --epochs is far more than the run gets through before the signal.
SMALL = ["--hidden", "32", "--batch-size", "32", "--no-progress"]
EPOCH_LINE = re.compile(r"^\s*\d+\s+\d+\.\d{4}\s+\d+\.\d\d%\s+\S+$")
STOPPED = re.compile(r"^pipecore train: stopped by (SIGINT|SIGTERM) at (?:epoch (\d+), step (\d+) of 44|the end of "
                     r"epoch (\d+)); checkpoint saved to (\S+); resume with: (.+)$")
WAIT = 240  # seconds: a bound on each wait (a busy machine starts torch slowly), never a measurement


class Training:
    """``python -m pipecore train ARGV`` in ``cwd``, its output read as it comes."""

    def __init__(self, cwd: Path, *argv: str) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen([sys.executable, "-m", "pipecore", "train", *argv], cwd=cwd, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                         for stream, lines in ((self.process.stdout, self.out), (self.process.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def wait_for_progress(self) -> None:
        """Until the first epoch line is printed (training is under way)."""
        deadline = time.monotonic() + WAIT
        while not any(EPOCH_LINE.match(line) for line in self.out):
            if self.process.poll() is not None:
                pytest.fail(f"training ended before printing progress:\n" + "\n".join(self.out + self.err))
            if time.monotonic() > deadline:
                self.process.kill()
                pytest.fail("no progress within the wait:\n" + "\n".join(self.out + self.err))
            time.sleep(0.05)

    def stop(self, signum: int) -> int:
        """Send ``signum`` and wait for the process to end; its exit code."""
        self.process.send_signal(signum)
        try:
            code = self.process.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            pytest.fail("the process did not stop after the signal:\n" + "\n".join(self.out + self.err))
        for reader in self._readers:
            reader.join(timeout=WAIT)
        return code


def in_process(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["train", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def test_sigint_saves_where_it_stopped_and_the_resumed_run_equals_an_uninterrupted_one(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt.pt"
    run = Training(tmp_path, "--epochs", "100", *SMALL, "--save", str(ckpt))
    run.wait_for_progress()
    code = run.stop(signal.SIGINT)
    assert code == 130, "\n".join(run.out + run.err)
    assert len(run.err) == 1, run.err  # one line, no traceback
    line = STOPPED.match(run.err[0])
    assert line, run.err[0]
    name, epoch, step, end_epoch, saved, command = line.groups()
    assert name == "SIGINT" and saved == str(ckpt)
    # The flags as given (in the parser's order), then --save and --resume the checkpoint.
    assert command == (f"pipecore train --batch-size 32 --epochs 100 --hidden 32 --no-progress "
                       f"--save {ckpt} --resume {ckpt}")
    state = load(ckpt)
    if step is not None:  # stopped part way through an epoch: the checkpoint says which step
        assert (state["epoch"], state["step"]) == (int(epoch) - 1, int(step)) and len(state["losses"]) == int(step)
    else:
        assert (state["epoch"], state["step"]) == (int(end_epoch), 0)
    assert state["epoch"] >= 1  # the epoch line came first

    # The resume command, with fewer epochs (--epochs given last wins), against the same run uninterrupted.
    epochs = str(state["epoch"] + 2)
    words = shlex.split(command)
    assert words[:2] == ["pipecore", "train"]
    code, out, err = in_process(capsys, *words[2:], "--epochs", epochs)
    assert code == 0, err
    resumed = (f"in epoch {state['epoch'] + 1}, after step {state['step']} of 44" if state["step"]
               else f"at epoch {state['epoch']}")
    assert f"resumed from {ckpt} {resumed}" in out
    reference = tmp_path / "reference.pt"
    assert in_process(capsys, "--epochs", epochs, *SMALL, "--save", str(reference))[0] == 0
    a, b = load(reference), load(ckpt)
    assert a["epoch"] == b["epoch"] == int(epochs)
    assert b["history"] == a["history"]  # the stopped epoch's loss counts its steps from both runs
    assert_same(b["pipeline"], a["pipeline"])  # 1f1b: the stop adds no flush, so training is unchanged


def test_sigterm_saves_an_asynchronous_run_that_loads_and_resumes(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt.pt"
    run = Training(tmp_path, "-a", "pipedream", "--epochs", "100", *SMALL, "--save", str(ckpt))
    run.wait_for_progress()
    assert run.stop(signal.SIGTERM) == 143
    assert len(run.err) == 1 and "Traceback" not in run.err[0], run.err
    line = STOPPED.match(run.err[0])
    assert line and line.group(1) == "SIGTERM", run.err[0]
    state = load(ckpt)
    # The live weights of every stage (the pipeline was flushed): they fill the plain model.
    model = load_model_weights(ckpt, build_mlp(64, 32, 3, 10))
    assert torch.equal(model[0].weight, state["pipeline"]["0.weight"])
    epochs = str(state["epoch"] + 1 + (state["step"] > 0))
    code, out, err = in_process(capsys, *shlex.split(line.group(6))[2:], "--epochs", epochs)
    assert code == 0, err
    assert load(ckpt)["epoch"] == int(epochs)
    assert f"saved checkpoint (epoch {epochs}) to {ckpt}" in out


def test_without_save_a_signal_stops_training_and_says_nothing_was_saved(tmp_path: Path) -> None:
    run = Training(tmp_path, "--epochs", "100", *SMALL)
    run.wait_for_progress()
    assert run.stop(signal.SIGINT) == 130
    assert len(run.err) == 1, run.err
    assert re.fullmatch(r"pipecore train: stopped by SIGINT at (epoch \d+, step \d+ of 44|the end of epoch \d+); "
                        r"nothing was saved \(pass --save PATH to keep a checkpoint\)", run.err[0]), run.err[0]
    assert list(tmp_path.iterdir()) == []


def test_a_second_sigint_undoes_the_step_in_progress_and_the_resumed_run_is_unchanged(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In process: the loss function of one micro-batch sends SIGINT twice, so the second one arrives while
    that step runs (on a stage thread; Python handles it in the main thread, inside the step or just after it).
    The checkpoint holds exactly the steps the pipeline kept, and resuming gives the uninterrupted run."""
    calls = [0]

    class SignallingLoss(torch.nn.CrossEntropyLoss):
        def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            if calls[0] == 4 * 50 + 2:  # micro-batch 2 of step 51 (epoch 2)
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGINT)
            return super().forward(output, target)

    ckpt, reference = tmp_path / "ckpt.pt", tmp_path / "reference.pt"
    monkeypatch.setattr(torch.nn, "CrossEntropyLoss", SignallingLoss)
    code, out, err = in_process(capsys, "--epochs", "3", *SMALL, "--save", str(ckpt))
    monkeypatch.undo()
    assert code == 130 and len(err.splitlines()) == 1 and STOPPED.match(err.strip()), err
    state = load(ckpt)
    assert state["epoch"] == 1 and state["step"] in (6, 7) and len(state["losses"]) == state["step"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the run's handlers are gone

    assert in_process(capsys, "--epochs", "3", *SMALL, "--resume", str(ckpt), "--save", str(ckpt))[0] == 0
    assert in_process(capsys, "--epochs", "3", *SMALL, "--save", str(reference))[0] == 0
    a, b = load(reference), load(ckpt)
    assert b["history"] == a["history"]
    assert_same(b["pipeline"], a["pipeline"])


def test_a_signal_the_process_ignores_stays_ignored() -> None:
    """``nohup pipecore train &``: a background job starts with SIGINT ignored, and Ctrl-C in the shell must not
    stop it; SIGTERM, not ignored, still gets the handler, and both are put back afterwards."""
    from pipecore.cli.train import Interrupts

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    term = signal.getsignal(signal.SIGTERM)
    try:
        with Interrupts() as interrupts:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == interrupts._handle
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is term
    finally:
        signal.signal(signal.SIGINT, previous)
