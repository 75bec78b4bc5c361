"""``pipecore train``: end to end through :func:`pipecore.cli.main` on scikit-learn's digits."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch

import pipecore
from pipecore.cli import main
from pipecore.cli.train import build_mlp, epoch_batches, stage_partition

from _same import assert_same

# Small settings keep every run well under a second of training.
SMALL = ["--hidden", "32", "--batch-size", "32", "--no-progress"]
EPOCH_LINE = re.compile(r"^\s*(\d+)\s+(\d+\.\d{4})\s+(\d+\.\d\d)%\s+(\S+)$", re.MULTILINE)


def train(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``pipecore train ARGV`` in-process; returns (exit code, stdout, stderr)."""
    code = main(["train", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def epochs_of(out: str) -> list[tuple[int, float, float, str]]:
    """(epoch, loss, accuracy %, time) of every epoch line."""
    return [(int(e), float(loss), float(acc), t) for e, loss, acc, t in EPOCH_LINE.findall(out)]


def final_accuracy(out: str) -> float:
    match = re.search(r"^test accuracy (\d+\.\d\d)% \((\d+)/360\)", out, re.MULTILINE)
    assert match, out
    return float(match.group(1)) / 100


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def test_default_run_prints_epochs_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = train(capsys, "--epochs", "2", "--no-progress")
    assert code == 0, err
    assert "digits: 1437 train / 360 test samples, 64 features, 10 classes; MLP 64-128-128-128-10" in out
    assert "1f1b: 4 stages, 4 micro-batches of 16 (batch 64, 22 steps/epoch), SGD lr 0.05 momentum 0.9" in out
    lines = epochs_of(out)
    assert [e for e, *_ in lines] == [1, 2]
    assert lines[1][1] < lines[0][1]  # the loss falls
    assert all(t.endswith("s") for *_, t in lines)
    assert "after 2 epochs" in out and re.search(r"^time \d+\.\d\ds for 2 epochs", out, re.MULTILINE)
    # The per-stage table: every stage has a Linear layer, one weight version (1F1B), no staleness.
    table = out[out.index("stage  layers"):].splitlines()
    assert len(table) == 5
    params = [8320, 16512, 16512, 1290]
    for s, row in enumerate(table[1:]):
        cells = row.split()
        assert cells[0] == str(s)
        assert cells[2] == f"{params[s]:,}" and cells[3] == "1" and cells[4] == f"{4 * params[s]:,}"
        assert cells[5] == "0.00/0" and cells[6] == "0.00/0"
    assert err == ""


def test_gpipe_learns(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = train(capsys, "--algorithm", "gpipe", "--epochs", "3", "--no-progress")
    assert code == 0
    lines = epochs_of(out)
    assert [e for e, *_ in lines] == [1, 2, 3]
    assert lines[-1][1] < 0.5 < lines[0][1]
    assert final_accuracy(out) > 0.88  # chance is 0.10
    assert final_accuracy(out) == pytest.approx(lines[-1][2] / 100)


@pytest.mark.parametrize("algorithm", pipecore.algorithm_names())
def test_every_algorithm_runs_one_epoch(capsys: pytest.CaptureFixture[str], algorithm: str) -> None:
    code, out, err = train(capsys, "--algorithm", algorithm, "--epochs", "1", *SMALL)
    assert code == 0, err
    assert [e for e, *_ in epochs_of(out)] == [1]
    assert final_accuracy(out) > 0.3
    stats_rows = out[out.index("stage  layers"):].splitlines()[1:]
    assert len(stats_rows) == 4


@pytest.mark.parametrize("algorithm", ["gpipe", "pipedream"])
def test_resume_equals_uninterrupted_run(capsys: pytest.CaptureFixture[str], tmp_path: Path, algorithm: str) -> None:
    """1 epoch + resume to 3 gives bit-identical weights and optimizer state to 3 epochs straight, for a
    synchronous and an asynchronous (weight-stashing, per-micro-batch update) algorithm."""
    args = ["--algorithm", algorithm, *SMALL]
    full, half, resumed = tmp_path / "full.pt", tmp_path / "half.pt", tmp_path / "resumed.pt"
    assert train(capsys, *args, "--epochs", "3", "--save", str(full))[0] == 0
    code, out, _ = train(capsys, *args, "--epochs", "1", "--save", str(half))
    assert code == 0 and f"saved checkpoint (epoch 1) to {half}" in out
    first = epochs_of(out)
    code, out, err = train(capsys, *args, "--epochs", "3", "--resume", str(half), "--save", str(resumed))
    assert code == 0, err
    assert f"resumed from {half} at epoch 1" in out
    lines = epochs_of(out)
    assert [e for e, *_ in lines] == [1, 2, 3]
    assert lines[0][:3] == first[0][:3] and lines[0][3] == "-"  # the saved epoch is listed, not retrained
    assert re.search(r"^time \d+\.\d\ds for 2 epochs", out, re.MULTILINE)

    a, b = load(full), load(resumed)
    assert a["epoch"] == b["epoch"] == 3
    assert [h["epoch"] for h in b["history"]] == [1, 2, 3]
    assert b["history"] == a["history"]
    keys = [k for k in a["pipeline"] if k != "pipecore"]
    assert keys == [k for k in b["pipeline"] if k != "pipecore"] and len(keys) == 8
    for key in keys:
        assert torch.equal(a["pipeline"][key], b["pipeline"][key]), key
    # Versions, update counts and optimizer state (momentum) agree too.
    assert_same(a["pipeline"]["pipecore"], b["pipeline"]["pipecore"])
    # The live weights moved in training: the comparison is not between two untouched initialisations.
    assert not torch.equal(a["pipeline"][keys[0]], load(half)["pipeline"][keys[0]])


def test_resume_rejects_other_settings_and_finished_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt.pt"
    assert train(capsys, "--epochs", "1", *SMALL, "--save", str(ckpt))[0] == 0
    code, _, err = train(capsys, "--epochs", "2", "--hidden", "64", "--batch-size", "32", "--resume", str(ckpt))
    assert code == 2 and err.strip() == (
        "pipecore train: error: the checkpoint was trained with --hidden 32; resume with the same settings"
    )
    code, _, err = train(capsys, "--epochs", "1", *SMALL, "--resume", str(ckpt))
    assert code == 2 and "already trained 1 epoch" in err and len(err.strip().splitlines()) == 1
    code, out, _ = train(capsys, "--epochs", "2", *SMALL, "--lr", "0.01", "--resume", str(ckpt))
    assert code == 0 and "note: --lr 0.01 differs from the checkpoint's 0.05" in out


def test_a_save_that_fails_leaves_the_previous_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = tmp_path / "ckpt.pt"
    assert train(capsys, "--epochs", "1", *SMALL, "--save", str(ckpt))[0] == 0
    before = ckpt.read_bytes()

    def save_part_then_fail(obj: object, f: io.BufferedWriter) -> None:
        f.write(before[:100])
        raise RuntimeError("No space left on device")

    monkeypatch.setattr(torch, "save", save_part_then_fail)
    code, _, err = train(capsys, "--epochs", "2", *SMALL, "--resume", str(ckpt), "--save", str(ckpt))
    assert code == 2 and f"cannot write {ckpt}: No space left on device" in err, err
    assert ckpt.read_bytes() == before  # not truncated: the old checkpoint still resumes
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # and nothing else is left behind


def test_plot_writes_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "curve.png"
    code, out, _ = train(capsys, "--epochs", "2", *SMALL, "--plot", str(png))
    assert code == 0 and f"wrote loss and accuracy curves to {png}" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_progress_bar_on_a_terminal(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for flag, shown in (([], True), (["--no-progress"], False)):
        terminal = Terminal()
        monkeypatch.setattr("sys.stderr", terminal)
        assert main(["train", "--epochs", "1", "--hidden", "32", "--batch-size", "32", *flag]) == 0
        assert ("epoch 1/1: " in terminal.getvalue() and "/44 [" in terminal.getvalue()) is shown
    capsys.readouterr()


def test_pipemare_warmup_defaults_to_five_epochs(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = train(capsys, "--algorithm", "pipemare", "--epochs", "1", *SMALL)
    # 44 steps per epoch, one update per mini-batch (update_every = M = 4).
    assert code == 0 and "pipemare warmup_steps=220 (5 epochs of updates)" in out
    code, out, _ = train(capsys, "-a", "pipemare", "-e", "1", *SMALL, "--option", "warmup_steps=7", "-o", "D=0.2")
    assert code == 0 and "warmup_steps" not in out
    code, out, _ = train(capsys, "-a", "pipemare", "-e", "1", *SMALL, "-o", "update_every=2")
    assert code == 0 and "pipemare warmup_steps=440" in out and "SGD lr 0.025 " in out


def test_default_lr_scales_with_updates_per_minibatch(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = train(capsys, "--algorithm", "pipedream", "--epochs", "1", *SMALL)
    assert code == 0 and "SGD lr 0.0125 momentum 0.9" in out  # 4 updates per mini-batch: 0.05 / 4
    code, out, _ = train(capsys, "--optimizer", "adamw", "--epochs", "1", *SMALL)
    assert code == 0 and "AdamW lr 0.001," in out


def test_threads_are_set_and_restored(capsys: pytest.CaptureFixture[str]) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        code, out, _ = train(capsys, "--epochs", "1", *SMALL)
        assert code == 0 and ", 1 thread\n" in out  # the default
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("argv, message", [
    (["--algorithm", "nope"], "unknown algorithm 'nope'"),
    (["--batch-size", "30"], "--batch-size 30 is not divisible by --microbatches 4"),
    (["--batch-size", "4096"], "larger than the training set (1437 samples)"),
    (["--algorithm", "2bw", "--microbatches", "2"], "2bw: needs n_microbatches >= num_stages"),
    (["--option", "foo=1"], "unknown option(s) ['foo']"),
    (["--option", "foo"], "expected KEY=VALUE"),
    (["--stages", "5", "--depth", "2"], "--stages 5 needs at least 5 Linear layers"),
    (["--epochs", "0"], "must be an integer >= 1"),
    (["--lr", "-1"], "must be a positive number"),
    (["--resume", "does-not-exist.pt"], "no such file"),
    (["--save", "no-such-dir/ckpt.pt"], "--save: the directory of no-such-dir/ckpt.pt does not exist"),
])
def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, out, err = train(capsys, *argv, "--epochs", "1") if "--epochs" not in argv else train(capsys, *argv)
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("pipecore")]
    assert len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err and "epoch" not in out


def test_under_torchrun_the_stages_must_match_the_processes(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, _, err = train(capsys, "--stages", "4", "--epochs", "1")
    assert code == 2 and err.strip() == (
        "pipecore train: error: --stages 4 but torchrun started 2 processes: pipecore runs one process per stage; "
        "pass --stages 2 or --nproc-per-node 4")


def test_partition_gives_every_stage_a_linear_layer() -> None:
    model = build_mlp(64, 32, 3, 10)  # a plain parameter balance would give stage 1 only a ReLU
    points = stage_partition(model, 4)
    assert points == [2, 4, 6]
    bounds = list(zip([0] + points, points + [len(model)]))
    assert all(isinstance(model[a], torch.nn.Linear) for a, _ in bounds)
    deep = build_mlp(64, 128, 8, 10)
    assert len(stage_partition(deep, 9)) == 8


def test_epoch_batches_depend_only_on_seed_and_epoch() -> None:
    a, b = epoch_batches(100, 32, seed=3, epoch=2), epoch_batches(100, 32, seed=3, epoch=2)
    assert len(a) == 3 and all(len(x) == 32 for x in a)  # the partial batch of 4 is dropped
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], epoch_batches(100, 32, seed=3, epoch=3)[0])
    assert len(set(torch.cat(a).tolist())) == 96
