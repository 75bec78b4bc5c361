"""Mailbox and Progress (pipecore._C): the stage worker threads' synchronisation primitives.

Every blocking call in these tests has a timeout, and every thread is joined with one, so a broken
implementation fails the test instead of hanging the suite.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import weakref

import pytest

from pipecore._C import Aborted, Mailbox, Progress

JOIN_S = 10.0  # far above anything these tests need; only reached on failure


class Payload:
    """Weak-referenceable stand-in for an activation."""

    def __init__(self, tag: object = None) -> None:
        self.tag = tag


def run_thread(fn, *args) -> tuple[threading.Thread, dict]:
    """Start fn(*args) on a thread; the returned dict gets "value" or "error" when it finishes."""
    out: dict = {}

    def body() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, out


def finish(t: threading.Thread) -> None:
    t.join(JOIN_S)
    assert not t.is_alive(), "thread still blocked"


# ------------------------------------------------------------------------------------------------
# Mailbox, single thread


def test_round_trip_keeps_identity_and_bookkeeping():
    m = Mailbox()
    a, b = Payload("a"), Payload("b")
    assert len(m) == 0 and m.keys() == [] and not m.contains(7)
    m.put(7, a)
    m.put(-2, b)
    m.put(3, None)
    assert len(m) == 3 and m.keys() == [-2, 3, 7]
    assert m.contains(7) and 7 in m and not m.contains(8)
    assert m.take(7) is a
    assert m.take(-2, timeout=0) is b  # present: no waiting needed, even with timeout 0
    assert m.take(3) is None
    assert len(m) == 0 and not m.contains(7)


def test_put_of_present_key_raises_and_keeps_the_first_value():
    m = Mailbox()
    first, second = Payload(), Payload()
    m.put(5, first)
    refs = sys.getrefcount(second)
    with pytest.raises(KeyError, match="key 5 is already present"):
        m.put(5, second)
    assert sys.getrefcount(second) == refs  # the rejected value is not kept
    assert m.take(5) is first


def test_take_of_missing_key_times_out():
    m = Mailbox()
    m.put(1, "other")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"key 2 was not put \(waited 0\.05 s\)"):
        m.take(2, timeout=0.05)
    assert time.monotonic() - start >= 0.05
    with pytest.raises(TimeoutError):
        m.take(2, timeout=0)
    assert m.keys() == [1]  # a timed-out take leaves the mailbox alone


def test_nan_timeout_is_rejected():
    with pytest.raises(ValueError, match="timeout"):
        Mailbox().take(0, timeout=float("nan"))
    with pytest.raises(ValueError, match="timeout"):
        Progress(1).wait_at_least(0, 1, timeout=float("nan"))


def test_huge_timeout_waits_like_forever():
    # A timeout too large for the clock must not overflow into an immediate timeout.
    m = Mailbox()
    t, out = run_thread(m.take, 0, 1e300)
    m.put(0, "x")
    finish(t)
    assert out == {"value": "x"}


# ------------------------------------------------------------------------------------------------
# Mailbox, several threads


def test_blocked_take_receives_a_later_put():
    m = Mailbox()
    obj = Payload()
    t, out = run_thread(m.take, 42, JOIN_S)
    time.sleep(0.05)  # let the consumer block (the assertion holds either way)
    m.put(42, obj)
    finish(t)
    assert out == {"value": obj}
    assert len(m) == 0


def test_two_waiters_on_one_key_each_take_one_put():
    # A put wakes the waiters of its key only; with two on one key, one takes it and the other waits on.
    m = Mailbox()
    first, second = Payload(1), Payload(2)
    waiters = [run_thread(m.take, 7, JOIN_S) for _ in range(2)]
    time.sleep(0.05)
    m.put(7, first)
    time.sleep(0.05)
    assert sum(t.is_alive() for t, _ in waiters) == 1
    m.put(7, second)
    for t, _ in waiters:
        finish(t)
    assert sorted(out["value"].tag for _, out in waiters) == [1, 2]
    assert len(m) == 0


def test_waiters_on_other_keys_keep_waiting_and_timed_out_ones_leave_no_trace():
    m = Mailbox()
    others = [run_thread(m.take, k, JOIN_S) for k in (1, 2, 3)]
    for _ in range(50):  # waits that time out unregister themselves: later puts must not reach them
        with pytest.raises(TimeoutError):
            m.take(9, timeout=0.0001)
    time.sleep(0.05)
    m.put(9, Payload(9))
    m.put(2, Payload(2))
    finish(others[1][0])
    assert others[1][1]["value"].tag == 2
    assert all(t.is_alive() for t, _ in (others[0], others[2]))
    assert m.keys() == [9]
    m.abort("done")  # wakes every waiter, whatever its key
    for t, out in (others[0], others[2]):
        finish(t)
        assert isinstance(out["error"], Aborted)


def test_put_from_another_thread_wakes_the_main_thread():
    m = Mailbox()
    obj = Payload()
    t = threading.Timer(0.05, m.put, args=(1, obj))
    t.start()
    assert m.take(1, timeout=JOIN_S) is obj
    finish(t)


@pytest.mark.parametrize("prim", ["mailbox", "progress"])
def test_waiting_releases_the_gil(prim):
    # A waiter that kept the GIL would freeze this thread until its timeout: the counting loop
    # below would see one gap of WAIT_S and the waiter would end in TimeoutError.
    WAIT_S = 5.0
    m, p = Mailbox(), Progress(2)
    entered = threading.Event()

    def waiter():
        entered.set()
        if prim == "mailbox":
            return m.take(0, timeout=WAIT_S)
        p.wait_at_least(1, 1, timeout=WAIT_S)
        return "done"

    t, out = run_thread(waiter)
    assert entered.wait(JOIN_S)
    count, worst_gap = 0, 0.0
    start = last = time.monotonic()
    while (now := time.monotonic()) - start < 0.2:
        worst_gap = max(worst_gap, now - last)
        last = now
        count += 1
    assert t.is_alive(), "the waiter returned before anything was put"
    if prim == "mailbox":
        m.put(0, "payload")
    else:
        p.set(1, 1)
    finish(t)
    assert out == {"value": "payload" if prim == "mailbox" else "done"}
    assert worst_gap < 1.0
    assert count > 10_000  # millions on any machine; a frozen thread manages a few hundred


def test_abort_wakes_waiters_with_the_reason():
    m = Mailbox()
    threads = [run_thread(m.take, k, 30.0) for k in range(3)]
    time.sleep(0.05)  # let them block (the assertions hold either way)
    m.abort("stage 2 failed: boom")
    for t, out in threads:
        finish(t)  # long before the 30 s timeout
        assert isinstance(out.get("error"), Aborted)
        assert str(out["error"]) == "stage 2 failed: boom"


def test_after_abort_every_take_raises_until_reset():
    m = Mailbox()
    obj = Payload()
    m.put(1, obj)
    m.abort("first")
    m.abort("second")  # the first reason, usually the root cause, is kept
    assert issubclass(Aborted, RuntimeError)
    with pytest.raises(Aborted, match="^first$"):
        m.take(1)  # present, still raises
    with pytest.raises(Aborted, match="^first$"):
        m.take(2, timeout=0.01)  # aborted wins over timing out
    m.put(2, "put while aborted")  # put still stores
    assert m.keys() == [1, 2]
    m.reset()
    assert m.take(1) is obj and m.take(2) == "put while aborted"
    with pytest.raises(TimeoutError):
        m.take(3, timeout=0.01)
    m.abort("third")  # aborting again after reset uses the new reason
    with pytest.raises(Aborted, match="^third$"):
        m.take(3)


# ------------------------------------------------------------------------------------------------
# Reference counts


def test_take_hands_over_the_reference():
    m = Mailbox()
    obj = Payload()
    refs = sys.getrefcount(obj)
    m.put(0, obj)
    assert sys.getrefcount(obj) == refs + 1
    assert m.take(0) is obj
    assert sys.getrefcount(obj) == refs
    # Also when the take had to wait (the slow path).
    t, out = run_thread(m.take, 1, JOIN_S)
    time.sleep(0.05)  # let it block
    m.put(1, obj)
    finish(t)
    del out["value"]
    assert sys.getrefcount(obj) == refs


def test_clear_releases_untaken_objects():
    m = Mailbox()
    obj = Payload()
    ref = weakref.ref(obj)
    m.put(0, obj)
    m.put(1, Payload())
    del obj
    gc.collect()
    assert ref() is not None  # the mailbox keeps it alive
    m.clear()
    assert ref() is None and len(m) == 0 and m.keys() == []


def test_destroying_the_mailbox_releases_untaken_objects():
    m = Mailbox()
    obj = Payload()
    ref = weakref.ref(obj)
    m.put(0, obj)
    del obj, m
    gc.collect()
    assert ref() is None


def test_clear_may_run_code_that_uses_the_mailbox():
    # A decref can run __del__; clear() must not hold its lock while dropping items.
    m = Mailbox()

    class PutsOnDelete:
        def __del__(self):
            m.put(99, "from __del__")

    m.put(0, PutsOnDelete())
    m.clear()
    assert m.keys() == [99]


# ------------------------------------------------------------------------------------------------
# Stress


def test_many_producers_and_consumers():
    m = Mailbox()
    n_threads, per_thread = 4, 1000
    sent = {k: Payload(k) for k in range(n_threads * per_thread)}
    received: list[list[tuple[int, Payload]]] = [[] for _ in range(n_threads)]

    def producer(p: int) -> None:
        for k in range(p * per_thread, (p + 1) * per_thread):
            m.put(k, sent[k])

    def consumer(c: int) -> None:
        # Interleaved across producers and backwards: most takes wait for a later put.
        for k in reversed(range(c, n_threads * per_thread, n_threads)):
            received[c].append((k, m.take(k, timeout=JOIN_S)))

    threads = [run_thread(consumer, c) for c in range(n_threads)]
    threads += [run_thread(producer, p) for p in range(n_threads)]
    for t, out in threads:
        finish(t)
        assert "error" not in out, out.get("error")
    got = [pair for per in received for pair in per]
    assert sorted(k for k, _ in got) == sorted(sent)  # every key exactly once
    assert all(obj is sent[k] for k, obj in got)
    assert len(m) == 0


# ------------------------------------------------------------------------------------------------
# Progress


def test_progress_counters_and_fast_path():
    p = Progress(3)
    assert len(p) == 3 and [p.get(i) for i in range(3)] == [0, 0, 0]
    p.set(2, 5)
    assert p.get(2) == 5
    p.wait_at_least(2, 5, timeout=0)  # already true: returns without waiting
    p.wait_at_least(2, -1)
    p.wait_at_least(0, 0)
    p.set(2, 1)  # counters may also go down
    assert p.get(2) == 1


def test_progress_wait_returns_once_another_thread_sets_the_counter():
    p = Progress(2)
    t, out = run_thread(p.wait_at_least, 1, 3, JOIN_S)
    p.set(1, 1)
    p.set(0, 10)  # another counter does not release it
    p.set(1, 2)
    time.sleep(0.05)
    assert t.is_alive()
    p.set(1, 3)
    finish(t)
    assert out == {"value": None}


def test_progress_timeout():
    p = Progress(2)
    p.set(1, 2)
    with pytest.raises(TimeoutError, match=r"counter 1 is 2, not yet >= 3 \(waited 0\.05 s\)"):
        p.wait_at_least(1, 3, timeout=0.05)


def test_progress_abort_and_reset():
    p = Progress(2)
    t, out = run_thread(p.wait_at_least, 0, 1, 30.0)
    time.sleep(0.05)
    p.abort("stop everything")
    finish(t)
    assert isinstance(out.get("error"), Aborted) and str(out["error"]) == "stop everything"
    p.set(0, 4)  # set and get still work while aborted
    assert p.get(0) == 4
    with pytest.raises(Aborted, match="^stop everything$"):
        p.wait_at_least(0, 1)  # satisfied, still raises
    p.reset()
    p.wait_at_least(0, 4)
    assert p.get(0) == 4  # reset keeps the counters


@pytest.mark.parametrize("i", [-1, 3, 100])
def test_progress_index_errors(i):
    p = Progress(3)
    with pytest.raises(IndexError, match=f"counter index {i} is out of range for 3 counters"):
        p.set(i, 1)
    with pytest.raises(IndexError):
        p.get(i)
    with pytest.raises(IndexError):
        p.wait_at_least(i, 0, timeout=0)


@pytest.mark.parametrize("n", [0, -1])
def test_progress_needs_a_counter(n):
    with pytest.raises(ValueError, match="at least one counter"):
        Progress(n)


@pytest.mark.parametrize("stop", ["abort", "timeout"])
def test_a_backward_that_cannot_take_all_its_gradients_gives_back_those_it_took(stop):
    """A backward of several micro-batches takes one gradient after the other. When a take fails midway (the
    run was aborted between two takes, or a gradient never came), the gradients already taken go back to the
    mailbox: after a recovery the action runs again and needs them all (otherwise it waits forever)."""
    from pipecore.algorithms import get_algorithm
    from pipecore.runtime import Costs, Executor, LocalTransport, StageWorker
    from pipecore.runtime.worker import Message
    from pipecore.schedule.ir import B

    algorithm = get_algorithm("i-timeprest", 3, 4)
    transport = LocalTransport(timeout=0.05)
    executor = Executor(algorithm.schedule(1), [StageWorker(algorithm, s) for s in range(3)], Costs.uniform(3),
                        transport=transport)
    sent = {k: Message(Payload(k)) for k in (4, 6, 7)}
    for k, message in sent.items():
        transport.send(1, B, k, message)

    class AbortAfterFirst:
        """The transport, aborted right after the first take succeeds."""

        def __getattr__(self, name):
            return getattr(transport, name)

        def receive(self, stage, kind, microbatch):
            message = transport.receive(stage, kind, microbatch)
            transport.abort("a stage failed")
            return message

    if stop == "abort":
        executor.transport = AbortAfterFirst()
    with pytest.raises(Aborted if stop == "abort" else TimeoutError):
        executor._receive_gradients(1, [4, 5, 6, 7])
    transport.resume()
    assert all(transport.ready(1, B, k) for k in sent) and not transport.ready(1, B, 5)
    assert [transport.receive(1, B, k) for k in sent] == list(sent.values())
