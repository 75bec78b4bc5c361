"""Periodic schedules: long schedules in constant memory, action for action equal to the generated ones."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
import torch
from torch import nn

import pipecore
from pipecore.algorithms import algorithm_names, get_algorithm
from pipecore.algorithms.base import AlgorithmSpec, Live, SameAsForward
from pipecore.runtime.executor import Costs, Executor
from pipecore.runtime.worker import StageWorker
from pipecore.schedule import Action, B, F, Schedule, U, async_one_f_one_b, gpipe
from pipecore.schedule.periodic import PeriodicRow, microbatch_positions, periodic_form
from pipecore.schedule.progress import positions

SHAPES = [(1, 1), (1, 3), (2, 2), (2, 5), (3, 3), (3, 4), (4, 4), (4, 6)]


def _rows(schedule: Schedule) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(row) for row in schedule.stages)


def _accepted(name: str, P: int, m: int) -> bool:
    try:
        get_algorithm(name, P, m)
    except ValueError:  # e.g. 2BW needs m >= P; such shapes have no schedule to compare
        return False
    return True


CASES = [(name, P, m) for name in algorithm_names() for P, m in SHAPES if _accepted(name, P, m)]


@pytest.mark.parametrize("name,P,m", CASES)
def test_periodic_schedule_equals_the_generated_one(name, P, m):
    algorithm = get_algorithm(name, P, m)
    form = algorithm._periodic_form
    assert form is not None, f"{name} at P={P}, m={m} should repeat in steady state"
    for n in range(1, 3 * (2 * P + 2) + 6):
        schedule = algorithm.schedule(n)
        assert _rows(schedule) == _rows(algorithm._generate(n)), (name, P, m, n)
        assert schedule.n_minibatches == n


@pytest.mark.parametrize("name,P,m,slack", [("2bw", 2, 3, 1), ("2bw", 3, 7, 2), ("pipedream", 3, 2, 1),
                                             ("pipedream", 4, 1, 3)])
def test_periodic_schedule_with_slack_equals_the_generated_one(name, P, m, slack):
    algorithm = get_algorithm(name, P, m, slack=slack)
    assert algorithm._periodic_form is not None
    for n in range(1, 2 * algorithm.warmup_minibatches + 4):
        assert _rows(algorithm.schedule(n)) == _rows(algorithm._generate(n)), n


@pytest.mark.parametrize("every", [1, 2, 4])
def test_periodic_pipedream_with_update_every(every):
    algorithm = get_algorithm("pipedream", 3, 4, update_every=every)
    for n in range(1, 30):
        assert _rows(algorithm.schedule(n)) == _rows(algorithm._generate(n))


def test_update_interval_that_straddles_minibatches_has_a_longer_period():
    # 6 micro-batches per update with 4 per mini-batch: versions shift uniformly only every 3 mini-batches.
    def generate(n: int) -> Schedule:
        return async_one_f_one_b(2, 4, n).with_updates(6)

    form = periodic_form(generate, 4, 6, warmup=6)
    assert form is not None and form.period == 3
    for n in range(6, 40):
        assert _rows(form.schedule(n)) == _rows(generate(n)), n
    assert form.schedule(5) is None  # below every base: the caller generates it


def test_a_family_that_does_not_repeat_is_generated_in_full():
    # Backwards ascending in even mini-batches and descending in odd ones: no period of one mini-batch.
    def zigzag(P: int, m: int, n: int) -> Schedule:
        rows = []
        for s in range(P):
            row = []
            for j in range(n):
                row += [Action(s, F, j * m + u) for u in range(m)]
                order = range(m) if j % 2 == 0 else reversed(range(m))
                row += [Action(s, B, j * m + u) for u in order]
            rows.append(tuple(row))
        return Schedule(P, m, n, tuple(rows))

    spec = AlgorithmSpec(name="zigzag", summary="test", schedule=zigzag, forward=Live(), backward=SameAsForward())
    algorithm = spec.configure(2, 3)
    assert algorithm._periodic_form is None
    for n in (1, 5, 20):
        schedule = algorithm.schedule(n)
        assert all(isinstance(row, tuple) for row in schedule.stages)
        assert _rows(schedule) == _rows(zigzag(2, 3, n).with_updates(3))


def test_row_indexing_slicing_and_positions_match_a_tuple():
    algorithm = get_algorithm("timeprest", 3, 4)
    periodic, plain = algorithm.schedule(40), algorithm._generate(40)
    for row, expected in zip(periodic.stages, plain.stages):
        assert isinstance(row, PeriodicRow)
        assert len(row) == len(expected)
        assert row[-1] == expected[-1] and row[-len(expected)] == expected[0]
        assert row[5:17] == expected[5:17] and row[::-7] == expected[::-7]
        assert row == expected and expected == row and list(row) == list(expected)
        assert hash(row) == hash(tuple(expected))
        with pytest.raises(IndexError, match="outside"):
            row[len(expected)]
        table = microbatch_positions(expected)
        for (kind, k), i in table.items():
            assert row.position(kind, k) == i
        assert row.position(F, 40 * 4) is None and row.position(B, 10**6) is None
    index = positions(periodic)
    assert index[(1, F, 17)] == plain.stages[1].index(Action(1, F, 17))
    assert (1, F, 10**6) not in index
    with pytest.raises(KeyError):
        index[(0, B, 10**6)]


@pytest.mark.parametrize("name", ["1f1b", "timeprest"])
def test_a_longer_row_of_one_form_shares_the_prefix_it_is_known_to(name):
    """What the executor skips comparing when a step extends the schedule: rows of one form agree up to the
    shorter one's tail, and exactly that far is claimed."""
    algorithm = get_algorithm(name, 3, 4)
    short, long = algorithm.schedule(30), algorithm.schedule(31 + 7)
    other = get_algorithm("2bw" if name == "1f1b" else "1f1b", 3, 4).schedule(30)
    for s, (a, b) in enumerate(zip(short.stages, long.stages)):
        assert isinstance(a, PeriodicRow) and isinstance(b, PeriodicRow)
        known = len(a.head) + min(a.copies, b.copies) * len(a.body)
        assert known < len(a) and b.shares_prefix(a, known) and a.shares_prefix(b, known)
        assert tuple(b[:known]) == tuple(a[:known])  # what it claims holds
        assert not b.shares_prefix(a, known + 1)  # into the shorter row's tail: compared instead
        assert not b.shares_prefix(other.stages[s], 1) and not b.shares_prefix(tuple(a), 1)


def test_a_billion_minibatches_cost_nothing():
    algorithm = get_algorithm("2bw", 4, 8)
    schedule = algorithm.schedule(10**9)  # generated in full, this would take hours and terabytes
    last = 10**9 * 8 - 1
    row = schedule.stages[0]
    assert len(row) == 2 * 10**9 * 8 + 10**9  # F and B per micro-batch, one update per mini-batch
    assert row[-2:] == (Action(0, B, last), Action(0, U, 10**9))
    assert row[row.position(F, last)] == Action(0, F, last)


def test_pipeline_memory_does_not_grow_with_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe = pipecore.Pipeline(model, 2, "pipedream", 4, loss_fn=nn.MSELoss())
    for _ in range(50):
        pipe.step(x, y)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(400):
            pipe.step(x, y)
        gc.collect()
        grown = sum(d.size_diff for d in tracemalloc.take_snapshot().compare_to(before, "filename")
                    if "pipecore" in d.traceback[0].filename)
    finally:
        tracemalloc.stop()
    # Holding the schedule as generated lists grew by about 6 KB per step here.
    assert grown < 64 * 1024, f"pipecore's Python objects grew by {grown} bytes over 400 steps"


def test_gpipe_rows_have_no_head():
    form = get_algorithm("gpipe", 2, 3)._periodic_form
    assert form is not None
    assert all(len(row.head) == 0 for row in form.bases[0].stages)
    assert _rows(form.schedule(12)) == _rows(gpipe(2, 3, 12).with_updates(3))


@pytest.mark.parametrize("name", algorithm_names())
def test_running_across_many_minibatches_equals_the_generated_schedule(name):
    """The training engine's pattern over periodic rows (extend as the horizon doubles, run as far as the
    given mini-batches allow, drain at the end) performs the actions and reads of the generated schedule."""
    # The V placements (zb-v, dualpipe-v) need an even number of stages, two per rank.
    sizes = ((2, 2), (4, 4), (4, 8)) if name in ("zb-v", "dualpipe-v") else ((2, 2), (3, 4), (4, 4))
    for P, m in sizes:
        algorithm = get_algorithm(name, P, m)
        n = 4 * (2 * P + 2)
        workers = [StageWorker(algorithm, s) for s in range(P)]
        horizon = 2
        executor = Executor(algorithm.schedule(horizon), workers, Costs.uniform(P))
        for j in range(1, n + 1):
            if j + 1 > horizon:
                horizon *= 2
                executor.extend(algorithm.schedule(horizon))
            executor.run(available=j * m)
        executor.extend(algorithm.schedule(n))
        executor.run()
        assert isinstance(executor.schedule.stages[0], PeriodicRow)
        plain_workers = [StageWorker(algorithm, s) for s in range(P)]
        plain = Executor(algorithm._generate(n), plain_workers, Costs.uniform(P))
        plain.run()
        for s in range(P):
            got = [(e.action, e.record.reads) for e in executor.events if e.action.stage == s]
            want = [(e.action, e.record.reads) for e in plain.events if e.action.stage == s]
            assert got == want, (name, P, m, s)


@pytest.mark.parametrize("first,second", [
    (("pipedream", 3, 4, {}), ("pipedream", 3, 4, {"slack": 1})),          # a schedule option
    (("pipedream", 3, 4, {}), ("pipedream", 3, 4, {"update_every": 2})),   # the update interval
    (("pipedream", 3, 4, {}), ("2bw", 3, 4, {})),                          # same family, other update rule
    (("pipedream", 3, 4, {}), ("pipedream", 3, 2, {})),                    # micro-batches
    (("pipedream", 3, 4, {}), ("pipedream", 4, 4, {})),                    # stages
    (("timeprest", 3, 4, {}), ("gpipe", 3, 4, {})),                        # the family
])
def test_algorithms_that_differ_do_not_share_a_cached_form(first, second):
    # The warm-up and the periodic form are cached by what the schedules depend on, across Algorithm
    # objects: the second configuration, found after the first, must still get its own schedules.
    for name, P, m, options in (first, second):
        algorithm = get_algorithm(name, P, m, **options)
        assert algorithm._periodic_form is not None
        for n in range(1, algorithm.warmup_minibatches + 6):
            assert _rows(algorithm.schedule(n)) == _rows(algorithm._generate(n)), (name, P, m, options, n)
    a, b = (get_algorithm(name, P, m, **options) for name, P, m, options in (first, second))
    assert a._periodic_form is not b._periodic_form


def test_equal_configurations_share_one_read_only_form():
    a, b = get_algorithm("pipedream", 3, 4, slack=1), get_algorithm("pipedream", 3, 4, slack=1)
    assert a is not b and a._periodic_form is b._periodic_form
    assert get_algorithm("pipedream", 3, 4)._periodic_form is get_algorithm("pipedream", 3, 4, slack=0)._periodic_form
    form = a._periodic_form
    with pytest.raises(TypeError):
        form.bases[0] = form.bases[0]  # shared between algorithms, so it must not be changed by one
    with pytest.raises(TypeError):
        form.base_minibatches[0] = 1


def test_schedules_shorter_than_the_warmup_skip_the_periodic_form():
    algorithm = get_algorithm("pipedream", 5, 3)
    schedule = algorithm.schedule(2 * 5 + 1)  # below every periodic base: generated directly
    assert "_periodic_form" not in vars(algorithm)
    assert all(isinstance(row, tuple) for row in schedule.stages)
    assert _rows(schedule) == _rows(algorithm._generate(2 * 5 + 1))


def test_an_unhashable_schedule_option_is_found_uncached():
    def reordered(P: int, m: int, n: int, order: list[int] | None = None) -> Schedule:
        rows = [tuple(Action(s, kind, j * m + u) for j in range(n) for kind in (F, B) for u in range(m))
                for s in range(P)]
        return Schedule(P, m, n, tuple(rows))

    spec = AlgorithmSpec(name="reordered", summary="test", schedule=reordered, forward=Live(),
                         backward=SameAsForward(), defaults={"order": [0]}, schedule_options=("order",))
    algorithm = spec.configure(2, 3, order=[1, 0])
    assert algorithm._periodic_form is not None
    n = algorithm.warmup_minibatches + 2
    assert _rows(algorithm.schedule(n)) == _rows(reordered(2, 3, n).with_updates(3))


def test_a_shifted_period_equals_its_actions_shifted_one_by_one():
    """``Shift.apply_all`` builds a period's copy without Action's checks: the same actions (equal, equal
    hashes, the same type) as ``Shift.apply`` of each, and the unshifted period itself for 0 periods."""
    from pipecore.schedule.ir import Action
    from pipecore.schedule.periodic import Shift

    for name in ("1f1b", "pipedream", "2bw", "gpipe", "zb-h1"):
        row = pipecore.get_algorithm(name, 3, 4).schedule(3).stages[1]
        shift = Shift(microbatches=4, updates=1)
        for times in (0, 1, 5):
            got = shift.apply_all(row, times)
            want = tuple(shift.apply(a, times) for a in row)
            assert got == want and hash(got) == hash(want)
            assert all(type(a) is Action for a in got)
            assert [a.index for a in got] == [a.index + times * (1 if a.kind is U else 4) for a in row]


@pytest.mark.parametrize("name", ["1f1b", "pipedream", "2bw", "timeprest"])
def test_a_rows_blocks_cover_it_in_order_with_its_actions(name):
    """``PeriodicRow.block(i)``: the head, a body copy or the tail holding position ``i``, whose actions are
    the row's from its start; consecutive blocks tile the row; past the end it raises like indexing."""
    row = get_algorithm(name, 3, 4).schedule(40).stages[1]
    assert isinstance(row, PeriodicRow)
    i, blocks = 0, 0
    while i < len(row):
        start, actions = row.block(i)
        assert start == i and actions  # each block starts where the previous one ended
        assert tuple(actions) == tuple(row[j] for j in range(i, i + len(actions)))
        for j in (i, i + len(actions) // 2, i + len(actions) - 1):
            assert row.block(j) == (start, actions)
        i, blocks = i + len(actions), blocks + 1
    assert i == len(row) and blocks == 2 + row.copies - (0 if row.head else 1) - (0 if row.tail else 1)
    with pytest.raises(IndexError):
        row.block(len(row))
