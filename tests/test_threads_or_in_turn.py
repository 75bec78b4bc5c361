"""The default ``concurrent`` with every stage on the CPU: the first steps run both on the stage threads and in
turn, timed, and the faster way is kept, probed again after 100 steps, then 200, ... (pipecore/runtime/choice.py).
Either way gives the same bits."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import pipecore
from _same import assert_same
from pipecore.runtime.choice import IN_TURN, MEASURING, THREADS, ThreadsOrInTurn


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(8, 8), nn.Tanh())],
                         nn.Linear(8, 3)).double()


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g))
            for _ in range(steps)]


def test_warmup_then_alternating_probes_then_the_faster_way():
    choice = ThreadsOrInTurn(warmup=2, probes=3)
    ways = []
    times = {THREADS: iter([0.5, 0.15, 0.3]), IN_TURN: iter([0.2, 0.12, 9.0])}  # in turn: one slow outlier
    while choice.state == MEASURING:
        way = choice.next()
        ways.append(way)
        choice.record(way, 100.0 if len(ways) <= 2 else next(times[way]))  # warm-up steps are not counted
    assert ways == [THREADS, THREADS, IN_TURN, THREADS, IN_TURN, THREADS, IN_TURN, THREADS]
    assert choice.seconds == {THREADS: [0.5, 0.15, 0.3], IN_TURN: [0.2, 0.12, 9.0]}
    assert choice.chosen == IN_TURN and choice.next() == IN_TURN  # fastest probes: 0.12 < 0.15
    choice.record(THREADS, 0.0)  # after the choice nothing changes it
    assert choice.next() == IN_TURN and choice.seconds[THREADS] == [0.5, 0.15, 0.3]


@pytest.mark.parametrize("threads, kept", [(0.5, THREADS), (0.9, THREADS), (0.95, IN_TURN), (1.0, IN_TURN)])
def test_threads_kept_only_when_clearly_faster(threads, kept):
    choice = ThreadsOrInTurn(warmup=0, probes=1)
    choice.record(choice.next(), 1.0)  # in turn
    assert choice.state == MEASURING
    choice.record(choice.next(), threads)
    assert choice.state == kept  # the threads must save THREADS_MARGIN (10%) of the step


@pytest.mark.parametrize("warmup, probes, recheck", [(-1, 2, 10), (0, 0, 10), (0, 2, -1)])
def test_bad_settings(warmup, probes, recheck):
    with pytest.raises(ValueError, match="warmup and recheck must be >= 0 and probes >= 1"):
        ThreadsOrInTurn(warmup=warmup, probes=probes, recheck=recheck)


def test_the_ways_are_probed_again_after_recheck_then_twice_as_many_steps():
    """A choice stands for ``recheck`` steps, then the ways are probed again and chosen afresh from the new
    probes only (a burst of load that decided the first choice does not decide the next); the gap doubles."""
    choice = ThreadsOrInTurn(warmup=0, probes=2, recheck=3)
    ways, states = [], []
    threads_seconds = [2.0]  # a step's wall time on the threads (in turn: 1.0); changed between rounds

    def step():
        way = choice.next()
        ways.append(way)
        choice.record(way, threads_seconds[0] if way == THREADS else 1.0)
        states.append(choice.state)

    for _ in range(4):  # the first round
        step()
    assert choice.chosen == IN_TURN and choice.seconds == {THREADS: [2.0, 2.0], IN_TURN: [1.0, 1.0]}
    for _ in range(3):  # the choice stands for `recheck` steps
        step()
    assert ways[4:] == [IN_TURN] * 3 and states[4:] == [IN_TURN, IN_TURN, MEASURING]
    threads_seconds[0] = 0.5
    for _ in range(4):  # probed again: the threads are faster now, by the new probes alone
        step()
    assert ways[7:] == [IN_TURN, THREADS, IN_TURN, THREADS] and choice.chosen == THREADS
    assert choice.seconds == {THREADS: [0.5, 0.5], IN_TURN: [1.0, 1.0]}
    for _ in range(6):  # then twice as many steps before the next round
        step()
    assert ways[11:] == [THREADS] * 6 and states[-1] == MEASURING
    threads_seconds[0] = 2.0
    for _ in range(4):
        step()
    assert ways[17:] == [IN_TURN, THREADS, IN_TURN, THREADS] and choice.chosen == IN_TURN and states[-1] == IN_TURN


def test_no_recheck_keeps_the_first_choice():
    choice = ThreadsOrInTurn(warmup=0, probes=1, recheck=0)
    for seconds in (1.0, 0.5):
        choice.record(choice.next(), seconds)
    assert choice.chosen == THREADS
    for _ in range(1000):
        assert choice.next() == THREADS and choice.state == THREADS
        choice.record(THREADS, 9.0)
    assert choice.chosen == THREADS


def _train(**options):
    pipe = pipecore.Pipeline(mlp(), 4, "1f1b", n_microbatches=4, optimizer=pipecore.SGD(lr=0.05, momentum=0.9),
                             loss_fn=nn.CrossEntropyLoss(), **options)
    return pipe


@pytest.mark.parametrize("kept", [THREADS, IN_TURN])
def test_default_on_the_cpu_measures_then_keeps_one_way_with_the_same_bits(monkeypatch, kept):
    # Step times made up so that `kept` wins: the real ones decide on this machine, but the test needs both.
    real_record = ThreadsOrInTurn.record
    monkeypatch.setattr(ThreadsOrInTurn, "record",
                        lambda self, way, seconds: real_record(self, way, 1.0 if way == kept else 2.0))
    pipe = _train()
    threads_seen = []  # the threads the first Linear ran on, per step
    first = pipe.stages[0].module.get_submodule("0")
    first.register_forward_pre_hook(lambda module, args: threads_seen[-1].add(threading.current_thread()))
    steps, states = data(16), []
    losses = []
    for x, y in steps:
        threads_seen.append(set())
        losses.append(pipe.step(x, y))
        states.append(pipe.execution)
    assert states[:12] == [MEASURING] * 12 and set(states[12:]) == {kept}  # 3 warm-up steps, 5 probes each
    main = threading.current_thread()
    on_main = [threads_seen[i] == {main} for i in range(16)]
    assert on_main == [False] * 3 + [True, False] * 5 + [kept == IN_TURN] * 3
    reference = _train(concurrent=False)
    assert [reference.step(x, y) for x, y in steps] == losses
    assert_same(pipe.state_dict(), reference.state_dict(), "1f1b")
    pipe.close(), reference.close()


def test_explicit_or_overlapping_threads_and_explicit_in_turn_are_kept():
    for options, way in [({"concurrent": True}, THREADS), ({"overlap_steps": True}, THREADS),
                         ({"concurrent": False}, IN_TURN)]:
        pipe = _train(**options)
        for x, y in data(12):
            pipe.step(x, y)
            assert pipe.execution == way, options
        pipe.close()
    single = pipecore.Pipeline(mlp(), 1, "1f1b", loss_fn=nn.CrossEntropyLoss())
    assert single.execution == IN_TURN
