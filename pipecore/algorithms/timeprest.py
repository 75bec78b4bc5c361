"""TiMePReSt (Dutta, Chaki, De; FGCS 2026): nF1B with vertical sync and no horizontal stashing.

Each stage runs a forward per micro-batch and one backward per mini-batch. A micro-batch's forward reads,
at every stage, the version it was assigned when it entered stage 0 (vertical sync); the backward reads
the stage's latest weights (default ``backward_rule="swap"``: the forward's graph with the latest weight
values). One update per mini-batch.
"""

from ..schedule import n_forward_one_backward
from .base import AlgorithmSpec, Live, StageZeroTag

SPEC = AlgorithmSpec(
    name="timeprest",
    summary="nF1B; F reads the stage-0 tag (vertical sync), B reads live",
    schedule=n_forward_one_backward,
    forward=StageZeroTag(),
    backward=Live(),
    defaults={"backward_rule": "swap"},
)
