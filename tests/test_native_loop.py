"""The native stage loop (csrc/stage_loop.*): order, messages, errors and aborts, with the CPU stand-in for graphs."""

from __future__ import annotations

import re
import sys
import threading
import time

import pytest
import torch

from pipecore import _C
from pipecore.runtime.native_loop import Aborted, NativeStageLoop, Post, Replay, StandInGraph, Take

WAIT = 30.0  # seconds: generous, a loaded machine must not fail these; a hang still fails


def chain(m: int, scales=(2.0, 3.0), fail_at: int = 0):
    """Two stages, F then B per micro-batch as 1F1B orders them on 2 stages, each action a stand-in graph:
    stage s's forward multiplies by scales[s], its backward by scales[s] too (the derivative of x * a).
    Mailboxes: 0 the inputs, 1 stage 0 -> 1 activations, 2 stage 1's outputs, 3 gradients into stage 1,
    4 stage 1 -> 0 gradients, 5 stage 0's input gradients."""
    boxes = [_C.Mailbox() for _ in range(6)]
    loops, graphs = [], []
    for s, a in enumerate(scales):
        x, y, g, dx = (torch.zeros(3, dtype=torch.float64) for _ in range(4))
        fwd = StandInGraph(f"F{s}", [x], [y], scale=a, fail_at=fail_at if s == 0 else 0)
        bwd = StandInGraph(f"B{s}", [g], [dx], scale=a)
        graphs.append((fwd, bwd))
        loops.append(NativeStageLoop(s, [fwd, bwd], [x, y, g, dx], boxes))
    # 1F1B on two stages: stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3 (one warm-up forward), stage 1 F then B each.
    order0 = [("F", 0)]
    for k in range(1, m):
        order0 += [("F", k), ("B", k - 1)]
    order0 += [("B", m - 1)]
    order1 = [a for k in range(m) for a in (("F", k), ("B", k))]
    programs = []
    for s, order in enumerate((order0, order1)):
        ins = []
        for kind, k in order:
            if kind == "F":
                ins += [Take(0 if s == 0 else 1, k, [0]), Replay(0), Post(1 if s == 0 else 2, k, [1])]
            else:
                ins += [Take(3 if s == 1 else 4, k, [2]), Replay(1), Post(4 if s == 1 else 5, k, [3])]
        programs.append(ins)
    return boxes, loops, graphs, programs


def test_a_two_stage_program_computes_what_the_eager_chain_computes():
    m = 4
    boxes, loops, graphs, programs = chain(m)
    for loop, program in zip(loops, programs):
        loop.start(program, timeout=WAIT)
    inputs = [torch.randn(3, dtype=torch.float64) for _ in range(m)]
    grads = [torch.randn(3, dtype=torch.float64) for _ in range(m)]
    for k in range(m):
        boxes[0].put_tensors(k, [inputs[k].clone()])
        boxes[3].put_tensors(k, [grads[k].clone()])
    for loop in loops:
        loop.join(WAIT)
    for k in range(m):
        [out] = boxes[2].take(k, timeout=WAIT)
        [dx] = boxes[5].take(k, timeout=WAIT)
        assert torch.equal(out, inputs[k] * 2.0 * 3.0)
        assert torch.equal(dx, grads[k] * 3.0 * 2.0)
    assert [(f.replays, b.replays) for f, b in graphs] == [(m, m), (m, m)]
    assert all(len(b) == 0 for b in boxes)


def test_instructions_complete_in_program_order_and_after_the_messages_they_take():
    m = 3
    boxes, loops, _, programs = chain(m)
    for loop, program in zip(loops, programs):
        loop.start(program, timeout=WAIT)
    for k in reversed(range(m)):  # put out of order: each loop still takes in its program's order
        boxes[3].put_tensors(k, [torch.ones(3, dtype=torch.float64)])
        boxes[0].put_tensors(k, [torch.ones(3, dtype=torch.float64)])
    for loop in loops:
        loop.join(WAIT)
    done = [dict(loop.completed()) for loop in loops]
    for s, program in enumerate(programs):
        assert sorted(done[s]) == list(range(len(program)))
        sequence = [done[s][i] for i in range(len(program))]
        assert sequence == sorted(sequence)
    # Stage 1 takes activation k (instruction 6k) after stage 0 posted it; stage 0 takes gradient k after
    # stage 1 posted it.
    posted0 = {ins.key: done[0][i] for i, ins in enumerate(programs[0]) if isinstance(ins, Post) and ins.mailbox == 1}
    taken1 = {ins.key: done[1][i] for i, ins in enumerate(programs[1]) if isinstance(ins, Take) and ins.mailbox == 1}
    posted1 = {ins.key: done[1][i] for i, ins in enumerate(programs[1]) if isinstance(ins, Post) and ins.mailbox == 4}
    taken0 = {ins.key: done[0][i] for i, ins in enumerate(programs[0]) if isinstance(ins, Take) and ins.mailbox == 4}
    assert all(taken1[k] > posted0[k] and taken0[k] > posted1[k] for k in range(m))


def test_a_failing_replay_stops_its_loop_and_aborts_the_stage_waiting_on_it():
    boxes, loops, graphs, programs = chain(4, fail_at=2)  # stage 0's second forward fails
    for loop, program in zip(loops, programs):
        loop.start(program, timeout=WAIT)
    for k in range(4):
        boxes[0].put_tensors(k, [torch.ones(3, dtype=torch.float64)])
        boxes[3].put_tensors(k, [torch.ones(3, dtype=torch.float64)])
    reason = re.escape("stage 0, instruction 4 (replay graph 'F0'): graph 'F0': replay 2 failed")
    with pytest.raises(RuntimeError, match=reason):
        loops[0].join(WAIT)
    with pytest.raises(Aborted, match=reason):  # stage 1 waits for the activation that never comes
        loops[1].join(WAIT)
    # Nothing ran after the failure: stage 0 stopped at its second forward, and stage 1 got at most micro-batch
    # 0's activation (whether it took it before the abort reached its mailboxes depends on the timing).
    assert graphs[0][0].replays == 2 and graphs[0][1].replays == 0
    assert graphs[1][0].replays <= 1 and graphs[1][1].replays <= 1
    with pytest.raises(Aborted, match=reason):  # Python waiting on the same mailboxes stops too
        boxes[5].take(0, timeout=WAIT)


@pytest.mark.parametrize("message, what", [
    ([torch.ones(4, dtype=torch.float64)], r"tensor 0 of the message is \[4\] Double on cpu, the static buffer it "
                                           r"goes to is \[3\] Double on cpu"),
    ([torch.ones(3, dtype=torch.float32)], r"tensor 0 of the message is \[3\] Float on cpu, the static buffer it "
                                           r"goes to is \[3\] Double on cpu"),
    ([torch.ones(3, dtype=torch.float64)] * 2, "the message has 2 tensors, the graph's static inputs are 1"),
    ([], "the message has 0 tensors, the graph's static inputs are 1"),
])
def test_a_message_that_does_not_fit_the_static_buffers_is_never_replayed_on(message, what):
    inbox, outbox = _C.Mailbox(), _C.Mailbox()
    x, y = torch.full((3,), 5.0, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    graph = StandInGraph("f", [x], [y])
    loop = NativeStageLoop(2, [graph], [x, y], [inbox, outbox])
    loop.start([Take(0, 9, [0]), Replay(0), Post(1, 9, [1])], timeout=WAIT)
    inbox.put_tensors(9, message)
    with pytest.raises(RuntimeError, match=r"stage 2, instruction 0 \(take key 9 from mailbox 0\): " + what):
        loop.join(WAIT)
    assert graph.replays == 0 and torch.equal(x, torch.full((3,), 5.0, dtype=torch.float64))
    assert len(outbox) == 0


def test_abort_stops_a_loop_waiting_for_a_message():
    inbox = _C.Mailbox()
    x = torch.zeros(2)
    loop = NativeStageLoop(1, [StandInGraph("f", [x], [x])], [x], [inbox])
    loop.start([Take(0, 0, [0]), Replay(0)])
    time.sleep(0.05)
    assert loop.running
    loop.abort("the user stopped training")
    with pytest.raises(Aborted, match="the user stopped training"):
        loop.join(WAIT)
    assert not loop.running


def test_join_can_time_out_and_be_called_again():
    inbox, outbox = _C.Mailbox(), _C.Mailbox()
    x = torch.zeros(2)
    loop = NativeStageLoop(0, [], [x], [inbox, outbox])
    loop.start([Take(0, 1, [0]), Post(1, 1, [0])])
    with pytest.raises(TimeoutError, match=r"stage 0 is still running its program \(0 instructions done\)"):
        loop.join(0.05)
    inbox.put_tensors(1, [torch.ones(2)])
    loop.join(WAIT)
    assert torch.equal(outbox.take(1)[0], torch.ones(2))


def test_a_take_that_waits_past_its_timeout_fails_the_loop_and_its_mailboxes():
    inbox, outbox = _C.Mailbox(), _C.Mailbox()
    x = torch.zeros(2)
    loop = NativeStageLoop(4, [], [x], [inbox, outbox])
    loop.start([Take(0, 3, [0])], timeout=0.05)
    with pytest.raises(TimeoutError, match=r"stage 4, instruction 0 \(take key 3 from mailbox 0\): "
                                           r"Mailbox.take_tensors: key 3 was not put"):
        loop.join(WAIT)
    with pytest.raises(Aborted, match="key 3 was not put"):
        outbox.take(0, timeout=WAIT)


def test_posting_a_key_that_is_already_there_fails_the_loop():
    box = _C.Mailbox()
    x = torch.zeros(2)
    box.put(5, "a Python object")
    loop = NativeStageLoop(0, [], [x], [box])
    loop.start([Post(0, 5, [0])])
    with pytest.raises(RuntimeError, match=r"stage 0, instruction 0 \(post key 5 to mailbox 0\): "
                                           r"Mailbox.put_tensors: key 5 is already present"):
        loop.join(WAIT)


def test_a_loop_cannot_take_a_python_object():
    box = _C.Mailbox()
    x = torch.zeros(2)
    box.put(5, (torch.ones(2),))
    loop = NativeStageLoop(0, [], [x], [box])
    loop.start([Take(0, 5, [0])])
    with pytest.raises(RuntimeError, match="key 5 holds a Python object, not tensors put by put_tensors"):
        loop.join(WAIT)
    box.reset()
    assert box.take(5)[0].tolist() == [1.0, 1.0]  # left where it was


@pytest.mark.parametrize("program, message", [
    ([Replay(1)], "instruction 0: graph 1 is out of range for 1 graphs"),
    ([Replay(0), Take(2, 0, [0])], "instruction 1: mailbox 2 is out of range for 1 mailboxes"),
    ([Post(0, 0, [0, 2])], "instruction 0: buffer 2 is out of range for 2 buffers"),
    ([Take(-1, 0, [0])], "instruction 0: mailbox -1 is out of range"),
])
def test_bad_programs_are_refused_before_anything_runs(program, message):
    x, y = torch.zeros(2), torch.zeros(2)
    graph = StandInGraph("f", [x], [y])
    loop = NativeStageLoop(3, [graph], [x, y], [_C.Mailbox()])
    with pytest.raises(ValueError, match=f"StageLoop.start: stage 3, {message}"):
        loop.start(program)
    assert not loop.running and graph.replays == 0
    with pytest.raises(TypeError, match="program instruction 0 is a str; expected Take, Replay or Post"):
        loop.start(["replay"])


@pytest.mark.parametrize("raw, message", [
    (["replay"], "instruction 0: not a tuple"),
    ([("jump", 0)], "instruction 0: 'jump' with 1 arguments"),
    ([("take", 0, "k", [0])], "instruction 0: an argument of 'take' is not an integer"),
    ([()], "instruction 0: the first element is not an instruction name"),
])
def test_the_extension_refuses_malformed_instructions(raw, message):
    loop = _C.StageLoop(0, [], [torch.zeros(1)], [_C.Mailbox()])
    with pytest.raises(ValueError, match=message):
        loop.start(raw)


def test_bad_loop_arguments_are_refused():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="mailbox 0 is a <class 'dict'>, not a pipecore._C.Mailbox"):
        _C.StageLoop(0, [], [x], [{}])
    with pytest.raises(ValueError, match="stage must be >= 0"):
        _C.StageLoop(-1, [], [x], [])
    with pytest.raises(ValueError, match=r"input 0 is \[2\] Float on cpu but output 0 is \[3\] Float on cpu"):
        StandInGraph("f", [x], [torch.zeros(3)])
    with pytest.raises(ValueError, match="1 inputs but 0 outputs"):
        StandInGraph("f", [x], [])


def test_a_second_program_waits_until_the_first_is_joined():
    box = _C.Mailbox()
    x = torch.zeros(2)
    loop = NativeStageLoop(0, [], [x], [box])
    loop.start([Take(0, 0, [0])])
    with pytest.raises(RuntimeError, match="a program is still running; join\\(\\) it first"):
        loop.start([])
    box.put_tensors(0, [torch.ones(2)])
    while loop.running:
        time.sleep(0.001)
    with pytest.raises(RuntimeError, match="the previous program ended but was not joined"):
        loop.start([])
    loop.join(WAIT)
    loop.start([Post(0, 1, [0])])
    loop.join(WAIT)
    assert box.take(1)[0].tolist() == [1.0, 1.0]
    with pytest.raises(RuntimeError, match="no program was started"):
        loop.join(WAIT)


def test_the_loops_run_while_python_keeps_the_gil():
    """With a switch interval of 5 s the main thread keeps the GIL while it spins below; two loops passing
    messages from Python, between them and back to Python finish anyway, because nothing they do needs the
    interpreter (not even dropping the messages Python put: those are detached aliases)."""
    n = 100
    inbox, a, out = _C.Mailbox(), _C.Mailbox(), _C.Mailbox()
    for k in range(n):
        inbox.put_tensors(k, [torch.full((8,), float(k), requires_grad=True)])
    x, y = torch.zeros(8), torch.zeros(8)
    u, v = torch.zeros(8), torch.zeros(8)
    first = NativeStageLoop(0, [StandInGraph("F0", [x], [y], scale=2.0)], [x, y], [inbox, a])
    second = NativeStageLoop(1, [StandInGraph("F1", [u], [v], shift=1.0)], [u, v], [a, out])
    first.start([i for k in range(n) for i in (Take(0, k, [0]), Replay(0), Post(1, k, [1]))], timeout=WAIT)
    second.start([i for k in range(n) for i in (Take(0, k, [0]), Replay(0), Post(1, k, [1]))], timeout=WAIT)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    try:
        deadline = time.monotonic() + 4.0
        while len(out) < n and time.monotonic() < deadline:
            pass
        finished = len(out)
    finally:
        sys.setswitchinterval(interval)
    first.join(WAIT)
    second.join(WAIT)
    assert finished == n
    assert all(torch.equal(out.take(k)[0], torch.full((8,), 2.0 * k + 1.0)) for k in range(n))


def test_destroying_a_running_loop_aborts_its_mailboxes_and_does_not_hang():
    box = _C.Mailbox()
    x = torch.zeros(2)
    loop = NativeStageLoop(7, [], [x], [box])
    loop.start([Take(0, 0, [0])])
    done = threading.Event()

    def drop():
        nonlocal loop
        del loop
        done.set()

    t = threading.Thread(target=drop)
    t.start()
    t.join(WAIT)
    assert done.is_set()
    with pytest.raises(Aborted, match="stage 7: its StageLoop was destroyed while its program ran"):
        box.take(0, timeout=WAIT)


def test_python_puts_and_takes_native_messages_beside_objects():
    box = _C.Mailbox()
    box.put(1, "object")
    box.put_tensors(0, [torch.ones(2), torch.zeros(1, dtype=torch.int64)])
    assert box.keys() == [0, 1] and len(box) == 2 and 0 in box
    with pytest.raises(KeyError, match="key 0 is already present"):
        box.put_tensors(0, [])
    with pytest.raises(KeyError, match="key 1 is already present"):
        box.put_tensors(1, [])
    with pytest.raises(KeyError, match="key 0 is already present"):
        box.put(0, "x")
    taken = box.take(0)
    assert isinstance(taken, list) and [t.dtype for t in taken] == [torch.float32, torch.int64]
    w = torch.ones(3, requires_grad=True)
    box.put_tensors(3, [w * 2])
    [alias] = box.take(3)
    assert not alias.requires_grad and alias.grad_fn is None and torch.equal(alias, torch.full((3,), 2.0))
    assert box.take(1) == "object"
    box.put_tensors(2, [torch.ones(1)])
    box.clear()
    assert len(box) == 0


@pytest.mark.parametrize("ending", ["return", "sys.exit(3)", "raise SystemExit(3)"])
def test_the_interpreter_exits_cleanly_with_a_loop_still_waiting(ending):
    """A script that ends while its loop waits for a message (a forgotten join, an exception) exits with its own
    status: the loop's destructor aborts and joins it; nothing terminates the process."""
    import subprocess
    import textwrap
    from pathlib import Path

    script = textwrap.dedent(f"""
        import sys, torch
        from pipecore import _C
        from pipecore.runtime.native_loop import NativeStageLoop, Take, Replay, StandInGraph

        def main():
            box = _C.Mailbox()
            x = torch.zeros(2)
            loop = NativeStageLoop(0, [StandInGraph("f", [x], [x])], [x], [box])
            loop.start([Take(0, 0, [0]), Replay(0), Take(0, 1, [0])])
            box.put_tensors(0, [torch.ones(2)])
            globals()["kept"] = loop  # alive until the interpreter finalizes
            {ending}

        main()
    """)
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == (0 if ending == "return" else 3), proc.stderr
    assert "terminate" not in proc.stderr and "Fatal" not in proc.stderr, proc.stderr
