"""Checkpoint files: the manifest commits a save, so a failed save never leaves a mix of stages behind."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import pipecore
from pipecore import checkpoint
from pipecore.checkpoint import CheckpointError


def make_pipeline(algorithm: str = "pipedream") -> pipecore.Pipeline:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    return pipecore.Pipeline(model, 3, algorithm, 2, optimizer=pipecore.SGD(lr=0.1, momentum=0.9),
                             loss_fn=nn.CrossEntropyLoss())


def train(pipe: pipecore.Pipeline, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        pipe.step(torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g))
    pipe.flush()


def weights(pipe: pipecore.Pipeline) -> dict[str, torch.Tensor]:
    return {k: v for k, v in pipe.state_dict().items() if k != "pipecore"}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def files(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def committed(directory) -> list[str]:
    return json.loads((directory / checkpoint.MANIFEST).read_text())["files"]


def failing_after(calls: int, monkeypatch) -> None:
    """Make torch.save fail (disk full) from its ``calls+1``-th call on."""
    real, count = torch.save, [0]

    def save(obj, f, *args, **kwargs):
        count[0] += 1
        if count[0] > calls:
            raise OSError(28, "No space left on device")
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def test_a_save_replaces_the_previous_one_and_deletes_its_files(tmp_path):
    pipe = make_pipeline()
    train(pipe, 2, seed=1)
    checkpoint.save(pipe, tmp_path)
    first = committed(tmp_path)
    train(pipe, 2, seed=2)
    checkpoint.save(pipe, tmp_path)
    second = committed(tmp_path)
    assert len(second) == 3 and not set(first) & set(second)
    assert files(tmp_path) == sorted([checkpoint.MANIFEST] + second)
    resumed = make_pipeline()
    checkpoint.load(resumed, tmp_path)
    assert_same(weights(resumed), weights(pipe))


def test_a_save_that_fails_part_way_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    pipe = make_pipeline()
    train(pipe, 2, seed=1)
    checkpoint.save(pipe, tmp_path)
    before, saved = committed(tmp_path), weights(pipe)
    train(pipe, 2, seed=2)
    failing_after(1, monkeypatch)  # stage 0's file is written, stage 1's is not
    with pytest.raises(CheckpointError, match="No space left on device"):
        checkpoint.save(pipe, tmp_path)
    monkeypatch.undo()
    assert committed(tmp_path) == before
    resumed = make_pipeline()
    checkpoint.load(resumed, tmp_path)
    assert_same(weights(resumed), saved)
    assert not any(torch.equal(saved[k], v) for k, v in weights(pipe).items() if k.endswith("weight"))
    # The failed save removed what it had written.
    assert files(tmp_path) == sorted([checkpoint.MANIFEST] + before)


def test_a_save_whose_manifest_cannot_be_replaced_removes_its_files(tmp_path, monkeypatch):
    pipe = make_pipeline()
    train(pipe, 1, seed=1)
    checkpoint.save(pipe, tmp_path)
    before = committed(tmp_path)
    train(pipe, 1, seed=2)

    def replace(src, dst):
        raise PermissionError(13, "Permission denied", dst)

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    with pytest.raises(CheckpointError, match="writing the manifest.*Permission denied"):
        checkpoint.save(pipe, tmp_path)
    monkeypatch.undo()
    assert committed(tmp_path) == before
    assert files(tmp_path) == sorted([checkpoint.MANIFEST] + before)


def test_the_next_save_removes_what_a_killed_save_left(tmp_path):
    pipe = make_pipeline()
    train(pipe, 1, seed=1)
    checkpoint.save(pipe, tmp_path)
    for name in ("stage000-0badf00d.pt", "manifest.json.0badf00d.tmp", "stage001.pt", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    checkpoint.save(pipe, tmp_path)
    assert files(tmp_path) == sorted([checkpoint.MANIFEST, "notes.txt"] + committed(tmp_path))


def test_a_first_save_that_fails_leaves_no_checkpoint(tmp_path, monkeypatch):
    pipe = make_pipeline()
    train(pipe, 1, seed=1)
    failing_after(2, monkeypatch)
    with pytest.raises(CheckpointError, match="No space left on device"):
        checkpoint.save(pipe, tmp_path)
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match="manifest.json is missing"):
        checkpoint.load(make_pipeline(), tmp_path)


def test_saving_with_backwards_in_flight_writes_nothing(tmp_path):
    pipe = make_pipeline()
    pipe.step(torch.randn(4, 4, dtype=torch.float64), torch.randint(0, 3, (4,)))
    assert pipe.in_flight
    with pytest.raises(CheckpointError, match="in flight; call flush"):
        checkpoint.save(pipe, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_a_checkpoint_loads_into_another_stage_count_but_not_into_another_model(tmp_path):
    """Stage files map by parameter name into any number of stages (tests/test_universal_checkpoint.py has the
    exact comparisons); a model whose parameters the checkpoint does not name is refused, naming them."""
    pipe = make_pipeline()
    train(pipe, 1, seed=1)
    checkpoint.save(pipe, tmp_path)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    two = pipecore.Pipeline(model, 2, "1f1b", 4, optimizer=pipecore.SGD(lr=0.1, momentum=0.9),
                            loss_fn=nn.CrossEntropyLoss())
    checkpoint.load(two, tmp_path)
    assert_same(weights(two), weights(pipe))
    torch.manual_seed(0)
    other = pipecore.Pipeline(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double(), 2, "pipedream", 2,
                              optimizer=pipecore.SGD(lr=0.1, momentum=0.9), loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(KeyError, match=r"unexpected keys \['4.bias', '4.weight'\]"):
        checkpoint.load(other, tmp_path)


def test_write_atomically_replaces_a_file_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "state.bin"
    checkpoint.write_atomically(path, lambda f: f.write(b"old"))
    checkpoint.write_atomically(path, lambda f: f.write(b"new"))
    assert path.read_bytes() == b"new" and files(tmp_path) == ["state.bin"]

    def fail_part_way(f):
        f.write(b"ne")
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space left"):
        checkpoint.write_atomically(path, fail_part_way)
    assert path.read_bytes() == b"new" and files(tmp_path) == ["state.bin"]

    def replace(src, dst):
        raise OSError("read-only file system")

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    with pytest.raises(OSError, match="read-only"):
        checkpoint.write_atomically(path, lambda f: f.write(b"newer"))
    assert path.read_bytes() == b"new" and files(tmp_path) == ["state.bin"]


def test_resume_loads_the_last_committed_checkpoint_and_returns_what_the_save_was_given(tmp_path):
    pipe = make_pipeline()
    train(pipe, 2, seed=1)
    checkpoint.save(pipe, tmp_path, extra={"step": 2, "epoch": 0})
    resumed = make_pipeline()
    assert checkpoint.resume(resumed, tmp_path) == {"step": 2, "epoch": 0}
    assert_same(weights(resumed), weights(pipe))
    # Training on from there ends where the pipeline that was never restarted ends.
    train(pipe, 2, seed=2)
    train(resumed, 2, seed=2)
    assert_same(weights(resumed), weights(pipe))


def test_resume_with_nothing_committed_starts_from_the_beginning(tmp_path, monkeypatch):
    pipe = make_pipeline()
    before = weights(pipe)
    assert checkpoint.resume(pipe, tmp_path / "not-yet") is None
    # A first save that failed left no manifest: still nothing to resume.
    failing_after(1, monkeypatch)
    with pytest.raises(CheckpointError):
        checkpoint.save(pipe, tmp_path, extra={"step": 1})
    assert checkpoint.resume(pipe, tmp_path) is None
    assert_same(weights(pipe), before)


def test_a_save_without_extra_loads_as_an_empty_one_and_extra_must_be_json(tmp_path):
    pipe = make_pipeline()
    train(pipe, 1, seed=1)
    checkpoint.save(pipe, tmp_path)
    assert checkpoint.load(make_pipeline(), tmp_path) == {}
    with pytest.raises(TypeError, match="extra must hold plain JSON values"):
        checkpoint.save(pipe, tmp_path / "other", extra={"weights": torch.ones(2)})
    assert not (tmp_path / "other").exists()
