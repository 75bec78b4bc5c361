"""Long-lived worker threads, one per stage, that run the executor's per-stage jobs.

A pipeline keeps its stage threads from one ``step()`` to the next (starting threads at every step would
cost time, and a profiler trace would show new threads each step instead of one row per stage). Jobs can be
queued while earlier ones run, so the stages can go on with one step's work while the caller prepares the
next. A thread waits for its next job without holding the GIL; :meth:`StageThreads.close` (or the pipeline being garbage
collected) ends every thread.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Callable, Mapping, Optional

_STOP = None  # the job that ends a thread
_POLL = 0.05  # seconds between the caller's checks for Ctrl-C while stage threads run


class StageThreads:
    """One daemon thread per stage, started on first use. ``on_start``, if given, runs once on each thread
    when it starts, before its first job (the pipeline sets the thread's intra-op thread count there: torch
    keeps that count per thread, so a setting made on the caller's thread does not reach the stage threads)."""

    def __init__(self, on_start: Optional[Callable[[], None]] = None) -> None:
        self._on_start = on_start
        self._inboxes: dict[int, queue.SimpleQueue] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._closed = False
        self._done = threading.Semaphore(0)  # released once per finished job
        self._pending = 0  # jobs submitted and not yet seen finished (only the submitting thread counts)
        # Ends the threads when the pool is dropped without close() (they hold no reference to it).
        self._finalizer = weakref.finalize(self, _stop, self._inboxes, self._threads)

    def submit(self, jobs: Mapping[int, Callable[[], None]]) -> None:
        """Queue ``jobs[s]`` on stage ``s``'s thread and return at once. Each thread runs its jobs in the order
        they were submitted. Jobs must not raise (the executor's jobs record their errors)."""
        if self._closed:
            raise RuntimeError("the stage threads were closed")
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

    def _inbox(self, stage: int) -> queue.SimpleQueue:
        inbox = self._inboxes.get(stage)
        if inbox is None or not self._threads[stage].is_alive():
            inbox = self._inboxes[stage] = queue.SimpleQueue()
            thread = threading.Thread(target=_serve, args=(inbox, self._on_start), name=f"pipecore-stage-{stage}",
                                      daemon=True)
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


def _serve(inbox: queue.SimpleQueue, on_start: Optional[Callable[[], None]] = None) -> None:
    if on_start is not None:
        on_start()
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


def _stop(inboxes: dict[int, queue.SimpleQueue], threads: dict[int, threading.Thread]) -> None:
    for inbox in inboxes.values():
        inbox.put(_STOP)
    current = threading.current_thread()
    for thread in threads.values():
        if thread is not current:
            thread.join()
