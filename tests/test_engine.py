"""The training engine against plain training and against the simulator's version trace (CPU, float64)."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

import pipecore
from pipecore import AdamW, Pipeline, SGD
from pipecore.engine.stage import TensorStage
from pipecore.schedule.ir import B

from _same import assert_same

M = 4  # micro-batches per mini-batch in these tests


def mlp(num_linear: int, width: int = 6, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(num_linear):
        layers.append(nn.Linear(5 if i == 0 else width, 3 if i == num_linear - 1 else width))
        if i < num_linear - 1:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers).double()


def data(steps: int, batch: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(steps, batch, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (steps, batch), generator=g)


def sequential_reference(model, optimizer, xs, ys, per_update: int):
    """Plain training: each micro-batch loss / per_update, gradients accumulated, one step per group."""
    loss_fn = nn.CrossEntropyLoss()
    chunks = [(x, y) for X, Y in zip(xs, ys) for x, y in zip(X.split(X.shape[0] // M), Y.split(Y.shape[0] // M))]
    optimizer.zero_grad()
    for i, (x, y) in enumerate(chunks):
        (loss_fn(model(x), y) / per_update).backward()
        if (i + 1) % per_update == 0:
            optimizer.step()
            optimizer.zero_grad()
    return model


@pytest.mark.parametrize("algorithm", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_stages", [1, 2, 4])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_synchronous_equals_sequential_training(algorithm, num_stages, opt):
    xs, ys = data(5)
    if opt == "sgd":
        ours, theirs = SGD(lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True), torch.optim.SGD
        kwargs = dict(lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)
    else:
        ours, theirs = AdamW(lr=0.01, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1), torch.optim.AdamW
        kwargs = dict(lr=0.01, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1)
    pipe = Pipeline(mlp(4), num_stages, algorithm, M, optimizer=ours, loss_fn=nn.CrossEntropyLoss())
    for x, y in zip(xs, ys):
        pipe.step(x, y)
    ref = mlp(4)
    sequential_reference(ref, theirs(ref.parameters(), **kwargs), xs, ys, per_update=M)
    got = pipe.state_dict()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-12)


def test_input_that_requires_grad_is_left_alone_and_weights_match_plain_training():
    # The pipeline differentiates only its own weights (and stage inputs it received): a user's input
    # tensor that requires grad gets no gradient, and training is unchanged.
    xs, ys = data(3)
    xs.requires_grad_(True)
    pipe = Pipeline(mlp(4), 2, "1f1b", M, optimizer=SGD(lr=0.1), loss_fn=nn.CrossEntropyLoss())
    for x, y in zip(xs, ys):
        pipe.step(x, y)
    assert xs.grad is None
    ref = mlp(4)
    sequential_reference(ref, torch.optim.SGD(ref.parameters(), lr=0.1), xs.detach(), ys, per_update=M)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[key], value, rtol=0, atol=1e-12)


class _ScaledByAttribute(nn.Module):
    """A module that reads a tensor attribute requiring grad that is not a parameter: plain training
    accumulates into it, a pipeline must not (it differentiates its own weights and received inputs only)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.scale = torch.full((5,), 1.5, dtype=torch.float64, requires_grad=True)

    def forward(self, x):
        return self.inner(x * self.scale)


def _pipeline_with(model: nn.Module, num_stages: int = 2) -> Pipeline:
    return Pipeline(model, num_stages, "1f1b", M, optimizer=SGD(lr=0.1), loss_fn=nn.CrossEntropyLoss())


def test_backwards_accumulate_into_the_stage_leaves_only():
    # Every leaf a stage's backward reaches is its own (weight leaves, received inputs): its backwards then let
    # the engine accumulate into every leaf it reaches, which gives the same tensors the same gradients.
    xs, ys = data(3)
    pipe = _pipeline_with(mlp(4))
    for x, y in zip(xs, ys):
        pipe.step(x, y)
    assert [st._every_leaf for st in pipe.stages.values()] == [True, True]
    ref = mlp(4)
    sequential_reference(ref, torch.optim.SGD(ref.parameters(), lr=0.1), xs, ys, per_update=M)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[key], value, rtol=0, atol=1e-12)


def test_a_tensor_attribute_that_requires_grad_gets_no_gradient():
    # Its graph reaches a leaf that is not the stage's: that stage's backwards name their leaves.
    xs, ys = data(3)
    pipe = _pipeline_with(_ScaledByAttribute(mlp(4)))
    for x, y in zip(xs, ys):
        pipe.step(x, y)
    scale = pipe.stages[0].module.scale  # the stage's generated module reads the attribute itself
    assert scale.requires_grad and scale.grad is None
    assert pipe.stages[0]._every_leaf is False and pipe.stages[1]._every_leaf is True


def test_a_target_that_requires_grad_gets_no_gradient():
    # A target computed with autograd (say, a teacher's output): the last stage names its leaves for it.
    xs, ys = data(2)
    teacher = nn.Linear(5, 3).double()
    pipe = Pipeline(mlp(4), 2, "1f1b", M, optimizer=SGD(lr=0.1), loss_fn=nn.MSELoss())
    for x in xs:
        pipe.step(x, teacher(x))  # requires grad, through the teacher's parameters
    assert all(p.grad is None for p in teacher.parameters())
    assert pipe.stages[1]._every_leaf is None  # every backward named its leaves: the check never ran


def test_leaves_reached_lists_the_gradient_accumulators_of_a_graph():
    from pipecore.engine.autograd_call import leaves_reached

    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    c = torch.randn(3)  # no grad: not a leaf of the graph
    y = (a * b + c).sum() + a.sum()
    assert sorted(map(id, leaves_reached([y]))) == sorted(map(id, [a, b]))
    assert [id(t) for t in leaves_reached([a])] == [id(a)]  # a leaf itself


class _WithUnusedParameter(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.unused = nn.Parameter(torch.ones(2, dtype=torch.float64))

    def forward(self, x):
        return self.inner(x)


def test_a_parameter_that_takes_no_part_keeps_its_value():
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 6).double(), _WithUnusedParameter(nn.Linear(6, 3).double()))

    pipe = Pipeline(model(), 2, "1f1b", M, optimizer=SGD(lr=0.1), loss_fn=nn.CrossEntropyLoss())
    xs, ys = data(3)
    for x, y in zip(xs, ys):
        pipe.step(x, y)
    ref = model()
    sequential_reference(ref, torch.optim.SGD(ref.parameters(), lr=0.1), xs, ys, per_update=M)
    got = pipe.state_dict()
    assert torch.equal(got["1.unused"], torch.ones(2, dtype=torch.float64))
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-12)


def test_user_model_parameters_follow_the_live_weights():
    model = mlp(4)
    pipe = Pipeline(model, 2, "2bw", 2, optimizer=SGD(lr=0.1), loss_fn=nn.CrossEntropyLoss())
    xs, ys = data(3)
    for x, y in zip(xs, ys):
        pipe.step(x, y)
    pipe.flush()
    sd = pipe.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, sd[key])


def test_2bw_follows_delayed_update_rule():
    """theta(t+1) = theta(t) - lr * grad(theta(t-1)) on each mini-batch t (theta(-1) = theta(0))."""
    xs, ys = data(5)
    lr = 0.2
    pipe = Pipeline(mlp(4), 2, "2bw", M, optimizer=SGD(lr=lr), loss_fn=nn.CrossEntropyLoss())
    for x, y in zip(xs, ys):
        pipe.step(x, y)
    pipe.flush()
    loss_fn = nn.CrossEntropyLoss()
    model = mlp(4)
    params = [p.detach().clone() for p in model.parameters()]
    history = [params]
    for t, (X, Y) in enumerate(zip(xs, ys)):
        read = history[max(t - 1, 0)]
        with torch.no_grad():
            for p, v in zip(model.parameters(), read):
                p.copy_(v)
        model.zero_grad()
        loss_fn(model(X), Y).backward()  # the mean over the mini-batch = mean of the equal micro-batch means
        history.append([w - lr * p.grad for w, p in zip(history[-1], model.parameters())])
    sd = pipe.state_dict()
    for (name, _), expected in zip(model.named_parameters(), history[-1]):
        torch.testing.assert_close(sd[name], expected, rtol=0, atol=1e-12)


class Recorder:
    """Snapshots every stage's weights, update direction and velocity after each update."""

    def __init__(self, pipe: Pipeline):
        self.weights = [{0: st.ring.live.clone()} for st in pipe.stages.values()]
        self.direction = [{0: self._buffer(st, "direction")} for st in pipe.stages.values()]
        self.velocity = [{0: self._buffer(st, "velocity")} for st in pipe.stages.values()]
        self.applied_grads = [[] for _ in pipe.stages]
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.grad_in: dict[tuple[int, int], torch.Tensor] = {}
        self.grad_out: dict[tuple[int, int], torch.Tensor] = {}
        for st in pipe.stages.values():
            self._wrap(st)

    def _wrap(self, st: TensorStage) -> None:
        rec, s = self, st.stage
        update, forward, backward = st.compute_update, st.compute_forward, st.compute_backward

        def compute_update(action, info):
            rec.applied_grads[s].append(st.grad.clone())
            update(action, info)
            rec.direction[s][info.new_version] = rec._buffer(st, "direction")
            rec.weights[s][info.new_version] = st.ring.live.clone()
            rec.velocity[s][info.new_version] = rec._buffer(st, "velocity")

        def compute_forward(action, read, payload):
            out = forward(action, read, payload)
            rec.inputs[(s, action.index)] = payload
            rec.outputs[(s, action.index)] = out
            return out

        def compute_backward(action, reads, forward_reads, payloads):
            outs = backward(action, reads, forward_reads, payloads)
            for k, g_in, g_out in zip(action.microbatches, payloads, outs):
                rec.grad_in[(s, k)], rec.grad_out[(s, k)] = g_in, g_out
            return outs

        st.compute_update, st.compute_forward, st.compute_backward = compute_update, compute_forward, compute_backward

    @staticmethod
    def _buffer(st: TensorStage, name: str) -> torch.Tensor | None:
        return st.buffer(name).clone() if name in st.state.buffers else None

    def expected_weights(self, stage: int, read, lr: float) -> torch.Tensor:
        w = self.weights[stage][read.version]
        if read.derivation is None:
            return w
        if read.derivation == "interpolate":
            return w + read.coef * (self.weights[stage][read.other] - w)
        if read.derivation == "predict":
            return w - read.coef * lr * self.direction[stage][read.version].to(w.dtype)
        return w - read.coef * self.velocity[stage][read.version].to(w.dtype)


def linear_chain(num_stages: int, width: int = 3) -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(num_stages)]).double()


@pytest.mark.parametrize("algorithm,options", [
    ("pipemare", {"warmup_steps": 3}),
    ("spectrain", {}),
    ("timeprest", {}),
    ("v-timeprest", {}),
    ("i-timeprest", {"lam": 0.7}),
    ("i-timeprest", {"alpha": "inverse", "lam": 2.0}),
    ("pipedream", {}),
    ("pipedream", {"slack": 1}),
    ("2bw", {}),
])
def test_weights_read_by_each_action_match_the_simulated_trace(algorithm, options):
    """Each stage is one bias-free Linear: its output reveals the forward's weights (y = x W^T) and its input
    gradient reveals the backward's weights (dx = g W); both must equal what the simulator's trace says."""
    P, m, n, lr = 3, 3, 4, 0.05
    pipe = Pipeline(linear_chain(P), P, algorithm, m, optimizer=SGD(lr=lr, momentum=0.9),
                    loss_fn=lambda y, t: ((y - t) ** 2).mean(), **options)
    rec = Recorder(pipe)
    torch.manual_seed(5)
    for _ in range(n):
        pipe.step(torch.randn(m * 2, 3, dtype=torch.float64), torch.randn(m * 2, 3, dtype=torch.float64))
    pipe.flush()
    trace = pipecore.simulate(algorithm, P, m, n, **options)
    checked = 0
    for s in range(P):
        for k in range(m * n):
            w_f = rec.expected_weights(s, trace.read(s, k, "F"), lr)
            x = rec.inputs[(s, k)]
            if s < P - 1:
                torch.testing.assert_close(rec.outputs[(s, k)], x @ w_f.view(3, 3).T, rtol=0, atol=1e-12)
            if s > 0:
                w_b = rec.expected_weights(s, trace.read(s, k, "B"), lr)
                g = rec.grad_in[(s, k)] if s < P - 1 else None
                if g is not None:
                    torch.testing.assert_close(rec.grad_out[(s, k)], g @ w_b.view(3, 3), rtol=0, atol=1e-12)
                    checked += 1
    assert checked == (P - 2) * m * n


def test_pipedream_gradients_are_exact_for_the_stashed_versions():
    """Each stage's update uses the exact gradient of the model evaluated with every stage at the version
    its forward read (weight stashing is exact); stage s holds P-s versions."""
    P, m, n, lr = 3, 3, 3, 0.1
    model = linear_chain(P)
    loss_fn = lambda y, t: ((y - t) ** 2).mean()
    pipe = Pipeline(model, P, "pipedream", m, optimizer=SGD(lr=lr), loss_fn=loss_fn)
    rec = Recorder(pipe)
    torch.manual_seed(7)
    batches = [(torch.randn(m, 3, dtype=torch.float64), torch.randn(m, 3, dtype=torch.float64)) for _ in range(n)]
    for x, y in batches:
        pipe.step(x, y)
    pipe.flush()
    assert [s["weight_versions"] for s in pipe.stats()] == [P - s for s in range(P)]
    trace = pipecore.simulate("pipedream", P, m, n)
    xs = torch.cat([x for x, _ in batches]).split(1)
    ys = torch.cat([y for _, y in batches]).split(1)
    for k in range(m * n):
        ws = [rec.weights[s][trace.version(s, k, "F")].view(3, 3).clone().requires_grad_() for s in range(P)]
        h = xs[k]
        for w in ws:
            h = h @ w.T
        grads = torch.autograd.grad(loss_fn(h, ys[k]), ws)
        for s in range(P):
            torch.testing.assert_close(rec.applied_grads[s][k].view(3, 3), grads[s], rtol=0, atol=1e-12)


@pytest.mark.parametrize("rule", ["swap", "recompute", "stash"])
def test_backward_rules_match_their_closed_forms(rule):
    """Spec 1.3's scalar check on a stale stage holding a = w1*x, y = w2*a (then a fixed last stage): with
    incoming gradient g, swap gives g_w2 = g*a_F, g_w1 = g*w2_B*x; recompute g_w2 = g*(w1_B*x),
    g_w1 = g*w2_B*x; stash g_w2 = g*a_F, g_w1 = g*w2_F*x."""
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)).double()
    P, m = 2, 1
    pipe = Pipeline(model, P, "v-timeprest", m, optimizer=SGD(lr=0.3), partition=[2],
                    loss_fn=lambda y, t: ((y - t) ** 2).mean(), backward_rule=rule)
    rec = Recorder(pipe)
    samples = [(torch.tensor([[0.5 + k]], dtype=torch.float64), torch.tensor([[1.0 - k]], dtype=torch.float64))
               for k in range(4)]
    for x, y in samples:
        pipe.step(x, y)
    pipe.flush()
    trace = pipecore.simulate("v-timeprest", P, m, len(samples), backward_rule=rule)
    stale = 0
    for k, (x, _) in enumerate(samples):
        f = rec.weights[0][trace.version(0, k, "F")]
        b = rec.weights[0][trace.read(0, k, "B").version] if rule != "stash" else f
        stale += int(not torch.equal(f, b))
        w1_f, w2_f, w1_b, w2_b = f[0], f[1], b[0], b[1]
        g = rec.grad_in[(0, k)].item()
        a_f = w1_f * x.item()
        if rule == "swap":
            expected = [g * w2_b * x.item(), g * a_f]
        elif rule == "recompute":
            expected = [g * w2_b * x.item(), g * w1_b * x.item()]
        else:
            expected = [g * w2_f * x.item(), g * a_f]
        torch.testing.assert_close(rec.applied_grads[0][k], torch.stack(expected), rtol=0, atol=1e-12)
    if rule != "stash":
        assert stale > 0, "the test needs backwards that read other weights than their forwards"


# 2BW is excluded on purpose: its one-version delay is part of its update rule at any depth
# (theta(t+1) = theta(t) - lr*grad(theta(t-1)), tested above), so its reads are never the live weights.
# The V placements (zb-v, dualpipe-v) put two stages on every rank: they need an even number of stages.
V_SHAPED = ("zb-v", "dualpipe-v")


@pytest.mark.parametrize("algorithm", [a for a in pipecore.algorithm_names() if a != "2bw" and a not in V_SHAPED])
def test_single_stage_reduces_to_plain_sgd(algorithm):
    xs, ys = data(4)
    pipe = Pipeline(mlp(3), 1, algorithm, M, optimizer=SGD(lr=0.1, momentum=0.5), loss_fn=nn.CrossEntropyLoss())
    for x, y in zip(xs, ys):
        pipe.step(x, y)
    pipe.flush()
    ref = mlp(3)
    # The Nesterov method takes the momentum as its look-ahead: without delay, SGD with Nesterov's momentum.
    nesterov = algorithm == "nesterov-async"
    sequential_reference(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5, nesterov=nesterov), xs, ys,
                         per_update=pipe.algorithm.update_every)
    got = pipe.state_dict()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-12)


def test_torch_optimizer_factory_runs_unfused():
    import functools

    xs, ys = data(3)
    pipe = Pipeline(mlp(4), 2, "1f1b", M, optimizer=functools.partial(torch.optim.RMSprop, lr=0.01),
                    loss_fn=nn.CrossEntropyLoss())
    for x, y in zip(xs, ys):
        pipe.step(x, y)
    ref = mlp(4)
    sequential_reference(ref, torch.optim.RMSprop(ref.parameters(), lr=0.01), xs, ys, per_update=M)
    got = pipe.state_dict()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-12)


RESUME_SCRIPT = textwrap.dedent("""
    import sys, torch
    from torch import nn
    import pipecore
    torch.manual_seed(0)
    layers = []
    for i in range(4):
        layers.append(nn.Linear(5 if i == 0 else 6, 3 if i == 3 else 6))
        if i < 3:
            layers.append(nn.Tanh())
    model = nn.Sequential(*layers).double()
    pipe = pipecore.Pipeline(model, 2, sys.argv[1], 2, optimizer=pipecore.SGD(lr=0.1, momentum=0.9),
                             loss_fn=nn.CrossEntropyLoss())
    pipe.load_state_dict(torch.load(sys.argv[2], weights_only=False))
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        pipe.step(torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g))
    pipe.flush()
    torch.save(pipe.state_dict(), sys.argv[3])
""")


@pytest.mark.parametrize("algorithm", ["1f1b", "pipedream", "2bw", "pipemare", "i-timeprest"])
def test_checkpoint_resumes_bit_identically_in_a_new_process(algorithm, tmp_path):
    def build():
        return Pipeline(mlp(4), 2, algorithm, 2, optimizer=SGD(lr=0.1, momentum=0.9), loss_fn=nn.CrossEntropyLoss())

    xs, ys = data(3, batch=4)
    pipe = build()
    for x, y in zip(xs, ys):
        pipe.step(x, y)
    pipe.flush()
    ckpt = tmp_path / "ckpt.pt"
    torch.save(pipe.state_dict(), ckpt)
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        pipe.step(torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g))
    pipe.flush()
    uninterrupted = pipe.state_dict()
    out = tmp_path / "resumed.pt"
    subprocess.run([sys.executable, "-c", RESUME_SCRIPT, algorithm, str(ckpt), str(out)], check=True)
    resumed = torch.load(out, weights_only=False)
    for key, value in uninterrupted.items():
        if key == "pipecore":
            for s, a in value["stages"].items():
                b = resumed[key]["stages"][s]
                assert (a["version"], a["updates"]) == (b["version"], b["updates"])
        else:
            assert torch.equal(value, resumed[key]), key


@pytest.mark.parametrize("algorithm,options", [(a, {}) for a in pipecore.algorithm_names() if a not in V_SHAPED] + [
    ("pipemare", {"backward_rule": "stash"}), ("pipemare", {"backward_rule": "recompute"}),
    ("i-timeprest", {"backward_rule": "recompute"}), ("pipedream", {"update_every": 2}),
])
def test_split_backward_is_bit_identical(algorithm, options):
    """Input gradient first, weight gradients after the send: the same losses and weights, bit for bit."""
    xs, ys = data(4)
    runs = []
    for split in (False, True):
        pipe = Pipeline(mlp(6), 3, algorithm, M, optimizer=SGD(lr=0.1, momentum=0.9),
                        loss_fn=nn.CrossEntropyLoss(), split_backward=split, **options)
        losses = [pipe.step(x, y) for x, y in zip(xs, ys)]
        pipe.flush()
        runs.append((losses, pipe.state_dict()))
        assert [st.split_backward for st in pipe.stages.values()] == [False, split, split]
    (losses, state), (split_losses, split_state) = runs
    assert split_losses == losses
    for key, value in state.items():
        if key != "pipecore":
            assert torch.equal(split_state[key], value), key


@pytest.mark.parametrize("slack", [1, 2])
def test_2bw_slack_changes_no_bit(slack):
    """2BW reads versions by micro-batch index, so warm-up slack moves when messages are needed but leaves
    every loss and weight the same, bit for bit, while stage 0 holds more activations."""
    xs, ys = data(5, batch=16)
    runs = []
    for option in (0, slack):
        pipe = Pipeline(mlp(6), 3, "2bw", 8, optimizer=SGD(lr=0.1, momentum=0.9), loss_fn=nn.CrossEntropyLoss(),
                        slack=option)
        losses = [pipe.step(x, y) for x, y in zip(xs, ys)]
        in_flight = pipe.in_flight
        pipe.flush()
        runs.append((losses, pipe.state_dict(), in_flight))
    (losses, state, in_flight), (slack_losses, slack_state, slack_in_flight) = runs
    assert slack_losses == losses
    for key, value in state.items():
        if key != "pipecore":
            assert torch.equal(slack_state[key], value), key
    # stages 0 and 1 each keep (P-s-1)*slack more forwards ahead of their backwards
    assert slack_in_flight - in_flight == (2 + 1) * slack


def test_split_backward_defers_weight_gradients_until_after_the_send():
    """The input gradient leaves before the stage's weight gradients are accumulated."""
    pipe = Pipeline(mlp(4), 2, "1f1b", M, loss_fn=nn.CrossEntropyLoss(), split_backward=True)
    stage = pipe.stages[1]
    seen = []
    send = pipe._parts.transport.send

    def spy(target_stage, kind, microbatch, message):
        if kind is B:  # a gradient message, from stage 1
            seen.append((float(stage.grad.abs().sum()), bool(stage._deferred)))
        send(target_stage, kind, microbatch, message)

    pipe._parts.transport.send = spy
    x, y = data(1)
    pipe.step(x[0], y[0])
    assert len(seen) == M
    assert seen[0][0] == 0.0  # nothing accumulated yet when the first input gradient left
    assert all(pending for _, pending in seen)  # every send left before its weight gradients were computed
    assert not stage._deferred
    assert stage.grad.abs().sum() == 0.0  # all of them applied by the update


# -- bad input: a clear error, nothing half-done -----------------------------------------------------


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match="larger than the number of modules"):
        Pipeline(mlp(2), 5, "gpipe", 2, loss_fn=nn.CrossEntropyLoss())


def test_batch_smaller_than_the_micro_batches():
    # Batches that do not divide are split as torch.tensor_split does (tests/test_batches.py); a micro-batch
    # cannot be empty.
    pipe = Pipeline(mlp(3), 2, "gpipe", 4, loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="batch of 3 samples is smaller than n_microbatches=4"):
        pipe.step(torch.randn(3, 5, dtype=torch.float64), torch.zeros(3, dtype=torch.long))


def test_shape_mismatch_between_stages_names_both():
    model = nn.Sequential(nn.Linear(5, 4), nn.Linear(7, 3)).double()
    pipe = Pipeline(model, 2, "gpipe", 2, loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
        pipe.step(torch.randn(4, 5, dtype=torch.float64), torch.zeros(4, dtype=torch.long))
    assert "raised by stage 1's forward, given stage 0's output of shape (2, 4)" in info.value.__notes__[0]


def test_dtype_mismatch_between_stages_names_both():
    model = nn.Sequential(nn.Linear(5, 4).double(), nn.Linear(4, 3).float())
    pipe = Pipeline(model, 2, "gpipe", 2, loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="stage 0 sends activations of dtype torch.float64.*stage 1 has torch.float32"):
        pipe.step(torch.randn(4, 5, dtype=torch.float64), torch.zeros(4, dtype=torch.long))


def test_split_backward_must_be_a_bool():
    with pytest.raises(TypeError, match="split_backward must be True or False"):
        Pipeline(mlp(2), 2, "1f1b", 2, loss_fn=nn.CrossEntropyLoss(), split_backward="yes")


def test_unknown_algorithm_and_option():
    with pytest.raises(ValueError, match="unknown algorithm 'pipedraem'.*valid names: gpipe"):
        Pipeline(mlp(3), 2, "pipedraem", 2, loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['lamda'\].*valid options: alpha, backward_rule, degree, lam"):
        Pipeline(mlp(3), 2, "i-timeprest", 2, loss_fn=nn.CrossEntropyLoss(), lamda=0.5)


class LossFailed(RuntimeError):
    """What the loss function of the next test raises."""


@pytest.mark.parametrize("error", [RuntimeError, LossFailed, KeyError])
def test_a_loss_functions_own_error_reaches_step_as_itself(error):
    def loss_fn(out, target):
        raise error("the loss function's own message")

    pipe = Pipeline(mlp(3), 2, "gpipe", 2, loss_fn=loss_fn, concurrent=False)
    with pytest.raises(error, match="the loss function's own message") as info:
        pipe.step(torch.randn(4, 5, dtype=torch.float64), torch.zeros(4, dtype=torch.long))
    assert type(info.value) is error
    assert any("raised by loss_fn, given the last stage's output of shape (2, 3)" in n for n in info.value.__notes__)


def test_nonfinite_loss_raises_naming_stage_and_microbatch():
    pipe = Pipeline(mlp(3), 2, "gpipe", 2, loss_fn=nn.CrossEntropyLoss())
    before = pipe.state_dict()
    x = torch.randn(4, 5, dtype=torch.float64)
    x[3, 0] = math.nan
    with pytest.raises(pipecore.NonFiniteLoss, match="stage 1, micro-batch 1"):
        pipe.step(x, torch.zeros(4, dtype=torch.long))
    for st in pipe.stages.values():  # no update ran
        assert st.book.live == 0
    params = {k: v for k, v in before.items() if k != "pipecore"}
    for st in pipe.stages.values():
        for name, value in st.live_parameters().items():
            assert torch.equal(value, params[name])


@pytest.mark.parametrize("algorithm", ["gpipe", "pipedream"])
def test_nonfinite_loss_skip_leaves_weights_untouched(algorithm):
    pipe = Pipeline(mlp(3), 2, algorithm, 2, loss_fn=nn.CrossEntropyLoss(), on_nonfinite="skip",
                    optimizer=SGD(lr=0.1, momentum=0.9))
    before = pipe.state_dict()
    x = torch.full((4, 5), math.nan, dtype=torch.float64)
    loss = pipe.step(x, torch.zeros(4, dtype=torch.long))
    pipe.flush()
    assert math.isnan(loss)
    after = pipe.state_dict()
    for key, value in before.items():
        if key != "pipecore":
            assert torch.equal(value, after[key]), key
    for st in pipe.stages.values():
        assert st.optimizer.steps == 0  # optimizer state untouched too
    # and training continues normally afterwards
    assert math.isfinite(pipe.step(torch.randn(4, 5, dtype=torch.float64), torch.zeros(4, dtype=torch.long)))


def test_load_state_dict_key_mismatch():
    pipe = Pipeline(mlp(3), 2, "gpipe", 2, loss_fn=nn.CrossEntropyLoss())
    sd = pipe.state_dict()
    sd["extra.weight"] = sd.pop("0.weight")
    with pytest.raises(KeyError, match=r"missing keys \['0.weight'\], unexpected keys \['extra.weight'\]"):
        pipe.load_state_dict(sd)


def test_state_dict_requires_flush_for_async():
    pipe = Pipeline(mlp(3), 2, "pipedream", 2, loss_fn=nn.CrossEntropyLoss())
    pipe.step(torch.randn(4, 5, dtype=torch.float64), torch.zeros(4, dtype=torch.long))
    with pytest.raises(RuntimeError, match="call flush"):
        pipe.state_dict()
    pipe.flush()
    assert set(pipe.state_dict()) == set(mlp(3).state_dict()) | {"pipecore"}


def test_close_flushes_then_refuses_to_train():
    xs, ys = data(3)
    closed, flushed = (Pipeline(mlp(3), 2, "2bw", 2, loss_fn=nn.CrossEntropyLoss()) for _ in range(2))
    for x, y in zip(xs, ys):
        closed.step(x, y)
        flushed.step(x, y)
    assert closed.in_flight > 0
    closed.close()
    flushed.flush()
    assert closed.in_flight == 0
    a, b = closed.state_dict(), flushed.state_dict()  # still readable after close
    for key in a:
        if key != "pipecore":
            assert torch.equal(a[key], b[key]), key
    for call in (lambda: closed.step(xs[0], ys[0]), closed.flush):
        with pytest.raises(RuntimeError, match="closed; build a new Pipeline"):
            call()
    closed.close()  # a second close does nothing


def test_with_block_closes_and_an_error_inside_is_not_masked():
    xs, ys = data(2)
    with Pipeline(mlp(3), 2, "pipedream", 2, loss_fn=nn.CrossEntropyLoss()) as pipe:
        pipe.step(xs[0], ys[0])
    assert pipe.in_flight == 0
    with pytest.raises(RuntimeError, match="closed"):
        pipe.step(xs[1], ys[1])
    with pytest.raises(ValueError, match="smaller than n_microbatches"):
        with Pipeline(mlp(3), 2, "pipedream", 2, loss_fn=nn.CrossEntropyLoss()) as failed:
            failed.step(xs[0], ys[0])
            failed.step(xs[1][:1], ys[1][:1])
    with pytest.raises(RuntimeError, match="closed"):
        failed.step(xs[1], ys[1])


def test_stats_report_versions_and_bytes():
    pipe = Pipeline(mlp(4), 3, "pipedream", 3, loss_fn=nn.CrossEntropyLoss())
    for _ in range(3):
        pipe.step(torch.randn(6, 5, dtype=torch.float64), torch.zeros(6, dtype=torch.long))
    stats = pipe.stats()
    for s, st in enumerate(stats):
        assert st["weight_versions"] == 3 - s
        assert st["weight_version_bytes"] == (3 - s) * st["parameters"] * 8
        assert set(st["seconds_per_action"]) >= {"F", "B", "U"}
    assert stats[0]["delay_max"] == 2 and stats[2]["delay_max"] == 0


def test_seconds_per_action_is_a_median_that_one_slow_action_does_not_move():
    pipe = Pipeline(mlp(3), 2, "1f1b", 2, loss_fn=nn.CrossEntropyLoss())
    for _ in range(3):
        pipe.step(torch.randn(4, 5, dtype=torch.float64), torch.zeros(4, dtype=torch.long))
    st = pipe.stages[0]
    st._forward_times.add_since(time.perf_counter() - 5.0)  # one forward that took 5 s (a one-time import, a GC pass)
    assert pipe.stats()[0]["seconds_per_action"]["F"] < 1.0
    assert st.seconds["F"] > 5.0  # the totals (the benchmarks' compute shares) still count it


def test_action_times_total_every_action_and_keep_the_recent_for_the_median():
    from pipecore.engine.action_times import KEPT, ActionTimes

    times = ActionTimes()
    n = 2 * KEPT + 10
    for i in range(n):  # action i took i ms (and the few microseconds of the call)
        times.add_since(time.perf_counter() - i / 1000)
    assert len(times.values) == KEPT  # bounded, however long the run
    assert times.total == pytest.approx(sum(range(n)) / 1000, rel=1e-4)
    assert times.median() == pytest.approx((n - 1 - (KEPT - 1) / 2) / 1000, abs=1e-4)  # of the last KEPT
    times.extend_last(1.0)  # deferred work of the last action adds to it
    assert times.values[(n - 1) % KEPT] == pytest.approx((n - 1) / 1000 + 1.0, abs=1e-4)


def test_full_state_dict_in_one_process_is_the_state_dict_and_parts_merge_back():
    from pipecore.engine.state_io import merge_state_dicts

    pipe = Pipeline(mlp(4), 2, "pipedream", 2, optimizer=SGD(lr=0.1, momentum=0.9), loss_fn=nn.CrossEntropyLoss())
    xs, ys = data(3, batch=4)
    for x, y in zip(xs, ys):
        pipe.step(x, y)
    pipe.flush()
    state = pipe.state_dict()
    assert_same(pipe.full_state_dict(), state)
    assert pipe.stats(all_stages=True) == pipe.stats()
    # What two ranks would hold, one stage each, merged in either order, is the whole state again.
    keys = [pipe.stages[s].module.state_dict().keys() for s in (0, 1)]
    parts = [{**{k: state[k] for k in keys[s]},
              "pipecore": {**state["pipecore"], "stages": {s: state["pipecore"]["stages"][s]}}} for s in (0, 1)]
    assert_same(merge_state_dicts(parts), state)
    assert_same(merge_state_dicts(parts[::-1])["pipecore"], state["pipecore"])
    with pytest.raises(ValueError, match="at least one"):
        merge_state_dicts([])


def test_load_state_dict_takes_a_state_that_holds_this_process_stages():
    def build():
        return Pipeline(mlp(4), 2, "1f1b", 2, optimizer=SGD(lr=0.1, momentum=0.9), loss_fn=nn.CrossEntropyLoss())

    pipe = build()
    xs, ys = data(2, batch=4)
    for x, y in zip(xs, ys):
        pipe.step(x, y)
    state = pipe.state_dict()
    one_stage = build()
    del one_stage.stages[1]  # as on rank 0 of two: only stage 0 is this process's
    one_stage.load_state_dict(state)  # the other stage's keys are ignored
    for name, value in one_stage.stages[0].live_parameters().items():
        assert torch.equal(value, state[name])
    with pytest.raises(KeyError, match=r"unexpected keys \['9.weight'\]"):
        one_stage.load_state_dict({**state, "9.weight": torch.zeros(1)})
    missing = {k: v for k, v in state.items() if k != "0.bias"}
    with pytest.raises(KeyError, match=r"missing keys \['0.bias'\]"):
        one_stage.load_state_dict(missing)
    no_stage_zero = {**state, "pipecore": {**state["pipecore"], "stages": {1: state["pipecore"]["stages"][1]}}}
    with pytest.raises(KeyError, match=r"no optimizer state or versions of stage\(s\) \[0\]"):
        one_stage.load_state_dict(no_stage_zero)
