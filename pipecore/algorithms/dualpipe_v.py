"""DualPipeV (DeepSeek-V3 technical report; deepseek-ai/DualPipe's ``dualpipev``; torch's ScheduleDualPipeV):
two chunks per rank in a V, the backward split into B and W, and in the steady state the forward of one
micro-batch issued together with the backward of another (two consecutive actions of the rank, forward
first), so that one's communication can hide behind the other's compute. Synchronous.
"""

from ..schedule.modern import dualpipe_v
from ._common import sizes_allowed_by
from .base import AlgorithmSpec, Live

SPEC = AlgorithmSpec(
    name="dualpipe-v",
    aliases=("dualpipev",),
    summary="synchronous; V placement, a forward and a backward of two micro-batches overlapped; 1 version",
    schedule=dualpipe_v,
    forward=Live(),
    backward=Live(),
    defaults={"stages_per_rank": 2},
    schedule_options=("stages_per_rank",),
    constraints=(sizes_allowed_by(dualpipe_v, "stages_per_rank"),),
)
