"""The two staleness corrections on PipeDream's stash: delay compensation (``pipedream-dc``, DC-ASGD) and the Nesterov
method of asynchronous pipelines (``nesterov-async``), each against its formula.

The model of the closed-form checks is a chain of bias-add stages, ``y = x + b_0 + ... + b_{P-1}``, under the mean
squared error: a quadratic in the biases whose gradient (the same for every stage, ``2 * mean residual``) is written
by hand in numpy. Stage ``s`` of ``P`` reads, for micro-batch ``t``, the version ``max(t - w, 0)`` with
``w = (P-1-s)*(1+slack)`` (the asynchronous 1F1B schedule, one update per micro-batch, checked by the trace tests),
so the numpy recurrences below run every stage with its fixed delay, independently of pipecore.
"""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import pipecore
from pipecore import SGD, AdamW, Pipeline
from pipecore.algorithms import get_algorithm
from pipecore.algorithms.pipedream_dc import DelayCompensation
from pipecore.engine.flat import FlatLayout
from pipecore.engine.optim import MomentumForm, build_optimizer
from pipecore.planning import Sizing
from pipecore.schedule import B, F
from pipecore.versions import VersionBook

sys.path.insert(0, str(Path(__file__).parent))
from _same import assert_same  # noqa: E402
from test_algorithm_fidelity import shift_chain  # noqa: E402

WIDTH = 3
P, M, SAMPLES, STEPS = 4, 2, 6, 5  # 4 stages (delays 3, 2, 1, 0), 2 micro-batches of 3 samples, 5 mini-batches


def quadratic_batches(steps: int = STEPS, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(SAMPLES, WIDTH, generator=g, dtype=torch.float64),
             torch.randn(SAMPLES, WIDTH, generator=g, dtype=torch.float64)) for _ in range(steps)]


def train(algorithm: str, optimizer, num_stages: int = P, batches=None, **options) -> list[np.ndarray]:
    """Every stage's bias after training on ``batches`` and a flush."""
    pipe = Pipeline(shift_chain(num_stages, WIDTH), num_stages, algorithm, M, optimizer=optimizer,
                    loss_fn=nn.MSELoss(), **options)
    for x, y in batches or quadratic_batches():
        pipe.step(x, y)
    pipe.flush()
    state = pipe.state_dict()
    return [state[f"{s}.b"].numpy() for s in range(num_stages)]


def delayed(step, num_stages: int = P, slack: int = 0, batches=None) -> list[np.ndarray]:
    """The numpy recurrence: micro-batch ``t``'s gradient, taken where each stage's forward read (``max(t - w, 0)``
    updates in), is applied by every stage's update ``t + 1`` through ``step(stage, t, live, read, g, state) ->
    (new weights, state)``. Returns each stage's final bias."""
    history = [[np.full(WIDTH, 0.1 * (s + 1))] for s in range(num_stages)]
    states: list = [None] * num_stages
    t = 0
    for x, y in batches or quadratic_batches():
        for xm, ym in zip(np.split(x.numpy(), M), np.split(y.numpy(), M)):
            reads = [history[s][max(t - (num_stages - 1 - s) * (1 + slack), 0)] for s in range(num_stages)]
            residual = xm + sum(reads) - ym
            g = 2.0 * residual.sum(axis=0) / residual.size  # d mean((x + sum b - y)^2) / d b_s
            for s in range(num_stages):
                new, states[s] = step(s, t, history[s][t], reads[s], g, states[s])
                history[s].append(new)
            t += 1
    return [h[-1] for h in history]


def assert_equal_to_roundoff(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    for s, (a, b) in enumerate(zip(got, expected)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13, err_msg=f"stage {s}")


def assert_bitwise(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(got) == len(expected)
    for s, (a, b) in enumerate(zip(got, expected)):
        assert np.array_equal(a, b), f"stage {s}: {a} != {b}"


def sgd(lr: float, momentum: float = 0.0):
    """torch.optim.SGD's step (undampened, no weight decay) on the gradient ``g``: ``b = g`` at the first step."""
    def step(w, g, buf):
        if momentum == 0.0:
            return w - lr * g, None
        buf = g.copy() if buf is None else momentum * buf + g
        return w - lr * buf, buf
    return step


# --------------------------------------------------------------------------- version traces


@pytest.mark.parametrize("name", ["pipedream-dc", "nesterov-async"])
@pytest.mark.parametrize("slack", [0, 1])
def test_reads_are_pipedreams(name, slack):
    """Both read as PipeDream: F the live version, B the stash, ``max(k - w, 0)``."""
    for num_stages, m, n in [(2, 1, 3), (3, 2, 2), (4, 4, 3), (5, 3, 2)]:
        ours = pipecore.simulate(name, num_stages, m, n, slack=slack)
        theirs = pipecore.simulate("pipedream", num_stages, m, n, slack=slack)
        for s in range(num_stages):
            w = (num_stages - 1 - s) * (1 + slack)
            for k in range(m * n):
                assert ours.version(s, k, F) == ours.version(s, k, B) == max(k - w, 0)
                assert ours.read(s, k, B) == theirs.read(s, k, B) and ours.read(s, k, B).derivation is None
                assert ours.delay(s, k) == min(k, w)


def dc_versions(num_stages: int, s: int, T: int, w: int) -> int:
    """Peak versions at stage ``s`` of pipedream-dc: as PipeDream (the stashes in flight and the live version),
    and during update ``t + 1`` the version micro-batch ``t`` read (held for the correction unless it is the live
    one), the versions pinned by the micro-batches forwarded by then (up to ``t + w``) and the new version."""
    peak = min(w + 1, T - w + 1) if T > w else min(T, 2)
    if s == num_stages - 1:
        return peak  # no delay: nothing corrected, nothing held
    for t in range(T):
        held = {max(j - w, 0) for j in range(t + 1, min(t + w, T - 1) + 1)} | {t + 1}
        if max(t - w, 0) != t:
            held.add(max(t - w, 0))
        peak = max(peak, len(held))
    return peak


@pytest.mark.parametrize("slack", [0, 1])
def test_delay_compensation_holds_the_stash_until_its_update(slack):
    """One more version than PipeDream at every stage but the last in the steady state (``P-s+1``): the
    version a gradient was computed at stays until the update that corrects by it. nesterov-async holds
    PipeDream's."""
    for num_stages in (2, 3, 4, 5):
        for m, n in [(1, 2), (2, 2), (4, 3), (3, 5)]:
            T = m * n
            dc = pipecore.simulate("pipedream-dc", num_stages, m, n, slack=slack)
            nag = pipecore.simulate("nesterov-async", num_stages, m, n, slack=slack)
            pd = pipecore.simulate("pipedream", num_stages, m, n, slack=slack)
            for s in range(num_stages):
                w = (num_stages - 1 - s) * (1 + slack)
                assert dc.weight_versions(s) == dc_versions(num_stages, s, T, w), (num_stages, m, n, s)
                assert nag.weight_versions(s) == pd.weight_versions(s)
                if slack == 0 and T >= 2 * w + 1 and s < num_stages - 1:
                    assert dc.weight_versions(s) == num_stages - s + 1


def test_delay_compensation_updates_after_every_backward_and_checks_its_options():
    assert get_algorithm("pipedream-dc", 4, 8).update_every == 1
    with pytest.raises(ValueError, match="unknown option.*update_every"):
        get_algorithm("pipedream-dc", 4, 8, update_every=2)
    for options, message in [({"lam": -0.1}, "lam must be a finite number >= 0"),
                             ({"lam": math.inf}, "lam must be a finite number >= 0"),
                             ({"mean_square_decay": 1.0}, r"mean_square_decay must be in \[0, 1\)"),
                             ({"eps": 0.0}, "eps must be > 0"),
                             ({"adaptive": 1}, "must be true or false")]:
        with pytest.raises(ValueError, match=message):
            get_algorithm("pipedream-dc", 3, 2, **options)


def test_the_version_book_goes_back_to_its_mark_with_the_holds():
    """Undoing any action (the worker does so when one fails) restores the holds for updates exactly."""
    algorithm = get_algorithm("pipedream-dc", 4, 4)
    row = algorithm.schedule(3).stages[1]
    book = VersionBook(algorithm, 1)

    def state():
        return (book.live, set(book.held), dict(book.pins), dict(book.awaiting), book.update_reads)

    for a in row:
        before = state()
        mark = book.mark()
        act = (lambda: book.forward(a.index, None)) if a.kind is F else \
            (lambda: [book.backward(k) for k in a.microbatches]) if a.kind is B else book.update
        act()
        book.rewind(mark)
        assert state() == before, a
        book.mark()
        act()
        if a.kind is B:
            book.release_backward()
    assert book.awaiting == {} and book.pins == {}


# --------------------------------------------------------------------------- delay compensation: the formula


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("slack", [0, 1])
def test_delay_compensation_is_the_taylor_corrected_gradient(momentum, slack):
    """``g + lam*g*g*(W_now - W_stash)`` at every stage but the last, then SGD (with heavy-ball momentum)."""
    lr, lam = 0.1, 2.0
    base = sgd(lr, momentum)

    def step(s, t, live, read, g, buf):
        corrected = g + lam * g * g * (live - read) if s < P - 1 else g
        return base(live, corrected, buf)

    got = train("pipedream-dc", SGD(lr=lr, momentum=momentum), lam=lam, slack=slack)
    assert_equal_to_roundoff(got, delayed(step, slack=slack))
    plain = train("pipedream", SGD(lr=lr, momentum=momentum), slack=slack)
    assert max(np.abs(a - b).max() for a, b in zip(got, plain)) > 1e-3  # the correction acts


def test_adaptive_delay_compensation_scales_lambda_by_the_mean_square():
    """DC-ASGD-a: ``MeanSquare <- m*MeanSquare + (1-m)*g*g`` first, then ``lam / sqrt(MeanSquare + eps)``."""
    lr, lam, decay, eps = 0.1, 0.5, 0.9, 1e-7
    base = sgd(lr)

    def step(s, t, live, read, g, mean_square):
        if s == P - 1:
            return base(live, g, None)[0], None
        mean_square = (1 - decay) * g * g if mean_square is None else decay * mean_square + (1 - decay) * g * g
        corrected = g + lam / np.sqrt(mean_square + eps) * g * g * (live - read)
        return base(live, corrected, None)[0], mean_square

    got = train("pipedream-dc", SGD(lr=lr), lam=lam, adaptive=True, mean_square_decay=decay, eps=eps)
    assert_equal_to_roundoff(got, delayed(step))
    assert max(np.abs(a - b).max() for a, b in zip(got, train("pipedream", SGD(lr=lr)))) > 1e-3


@pytest.mark.parametrize("optimizer", [SGD(lr=0.05, momentum=0.9), AdamW(lr=0.01, weight_decay=0.01),
                                       functools.partial(torch.optim.RMSprop, lr=0.01)], ids=["sgd", "adamw", "torch"])
@pytest.mark.parametrize("options", [{}, {"adaptive": True}], ids=["constant", "adaptive"])
def test_delay_compensation_without_delay_is_the_plain_optimizer_bit_for_bit(optimizer, options):
    """One stage, or a pipeline's last stage: no delay, no correction, no version held; the run is PipeDream's (one
    stage: the optimizer stepping after every micro-batch) bit for bit."""
    assert_bitwise(train("pipedream-dc", optimizer, num_stages=1, **options), train("pipedream", optimizer, num_stages=1))
    assert get_algorithm("pipedream-dc", 3, 2, **options).gradient_transform(2) is None
    assert pipecore.simulate("pipedream-dc", 1, 4, 2).weight_versions(0) == 1


def test_the_correction_reads_the_weights_the_gradient_was_computed_at_and_leaves_tied_weights():
    """The transform itself, on float32 weights with float32 state: the live minus the given weights, except on a
    range tied to another stage's copy (its summed gradient has no one stash; every copy must take the same step)."""
    g = torch.tensor([1.0, -2.0, 0.5, 3.0])
    now, then = torch.tensor([0.3, 0.2, 0.1, 0.0]), torch.tensor([0.1, 0.4, 0.1, 0.5])

    class Before:
        weights, gradient_weights, optimizer, tied = now, then, None, [(3, 4)]

        def buffer(self, name):
            raise AssertionError("the constant variant keeps no buffer")

    grad = g.clone()
    DelayCompensation(0.5, adaptive=False, decay=0.95, eps=1e-7).apply(grad, Before())
    expected = g + 0.5 * g * g * (now - then)
    expected[3] = g[3]
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-7)


# --------------------------------------------------------------------------- the Nesterov method: the formula


def paper_nesterov(lr: float, gamma: float):
    """The paper's update in its own variables: ``d_t = gamma*(w_t - w_{t-1})``, ``w_{t+1} = w_t + d_t -
    lr*(1-gamma)*grad f(w_{t-tau} + d_{t-tau})``; the stored weights are the look-ahead points ``w_t + d_t``, at
    which the stash computes the delayed gradient. Returns the next look-ahead point."""
    def step(s, t, live, read, g, state):
        w_prev, w = state if state is not None else (live, live)  # w_{-1} = w_0 = the initial weights
        assert np.allclose(w + gamma * (w - w_prev), live, rtol=0, atol=1e-12)  # the stored weights are w + d
        w_next = w + gamma * (w - w_prev) - lr * (1 - gamma) * g
        return w_next + gamma * (w_next - w), (w, w_next)
    return step


@pytest.mark.parametrize("nesterov", [False, True], ids=["heavy-ball", "nesterov"])
@pytest.mark.parametrize("slack", [0, 1])
def test_nesterov_async_under_sgd_is_the_papers_update(nesterov, slack):
    """pipecore.SGD(lr, momentum gamma), heavy-ball (made Nesterov's through the previous gradient) or Nesterov (as
    it is): both are the paper's recurrence with a constant gamma and ``eta = lr / (1 - gamma)``."""
    lr, gamma = 0.02, 0.9
    got = train("nesterov-async", SGD(lr=lr, momentum=gamma, nesterov=nesterov), slack=slack)
    assert_equal_to_roundoff(got, delayed(paper_nesterov(lr / (1 - gamma), gamma), slack=slack))
    if nesterov:  # Nesterov's momentum is the method's step: PipeDream with it, bit for bit
        assert_bitwise(got, train("pipedream", SGD(lr=lr, momentum=gamma, nesterov=True), slack=slack))


def test_nesterov_async_under_torch_sgd_is_the_same_update():
    lr, gamma = 0.02, 0.9
    for nesterov in (False, True):
        got = train("nesterov-async", functools.partial(torch.optim.SGD, lr=lr, momentum=gamma, nesterov=nesterov))
        assert_equal_to_roundoff(got, delayed(paper_nesterov(lr / (1 - gamma), gamma)))


def nadam(lr, betas, eps, weight_decay, momentum_decay):
    """torch.optim.NAdam's step (decoupled weight decay), in numpy; like torch, the product of the ``mu_t`` is kept
    in float32 (the default scalar dtype of its state)."""
    beta1, beta2 = betas

    def step(s, t, live, read, g, state):
        n, mu_product, m, v = state if state is not None else (0, 1.0, np.zeros(WIDTH), np.zeros(WIDTH))
        n += 1
        mu = beta1 * (1 - 0.5 * 0.96 ** (n * momentum_decay))
        mu_next = beta1 * (1 - 0.5 * 0.96 ** ((n + 1) * momentum_decay))
        mu_product = float(np.float32(mu_product) * np.float32(mu))
        w = live * (1 - lr * weight_decay)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        denom = np.sqrt(v / (1 - beta2 ** n)) + eps
        w = w - lr * (1 - mu) / (1 - mu_product) * g / denom - lr * mu_next / (1 - mu_product * mu_next) * m / denom
        return w, (n, mu_product, m, v)
    return step


PAPER_NADAM = dict(lr=0.01, betas=(0.99, 0.999), eps=1e-8, weight_decay=0.01, momentum_decay=0.004)


def test_nesterov_async_under_nadam_is_delayed_nadam():
    """With NAdam (the paper's optimizer and settings: beta1 0.99, momentum decay 0.004, decoupled weight decay)
    the gradient is left alone: NAdam's step is the method's, at the stashed weights."""
    torch_nadam = functools.partial(torch.optim.NAdam, decoupled_weight_decay=True, **PAPER_NADAM)
    assert_equal_to_roundoff(train("nesterov-async", torch_nadam), delayed(nadam(**PAPER_NADAM)))


def test_nesterov_async_without_delay_is_the_optimizer():
    """One stage: with NAdam, NAdam itself bit for bit; with SGD, its Nesterov momentum at the same ``lr``."""
    torch_nadam = functools.partial(torch.optim.NAdam, decoupled_weight_decay=True, **PAPER_NADAM)
    assert_bitwise(train("nesterov-async", torch_nadam, num_stages=1), train("pipedream", torch_nadam, num_stages=1))
    nesterov = SGD(lr=0.1, momentum=0.9, nesterov=True)
    assert_bitwise(train("nesterov-async", nesterov, num_stages=1), train("pipedream", nesterov, num_stages=1))
    assert_equal_to_roundoff(train("nesterov-async", SGD(lr=0.1, momentum=0.9), num_stages=1),
                             train("pipedream", nesterov, num_stages=1))
    # Without momentum the method is delayed SGD: PipeDream's, bit for bit.
    assert_bitwise(train("nesterov-async", SGD(lr=0.1)), train("pipedream", SGD(lr=0.1)))


@pytest.mark.parametrize("optimizer, message", [
    (AdamW(lr=0.01), "pipecore.AdamW's first moment is a moving average"),
    (SGD(lr=0.1, momentum=0.9, dampening=0.1), "a dampened momentum buffer"),
    (functools.partial(torch.optim.Adam, lr=0.01), "torch.optim.Adam does not take its momentum"),
], ids=["adamw", "dampening", "torch-adam"])
def test_nesterov_async_refuses_optimizers_without_a_look_ahead_form(optimizer, message):
    with pytest.raises(TypeError, match=f"nesterov-async takes Nesterov's look-ahead.*{message}.*NAdam"):
        Pipeline(shift_chain(2, WIDTH), 2, "nesterov-async", M, optimizer=optimizer, loss_fn=nn.MSELoss())


def test_momentum_forms_of_the_optimizers():
    layout, cpu = FlatLayout.of(nn.Linear(3, 1, bias=False).double(), 0), torch.device("cpu")
    assert build_optimizer(SGD(lr=0.1), layout, cpu).momentum_form() == MomentumForm("none", 0.0)
    assert build_optimizer(SGD(lr=0.1, momentum=0.5), layout, cpu).momentum_form() == MomentumForm("heavy-ball", 0.5)
    assert build_optimizer(SGD(lr=0.1, momentum=0.5, nesterov=True), layout, cpu).momentum_form() == \
        MomentumForm("nesterov", 0.5)
    assert build_optimizer(functools.partial(torch.optim.NAdam, lr=0.1), layout, cpu).momentum_form() == \
        MomentumForm("nesterov-ema")


# --------------------------------------------------------------------------- state: checkpoints, resharding, memory

import warnings  # noqa: E402

from pipecore.engine.state_io import CheckpointNote  # noqa: E402
from test_universal_checkpoint import data as mlp_data, mlp, per_name  # noqa: E402

STATEFUL = [  # (algorithm, optimizer, options, the buffer the stages keep)
    ("pipedream-dc", SGD(lr=0.05, momentum=0.9), {"adaptive": True}, "mean_square"),
    ("nesterov-async", SGD(lr=0.05, momentum=0.9), {}, "previous_gradient"),
]
IDS = ["dc-adaptive", "nesterov-heavy-ball"]


def make(algorithm: str, optimizer, stages: int, **options) -> Pipeline:
    return Pipeline(mlp(), stages, algorithm, 4, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss(), **options)


@pytest.mark.parametrize("algorithm, optimizer, options, buffer", STATEFUL, ids=IDS)
def test_a_checkpoint_resumes_bit_for_bit(algorithm, optimizer, options, buffer):
    """The declared buffer is saved and loaded with the weights and the optimizer state: training resumed from a
    checkpoint equals training that went on."""
    batches = mlp_data(6)
    going_on = make(algorithm, optimizer, 3, **options)
    for x, y in batches[:3]:
        going_on.step(x, y)
    going_on.flush()
    saved = going_on.state_dict()
    kept = {s: sm["buffers"] for s, sm in saved["pipecore"]["stages"].items()}
    assert all(buffer in kept[s] and kept[s][buffer].abs().sum() > 0 for s in (0, 1))
    resumed = make(algorithm, optimizer, 3, **options)
    resumed.load_state_dict(saved)
    for pipe in (going_on, resumed):
        for x, y in batches[3:]:
            pipe.step(x, y)
        pipe.flush()
    assert_same(resumed.state_dict(), going_on.state_dict())


@pytest.mark.parametrize("algorithm, optimizer, options, buffer", STATEFUL, ids=IDS)
def test_a_checkpoint_loads_into_another_stage_count_with_its_buffer_by_parameter_name(algorithm, optimizer, options,
                                                                                        buffer):
    source = make(algorithm, optimizer, 4, **options)
    for x, y in mlp_data(3):
        source.step(x, y)
    source.flush()
    saved = source.state_dict()
    target = make(algorithm, optimizer, 2, **options)
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always")
        target.load_state_dict(saved)
    got, expected = per_name(target.state_dict(), mlp()), per_name(saved, mlp())
    compared = 0
    for name, (_, buffers) in got.items():
        if buffer in buffers and buffer in expected[name][1]:
            assert torch.equal(buffers[buffer], expected[name][1][buffer]), name
            compared += 1
    assert compared >= 4
    if algorithm == "pipedream-dc":  # the source's stage 2 corrected, the target's last stage does not: noted
        assert any(issubclass(n.category, CheckpointNote) and "mean square" in str(n.message) for n in notes)
    else:
        assert not [n for n in notes if issubclass(n.category, CheckpointNote)]


def test_the_memory_model_and_stats_count_the_versions_and_buffers():
    """The planner's sizing (from the simulator and the declared buffers) and what the stages allocate: pipedream-dc
    holds one more version where it corrects, and DC-ASGD-a's mean square there; nesterov-async holds PipeDream's
    versions and, under heavy-ball momentum only, the previous gradient (the planner, which does not know the
    optimizer, counts it at every stage)."""
    z = Sizing.of("pipedream-dc", 3, 4)
    assert z.versions == (4, 3, 1) and z.buffers == (0, 0, 0) and z.derived == (False, False, False)
    assert Sizing.of("pipedream-dc", 3, 4, adaptive=True).buffers == (1, 1, 0)
    assert Sizing.of("pipedream", 3, 4).versions == Sizing.of("nesterov-async", 3, 4).versions == (3, 2, 1)
    assert Sizing.of("nesterov-async", 3, 4).buffers == (1, 1, 1)

    def allocated(pipe: Pipeline) -> tuple[list[int], list[dict[str, int]]]:
        for x, y in mlp_data(2):
            pipe.step(x, y)
        stats = pipe.stats()
        return [s["weight_versions"] for s in stats], [s["buffers"] for s in stats]

    stage_bytes = [8 * sum(p.numel() for p in part.parameters()) for part in (mlp()[0:4], mlp()[4:8], mlp()[8:])]
    versions, buffers = allocated(make("pipedream-dc", SGD(lr=0.05), 3, adaptive=True, partition=[4, 8]))
    assert versions == [4, 3, 1]
    assert buffers == [{"mean_square": stage_bytes[0]}, {"mean_square": stage_bytes[1]}, {}]
    versions, buffers = allocated(make("nesterov-async", SGD(lr=0.05, momentum=0.9), 3, partition=[4, 8]))
    assert versions == [3, 2, 1] and buffers == [{"previous_gradient": b} for b in stage_bytes]
    for optimizer in (SGD(lr=0.05, momentum=0.9, nesterov=True), functools.partial(torch.optim.NAdam, lr=0.01)):
        assert allocated(make("nesterov-async", optimizer, 3, partition=[4, 8]))[1] == [{}, {}, {}]


# --------------------------------------------------------------------------- a failed step is taken back

from test_recovery import Fault, check_like_a_flush  # noqa: E402


@pytest.mark.parametrize("algorithm, options", [("pipedream-dc", {"adaptive": True}), ("nesterov-async", {})],
                         ids=["dc-adaptive", "nesterov-heavy-ball"])
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("kind", ["F", "B", "U"])
def test_a_failed_action_is_undone_with_the_held_versions_and_buffers(algorithm, options, stage, kind):
    """As a flush in place of the failed step, bit for bit: the versions held for the corrections, the mean
    square and the previous gradient go back with the weights and the optimizer state."""
    check_like_a_flush(algorithm, Fault(stage, kind, when="end", target="newest"), concurrent=True, **options)


# --------------------------------------------------------------------------- under torchrun

from test_distributed import _check_ok, launch, local_run  # noqa: E402


def test_four_ranks_train_bit_for_bit_as_one_process(tmp_path):
    """Each rank holds its stage's held versions and buffers: 4 processes (gloo) equal one, for delay compensation
    (adaptive, and with slack) and the Nesterov method under NAdam and under heavy-ball SGD."""
    algorithms = ["pipedream-dc+adaptive", "pipedream-dc+slack", "nesterov-async+nadam", "nesterov-async"]
    world = 4
    _check_ok(launch(world, "compare", str(tmp_path), ",".join(algorithms)))
    for algorithm in algorithms:
        losses, state, _ = local_run(world, algorithm)
        for rank in range(world):
            got = torch.load(tmp_path / f"{algorithm}-{rank}.pt", weights_only=False)
            assert got["losses"] == losses, f"{algorithm}: rank {rank} reports other losses"
            mine = state["pipecore"]["stages"][rank]
            assert_same(got["state"]["pipecore"]["stages"][rank]["buffers"], mine["buffers"])
            assert_same(got["state"]["pipecore"]["stages"][rank]["optimizer"], mine["optimizer"])
            for key, value in got["state"].items():
                if key != "pipecore":
                    assert torch.equal(value, state[key]), f"{algorithm}: {key} differs on rank {rank}"
