"""Stress cases for pipecore._C, one per process: ``python stress_run.py CASE SECONDS THREADS``.

Each case hammers one part of the extension from THREADS threads (more than the machine's cores) for
SECONDS, checks what every call returned or raised, and prints one JSON line of counts ("ok": true) at
the end. A crash shows as the process dying of a signal; tests/test_stress_extension.py runs each case
in its own process so that it fails the test with the signal and this output instead of killing pytest.
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import sys
import threading
import time
import weakref
from collections import Counter
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent.parent))
from pipecore import _C  # noqa: E402
from pipecore.ops import reference  # noqa: E402
from pipecore.ops._checks import nadam_scalars  # noqa: E402

JOIN_S = 60.0


class Payload:
    """A weak-referenceable object, to check that the mailbox drops exactly the references it took."""

    def __init__(self, key: int) -> None:
        self.key = key


def run_threads(bodies: list[Callable[[Counter], None]]) -> Counter:
    """Run every body on its own thread; each counts what it saw. The first unexpected error is re-raised."""
    counts: list[Counter] = [Counter() for _ in bodies]
    errors: list[BaseException] = []

    def wrap(body: Callable[[Counter], None], count: Counter) -> None:
        try:
            body(count)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(b, c), daemon=True) for b, c in zip(bodies, counts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
        if t.is_alive():
            raise AssertionError("a stress thread is still blocked: a wait did not end")
    if errors:
        raise errors[0]
    total: Counter = Counter()
    for c in counts:
        total.update(c)
    return total


def mailbox(seconds: float, threads: int) -> Counter:
    """Producers put, consumers take with short timeouts (some keys are never put), one thread aborts and
    resets the mailbox now and then: every take returns its key's payload or raises TimeoutError naming the
    key or Aborted with the reason."""
    box = _C.Mailbox()
    deadline = time.monotonic() + seconds
    pairs = max(1, (threads - 1) // 2)
    refs: list[weakref.ref] = []

    def producer(p: int) -> Callable[[Counter], None]:
        def body(count: Counter) -> None:
            rng = random.Random(p)
            n = 0
            while time.monotonic() < deadline:
                key = p * 1_000_000 + n
                n += 1
                if rng.random() < 0.2:
                    continue  # never put: its take times out
                payload = Payload(key)
                refs.append(weakref.ref(payload))
                box.put(key, payload)
                count["put"] += 1
                if rng.random() < 0.3:
                    time.sleep(0.0005)
            count["producers_done"] += 1
        return body

    def consumer(p: int) -> Callable[[Counter], None]:
        def body(count: Counter) -> None:
            n = 0
            while time.monotonic() < deadline:
                key = p * 1_000_000 + n
                n += 1
                try:
                    value = box.take(key, 0.002)
                except TimeoutError as exc:
                    assert f"key {key} was not put" in str(exc), str(exc)
                    count["timeout"] += 1
                except _C.Aborted as exc:
                    assert str(exc).startswith("stress abort "), str(exc)
                    count["aborted"] += 1
                else:
                    assert isinstance(value, Payload) and value.key == key, (key, value)
                    count["taken"] += 1
        return body

    def aborter(count: Counter) -> None:
        k = 0
        while time.monotonic() < deadline:
            time.sleep(0.01)
            box.abort(f"stress abort {k}")
            box.abort("a second reason, not kept")
            time.sleep(0.001)
            box.reset()
            k += 1
            count["aborts"] += 1

    bodies = [producer(p) for p in range(pairs)] + [consumer(p) for p in range(pairs)] + [aborter]
    counts = run_threads(bodies)
    box.clear()
    assert len(box) == 0
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} payloads outlived the mailbox's clear(): a reference leaked"
    for key in ("taken", "timeout", "aborted"):
        assert counts[key] > 0, f"the stress never exercised '{key}': {dict(counts)}"
    return counts


def progress(seconds: float, threads: int) -> Counter:
    """Setters raise counters, waiters wait for values with short timeouts, one thread aborts and resets:
    a wait that returns saw its value reached, the others raised TimeoutError or Aborted."""
    n = 4
    prog = _C.Progress(n)
    deadline = time.monotonic() + seconds

    def setter(i: int) -> Callable[[Counter], None]:
        def body(count: Counter) -> None:
            v = 0
            while time.monotonic() < deadline:
                v += 1
                prog.set(i, v)
                count["set"] += 1
                time.sleep(0.0002)
        return body

    def waiter(w: int) -> Callable[[Counter], None]:
        def body(count: Counter) -> None:
            rng = random.Random(w)
            while time.monotonic() < deadline:
                i = rng.randrange(n)
                target = prog.get(i) + rng.choice([1, 5, 10_000_000])  # the last is never reached
                try:
                    prog.wait_at_least(i, target, 0.003)
                except TimeoutError as exc:
                    assert f"counter {i} is" in str(exc) and f">= {target}" in str(exc), str(exc)
                    count["timeout"] += 1
                except _C.Aborted as exc:
                    assert str(exc).startswith("progress abort "), str(exc)
                    count["aborted"] += 1
                else:
                    assert prog.get(i) >= target
                    count["reached"] += 1
        return body

    def aborter(count: Counter) -> None:
        k = 0
        while time.monotonic() < deadline:
            time.sleep(0.01)
            prog.abort(f"progress abort {k}")
            time.sleep(0.001)
            prog.reset()
            k += 1

    waiters = max(1, threads - n - 1)
    counts = run_threads([setter(i) for i in range(n)] + [waiter(w) for w in range(waiters)] + [aborter])
    for key in ("reached", "timeout", "aborted"):
        assert counts[key] > 0, f"the stress never exercised '{key}': {dict(counts)}"
    return counts


NADAM_ARGS = dict(step=2, mu_product=0.5, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01,
                  momentum_decay=0.004, decoupled_weight_decay=False)
#: nadam_scalars' arguments for NADAM_ARGS, in order.
NADAM_SCALARS = tuple(NADAM_ARGS[k] for k in ("step", "mu_product", "lr", "beta1", "beta2", "weight_decay",
                                                "momentum_decay", "decoupled_weight_decay"))


def kernels(seconds: float, threads: int) -> Counter:
    """Half the threads run the fused kernels on tensors large enough for at::parallel_for to split (and to
    stream their stores), checking each result against the plain-torch reference; the other half call them
    with bad arguments and expect ValueError naming the argument."""
    # At least two intra-op threads, so that at::parallel_for splits the work, unless the environment asks
    # for one (ThreadSanitizer runs: libgomp's barriers are invisible to an uninstrumented OpenMP runtime).
    torch.set_num_threads(int(os.environ.get("PIPECORE_STRESS_INTRAOP_THREADS", max(2, torch.get_num_threads()))))
    _C._set_streaming_threshold(0)  # every call streams its stores: the alignment path runs too
    deadline = time.monotonic() + seconds
    size = 1 << 18

    def good(t: int) -> Callable[[Counter], None]:
        def body(count: Counter) -> None:
            g = torch.Generator().manual_seed(t)
            live, stale = torch.randn(size, generator=g, dtype=torch.float64), torch.randn(size, generator=g,
                                                                                        dtype=torch.float64)
            grad, buf = torch.randn(size, generator=g, dtype=torch.float64), torch.randn(size, generator=g,
                                                                                       dtype=torch.float64)
            out = torch.empty_like(live)
            while True:  # at least one round, however slow the machine (or a sanitizer) is
                _C.interpolate(out, live, stale, 0.25)
                assert torch.equal(out, reference.interpolate(live, stale, 0.25)), "interpolate differs"
                _C.predict(out, live, stale, 0.5)
                assert torch.equal(out, reference.predict(live, stale, 0.5)), "predict differs"
                mine, theirs = buf.clone(), buf.clone()
                _C.sgd_step(out, live, grad, mine, None, 0.1, 0.9, 0.0, 0.0, False, False, 0.0)
                expected = reference.sgd_step(live, grad, theirs, lr=0.1, momentum=0.9, out=torch.empty_like(live))
                # torch's add(alpha=) may fuse the multiply-add: to round-off, as tests/test_ops.py compares.
                torch.testing.assert_close(out, expected, rtol=1e-13, atol=1e-14)
                assert torch.equal(mine, theirs), "sgd_step's momentum differs"
                m_mine, v_mine = grad.clone(), buf.abs()
                m_theirs, v_theirs = m_mine.clone(), v_mine.clone()
                _C.nadam_step(out, live, grad, m_mine, v_mine, **nadam_scalars(*NADAM_SCALARS), beta1=0.9, beta2=0.99,
                              eps=1e-8)
                expected = reference.nadam_step(live, grad, m_theirs, v_theirs, **NADAM_ARGS,
                                                out=torch.empty_like(live))
                assert torch.equal(out, expected), "nadam_step differs"
                assert torch.equal(m_mine, m_theirs) and torch.equal(v_mine, v_theirs), "nadam_step's moments differ"
                count["kernel_calls"] += 4
                if time.monotonic() >= deadline:
                    break
        return body

    bad_calls = [
        (lambda: _C.interpolate(torch.zeros(10), torch.ones(10), torch.ones(9), 0.5),
         "argument 'stale' has 9 elements, expected 10"),
        (lambda: _C.predict(torch.zeros(10), torch.ones(10, dtype=torch.int32), torch.ones(10), 0.5),
         "weights must be float64, float32, bfloat16 or float16"),
        (lambda: _C.sgd_step(torch.zeros(10), torch.ones(10), torch.ones(10), None, None, 0.1, 0.9, 0.0, 0.0, False,
                             False, 0.0), "argument 'momentum_buf' is required"),
        (lambda: _C.adamw_step(torch.zeros(10), torch.ones(10), torch.ones(10), torch.zeros(10, dtype=torch.float64),
                               torch.zeros(10), 1.0, 0.9, 0.99, 1e-8, 0.1, 1.0), "argument 'exp_avg' has dtype"),
        (lambda: _C.nadam_step(torch.zeros(10), torch.ones(10), torch.ones(10), torch.zeros(10), torch.zeros(9), 0.0,
                               1.0, 0.9, 0.99, 1e-8, 0.01, -0.01, -0.09), "argument 'exp_avg_sq' has 9 elements"),
        (lambda: _C.interpolate(torch.zeros(4, 4).t(), torch.ones(4, 4), torch.ones(4, 4), 0.5),
         "argument 'out' must be contiguous"),
    ]

    def bad(t: int) -> Callable[[Counter], None]:
        def body(count: Counter) -> None:
            rng = random.Random(t)
            while time.monotonic() < deadline:
                call, message = rng.choice(bad_calls)
                try:
                    call()
                except ValueError as exc:
                    assert message in str(exc), (message, str(exc))
                    count["value_errors"] += 1
                else:
                    raise AssertionError(f"no ValueError for a call that should raise {message!r}")
        return body

    half = max(1, threads // 2)
    counts = run_threads([good(t) for t in range(half)] + [bad(t) for t in range(threads - half)])
    for key in ("kernel_calls", "value_errors"):
        assert counts[key] > 0, f"the stress never exercised '{key}': {dict(counts)}"
    return counts


def thread_state(seconds: float, threads: int) -> Counter:
    """Short-lived threads enter the caller's torch state (no_grad) and leave it, running autograd around it;
    guards left on the wrong thread raise, and guards dropped unleft change no thread's state."""
    deadline = time.monotonic() + seconds
    with torch.no_grad():
        state = _C.ThreadState()
    counts: Counter = Counter()
    lock = threading.Lock()

    def short_lived(count: Counter) -> None:
        assert torch.is_grad_enabled()
        with state.enter():
            assert not torch.is_grad_enabled(), "the entered state is not the captured one"
        assert torch.is_grad_enabled(), "leaving did not restore the thread's own state"
        x = torch.randn(8, requires_grad=True)
        (x * x).sum().backward()
        assert torch.equal(x.grad, 2 * x.detach())
        count["entered"] += 1

    def dropped(count: Counter) -> None:
        guard = state.enter()
        guard.__enter__()
        del guard  # never left: the thread ends holding the entered state; nothing is restored elsewhere
        count["dropped"] += 1

    holder: list = []

    def wrong_thread(count: Counter) -> None:
        guard = state.enter()
        guard.__enter__()
        holder.append(guard)
        count["handed_over"] += 1

    while time.monotonic() < deadline:
        batch = [short_lived] * (threads - 2) + [dropped, wrong_thread]
        c = run_threads(batch)
        with lock:
            counts.update(c)
        # Leaving a guard entered on a thread that has ended, from this thread, raises and leaves this
        # thread's state as it was.
        while holder:
            guard = holder.pop()
            with torch.no_grad():
                try:
                    guard.__exit__(None, None, None)
                except RuntimeError as exc:
                    assert "must be left on the thread that entered it" in str(exc), str(exc)
                    counts["wrong_thread_refused"] += 1
                else:
                    raise AssertionError("a guard was left on another thread without an error")
                assert not torch.is_grad_enabled(), "a refused exit changed this thread's state"
            del guard
    assert torch.is_grad_enabled()
    for key in ("entered", "dropped", "wrong_thread_refused"):
        assert counts[key] > 0, f"the stress never exercised '{key}': {dict(counts)}"
    return counts


def mixed(seconds: float, threads: int) -> Counter:
    """Everything at once, beside threads running autograd through batch_norm and cross_entropy (what the
    other threads were doing when the extension's calls crashed on a 16-core machine)."""
    deadline = time.monotonic() + seconds
    share = max(4, threads // 4)

    def training(count: Counter) -> None:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(16, 32, generator=g, requires_grad=True)
        bn = torch.nn.BatchNorm1d(16)
        while time.monotonic() < deadline:
            x = torch.randn(64, 32, generator=g)
            loss = F.cross_entropy(bn(x @ w.t()), torch.randint(0, 16, (64,), generator=g))
            loss.backward()
            count["backwards"] += 1

    results: dict[str, Counter] = {}
    parts = {"mailbox": mailbox, "progress": progress, "kernels": kernels, "thread_state": thread_state,
             "stage_loops": stage_loops}

    def part(name: str) -> Callable[[Counter], None]:
        def body(count: Counter) -> None:
            results[name] = parts[name](seconds, share)
        return body

    counts = run_threads([part(name) for name in parts] + [training] * 2)
    for c in results.values():
        counts.update(c)
    assert counts["backwards"] > 0
    return counts


def stage_loops(seconds: float, threads: int) -> Counter:
    """Pairs of native stage loops pass messages (the first posts what Python put, after a stand-in replay; the
    second takes, replays, posts to Python) while Python threads put and take on the same mailboxes, and now and
    then a round is aborted or its loops are dropped while they run. Every round either delivers every message
    with its value or ends with the abort's reason; no wait outlives its round."""
    deadline = time.monotonic() + seconds
    n = 20

    def pair(p: int) -> Callable[[Counter], None]:
        def body(count: Counter) -> None:
            rng = random.Random(p)
            while time.monotonic() < deadline:
                inbox, middle, outbox = _C.Mailbox(), _C.Mailbox(), _C.Mailbox()
                x, y, u, v = (torch.zeros(64) for _ in range(4))
                first = _C.StageLoop(0, [_C.StandInGraph("F0", [x], [y], 2.0, 0.0, 0)], [x, y], [inbox, middle])
                second = _C.StageLoop(1, [_C.StandInGraph("F1", [u], [v], 1.0, 1.0, 0)], [u, v], [middle, outbox])
                first.start([i for k in range(n) for i in (("take", 0, k, [0]), ("replay", 0), ("post", 1, k, [1]))],
                            JOIN_S)
                second.start([i for k in range(n) for i in (("take", 0, k, [0]), ("replay", 0), ("post", 1, k, [1]))],
                             JOIN_S)
                fate = rng.random()
                stop_at = rng.randrange(n) if fate < 0.3 else n
                for k in range(stop_at):
                    inbox.put_tensors(k, [torch.full((64,), float(k))])  # Python-born: the loop drops them
                if fate < 0.15:
                    first.abort(f"stress abort {p}")
                elif fate < 0.3:
                    del first, second  # dropped while running: their mailboxes are aborted
                    with_reason = "its StageLoop was destroyed while its program ran"
                    try:
                        outbox.take(n - 1, JOIN_S)
                    except _C.Aborted as exc:
                        assert with_reason in str(exc), str(exc)
                        count["dropped"] += 1
                    continue
                outcomes = []
                for loop in (first, second):
                    try:
                        loop.join(JOIN_S)
                        outcomes.append("ok")
                    except _C.Aborted as exc:
                        assert str(exc) == f"stress abort {p}", str(exc)
                        outcomes.append("aborted")
                if outcomes == ["ok", "ok"]:
                    for k in range(n):
                        [got] = outbox.take(k, JOIN_S)
                        assert torch.equal(got, torch.full((64,), 2.0 * k + 1.0)), (k, got)
                    count["delivered"] += n
                else:
                    assert fate < 0.15, outcomes
                    count["aborted"] += 1
                count["rounds"] += 1
        return body

    counts = run_threads([pair(p) for p in range(max(2, threads // 2))])
    for key in ("delivered", "aborted", "dropped"):
        assert counts[key] > 0, f"the stress never exercised '{key}': {dict(counts)}"
    return counts


def segfault(seconds: float, threads: int) -> Counter:
    """Dies of SIGSEGV (reads address 0): for the test of the harness itself."""
    import ctypes

    ctypes.string_at(0)
    raise AssertionError("reading address 0 did not fault")


CASES = {"segfault": segfault, "mailbox": mailbox, "progress": progress, "kernels": kernels, "thread_state": thread_state,
         "stage_loops": stage_loops, "mixed": mixed}


def main() -> None:
    faulthandler.enable()  # a crash prints every thread's Python stack before the process dies
    native_stacks = getattr(torch._C, "_set_print_stack_traces_on_fatal_signal", None)
    if native_stacks is not None:
        native_stacks(True)  # ... and, first, every thread's C++ stack (tests/conftest.py)
    case, seconds, threads = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    counts = CASES[case](seconds, threads)
    print(json.dumps({"ok": True, "case": case, "threads": threads, "counts": dict(counts)}), flush=True)


if __name__ == "__main__":
    main()
