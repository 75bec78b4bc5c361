"""Version traces of every algorithm against the formulas of the algorithms spec.

Micro-batches are numbered globally from 0 (``k``), mini-batch ``k // m``; ``w = P - 1 - s`` is stage
``s``'s warm-up depth under 1F1B; ``T = m * n`` is the number of micro-batches simulated.
"""

from __future__ import annotations

import functools
import math

import pytest

from pipecore import algorithm_names, get_algorithm, simulate
from pipecore.algorithms import ALIASES, get_spec
from pipecore.algorithms.pipemare import stage_delay
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
    assert algorithm_names() == [
        "gpipe", "1f1b", "pipedream", "2bw", "pipemare", "spectrain", "timeprest", "v-timeprest", "i-timeprest",
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


@pytest.mark.parametrize("name", ["v-timeprest", "i-timeprest"])
def test_staleness_free_nf1b_needs_m_at_least_p_minus_1(name):
    for P in STAGES:
        for m in MICRO:
            if m < P - 1:
                with pytest.raises(ValueError) as info:
                    get_algorithm(name, P, m)
                message = str(info.value)
                assert message.startswith(f"{name}: needs n_microbatches >= num_stages - 1 "
                                          f"(got n_microbatches={m}, num_stages={P})")
                assert "v equals 1 only when P <= N + 1" in message
            else:
                get_algorithm(name, P, m)


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(ValueError) as info:
        get_algorithm("i-timeprest", 3, 2, lambda_=0.5)
    assert str(info.value) == (
        "unknown option(s) ['lambda_'] for algorithm 'i-timeprest'; valid options: alpha, backward_rule, lam"
    )
    with pytest.raises(ValueError, match="valid options: none"):
        get_algorithm("gpipe", 3, 2, lam=0.5)


@pytest.mark.parametrize("name, options, expected", [
    ("i-timeprest", {"lam": "fast"}, "i-timeprest: option lam='fast': must be a finite number (default 1.0)"),
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


def test_pipemare_backward_corrects_the_live_weights():
    seen_correction = False
    for P, m, n in grid_sizes():
        t = trace("pipemare", P, m, n)
        for s, k in reads(P, m * n):
            f, b = t.read(s, k, F), t.read(s, k, B)
            assert f.derivation is None and f.version == t.live_version(s, k, F)
            tau = t.live_version(s, k, B) - f.version
            assert tau == t.delay(s, k) == expected_async_delay(P, s, k, m)
            assert b.version == t.live_version(s, k, B)
            if tau == 0:
                assert b.derivation is None
            else:
                assert (b.derivation, b.coef) == ("correct", tau)
                seen_correction = True
        assert [t.weight_versions(s) for s in range(P)] == [1] * P
    assert seen_correction


def test_pipemare_stage_delay_is_the_measured_maximum():
    for P, m, n in grid_sizes():
        t = trace("pipemare", P, m, n)
        algorithm = get_algorithm("pipemare", P, m)
        for s in range(P):
            w = P - 1 - s
            if w > 0 and m * n > m * math.ceil(w / m):
                assert stage_delay(s, algorithm) == t.stage_summary(s).max_delay == math.ceil(w / m)


def test_pipemare_lr_warmup():
    a = get_algorithm("pipemare", 4, 1, warmup_steps=10)
    # Stage 0 has delay 3: its learning rate starts at 1/3 and reaches 1 after 10 updates.
    assert a.lr_scale(0, 0) == pytest.approx(1 / 3)
    assert a.lr_scale(0, 5) == pytest.approx(3 ** -0.5)
    assert a.lr_scale(0, 10) == a.lr_scale(0, 50) == 1.0
    linear = get_algorithm("pipemare", 4, 1, warmup_steps=10, lr_warmup="linear")
    assert linear.lr_scale(0, 5) == pytest.approx(1 / 3 + (2 / 3) * 0.5)
    assert a.velocity_decay(0) == pytest.approx(0.1 ** (1 / 3))
    assert get_algorithm("pipemare", 4, 1, delta_decay=0.5).velocity_decay(0) == 0.5


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


def test_spectrain_lookahead_overrides_the_forward_horizon_only():
    t = simulate("spectrain", 4, 2, 2, lookahead=[5, 0, 2, 1])
    for k in range(4):
        assert [t.read(s, k, F).coef for s in range(4)] == [5.0, None, 2.0, 1.0]
        assert [t.read(s, k, B).coef for s in range(4)] == [None, None, 1.0, 1.0]


# --------------------------------------------------------------------------- nF1B family


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
    # Spec 8.1: after the first backward, each stage's backward recurs every N+1 slots (when P <= N+1).
    for P in STAGES:
        for m in MICRO:
            if P > m + 1:
                continue
            t = simulate("timeprest", P, m, 5, costs={"forward": 1, "backward": 1 / m})
            for s in range(P):
                starts = [e.start for e in t.events if e.action.stage == s and e.action.kind is B]
                assert {b - a for a, b in zip(starts, starts[1:])} == {m + 1}


def test_timeprest_stash_rule():
    t = simulate("timeprest", 3, 2, 3, backward_rule="stash")
    for s, k in reads(3, 6):
        assert t.version(s, k, B) == t.version(s, k, F)


def test_v_timeprest_is_staleness_free():
    for P, m, n in grid_sizes(min_m=lambda P: P - 1):
        t = trace("v-timeprest", P, m, n)
        for s, k in reads(P, m * n):
            for kind in (F, B):
                assert t.version(s, k, kind) == t.live_version(s, k, kind)
                assert t.staleness(s, k, kind) == 0 and t.read(s, k, kind).derivation is None
        assert [t.weight_versions(s) for s in range(P)] == [1] * P


ALPHAS = [
    ({}, lambda d: math.exp(-d)),
    ({"lam": 0.5}, lambda d: math.exp(-0.5 * d)),
    ({"lam": 2.0}, lambda d: math.exp(-2.0 * d)),
    ({"alpha": "inverse"}, lambda d: 1 / (1 + d)),
    ({"alpha": "inverse", "lam": 0.25}, lambda d: 1 / (1 + 0.25 * d)),
    ({"alpha": "constant", "lam": 0.3}, lambda d: 0.3),
    ({"alpha": lambda d: 0.5 ** d}, lambda d: 0.5 ** d),
]


@pytest.mark.parametrize("options, alpha", ALPHAS)
def test_i_timeprest_interpolates_towards_the_live_weights(options, alpha):
    staleness_seen = set()
    for P, m, n in grid_sizes(min_m=lambda P: P - 1):
        if P > 5:
            continue
        t = simulate("i-timeprest", P, m, n, **options)
        for s, k in reads(P, m * n):
            f, b = t.read(s, k, F), t.read(s, k, B)
            assert f.derivation is None and f.version == t.live_version(s, k, F)
            live = t.live_version(s, k, B)
            d = live - f.version
            assert d == t.delay(s, k)
            assert b.version == live
            if d == 0:
                assert b.derivation is None
            else:
                assert (b.derivation, b.other) == ("interpolate", f.version)
                assert b.coef == pytest.approx(alpha(d), rel=1e-12)
            staleness_seen.add(d)
    assert {0, 1, 2} <= staleness_seen  # the formula was exercised at several degrees of staleness


def test_i_timeprest_default_alpha_in_the_grid():
    t = simulate("i-timeprest", 3, 2, 4)
    assert t.read(0, 4, B).coef == pytest.approx(math.exp(-2))
    assert str(t.read(0, 4, B)) == "v2~interp(v0,a=0.135)"
    # Stashing: the stage keeps every forward version still in flight plus the live one.
    assert [t.weight_versions(s) for s in range(3)] == [3, 2, 1]


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
