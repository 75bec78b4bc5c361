"""The algorithms: each module declares a schedule family, a version policy and an update rule."""

from __future__ import annotations

from typing import Any

from . import (dualpipe_v, gpipe, i_timeprest, interleaved, looped_bfs, one_f_one_b, pipedream, pipemare, spectrain,
               timeprest, twobw, v_timeprest, zero_bubble)
from .base import Algorithm, AlgorithmSpec, ReadContext, ReadRule, WeightRead

SPECS: dict[str, AlgorithmSpec] = {
    spec.name: spec
    for spec in (gpipe.SPEC, one_f_one_b.SPEC, pipedream.SPEC, twobw.SPEC, pipemare.SPEC, spectrain.SPEC,
                 timeprest.SPEC, v_timeprest.SPEC, i_timeprest.SPEC,
                 # synchronous schedules with several stages per rank or a split backward
                 interleaved.SPEC, looped_bfs.SPEC, zero_bubble.H1, zero_bubble.V, dualpipe_v.SPEC)
}
ALIASES: dict[str, str] = {alias: spec.name for spec in SPECS.values() for alias in spec.aliases}


def algorithm_names() -> list[str]:
    """Canonical algorithm names, in the order of the docs."""
    return list(SPECS)


def get_spec(name: str) -> AlgorithmSpec:
    """Look up an algorithm by name or alias (case-insensitive)."""
    key = name.lower()
    key = ALIASES.get(key, key)
    if key not in SPECS:
        valid = ", ".join(list(SPECS) + list(ALIASES))
        raise ValueError(f"unknown algorithm {name!r}; valid names: {valid}")
    return SPECS[key]


def get_algorithm(name: str, num_stages: int, n_microbatches: int, **options: Any) -> Algorithm:
    """The algorithm ``name`` configured for a pipeline of ``num_stages`` and ``n_microbatches``."""
    return get_spec(name).configure(num_stages, n_microbatches, **options)


__all__ = [
    "ALIASES", "Algorithm", "AlgorithmSpec", "ReadContext", "ReadRule", "SPECS", "WeightRead",
    "algorithm_names", "get_algorithm", "get_spec",
]
