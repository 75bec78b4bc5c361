"""pipecore: pipeline-parallel training for PyTorch with first-class weight staleness.

Every algorithm is a schedule (per-stage action lists), a version policy (which weights each forward and
backward reads) and an update rule. :func:`simulate` runs any of them symbolically and returns a
:class:`Trace` of the versions every action read.

The names below are imported on first use (PEP 562): ``import pipecore`` alone does not import torch, so
that ``pipecore --help`` (which reads ``__version__``) answers at once.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> the submodule that defines it.
_EXPORTS: dict[str, str] = {
    "algorithm_names": ".algorithms", "get_algorithm": ".algorithms", "register_algorithm": ".algorithms",
    "SGD": ".engine", "AdamW": ".engine", "NAdam": ".engine", "CaptureError": ".engine", "NonFiniteLoss": ".engine",
    "Pipeline": ".engine",
    "PeerError": ".runtime.link",
    "Action": ".schedule", "Schedule": ".schedule", "ScheduleError": ".schedule", "validate": ".schedule",
    "simulate": ".simulate",
    "Plan": ".planning", "plan": ".planning", "profile": ".planning",
    "Trace": ".trace",
}

__all__ = [
    "AdamW", "NAdam", "CaptureError", "checkpoint", "Plan", "plan", "profile", "NonFiniteLoss", "PeerError", "Pipeline", "SGD", "Action", "Schedule", "ScheduleError", "Trace", "algorithm_names", "get_algorithm", "register_algorithm", "simulate", "validate",
]

if TYPE_CHECKING:
    from . import checkpoint
    from .algorithms import algorithm_names, get_algorithm, register_algorithm
    from .engine import SGD, AdamW, CaptureError, NAdam, NonFiniteLoss, Pipeline
    from .planning import Plan, plan, profile
    from .runtime.link import PeerError
    from .schedule import Action, Schedule, ScheduleError, validate
    from .simulate import simulate
    from .trace import Trace


def __getattr__(name: str) -> Any:
    """Import a public name (or a submodule, such as ``pipecore.checkpoint``) when it is first read."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # read once: later reads do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The package's module type: ``pipecore.simulate`` stays the function, as when this file imported it
    eagerly, although importing the submodule of the same name sets the package's attribute to the module."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "simulate" and isinstance(value, types.ModuleType):
            value = value.simulate
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
