"""Any model: captured graphs cut into generated stages, several tensors between stages, tied weights (CPU,
float64 where exactness is the point)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import pipecore
from pipecore import CaptureError, Pipeline, SGD
from pipecore.models import GPT, Encoder, ResNet

M = 4


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(11, 8, n_layer=3, n_head=2, n_embd=8).double()


def resnet() -> ResNet:
    torch.manual_seed(0)
    return ResNet(width=4, blocks=3).double()


def encoder() -> Encoder:
    torch.manual_seed(0)
    return Encoder(13, 6, 3, n_layer=3, n_head=2, n_embd=8).double()


def gpt_data(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 11, (8, 8), generator=g), torch.randint(0, 11, (8, 8), generator=g)) for _ in range(steps)]


def resnet_data(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 64, generator=g, dtype=torch.float64), torch.randint(0, 10, (8,), generator=g))
            for _ in range(steps)]


def encoder_data(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, 13, (8, 6), generator=g)
        lengths = torch.randint(1, 7, (8,), generator=g)
        mask = torch.arange(6)[None, :] < lengths[:, None]
        out.append(({"tokens": tokens, "mask": mask}, torch.randint(0, 3, (8,), generator=g)))
    return out


CASES = {
    "gpt": (gpt, gpt_data, lm_loss, 4),
    "resnet": (resnet, resnet_data, nn.CrossEntropyLoss(), 3),
    "encoder": (encoder, encoder_data, nn.CrossEntropyLoss(), 4),
}


def _call(model: nn.Module, x):
    return model(**x) if isinstance(x, dict) else model(x)


def _chunks(x, n: int):
    if isinstance(x, dict):
        parts = {k: v.split(v.shape[0] // n) for k, v in x.items()}
        return [{k: parts[k][u] for k in x} for u in range(n)]
    return list(x.split(x.shape[0] // n))


def sequential_training(model: nn.Module, optimizer, data, loss_fn, per_update: int = M) -> nn.Module:
    """Plain training: each micro-batch loss / per_update, gradients accumulated, one step per group."""
    optimizer.zero_grad()
    i = 0
    for x, y in data:
        for xc, yc in zip(_chunks(x, M), _chunks(y, M)):
            (loss_fn(_call(model, xc), yc) / per_update).backward()
            i += 1
            if i % per_update == 0:
                optimizer.step()
                optimizer.zero_grad()
    return model


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("algorithm", ["gpipe", "1f1b"])
def test_synchronous_pipeline_of_any_model_equals_sequential_training(name, algorithm):
    make, data_of, loss_fn, P = CASES[name]
    data = data_of(3)
    pipe = Pipeline(make(), P, algorithm, M, optimizer=SGD(lr=0.1, momentum=0.9, weight_decay=1e-3),
                    loss_fn=loss_fn)
    for x, y in data:
        pipe.step(x, y)
    ref = make()
    sequential_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3), data, loss_fn)
    got = pipe.state_dict()
    expected = ref.state_dict()
    assert set(expected) <= set(got)
    for key, value in expected.items():  # weights, tied copies and BatchNorm running statistics
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-12, msg=key)


def test_gpt_head_is_tied_across_the_first_and_last_stage_and_the_copies_stay_identical():
    data = gpt_data(4)
    for algorithm in pipecore.algorithm_names():
        model = gpt()
        pipe = Pipeline(model, 4, algorithm, M, optimizer=SGD(lr=0.1, momentum=0.9), loss_fn=lm_loss)
        assert pipe.ties == {"tok_emb.weight": ((0, "tok_emb.weight"), (3, "head.weight"))}
        for x, y in data:
            pipe.step(x, y)
        pipe.flush()
        first = pipe.stages[0].layout.views(pipe.stages[0].ring.live)["tok_emb.weight"]
        last = pipe.stages[3].layout.views(pipe.stages[3].ring.live)["head.weight"]
        assert torch.equal(first, last), algorithm
        assert not torch.equal(first, gpt().tok_emb.weight), "the tied weight must have trained"
        # The user's shared parameter follows the first owner's live weights (one tensor, as in the model).
        assert model.head.weight is model.tok_emb.weight
        assert torch.equal(model.tok_emb.weight, first)


def test_a_stage_holding_both_uses_of_a_tied_weight_has_one_copy():
    pipe = Pipeline(gpt(), 2, "1f1b", M, optimizer=SGD(lr=0.1), loss_fn=lm_loss, partition=["blocks.0"])
    # Stage 1 holds the blocks and the head; stage 0 the embedding: tied across the two.
    assert set(pipe.ties) == {"tok_emb.weight"}
    single = Pipeline(gpt(), 1, "1f1b", M, optimizer=SGD(lr=0.1), loss_fn=lm_loss)
    assert single.ties == {}
    assert single.stages[0].layout.numel == sum(p.numel() for p in gpt().parameters())


class Recorder:
    """Every stage's inputs, outputs, incoming and outgoing gradients, and weights after each update."""

    def __init__(self, pipe: Pipeline):
        self.weights = {s: {0: st.ring.live.clone()} for s, st in pipe.stages.items()}
        self.inputs, self.outputs, self.grad_in, self.grad_out = {}, {}, {}, {}
        for s, st in pipe.stages.items():
            self._wrap(s, st)

    def _wrap(self, s, st):
        forward, backward, update = st.compute_forward, st.compute_backward, st.compute_update

        def compute_forward(action, read, payload):
            out = forward(action, read, payload)
            self.inputs[s, action.index], self.outputs[s, action.index] = payload, out
            return out

        def compute_backward(action, reads, forward_reads, payloads):
            outs = backward(action, reads, forward_reads, payloads)
            for k, g_in, g_out in zip(action.microbatches, payloads, outs):
                self.grad_in[s, k], self.grad_out[s, k] = g_in, g_out
            return outs

        def compute_update(action, info):
            update(action, info)
            self.weights[s][info.new_version] = st.ring.live.clone()

        st.compute_forward, st.compute_backward, st.compute_update = compute_forward, compute_backward, compute_update


def _as_tuple(value):
    return value if isinstance(value, tuple) else (value,)


def _stage_call(st, flat: torch.Tensor, inputs):
    """The stage's generated module run with the weights ``flat`` (a reference, outside the engine)."""
    params = {name: view.clone().requires_grad_(True) for name, view in st.layout.views(flat).items()}
    args = [x.detach().requires_grad_(g and x.is_floating_point()) if isinstance(x, torch.Tensor) else x
            for x, g in zip(inputs, st.boundary.grad_inputs)]
    out = torch.func.functional_call(st.module, params, tuple(args))
    return out, args


@pytest.mark.parametrize("algorithm", ["pipedream", "2bw"])
def test_asynchronous_gpt_stages_read_the_versions_of_the_simulated_trace(algorithm):
    """For every stage and micro-batch, the forward's outputs equal the stage's module run (outside the
    engine) with the weight version the simulator's trace names, and the backward's input gradients equal
    the vector-Jacobian product at the backward's version."""
    P, n, lr = 4, 4, 0.05
    pipe = Pipeline(gpt(), P, algorithm, M, optimizer=SGD(lr=lr, momentum=0.9), loss_fn=lm_loss)
    rec = Recorder(pipe)
    for x, y in gpt_data(n):
        pipe.step(x, y)
    pipe.flush()
    trace = pipecore.simulate(algorithm, P, M, n)
    checked = 0
    for s in range(P - 1):
        st = pipe.stages[s]
        for k in range(M * n):
            inputs = _as_tuple(rec.inputs[s, k])
            w_f = rec.weights[s][trace.version(s, k, "F")]
            out, _ = _stage_call(st, w_f, inputs)
            for got, want in zip(_as_tuple(rec.outputs[s, k]), out):
                torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-12)
            if s > 0:
                w_b = rec.weights[s][trace.read(s, k, "B").version]
                out, args = _stage_call(st, w_b, inputs)
                grads = _as_tuple(rec.grad_in[s, k])
                pairs = [(o, g) for o, g in zip(out, grads) if g is not None]
                wanted = [a for a in args if a.requires_grad]
                expected = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs])
                got = [g for g in _as_tuple(rec.grad_out[s, k]) if g is not None]
                for a, b in zip(got, expected):
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
                checked += 1
    assert checked == (P - 2) * M * n
    # The tied copies are the same weights at every version both owners reached.
    for v in set(rec.weights[0]) & set(rec.weights[P - 1]):
        first = pipe.stages[0].layout.views(rec.weights[0][v])["tok_emb.weight"]
        last = pipe.stages[P - 1].layout.views(rec.weights[P - 1][v])["head.weight"]
        assert torch.equal(first, last), v


def test_the_mask_reaches_every_stage_and_passes_without_gradients():
    pipe = Pipeline(encoder(), 4, "1f1b", M, optimizer=SGD(lr=0.1), loss_fn=nn.CrossEntropyLoss())
    for g in pipe.stage_graphs[1:]:
        assert "mask" in g.inputs
        assert not g.grad_inputs[g.inputs.index("mask")]
    rec = Recorder(pipe)
    for x, y in encoder_data(2):
        pipe.step(x, y)
    for s in range(1, 3):
        for k in range(2 * M):
            received = dict(zip(pipe.stage_graphs[s].inputs, _as_tuple(rec.inputs[s, k])))
            assert received["mask"].dtype == torch.bool
            sent_back = dict(zip(pipe.stage_graphs[s].inputs, _as_tuple(rec.grad_out[s, k])))
            residual = next(name for name in pipe.stage_graphs[s].inputs if name != "mask")
            assert sent_back["mask"] is None and sent_back[residual] is not None


def test_inputs_as_tuple_and_dict_train_identically():
    data = encoder_data(2)
    pipes = [Pipeline(encoder(), 2, "1f1b", M, optimizer=SGD(lr=0.1), loss_fn=nn.CrossEntropyLoss()) for _ in range(2)]
    for x, y in data:
        a = pipes[0].step(x, y)
        b = pipes[1].step((x["tokens"], x["mask"]), y)
        assert a == b
    for key, value in pipes[0].state_dict().items():
        if key != "pipecore":
            assert torch.equal(value, pipes[1].state_dict()[key]), key


def test_targets_as_a_dict_reach_the_loss_split_like_the_inputs():
    def loss_fn(out, target):
        return nn.functional.cross_entropy(out, target["label"]) * target["weight"].mean()

    g = torch.Generator().manual_seed(0)
    x, label = torch.randn(8, 64, generator=g, dtype=torch.float64), torch.randint(0, 10, (8,), generator=g)
    weight = torch.arange(8, dtype=torch.float64)
    pipe = Pipeline(resnet(), 2, "gpipe", M, optimizer=SGD(lr=0.1), loss_fn=loss_fn)
    loss = pipe.step(x, {"label": label, "weight": weight})
    ref = resnet()
    with torch.no_grad():
        expected = sum(float(loss_fn(ref(xc), {"label": lc, "weight": wc}))
                       for xc, lc, wc in zip(x.split(2), label.split(2), weight.split(2))) / M
    assert loss == pytest.approx(expected, rel=1e-12)


def test_partition_by_module_names_and_by_node_indices():
    by_name = Pipeline(gpt(), 3, "1f1b", M, optimizer=SGD(lr=0.1), loss_fn=lm_loss, partition=["blocks.1", "blocks.2"])
    assert by_name.stage_graphs[1].modules[0].startswith("blocks.1")
    nodes = [n.name for n in by_name.captured.nodes]
    starts = [nodes.index(by_name.stage_graphs[s].nodes[0]) for s in (1, 2)]
    by_index = Pipeline(gpt(), 3, "1f1b", M, optimizer=SGD(lr=0.1), loss_fn=lm_loss, partition=starts)
    assert [g.nodes for g in by_index.stage_graphs] == [g.nodes for g in by_name.stage_graphs]
    text = by_name.describe()
    assert "stage 2" in text and "receives" in text and "tied: tok_emb.weight held by stages 0" in text
    assert str(by_name) == text


def test_print_names_what_each_stage_runs_by_module_path_with_ranges_of_siblings():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                        nn.Linear(8, 2))
    pipe = Pipeline(mlp, 3, "1f1b", 2, loss_fn=nn.CrossEntropyLoss(), partition=[2, 5], example_input=torch.randn(6, 4))
    assert str(pipe) == "\n".join([
        "Pipeline: Sequential as 3 stages, 1f1b, 2 micro-batches; inputs input",
        "stage 0: nodes 0-1 (2), 40 parameters",
        "  runs:     0-1",
        "  sends:    _1 from 1 (6, 8) float32",
        "stage 1: nodes 2-4 (3), 144 parameters",
        "  runs:     2-4",
        "  receives: _1 from 1 (6, 8) float32",
        "  sends:    _4 from 4 (6, 8) float32",
        "stage 2: nodes 5-6 (2), 18 parameters",
        "  runs:     5-6",
        "  receives: _4 from 4 (6, 8) float32",
    ])


def _runs(pipe):
    return [line.split(":", 1)[1].strip().split(", ") for line in str(pipe).splitlines()
            if line.startswith("  runs:")]


def test_print_names_a_module_split_by_a_cut_as_a_part_and_the_forward_s_own_nodes_by_name():
    model = gpt()
    assert _runs(Pipeline(model, 3, "1f1b", M, loss_fn=lm_loss, partition=["blocks.1", "blocks.2"])) == [
        ["getattr_1", "getitem", "getattr_2", "arange", "tok_emb", "pos_emb", "add", "drop", "blocks.0"],
        ["blocks.1"], ["blocks.2", "ln_f", "head"]]
    captured = Pipeline(gpt(), 1, "1f1b", M, loss_fn=lm_loss).captured
    cut = next(i for i, n in enumerate(captured.nodes) if n.target == "blocks.0.ln2")
    inside = Pipeline(gpt(), 2, "1f1b", M, loss_fn=lm_loss, partition=[cut])
    runs = _runs(inside)
    assert runs[0][-3:] == ["blocks.0.ln1", "blocks.0.attn", "blocks.0 (part)"]
    assert runs[1] == ["blocks.0.ln2", "blocks.0.mlp", "blocks.0 (part)", "blocks.1-blocks.2", "ln_f", "head"]
    assert "  sends:    add_1 from blocks.0" in str(inside).splitlines()


def test_a_cut_inside_a_block_sends_every_live_value():
    # Cutting between attention and MLP of block 0: the residual stream crosses, with gradients.
    model = gpt()
    captured = Pipeline(model, 1, "1f1b", M, optimizer=SGD(lr=0.1), loss_fn=lm_loss).captured
    cut = next(i for i, n in enumerate(captured.nodes) if n.target == "blocks.0.ln2")
    data = gpt_data(2)
    pipe = Pipeline(gpt(), 2, "1f1b", M, optimizer=SGD(lr=0.1), loss_fn=lm_loss, partition=[cut])
    assert len(pipe.stage_graphs[0].outputs) == 1
    for x, y in data:
        pipe.step(x, y)
    ref = gpt()
    sequential_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), data, lm_loss)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[key], value, rtol=0, atol=1e-12)


# -- bad input -------------------------------------------------------------------------------------------


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:  # data-dependent control flow
            h = -h
        return self.b(h)


class _Gate(nn.Module):
    def forward(self, h):
        return -h if h.sum() > 0 else h


class _GatedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.gate = _Gate()
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.gate(self.a(x)))


def test_a_forward_that_cannot_be_captured_names_the_construct_and_the_fallback():
    # Without example_input the torch.export fallback waits for the first step, which reports both failures.
    pipe = Pipeline(_Branchy(), 2, "1f1b", M, loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(CaptureError) as info:
        pipe.step(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    message = str(info.value)
    assert "control flow" in message and "if h.sum() > 0" in message and "leaf_modules" in message
    assert "neither capture works" in message and "torch.export failed" in message
    with pytest.raises(CaptureError, match="control flow"):  # with fx alone, at construction
        Pipeline(_Branchy(), 2, "1f1b", M, loss_fn=nn.CrossEntropyLoss(), capture="fx")


def test_leaf_modules_keep_uncapturable_code_whole():
    torch.manual_seed(0)
    model = _GatedModel().double()
    pipe = Pipeline(model, 2, "1f1b", M, optimizer=SGD(lr=0.1), loss_fn=nn.CrossEntropyLoss(), leaf_modules=[_Gate])
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 2, (8,))
    loss = pipe.step(x, y)
    torch.manual_seed(0)
    ref = _GatedModel().double()
    with torch.no_grad():
        expected = sum(float(nn.functional.cross_entropy(ref(xc), yc)) for xc, yc in zip(x.split(2), y.split(2))) / M
    assert loss == pytest.approx(expected, rel=1e-12)


def test_a_cut_outside_the_graph_or_naming_no_module_is_an_error():
    with pytest.raises(ValueError, match="outside the captured graph"):
        Pipeline(gpt(), 2, "1f1b", M, loss_fn=lm_loss, partition=[10_000])
    with pytest.raises(ValueError, match="names no module"):
        Pipeline(gpt(), 2, "1f1b", M, loss_fn=lm_loss, partition=["blocks.9"])
    with pytest.raises(ValueError, match="strictly increasing"):
        Pipeline(gpt(), 3, "1f1b", M, loss_fn=lm_loss, partition=["blocks.2", "blocks.1"])


def test_an_input_dict_missing_a_key_or_with_an_unknown_one_is_an_error():
    pipe = Pipeline(encoder(), 2, "1f1b", M, optimizer=SGD(lr=0.1), loss_fn=nn.CrossEntropyLoss())
    (x, y), = encoder_data(1)
    with pytest.raises(KeyError, match="missing \\['mask'\\]"):
        pipe.step({"tokens": x["tokens"]}, y)
    with pytest.raises(KeyError, match="'padding'"):
        pipe.step({**x, "padding": x["mask"]}, y)
    with pytest.raises(TypeError, match="reads 2 inputs"):
        pipe.step(x["tokens"], y)


def test_inputs_whose_batch_sizes_differ_are_an_error():
    pipe = Pipeline(encoder(), 2, "1f1b", M, optimizer=SGD(lr=0.1), loss_fn=nn.CrossEntropyLoss())
    (x, y), = encoder_data(1)
    with pytest.raises(ValueError, match="different batch sizes.*'tokens': 8, 'mask': 4"):
        pipe.step({"tokens": x["tokens"], "mask": x["mask"][:4]}, y)
    with pytest.raises(ValueError, match="input batch has 8 samples but target batch has 4"):
        pipe.step(x, y[:4])


class _ShapePasser(nn.Module):
    """Its forward computes a size in the first part and uses it after the cut."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        n = x.shape[1]
        h = self.a(x)
        return self.b(h) * n


def test_a_boundary_value_that_is_not_a_tensor_is_an_error():
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    loss = nn.MSELoss()
    with pytest.raises(TypeError, match="would send 'getitem' to stage 1, but on the example input it is a int"):
        Pipeline(_ShapePasser(), 2, "1f1b", M, loss_fn=loss, partition=["b"], example_input=x)
    # Without an example input the first step reports it, before anything is applied.
    pipe = Pipeline(_ShapePasser(), 2, "1f1b", M, optimizer=SGD(lr=0.1), loss_fn=loss, partition=["b"])
    with pytest.raises(TypeError, match="would send 'getitem' to stage 1, but it is a int"):
        pipe.step(x, y)


def test_the_gpt_example_runs_and_its_loss_falls():
    example = Path(__file__).parent.parent / "examples" / "train_gpt.py"
    run = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr
    assert "tied: tok_emb.weight held by stages 0 (tok_emb.weight), 3 (head.weight)" in run.stdout
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", run.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.2, run.stdout


@pytest.mark.parametrize("algorithm", ["1f1b", "pipedream"])
def test_a_gpt_checkpoint_resumes_bit_identically(algorithm, tmp_path):
    """Save after a flush, load into a new pipeline, continue: the same weights as an uninterrupted run,
    and the tied copies still agree (the delayed tied gradients were all applied by the flush)."""
    data = gpt_data(6)

    def pipeline():
        return Pipeline(gpt(), 4, algorithm, M, optimizer=SGD(lr=0.1, momentum=0.9), loss_fn=lm_loss)

    straight = pipeline()
    for i, (x, y) in enumerate(data):
        straight.step(x, y)
        if i == 2:
            straight.flush()
    straight.flush()
    first = pipeline()
    for x, y in data[:3]:
        first.step(x, y)
    first.flush()
    pipecore.checkpoint.save(first, tmp_path / "ckpt")
    resumed = pipeline()
    pipecore.checkpoint.load(resumed, tmp_path / "ckpt")
    for x, y in data[3:]:
        resumed.step(x, y)
    resumed.flush()
    a, b = straight.state_dict(), resumed.state_dict()
    for key in a:
        if key != "pipecore":
            assert torch.equal(a[key], b[key]), key
    assert torch.equal(b["tok_emb.weight"], b["head.weight"])
