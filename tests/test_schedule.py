"""Schedule IR, generators and validation."""

from __future__ import annotations

import functools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipecore.schedule import (
    FAMILIES, Action, B, F, Kind, Schedule, ScheduleError, U, async_one_f_one_b, gpipe, n_forward_one_backward,
    one_f_one_b, parse_traced, validate,
)

SIZES = [(P, m, n) for P in range(1, 9) for m in range(1, 9) for n in (1, 2, 3)]


@functools.cache
def all_schedules() -> tuple[Schedule, ...]:
    """Every family at every size of SIZES, plain, with updates per mini-batch and per micro-batch."""
    out = []
    for family in FAMILIES.values():
        for P, m, n in SIZES:
            base = family(P, m, n)
            out += [base, base.with_updates(m), base.with_updates(1)]
    return tuple(out)


# --------------------------------------------------------------------------- IR


def test_grammar_examples():
    assert Action.parse("2F0") == Action(2, F, 0)
    assert Action.parse("1B4-7") == Action(1, B, 4, 4)
    assert list(Action.parse("1B4-7").microbatches) == [4, 5, 6, 7]
    assert Action.parse("0U3") == Action(0, U, 3)
    assert list(Action.parse("0U3").microbatches) == []
    assert parse_traced("2F0@v3") == (Action(2, F, 0), "v3")
    assert parse_traced("1B2-3@v1~interp(v0,a=0.368)") == (Action(1, B, 2, 2), "v1~interp(v0,a=0.368)")
    assert parse_traced("0U1") == (Action(0, U, 1), None)
    assert str(Action(1, B, 4, 4)) == "1B4-7" and str(Action(0, U, 3)) == "0U3"


def test_every_generated_action_round_trips():
    count = 0
    for schedule in all_schedules():
        for row in schedule.stages:
            for action in row:
                assert Action.parse(str(action)) == action
                assert parse_traced(f"{action}@v7") == (action, "v7")
                count += 1
    assert count > 100_000  # the loop really covered the families


def test_table_parses_back_to_the_same_schedule():
    for schedule in all_schedules():
        rows = [line.split(": ", 1)[1] if ": " in line else "" for line in schedule.table().splitlines()]
        again = Schedule.from_strings(rows, schedule.n_microbatches, schedule.n_minibatches)
        assert again == schedule


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    stage=st.integers(0, 10_000), index=st.integers(0, 10_000), kind=st.sampled_from(list(Kind)),
    count=st.integers(1, 64), tag=st.none() | st.from_regex(r"[A-Za-z0-9~(),.=_-]{1,12}", fullmatch=True),
)
def test_random_actions_round_trip(stage, index, kind, count, tag):
    if kind is not B:
        count = 1
    action = Action(stage, kind, index, count)
    text = str(action) + (f"@{tag}" if tag is not None else "")
    assert parse_traced(text) == (action, tag)


@pytest.mark.parametrize("text, expected", [
    ("", "cannot parse action ''"),
    ("F0", "cannot parse action 'F0'"),
    ("1X0", "cannot parse action '1X0'"),
    ("1F", "cannot parse action '1F'"),
    ("-1F0", "cannot parse action '-1F0'"),
    ("1F0@", "cannot parse action '1F0@'"),
    ("1 F0", "cannot parse action '1 F0'"),
    ("1f0", "cannot parse action '1f0'"),
    ("1B7-4", "range end 4 is before its start 7"),
    ("1F4-7", "only backward actions may cover several micro-batches"),
    ("0U3-4", "only backward actions may cover several micro-batches"),
])
def test_parse_errors_are_clear(text, expected):
    with pytest.raises(ValueError) as info:
        Action.parse(text)
    assert expected in str(info.value)
    if "cannot parse" in expected:
        # The message teaches the grammar.
        assert "'2F0', '1B4-7', '1W4', '0U3', '2F0@v3'" in str(info.value)


def test_action_fields_are_checked():
    with pytest.raises(ValueError, match="invalid action fields"):
        Action(-1, F, 0)
    with pytest.raises(ValueError, match="invalid action fields"):
        Action(0, B, 0, 0)


# --------------------------------------------------------------------------- generators


def test_generated_schedules_validate():
    for schedule in all_schedules():
        assert validate(schedule) is schedule


def test_gpipe_order():
    for P, m, n in SIZES:
        for s, row in enumerate(gpipe(P, m, n).stages):
            expected = []
            for j in range(n):
                expected += [Action(s, F, j * m + u) for u in range(m)] + [Action(s, B, j * m + u) for u in range(m)]
            assert list(row) == expected


def test_one_f_one_b_warmup_steady_cooldown():
    for P, m, n in SIZES:
        for s, row in enumerate(one_f_one_b(P, m, n).stages):
            warmup = min(P - s - 1, m)
            for j in range(n):
                block = row[j * 2 * m:(j + 1) * 2 * m]
                kinds = "".join(a.kind.value for a in block)
                assert kinds == "F" * warmup + "FB" * (m - warmup) + "B" * warmup
                assert [a.index for a in block if a.kind is F] == list(range(j * m, j * m + m))
                assert [a.index for a in block if a.kind is B] == list(range(j * m, j * m + m))


def test_async_one_f_one_b_has_one_warmup_and_one_drain():
    for P, m, n in SIZES:
        T = m * n
        for s, row in enumerate(async_one_f_one_b(P, m, n).stages):
            warmup = min(P - s - 1, T)
            kinds = "".join(a.kind.value for a in row)
            assert kinds == "F" * warmup + "FB" * (T - warmup) + "B" * warmup


@pytest.mark.parametrize("slack", [1, 2, 5])
def test_async_one_f_one_b_slack_lengthens_each_warmup(slack):
    for P, m, n in SIZES:
        T = m * n
        schedule = async_one_f_one_b(P, m, n, slack=slack)
        validate(schedule)  # still deadlock-free
        for s, row in enumerate(schedule.stages):
            warmup = min((P - s - 1) * (1 + slack), T)
            kinds = "".join(a.kind.value for a in row)
            assert kinds == "F" * warmup + "FB" * (T - warmup) + "B" * warmup
        longer = async_one_f_one_b(P, m, n + 1, slack=slack)
        for s, (row, more) in enumerate(zip(schedule.stages, longer.stages)):
            done = next((i for i, a in enumerate(row) if a.kind is B and a.index >= T - (P - s - 1) * (1 + slack)), len(row))
            assert tuple(more[:done]) == tuple(row[:done])  # prefix-stable up to the drain


@pytest.mark.parametrize("slack", [-1, 1.5, True])
def test_async_one_f_one_b_rejects_bad_slack(slack):
    with pytest.raises(ValueError, match="slack must be a non-negative integer"):
        async_one_f_one_b(2, 2, 2, slack=slack)


def test_nf1b_one_backward_per_minibatch_and_admission_cap():
    for P, m, n in SIZES:
        schedule = n_forward_one_backward(P, m, n)
        for s, row in enumerate(schedule.stages):
            assert [a for a in row if a.kind is B] == [Action(s, B, j * m, m) for j in range(n)]
            assert [a.index for a in row if a.kind is F] == list(range(m * n))
            # PipeDream's admission cap: at most P - s mini-batches forwarded and not yet backwarded.
            started, done = set(), 0
            for a in row:
                if a.kind is F:
                    started.add(a.index // m)
                else:
                    done += 1
                assert len(started) - done <= P - s


def test_nf1b_reproduces_the_timeprest_figure():
    # The paper's P=3, N=2 grid (kX = forward of micro-batch X of mini-batch k, Bk = backward), mapped to the
    # IR with 0-based global micro-batches: 1A -> F0, 1B -> F1, 2A -> F2, ..., B1 -> B0-1, B2 -> B2-3.
    figure = {
        0: "1A 1B 2A 2B 3A 3B B1 4A 4B B2",
        1: "1A 1B 2A 2B B1 3A 3B B2 4A",
        2: "1A 1B B1 2A 2B B2 3A 3B",
    }
    m = 2

    def to_ir(stage: int, cell: str) -> Action:
        if cell.startswith("B"):
            return Action(stage, B, (int(cell[1:]) - 1) * m, m)
        return Action(stage, F, (int(cell[:-1]) - 1) * m + "AB".index(cell[-1]))

    schedule = n_forward_one_backward(3, m, 4)
    for s, cells in figure.items():
        expected = [to_ir(s, c) for c in cells.split()]
        assert list(schedule.stages[s][:len(expected)]) == expected


def test_with_updates_closes_every_group():
    for P, m, n in SIZES:
        for every in [d for d in range(1, m + 1) if m % d == 0]:
            for family in (async_one_f_one_b, n_forward_one_backward):
                schedule = family(P, m, n).with_updates(every)
                for s, row in enumerate(schedule.stages):
                    done, version = 0, 0
                    for i, a in enumerate(row):
                        if a.kind is B:
                            done += a.count
                        if a.kind is U:
                            version += 1
                            assert a.index == version and done >= version * every
                            assert row[i - 1].kind in (B, U)
                    assert version == m * n // every


def test_with_updates_rejects_bad_input():
    with pytest.raises(ValueError, match="update interval must be >= 1"):
        gpipe(2, 2).with_updates(0)
    with pytest.raises(ValueError, match="already holds updates"):
        gpipe(2, 2).with_updates(2).with_updates(2)


def test_generators_reject_bad_sizes():
    for family in FAMILIES.values():
        with pytest.raises(ValueError, match="num_stages must be >= 1, got 0"):
            family(0, 2, 1)
        with pytest.raises(ValueError, match="n_microbatches must be >= 1, got 0"):
            family(2, 0, 1)
        with pytest.raises(ValueError, match="n_minibatches must be >= 1, got 0"):
            family(2, 2, 0)


def test_diff():
    a = Schedule.from_strings(["0F0 0B0", "1F0 1B0"], 1)
    b = Schedule.from_strings(["0F0 0B0", "1B0 1F0"], 1)
    assert a.diff(a) == ""
    assert a.diff(b) == "stage 1 position 0: 1F0 != 1B0"


def test_from_strings_rejects_foreign_actions():
    with pytest.raises(ValueError, match="action 1F0 is in row 0"):
        Schedule.from_strings(["1F0 0B0"], 1)


# --------------------------------------------------------------------------- prefix stability


def _first_touching(row, first_microbatch: int) -> int:
    return next((i for i, a in enumerate(row) if any(k >= first_microbatch for k in a.microbatches)), len(row))


@pytest.mark.parametrize("family", [async_one_f_one_b, n_forward_one_backward])
def test_prefix_stability(family):
    """The n-mini-batch schedule agrees with the (n+1)-mini-batch one, stage by stage, up to the first action
    that touches a micro-batch of mini-batch n; moreover it *is* the longer schedule with mini-batch n's
    actions removed (those only take the place of idle slots, never delay earlier work)."""
    for P in range(1, 9):
        for m in range(1, 9):
            for n in range(1, 5):
                short, long = family(P, m, n), family(P, m, n + 1)
                for every in (1, m):
                    s_upd, l_upd = short.with_updates(every), long.with_updates(every)
                    for s in range(P):
                        i = _first_touching(l_upd.stages[s], n * m)
                        assert l_upd.stages[s][:i] == s_upd.stages[s][:i], (P, m, n, s)
                        assert i < len(l_upd.stages[s])
                for s in range(P):
                    kept = tuple(a for a in long.stages[s] if all(k < n * m for k in a.microbatches))
                    assert kept == short.stages[s], (P, m, n, s)


def test_synchronous_families_are_prefix_stable_too():
    for family in (gpipe, one_f_one_b):
        for P, m, n in SIZES:
            short, long = family(P, m, n), family(P, m, n + 1)
            for s in range(P):
                assert long.stages[s][:len(short.stages[s])] == short.stages[s]


# --------------------------------------------------------------------------- validation


def _error(rows, m, n=1) -> str:
    with pytest.raises(ScheduleError) as info:
        validate(Schedule.from_strings(rows, m, n))
    assert isinstance(info.value, ValueError)
    return str(info.value)


def _marks(message: str) -> list[str]:
    return re.findall(r">>(\S+?)<<", message)


def test_rejects_backward_before_forward():
    message = _error(["0B0 0F0", "1F0 1B0"], 1)
    assert message.splitlines()[0] == "0B0 runs a backward of micro-batch 0 before its forward"
    assert message.splitlines()[1:] == ["stage 0: >>0B0<< 0F0", "stage 1: 1F0 1B0"]


def test_rejects_backward_without_forward():
    message = _error(["0F0 0B0 0B1", "1F0 1B0 1F1 1B1"], 2)
    assert "0B1 runs a backward of micro-batch 1 before its forward" in message
    assert _marks(message) == ["0B1"]


def test_rejects_missing_backward_and_forward():
    message = _error(["0F0 0F1 0B0", "1F0 1B0 1F1 1B1"], 2)
    assert message.splitlines()[0] == "stage 0 is unbalanced: no backward for micro-batch(es) [1]"
    assert "stage 0: 0F0 0F1 0B0\nstage 1: 1F0 1B0 1F1 1B1" in message
    message = _error(["0F0 0B0", "1F0 1B0 1F1 1B1"], 2)
    assert message.splitlines()[0] == "stage 0 is unbalanced: no forward for micro-batch(es) [1]"


def test_rejects_duplicates_and_marks_the_second_one():
    message = _error(["0F0 0F0 0B0", "1F0 1B0"], 1)
    assert message.splitlines()[0] == "0F0 forwards micro-batch 0 a second time"
    assert "stage 0: 0F0 >>0F0<< 0B0" in message and len(_marks(message)) == 1
    message = _error(["0F0 0B0 0B0", "1F0 1B0"], 1)
    assert "stage 0: 0F0 0B0 >>0B0<<" in message and len(_marks(message)) == 1


def test_rejects_out_of_range_and_misnumbered_updates():
    assert "0F2 names micro-batch 2; the schedule has 2" in _error(["0F0 0F2", "1F0"], 2)
    message = _error(["0F0 0B0 0U2", "1F0 1B0"], 1)
    assert "0U2 should produce version 1" in message and _marks(message) == ["0U2"]


def test_rejects_inconsistent_backward_groups():
    message = _error(["0F0 0F1 0B0-1", "1F0 1F1 1B0 1B1"], 2)
    assert "stages 0 and 1 group micro-batches into backwards differently" in message


def test_rejects_wrong_row_count():
    schedule = Schedule(3, 1, 1, gpipe(2, 1).stages)
    with pytest.raises(ScheduleError, match="declares 3 stages but has 2 rows"):
        validate(schedule)


def test_deadlock_marks_the_out_of_order_forward():
    message = _error(["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"], 2)
    first, *table = message.splitlines()
    assert first.startswith("deadlock: no stage can make progress (0B0 waits for 1B0, 1F1 waits for 0F1)")
    assert "1F1 runs before 1F0, but stage 0 forwards micro-batch 0 before micro-batch 1" in first
    assert table == ["stage 0: 0F0 0B0 0F1 0B1", "stage 1: >>1F1<< 1F0 1B0 1B1"]


def test_deadlock_marks_the_out_of_order_backward():
    message = _error(["0F0 0F1 0B1 0F2 0B0 0B2", "1F0 1F1 1F2 1B0 1B1 1B2"], 3)
    assert "(0B1 waits for 1B1, 1F2 waits for 0F2)" in message
    assert "0B1 runs before 0B0, but stage 1 backwards micro-batch 0 before micro-batch 1" in message
    assert _marks(message) == ["0B1"]


def test_deadlock_without_order_inversion_marks_every_blocked_action():
    # Both orders are plausible alone; together stage 1 wants F1 before B0 and stage 0 sends F1 after B0.
    message = _error(["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"], 2)
    assert message.splitlines()[0] == "deadlock: no stage can make progress (0B0 waits for 1B0, 1F1 waits for 0F1)"
    assert _marks(message) == ["0B0", "1F1"]


def test_deadlock_across_three_stages():
    message = _error(["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1", "2F1 2F0 2B0 2B1"], 2)
    assert "(0B0 waits for 1B0, 1B0 waits for 2B0, 2F1 waits for 1F1)" in message
    assert _marks(message) == ["2F1"]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data())
def test_dropping_any_compute_action_is_rejected(data):
    family = data.draw(st.sampled_from(list(FAMILIES.values())))
    P, m, n = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 6)), data.draw(st.integers(1, 3))
    schedule = family(P, m, n)
    s = data.draw(st.integers(0, P - 1))
    i = data.draw(st.integers(0, len(schedule.stages[s]) - 1))
    dropped = schedule.stages[s][i]
    rows = list(schedule.stages)
    rows[s] = rows[s][:i] + rows[s][i + 1:]
    with pytest.raises(ScheduleError) as info:
        validate(Schedule(P, m, n, tuple(rows)))
    message = str(info.value)
    k = dropped.index
    if dropped.kind is B:
        assert f"no backward for micro-batch(es) [{k}" in message or "group micro-batches" in message
    else:
        assert f"of micro-batch {k} before its forward" in message or f"no forward for micro-batch(es) [{k}" in message


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data())
def test_duplicating_any_compute_action_is_rejected_at_the_copy(data):
    family = data.draw(st.sampled_from(list(FAMILIES.values())))
    P, m, n = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 6)), data.draw(st.integers(1, 3))
    schedule = family(P, m, n)
    s = data.draw(st.integers(0, P - 1))
    i = data.draw(st.integers(0, len(schedule.stages[s]) - 1))
    rows = list(schedule.stages)
    rows[s] = rows[s][:i + 1] + rows[s][i:]
    with pytest.raises(ScheduleError) as info:
        validate(Schedule(P, m, n, tuple(rows)))
    assert "a second time" in str(info.value)
    assert info.value.at == ((s, i + 1),)
