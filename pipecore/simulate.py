"""The simulator: the local executor over symbolic stages, yielding a :class:`~pipecore.trace.Trace`."""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

from .algorithms import Algorithm, get_algorithm
from .runtime.executor import Costs, Executor
from .runtime.worker import StageWorker
from .schedule.validate import validate
from .trace import Trace

CostsLike = Costs | Mapping[str, Any] | Sequence[float] | None


def make_costs(num_stages: int, costs: CostsLike) -> Costs:
    """Normalise ``costs``: None (F=1, B=2 of which W=1), ``(F, B)``, a :class:`Costs`, or a mapping with
    per-stage lists or scalars under ``forward``, ``backward`` and optionally ``weight``, ``update`` and ``send``.

    ``weight`` is the weight-gradient part of a backward: schedules that split backwards (zero bubble) run it
    as a ``W`` action and their ``B`` costs ``backward``; the others pay ``backward + weight`` per ``B``.
    Without ``weight``, ``backward`` is the whole backward (default 2) and a ``W`` costs nothing; with it,
    ``backward`` defaults to 1."""
    if costs is None:
        return Costs.uniform(num_stages, backward=1.0, weight=1.0)
    if isinstance(costs, Costs):
        result = costs
    elif isinstance(costs, Mapping):
        unknown = set(costs) - {"forward", "backward", "weight", "update", "send"}
        if unknown:
            raise ValueError(f"unknown cost keys {sorted(unknown)}; use forward, backward, weight, update, send")

        def per_stage(key: str, default: float) -> tuple[float, ...]:
            value = costs.get(key, default)
            values = tuple(float(v) for v in value) if isinstance(value, Sequence) else (float(value),) * num_stages
            if len(values) != num_stages:
                raise ValueError(f"costs[{key!r}] has {len(values)} entries; the pipeline has {num_stages} stages")
            return values

        result = Costs(per_stage("forward", 1.0), per_stage("backward", 1.0 if "weight" in costs else 2.0),
                       per_stage("update", 0.0), float(costs.get("send", 0.0)), per_stage("weight", 0.0))
    else:
        values = tuple(float(v) for v in costs)
        if len(values) not in (2, 3):
            raise ValueError(f"costs as a sequence must be (forward, backward) or (forward, backward, send), got {values}")
        result = Costs.uniform(num_stages, values[0], values[1], send=values[2] if len(values) == 3 else 0.0)
    for key in ("forward", "backward", "weight", "update"):
        if len(getattr(result, key)) != num_stages:
            raise ValueError(
                f"costs.{key} has {len(getattr(result, key))} entries; the pipeline has {num_stages} stages"
            )
    values = result.forward + result.backward + result.update + (result.send,) + tuple(result.weight or ())
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise ValueError(f"costs must be finite and non-negative, got {result}")
    return result


def simulate(
    algorithm: str | Algorithm,
    num_stages: int,
    n_microbatches: int,
    n_minibatches: int = 4,
    costs: CostsLike = None,
    **options: Any,
) -> Trace:
    """Run ``algorithm`` symbolically and return its timed version trace.

    Micro-batches are numbered globally from 0 (mini-batch = index // n_microbatches). ``costs`` is None
    (unit costs F=1, B=2 of which the weight-gradient part W=1), ``(F, B)`` or ``(F, B, send)``, or per-stage
    times, e.g. ``{"forward": 1, "backward": 1, "weight": 1}`` (see :func:`make_costs`). ``options`` are the
    algorithm's options (e.g. ``lam=0.5`` for I-TiMePReSt, ``stages_per_rank=2`` for the interleaved and
    V-shaped schedules, whose traces then show ranks as rows).
    """
    if isinstance(algorithm, str):
        algorithm = get_algorithm(algorithm, num_stages, n_microbatches, **options)
    elif options:
        raise ValueError("pass options when naming the algorithm, not with a configured Algorithm")
    resolved_costs = make_costs(num_stages, costs)
    with _cyclic_gc_paused():
        schedule = validate(algorithm.schedule(n_minibatches))
        workers = [StageWorker(algorithm, s) for s in range(num_stages)]
        executor = Executor(schedule, workers, resolved_costs)
        executor.run()
        return Trace(algorithm, schedule, executor.events, [w.book.peak_versions for w in workers])


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (reference counting still frees memory).

    A simulation allocates a handful of small, acyclic objects per action; the full collections that this
    triggers traverse every object of the process, which with torch loaded cost more than the simulation.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
