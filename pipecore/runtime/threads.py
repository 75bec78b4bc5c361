"""Long-lived worker threads, one per stage, that run the executor's per-stage jobs.

A pipeline keeps its stage threads from one ``step()`` to the next (starting threads at every step would
cost time, and a profiler trace would show new threads each step instead of one row per stage). Jobs can be
queued while earlier ones run, so the stages can go on with one step's work while the caller prepares the
next. A thread waits for its next job without holding the GIL; :meth:`StageThreads.close` (or the pipeline being garbage
collected) ends every thread.

While jobs run, the pool lowers the interpreter's thread switch interval (``sys.setswitchinterval``). A stage
thread that needs the GIL back (to return from a torch call, or to run a saved-tensor hook inside the
autograd engine) otherwise waits up to the interpreter's 5 ms: another stage thread running module code
gives the GIL up at every torch call but takes it back before the waiting thread has woken, so only the
interval forces a switch. The previous interval is restored once every pool using it is idle.
"""

from __future__ import annotations

import math
import queue
import sys
import threading
import weakref
from typing import Callable, Mapping

_STOP = None  # the job that ends a thread
_POLL = 0.05  # seconds between the caller's checks for Ctrl-C while stage threads run

#: The switch interval stage threads run under by default (seconds); see the module docstring.
SWITCH_INTERVAL = 1e-4


def check_switch_interval(seconds: float | None) -> float | None:
    """``seconds`` if it is a valid switch interval (a finite number > 0) or None; otherwise a ValueError
    saying what is allowed."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
            or seconds <= 0:
        raise ValueError(f"switch_interval must be a number of seconds > 0 (default {SWITCH_INTERVAL}) or None "
                         f"(leave the interpreter's interval alone), got {seconds!r}")
    return float(seconds)


class _SwitchInterval:
    """The process's switch interval while pools need a lower one: the smallest requested (never above what
    it was), and what it was once no request is left. An interval set by someone else in between becomes the
    one to go back to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: list[float] = []
        self._restore = 0.0  # the interval to go back to
        self._set: float | None = None  # the interval this set, as the interpreter reports it

    def lower(self, seconds: float) -> None:
        with self._lock:
            self._requests.append(seconds)
            self._apply()

    def release(self, seconds: float) -> None:
        with self._lock:
            self._requests.remove(seconds)
            self._apply()

    def _apply(self) -> None:
        current = sys.getswitchinterval()
        if self._set is None or current != self._set:
            self._restore = current  # first request, or changed by someone else since
        if self._requests:
            sys.setswitchinterval(min(self._restore, *self._requests))
            self._set = sys.getswitchinterval()
        else:
            sys.setswitchinterval(self._restore)
            self._set = None


_SWITCH = _SwitchInterval()


class _Lowering:
    """One pool's request for a lower switch interval, held while it has jobs (see :class:`StageThreads`)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.held = False

    def hold(self) -> None:
        if self.seconds is not None and not self.held:
            _SWITCH.lower(self.seconds)
            self.held = True

    def let_go(self) -> None:
        if self.held:
            self.held = False
            _SWITCH.release(self.seconds)  # type: ignore[arg-type]


class StageThreads:
    """One daemon thread per stage, started on first use. From a :meth:`submit` until :meth:`wait` has seen
    every job finish (or :meth:`close`), the interpreter's switch interval is at most ``switch_interval``
    seconds (None: left alone)."""

    def __init__(self, switch_interval: float | None = SWITCH_INTERVAL) -> None:
        self._lowering = _Lowering(check_switch_interval(switch_interval))
        self._inboxes: dict[int, queue.SimpleQueue] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._closed = False
        self._done = threading.Semaphore(0)  # released once per finished job
        self._pending = 0  # jobs submitted and not yet seen finished (only the submitting thread counts)
        # Ends the threads when the pool is dropped without close() (they hold no reference to it).
        self._finalizer = weakref.finalize(self, _stop, self._inboxes, self._threads, self._lowering)

    def submit(self, jobs: Mapping[int, Callable[[], None]]) -> None:
        """Queue ``jobs[s]`` on stage ``s``'s thread and return at once. Each thread runs its jobs in the order
        they were submitted. Jobs must not raise (the executor's jobs record their errors)."""
        if self._closed:
            raise RuntimeError("the stage threads were closed")
        if jobs:
            self._lowering.hold()
        for s, job in jobs.items():
            self._inbox(s).put((job, self._done))
            self._pending += 1

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished."""
        return self._pending

    def wait(self, on_interrupt: Callable[[], None]) -> None:
        """Return when every submitted job has returned. If the calling thread is interrupted while waiting
        (``KeyboardInterrupt``), ``on_interrupt`` is called to make the jobs stop, and the interrupt is raised
        once they have."""
        try:
            while self._pending:
                # Short waits: SIGINT may be delivered to a stage thread, and then only the main thread's
                # next bytecode raises KeyboardInterrupt; a wait that never returns would never see it.
                if self._done.acquire(timeout=_POLL):
                    self._pending -= 1
        except BaseException:
            on_interrupt()
            while self._pending:
                self._done.acquire()
                self._pending -= 1
            raise
        finally:
            if not self._pending:
                self._lowering.let_go()

    def _inbox(self, stage: int) -> queue.SimpleQueue:
        inbox = self._inboxes.get(stage)
        if inbox is None or not self._threads[stage].is_alive():
            inbox = self._inboxes[stage] = queue.SimpleQueue()
            thread = threading.Thread(target=_serve, args=(inbox,), name=f"pipecore-stage-{stage}", daemon=True)
            self._threads[stage] = thread
            thread.start()
        return inbox

    def alive(self) -> list[threading.Thread]:
        """The threads that are running."""
        return [t for t in self._threads.values() if t.is_alive()]

    def close(self) -> None:
        """End every thread and wait for them (idempotent)."""
        self._closed = True
        self._finalizer()


def _serve(inbox: queue.SimpleQueue) -> None:
    while True:
        item = inbox.get()
        if item is _STOP:
            return
        job, done = item
        del item  # an idle thread must not keep the last job (and through it the pipeline) alive
        try:
            job()
        finally:
            del job
            done.release()


def _stop(inboxes: dict[int, queue.SimpleQueue], threads: dict[int, threading.Thread], lowering: _Lowering
          ) -> None:
    for inbox in inboxes.values():
        inbox.put(_STOP)
    current = threading.current_thread()
    for thread in threads.values():
        if thread is not current:
            thread.join()
    lowering.let_go()
