"""Schedules as data: the action IR, the schedule families and validation."""

from .generators import FAMILIES, async_one_f_one_b, gpipe, n_forward_one_backward, one_f_one_b
from .ir import Action, B, F, Kind, U, parse_traced
from .schedule import Schedule, upstream
from .validate import ScheduleError, validate

__all__ = [
    "Action", "B", "F", "FAMILIES", "Kind", "Schedule", "ScheduleError", "U", "async_one_f_one_b", "gpipe",
    "n_forward_one_backward", "one_f_one_b", "parse_traced", "upstream", "validate",
]
