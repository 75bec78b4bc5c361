"""Schedules as data: the action IR, the schedule families and validation."""

from .generators import FAMILIES, async_one_f_one_b, gpipe, n_forward_one_backward, one_f_one_b
from .ir import Action, B, F, Kind, U, W, parse_traced
from .modern import (
    MODERN_FAMILIES, dualpipe_v, interleaved_one_f_one_b, looped_bfs, zero_bubble_h1, zero_bubble_v,
)
from .schedule import Schedule, upstream
from .validate import ScheduleError, validate

__all__ = [
    "Action", "B", "F", "FAMILIES", "Kind", "MODERN_FAMILIES", "Schedule", "ScheduleError", "U", "W",
    "async_one_f_one_b", "dualpipe_v", "gpipe", "interleaved_one_f_one_b", "looped_bfs", "n_forward_one_backward",
    "one_f_one_b", "parse_traced", "upstream", "validate", "zero_bubble_h1", "zero_bubble_v",
]
