"""How many intra-op threads each stage thread of a pipeline uses (``Pipeline(threads_per_stage=...)``).

Stage threads in one process share the machine's cores. torch keeps its intra-op thread count per thread
(OpenMP's per-thread setting): a stage thread that has never set it uses torch's process default, the whole
machine, so P stage threads would run P x cores threads, each stage's parallel regions fighting the others'
(``python bench/overhead.py --example`` times ``examples/train_mlp.py`` against ``OMP_NUM_THREADS=1``). The
default share is ``cores // stages`` (at least 1), and no more than the caller's
own setting (``torch.get_num_threads()``), so that a caller who asked torch for fewer threads gets no more.
Stages that run in turn on the calling thread compute with the same count there (set around the run, then
restored): a reduction split over another number of threads may round differently, and a pipeline's results
must not depend on whether its stages run in turn or on threads.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Iterator

import torch


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform tells, else the CPU count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads_per_stage(stages: int) -> int:
    """The process's share of cores for each of ``stages`` stage threads: ``cores // stages``, at least 1,
    at most the calling thread's ``torch.get_num_threads()``."""
    return max(1, min(available_cores() // max(1, stages), torch.get_num_threads()))


def check_threads_per_stage(value: object) -> int | None:
    """``value`` as ``Pipeline`` takes it: None (the default share) or a positive int; anything else raises."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"threads_per_stage must be a positive int or None (the default share), got {value!r}")
    if value < 1:
        raise ValueError(f"threads_per_stage must be at least 1, got {value}")
    return value


def thread_setup(threads: int) -> Callable[[], None]:
    """What a stage thread runs once when it starts: set its intra-op thread count to ``threads``. (Each run of
    actions on the thread then enters the caller's torch state, ``pipecore._C.ThreadState``, which sets the
    count to the one last set on any thread; the stage sets ``threads`` again after it, see
    ``TensorStage.running``.)"""
    def setup() -> None:
        torch.set_num_threads(threads)
    return setup


@contextmanager
def calling_thread_threads(threads: int) -> Iterator[None]:
    """The calling thread computes with ``threads`` intra-op threads inside the block (restored after): stages
    that run in turn on it compute as they would on their own threads. A reduction split over a different
    number of threads may round differently, and in turn or on threads the results must be the same bits."""
    before = torch.get_num_threads()
    if before == threads:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
