"""Zero-bubble schedules (Qi et al., ICLR'24, "Zero Bubble Pipeline Parallelism"): the backward split into
``B``, the gradient of the stage's input that the upstream stage waits for, and ``W``, the weights' gradients,
which nothing waits for and which fill the bubbles.

* ``zb-h1``: 1F1B's order with ``W`` deferred into the cool-down; at 1F1B's activation memory, about a third
  of its bubble. With ``stages_per_rank > 1``, looped chunks (torch's ScheduleInterleavedZeroBubble).
* ``zb-v``: two chunks per rank placed in a V (rank ``r`` holds stages ``r`` and ``2R-1-r``): about no bubble
  when F, B and W cost the same, at 1F1B's activation memory.

Synchronous: equal to sequential training (a W adds its micro-batch's gradients before the update).
"""

from ..schedule.modern import zero_bubble_h1, zero_bubble_v
from ._common import sizes_allowed_by
from .base import AlgorithmSpec, Live

H1 = AlgorithmSpec(
    name="zb-h1",
    aliases=("zero-bubble", "zb1p"),
    summary="synchronous; 1F1B with the backward split into B and W, W filling the bubble; 1 version",
    schedule=zero_bubble_h1,
    forward=Live(),
    backward=Live(),
    defaults={"stages_per_rank": 1},
    schedule_options=("stages_per_rank",),
    constraints=(sizes_allowed_by(zero_bubble_h1, "stages_per_rank"),),
)

V = AlgorithmSpec(
    name="zb-v",
    summary="synchronous; two chunks per rank in a V, backward split into B and W; 1 version",
    schedule=zero_bubble_v,
    forward=Live(),
    backward=Live(),
    defaults={"stages_per_rank": 2},
    schedule_options=("stages_per_rank",),
    constraints=(sizes_allowed_by(zero_bubble_v, "stages_per_rank"),),
)

#: Both, in the order of the docs.
SPECS = (H1, V)
