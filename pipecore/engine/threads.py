"""How many intra-op threads each stage thread of a pipeline uses (``Pipeline(threads_per_stage=...)``).

Stage threads in one process share the machine's cores. torch keeps its intra-op thread count per thread
(OpenMP's per-thread setting): a stage thread that has never set it uses torch's process default, the whole
machine, so P stage threads would run P x cores threads, each stage's parallel regions fighting the others'
(on a busy 2-core machine, ``examples/train_mlp.py`` took 52 s this way against 7 s with
``OMP_NUM_THREADS=1``). The default share is ``cores // stages`` (at least 1), and no more than the caller's
own setting (``torch.get_num_threads()``), so that a caller who asked torch for fewer threads gets no more.
"""

from __future__ import annotations

import os
from typing import Callable

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
    """What a stage thread runs once when it starts: set its intra-op thread count to ``threads``."""
    def setup() -> None:
        torch.set_num_threads(threads)
    return setup
