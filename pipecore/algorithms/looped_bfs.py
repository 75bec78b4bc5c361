"""Looped BFS (Lamy-Poirier, 2022; torch's ScheduleLoopedBFS): each rank holds ``stages_per_rank`` looped
chunks and runs every forward of its first chunk, then of the next, ..., then the backwards in reverse:
GPipe's order per chunk, breadth first. Synchronous; holds all ``m`` micro-batches' activations per chunk.
"""

from ..schedule.modern import looped_bfs
from ._common import sizes_allowed_by
from .base import AlgorithmSpec, Live

SPEC = AlgorithmSpec(
    name="looped-bfs",
    summary="synchronous; all forwards of each looped chunk, then all backwards (breadth first); 1 version",
    schedule=looped_bfs,
    forward=Live(),
    backward=Live(),
    defaults={"stages_per_rank": 1},
    schedule_options=("stages_per_rank",),
    constraints=(sizes_allowed_by(looped_bfs, "stages_per_rank"),),
)
