"""Version traces of every algorithm against the formulas of the algorithms spec.

Micro-batches are numbered globally from 0 (``k``), mini-batch ``k // m``; ``w = P - 1 - s`` is stage
``s``'s warm-up depth under 1F1B; ``T = m * n`` is the number of micro-batches simulated.

Expected versions and delays are computed independently of the simulator: closed forms for the
asynchronous 1F1B family (:func:`expected_async_delay`), and for the nF1B family (TiMePReSt and its
variants) a separate implementation of the paper's slot rule (:func:`nf1b_slots`), from which every
expected read follows (:func:`nf1b_expected`).
"""

from __future__ import annotations

import functools
import math

import pytest

from pipecore import algorithm_names, get_algorithm, simulate
from pipecore.algorithms import ALIASES, get_spec
from pipecore.algorithms.base import WeightRead, timeprest_version_difference
from pipecore.algorithms.pipemare import stage_delay, velocity_decay
from pipecore.algorithms.state import ChangeAverage
from pipecore.runtime import Costs, Executor, StageWorker
from pipecore.schedule import B, F, U

STAGES = range(2, 9)
MICRO = range(1, 9)
MINI = (1, 2, 3)


@functools.cache
def trace(name: str, P: int, m: int, n: int, **options):
    return simulate(name, P, m, n, **options)


def grid_sizes(min_m=lambda P: 1):
    for P in STAGES:
        for m in MICRO:
            if m >= min_m(P):
                for n in MINI:
                    yield P, m, n


def reads(P: int, T: int):
    """Every (stage, micro-batch) pair."""
    for s in range(P):
        for k in range(T):
            yield s, k


# --------------------------------------------------------------------------- parameter errors


def test_unknown_algorithm_lists_the_names():
    with pytest.raises(ValueError) as info:
        get_algorithm("pipedraem", 4, 4)
    message = str(info.value)
    assert message.startswith("unknown algorithm 'pipedraem'; valid names: ")
    for name in algorithm_names() + list(ALIASES):
        assert name in message


def test_aliases_and_case():
    assert get_spec("PipeDream-Flush").name == "1f1b"
    assert get_spec("pipedream-2bw").name == "2bw"
    assert get_spec("ZB1P").name == "zb-h1"
    assert algorithm_names() == [
        "gpipe", "1f1b", "pipedream", "2bw", "pipemare", "spectrain", "timeprest", "v-timeprest", "i-timeprest",
        "pipedream-dc", "nesterov-async", "interleaved-1f1b", "looped-bfs", "zb-h1", "zb-v", "dualpipe-v",
    ]


@pytest.mark.parametrize("name", algorithm_names())
def test_sizes_below_one_are_rejected(name):
    with pytest.raises(ValueError, match=r"num_stages must be >= 1, got 0"):
        get_algorithm(name, 0, 4)
    with pytest.raises(ValueError, match=r"n_microbatches must be >= 1, got 0"):
        get_algorithm(name, 2, 0)
    with pytest.raises(ValueError, match=r"n_minibatches must be >= 1, got 0"):
        simulate(name, 2, 4, 0)


def test_2bw_needs_m_at_least_p():
    for P in STAGES:
        for m in MICRO:
            if m < P:
                with pytest.raises(ValueError) as info:
                    get_algorithm("2bw", P, m)
                assert str(info.value).startswith(f"2bw: needs n_microbatches >= num_stages (got {m} < {P})")
            else:
                assert get_algorithm("pipedream-2bw", P, m).update_every == m


def test_2bw_with_slack_needs_the_warmup_within_one_minibatch():
    for P in range(2, 6):
        for slack in (1, 2):
            need = (P - 1) * (1 + slack) + 1
            with pytest.raises(ValueError) as info:
                get_algorithm("2bw", P, need - 1, slack=slack)
            assert str(info.value).startswith(f"2bw: with slack={slack} needs n_microbatches >= "
                                              f"(num_stages-1)*(1+slack)+1 = {need} (got {need - 1})")
            for n in (1, 3):  # the smallest accepted size really runs: every read is of a produced version
                assert [simulate("2bw", P, need, n, slack=slack).weight_versions(s) for s in range(P)] == [2] * P


@pytest.mark.parametrize("P", [2, 3, 4])
def test_slack_hides_message_latency_in_the_timing_model(P):
    """With a send time, the published warm-up puts each message's latency on every step; one unit of slack
    per downstream stage hides a latency of up to half a forward+backward, recovering the zero-latency
    makespan in steady state (without latency, slack changes nothing)."""
    m, n, send = 8, 6, 0.5
    free = simulate("2bw", P, m, n, costs=(1, 2)).makespan
    assert simulate("2bw", P, m, n, costs=(1, 2), slack=1).makespan == free
    tight = simulate("2bw", P, m, n, costs=(1, 2, send)).makespan
    slack = simulate("2bw", P, m, n, costs=(1, 2, send), slack=1).makespan
    assert tight >= free + send * m * n  # every micro-batch pays the latency
    assert slack <= free + 2 * send * (P - 1) + 1e-9  # only the fill and the drain pay it


def test_slack_is_an_option_of_the_async_1f1b_algorithms_only():
    for name in ("gpipe", "1f1b", "pipemare", "spectrain", "timeprest"):
        with pytest.raises(ValueError, match="unknown option"):
            get_algorithm(name, 2, 4, slack=1)


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(ValueError) as info:
        get_algorithm("i-timeprest", 3, 2, lambda_=0.5)
    assert str(info.value) == (
        "unknown option(s) ['lambda_'] for algorithm 'i-timeprest'; valid options: alpha, backward_rule, degree, lam"
    )
    with pytest.raises(ValueError, match="valid options: none"):
        get_algorithm("gpipe", 3, 2, lam=0.5)


@pytest.mark.parametrize("name, options, expected", [
    ("i-timeprest", {"lam": "fast"}, "i-timeprest: option lam='fast': must be a number or inf (default 1.0)"),
    ("i-timeprest", {"alpha": "cosine"}, "alpha must be one of ['constant', 'exp', 'inverse'] or a callable"),
    ("i-timeprest", {"backward_rule": "graph"}, "backward_rule must be one of ('swap', 'recompute', 'stash')"),
    ("pipedream", {"update_every": 3}, "update_every=3 must divide n_microbatches=4"),
    ("pipedream", {"update_every": 1.5}, "option update_every=1.5: must be an integer number of micro-batches"),
    ("pipemare", {"warmup_steps": 2.5}, "option warmup_steps=2.5: must be an integer (default 1000)"),
    ("pipemare", {"D": 1.5}, "D must be in [0, 1), got 1.5"),
    ("pipemare", {"delta_decay": "x"}, "delta_decay must be a number in [0, 1), got 'x'"),
    ("pipemare", {"lr_warmup": "cosine"}, "lr_warmup must be 'power' or 'linear'"),
    ("spectrain", {"lookahead": [1, 2]}, "lookahead needs one horizon per stage (4), got 2"),
    ("pipedream", {"slack": -1}, "option slack=-1: must be a non-negative integer number of micro-batches"),
    ("2bw", {"slack": 0.5}, "option slack=0.5: must be a non-negative integer number of micro-batches"),
    ("spectrain", {"lookahead": [1, 2, -1, 0]}, "must be a list of non-negative integer horizons"),
    ("spectrain", {"update_every": 2}, "spectrain: update_every must be 1, got 2"),
    ("pipemare", {"lr_rescheduling": 1}, "option lr_rescheduling=1: must be true or false"),
    ("pipemare", {"discrepancy_correction": "no"}, "option discrepancy_correction='no': must be true or false"),
    ("i-timeprest", {"lam": -0.5}, "i-timeprest: lam must be >= 0 (0: the stashed weights, inf: the live weights), "
                                   "got -0.5"),
    ("i-timeprest", {"alpha": "inverse", "lam": -1.0}, "i-timeprest: lam must be >= 0"),
    ("i-timeprest", {"alpha": "constant", "lam": 1.5}, "i-timeprest: with alpha='constant', lam is the weight of "
                                                       "the stashed weights and must lie in [0, 1], got 1.5"),
    ("i-timeprest", {"alpha": "constant", "lam": -0.25}, "must lie in [0, 1], got -0.25"),
    ("i-timeprest", {"alpha": "constant", "lam": math.inf}, "must lie in [0, 1], got inf"),
    ("i-timeprest", {"lam": math.nan}, "i-timeprest: option lam=nan: must be a "),
    ("i-timeprest", {"degree": "steps"}, "i-timeprest: degree must be one of ('versions', 'timeprest'), got 'steps'"),
])
def test_bad_option_values_say_what_is_allowed(name, options, expected):
    with pytest.raises(ValueError) as info:
        get_algorithm(name, 4, 4, **options)
    assert expected in str(info.value)


# --------------------------------------------------------------------------- synchronous: GPipe, 1F1B


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_synchronous_reads_minibatch_version_and_holds_one(name):
    for P, m, n in grid_sizes():
        t = trace(name, P, m, n)
        for s, k in reads(P, m * n):
            assert t.version(s, k, F) == t.version(s, k, B) == k // m
            assert t.staleness(s, k, F) == t.staleness(s, k, B) == t.delay(s, k) == 0
        assert [t.weight_versions(s) for s in range(P)] == [1] * P


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_synchronous_bubble_is_exact(name):
    # Unit costs F=1, B=2: each mini-batch takes (m+P-1)*(F+B) and a stage is busy m*(F+B) of it.
    for P, m, n in grid_sizes():
        t = trace(name, P, m, n)
        assert t.makespan == n * (m + P - 1) * 3
        assert t.bubble_fraction == pytest.approx((P - 1) / (m + P - 1), abs=1e-12)
    # The same holds for any costs that are equal across stages.
    for forward, backward in ((1.0, 1.0), (2.0, 1.0), (0.5, 1.5)):
        for P, m, n in grid_sizes():
            if n < 3:
                t = simulate(name, P, m, n, costs=(forward, backward))
                assert t.makespan == pytest.approx(n * (m + P - 1) * (forward + backward))
                assert t.bubble_fraction == pytest.approx((P - 1) / (m + P - 1), abs=1e-12)


def test_peak_activations():
    for P, m, n in grid_sizes():
        g, f = trace("gpipe", P, m, n), trace("1f1b", P, m, n)
        assert [g.peak_activations(s) for s in range(P)] == [m] * P
        assert [f.peak_activations(s) for s in range(P)] == [min(P - s, m) for s in range(P)]


# --------------------------------------------------------------------------- asynchronous 1F1B family


def expected_async_delay(P: int, s: int, k: int, every: int) -> int:
    """Updates between the F and the B of micro-batch k at stage s under async 1F1B, updating after every
    `every` backwards: F(k) runs after max(k-w, 0) backwards, B(k) after k of them."""
    w = P - 1 - s
    return k // every - max(k - w, 0) // every


def test_async_delay_with_an_update_every_backward():
    # Steady state (k >= P-1-s): the delay is exactly P-1-s; during warm-up it is k.
    for P, m, n in grid_sizes():
        t = trace("pipedream", P, m, n)
        for s, k in reads(P, m * n):
            assert t.delay(s, k) == min(k, P - 1 - s)
        for s in range(P):
            if m * n > P - 1 - s:
                assert t.stage_summary(s).max_delay == P - 1 - s


def test_async_delay_with_update_every():
    for P, m, n in grid_sizes():
        for every in [d for d in range(1, m + 1) if m % d == 0]:
            t = trace("pipedream", P, m, n, update_every=every)
            T = m * n
            for s, k in reads(P, T):
                assert t.delay(s, k) == expected_async_delay(P, s, k, every)
            for s in range(P):
                w = P - 1 - s
                # The ceil((P-1-s)/update_every) bound is reached once a group boundary follows the warm-up.
                if T > every * math.ceil(w / every):
                    assert t.stage_summary(s).max_delay == math.ceil(w / every)


def test_pipedream_backward_reads_its_forward_version():
    for P, m, n in grid_sizes():
        for every in (1, m):
            t = trace("pipedream", P, m, n, update_every=every)
            for s, k in reads(P, m * n):
                w = P - 1 - s
                assert t.version(s, k, F) == t.live_version(s, k, F) == max(k - w, 0) // every
                assert t.version(s, k, B) == t.version(s, k, F)
                assert t.read(s, k, B).derivation is None


def pipedream_versions(P: int, s: int, T: int, ahead: int | None = None) -> int:
    """Peak versions at stage s (update every backward), whose forwards run ``ahead`` micro-batches ahead
    of its backwards (P-1-s without slack): the in-flight micro-batches' stashed versions plus the live
    one. Steady state pins ahead+1 versions once T >= 2*ahead; the drain adds the fresh live version next
    to the stashes still pinned; with T <= ahead everything is forwarded on v0."""
    w = P - 1 - s if ahead is None else ahead
    if T > w:
        return min(w + 1, T - w + 1)
    return min(T, 2)


def test_pipedream_versions_per_stage():
    for P, m, n in grid_sizes():
        T = m * n
        t = trace("pipedream", P, m, n)
        for s in range(P):
            assert t.weight_versions(s) == pipedream_versions(P, s, T)
            # Exactly P - s versions iff T >= 2(P-1-s) (the last stage always holds one).
            assert (t.weight_versions(s) == P - s) == (T >= 2 * (P - 1 - s))


@pytest.mark.parametrize("slack", [1, 2])
def test_pipedream_slack_runs_further_ahead_with_stashes_to_match(slack):
    """Stage s runs w = (P-1-s)*(1+slack) forwards ahead: F(k) reads the version after max(k-w, 0)
    backwards, B(k) its stash, and a full steady state pins w+1 versions."""
    for P, m, n in [(2, 4, 3), (3, 2, 4), (4, 3, 3)]:
        t = trace("pipedream", P, m, n, slack=slack)
        for s, k in reads(P, m * n):
            w = (P - 1 - s) * (1 + slack)
            assert t.version(s, k, F) == t.version(s, k, B) == max(k - w, 0)
            assert t.delay(s, k) == min(k, w)
        for s in range(P):
            assert t.weight_versions(s) == pipedream_versions(P, s, m * n, ahead=(P - 1 - s) * (1 + slack))


def test_2bw_reads_previous_minibatch_version():
    for P, m, n in grid_sizes(min_m=lambda P: P):
        t = trace("2bw", P, m, n)
        for s, k in reads(P, m * n):
            assert t.version(s, k, F) == t.version(s, k, B) == max(k // m - 1, 0)
            # theta(t+1) = theta(t) - lr * grad(theta(t-1)): a constant delay of 1 after the first mini-batch.
            assert t.delay(s, k) == min(k // m, 1)
        assert [t.weight_versions(s) for s in range(P)] == [2] * P


def pipemare_trace(P: int, m: int, n: int, every: str = "default", **options):
    """A PipeMare trace with its update step: the default (an update after every backward) or ``every="m"``
    (``update_every=m``, one update per mini-batch)."""
    if every == "m":
        return trace("pipemare", P, m, n, update_every=m, **options), m
    return trace("pipemare", P, m, n, **options), 1


def pipemare_sizes(every: str):
    """The whole grid for the default; a smaller one for ``update_every=m`` (the same code path, coarser)."""
    return [(P, m, n) for P, m, n in grid_sizes() if every == "default" or (P <= 5 and m <= 4)]


@pytest.mark.parametrize("every", ["default", "m"])
def test_pipemare_backward_corrects_the_live_weights(every):
    """F(k) reads the live version, the one after max(k-w, 0) backwards; B(k) reads the live version after k
    backwards, corrected by tau = the updates in between (``expected_async_delay``): ``W - tau*delta``."""
    seen = set()
    for P, m, n in pipemare_sizes(every):
        t, step = pipemare_trace(P, m, n, every)
        for s, k in reads(P, m * n):
            w = P - 1 - s
            tau = expected_async_delay(P, s, k, step)
            assert t.read(s, k, F) == WeightRead(max(k - w, 0) // step)
            assert t.live_version(s, k, F) == max(k - w, 0) // step
            assert t.live_version(s, k, B) == k // step
            assert t.delay(s, k) == tau
            corrected = WeightRead(k // step, "correct", coef=tau)
            assert t.read(s, k, B) == (WeightRead(k // step) if tau == 0 else corrected)
            seen.add(tau)
        assert [t.weight_versions(s) for s in range(P)] == [1] * P
    assert seen == ({0, 1, 2, 3, 4, 5, 6, 7} if every == "default" else {0, 1, 2})  # every delay was exercised


@pytest.mark.parametrize("every", ["default", "m"])
def test_pipemare_stage_delay_is_the_measured_maximum(every):
    """``stage_delay`` (T1's and T2's tau_s) is the largest delay the trace shows: P-1-s by default,
    ceil((P-1-s)/m) with ``update_every=m``, once the run is long enough to reach it (at least 1)."""
    for P, m, n in pipemare_sizes(every):
        t, step = pipemare_trace(P, m, n, every)
        algorithm = get_algorithm("pipemare", P, m, **({"update_every": m} if every == "m" else {}))
        assert algorithm.update_every == step
        for s in range(P):
            w = P - 1 - s
            assert stage_delay(s, algorithm) == max(math.ceil(w / step), 1)
            if w > 0 and m * n > step * math.ceil(w / step):
                assert t.stage_summary(s).max_delay == math.ceil(w / step)
            if every == "default":
                assert t.stage_summary(s).max_delay == min(w, m * n - 1)


def test_pipemare_corrects_by_the_stage_delay_in_steady_state():
    """With the defaults (T2 on, an update every backward) every stage but the last corrects: once past the
    warm-up (k >= P-1-s) the backward reads ``W - tau*delta`` with tau = P-1-s; the velocity decays at
    D**(1/tau_s) = 0.1**(1/(P-1-s)); the summary reports derived weights wherever a correction happened."""
    for P, m, n in grid_sizes():
        t = trace("pipemare", P, m, n)
        algorithm = get_algorithm("pipemare", P, m)
        for s, k in reads(P, m * n):
            w = P - 1 - s
            if k >= w:
                assert t.read(s, k, B) == (WeightRead(k) if w == 0 else WeightRead(k, "correct", coef=w))
        for s in range(P):
            w = P - 1 - s
            assert velocity_decay(s, algorithm) == pytest.approx(0.1 ** (1 / max(w, 1)), rel=1e-12)
            # The stage keeps that average as its declared buffer, and nothing else.
            assert algorithm.buffer_updates(s) == {"velocity": ChangeAverage(velocity_decay(s, algorithm))}
            assert t.stage_summary(s).derived_weights == (w > 0 and m * n > 1)


def test_pipemare_without_discrepancy_correction_reads_the_live_weights():
    """``discrepancy_correction=False`` (T2 off, the paper's ablation): the backward reads the live weights
    as they are, no stage derives weights or keeps a velocity; the delay itself is unchanged."""
    for P, m, n in pipemare_sizes("m"):
        t = trace("pipemare", P, m, n, discrepancy_correction=False)
        algorithm = get_algorithm("pipemare", P, m, discrepancy_correction=False)
        for s, k in reads(P, m * n):
            w = P - 1 - s
            assert t.read(s, k, F) == WeightRead(max(k - w, 0))
            assert t.read(s, k, B) == WeightRead(k)
            assert t.delay(s, k) == expected_async_delay(P, s, k, 1)
        for s in range(P):
            assert velocity_decay(s, algorithm) is None
            assert algorithm.buffer_updates(s) == {}
            assert t.weight_versions(s) == 1
            assert t.stage_summary(s).derived_weights is False
        # T1 is independent of T2: the learning rate still starts divided by the stage delay.
        assert algorithm.lr_scale(0, 0) == pytest.approx(1 / (P - 1), rel=1e-12)


def test_pipemare_without_lr_rescheduling_keeps_the_base_learning_rate():
    """``lr_rescheduling=False`` (T1 off): every stage's scale is 1 from the first update on; T1 is a
    learning-rate rule only, so the reads and the velocity are the default's."""
    for P in range(2, 7):
        for m in (1, 2, 4):
            on = get_algorithm("pipemare", P, m, warmup_steps=10)
            off = get_algorithm("pipemare", P, m, warmup_steps=10, lr_rescheduling=False)
            for s in range(P):
                assert [off.lr_scale(s, i) for i in (0, 1, 5, 10, 50)] == [1.0] * 5
                assert on.lr_scale(s, 0) == pytest.approx(1 / max(P - 1 - s, 1), rel=1e-12)
                assert velocity_decay(s, off) == velocity_decay(s, on) == pytest.approx(0.1 ** (1 / max(P - 1 - s, 1)))
            for n in (1, 3):
                plain, ablated = trace("pipemare", P, m, n), trace("pipemare", P, m, n, lr_rescheduling=False)
                for s, k in reads(P, m * n):
                    for kind in (F, B):
                        assert ablated.read(s, k, kind) == plain.read(s, k, kind)


@pytest.mark.parametrize("m", [1, 4])
def test_pipemare_lr_warmup(m):
    a = get_algorithm("pipemare", 4, m, warmup_steps=10)
    # Stage 0 has delay 3 (an update every backward, whatever m): its learning rate starts at 1/3 and
    # reaches 1 after 10 updates.
    assert a.update_every == 1
    assert a.lr_scale(0, 0) == pytest.approx(1 / 3)
    assert a.lr_scale(0, 5) == pytest.approx(3 ** -0.5)
    assert a.lr_scale(0, 10) == a.lr_scale(0, 50) == 1.0
    assert a.lr_scale(3, 0) == 1.0  # the last stage has no delay
    linear = get_algorithm("pipemare", 4, m, warmup_steps=10, lr_warmup="linear")
    assert linear.lr_scale(0, 5) == pytest.approx(1 / 3 + (2 / 3) * 0.5)
    assert velocity_decay(0, a) == pytest.approx(0.1 ** (1 / 3))
    assert velocity_decay(0, get_algorithm("pipemare", 4, m, delta_decay=0.5)) == 0.5


def test_pipemare_lr_warmup_with_one_update_per_minibatch():
    # update_every=m=4 >= P-1: every delay is 1 and T1 leaves the learning rate alone.
    a = get_algorithm("pipemare", 4, 4, warmup_steps=10, update_every=4)
    assert [a.lr_scale(s, 0) for s in range(4)] == [1.0] * 4
    assert [velocity_decay(s, a) for s in range(4)] == [pytest.approx(0.1)] * 4
    # update_every=2 at P=4: stage 0 has delay ceil(3/2) = 2, stage 1 ceil(2/2) = 1.
    b = get_algorithm("pipemare", 4, 4, warmup_steps=10, update_every=2)
    assert [b.lr_scale(s, 0) for s in range(4)] == [pytest.approx(0.5), 1.0, 1.0, 1.0]


def test_spectrain_horizons():
    for P, m, n in grid_sizes():
        t = trace("spectrain", P, m, n)
        for s, k in reads(P, m * n):
            f, b = t.read(s, k, F), t.read(s, k, B)
            assert f.version == t.live_version(s, k, F) and b.version == t.live_version(s, k, B)
            assert t.delay(s, k) == min(k, P - 1 - s)  # an update after every backward
            for read, horizon in ((f, s // 2 + P - s - 1), (b, s // 2)):
                if horizon == 0:
                    assert read.derivation is None
                else:
                    assert (read.derivation, read.coef) == ("predict", horizon)
        assert [t.weight_versions(s) for s in range(P)] == [1] * P


def test_spectrain_needs_an_update_after_every_backward():
    # The horizons count updates made one per backward; coarser updates are refused, not silently mis-predicted.
    for m in (2, 4, 6):
        for every in [d for d in range(2, m + 1) if m % d == 0]:
            with pytest.raises(ValueError) as info:
                get_algorithm("spectrain", 4, m, update_every=every)
            assert str(info.value).startswith(f"spectrain: update_every must be 1, got {every}")
        assert get_algorithm("spectrain", 4, m).update_every == 1
        assert get_algorithm("spectrain", 4, m, update_every=1).update_every == 1


def test_spectrain_lookahead_overrides_the_forward_horizon_only():
    t = simulate("spectrain", 4, 2, 2, lookahead=[5, 0, 2, 1])
    for k in range(4):
        assert [t.read(s, k, F).coef for s in range(4)] == [5.0, None, 2.0, 1.0]
        assert [t.read(s, k, B).coef for s in range(4)] == [None, None, 1.0, 1.0]


# --------------------------------------------------------------------------- nF1B family
#
# The expected reads of TiMePReSt, V-TiMePReSt and I-TiMePReSt come from an implementation of the paper's
# slot rule written here, apart from the library's generator (spec 8.1), and from the read rules of spec
# 8.2 and 9.2 applied to the versions that rule implies: one update after each backward.


@functools.cache
def nf1b_slots(P: int, m: int, n: int) -> tuple[tuple[tuple[int, str, int], ...], ...]:
    """The paper's nF1B slot rule (spec 8.1): per stage, its ops in order as ``(slot, "F", micro-batch)``
    or ``(slot, "B", mini-batch)``.

    Each op (the F of one micro-batch, the B of one mini-batch) takes one slot and may consume only results
    finished in an earlier slot: every stage decides from the state left by the previous slot, and the
    decisions are applied together. A stage runs its next backward (mini-batches in order) if it ran all
    that mini-batch's forwards and the next stage (if any) ran its backward; otherwise its next forward
    (micro-batches in order) if the previous stage (if any) ran it and the stage then holds at most ``P - s``
    mini-batches in flight (forwarded at least in part, not backwarded: a new mini-batch is admitted only
    while fewer than ``P - s`` are in flight); otherwise it idles.
    """
    T = m * n
    forwarded: list[set[int]] = [set() for _ in range(P)]
    backwarded: list[set[int]] = [set() for _ in range(P)]
    rows: list[list[tuple[int, str, int]]] = [[] for _ in range(P)]
    slot = 0
    while any(len(done) < n for done in backwarded):
        decided = []
        for s in range(P):
            j, k = len(backwarded[s]), len(forwarded[s])  # the next backward and the next forward
            if (j < n and forwarded[s] >= set(range(j * m, j * m + m))
                    and (s == P - 1 or j in backwarded[s + 1])):
                decided.append((s, "B", j))
            elif k < T and (s == 0 or k in forwarded[s - 1]):
                in_flight = {i // m for i in forwarded[s]} - backwarded[s]
                if len(in_flight | {k // m}) <= P - s:
                    decided.append((s, "F", k))
        assert decided, f"the slot rule is stuck at slot {slot}"
        for s, op, i in decided:
            (forwarded if op == "F" else backwarded)[s].add(i)
            rows[s].append((slot, op, i))
        slot += 1
    return tuple(tuple(row) for row in rows)


@functools.cache
def nf1b_live_versions(P: int, m: int, n: int) -> tuple[tuple[dict[int, int], dict[int, int]], ...]:
    """Per stage, its live version (updates so far, one after each backward) when each F runs, by
    micro-batch, and when each B runs, by mini-batch, following the slot model's op order."""
    result = []
    for row in nf1b_slots(P, m, n):
        updates, at_forward, at_backward = 0, {}, {}
        for _, op, i in row:
            if op == "F":
                at_forward[i] = updates
            else:
                at_backward[i] = updates
                updates += 1
        result.append((at_forward, at_backward))
    return tuple(result)


def nf1b_expected(name: str, P: int, m: int, n: int, alpha=lambda d: math.exp(-d), degree: str = "versions"):
    """Expected ``(F read, live at F, B read, live at B, delay)`` per ``(stage, micro-batch)``.

    TiMePReSt's F reads the stage-0 tag (stage 0's live version when the micro-batch entered it), V- and
    I-TiMePReSt's the live version; every B reads the live version, I-TiMePReSt's interpolated towards its
    forward's version with coefficient ``alpha(d)`` when they differ (d = the version difference, or with
    ``degree="timeprest"`` the paper's v = floor((P+N-2)/N)). The delay is the B's live version minus the F's.
    """
    live = nf1b_live_versions(P, m, n)
    expected = {}
    for s in range(P):
        at_forward, at_backward = live[s]
        for k in range(m * n):
            forward = live[0][0][k] if name == "timeprest" else at_forward[k]
            b_live = at_backward[k // m]
            backward = WeightRead(b_live)
            if name == "i-timeprest" and b_live != forward:
                d = b_live - forward if degree == "versions" else (P + m - 2) // m
                a = alpha(d)
                # The end points are plain reads: the live weights (alpha 0) or the stashed ones (alpha 1).
                backward = WeightRead(b_live) if a == 0 else WeightRead(forward) if a == 1 else \
                    WeightRead(b_live, "interpolate", forward, a)
            expected[s, k] = (WeightRead(forward), at_forward[k], backward, b_live, b_live - forward)
    return expected


def nf1b_stash_versions(P: int, m: int, n: int) -> list[int]:
    """Peak versions per stage when every forward pins its version until its mini-batch's backward (I-TiMePReSt):
    the live one plus those pinned, counted after every op and just before each backward's update."""
    peaks = []
    for row in nf1b_slots(P, m, n):
        live, pinned, peak = 0, {}, 1
        for _, op, i in row:
            if op == "F":
                pinned[i] = live
            else:
                peak = max(peak, len(set(pinned.values()) | {live}))
                for k in range(i * m, i * m + m):
                    del pinned[k]
                live += 1
            peak = max(peak, len(set(pinned.values()) | {live}))
        peaks.append(peak)
    return peaks


def _same_read(a: WeightRead, b: WeightRead) -> bool:
    if (a.version, a.derivation, a.other) != (b.version, b.derivation, b.other):
        return False
    if a.coef is None or b.coef is None:
        return a.coef is b.coef
    return math.isclose(a.coef, b.coef, rel_tol=1e-12)


def nf1b_mismatches(t, name: str, P: int, m: int, n: int, **model) -> list:
    """Every ``(stage, micro-batch)`` where the trace differs from :func:`nf1b_expected` (empty: none)."""
    wrong = []
    for (s, k), want in nf1b_expected(name, P, m, n, **model).items():
        got = (t.read(s, k, F), t.live_version(s, k, F), t.read(s, k, B), t.live_version(s, k, B), t.delay(s, k))
        if not (_same_read(got[0], want[0]) and _same_read(got[2], want[2]) and got[1::2] == want[1::2]):
            wrong.append(((P, m, n), (s, k), "got", got, "want", want))
    return wrong


def paper_rows(P: int, m: int, n: int, slots: int) -> list[str]:
    """The model's first ``slots`` slots in the paper's notation: ``kX`` = F of micro-batch X of mini-batch k,
    ``Bk`` = B of mini-batch k (both from 1), ``.`` = idle."""
    rows = []
    for row in nf1b_slots(P, m, n):
        cells = {slot: f"{i // m + 1}{chr(ord('A') + i % m)}" if op == "F" else f"B{i + 1}" for slot, op, i in row}
        rows.append(" ".join(cells.get(i, ".") for i in range(slots)))
    return rows


def test_nf1b_model_reproduces_the_paper_figure():
    figure = [  # spec 8.1, P=3, N=2, as printed there (the same rows as in the library test below)
        "1A 1B 2A 2B 3A 3B B1 4A 4B B2",
        ".  1A 1B 2A 2B B1 3A 3B B2 4A",
        ".  .  1A 1B B1 2A 2B B2 3A 3B",
    ]
    assert [row.split() for row in paper_rows(3, 2, 4, 10)] == [line.split() for line in figure]


def test_nf1b_model_backward_recurs_every_n_plus_one_slots():
    # Spec 8.1: after the first backward, each stage's backward recurs every N+1 slots. The spec states it
    # for P <= N+1; under the rule it holds for every P (N forwards and one backward per mini-batch).
    for P in STAGES:
        for m in MICRO:
            for s, row in enumerate(nf1b_slots(P, m, 5)):
                starts = [slot for slot, op, _ in row if op == "B"]
                assert {b - a for a, b in zip(starts, starts[1:])} == {m + 1}


def test_nf1b_model_with_one_microbatch_is_1f1b():
    # Spec 8.1: with N=1 the rule degenerates to PipeDream's 1F1B: P-1-s forwards, then F(k+w), B(k) pairs.
    for P in STAGES:
        for n in (1, 2, 5, 12):
            for s, row in enumerate(nf1b_slots(P, 1, n)):
                w = min(P - 1 - s, n)
                order = [("F", k) for k in range(w)]
                for k in range(n - w):
                    order += [("F", k + w), ("B", k)]
                order += [("B", k) for k in range(n - w, n)]
                assert [(op, i) for _, op, i in row] == order


@functools.cache
def slot_trace(P: int, m: int, n: int):
    """A TiMePReSt run at one slot per op: F = 1 per micro-batch, B = 1/m per micro-batch (1 per mini-batch)."""
    return simulate("timeprest", P, m, n, costs={"forward": 1, "backward": 1 / m})


def test_nf1b_schedule_follows_the_slot_model():
    # The library's stage rows hold the model's ops in the model's order, for every size (m < P-1 included);
    # the versions every read names follow from that order alone.
    for P, m, n in grid_sizes():
        t = trace("timeprest", P, m, n)
        for s in range(P):
            got = []
            for e in t.events:
                a = e.action
                if a.stage == s and a.kind is F:
                    got.append(("F", a.index))
                elif a.stage == s and a.kind is B:
                    assert a.count == m and a.index % m == 0
                    got.append(("B", a.index // m))
            assert got == [(op, i) for _, op, i in nf1b_slots(P, m, n)[s]], (P, m, n, s)
    # With one slot per op the simulated start times are the slots.
    for P in STAGES:
        for m in MICRO:
            t = slot_trace(P, m, 5)
            for s in range(P):
                starts = [round(e.start, 9) for e in t.events if e.action.stage == s and e.action.kind is not U]
                assert starts == [slot for slot, _, _ in nf1b_slots(P, m, 5)[s]], (P, m, s)


@pytest.mark.parametrize("name", ["timeprest", "v-timeprest", "i-timeprest"])
def test_nf1b_reads_and_delays_match_the_slot_model(name):
    """Every F and B read, the live versions beside them and the delay per (stage, micro-batch), against the
    model, m < P-1 included."""
    delays = set()
    for P, m, n in grid_sizes():
        assert nf1b_mismatches(trace(name, P, m, n), name, P, m, n)[:3] == []
        delays |= {want[-1] for want in nf1b_expected(name, P, m, n).values()}
    assert delays == {0, 1, 2}  # at most n-1 = 2 updates between a forward and its backward here


@pytest.mark.parametrize("name", ["timeprest", "v-timeprest", "i-timeprest"])
@pytest.mark.parametrize("P, m", [(3, 2), (4, 1), (4, 2), (5, 3), (6, 2), (8, 3)])
def test_nf1b_long_runs_match_the_slot_model(name, P, m):
    """Past the warm-up the library builds the schedule from its periodic form; the reads still match, and
    the delays reach their steady state (at most P-1 updates; stage 0 sees the most)."""
    n = get_algorithm(name, P, m).warmup_minibatches + 3
    assert nf1b_mismatches(simulate(name, P, m, n), name, P, m, n)[:3] == []
    expected = nf1b_expected(name, P, m, n)
    delays = [max(expected[s, k][-1] for k in range(m * n)) for s in range(P)]
    assert delays[0] == max(delays) <= P - 1


def test_timeprest_vertical_sync_and_live_backward():
    for P, m, n in grid_sizes():
        t = trace("timeprest", P, m, n)
        for s, k in reads(P, m * n):
            assert t.version(s, k, F) == t.version(0, k, F)  # the stage-0 tag, at every stage
            assert t.version(s, k, B) == t.live_version(s, k, B)
        for k in range(m * n):
            assert t.version(0, k, F) == t.live_version(0, k, F)


def test_timeprest_versions_example():
    # Spec 8.2 (P=2, N=3): stage 0 holds 1 version, stage 1 holds 2 (vertical sync keeps the old one for the
    # micro-batches that reach stage 1 after it has updated).
    for n in (2, 3, 4, 6):
        t = trace("timeprest", 2, 3, n)
        assert [t.weight_versions(s) for s in range(2)] == [1, 2]
        assert any(t.version(1, k, F) < t.live_version(1, k, F) for k in range(3 * n))


def test_timeprest_stage_zero_never_stashes():
    for P, m, n in grid_sizes():
        assert trace("timeprest", P, m, n).weight_versions(0) == 1


def slot_grid(t) -> list[str]:
    """The timeline at one slot per op (F=1 per micro-batch, B=1 per mini-batch), '.' for an idle slot."""
    rows = []
    for s in range(t.num_stages):
        cells = {}
        for e in t.events:
            if e.action.stage == s and e.action.kind is not U:
                assert float(e.start).is_integer()
                cells[int(e.start)] = str(e.action)
        rows.append(" ".join(cells.get(i, ".") for i in range(max(cells) + 1)))
    return rows


def test_timeprest_reproduces_the_paper_grid_in_time():
    # Spec 8.1, P=3, N=2: "s0: 1A 1B 2A 2B 3A 3B B1 4A 4B B2", "s1: . 1A 1B 2A 2B B1 3A 3B B2 4A",
    # "s2: . . 1A 1B B1 2A 2B B2 3A 3B" (kX = micro-batch X of mini-batch k, Bk = backward of mini-batch k).
    t = simulate("timeprest", 3, 2, 4, costs={"forward": 1, "backward": 0.5})
    rows = slot_grid(t)
    assert rows[0].startswith("0F0 0F1 0F2 0F3 0F4 0F5 0B0-1 0F6 0F7 0B2-3")
    assert rows[1].startswith(". 1F0 1F1 1F2 1F3 1B0-1 1F4 1F5 1B2-3 1F6")
    assert rows[2].startswith(". . 2F0 2F1 2B0-1 2F2 2F3 2B2-3 2F4 2F5")


def test_nf1b_backward_recurs_every_n_plus_one_slots():
    # Spec 8.1: after the first backward, each stage's backward recurs every N+1 slots (stated for P <= N+1,
    # true for every P, as the slot model shows).
    for P in STAGES:
        for m in MICRO:
            t = slot_trace(P, m, 5)
            for s in range(P):
                starts = [e.start for e in t.events if e.action.stage == s and e.action.kind is B]
                assert {round(b - a, 9) for a, b in zip(starts, starts[1:])} == {m + 1}


def test_timeprest_stash_rule():
    t = simulate("timeprest", 3, 2, 3, backward_rule="stash")
    for s, k in reads(3, 6):
        assert t.version(s, k, B) == t.version(s, k, F)


def test_timeprest_version_difference_is_not_the_delay_between_forward_and_backward():
    """TiMePReSt's "version difference" v = floor((P+N-2)/N) is 1 at P=3, N=2 (the paper's Fig. 2), yet
    under V-TiMePReSt, where every read is the live version, stages 0, 1 and 2 make 2, 1 and 0 updates
    between a micro-batch's forward and its backward in steady state (from the slot model; TiMePReSt's
    forwards read stage 0's tag, so there every stage sees stage 0's 2). v is therefore not the number of
    updates between a forward and its backward; the simulator's delay is."""
    P, m, n = 3, 2, 8
    assert timeprest_version_difference(P, m) == (P + m - 2) // m == 1
    expected = nf1b_expected("v-timeprest", P, m, n)
    steady = range((P - 1) * m, m * n)  # from mini-batch P-1 = 2 on, to the end of the run
    assert [{expected[s, k][-1] for k in steady} for s in range(P)] == [{2}, {1}, {0}]
    for name, delays in (("v-timeprest", [2, 1, 0]), ("timeprest", [2, 2, 2])):
        t = trace(name, P, m, n)
        assert [{t.delay(s, k) for k in steady} for s in range(P)] == [{d} for d in delays]
        assert [t.stage_summary(s).max_delay for s in range(P)] == delays


def test_v_timeprest_is_staleness_free():
    for P, m, n in grid_sizes():
        t = trace("v-timeprest", P, m, n)
        for s, k in reads(P, m * n):
            for kind in (F, B):
                assert t.version(s, k, kind) == t.live_version(s, k, kind)
                assert t.staleness(s, k, kind) == 0 and t.read(s, k, kind).derivation is None
        assert [t.weight_versions(s) for s in range(P)] == [1] * P


@pytest.mark.parametrize("name", ["v-timeprest", "i-timeprest"])
def test_staleness_free_nf1b_accepts_m_below_p_minus_1(name):
    """The paper's N >= P-1 (v = 1) is not required: it changes no read. For m < P-1 (where v > 1),
    V-TiMePReSt still reads the live version everywhere (staleness 0, one version per stage) and both read
    as the slot model says."""
    sizes = [(P, m, n) for P, m, n in grid_sizes() if m < P - 1]
    assert len(sizes) == 63
    for P, m, n in sizes:
        algorithm = get_algorithm(name, P, m)
        assert (algorithm.num_stages, algorithm.n_microbatches, algorithm.update_every) == (P, m, m)
        assert timeprest_version_difference(P, m) > 1
        t = trace(name, P, m, n)
        assert nf1b_mismatches(t, name, P, m, n)[:3] == []
        if name == "v-timeprest":
            for s, k in reads(P, m * n):
                assert t.staleness(s, k, F) == t.staleness(s, k, B) == 0
                assert t.read(s, k, F) == WeightRead(t.live_version(s, k, F))
                assert t.read(s, k, B) == WeightRead(t.live_version(s, k, B))
            assert [t.weight_versions(s) for s in range(P)] == [1] * P
        else:
            assert [t.weight_versions(s) for s in range(P)] == nf1b_stash_versions(P, m, n)


ALPHAS = [
    ({}, lambda d: math.exp(-d)),
    ({"lam": 0.5}, lambda d: math.exp(-0.5 * d)),
    ({"lam": 2.0}, lambda d: math.exp(-2.0 * d)),
    ({"alpha": "inverse"}, lambda d: 1 / (1 + d)),
    ({"alpha": "inverse", "lam": 0.25}, lambda d: 1 / (1 + 0.25 * d)),
    ({"alpha": "constant", "lam": 0.3}, lambda d: 0.3),
    ({"alpha": lambda d: 0.5 ** d}, lambda d: 0.5 ** d),
]

# Small sizes exercising d = 0..4, m < P-1 included; the default alpha also runs on the whole grid above.
ALPHA_SIZES = [(2, 3, 3), (3, 1, 3), (3, 2, 4), (4, 2, 3), (4, 3, 3), (5, 1, 5), (5, 4, 2)]


@pytest.mark.parametrize("options, alpha", ALPHAS)
def test_i_timeprest_interpolates_towards_the_live_weights(options, alpha):
    staleness_seen = set()
    for P, m, n in ALPHA_SIZES:
        t = simulate("i-timeprest", P, m, n, **options)
        assert nf1b_mismatches(t, "i-timeprest", P, m, n, alpha=alpha)[:3] == []
        staleness_seen |= {want[-1] for want in nf1b_expected("i-timeprest", P, m, n).values()}
    assert staleness_seen == {0, 1, 2, 3, 4}  # the formula was exercised at several degrees of staleness


def test_i_timeprest_default_alpha_in_the_grid():
    t = simulate("i-timeprest", 3, 2, 4)
    assert t.read(0, 4, B).coef == pytest.approx(math.exp(-2))
    assert str(t.read(0, 4, B)) == "v2~interp(v0,a=0.135)"
    # Stashing: the stage keeps every forward version still in flight plus the live one.
    assert [t.weight_versions(s) for s in range(3)] == [3, 2, 1] == nf1b_stash_versions(3, 2, 4)


def test_i_timeprest_versions_are_the_pinned_ones_plus_the_live_one():
    for P, m, n in grid_sizes():
        t = trace("i-timeprest", P, m, n)
        assert [t.weight_versions(s) for s in range(P)] == nf1b_stash_versions(P, m, n), (P, m, n)


@pytest.mark.parametrize("options, coef", [
    ({"lam": math.inf}, 0.0),
    ({"alpha": "inverse", "lam": math.inf}, 0.0),
    ({"alpha": "constant", "lam": 0.0}, 0.0),
    ({"lam": 0.0}, 1.0),
    ({"alpha": "inverse", "lam": 0.0}, 1.0),
    ({"alpha": "constant", "lam": 1.0}, 1.0),
])
def test_i_timeprest_lambda_at_its_ends(options, coef):
    """lam = inf gives alpha = 0 (the live weights, V-TiMePReSt's backward); lam = 0 gives alpha = 1 (the
    stashed weights, PipeDream's); for alpha="constant", lam itself is the coefficient, 0 or 1. Both ends are
    plain reads of one version (exact, no derived weights)."""
    for P, m, n in ALPHA_SIZES:
        t = simulate("i-timeprest", P, m, n, **options)
        assert nf1b_mismatches(t, "i-timeprest", P, m, n, alpha=lambda d: coef)[:3] == []
        backward = [t.read(s, k, B) for s, k in reads(P, m * n)]
        assert all(read.derivation is None for read in backward)
        stale = [(s, k) for s, k in reads(P, m * n) if t.read(s, k, B).version < t.live_version(s, k, B)]
        assert bool(stale) == (coef == 1.0)  # only the stashed end reads behind the live version
        assert not any(t.derived_weights(s) for s in range(P))


@pytest.mark.parametrize("fn, first_bad", [
    (lambda d: 1.5, "alpha(1) = 1.5"),
    (lambda d: -0.1, "alpha(1) = -0.1"),
    (lambda d: math.nan, "alpha(1) = nan"),
    (lambda d: 0.6 * d, "alpha(2) = 1.2"),  # in range at d = 1, out of it at d = 2
])
def test_i_timeprest_callable_alpha_outside_0_1_fails_when_read(fn, first_bad):
    algorithm = get_algorithm("i-timeprest", 3, 2, alpha=fn)  # a callable is only checked where it is used
    with pytest.raises(ValueError) as info:
        simulate(algorithm, 3, 2, 4)
    assert str(info.value).startswith(f"{first_bad}: the interpolation weight of the stashed weights must lie "
                                      "in [0, 1]")


@pytest.mark.parametrize("options, alpha", [ALPHAS[0], ALPHAS[3], ALPHAS[5]])
def test_i_timeprest_degree_timeprest_uses_the_papers_version_difference(options, alpha):
    """``degree="timeprest"``: wherever the stashed version is not the live one, the coefficient is alpha(v)
    with v = floor((P+N-2)/N), whatever the actual version difference."""
    vs = set()
    for P, m, n in ALPHA_SIZES + [(6, 2, 3), (8, 3, 3)]:
        v = (P + m - 2) // m
        assert timeprest_version_difference(P, m) == v
        vs.add(v)
        t = simulate("i-timeprest", P, m, n, degree="timeprest", **options)
        assert nf1b_mismatches(t, "i-timeprest", P, m, n, alpha=alpha, degree="timeprest")[:3] == []
        interpolated = {t.read(s, k, B).coef for s, k in reads(P, m * n) if t.read(s, k, B).derivation}
        assert len(interpolated) == 1 and math.isclose(interpolated.pop(), alpha(v), rel_tol=1e-12)
    assert vs == {1, 2, 3, 4}


# --------------------------------------------------------------------------- continuous runs


@pytest.mark.parametrize("name", algorithm_names())
def test_running_ahead_then_flushing_equals_a_plain_run(name):
    """How the training engine drives a pipeline: run a longer schedule as far as the mini-batches given
    so far allow, step by step, then switch to the n-mini-batch schedule (its drain) and finish. Every
    stage must perform exactly the actions and reads of a plain n-mini-batch run."""
    for P in range(1, 6):
        for m in range(1, 5):
            try:
                algorithm = get_algorithm(name, P, m)
            except ValueError:
                continue
            for n in (1, 2, 3):
                workers = [StageWorker(algorithm, s) for s in range(P)]
                executor = Executor(algorithm.schedule(n + 2), workers, Costs.uniform(P))
                for j in range(1, n + 1):
                    executor.run(available=j * m)
                    started = [e.action.index for e in executor.events if e.action.stage == 0 and e.action.kind is F]
                    assert max(started) == j * m - 1
                executor.extend(algorithm.schedule(n))
                executor.run()
                plain = simulate(algorithm, P, m, n)
                for s in range(P):
                    got = [(e.action, e.record.reads) for e in executor.events if e.action.stage == s]
                    want = [(e.action, e.record.reads) for e in plain.events if e.action.stage == s]
                    assert got == want, (name, P, m, n, s)
                    assert workers[s].book.peak_versions == plain.weight_versions(s)


@pytest.mark.parametrize("name", algorithm_names())
def test_a_workers_tallies_are_the_staleness_and_delay_of_its_records(name):
    """A worker tallies what its actions read as they complete (what ``Pipeline.stats()`` reports): the same
    count, total and maximum as the records' reads give, staleness over every read and delay over the backwards'
    forward reads (live version at the action minus the version read)."""
    P, m, n = 4, 4, 3
    algorithm = get_algorithm(name, P, m)
    workers = [StageWorker(algorithm, s) for s in range(P)]
    executor = Executor(algorithm.schedule(n), workers, Costs.uniform(P))
    executor.run()
    for s, worker in enumerate(workers):
        events = [e for e in executor.events if e.action.stage == s]
        staleness = [e.record.live - r.version for e in events for r in e.record.reads.values()]
        delays = [e.record.live - r.version for e in events for r in e.record.forward_reads.values()]
        assert len(staleness) == m * n * 2 and len(delays) == m * n  # a read per F and B; a forward read per B
        for tally, values in ((worker.staleness, staleness), (worker.delays, delays)):
            assert (tally.count, tally.total, tally.max) == (len(values), sum(values), max(values)), (name, s)
            assert tally.mean == sum(values) / len(values)


def test_without_events_the_executor_keeps_no_timeline_and_reports_the_recorded_stages_only():
    """``keep_events=False`` (training): no events, no simulated times on the messages, the same actions and
    reads as with them; ``on_record`` hears of the ``recorded_stages``' actions only, each once, in order."""
    P, m = 3, 4
    algorithm = get_algorithm("pipedream", P, m)
    timed = Executor(algorithm.schedule(2), [StageWorker(algorithm, s) for s in range(P)], Costs.uniform(P))
    timed.run()
    heard = []
    workers = [StageWorker(algorithm, s) for s in range(P)]
    executor = Executor(algorithm.schedule(2), workers, Costs.uniform(P), keep_events=False,
                        on_record=lambda action, record: heard.append((action, record.reads)),
                        recorded_stages=frozenset({0, 2}))
    sent = []
    send = executor.transport.send
    executor.transport.send = lambda *args: (sent.append(args[-1].ready_at), send(*args))[1]
    executor.run()
    assert executor.events == [] and executor.rank_free == [0.0] * P
    assert sent and set(sent) == {0.0}
    assert heard == [(e.action, e.record.reads) for e in timed.events if e.action.stage in (0, 2)]
    assert [e.action for e in timed.events if e.action.stage in (0, 2)] == [a for a, _ in heard]
    assert timed.rank_free != [0.0] * P  # the timeline is there when events are kept
