"""SpecTrain (Chen et al., 2018): asynchronous 1F1B without stashing, with weight prediction.

Forward and backward read weights predicted ``s`` updates ahead, ``W - s*lr*v``, where ``v`` is the
optimizer's next update direction estimated with the latest gradient: for momentum SGD the official code's
``v = momentum*buf + g`` (the next momentum buffer if the next gradient equals the last one), see
:meth:`pipecore.engine.optim.StageOptimizer.next_step_direction`. Each stage keeps ``v`` as a weight-sized
buffer of its own (``direction``), estimated after every update. Stage ``s`` (0-based) of ``P`` predicts
``s_f = s//2 + P - s - 1`` updates ahead in its forward and ``s_b = s//2`` in its backward (the official
code's horizons); ``lookahead`` (one ``s_f`` per stage) overrides the forward horizon; the backward keeps
``s//2``. The horizons count updates, one after every backward, so ``update_every`` must be 1. One version
per stage plus a transient predicted copy.
"""

from typing import Any

import torch

from .. import ops
from ..schedule import async_one_f_one_b
from ._common import update_every_option
from .base import AlgorithmSpec, Options, Predicted, ReadContext, WeightRead
from .state import AfterUpdate, BufferUpdate, StateBuffer, WeightSource


class NextStepDirection(BufferUpdate):
    """After every update: the direction the next update would take if its gradient equalled this one, per
    unit of learning rate (the optimizer's :meth:`~pipecore.engine.optim.StageOptimizer.next_step_direction`)."""

    def check(self, optimizer: Any) -> None:
        optimizer.check_next_step_direction()

    def apply(self, buffer: torch.Tensor, after: AfterUpdate) -> None:
        after.optimizer.next_step_direction(after.grad, after.weights, out=buffer)


_NEXT_STEP = NextStepDirection()

#: ``v``, what a prediction extrapolates along; every stage predicts.
DIRECTION = StateBuffer("direction", "update direction (of weight prediction)", lambda stage, algorithm: _NEXT_STEP,
                        saved_as=("optimizer.next_direction",))


def predict(source: WeightSource, read: WeightRead, base: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``W[version] - coef * lr * v``: the weights ``coef`` updates ahead, at the stage's next learning rate."""
    direction = source.buffer(DIRECTION.name).to(base.dtype)
    return ops.predict(base, direction, read.coef * source.next_lr(), out=out)


def forward_horizon(stage: int, num_stages: int) -> int:
    return stage // 2 + num_stages - stage - 1


def backward_horizon(stage: int, num_stages: int) -> int:
    return stage // 2


class _BackwardPrediction(Predicted):
    """The backward horizon is fixed by the forward's target, so ``lookahead`` does not apply to it."""

    def resolve(self, ctx: ReadContext, options: Options) -> WeightRead:
        return super().resolve(ctx, {**options, "lookahead": None})


def _one_update_per_backward(num_stages: int, n_microbatches: int, options: Options) -> str | None:
    every = update_every_option(n_microbatches, options)
    if every != 1:
        return (f"update_every must be 1, got {every}: the prediction horizons s//2 + P-s-1 and s//2 count "
                "updates made one per backward (the official code's setting); with coarser updates they "
                "would predict too far ahead")
    return None


SPEC = AlgorithmSpec(
    name="spectrain",
    summary="async 1F1B, no stash; F and B read predicted weights W - s*lr*v; 1 version",
    schedule=async_one_f_one_b,
    forward=Predicted(forward_horizon),
    backward=_BackwardPrediction(backward_horizon),
    update_every=update_every_option,
    defaults={"update_every": 1, "backward_rule": "swap", "lookahead": None},
    constraints=(_one_update_per_backward,),
    buffers=(DIRECTION,),
    derivations={"predict": predict},
)
