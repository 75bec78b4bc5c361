"""Stress tests for pipecore._C: many threads (at least 16, more than the cores) on every binding.

Each case runs in a subprocess (``stress_run.py``), so that a crash fails the test with the signal that
killed it and the process's output (faulthandler prints every thread's Python stack) instead of killing
pytest. ``PIPECORE_STRESS_SECONDS`` lengthens the runs (default: a few seconds per case).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipecore import _C, ops

ROOT = Path(__file__).parent.parent
SCRIPT = str(Path(__file__).parent / "stress_run.py")
SECONDS = float(os.environ.get("PIPECORE_STRESS_SECONDS", "2"))
THREADS = max(16, 2 * (os.cpu_count() or 1))


def failure(case: str, proc: subprocess.CompletedProcess) -> str | None:
    """Why a stress process failed (naming the signal that killed it), or None when it succeeded."""
    output = f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    if proc.returncode < 0:
        return f"the '{case}' stress process died of {signal.Signals(-proc.returncode).name}\n{output}"
    if proc.returncode != 0:
        # Under a sanitizer's runtime a fault is its report ("DEADLYSIGNAL") and its exit code, not a signal.
        return f"the '{case}' stress process failed (exit {proc.returncode})\n{output}"
    return None


def run_case(case: str, seconds: float = SECONDS, threads: int = THREADS) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, case, str(seconds), str(threads)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600 + 20 * seconds)


@pytest.mark.parametrize("case", ["mailbox", "progress", "kernels", "thread_state", "stage_loops", "mixed"])
def test_stress_case_survives_and_checks_every_result(case):
    proc = run_case(case)
    why = failure(case, proc)
    if why is not None:
        pytest.fail(why)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["case"] == case and report["threads"] >= 16
    assert sum(report["counts"].values()) > 0


def test_a_crashing_case_fails_naming_its_signal():
    """The harness itself: a case that faults fails with the signal's name (or, when a sanitizer's runtime is
    preloaded, with the sanitizer's report of the fault) and the process's output."""
    why = failure("segfault", run_case("segfault", 0.0, 1))
    assert why is not None
    assert "died of SIGSEGV" in why or "DEADLYSIGNAL" in why, why
    assert "--- stderr ---" in why


# ------------------------------------------------------------------------------------------------
# What the rules of csrc/README.md changed, one by one


def test_a_guard_left_on_another_thread_raises_and_leaves_that_thread_alone():
    """Leaving used to restore the entering thread's previous state on whichever thread left: here it
    would have switched gradients back on inside this thread's no_grad."""
    import threading

    state = _C.ThreadState()
    guards = []
    t = threading.Thread(target=lambda: guards.append(state.enter().__enter__()))
    t.start()
    t.join(10)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="must be left on the thread that entered it"):
            guards[0].__exit__(None, None, None)
        assert not torch.is_grad_enabled()


def test_a_guard_is_left_once():
    guard = _C.ThreadState().enter()
    with guard:
        pass
    with pytest.raises(RuntimeError, match="already left"):
        guard.__exit__(None, None, None)


def test_misaligned_tensors_are_refused_before_any_access():
    """A float32 tensor at an odd byte address: the kernels' element accesses were undefined behaviour on it
    (UBSan: store to misaligned address) and their streaming stores faulted. Both layers now refuse it. Run in
    a subprocess, so a regression fails the test instead of crashing pytest."""
    code = (
        "import torch\n"
        "from pipecore import _C, ops\n"
        "_C._set_streaming_threshold(0)\n"
        "n = 100_000\n"
        "raw = bytearray(4 * n + 2)\n"
        "out = torch.frombuffer(raw, dtype=torch.float32, offset=2, count=n)\n"
        "assert out.data_ptr() % 4 == 2\n"
        "live, stale = torch.randn(n), torch.randn(n)\n"
        "for call in (lambda: _C.interpolate(out, live, stale, 0.5), lambda: ops.predict(live, stale, 0.5, out=out)):\n"
        "    try:\n"
        "        call()\n"
        "    except ValueError as exc:\n"
        "        assert \"argument 'out' is not aligned to its 4-byte elements\" in str(exc), str(exc)\n"
        "    else:\n"
        "        raise AssertionError('a misaligned out was accepted')\n"
        "assert not any(raw), 'a refused call wrote'\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stdout, proc.stderr)


def test_the_extension_refuses_overlapping_written_arguments():
    """Direct callers of pipecore._C: a written tensor that overlaps another argument (other than 'out'
    being exactly the weights it replaces) is a ValueError, not a silently wrong update."""
    w, grad = torch.ones(10), torch.ones(10)
    pool = torch.zeros(20)
    with pytest.raises(ValueError, match="argument 'out' is written and overlaps argument 'momentum_buf'"):
        _C.sgd_step(pool[:10], w, grad, pool[5:15], None, 0.1, 0.9, 0.0, 0.0, False, False, 0.0)
    with pytest.raises(ValueError, match="argument 'exp_avg' is written and overlaps argument 'grad'"):
        _C.adamw_step(torch.zeros(10), w, grad, grad, torch.zeros(10), 1.0, 0.9, 0.99, 1e-8, 0.1, 1.0)
    with pytest.raises(ValueError, match="argument 'out' is written and overlaps argument 'exp_avg_sq'"):
        _C.nadam_step(pool[:10], w, grad, torch.zeros(10), pool[5:15], 0.0, 1.0, 0.9, 0.99, 1e-8, 0.01, -0.01, -0.09)
    assert torch.count_nonzero(pool) == 0 and torch.equal(grad, torch.ones(10))
    # 'out' being exactly the weights is the in-place update the optimizers use.
    _C.sgd_step(w, w, grad, None, None, 0.5, 0.0, 0.0, 0.0, False, False, 0.0)
    assert torch.equal(w, torch.full((10,), 0.5))
    assert torch.equal(ops.interpolate(w, torch.zeros(10), 1.0, out=w), torch.zeros(10))


def test_errors_raised_by_the_extension_have_their_python_types():
    """Translated by the extension's own translators (none registered globally)."""
    box = _C.Mailbox()
    box.put(1, "x")
    with pytest.raises(KeyError, match="key 1 is already present"):
        box.put(1, "y")
    with pytest.raises(TimeoutError, match="key 2 was not put"):
        box.take(2, 0.0)
    with pytest.raises(IndexError, match="counter index 3 is out of range for 2 counters"):
        _C.Progress(2).get(3)
    box.abort("why")
    with pytest.raises(_C.Aborted, match="why") as info:
        box.take(1)
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(ValueError, match="numel must be positive"):
        _C.WeightRing(0, 2, torch.float32, torch.device("cpu"))
