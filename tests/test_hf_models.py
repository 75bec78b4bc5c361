"""Hugging Face transformers models as they come (issue 36): captured with torch.export where torch.fx cannot,
cut at their layers, trained equal to the plain model, checkpointed under the model's own keys."""

from __future__ import annotations

import copy
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import pipecore
from pipecore import CaptureError, Pipeline, SGD

sys.path.insert(0, str(Path(__file__).parent))
import _hf  # noqa: E402  (skips this module without transformers)
from _hf import batch, loss_of, make, sequential_step  # noqa: E402

M = 4
LR = 0.1


def _pipeline(model, name, stages, algorithm, **kwargs):
    x, _ = batch(name)
    return Pipeline(model, stages, algorithm, M, optimizer=SGD(lr=LR), loss_fn=loss_of(name), example_input=x,
                    **kwargs)


def _model_state(pipe):
    state = pipe.state_dict()
    state.pop("pipecore")
    return state


CASES = [(name, 2, "gpipe") for name in _hf.NAMES] + [(name, 4, "1f1b") for name in _hf.NAMES] + [
    ("gpt2", 2, "1f1b"), ("gpt2", 4, "gpipe")]


@pytest.mark.parametrize("name,stages,algorithm", CASES)
def test_training_equals_the_plain_model(name, stages, algorithm):
    """Two steps (the second with another sequence length for token models) equal plain SGD on the model to
    round-off in float64; the checkpoint has exactly the model's keys and loads strictly into a plain copy."""
    layers = stages  # tiny: capture time grows with the graph
    model, ref = make(name, layers), make(name, layers)
    pipe = _pipeline(model, name, stages, algorithm)
    assert pipe.captured.capture == "export"
    loss_fn = loss_of(name)
    for step, length in enumerate((8, 6)):
        x, y = batch(name, length=length, seed=step + 1)
        got = pipe.step(x, y)
        expected = sequential_step(ref, x, y, loss_fn, M, LR)
        assert math.isclose(got, expected, rel_tol=1e-12), (step, got, expected)
    state = _model_state(pipe)
    assert set(state) == set(ref.state_dict())
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-10, atol=1e-12, msg=key)
    plain = make(name, layers)
    plain.load_state_dict(state, strict=True)
    pipe.close()


def test_default_partition_cuts_at_the_layers():
    """The default cuts fall where a layer of the model's ModuleList starts (transformer.h.1, ...), balanced by
    parameters; module names cut as well."""
    pipe = _pipeline(make("gpt2"), "gpt2", 4, "1f1b")
    starts = [g.nodes[0] for g in pipe.stage_graphs[1:]]
    modules = [pipe.captured.module_of(next(n for n in pipe.captured.nodes if n.name == s)) for s in starts]
    assert modules == ["transformer.h.1.ln_1", "transformer.h.2.ln_1", "transformer.h.3.ln_1"]
    assert pipe.ties == {"transformer.wte.weight": ((0, "transformer.wte.weight"), (3, "lm_head.weight"))}
    pipe.close()
    named = _pipeline(make("llama"), "llama", 3, "1f1b", partition=["model.layers.1", "model.layers.3"])
    assert named.stage_layers[1][0].startswith("model.layers.1") and named.stage_layers[2][0].startswith("model.layers.3")
    named.close()


def test_tied_aliases_are_in_the_checkpoint_and_reload():
    """BART's embedding is one parameter under four names; each is a key of state_dict() with the live value,
    and a pipeline checkpoint loads into another partition of the same model."""
    pipe = _pipeline(make("bart"), "bart", 4, "1f1b")
    assert set(pipe.ties) == {"model.shared.weight"}
    x, y = batch("bart")
    pipe.step(x, y)
    state = pipe.state_dict()
    names = ["model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
             "lm_head.weight"]
    for key in names[1:]:
        assert torch.equal(state[key], state[names[0]]), key
    other = _pipeline(make("bart"), "bart", 2, "gpipe")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other.load_state_dict(state)
    reloaded = other.state_dict()
    for key in names:
        assert torch.equal(reloaded[key], state[key]), key
    pipe.close()
    other.close()


@pytest.mark.parametrize("name,algorithm", [("gpt2", "pipedream"), ("llama", "2bw"), ("bart", "pipemare")])
def test_asynchronous_algorithms_run(name, algorithm):
    pipe = _pipeline(make(name), name, 4, algorithm)
    losses = [pipe.step(*batch(name, seed=i)) for i in range(3)]
    pipe.flush()
    assert all(math.isfinite(loss) for loss in losses)
    make(name).load_state_dict(_model_state(pipe), strict=True)
    pipe.close()


def test_eval_mode_follows_the_pipeline_and_predict_equals_the_model():
    """Dropout in the exported graph follows train()/eval(): in eval mode, predict equals the plain model's
    output (a ModelOutput, as the model returns it)."""
    model, ref = make("gpt2", dropout=0.2), make("gpt2", dropout=0.2)
    pipe = _pipeline(model, "gpt2", 2, "1f1b")
    x, _ = batch("gpt2")
    pipe.eval()
    out = pipe.predict(x)
    ref.eval()
    with torch.no_grad():
        expected = ref(**x)
    assert type(out) is type(expected)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-10, atol=1e-12)
    pipe.train()
    with torch.no_grad():
        trained = pipe.stage_graphs[0].module(x["input_ids"])  # dropout active again: outputs differ run to run
        again = pipe.stage_graphs[0].module(x["input_ids"])
    assert not torch.equal(trained[-1], again[-1])
    pipe.close()


def test_a_model_that_returns_a_cache_is_refused_with_the_setting_to_change():
    model = make("gpt2")
    model.config.use_cache = True
    with pytest.raises(CaptureError, match=r"model.config.use_cache = False"):
        _pipeline(model, "gpt2", 2, "1f1b")


def test_capture_choices():
    x, _ = batch("gpt2")
    with pytest.raises(ValueError, match=r"capture must be one of \('fx', 'export', 'auto'\)"):
        Pipeline(make("gpt2"), 2, "1f1b", M, loss_fn=_hf.lm_loss, example_input=x, capture="dynamo")
    for capture in ("export", "auto"):  # without an example: captured at the first step (test_lazy_capture.py)
        waiting = Pipeline(make("gpt2"), 2, "1f1b", M, loss_fn=_hf.lm_loss, capture=capture)
        assert str(waiting).splitlines()[0].endswith("; not captured yet"), capture
    with pytest.raises(CaptureError) as info:
        Pipeline(make("gpt2"), 2, "1f1b", M, loss_fn=_hf.lm_loss, example_input=x, capture="fx")
    assert "GPT2LMHeadModel.forward" in str(info.value) and "at an unknown place" not in str(info.value)


class _Causal(nn.Module):
    """Plain user code that torch.fx cannot capture: a mask built from a traced length."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(_MaskedBlock() for _ in range(3))
        self.head = nn.Linear(8, 16)

    def forward(self, idx):
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class _MaskedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        T = x.shape[1]
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
        y = self.norm(x)
        return x + self.attn(y, y, y, attn_mask=mask, need_weights=False)[0]


def test_plain_code_fx_cannot_capture_goes_through_export():
    torch.manual_seed(0)
    model = _Causal().double()
    ref = copy.deepcopy(model)
    idx = torch.randint(0, 16, (8, 7))
    y = torch.randint(0, 16, (8, 7))
    pipe = Pipeline(model, 3, "1f1b", M, optimizer=SGD(lr=LR), loss_fn=_hf.lm_loss_logits, example_input=idx)
    assert pipe.captured.capture == "export"
    got = pipe.step(idx, y)
    ref.zero_grad()
    expected = 0.0
    for u in range(M):
        loss = _hf.lm_loss_logits(ref(idx.tensor_split(M)[u]), y.tensor_split(M)[u]) / M
        loss.backward()
        expected += float(loss.detach())
    assert math.isclose(got, expected, rel_tol=1e-12)
    with pytest.raises(CaptureError, match="triu"):  # fx alone names the line it cannot follow
        Pipeline(_Causal(), 3, "1f1b", M, loss_fn=_hf.lm_loss_logits, capture="fx")
    pipe.close()


class _Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.b = nn.Linear(8, 2)

    def forward(self, x):
        n = x.shape[0]
        scale = torch.ones(n, 1, device=x.device)  # torch.ones of a traced size: fx cannot, export can
        return self.b(torch.relu(self.bn(self.a(x)))) * scale


class _PlainNorm(_Norm):
    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))


@pytest.mark.parametrize("cls,capture", [(_PlainNorm, "fx"), (_PlainNorm, "export"), (_Norm, "auto")])
def test_example_input_never_trains(cls, capture):
    """Capturing and describing the boundaries on example_input change no parameter or buffer of the model
    (BatchNorm's running statistics and num_batches_tracked included); training then updates them in place as
    the plain model does."""
    torch.manual_seed(0)
    model = cls().double()
    ref = copy.deepcopy(model)
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(8, 4, dtype=torch.float64)
    y = torch.randint(0, 2, (8,))
    pipe = Pipeline(model, 2, "gpipe", M, optimizer=SGD(lr=LR), loss_fn=nn.functional.cross_entropy, example_input=x,
                    capture=capture)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    pipe.step(x, y)
    ref.zero_grad()
    for u in range(M):
        (nn.functional.cross_entropy(ref(x.tensor_split(M)[u]), y.tensor_split(M)[u]) / M).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= LR * p.grad
    state = _model_state(pipe)
    for key in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        torch.testing.assert_close(state[key], ref.state_dict()[key], rtol=1e-12, atol=1e-14, msg=key)
    pipe.eval()
    with torch.no_grad():
        out = pipe.predict(x)
        expected = ref.eval()(x)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    assert torch.equal(_model_state(pipe)["bn.num_batches_tracked"], ref.bn.num_batches_tracked)  # eval: no count
    pipe.close()


def test_a_compiled_model_is_unwrapped_with_a_note():
    model = make("gpt2")
    compiled = torch.compile(model)
    with pytest.warns(UserWarning, match="_orig_mod"):
        pipe = _pipeline(compiled, "gpt2", 2, "1f1b")
    assert pipe.captured.model is model
    loss = pipe.step(*batch("gpt2"))
    assert math.isfinite(loss)
    pipe.close()


def test_recomputation_and_the_planner_work_on_the_exported_graph():
    """A plan (pipecore.plan) of an exported model: its cuts and recomputed segments train equal to the
    plain model."""
    x, y = batch("gpt2")
    # 1.75 MiB: the first stage needs 2.5 MiB without recomputing; the plan counts the copies that undo a failed
    # step, which this pipeline keeps (recover=True), so the least limit any partition meets is 1.58 MiB.
    plan = pipecore.plan(make("gpt2"), x, 2, "1f1b", n_microbatches=M, memory_limit="1.75MiB", loss_fn=_hf.lm_loss,
                         example_target=y)
    assert any(plan.recomputed)  # the memory limit makes it recompute segments of the exported graph
    pipe = Pipeline(make("gpt2"), 2, "1f1b", M, optimizer=SGD(lr=LR), loss_fn=_hf.lm_loss, example_input=x,
                    partition=plan)
    ref = make("gpt2")
    got = pipe.step(x, y)
    expected = sequential_step(ref, x, y, _hf.lm_loss, M, LR)
    assert math.isclose(got, expected, rel_tol=1e-12)
    state = _model_state(pipe)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-10, atol=1e-12, msg=key)
    pipe.close()


def test_gpt2_across_two_processes_equals_one_process(tmp_path):
    """GPT-2 as two ranks (gloo on loopback, each rank captures the model with torch.export and keeps its own
    stage; the tied embedding and head on different ranks; the sequence length changes between steps) trains
    bit for bit as in one process."""
    import hf_dist_run
    from _ranks import launch_ranks

    algorithms = ["1f1b", "pipedream"]
    results = launch_ranks(str(Path(__file__).parent / "hf_dist_run.py"), 2, str(tmp_path), ",".join(algorithms),
                           timeout=300)
    for r in results:
        assert r.returncode == 0, r.stdout
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run with one thread each: identical reductions
    try:
        for algorithm in algorithms:
            pipe = hf_dist_run.make_pipeline(2, algorithm)
            losses = hf_dist_run.train(pipe, True, True)
            state = pipe.state_dict()
            pipe.close()
            parts = [torch.load(tmp_path / f"{algorithm}-{rank}.pt") for rank in range(2)]
            merged = {}
            for rank, part in enumerate(parts):
                assert part["losses"] == losses, (algorithm, rank)
                for key, value in part["state"].items():
                    if key != "pipecore":
                        assert torch.equal(value, state[key]), (algorithm, rank, key)
                        merged[key] = value
            assert set(merged) == set(_hf.make("gpt2", layers=2).state_dict())
            assert torch.equal(parts[0]["state"]["transformer.wte.weight"], parts[1]["state"]["lm_head.weight"])
    finally:
        torch.set_num_threads(threads)


def test_tensors_the_forward_creates_are_made_on_the_stage_device():
    """torch.export records the device of torch.ones(T, T, device=x.device) and of HF's torch.arange as a
    constant; the pipeline makes them the device of the module running the node, so a stage moved to another
    device (here the meta device, standing in for a GPU) creates them there."""
    from pipecore.engine.graph import CapturedModel

    torch.manual_seed(0)
    captured = CapturedModel(_Causal(), example_input=torch.randint(0, 16, (4, 7)))
    assert captured.capture == "export"
    gm = captured.gm.to("meta")
    out = gm(torch.zeros(4, 5, dtype=torch.long, device="meta"))
    assert out.device.type == "meta" and out.shape == (4, 5, 16)


def test_options_in_the_inputs_are_captured_as_constants():
    """A non-tensor argument (use_cache=False) in example_input and step() is an option, not an input."""
    x, y = batch("gpt2")
    pipe = Pipeline(make("gpt2", 2), 2, "1f1b", M, optimizer=SGD(lr=LR), loss_fn=_hf.lm_loss,
                    example_input={**x, "use_cache": False})
    assert pipe.captured.input_names == ("input_ids",)
    got = pipe.step({**x, "use_cache": False}, y)
    assert math.isclose(got, sequential_step(make("gpt2", 2), x, y, _hf.lm_loss, M, LR), rel_tol=1e-12)
    pipe.close()


class _Branchy(nn.Module):
    """Control flow on a tensor value: neither capture can follow it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:
            h = h * 2
        return self.b(h)


def test_when_neither_capture_works_the_error_says_how_each_failed_and_where():
    with pytest.raises(CaptureError) as info:
        Pipeline(_Branchy(), 2, "1f1b", M, loss_fn=nn.functional.cross_entropy, example_input=torch.randn(8, 4))
    message = str(info.value)
    assert "neither capture works" in message and "torch.fx failed" in message and "torch.export failed" in message
    assert message.count("if h.sum() > 0") == 2, message  # each failure names the line


def test_the_example_trains_gpt2_on_the_text(capsys):
    """examples/train_hf.py, the runnable example of docs/models.md: a GPT-2 from a config, captured with
    torch.export, learns the character corpus (its loss falls well below the uniform guess's)."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
    try:
        import train_hf
    finally:
        sys.path.pop(0)
    from pipecore.models.text import load_char_data

    loss = train_hf.main(steps=40)
    uniform = math.log(load_char_data(train_hf.BLOCK).vocab_size)
    assert loss < uniform - 1.0, (loss, uniform)
    assert "Pipeline: GPT2LMHeadModel as 4 stages, 1f1b" in capsys.readouterr().out
