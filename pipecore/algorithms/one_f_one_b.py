"""1F1B with flush (PipeDream-Flush, DAPPLE, Megatron's default schedule).

Warm-up ``P-s-1`` forwards, then alternate one forward and one backward, drain, update, flush. Same
semantics as GPipe (``theta(t+1) = theta(t) - lr*grad(theta(t))``), at most ``P-s`` micro-batches of
activations in flight instead of ``m``.
"""

from ..schedule import one_f_one_b
from .base import AlgorithmSpec, Live

SPEC = AlgorithmSpec(
    name="1f1b",
    aliases=("pipedream-flush",),
    summary="synchronous; 1F1B with a flush every mini-batch; 1 version",
    schedule=one_f_one_b,
    forward=Live(),
    backward=Live(),
)
