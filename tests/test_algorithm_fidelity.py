"""Each algorithm's distinguishing rule, checked on real tensors against a reference written independently of
the code that implements it: PipeMare's per-stage learning-rate rescheduling (T1) and velocity (T2),
SpecTrain's weight prediction and update direction.

The model of most checks is a chain of bias-add stages, ``y = x + b_s``, with the loss ``mean(sum(y * t))``:
every stage's gradient is the mean target, whatever the weights, so the weights after any number of updates
have a closed form.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from pipecore import SGD, AdamW, Pipeline
from pipecore.engine.flat import FlatLayout
from pipecore.engine.optim import SGD as SGDConfig, build_optimizer, uniform_scale
from pipecore.algorithms.state import ChangeAverage


class Shift(nn.Module):
    """``y = x + b``: the gradient of ``b`` does not depend on any weight."""

    def __init__(self, width: int, start: float):
        super().__init__()
        self.b = nn.Parameter(torch.full((width,), start, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b


def shift_chain(num_stages: int, width: int = 3) -> nn.Sequential:
    return nn.Sequential(*[Shift(width, 0.1 * (s + 1)) for s in range(num_stages)])


def linear_loss(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (y * t).sum(dim=1).mean()


TARGET = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)  # the gradient of every b


def constant_gradient_batches(n: int, samples: int):
    torch.manual_seed(0)
    return [(torch.randn(samples, 3, dtype=torch.float64), TARGET.expand(samples, 3).clone()) for _ in range(n)]


class ReadSpy:
    """Records, per stage, the weights each forward and each backward computed with (the output of
    ``materialize``), and the live weights after every update, by version."""

    def __init__(self, pipe: Pipeline):
        self.reads: list[tuple[int, str, object, torch.Tensor]] = []
        self.history = {s: {0: st.ring.live.clone()} for s, st in pipe.stages.items()}
        for st in pipe.stages.values():
            self._wrap(st)

    def _wrap(self, st) -> None:
        spy, phase = self, ["F"]
        materialize, forward, backward, update = st.materialize, st.compute_forward, st.compute_backward, st.compute_update

        def spy_materialize(read):
            out = materialize(read)
            spy.reads.append((st.stage, phase[0], read, out.clone()))
            return out

        def spy_forward(*args):
            phase[0] = "F"
            return forward(*args)

        def spy_backward(*args):
            phase[0] = "B"
            return backward(*args)

        def spy_update(action, info):
            update(action, info)
            spy.history[st.stage][info.new_version] = st.ring.live.clone()

        st.materialize, st.compute_forward, st.compute_backward, st.compute_update = (
            spy_materialize, spy_forward, spy_backward, spy_update)


@pytest.mark.parametrize("P", [4, 5])
def test_spectrain_predicts_the_weights_s_updates_ahead_under_a_constant_gradient(P):
    """Under a constant gradient and plain SGD, W - s*lr*g is exactly the live weights s updates later. Every
    forward (s_f = s//2 + P-s-1) and every backward (s_b = s//2, nonzero from stage 2 on) must read them."""
    m, n, lr = 2, 6, 0.125
    pipe = Pipeline(shift_chain(P), P, "spectrain", m, optimizer=SGD(lr=lr), loss_fn=linear_loss)
    spy = ReadSpy(pipe)
    for x, y in constant_gradient_batches(n, 2 * m):
        pipe.step(x, y)
    pipe.flush()
    checked = {"F": 0, "B": 0}
    for stage, phase, read, weights in spy.reads:
        horizon = stage // 2 + (P - stage - 1 if phase == "F" else 0)
        assert read.version + horizon >= 0
        if read.version == 0:
            continue  # before the first update the direction is unknown (zero): the live weights are read
        future = spy.history[stage].get(read.version + horizon)
        if future is None:
            continue  # the run ended before that version existed
        torch.testing.assert_close(weights, future, rtol=0, atol=1e-12)
        if horizon > 0:
            checked[phase] += 1
    assert checked["F"] > 0
    assert checked["B"] > 0  # the backward prediction of stages >= 2 was exercised


@pytest.mark.parametrize("config", [
    SGDConfig(lr=0.1, momentum=0.9),
    SGDConfig(lr=0.1, momentum=0.9, dampening=0.3),
    SGDConfig(lr=0.1, momentum=0.9, nesterov=True),
    SGDConfig(lr=0.1, momentum=0.5, weight_decay=0.01),
    SGDConfig(lr=0.1),
    SGDConfig(lr=0.1, weight_decay=0.1),
], ids=["momentum", "dampening", "nesterov", "weight-decay", "plain", "plain-weight-decay"])
def test_sgd_direction_is_the_next_step_of_torch_sgd_with_the_last_gradient_again(config):
    """The prediction direction: the step torch.optim.SGD would take next (per unit of learning rate) if the
    next gradient equalled the last one; for plain momentum, the official SpecTrain ``momentum*buf + g``."""
    torch.manual_seed(1)
    w0 = torch.randn(7, dtype=torch.float64)
    grads = [torch.randn(7, dtype=torch.float64) for _ in range(3)]
    layout = FlatLayout.of(nn.Linear(7, 1, bias=False).double(), 0)
    ours = config.build(layout, torch.device("cpu"))
    ours.check_next_step_direction()
    w = w0.clone()
    p = nn.Parameter(w0.clone())
    ref = torch.optim.SGD([p], lr=config.lr, momentum=config.momentum, dampening=config.dampening,
                          weight_decay=config.weight_decay, nesterov=config.nesterov)
    direction = torch.empty(7, dtype=torch.float64)
    for g in grads:
        ours.step(w, g, w, uniform_scale(7, 1.0))
        ours.next_step_direction(g, w, out=direction)  # what SpecTrain's buffer update runs after each update
        p.grad = g.clone()
        ref.step()
    torch.testing.assert_close(w, p.detach(), rtol=0, atol=1e-14)
    buffer = ref.state[p].get("momentum_buffer")
    official = None if buffer is None else config.momentum * buffer + grads[-1]
    before = p.detach().clone()
    p.grad = grads[-1].clone()
    ref.step()
    expected = (before - p.detach()) / config.lr
    torch.testing.assert_close(direction, expected, rtol=1e-12, atol=1e-14)
    if config.momentum and not (config.dampening or config.nesterov or config.weight_decay):
        torch.testing.assert_close(direction, official, rtol=1e-12, atol=1e-14)


def test_torch_optimizers_cannot_predict_and_say_so_at_construction():
    import functools

    with pytest.raises(TypeError, match="weight prediction needs the optimizer's update direction"):
        Pipeline(shift_chain(2), 2, "spectrain", 2, optimizer=functools.partial(torch.optim.RMSprop, lr=0.01),
                 loss_fn=linear_loss)


def t1_scale(tau: int, update: int, warmup: int) -> float:
    """PipeMare T1 (power form), written out: lr * tau^-(1 - min(u/K, 1))."""
    return tau ** -(1.0 - min(update / warmup, 1.0))


@pytest.mark.parametrize("rescheduling", [True, False])
def test_pipemare_t1_divides_each_stage_learning_rate_by_its_delay_then_anneals(rescheduling):
    """One update per micro-batch's backward: stage s's delay is P-1-s (1 for the last stage), and under a
    constant gradient g its weights after U updates are W0 - lr*g*sum_u scale(s, u). Without T1 every scale
    is 1."""
    P, m, n, lr, warmup = 4, 2, 5, 0.25, 6
    model = shift_chain(P)
    start = [mod.b.detach().clone() for mod in model]
    pipe = Pipeline(model, P, "pipemare", m, optimizer=SGD(lr=lr), loss_fn=linear_loss, warmup_steps=warmup,
                    lr_rescheduling=rescheduling)
    assert pipe.algorithm.update_every == 1
    for x, y in constant_gradient_batches(n, 2 * m):
        pipe.step(x, y)
    pipe.flush()
    state = pipe.state_dict()
    updates = m * n
    for s in range(P):
        tau = max(P - 1 - s, 1)
        scales = [t1_scale(tau, u, warmup) if rescheduling else 1.0 for u in range(updates)]
        expected = start[s] - lr * TARGET * math.fsum(scales)
        torch.testing.assert_close(state[f"{s}.b"], expected, rtol=0, atol=1e-12)
    if rescheduling:
        assert t1_scale(P - 1, 0, warmup) == pytest.approx(1 / 3)  # stage 0 starts at a third of the rate


def test_pipemare_first_update_of_each_stage_is_the_plain_gradient_over_its_delay():
    """On a real MLP: the first backward at each stage reads the initial weights (nothing was updated yet),
    so the first update is W0 - (lr / tau_s) * (gradient of micro-batch 0's loss), tau_s = P-1-s."""
    P, m, lr = 4, 4, 0.5
    torch.manual_seed(2)
    widths = [5, 6, 6, 6, 3]
    layers = [nn.Linear(a, b).double() for a, b in zip(widths, widths[1:])]
    model = nn.Sequential(*layers)
    reference = [(l.weight.detach().clone(), l.bias.detach().clone()) for l in layers]
    pipe = Pipeline(model, P, "pipemare", m, optimizer=SGD(lr=lr), loss_fn=nn.CrossEntropyLoss(),
                    warmup_steps=1000)
    firsts: dict[int, list[torch.Tensor]] = {}
    for s, st in pipe.stages.items():
        update = st.compute_update

        def first_update(action, info, st=st, update=update):
            update(action, info)
            firsts.setdefault(st.stage, [v.clone() for v in st.layout.views(st.ring.live).values()])

        st.compute_update = first_update
    x = torch.randn(4 * m, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (4 * m,))
    pipe.step(x, y)
    pipe.flush()
    plain = nn.Sequential(*[nn.Linear(a, b).double() for a, b in zip(widths, widths[1:])])
    with torch.no_grad():
        for layer, (weight, bias) in zip(plain, reference):
            layer.weight.copy_(weight)
            layer.bias.copy_(bias)
    nn.CrossEntropyLoss()(plain(x[:4]), y[:4]).backward()  # micro-batch 0, divided by update_every = 1
    for s in range(P):
        tau = max(P - 1 - s, 1)
        layer, (weight, bias) = plain[s], reference[s]
        got_weight, got_bias = firsts[s]
        torch.testing.assert_close(got_weight, weight - lr / tau * layer.weight.grad, rtol=0, atol=1e-12)
        torch.testing.assert_close(got_bias, bias - lr / tau * layer.bias.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("optimizer", [
    SGD(lr=0.1, momentum=0.9),  # the fused kernel adds the change in its own pass
    AdamW(lr=0.01),  # the default: the change is added after the step
    functools.partial(torch.optim.RMSprop, lr=0.01),  # a torch optimizer, over views of the new weights
], ids=["fused-sgd", "adamw", "torch-rmsprop"])
def test_pipemare_velocity_is_the_moving_average_of_weight_changes(optimizer):
    """T2's velocity, rebuilt from the recorded weight history: delta <- g*delta + (1-g)*(W_new - W_old) with
    g = D^(1/tau_s); the backward then reads W_live - tau*delta. PipeMare keeps one version, so every update
    overwrites the weights it changes, whichever optimizer runs it."""
    P, m, n = 3, 2, 4
    torch.manual_seed(4)
    model = nn.Sequential(*[nn.Linear(3, 3, bias=False) for _ in range(P)]).double()
    pipe = Pipeline(model, P, "pipemare", m, optimizer=optimizer,
                    loss_fn=lambda y, t: ((y - t) ** 2).mean(), warmup_steps=4)
    spy = ReadSpy(pipe)
    velocities = {s: {0: torch.zeros(9, dtype=torch.float64)} for s in range(P)}
    for s, st in pipe.stages.items():
        update = st.compute_update

        def with_velocity(action, info, st=st, update=update):
            update(action, info)
            velocities[st.stage][info.new_version] = st.buffer("velocity").clone()

        st.compute_update = with_velocity
    for _ in range(n):
        pipe.step(torch.randn(2 * m, 3, dtype=torch.float64), torch.randn(2 * m, 3, dtype=torch.float64))
    pipe.flush()
    corrected = 0
    for s in range(P):
        gamma = 0.1 ** (1 / max(P - 1 - s, 1))
        history = spy.history[s]
        delta = torch.zeros(9, dtype=torch.float64)
        for v in range(1, len(history)):
            delta = gamma * delta + (1 - gamma) * (history[v] - history[v - 1])
            torch.testing.assert_close(velocities[s][v], delta, rtol=0, atol=1e-14)
    for stage, phase, read, weights in spy.reads:
        if phase == "B" and read.derivation == "correct":
            expected = spy.history[stage][read.version] - read.coef * velocities[stage][read.version]
            torch.testing.assert_close(weights, expected, rtol=0, atol=1e-14)
            corrected += 1
    assert corrected > 0


@pytest.mark.parametrize("config", [
    SGD(lr=0.1, momentum=0.9, weight_decay=0.01),
    AdamW(lr=0.01),
    functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
], ids=["fused-sgd", "adamw", "torch-sgd"])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "next-slot"])
def test_a_step_averaging_the_change_makes_the_plain_step_and_adds_its_change(config, in_place):
    """step_averaging_change = step + (avg <- d*avg + (1-d)*(new - old)), whether the step overwrites the
    weights (one version: the old ones must be kept first) or writes the next slot; the fused SGD kernel
    folds the average into its pass and must give the same numbers."""
    torch.manual_seed(5)
    layout = FlatLayout.of(nn.Linear(6, 1, bias=False).double(), 0)
    plain, averaging = (build_optimizer(config, layout, torch.device("cpu")) for _ in range(2))
    w = torch.randn(6, dtype=torch.float64)
    w_plain, w_avg = w.clone(), w.clone()
    average = torch.randn(6, dtype=torch.float64)
    expected = average.clone()
    for _ in range(3):
        g = torch.randn(6, dtype=torch.float64)
        old = w_plain.clone()
        out_plain = w_plain if in_place else torch.empty_like(w_plain)
        plain.step(w_plain, g, out_plain, uniform_scale(6, 1.0))
        out_avg = w_avg if in_place else torch.empty_like(w_avg)
        averaging.step_averaging_change(w_avg, g, out_avg, uniform_scale(6, 1.0), average, 0.3)
        if not in_place:
            torch.testing.assert_close(w_avg, old, rtol=0, atol=0)  # the old weights are left as they were
        w_plain, w_avg = out_plain, out_avg
        expected = 0.3 * expected + 0.7 * (w_plain - old)
        torch.testing.assert_close(w_avg, w_plain, rtol=0, atol=0)
        torch.testing.assert_close(average, expected, rtol=0, atol=1e-15)


def test_the_change_average_refuses_a_decay_outside_zero_to_one():
    with pytest.raises(ValueError, match=r"0 <= decay < 1, got 1.0"):
        ChangeAverage(decay=1.0)


@pytest.mark.parametrize("correction", [True, False])
def test_pipemare_velocity_memory_is_reported_and_t2_off_keeps_none(correction):
    P = 3
    pipe = Pipeline(shift_chain(P), P, "pipemare", 2, optimizer=SGD(lr=0.1), loss_fn=linear_loss,
                    discrepancy_correction=correction)
    for stats in pipe.stats():
        st = pipe.stages[stats["stage"]]
        assert stats["buffers"] == ({"velocity": 3 * 8} if correction else {})  # 3 float64 biases, or nothing
        assert stats["buffer_bytes"] == (3 * 8 if correction else 0)
        assert ("velocity" in st.state.buffers) == correction
        # The scratch buffer holds corrected weights; without T2 the reads are plain and none is needed.
        assert (stats["scratch_bytes"] > 0) == (correction and stats["stage"] < P - 1)
    x, y = constant_gradient_batches(1, 4)[0]
    pipe.step(x, y)
    pipe.flush()


class TiedShifts(nn.Module):
    """Bias-add stages whose first and last share one bias (a tied weight across stages 0 and 3); the last
    stage also has a bias of its own."""

    def __init__(self):
        super().__init__()
        self.first, self.middle, self.other, self.last = Shift(3, 0.1), Shift(3, 0.2), Shift(3, 0.3), Shift(3, 0.0)
        self.last.b = self.first.b
        self.tail = Shift(3, 0.4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.last(self.other(self.middle(self.first(x)))))


def test_pipemare_t1_steps_a_tied_weight_at_its_owners_smallest_scale():
    """Stage 0 (delay 3) and stage 3 (delay 1) hold copies of one bias. Under T1 each stage's own weights take
    its own scale, the tied weight the smaller one at both owners: the copies stay bit-identical."""
    P, m, n, lr, warmup = 4, 2, 4, 0.25, 100
    model = TiedShifts()
    pipe = Pipeline(model, P, "pipemare", m, optimizer=SGD(lr=lr), loss_fn=linear_loss, warmup_steps=warmup,
                    partition=["middle", "other", "last"])
    assert pipe.ties == {"first.b": ((0, "first.b"), (3, "first.b"))}
    for x, y in constant_gradient_batches(n, 2 * m):
        pipe.step(x, y)
    pipe.flush()
    first = pipe.stages[0].layout.views(pipe.stages[0].ring.live)["first.b"]
    last = pipe.stages[3].layout.views(pipe.stages[3].ring.live)["first.b"]
    assert torch.equal(first, last)
    # Untied weights follow their own stage's scale (delays 2, 1 and 1 for stages 1, 2 and 3).
    state = pipe.state_dict()
    for name, start, tau in (("middle.b", 0.2, 2), ("other.b", 0.3, 1), ("tail.b", 0.4, 1)):
        scales = [t1_scale(tau, u, warmup) for u in range(m * n)]
        torch.testing.assert_close(state[name], torch.full((3,), start, dtype=torch.float64)
                                   - lr * TARGET * math.fsum(scales), rtol=0, atol=1e-12)


def test_tied_weights_under_t1_with_a_torch_optimizer_say_what_to_use():
    import functools

    pipe = Pipeline(TiedShifts(), 4, "pipemare", 2, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                    loss_fn=linear_loss, partition=["middle", "other", "last"])
    x, y = constant_gradient_batches(1, 4)[0]
    with pytest.raises(ValueError, match="use pipecore.SGD, pipecore.AdamW or pipecore.NAdam, or turn the scaling off"):
        pipe.step(x, y)
        pipe.flush()
