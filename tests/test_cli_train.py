"""``pipecore train``: end to end through :func:`pipecore.cli.main` on scikit-learn's digits."""

from __future__ import annotations

import io
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pipecore
from pipecore.cli import main
from pipecore.cli import train as train_command
from pipecore.cli.report import layers_cell
from pipecore.cli.tasks import build_mlp, epoch_batches, held_out_windows, resolve_defaults, stage_partition

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


def test_a_batch_that_does_not_divide_into_micro_batches_trains(capsys: pytest.CaptureFixture[str]) -> None:
    """Batch 30 in 4 micro-batches: sizes 8, 8, 7, 7 as torch.tensor_split gives them (the step equals the
    plain mean over the batch; tests/test_batches.py checks that exactly)."""
    code, out, err = train(capsys, "--epochs", "2", "--hidden", "32", "--batch-size", "30", "--no-progress")
    assert code == 0, err
    assert "1f1b: 4 stages, 4 micro-batches of 7-8 (batch 30, 47 steps/epoch)" in out
    lines = epochs_of(out)
    assert [e for e, *_ in lines] == [1, 2] and lines[1][1] < lines[0][1]


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
    # 44 steps per epoch, one update per micro-batch (update_every = 1, M = 4): 176 updates per epoch.
    assert code == 0 and "pipemare warmup_steps=880 (5 epochs of updates)" in out and "SGD lr 0.0125 " in out
    code, out, _ = train(capsys, "-a", "pipemare", "-e", "1", *SMALL, "--option", "warmup_steps=7", "-o", "D=0.2")
    assert code == 0 and "warmup_steps" not in out
    code, out, _ = train(capsys, "-a", "pipemare", "-e", "1", *SMALL, "-o", "update_every=2")
    assert code == 0 and "pipemare warmup_steps=440" in out and "SGD lr 0.025 " in out


def test_a_cosine_schedule_decays_to_zero_and_resumes_exactly(capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path) -> None:
    from pipecore.cli.train import cosine_decay

    assert cosine_decay(10, 0) == 1.0 and cosine_decay(10, 5) == pytest.approx(0.5) and cosine_decay(10, 10) == 0.0
    assert cosine_decay(10, 12) == 0.0
    args = ["--algorithm", "pipedream", "--lr-schedule", "cosine", *SMALL]
    full, half, resumed = tmp_path / "full.pt", tmp_path / "half.pt", tmp_path / "resumed.pt"
    code, out, _ = train(capsys, *args, "--epochs", "2", "--save", str(full))
    # 44 steps per epoch, pipedream updates after each of the 4 micro-batches: 352 updates per stage in 2 epochs.
    assert code == 0 and "cosine learning rate over 352 updates per stage" in out
    meta = load(full)["pipeline"]["pipecore"]["stages"]
    for s, stage in meta.items():  # the rate of each stage's last update, on its own update count
        assert stage["lr"] == 0.0125 * cosine_decay(352, stage["updates"] - 1)
    # Resumed, the schedule goes on from the update count the checkpoint holds (--epochs is the total: the
    # first run's cosine spanned its 1 epoch, the resumed one spans 2).
    assert train(capsys, *args, "--epochs", "1", "--save", str(half))[0] == 0
    code, out, err = train(capsys, *args, "--epochs", "2", "--resume", str(half), "--save", str(resumed))
    assert code == 0, err
    for s, stage in load(resumed)["pipeline"]["pipecore"]["stages"].items():
        assert stage["updates"] == meta[s]["updates"]
        assert stage["lr"] == 0.0125 * cosine_decay(352, stage["updates"] - 1)
    code, out, _ = train(capsys, "--algorithm", "pipedream", *SMALL, "--epochs", "3", "--resume", str(half))
    assert code == 0 and "note: --lr-schedule constant differs from the checkpoint's cosine" in out


def test_clip_bounds_every_update_and_is_noted_on_resume(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ckpt, clipped = tmp_path / "plain.pt", tmp_path / "clipped.pt"
    assert train(capsys, "--epochs", "1", *SMALL, "--save", str(ckpt))[0] == 0
    code, out, err = train(capsys, "--epochs", "1", *SMALL, "--clip", "0.001", "--save", str(clipped))
    assert code == 0, err
    # The same seed and data: only the clipping (at every update, with a norm this small) tells them apart.
    plain, small = load(ckpt)["pipeline"], load(clipped)["pipeline"]
    assert any(not torch.equal(plain[k], small[k]) for k in plain if k != "pipecore")
    code, out, _ = train(capsys, "--epochs", "2", *SMALL, "--resume", str(ckpt), "--clip", "0.5")
    assert code == 0 and "note: --clip 0.5 differs from the checkpoint's None" in out
    code, _, err = train(capsys, "--epochs", "1", *SMALL, "--clip", "0")
    assert code == 2 and "--clip" in err


def test_bf16_runs_the_forwards_under_autocast(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plain, mixed = tmp_path / "plain.pt", tmp_path / "bf16.pt"
    assert train(capsys, "--epochs", "1", *SMALL, "--save", str(plain))[0] == 0
    code, out, err = train(capsys, "--epochs", "1", *SMALL, "--bf16", "--save", str(mixed))
    assert code == 0, err
    assert "forwards under bfloat16 autocast" in out and final_accuracy(out) > 0.5
    a, b = load(plain)["pipeline"], load(mixed)["pipeline"]
    keys = [k for k in a if k != "pipecore"]
    assert all(b[k].dtype == torch.float32 for k in keys)  # the weights stay float32
    assert any(not torch.equal(a[k], b[k]) for k in keys)  # the arithmetic was not


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
    (["--batch-size", "3"], "--batch-size 3 is smaller than --microbatches 4"),
    (["--batch-size", "4096"], "larger than the training set (1437 samples)"),
    (["--algorithm", "2bw", "--microbatches", "2"], "2bw: needs n_microbatches >= num_stages"),
    (["--option", "foo=1"], "unknown option(s) ['foo']"),
    (["--option", "foo"], "expected KEY=VALUE"),
    (["--stages", "5", "--depth", "2"], "--stages 5 needs at least 5 Linear layers, the MLP has 3 (--depth 2)"),
    # The MLP's depth does not follow --stages: the default (3) has 4 Linear layers.
    (["--stages", "5"], "--stages 5 needs at least 5 Linear layers, the MLP has 4 (--depth 3); raise --depth to 4 "
                        "or more, or lower --stages"),
    (["--save-every", "2"], "--save-every 2 needs --save PATH"),
    (["--epochs", "0"], "must be an integer >= 1"),
    (["--lr", "-1"], "must be a positive number"),
    (["--resume", "does-not-exist.pt"], "no such file"),
    (["--save", "no-such-dir/ckpt.pt"], "--save: the directory of no-such-dir/ckpt.pt does not exist"),
])
def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, out, err = train(capsys, *argv, "--epochs", "1") if "--epochs" not in argv else train(capsys, *argv)
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipecore train: error: ") and message in lines[0], err
    assert "epoch" not in out


def test_under_torchrun_the_stages_must_match_the_processes(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A configuration error is the same on every rank: rank 0 alone prints it and exits with 2 (a launch that did
    not train must not look like one that did); the other ranks exit quietly with 0."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, out, err = train(capsys, "--stages", "4", "--epochs", "1")
    assert (code, out) == (2, "") and err == (
        "pipecore train: error: --stages 4 but torchrun started 2 processes: pipecore runs one process per stage "
        "of each replica of the pipeline, so the processes must be a multiple of 4; pass --nproc-per-node 4 (or a "
        "multiple, with --data-parallel)\n")
    code, _, err = train(capsys, "--stages", "2", "--data-parallel", "2", "--epochs", "1")
    assert code == 2 and "--stages 2 and --data-parallel 2 need 4 processes but torchrun started 2" in err
    code, _, err = train(capsys, "--epochs", "0")  # the command line's own errors too
    assert code == 2 and err.startswith("pipecore train: error: argument -e/--epochs: must be an integer >= 1")
    monkeypatch.setenv("RANK", "1")
    assert train(capsys, "--stages", "4", "--epochs", "1") == (0, "", "")
    assert train(capsys, "--epochs", "0") == (0, "", "")


def test_under_torchrun_errors_a_rank_meets_alone_are_its_own(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    """A file that a rank cannot read may be there for the others (another node): each rank says so itself."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, _, err = train(capsys, "--stages", "2", "--epochs", "1", "--resume", str(tmp_path / "missing.pt"))
    assert code == 2 and err.startswith("pipecore train: error: ") and "missing.pt" in err


def test_a_configuration_error_under_torchrun_is_one_line_from_rank_0_and_a_failed_launch(tmp_path: Path) -> None:
    """pipecore's own output is the one line, from rank 0, with no traceback of pipecore's; the launch fails (torchrun
    exits non-zero and summarises its failed workers, which is its own output)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("TORCHELASTIC")}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "pipecore", "train", "--stages", "3"], cwd=tmp_path,
                         env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
    assert run.returncode != 0, run.stdout + run.stderr
    ours = [line for line in run.stderr.splitlines() if line.startswith("pipecore train")]
    assert ours == ["pipecore train: error: --stages 3 but torchrun started 2 processes: pipecore runs one process "
                    "per stage of each replica of the pipeline, so the processes must be a multiple of 3; pass "
                    "--nproc-per-node 3 (or a multiple, with --data-parallel)"], run.stderr
    assert "pipecore/cli" not in run.stderr and "pipecore/engine" not in run.stderr, run.stderr  # no frame of ours
    assert "exitcode  : 2" in run.stderr, run.stderr


def test_under_torchrun_the_stages_default_to_the_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipecore.cli import build_parser

    def stages(*argv: str) -> int:
        args = build_parser().parse_args(["train", *argv])
        resolve_defaults(args)
        return args.stages

    assert stages() == 4
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert stages() == 4  # WORLD_SIZE without RANK is not torchrun
    monkeypatch.setenv("RANK", "1")
    assert stages() == 3 and stages("--stages", "2") == 2  # given, it is checked against the processes instead


def test_the_mlp_depth_does_not_follow_the_stages(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = train(capsys, "--stages", "2", "--epochs", "1", *SMALL)
    assert code == 0, err
    assert "MLP 64-32-32-32-10" in out  # --depth 3 whatever --stages
    code, out, err = train(capsys, "--stages", "6", "--depth", "5", "--epochs", "1", *SMALL)
    assert code == 0 and "MLP 64-32-32-32-32-32-10" in out, err


def test_resume_with_other_stages_microbatches_and_algorithm(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    """The checkpoint maps by parameter name: 1f1b continued on 2 stages equals 4 stages straight (to float32
    round-off); an asynchronous algorithm with other micro-batches continues at its own --lr."""
    full, half, two = tmp_path / "full.pt", tmp_path / "half.pt", tmp_path / "two.pt"
    assert train(capsys, "--epochs", "2", *SMALL, "--save", str(full))[0] == 0
    assert train(capsys, "--epochs", "1", *SMALL, "--save", str(half))[0] == 0
    code, out, err = train(capsys, "--epochs", "2", *SMALL, "--stages", "2", "--resume", str(half), "--save", str(two))
    assert code == 0, err
    assert "note: --stages 2 differs from the checkpoint's 4" in out and "1f1b: 2 stages" in out
    a, b = load(full)["pipeline"], load(two)["pipeline"]
    for key in [k for k in a if k != "pipecore"]:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5)
    assert not torch.equal(b["0.weight"], load(half)["pipeline"]["0.weight"])

    code, out, err = train(capsys, "--epochs", "2", *SMALL, "-a", "pipedream", "--stages", "3", "-m", "2",
                           "--resume", str(half), "--save", str(two))
    assert code == 0, err
    for note in ("--algorithm pipedream differs from the checkpoint's 1f1b", "--stages 3 differs",
                 "--microbatches 2 differs", "--lr 0.025 differs from the checkpoint's 0.05"):
        assert f"note: {note}" in out
    stages = load(two)["pipeline"]["pipecore"]["stages"]
    assert len(stages) == 3 and all(st["lr"] == 0.025 for st in stages.values())  # the run's rate, not the saved one
    assert final_accuracy(out) > 0.8


def test_save_every_saves_after_every_n_epochs(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt, straight = tmp_path / "ckpt.pt", tmp_path / "straight.pt"
    written = []
    real = train_command.write_checkpoint

    def keep(path: str, ckpt: dict) -> None:
        real(path, ckpt)
        written.append(load(Path(path)))

    monkeypatch.setattr(train_command, "write_checkpoint", keep)
    code, out, err = train(capsys, "--epochs", "5", *SMALL, "--save", str(ckpt), "--save-every", "2")
    assert code == 0, err
    assert [c["epoch"] for c in written] == [2, 4, 5]
    assert [line for line in out.splitlines() if line.startswith("saved checkpoint")] == [
        f"saved checkpoint (epoch {e}) to {ckpt}" for e in (2, 4, 5)]
    assert train(capsys, "--epochs", "2", *SMALL, "--save", str(straight))[0] == 0
    assert_same(written[0]["pipeline"], load(straight)["pipeline"])  # the epoch-2 save is a 2-epoch run's


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


# -- --model gpt and --model resnet ------------------------------------------------------------------------

# A tiny GPT: 2 stages of one block each, short windows; 30 steps an epoch take about half a second.
TINY_GPT = ["--model", "gpt", "--stages", "2", "--layers", "2", "--embd", "32", "--heads", "2", "--block-size", "16",
            "--batch-size", "16", "--steps-per-epoch", "30", "--eval-windows", "16", "--no-progress"]
GPT_LINE = re.compile(r"^\s*(\d+)\s+(\d+\.\d{4})\s+(\d+\.\d{4})\s+(\d+\.\d\d)\s+(\S+)$", re.MULTILINE)


def gpt_epochs_of(out: str) -> list[tuple[int, float, float, float, str]]:
    """(epoch, training loss, held-out loss, held-out perplexity, time) of every epoch line of a gpt run."""
    return [(int(e), float(a), float(b), float(c), t) for e, a, b, c, t in GPT_LINE.findall(out)]


def final_perplexity(out: str) -> tuple[float, float]:
    match = re.search(r"^held-out perplexity (\d+\.\d\d) \(loss (\d+\.\d{4}) per character, 16 windows of 16\) "
                      r"after \d+ epochs?$", out, re.MULTILINE)
    assert match, out
    return float(match.group(1)), float(match.group(2))


def test_gpt_learns_and_reports_perplexity(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "gpt.png"
    code, out, err = train(capsys, *TINY_GPT, "--epochs", "2", "--plot", str(png))
    assert code == 0, err
    assert re.search(r"^text: Python's help topics, [\d,]+ train / [\d,]+ held-out characters, vocabulary \d+; "
                     r"GPT 2 layers, 2 heads, embd 32, block 16, [\d,]+ parameters$", out, re.MULTILINE), out
    # AdamW is the gpt's default optimizer; 1f1b updates once per mini-batch, so the lr is not scaled.
    assert "1f1b: 2 stages, 4 micro-batches of 4 (batch 16, 30 steps/epoch), AdamW lr 0.001, seed 0" in out
    assert "epoch      loss  test loss  test ppl    time" in out
    lines = gpt_epochs_of(out)
    assert [e for e, *_ in lines] == [1, 2]
    for _, _, test_loss, ppl, seconds in lines:
        assert ppl == pytest.approx(math.exp(test_loss), rel=1e-3) and seconds.endswith("s")
    assert lines[1][1] < lines[0][1] and lines[1][2] < lines[0][2]  # training and held-out loss fall
    assert lines[0][3] < 60  # from about the vocabulary size (~100) at initialisation
    ppl, loss = final_perplexity(out)
    assert (ppl, loss) == (lines[-1][3], lines[-1][2])
    assert "test accuracy" not in out and re.search(r"^time \d+\.\d\ds for 2 epochs \([\d,]+ windows/s", out, re.MULTILINE)
    # The per-stage table names the stages' top-level modules; the tied head sits in the last stage.
    table = out[out.index("stage  layers"):].splitlines()
    assert table[1].split()[:2] == ["0", "tok_emb,pos_emb,drop,blocks.0"]
    assert table[2].split()[:2] == ["1", "blocks.1,ln_f,head"]
    assert f"wrote loss and perplexity curves to {png}" in out and png.read_bytes()[:4] == b"\x89PNG"


def test_gpt_resume_equals_uninterrupted_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Epochs are a function of (seed, epoch): 1 epoch + resume to 2 prints and saves what 2 straight do,
    here with an asynchronous algorithm (weight stashing, an update per micro-batch)."""
    args = [*TINY_GPT, "--algorithm", "pipedream", "--steps-per-epoch", "10"]
    full, half, resumed = tmp_path / "full.pt", tmp_path / "half.pt", tmp_path / "resumed.pt"
    code, straight, err = train(capsys, *args, "--epochs", "2", "--save", str(full))
    assert code == 0, err
    assert train(capsys, *args, "--epochs", "1", "--save", str(half))[0] == 0
    code, out, err = train(capsys, *args, "--epochs", "2", "--resume", str(half), "--save", str(resumed))
    assert code == 0, err
    assert f"resumed from {half} at epoch 1" in out
    assert [line[:4] for line in gpt_epochs_of(out)] == [line[:4] for line in gpt_epochs_of(straight)]
    assert gpt_epochs_of(out)[0][4] == "-"
    assert final_perplexity(out) == final_perplexity(straight)
    a, b = load(full), load(resumed)
    assert a["history"] == b["history"] and a["args"]["model"] == "gpt" and a["args"]["block_size"] == 16
    assert_same(a["pipeline"], b["pipeline"])
    # The size flags are fixed by the checkpoint.
    code, _, err = train(capsys, *args, "--epochs", "3", "--embd", "16", "--resume", str(half))
    assert code == 2 and "the checkpoint was trained with --embd 32; resume with the same settings" in err


def test_resnet_learns_on_two_stages(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = train(capsys, "--model", "resnet", "--stages", "2", "--epochs", "2", "--no-progress")
    assert code == 0, err
    assert "digits: 1437 train / 360 test samples, 64 features, 10 classes; ResNet width 16, 3 blocks, " in out
    assert "1f1b: 2 stages, 4 micro-batches of 16 (batch 64, 22 steps/epoch), SGD lr 0.05 momentum 0.9" in out
    lines = epochs_of(out)
    assert [e for e, *_ in lines] == [1, 2] and lines[1][1] < lines[0][1]
    assert final_accuracy(out) > 0.3  # chance is 0.10
    assert final_accuracy(out) == pytest.approx(lines[-1][2] / 100)
    table = out[out.index("stage  layers"):].splitlines()
    assert [row.split()[0] for row in table[1:]] == ["0", "1"]


def test_resume_across_models_and_from_checkpoints_before_model(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt.pt"
    assert train(capsys, "--epochs", "1", *SMALL, "--save", str(ckpt))[0] == 0
    code, _, err = train(capsys, *TINY_GPT, "--epochs", "2", "--resume", str(ckpt))
    assert code == 2 and err.strip() == (
        "pipecore train: error: the checkpoint was trained with --model mlp; resume with the same settings")
    # A checkpoint written before --model existed has none of the new settings: it is an MLP's.
    old = load(ckpt)
    old["args"] = {k: v for k, v in old["args"].items() if k in
                   ("algorithm", "stages", "microbatches", "batch_size", "epochs", "lr", "optimizer", "hidden",
                    "depth", "seed", "option")}
    torch.save(old, ckpt)
    code, out, err = train(capsys, "--epochs", "2", *SMALL, "--resume", str(ckpt))
    assert code == 0 and "note:" not in out, err + out


@pytest.mark.parametrize("argv, message", [
    (["--model", "foo"], "argument --model: invalid choice: 'foo'"),
    (["--model", "gpt", "--hidden", "32"], "--hidden applies to --model mlp, not --model gpt"),
    (["--layers", "2"], "--layers applies to --model resnet and --model gpt, not --model mlp"),
    (["--model", "resnet", "--embd", "32"], "--embd applies to --model gpt, not --model resnet"),
    (["--model", "gpt", "--heads", "3"], "--embd 64 is not divisible by --heads 3"),
    (["--model", "gpt", "--block-size", "10000000"], "--block-size 10000000 is longer than the held-out text"),
    (["--model", "resnet", "--stages", "20"], "--stages 20: the resnet can be cut into at most"),
    (["--model", "gpt", "--batch-size", "3"], "--batch-size 3 is smaller than --microbatches 4"),
])
def test_bad_model_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, out, err = train(capsys, *argv, "--epochs", "1")
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("pipecore")]
    assert len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err and "epoch" not in out


def test_layers_cell_names_top_level_modules_and_abbreviates() -> None:
    assert layers_cell(["0", "1"]) == "0,1"  # the MLP's layers, as before
    gpt0 = ["tok_emb", "pos_emb", "drop", "blocks.0.ln1", "blocks.0.attn", "blocks.0.attn.qkv", "blocks.0"]
    assert layers_cell(gpt0) == "tok_emb,pos_emb,drop,blocks.0"
    assert layers_cell(gpt0 + ["blocks.1.ln1", "blocks.1"]) == "tok_emb..blocks.1 (5)"
    assert layers_cell([]) == "-"


def test_held_out_windows_are_spread_over_the_text() -> None:
    data = torch.arange(1001)
    x, y = held_out_windows(data, 10, 5)
    assert x.shape == (5, 10) and torch.equal(y, x + 1)
    assert x[:, 0].tolist() == [0, 250, 500, 740, 990]  # windows 0, 25, 50, 74, 99 of 100
    assert held_out_windows(data, 10, 1000)[0].shape == (100, 10)


def test_gpt_under_torchrun_matches_one_process(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """One process per stage: the ranks evaluate through pipe.predict (each its stage, the tied head on the
    last rank) and rank 0 reports what the one-process run reports; the checkpoints agree."""
    args = [*TINY_GPT, "--algorithm", "pipedream", "--steps-per-epoch", "10", "--epochs", "2"]
    code, alone, err = train(capsys, *args, "--save", str(tmp_path / "alone.pt"))
    assert code == 0, err
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("TORCHELASTIC")}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "pipecore", "train", *args, "--save", str(tmp_path / "ranks.pt")],
                         cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    ranks = run.stdout
    assert ranks.count("epoch      loss  test loss") == 1 and "one process per rank: 2 ranks (gloo)" in ranks, ranks
    assert [line[:4] for line in gpt_epochs_of(ranks)] == [line[:4] for line in gpt_epochs_of(alone)]
    assert final_perplexity(ranks) == final_perplexity(alone)
    a, b = load(tmp_path / "alone.pt"), load(tmp_path / "ranks.pt")
    assert_same(b["pipeline"], a["pipeline"])
    assert b["history"] == a["history"]


def test_stages_per_rank_runs_an_interleaved_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = train(capsys, "--algorithm", "interleaved-1f1b", "--stages", "8", "--stages-per-rank", "2",
                           "--depth", "8", "--epochs", "1", *SMALL)
    assert code == 0, err
    assert len(out[out.index("stage  layers"):].splitlines()[1:]) == 8
    # Synchronous: the same training as 1F1B over the same 8 stages, one per rank.
    code, plain, err = train(capsys, "--algorithm", "1f1b", "--stages", "8", "--depth", "8", "--epochs", "1", *SMALL)
    assert code == 0, err
    assert [e[:3] for e in epochs_of(out)] == [e[:3] for e in epochs_of(plain)]
    assert final_accuracy(out) == final_accuracy(plain)


def test_stages_per_rank_is_refused_where_it_does_not_apply(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = train(capsys, "--algorithm", "1f1b", "--stages-per-rank", "2", "--epochs", "1", *SMALL)
    assert code != 0 and "runs one stage per rank" in err
    # Under torchrun the processes are the ranks: 3 processes cannot run 4 stages two per rank.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    code, _, err = train(capsys, "--algorithm", "zb-v", "--stages", "4", "--epochs", "1", *SMALL)
    assert code == 2  # the same error on every rank: rank 0 prints it and exits with 2, the others quietly
    assert "torchrun started 3 processes: pipecore runs one process per rank (2 stages each)" in err
    assert "--nproc-per-node 2" in err


def test_data_parallel_under_torchrun_matches_one_process(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """4 processes, --stages 2: two replicas of a 2-stage pipeline (--data-parallel 2 inferred), each training on
    half of every mini-batch; with 1f1b (an update per mini-batch) the run reports what one process reports."""
    args = ["--algorithm", "1f1b", "--stages", "2", "--epochs", "1", *SMALL]
    code, alone, err = train(capsys, *args)
    assert code == 0, err
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("TORCHELASTIC")}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          "-m", "pipecore", "train", *args], cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "one process per rank: 2 ranks x 2 replicas (gloo)" in run.stdout, run.stdout
    assert [e[:3] for e in epochs_of(run.stdout)] == [e[:3] for e in epochs_of(alone)]
    assert final_accuracy(run.stdout) == final_accuracy(alone)


def test_nadam_trains_the_nesterov_method_as_its_paper_does(capsys: pytest.CaptureFixture[str]) -> None:
    """``--optimizer nadam`` is torch.optim.NAdam's update (pipecore.NAdam): with nesterov-async, the Nesterov method
    of asynchronous pipelines, it learns the digits within 3 epochs; the header names the optimizer."""
    code, out, err = train(capsys, "--algorithm", "nesterov-async", "--optimizer", "nadam", "--epochs", "3", *SMALL)
    assert code == 0, err
    assert "NAdam lr 0.00025" in out  # 1e-3 per mini-batch, taken a quarter per micro-batch update
    assert final_accuracy(out) > 0.7  # chance is 0.1
