"""The simulator's speed, guarded by counts rather than timings (the suite runs on shared machines): a warm
simulation builds, validates and indexes nothing again, and makes a bounded number of Python calls per action.
bench/simulate_speed.py measures the seconds."""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import MISSING, fields, replace

import pytest

from pipecore import algorithm_names
from pipecore.algorithms import SPECS, base
from pipecore.algorithms.base import ReadContext, WeightRead
from pipecore.simulate import simulate
from pipecore.versions import UpdateInfo

TWO_PER_RANK = ("zb-v", "dualpipe-v")
NF1B = ("timeprest", "v-timeprest", "i-timeprest")  # one backward per mini-batch: few, large actions
# The modules themselves (pipecore.schedule's names for some of them are functions).
progress, schedule, validate = (importlib.import_module(f"pipecore.schedule.{m}")
                                for m in ("progress", "schedule", "validate"))
executor = importlib.import_module("pipecore.runtime.executor")


def _options(name: str) -> dict[str, int]:
    return {"stages_per_rank": 2} if name in TWO_PER_RANK else {}


@pytest.mark.parametrize("name", algorithm_names())
def test_a_warm_simulation_builds_and_checks_its_schedule_once(name, monkeypatch):
    """The second simulate() of the same sizes reuses the schedule: not generated, validated, placed or
    indexed again, and the algorithm's size checks (which may build a schedule) are not rerun either."""
    calls: dict[str, int] = {}
    spec = SPECS[name]

    def counting(check):
        def wrapper(*args):
            calls["constraint"] = calls.get("constraint", 0) + 1
            return check(*args)
        return wrapper
    monkeypatch.setitem(SPECS, name, replace(spec, constraints=tuple(counting(c) for c in spec.constraints)))
    first = simulate(name, 4, 8, 2, **_options(name))
    assert calls.get("constraint", 0) == len(spec.constraints)
    calls.clear()

    def counted(owner, attribute):
        original = getattr(owner, attribute)

        def wrapper(*args, **kwargs):
            calls[attribute] = calls.get(attribute, 0) + 1
            return original(*args, **kwargs)
        monkeypatch.setattr(owner, attribute, wrapper)

    counted(base._Family, "generate")
    counted(validate, "_check_runs_to_completion")
    counted(validate, "_check_ranks")
    counted(validate, "runnable")
    counted(executor, "runnable")
    counted(progress.Positions, "__init__")
    counted(schedule, "_placement")
    counted(schedule, "_splits")
    second = simulate(name, 4, 8, 2, **_options(name))
    assert second.schedule is first.schedule
    assert [(e.action, e.start, e.end) for e in second.events] == [(e.action, e.start, e.end) for e in first.events]
    assert calls == {}


@pytest.mark.parametrize("name", algorithm_names())
def test_python_calls_per_action_stay_bounded(name):
    """A warm simulation makes 10 to 15 Python function calls per action (23 for the nF1B family, whose
    backwards cover a mini-batch each); 38 to 61 before the simulator's speed work. Counted, not timed: the
    bound catches per-action work coming back (a walk over the schedule, a context or record built twice)."""
    simulate(name, 8, 16, 4, **_options(name))
    count = 0

    def profile(frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
        nonlocal count
        if event == "call":
            count += 1

    sys.setprofile(profile)
    try:
        trace = simulate(name, 8, 16, 4, **_options(name))
    finally:
        sys.setprofile(None)
    per_action = count / len(trace.events)
    assert per_action <= (26 if name in NF1B else 17), f"{per_action:.1f} Python calls per action"


@pytest.mark.parametrize("cls", [WeightRead, ReadContext, UpdateInfo])
def test_the_fast_constructors_take_and_set_exactly_the_fields(cls):
    """WeightRead, ReadContext and UpdateInfo (one per action) write their fields in one go instead of the frozen
    dataclass's field-by-field __init__: the same parameters, defaults and attributes, and still frozen."""
    declared = [(f.name, f.default) for f in fields(cls)]
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert [(p.name, MISSING if p.default is inspect.Parameter.empty else p.default) for p in parameters] == declared
    values = {name: i for i, (name, _) in enumerate(declared)}
    made = cls(**values)
    assert vars(made) == values and made == cls(**values) and hash(made) == hash(cls(**values))
    with pytest.raises(AttributeError):
        setattr(made, declared[0][0], -1)


@pytest.mark.parametrize("name", ["pipedream", "2bw", "spectrain", "i-timeprest", "pipemare", "1f1b"])
def test_a_version_book_goes_back_to_its_mark_exactly(name):
    """A mark journals the in-flight reads and pins instead of copying them: going back after any forward,
    backward or update leaves the book as a copy taken at the mark (the worker undoes a failed action so)."""
    from pipecore.algorithms import get_algorithm
    from pipecore.schedule.ir import B, F, U
    from pipecore.versions import VersionBook

    algorithm = get_algorithm(name, 4, 4)
    row = algorithm.schedule(3).stages[2]
    book = VersionBook(algorithm, 2)

    def state():
        return (book.live, book.updates, set(book.held), dict(book.pins), dict(book.forward_reads), book.latest_tag)

    def act(a):
        if a.kind is F:
            book.forward(a.index, a.index // 4)
        elif a.kind is B:
            for k in a.microbatches:
                book.backward(k)
        elif a.kind is U:
            book.update()

    for a in row:
        before = state()
        mark = book.mark()
        act(a)
        book.rewind(mark)
        assert state() == before, a
        mark = book.mark()
        act(a)
        if a.kind is B:
            book.release_backward()
    with pytest.raises(ValueError, match="latest mark"):
        old = book.mark()
        book.mark()
        book.rewind(old)
