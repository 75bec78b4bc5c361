"""Modern schedule families (pipecore.schedule.modern): validity, placement, errors, and their quality with a
small list-scheduling timer (each rank runs its list in order, every action costs 1, no send time)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipecore.schedule import (
    B, F, Schedule, W, dualpipe_v, interleaved_one_f_one_b, looped_bfs, one_f_one_b, validate, zero_bubble_h1,
    zero_bubble_v,
)
from pipecore.schedule.modern import MODERN_FAMILIES
from pipecore.schedule.schedule import upstream

LOOPED = (interleaved_one_f_one_b, looped_bfs, zero_bubble_h1)
V_SHAPED = (zero_bubble_v, dualpipe_v)


# --------------------------------------------------------------------------- the timer


def timed(schedule: Schedule) -> tuple[int, float, list[float]]:
    """``(makespan, bubble fraction, peak activations per rank)`` with every action costing 1.

    An action starts when its rank has finished the previous action of its list and the remote work it needs
    (:func:`upstream`, as in progress.py) has ended. Activations of a (stage, micro-batch) are held from the
    start of its F to the end of its W (stages that split backwards) or of its B; a rank's peak counts them
    over its stages, each weighted ``1 / stages on the rank`` (a stage holds that share of the rank's layers),
    so that it compares with 1F1B's count of whole micro-batches.
    """
    rows, P = schedule.rank_rows, schedule.num_stages
    end: dict = {}
    at, free = [0] * len(rows), [0] * len(rows)
    events: list[list] = [[] for _ in rows]
    progressed = True
    while progressed:
        progressed = False
        for r, row in enumerate(rows):
            while at[r] < len(row):
                a = row[at[r]]
                need = upstream(a, P)
                if need is not None and need not in end:
                    break
                start = max(free[r], end[need] if need is not None else 0)
                free[r] = end[(a.stage, a.kind, a.index)] = start + 1
                events[r].append((a, start, start + 1))
                at[r] += 1
                progressed = True
    assert all(at[r] == len(row) for r, row in enumerate(rows)), "the timer found a deadlock"
    makespan = max(free)
    bubble = 1 - sum(len(row) for row in rows) / (len(rows) * makespan)
    peaks = []
    for r in range(len(rows)):
        split = {a.stage for a, _, _ in events[r] if a.kind is W}
        weight = 1 / len(schedule.stages_of(r))
        held: dict = {}
        for a, start, stop in events[r]:
            if a.kind is F:
                held[(a.stage, a.index)] = [start, None]
            elif a.kind is W or (a.kind is B and a.stage not in split):
                held[(a.stage, a.index)][1] = stop
        points = sorted([(s, 1) for s, _ in held.values()] + [(e, -1) for _, e in held.values()])
        count = peak = 0
        for _, d in points:  # at equal times a release (-1) sorts before an acquire
            count += d
            peak = max(peak, count)
        peaks.append(peak * weight)
    return makespan, bubble, peaks


def one_f_one_b_bubble(ranks: int, m: int) -> float:
    return (ranks - 1) / (m + ranks - 1)


QUALITY_SIZES = [(R, m) for R in (2, 4) for m in (4, 8, 16)]


def test_timer_reproduces_one_f_one_b():
    for R, m in QUALITY_SIZES:
        makespan, bubble, peaks = timed(one_f_one_b(R, m))
        assert makespan == 2 * (m + R - 1)
        assert bubble == pytest.approx(one_f_one_b_bubble(R, m))
        assert peaks[0] == R


# --------------------------------------------------------------------------- validity and shape


def _sizes():
    for family in LOOPED + V_SHAPED:
        for P in (4, 8):
            for v in (1, 2):
                if family in V_SHAPED and v != 2:
                    continue
                R = P // v
                for m in range(1, 17):
                    if v > 1 and family in (interleaved_one_f_one_b, zero_bubble_h1) and m % R:
                        continue
                    if family is dualpipe_v and m < P:
                        continue
                    for n in (1, 3):
                        yield family, P, m, n, v


@pytest.mark.parametrize("family", LOOPED + V_SHAPED, ids=lambda f: f.__name__)
def test_validates_and_is_complete(family):
    count = 0
    for fam, P, m, n, v in _sizes():
        if fam is not family:
            continue
        s = family(P, m, n, stages_per_rank=v)
        validate(s)
        validate(s.with_updates(m))
        assert (s.num_stages, s.n_microbatches, s.n_minibatches, s.num_ranks) == (P, m, n, P // v)
        split = family in (zero_bubble_h1, zero_bubble_v, dualpipe_v)
        for stage, row in enumerate(s.stages):
            kinds = sorted(str(a.kind) for a in row)
            assert kinds.count("F") == kinds.count("B") == m * n
            assert kinds.count("W") == (m * n if split else 0), (family.__name__, stage)
        # a flush: all of mini-batch j's actions on a rank before any of j+1's
        for row in s.rank_rows:
            minibatches = [a.index // m for a in row]
            assert minibatches == sorted(minibatches)
        count += 1
    assert count > 10


def test_interleaved_with_one_stage_per_rank_and_no_slack_is_one_f_one_b():
    for P in range(1, 9):
        for m in range(1, 10):
            for n in (1, 2, 3):
                ours, theirs = interleaved_one_f_one_b(P, m, n, slack=0), one_f_one_b(P, m, n)
                assert ours.stages == theirs.stages, ours.diff(theirs)
                assert tuple(ours.rank_rows) == tuple(theirs.rank_rows)


def test_interleaved_warms_up_like_megatron_two_forwards_per_rank_downstream():
    # 4 ranks, 2 chunks each, 8 micro-batches: rank 0 warms up with (v-1)*R + 2*(R-1) = 10 forwards (Megatron-LM's
    # and torch's ScheduleInterleaved1F1B's count), then alternates F and B; slack=0 warms up with (v-1)*R + R-1 = 7.
    s = interleaved_one_f_one_b(8, 8, stages_per_rank=2)
    assert " ".join(map(str, s.ranks[0])) == (
        "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 "
        "0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7 0B1 "
        "0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7"
    )
    lean = interleaved_one_f_one_b(8, 8, stages_per_rank=2, slack=0)
    assert [a.kind for a in lean.ranks[0][:9]] == [F] * 8 + [B]
    assert [str(a) for a in lean.ranks[3][:6]] == ["3F0", "3F1", "3F2", "3F3", "7F0", "7B0"]  # the last rank: no hop


@pytest.mark.parametrize("R", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_interleaved_is_torchs_interleaved_1f1b_order(R, v):
    # torch.distributed.pipelining's own per-rank action lists (its list builder, called without process groups).
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B
    for m in (R, 2 * R, 3 * R, 4 * R):
        shape = SimpleNamespace(n_local_stages=v, pp_group_size=R, microbatches_per_round=m // max(1, m // R),
                                _n_microbatches=m)
        ours = interleaved_one_f_one_b(v * R, m, stages_per_rank=v)
        for r in range(R):
            theirs = [str(a) for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(shape, r)
                      if a is not None]
            assert [str(a) for a in ours.rank_rows[r]] == theirs, (R, v, m, r)


def test_interleaved_refuses_a_bad_slack():
    for slack in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match=r"slack must be an integer >= 0"):
            interleaved_one_f_one_b(4, 4, stages_per_rank=2, slack=slack)


def test_interleaved_is_depth_first_in_groups_of_ranks():
    s = interleaved_one_f_one_b(4, 4, stages_per_rank=2)  # R = 2
    assert [str(a) for a in s.ranks[0] if a.kind is F] == ["0F0", "0F1", "2F0", "2F1", "0F2", "0F3", "2F2", "2F3"]
    assert [str(a) for a in s.ranks[0] if a.kind is B] == ["2B0", "2B1", "0B0", "0B1", "2B2", "2B3", "0B2", "0B3"]


def test_looped_bfs_order():
    s = looped_bfs(6, 3, stages_per_rank=3)  # R = 2: rank 0 holds 0, 2, 4
    assert " ".join(map(str, s.ranks[0])) == ("0F0 0F1 0F2 2F0 2F1 2F2 4F0 4F1 4F2 "
                                              "4B0 4B1 4B2 2B0 2B1 2B2 0B0 0B1 0B2")


@pytest.mark.parametrize("name", sorted(MODERN_FAMILIES))
def test_every_stage_runs_its_backwards_in_microbatch_order(name):
    """A stage accumulates gradients in the order sequential training does (bit for bit), and the last
    micro-batch of an update group is its last B and W: tied weights and the global gradient norm wait for it."""
    s = MODERN_FAMILIES[name](8, 8, 2, stages_per_rank=2)
    for row in s.stages:
        for kind in (B, W):
            indices = [a.index for a in row if a.kind is kind]
            assert indices == sorted(indices), (name, kind)


def test_zero_bubble_h1_every_b_has_its_w_after_it():
    s = zero_bubble_h1(4, 8)
    for row in s.stages:
        assert [a.index for a in row if a.kind is B] == list(range(8))
        assert [a.index for a in row if a.kind is W] == list(range(8))
    # the last rank defers its first R-1 W's to the end; the first runs F B W in the steady state
    assert [str(a) for a in s.ranks[3][-3:]] == ["3W5", "3W6", "3W7"]
    assert " ".join(map(str, s.ranks[0][:6])) == "0F0 0F1 0F2 0F3 0B0 0W0"


def test_dualpipe_v_pairs_a_forward_with_another_backward():
    m, R = 16, 4
    s = dualpipe_v(2 * R, m)
    for r, row in enumerate(s.ranks):
        # an F of one of the rank's stages immediately followed by a B of its other stage: the main phase's
        # 2 * (m - 2R + r + 1) overlapped pairs and the R - r - 1 of the phase after it
        pairs = [(a, b) for a, b in zip(row, row[1:]) if a.kind is F and b.kind is B and a.stage != b.stage]
        assert len(pairs) == 2 * (m - 2 * R + r + 1) + (R - r - 1), r


@pytest.mark.parametrize("P,v", [(4, 1), (8, 1), (4, 2), (8, 2), (8, 4)])
def test_looped_placement(P, v):
    R = P // v
    for family in LOOPED:
        s = family(P, 2 * R, stages_per_rank=v)
        assert s.placement == tuple(stage % R for stage in range(P))
        assert s.stages_of(0) == tuple(range(0, P, R))


@pytest.mark.parametrize("R", [1, 2, 3, 4])
def test_v_placement(R):
    for family in V_SHAPED:
        s = family(2 * R, 2 * R)
        assert s.placement == tuple(list(range(R)) + list(reversed(range(R))))
        assert s.stages_of(0) == (0, 2 * R - 1)
        assert s.stages_of(R - 1) == (R - 1, R)


def test_families_table():
    assert set(MODERN_FAMILIES.values()) == set(LOOPED + V_SHAPED)


# --------------------------------------------------------------------------- bad sizes


@pytest.mark.parametrize("family", LOOPED + V_SHAPED, ids=lambda f: f.__name__)
def test_bad_common_sizes(family):
    v = 2 if family in V_SHAPED else 1
    for args, word in [((0, 8), "num_stages"), ((4, 0), "n_microbatches"), ((4, 8, 0), "n_minibatches"),
                       ((4.0, 8), "num_stages"), ((4, True), "n_microbatches")]:
        with pytest.raises(ValueError, match=f"{word} must be (an integer )?>= 1"):
            family(*args, stages_per_rank=v)
    with pytest.raises(ValueError, match="stages_per_rank"):
        family(4, 8, stages_per_rank=0)


def test_bad_stage_multiples():
    for family in LOOPED:
        with pytest.raises(ValueError, match=r"num_stages \(6\) must be a multiple of stages_per_rank \(4\)"):
            family(6, 8, stages_per_rank=4)
    for family in V_SHAPED:
        with pytest.raises(ValueError, match=r"num_stages \(5\) must be a multiple of stages_per_rank \(2\)"):
            family(5, 10)


def test_rounds_need_microbatches_a_multiple_of_ranks():
    for family in (interleaved_one_f_one_b, zero_bubble_h1):
        with pytest.raises(ValueError, match=r"n_microbatches \(6\) must be a multiple of the number of ranks \(4"):
            family(8, 6, stages_per_rank=2)
        family(4, 6)  # one stage per rank: any m
    looped_bfs(8, 6, stages_per_rank=2)  # BFS has no rounds


def test_v_needs_two_stages_per_rank():
    for family in V_SHAPED:
        for v in (1, 3, 4):
            with pytest.raises(ValueError, match=f"stages_per_rank must be 2 .*got {v}"):
                family(12, 12, stages_per_rank=v)


def test_dualpipe_v_needs_enough_microbatches():
    with pytest.raises(ValueError, match=r"n_microbatches \(7\) must be >= num_stages \(8"):
        dualpipe_v(8, 7)
    validate(dualpipe_v(8, 8))


# --------------------------------------------------------------------------- quality (timer)


@pytest.mark.parametrize("R,m", QUALITY_SIZES)
def test_zero_bubble_h1_quality(R, m):
    b = one_f_one_b_bubble(R, m)
    makespan, bubble, peaks = timed(zero_bubble_h1(R, m))
    # the lower bound for any schedule: the last rank starts after R-1 forwards and has 3m units of work
    assert makespan == 3 * m + R - 1
    if m >= 3 * (R - 1):  # 0.4 x 1F1B's bubble is reachable at all only there (see the lower bound)
        assert bubble <= 0.4 * b
    assert bubble <= 0.47 * b
    assert max(peaks) <= R
    if m % R == 0:  # interleaved form, ZB1P
        makespan, bubble, peaks = timed(zero_bubble_h1(2 * R, m, stages_per_rank=2))
        assert bubble <= 0.4 * b
        assert max(peaks) <= R


@pytest.mark.parametrize("R,m", QUALITY_SIZES)
@pytest.mark.parametrize("v", [2, 4])
def test_interleaved_quality(R, m, v):
    b = one_f_one_b_bubble(R, m)
    makespan, bubble, peaks = timed(interleaved_one_f_one_b(v * R, m, stages_per_rank=v))
    assert bubble == pytest.approx((R - 1) / (v * m + R - 1))  # Megatron's (p-1)/v bubble time
    assert bubble <= 1.5 * b / v  # (1 + (v-1)(p-1)/(v*m+p-1)) x b/v: close to b/v for m >> p
    # Megatron's warm-up holds (R-1)/v more micro-batches' worth on rank 0 than 1F1B; without the slack, none.
    assert max(peaks) <= R + (R - 1) / v
    lean_makespan, lean_bubble, lean_peaks = timed(interleaved_one_f_one_b(v * R, m, stages_per_rank=v, slack=0))
    assert (lean_makespan, lean_bubble) == (makespan, bubble)  # with no send time the slack costs nothing
    assert max(lean_peaks) <= R


@pytest.mark.parametrize("R,m", QUALITY_SIZES)
def test_zero_bubble_v_quality(R, m):
    makespan, bubble, peaks = timed(zero_bubble_v(2 * R, m))
    if m >= 2 * R:
        assert bubble <= 0.1
        assert makespan == 6 * m + R - 1  # the ramp-up is the only bubble
    assert max(peaks) <= R


@pytest.mark.parametrize("R,m", [(R, m) for R, m in QUALITY_SIZES if m >= 2 * R])
def test_dualpipe_v_quality(R, m):
    _, bubble, _ = timed(dualpipe_v(2 * R, m))
    assert bubble < one_f_one_b_bubble(R, m)


@pytest.mark.parametrize("R,m", QUALITY_SIZES)
def test_looped_bfs_beats_gpipe_bubble(R, m):
    _, bubble, _ = timed(looped_bfs(2 * R, m, stages_per_rank=2))
    assert bubble < one_f_one_b_bubble(R, m)
