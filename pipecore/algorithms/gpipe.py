"""GPipe (Huang et al., 2019): all forwards, all backwards, one synchronous update per mini-batch.

Every F and B of mini-batch ``t`` reads ``theta(t)``; one weight version per stage; the update equals
mini-batch SGD over the ``m`` micro-batches. Bubble fraction ``(P-1)/(m+P-1)``.
"""

from ..schedule import gpipe
from .base import AlgorithmSpec, Live

SPEC = AlgorithmSpec(
    name="gpipe",
    summary="synchronous; all F then all B, flush every mini-batch; 1 version",
    schedule=gpipe,
    forward=Live(),
    backward=Live(),
)
