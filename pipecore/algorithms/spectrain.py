"""SpecTrain (Chen et al., 2018): asynchronous 1F1B without stashing, with weight prediction.

Forward and backward read weights predicted ``s`` updates ahead, ``W - s*lr*v`` with ``v`` the momentum
buffer advanced by the latest gradient. Stage ``s`` (0-based) of ``P`` predicts ``s_f = s//2 + P - s - 1``
updates ahead in its forward and ``s_b = s//2`` in its backward (the official code's horizons);
``lookahead`` (one ``s_f`` per stage) overrides the forward horizon; the backward keeps ``s//2``.
An update after every backward by default. One version per stage plus a transient predicted copy.
"""

from ..schedule import async_one_f_one_b
from ._common import update_every_divides_minibatch, update_every_option
from .base import AlgorithmSpec, Predicted, ReadContext, Options, WeightRead


def forward_horizon(stage: int, num_stages: int) -> int:
    return stage // 2 + num_stages - stage - 1


def backward_horizon(stage: int, num_stages: int) -> int:
    return stage // 2


class _BackwardPrediction(Predicted):
    """The backward horizon is fixed by the forward's target, so ``lookahead`` does not apply to it."""

    def resolve(self, ctx: ReadContext, options: Options) -> WeightRead:
        return super().resolve(ctx, {**options, "lookahead": None})


SPEC = AlgorithmSpec(
    name="spectrain",
    summary="async 1F1B, no stash; F and B read predicted weights W - s*lr*v; 1 version",
    schedule=async_one_f_one_b,
    forward=Predicted(forward_horizon),
    backward=_BackwardPrediction(backward_horizon),
    update_every=update_every_option,
    defaults={"update_every": 1, "backward_rule": "swap", "lookahead": None},
    constraints=(update_every_divides_minibatch,),
)
