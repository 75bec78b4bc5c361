"""The simulator's traces of the modern schedules against the published figures (F = B = W = 1, no send time).

``b = (p-1)/(m+p-1)`` is 1F1B's bubble with ``p`` ranks when a backward costs B + W. The papers: interleaving
with ``v`` stages per rank about ``b/v`` (Narayanan et al., SC'21); ZB-H1 about ``b/3`` at 1F1B's activation
memory and ZB-V about 0 (Qi et al., ICLR'24); DualPipeV below 1F1B (DeepSeek-V3). Activations per rank are
counted in micro-batches of a rank's share of the model: a rank holding ``v`` chunks holds ``1/v`` of a
micro-batch's activations per chunk."""

from __future__ import annotations

import pytest

from pipecore import simulate

COSTS = {"forward": 1, "backward": 1, "weight": 1}


def trace(name: str, ranks: int, m: int, v: int = 1):
    options = {} if v == 1 else {"stages_per_rank": v}
    return simulate(name, ranks * v, m, 1, costs=COSTS, **options)


def activations(t, v: int) -> float:
    """The most activations a rank holds, in micro-batches of its share of the model."""
    return max(t.rank_peak_activations(r) for r in range(t.num_ranks)) / v


@pytest.mark.parametrize("ranks,m", [(2, 8), (4, 12), (4, 16), (8, 32)])
def test_zero_bubble_h1_has_at_most_four_tenths_of_one_f_one_b_bubble(ranks, m):
    # The bound holds from m >= 3(p-1): below it, the last rank's own 3m units of work over its start at p-1 leave
    # more than 0.4 b whatever the order (tests/test_modern_schedules.py checks the makespan against that bound).
    one_f_one_b = trace("1f1b", ranks, m)
    zb = trace("zb-h1", ranks, m)
    assert zb.bubble_fraction <= 0.4 * one_f_one_b.bubble_fraction
    assert activations(zb, 1) <= activations(one_f_one_b, 1)


@pytest.mark.parametrize("ranks,m,v", [(4, 8, 2), (4, 16, 2), (4, 16, 4), (2, 8, 2)])
def test_interleaving_divides_the_bubble_by_the_stages_per_rank(ranks, m, v):
    b = trace("1f1b", ranks, m).bubble_fraction
    got = trace("interleaved-1f1b", ranks, m, v).bubble_fraction
    # Megatron's (p-1)/(v m + p-1): b/v as m grows; within a fifth of it for these sizes.
    assert got == pytest.approx((ranks - 1) / (v * m + ranks - 1))
    assert b / v <= got <= 1.2 * b / v


@pytest.mark.parametrize("ranks,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_v_is_nearly_bubble_free_at_one_f_one_b_memory(ranks, m):
    zbv = trace("zb-v", ranks, m, 2)
    assert zbv.bubble_fraction <= 0.1
    assert activations(zbv, 2) <= activations(trace("1f1b", ranks, m), 1)


@pytest.mark.parametrize("ranks,m", [(2, 4), (4, 8), (4, 16)])
def test_dualpipe_v_is_below_one_f_one_b(ranks, m):
    assert trace("dualpipe-v", ranks, m, 2).bubble_fraction < trace("1f1b", ranks, m).bubble_fraction


def test_a_split_backward_costs_its_parts_and_an_unsplit_one_their_sum():
    t = trace("zb-h1", 2, 4)
    durations = {(e.action.kind.value, e.end - e.start) for e in t.events if e.action.kind.value in "BW"}
    assert durations == {("B", 1.0), ("W", 1.0)}
    t = trace("1f1b", 2, 4)
    assert {e.end - e.start for e in t.events if e.action.kind.value == "B"} == {2.0}
