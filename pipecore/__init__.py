"""pipecore: pipeline-parallel training for PyTorch with first-class weight staleness.

Every algorithm is a schedule (per-stage action lists), a version policy (which weights each forward and
backward reads) and an update rule. :func:`simulate` runs any of them symbolically and returns a
:class:`Trace` of the versions every action read.
"""

from .algorithms import algorithm_names, get_algorithm
from .engine import SGD, AdamW, CaptureError, NonFiniteLoss, Pipeline
from .runtime.distributed import PeerError
from . import checkpoint
from .schedule import Action, Schedule, ScheduleError, validate
from .simulate import simulate
from .planning import Plan, plan, profile
from .trace import Trace

__version__ = "0.1.0"

__all__ = [
    "AdamW", "CaptureError", "checkpoint", "Plan", "plan", "profile", "NonFiniteLoss", "PeerError", "Pipeline", "SGD", "Action", "Schedule", "ScheduleError", "Trace", "algorithm_names", "get_algorithm", "simulate", "validate",
]
