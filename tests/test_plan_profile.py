"""``pipecore.planning.profiler``: per-node costs of a captured graph, measured on the CPU.

Byte figures are checked exactly on small hand-built models (float32: 4 bytes an element); times only for
being measured at all (positive where there is work, zero where a node has no backward)."""

from __future__ import annotations

import functools
import sys
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import pipecore
from pipecore.engine.graph import CaptureError, CapturedModel
from pipecore.models import GPT, ResNet
from pipecore.planning.costs import GraphCosts, TiedParameter, ValueCost
from pipecore.planning.profiler import profile

FAST = dict(warmup=0, repeats=1)  # where only bytes matter


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# -- bytes --------------------------------------------------------------------------------------------------


def test_linear_relu_bytes():
    x = torch.randn(5, 4)
    c = profile(mlp(), x, **FAST)
    assert isinstance(c, GraphCosts)
    assert c.names == ("_0", "_1", "_2")
    # A Linear saves its input (its weight is a parameter, left out); ReLU saves its output, which the second
    # Linear saves as its input: one tensor in training, charged once, to the first node that saves it.
    assert c.saved_bytes == (5 * 4 * 4, 5 * 3 * 4, 0)
    assert c.output_bytes == (5 * 3 * 4, 5 * 3 * 4, 5 * 2 * 4)
    assert c.param_bytes == ((4 * 3 + 3) * 4, 0, (3 * 2 + 2) * 4)
    assert c.crossing_bytes == (5 * 3 * 4, 5 * 3 * 4)
    assert c.input_bytes == 5 * 4 * 4
    assert c.microbatch_size == 5
    assert c.device == "cpu"


def test_float64_and_bfloat16_bytes():
    c = profile(mlp().double(), torch.randn(5, 4, dtype=torch.float64), **FAST)
    assert c.saved_bytes == (5 * 4 * 8, 5 * 3 * 8, 0)
    assert c.param_bytes == (15 * 8, 0, 8 * 8)
    c = profile(mlp().bfloat16(), torch.randn(5, 4).bfloat16(), optimizer=pipecore.AdamW(), **FAST)
    assert c.param_bytes == (15 * 2, 0, 8 * 2)
    # pipecore keeps optimizer state in float32 under bfloat16 weights: 2 buffers x 4 bytes an element.
    assert c.optimizer_bytes == (15 * 8, 0, 8 * 8)


@pytest.mark.parametrize("optimizer, per_element", [
    (None, 0),                                   # the pipeline's default: SGD without momentum
    (pipecore.SGD(lr=0.1), 0),
    (pipecore.SGD(lr=0.1, momentum=0.9), 4),     # one float32 buffer
    (pipecore.AdamW(lr=1e-3), 8),                # two float32 buffers
])
def test_optimizer_bytes_of_pipecore_optimizers(optimizer, per_element):
    c = profile(mlp(), torch.randn(5, 4), optimizer=optimizer, **FAST)
    assert c.optimizer_bytes == (15 * per_element, 0, 8 * per_element)


def test_optimizer_bytes_of_torch_optimizer_factories():
    x = torch.randn(5, 4)
    c = profile(mlp(), x, optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), **FAST)
    assert c.optimizer_bytes == (15 * 4, 0, 8 * 4)
    # Adam: two moments per element, and a float32 step counter per parameter tensor (weight and bias).
    c = profile(mlp(), x, optimizer=functools.partial(torch.optim.Adam, lr=1e-3), **FAST)
    assert c.optimizer_bytes == (15 * 8 + 2 * 4, 0, 8 * 8 + 2 * 4)
    c = profile(mlp().double(), x.double(), optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
                **FAST)
    assert c.optimizer_bytes == (15 * 8, 0, 8 * 8)


class TiedModule(nn.Module):
    """The head reuses the embedding's weight: once as a module, once as a get_attr argument."""

    def __init__(self, functional: bool):
        super().__init__()
        self.functional = functional
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.emb(idx))
        return F.linear(h, self.emb.weight) if self.functional else self.head(h)


@pytest.mark.parametrize("functional", [False, True])
def test_tied_parameter_is_charged_once_at_its_first_reader(functional):
    model = TiedModule(functional)
    weight_gradients = []
    model.emb.weight.register_hook(weight_gradients.append)
    c = profile(model, torch.randint(0, 10, (3, 5)), optimizer=pipecore.AdamW(), **FAST)
    assert len(weight_gradients) == 2  # both readers' backward compute a gradient of the parameter itself
    assert len(c) == 3
    assert c.param_bytes == (10 * 4 * 4, 0, 0)
    assert c.optimizer_bytes == (2 * 10 * 4 * 4, 0, 0)
    # The embedding saves its indices (int64); tanh saves its output, which the head saves as its input (charged
    # once, to tanh).
    assert c.saved_bytes == (3 * 5 * 8, 3 * 5 * 4 * 4, 0)
    # Both the embedding (node 0) and the head (node 2) read it: a stage holding the head holds it too.
    assert c.tied == (TiedParameter(10 * 4 * 4, 2 * 10 * 4 * 4, (0, 2)),)


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)         # no node reads it, nor any of its module
        self.b.extra = nn.Parameter(torch.zeros(7))  # b's forward does not read it

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_parameters_no_node_reads_are_charged_where_the_pipeline_keeps_them():
    c = profile(Unused(), torch.randn(2, 4), **FAST)
    linear = (16 + 4) * 4
    assert c.names == ("a", "relu", "b")
    assert c.param_bytes == (linear + linear, 0, linear + 7 * 4)
    assert sum(c.param_bytes) == sum(nbytes(p) for p in Unused().parameters())


class Residual(nn.Module):
    def __init__(self, return_hidden: bool = False):
        super().__init__()
        self.return_hidden = return_hidden
        self.lin1 = nn.Linear(4, 6)
        self.lin2 = nn.Linear(6, 6)

    def forward(self, x):
        h = self.lin1(x)
        z = self.lin2(torch.relu(h))
        return (z, h) if self.return_hidden else z + h


def test_crossing_bytes_with_a_skip_connection():
    s = 3 * 6 * 4  # bytes of every hidden value
    c = profile(Residual(), torch.randn(3, 4), **FAST)
    assert c.names == ("lin1", "relu", "lin2", "add")
    # h crosses every cut up to the addition; next to it the value the next node reads.
    assert c.crossing_bytes == (s, 2 * s, 2 * s)
    c = profile(Residual(return_hidden=True), torch.randn(3, 4), **FAST)
    assert c.names == ("lin1", "relu", "lin2")
    assert c.crossing_bytes == (s, 2 * s)  # h is part of the output: it crosses to the end


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(4, 6)
        self.lin2 = nn.Linear(6, 6)

    def forward(self, x, mask):
        h = self.lin2(torch.relu(self.lin1(x)))
        return h.masked_fill(mask, 0.0)


def test_crossing_bytes_with_a_mask_input_used_late():
    x, mask = torch.randn(3, 4), torch.rand(3, 6) > 0.5
    c = profile(Masked(), {"x": x, "mask": mask}, **FAST)
    assert c.names == ("lin1", "relu", "lin2", "masked_fill")
    s, m = 3 * 6 * 4, 3 * 6  # a bool is one byte
    assert c.crossing_bytes == (s + m, s + m, s + m)
    assert c.input_bytes == nbytes(x) + m
    assert c.saved_bytes[3] == m  # masked_fill keeps its mask
    assert profile(Masked(), (x, mask), **FAST).crossing_bytes == c.crossing_bytes


class Halves(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y[:, :1] * y[:, 1:2]


def test_saved_views_count_the_viewed_tensor_once():
    c = profile(Halves(), torch.randn(5, 4), **FAST)
    assert c.names[-1] == "mul"
    # mul saves two one-column views of y: they keep all of y alive, counted once.
    assert c.saved_bytes[-1] == 5 * 4 * 4
    assert c.output_bytes[1] == c.output_bytes[2] == 5 * 1 * 4  # the views' own elements


class Bump(nn.Module):
    """Writes its input in place without saying so (no ``inplace`` attribute, no trailing underscore)."""

    def forward(self, x):
        x.add_(1.0)
        return x


class Seen(nn.Module):
    """Keeps a copy of what it receives."""

    def forward(self, x):
        self.seen = x.detach().clone()
        return x


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)
        self.bump = Bump()
        self.out = nn.Linear(4, 4)
        self.seen = Seen()

    def forward(self, x):
        h = self.bump(self.act(self.lin(x)))
        h = h.mul_(2.0)
        return self.out(h) + self.seen(self.bump(x * 3.0))


def test_nodes_that_write_their_inputs_in_place():
    x = torch.randn(5, 4)
    before = x.clone()
    model = InPlace()
    c = profile(model, x, leaf_modules=[Bump, Seen], warmup=1, repeats=2)
    assert c.names == ("lin", "act", "bump", "mul_", "out", "mul", "bump_1", "seen", "add")
    assert c.saved_bytes[1] == 5 * 4 * 4  # an in-place ReLU saves its output
    assert all(t > 0 for t in c.forward_s)
    assert c.backward_s[2] > 0 and c.backward_s[3] > 0
    assert torch.equal(x, before)  # the caller's input is never written
    # Every run of the unannounced in-place write got its own copy: the next node sees one write, as in a forward.
    assert torch.equal(model.seen.seen, x * 3.0 + 1.0)


def test_crossing_bytes_match_what_split_sends():
    torch.manual_seed(0)
    model = GPT(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8)
    idx = torch.randint(0, 11, (2, 8))
    c = profile(model, idx, **FAST)
    captured = CapturedModel(model, example_input=idx)
    sizes: dict[str, int] = {}

    class Record(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            sizes[n.name] = nbytes(value) if isinstance(value, torch.Tensor) else \
                sum(nbytes(t) for t in value if isinstance(t, torch.Tensor)) if isinstance(value, tuple) else 0
            return value

    Record(captured.gm).run(idx)
    assert c.input_bytes == nbytes(idx)
    for cut in range(1, len(captured.nodes)):
        first = captured.split([cut])[0]
        assert c.crossing_bytes[cut - 1] == sum(sizes[name] for name in first.outputs), cut
    assert c.output_bytes == tuple(sizes[n.name] for n in captured.nodes)


# -- times ------------------------------------------------------------------------------------------------


def test_times_are_measured_for_every_node():
    model = ResNet(width=4, blocks=2)
    x = torch.randn(3, 64)
    c = profile(model, x, warmup=1, repeats=3)
    nodes = CapturedModel(model).nodes
    assert len(c) == len(nodes) and c.names == tuple(n.name for n in nodes)
    assert all(t > 0 for t in c.forward_s)
    # The input reshape has nothing to differentiate; every node after the first convolution has.
    assert c.names[0] == "reshape" and c.backward_s[0] == 0.0
    assert all(t > 0 for t in c.backward_s[1:])


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


@pytest.mark.parametrize("warmup, repeats", [(0, 1), (2, 5)])
def test_each_node_runs_once_to_count_saved_tensors_then_warmup_plus_repeats_times(warmup, repeats):
    leaf = Counting()
    model = nn.Sequential(leaf, nn.ReLU())
    profile(model, torch.randn(2, 3), leaf_modules=[Counting], warmup=warmup, repeats=repeats)
    assert leaf.calls == 1 + warmup + repeats


def test_backward_computes_input_and_weight_gradients():
    model = mlp()
    weight, backward = [], []
    model[2].weight.register_hook(weight.append)
    model[2].register_full_backward_pre_hook(lambda module, grad_output: backward.append(grad_output))
    profile(model, torch.randn(5, 4), warmup=1, repeats=3)
    assert len(weight) == len(backward) == 4  # warmup + repeats


# -- the model does not change ----------------------------------------------------------------------------


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(3 * 4 * 4, 2)

    def forward(self, x):
        h = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.head(h.flatten(1))


def test_model_state_grads_and_random_state_are_unchanged():
    torch.manual_seed(0)
    model = Noisy().train()
    model.conv.weight.grad = torch.full_like(model.conv.weight, 7.0)
    grad = model.conv.weight.grad
    params = list(model.parameters())
    buffers = list(model.buffers())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 1, 4, 4)
    rng = torch.get_rng_state()

    c = profile(model, x, optimizer=functools.partial(torch.optim.Adam, lr=0.1))

    assert len(c) == len(CapturedModel(model).nodes)
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert all(a is b for a, b in zip(model.buffers(), buffers))
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert int(model.bn.num_batches_tracked) == 0
    assert model.conv.weight.grad is grad and torch.equal(grad, torch.full_like(grad, 7.0))
    assert all(p.grad is None for p in params if p is not model.conv.weight)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training


def test_the_models_of_pipecore_at_tiny_sizes():
    torch.manual_seed(0)
    gpt = GPT(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=8)
    c = profile(gpt, torch.randint(0, 13, (2, 8)), optimizer=pipecore.AdamW(), **FAST)
    assert len(c) == len(CapturedModel(gpt).nodes) and c.microbatch_size == 2
    unique = sum(nbytes(p) for p in gpt.parameters())  # the tied head weight once
    assert sum(c.param_bytes) == unique and sum(c.optimizer_bytes) == 2 * unique
    assert c.param_bytes[c.names.index("head")] == 0  # its weight is the token embedding's, read first
    assert sum(c.saved_bytes) > 0

    resnet = ResNet(width=4, blocks=3).double()
    c = profile(resnet, torch.randn(3, 64, dtype=torch.float64), **FAST)
    assert len(c) == len(CapturedModel(resnet).nodes) and c.microbatch_size == 3
    assert sum(c.param_bytes) == sum(nbytes(p) for p in resnet.parameters())
    assert c.crossing_bytes[0] == 3 * 64 * 8  # the reshaped input
    assert c.output_bytes[-1] == 3 * 10 * 8


def test_a_model_without_parameters():
    model = nn.Sequential(nn.ReLU(), nn.Flatten())
    c = profile(model, torch.randn(2, 3, 4), **FAST)
    assert c.names == ("_0", "_1")
    assert c.param_bytes == (0, 0) and c.optimizer_bytes == (0, 0)
    assert c.saved_bytes == (0, 0) and c.backward_s == (0.0, 0.0)  # nothing carries a gradient
    assert c.crossing_bytes == (2 * 3 * 4 * 4,)


# -- progress and errors -------------------------------------------------------------------------------------


def test_progress_bar(capsys):
    profile(mlp(), torch.randn(5, 4), **FAST)
    assert capsys.readouterr().err == ""
    profile(mlp(), torch.randn(5, 4), progress=True, **FAST)
    assert "3/3" in capsys.readouterr().err


def test_progress_counter_without_tqdm(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm` fail
    profile(mlp(), torch.randn(5, 4), progress=True, **FAST)
    assert "profile: 3/3 nodes" in capsys.readouterr().err


# -- values: what recomputing a segment frees and holds ------------------------------------------------


def test_values_name_their_producer_savers_and_users():
    x = torch.randn(5, 4)
    c = profile(mlp(), x, **FAST)
    assert c.values == (
        ValueCost(-1, 5 * 4 * 4, savers=(0,), users=(0,)),   # the input: the first Linear saves it
        ValueCost(0, 5 * 3 * 4, savers=(), users=(1,)),      # ReLU saves its output, not its input
        ValueCost(1, 5 * 3 * 4, savers=(1, 2), users=(2,)),  # ... which the second Linear saves again
        ValueCost(2, 5 * 2 * 4, savers=(), users=(3,)),      # the graph's output (position 3)
    )


def test_values_of_a_reused_address_belong_to_the_node_that_made_them():
    """Values the profiler drops after their last use free their memory, which later nodes' outputs may reuse
    (as they do in this GPT with this allocator): each output of a module that makes a new tensor is still a
    value of its own node."""
    torch.manual_seed(0)
    model = GPT(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64)
    c = profile(model, torch.randint(0, 64, (8, 32)))
    captured = CapturedModel(model)
    makers = [i for i, node in enumerate(captured.nodes) if node.op == "call_module"
              and isinstance(captured.gm.get_submodule(str(node.target)), (nn.Linear, nn.LayerNorm, nn.GELU))]
    assert len(makers) == 2 * 7 + 2  # per block ln1, qkv, proj, ln2, fc, act, proj; then ln_f and head
    assert set(makers) <= {v.producer for v in c.values}


class SizeCrosses(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 6)

    def forward(self, x):
        n = x.size(0)  # an int, used after both layers
        return self.b(torch.relu(self.a(x))).reshape(n, 2, 3)


def test_cuts_that_a_value_other_than_a_tensor_would_cross_are_uncuttable():
    c = profile(SizeCrosses(), torch.randn(5, 4), **FAST)
    assert c.names == ("size", "a", "relu", "b", "reshape")
    assert c.uncuttable == (1, 2, 3, 4)  # the size crosses every cut after it is taken
    sizing = pipecore.planning.Sizing.of("1f1b", 2, 2)  # so no partition into two stages exists
    with pytest.raises(ValueError, match="values that are not tensors cross the others"):
        pipecore.planning.partition(c, 2, "time", sizing)


@pytest.mark.filterwarnings("ignore:Using a target size")
def test_the_loss_is_measured_when_given():
    x, target = torch.randn(5, 4), torch.randn(5, 2)
    c = profile(mlp(), x, loss_fn=F.mse_loss, example_target=target, **FAST)
    # mse_loss saves the model's output (no node saved it) and the target.
    assert c.loss_saved_bytes == 5 * 2 * 4 + 5 * 2 * 4
    assert c.loss_s > 0
    plain = profile(mlp(), x, **FAST)
    assert (plain.loss_saved_bytes, plain.loss_s) == (0, 0.0)
    with pytest.raises(TypeError, match="give loss_fn and example_target together"):
        profile(mlp(), x, loss_fn=F.mse_loss)
    with pytest.raises(RuntimeError, match="loss_fn failed on the model's output and example_target"):
        profile(mlp(), x, loss_fn=F.mse_loss, example_target=torch.randn(3, 3), **FAST)


def test_bad_input_gives_clear_errors():
    x = torch.randn(5, 4)
    with pytest.raises(TypeError, match="example_input"):
        profile(mlp(), None)
    with pytest.raises(RuntimeError, match=r"node '_0' \(call_module 0\) failed on the example input"):
        profile(mlp(), torch.randn(5, 7))
    with pytest.raises(ValueError, match="scalar"):
        profile(mlp(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="no samples"):
        profile(mlp(), torch.randn(0, 4))
    with pytest.raises(ValueError, match="different sizes along dimension 0"):
        profile(Masked(), (x, torch.zeros(3, 6, dtype=torch.bool)))
    with pytest.raises(KeyError, match="missing"):
        profile(Masked(), {"x": x})
    with pytest.raises(TypeError, match="must be a tensor"):
        profile(mlp(), [[1.0, 2.0]])
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        profile(mlp(), x, repeats=0)
    with pytest.raises(ValueError, match="warmup must be >= 0"):
        profile(mlp(), x, warmup=-1)
    with pytest.raises(TypeError, match="repeats must be an int"):
        profile(mlp(), x, repeats=2.0)
    with pytest.raises(TypeError, match="optimizer must be"):
        profile(mlp(), x, optimizer="adam")
    with pytest.raises(TypeError, match="must return a torch.optim.Optimizer"):
        profile(mlp(), x, optimizer=lambda params: None)

    class Branchy(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x

    with pytest.raises(CaptureError):
        profile(Branchy(), x)


def test_exported_from_pipecore_planning():
    import pipecore.planning

    assert pipecore.planning.profile is profile and "profile" in pipecore.planning.__all__
