"""Capture without an example: a model that torch.fx cannot capture, given no example_input, is captured with
torch.export at the first step() (or predict()) from its first micro-batch, with no effect on the model, and
trains exactly as with example_input; what needs the stages before then says what to do."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pipecore import CaptureError, Pipeline, SGD, checkpoint
from pipecore.engine.lazy import NotCaptured, first_microbatch

sys.path.insert(0, str(Path(__file__).parent))
import _hf  # noqa: E402  (skips this module without transformers)
from _hf import batch, make, sequential_step  # noqa: E402

M = 4
LR = 0.1


def _lazy_gpt2(model, **kwargs):
    return Pipeline(model, 4, "1f1b", M, optimizer=SGD(lr=kwargs.pop("lr", LR)), loss_fn=_hf.lm_loss, **kwargs)


def _model_state(pipe):
    state = pipe.state_dict()
    state.pop("pipecore")
    return state


def test_gpt2_without_an_example_trains_like_the_plain_model_and_like_with_an_example():
    """Four stages, two steps (the second with a shorter sequence): the losses and weights equal plain SGD on the
    model to round-off in float64, and are bit for bit those of the same pipeline given example_input."""
    model, ref, with_example = make("gpt2"), make("gpt2"), make("gpt2")
    lazy = _lazy_gpt2(model)
    eager = _lazy_gpt2(with_example, example_input=batch("gpt2")[0])
    for step, length in enumerate((8, 6)):
        x, y = batch("gpt2", length=length, seed=step + 1)
        got = lazy.step(x, y)
        assert lazy.captured.capture == "export"
        assert got == eager.step(x, y), step
        expected = sequential_step(ref, x, y, _hf.lm_loss, M, LR)
        assert math.isclose(got, expected, rel_tol=1e-12), (step, got, expected)
    state, eager_state = _model_state(lazy), _model_state(eager)
    assert set(state) == set(ref.state_dict())
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-10, atol=1e-12, msg=key)
        assert torch.equal(state[key], eager_state[key]), key
    assert [g.nodes for g in lazy.stage_graphs] == [g.nodes for g in eager.stage_graphs]
    # print(pipe) names each stage's blocks by module path, as with example_input.
    runs = _runs(lazy)
    assert runs == _runs(eager)
    assert all(f"transformer.h.{s}" in runs[s] for s in range(4)), runs
    assert runs[-1][-1] == "lm_head" and "transformer.ln_f" in runs[-1], runs
    lazy.close()
    eager.close()


def _runs(pipe):
    """What print(pipe) says each stage runs."""
    return [line.split(":", 1)[1].strip().split(", ") for line in str(pipe).splitlines()
            if line.startswith("  runs:")]


def _hooks(model):
    return [(name, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
             len(m._backward_pre_hooks), len(m._state_dict_hooks), len(m._load_state_dict_pre_hooks))
            for name, m in model.named_modules()]


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_the_capture_at_the_first_step_leaves_the_model_as_it_was(mode):
    """With a learning rate of 0 the first step changes no weight, so what differs afterwards is the capture's:
    nothing (parameters, buffers, the training flag, hooks); the stages take the model's mode."""
    model = make("gpt2", 2)
    model.train(mode == "train")
    before, hooks = copy.deepcopy(model.state_dict()), _hooks(model)
    pipe = Pipeline(model, 2, "gpipe", M, optimizer=SGD(lr=0.0), loss_fn=_hf.lm_loss)
    x, y = batch("gpt2")
    pipe.step(x, y)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert model.training == (mode == "train") == pipe.training
    assert all(st.module.training == (mode == "train") for st in pipe.stages.values())
    assert _hooks(model) == hooks
    pipe.close()


class _Scaled(nn.Module):
    """A small model torch.fx cannot capture (torch.ones of a traced size), with BatchNorm and dropout."""

    def __init__(self, width: int = 8, dropout: float = 0.5):
        super().__init__()
        self.a = nn.Linear(4, width)
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(dropout)
        self.b = nn.Linear(width, 2)

    def forward(self, x):
        scale = torch.ones(x.shape[0], 1, device=x.device)
        return self.b(self.drop(torch.relu(self.bn(self.a(x))))) * scale


def _scaled_pipeline(model, **kwargs):
    return Pipeline(model, 2, "1f1b", M, optimizer=SGD(lr=LR), loss_fn=nn.functional.cross_entropy, **kwargs)


def _scaled_data(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(0, 2, (8,), generator=g)


def test_the_capture_draws_no_random_number_and_counts_no_batch():
    """Dropout masks and BatchNorm's statistics after a first step that captures equal those of a pipeline given
    example_input (whose capture ran at construction): the capture drew nothing and updated nothing."""
    torch.manual_seed(0)
    model = _Scaled().double()
    twin = copy.deepcopy(model)
    lazy, eager = _scaled_pipeline(model), _scaled_pipeline(twin, example_input=_scaled_data(0)[0])
    for step in range(2):
        x, y = _scaled_data(step + 1)
        torch.manual_seed(10 + step)
        got = lazy.step(x, y)
        torch.manual_seed(10 + step)
        assert got == eager.step(x, y), step
    state, eager_state = _model_state(lazy), _model_state(eager)
    assert int(state["bn.num_batches_tracked"]) == 2 * M
    for key, value in eager_state.items():
        assert torch.equal(state[key], value), key


def test_with_stage_threads_and_overlapping_steps_the_capture_happens_before_the_threads_start():
    """concurrent=True with overlap_steps: the first step captures on the calling thread, then the stage threads
    train as one thread in turn does, bit for bit."""
    torch.manual_seed(0)
    model = _Scaled(dropout=0.0).double()
    twin = copy.deepcopy(model)
    threaded = _scaled_pipeline(model, concurrent=True, overlap_steps=True)
    in_turn = _scaled_pipeline(twin, concurrent=False, example_input=_scaled_data(0)[0])
    for step in range(3):
        x, y = _scaled_data(step)
        assert threaded.step(x, y) == in_turn.step(x, y), step
    assert threaded.execution == "stage threads"
    threaded.synchronize()
    for key, value in _model_state(in_turn).items():
        assert torch.equal(_model_state(threaded)[key], value), key
    threaded.close()


def test_print_before_the_first_step_says_it_waits_for_a_first_step_or_an_example():
    pipe = _lazy_gpt2(make("gpt2", 2))
    text = str(pipe)
    assert text == repr(pipe) == pipe.describe()
    first, second = text.splitlines()
    assert first == "Pipeline: GPT2LMHeadModel as 4 stages, 1f1b, 4 micro-batches; not captured yet"
    assert second.startswith("  torch.fx cannot capture GPT2LMHeadModel.forward (")
    assert "captured with torch.export from the first micro-batch of the first step()" in second
    assert "example_input=" in second


def test_what_needs_the_stages_before_the_first_step_says_what_to_do_in_one_line():
    pipe = _lazy_gpt2(make("gpt2", 2))
    for call in (pipe.stats, pipe.state_dict, pipe.full_state_dict, lambda: pipe.execution):
        with pytest.raises(NotCaptured) as info:
            call()
        message = str(info.value)
        assert "\n" not in message and "call step() first" in message and "example_input=" in message, message
    with pytest.raises(AttributeError, match=r"^Pipeline.stages needs the captured model.*call step\(\) first"):
        pipe.stages  # noqa: B018
    assert not hasattr(pipe, "captured")
    # What needs no stages answers as for a pipeline that has not stepped.
    assert (pipe.in_flight, pipe.minibatches, pipe.training) == (0, 0, True)
    pipe.synchronize()
    pipe.flush()
    assert pipe.eval() is pipe and not pipe.training
    pipe.close()
    with pytest.raises(RuntimeError, match="closed"):
        pipe.step(*batch("gpt2"))


def test_a_state_loaded_before_the_first_step_is_loaded_at_the_capture_with_set_lr_in_order():
    """Resuming: load_state_dict (and set_lr after it) before any step are held and applied right after the
    capture, so the resumed pipeline continues exactly as the one that saved."""
    torch.manual_seed(0)
    model = _Scaled().double()
    fresh = copy.deepcopy(model)
    first = _scaled_pipeline(model)
    for step in range(2):
        first.step(*_scaled_data(step))
    saved = copy.deepcopy(first.state_dict())
    resumed = _scaled_pipeline(fresh)
    resumed.set_lr(0.5)  # replaced by the state loaded after it
    resumed.load_state_dict(saved)
    resumed.set_lr(0.05)
    first.set_lr(0.05)
    for step in range(2, 4):
        x, y = _scaled_data(step)
        torch.manual_seed(step)
        expected = first.step(x, y)
        torch.manual_seed(step)
        assert resumed.step(x, y) == expected, step
    for key, value in first.state_dict()["pipecore"]["stages"].items():
        assert resumed.state_dict()["pipecore"]["stages"][key]["lr"] == value["lr"] == 0.05
    for key, value in _model_state(first).items():
        assert torch.equal(_model_state(resumed)[key], value), key


def test_a_checkpoint_loaded_before_the_first_step_resumes_exactly(tmp_path):
    torch.manual_seed(0)
    model = _Scaled().double()
    fresh = copy.deepcopy(model)
    first = _scaled_pipeline(model)
    with pytest.raises(checkpoint.CheckpointError, match="call step"):  # nothing to save before the capture
        checkpoint.save(first, tmp_path)
    first.step(*_scaled_data(0))
    checkpoint.save(first, tmp_path)
    resumed = _scaled_pipeline(fresh)
    checkpoint.load(resumed, tmp_path)
    x, y = _scaled_data(1)
    torch.manual_seed(1)
    expected = first.step(x, y)
    torch.manual_seed(1)
    assert resumed.step(x, y) == expected
    for key, value in _model_state(first).items():
        assert torch.equal(_model_state(resumed)[key], value), key


def test_a_state_that_does_not_fit_raises_at_the_first_step_and_stays_held():
    torch.manual_seed(0)
    other = _scaled_pipeline(_Scaled(width=6).double())
    other.step(*_scaled_data(0))
    pipe = _scaled_pipeline(_Scaled().double())
    with pytest.raises(KeyError, match="no 'pipecore' entry"):  # what can be checked without the stages, at once
        pipe.load_state_dict(_Scaled().double().state_dict())
    pipe.load_state_dict(other.state_dict())
    for _ in range(2):  # held until it loads: the pipeline never trains without it
        with pytest.raises(ValueError, match="shapes differ"):
            pipe.step(*_scaled_data(1))
    assert pipe.minibatches == 0
    good = _scaled_pipeline(_Scaled().double())
    good.step(*_scaled_data(0))
    pipe.load_state_dict(good.state_dict())  # replaces the held one
    pipe.step(*_scaled_data(1))
    assert pipe.minibatches == 1


def test_predict_before_any_step_captures_and_equals_the_model():
    model = make("gpt2", 2)
    ref = copy.deepcopy(model).eval()
    pipe = Pipeline(model, 2, "1f1b", M, optimizer=SGD(lr=LR), loss_fn=_hf.lm_loss).eval()
    x, _ = batch("gpt2", n=3)  # fewer samples than micro-batches: predict() takes them, and so does the capture
    with torch.no_grad():
        out = pipe.predict(x)
        expected = ref(**x)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-10, atol=1e-12)
    assert pipe.captured.capture == "export" and pipe.minibatches == 0


def test_the_first_microbatch_keeps_the_structure_and_the_options():
    ids = torch.arange(20).reshape(10, 2)
    assert torch.equal(first_microbatch(ids, 4), ids[:3])
    got = first_microbatch({"input_ids": ids, "use_cache": False}, 4)
    assert set(got) == {"input_ids", "use_cache"} and got["use_cache"] is False
    assert torch.equal(got["input_ids"], ids[:3])
    a, flag = first_microbatch((ids, True), 5)
    assert torch.equal(a, ids[:2]) and flag is True
    assert torch.equal(first_microbatch(ids[:3], 4), ids[:1])  # as predict() splits a small batch
    with pytest.raises(ValueError, match="different batch sizes"):
        first_microbatch((ids, ids[:5]), 4)


def test_under_torchrun_a_model_that_needs_an_example_asks_for_example_input(monkeypatch):
    """Only the first stage's rank has the first step's input, so the capture cannot wait for it there."""
    import pipecore.engine.build as build

    monkeypatch.setattr(build, "join_topology", lambda *args: object())  # as if under torchrun
    with pytest.raises(CaptureError) as info:
        _lazy_gpt2(make("gpt2", 2))
    message = str(info.value)
    assert "\n" not in message and "under torchrun" in message and "pass example_input=" in message, message
