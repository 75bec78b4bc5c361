"""The algorithms: each module declares a schedule family, a version policy, an update rule and the state it keeps.

Every algorithm is registered by :func:`register_algorithm`: the built-in ones when this package is imported (each
module of this package that defines ``SPEC``, or ``SPECS`` for several, in the order of the docs), an algorithm
defined outside the package when its author calls it (see docs/adding-an-algorithm.md).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from .base import Algorithm, AlgorithmSpec, ReadContext, ReadRule, WeightRead
from .state import BufferUpdate, ChangeAverage, ChangedBeforeStep, GradientTransform, StateBuffer

SPECS: dict[str, AlgorithmSpec] = {}
ALIASES: dict[str, str] = {}


def register_algorithm(spec: AlgorithmSpec, *, replace: bool = False) -> AlgorithmSpec:
    """Make ``spec`` an algorithm that ``Pipeline``, :func:`pipecore.simulate`, planning and the CLI accept by its
    name and aliases (case-insensitive), as the built-in ones are.

    A name or alias already taken is refused unless ``replace`` is true and it belongs to an algorithm of the same
    name (re-registering an edited definition in a notebook). Returns ``spec``:
    ``SPEC = register_algorithm(AlgorithmSpec(...))``.
    """
    if not isinstance(spec, AlgorithmSpec):
        raise TypeError(f"register_algorithm() takes a pipecore.algorithms.AlgorithmSpec, got a {type(spec).__name__}")
    name = spec.name.lower()
    if name != spec.name or not name:
        raise ValueError(f"an algorithm's name must be non-empty and lower-case, got {spec.name!r}")
    previous = SPECS.get(name)
    if previous is not None and not replace:
        raise ValueError(f"an algorithm named {name!r} is registered already; pass replace=True to replace it")
    for key in (name, *(a.lower() for a in spec.aliases)):
        owner = ALIASES.get(key, key if key in SPECS else None)
        if owner is not None and owner != name:
            raise ValueError(f"{key!r} already names the algorithm {owner!r}")
    if previous is not None:
        for alias in previous.aliases:
            ALIASES.pop(alias.lower(), None)
    SPECS[name] = spec
    for alias in spec.aliases:
        ALIASES[alias.lower()] = name
    return spec


def algorithm_names() -> list[str]:
    """Canonical algorithm names: the built-in ones in the order of the docs, then those registered since."""
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


# The built-in algorithms, in the order of the docs; a module of this package defining SPEC or SPECS that this list
# does not name comes after them, in the order of module names.
_DOCS_ORDER = ("gpipe", "one_f_one_b", "pipedream", "twobw", "pipemare", "spectrain", "timeprest", "v_timeprest",
               "i_timeprest", "pipedream_dc", "nesterov_async", "interleaved", "looped_bfs", "zero_bubble",
               "dualpipe_v")


def _register_builtins() -> None:
    found = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    for module_name in [m for m in _DOCS_ORDER if m in found] + [m for m in found if m not in _DOCS_ORDER]:
        module = importlib.import_module(f".{module_name}", __name__)
        declared = getattr(module, "SPECS", None) or ((module.SPEC,) if hasattr(module, "SPEC") else ())
        for spec in declared:
            register_algorithm(spec)


_register_builtins()

__all__ = [
    "ALIASES", "Algorithm", "AlgorithmSpec", "BufferUpdate", "ChangeAverage", "ChangedBeforeStep", "GradientTransform",
    "ReadContext", "ReadRule", "SPECS", "StateBuffer", "WeightRead", "algorithm_names", "get_algorithm", "get_spec",
    "register_algorithm",
]
