"""V-TiMePReSt (Dutta, Chaki, De; 2025): staleness-free nF1B.

Every forward and every backward reads the stage's latest weights; no stashing, one version per stage.
Requires ``n_microbatches >= num_stages - 1`` so that the version difference is 1.
"""

from ..schedule import n_forward_one_backward
from ._common import staleness_free_nf1b
from .base import AlgorithmSpec, Live

SPEC = AlgorithmSpec(
    name="v-timeprest",
    summary="nF1B; F and B read live weights, no stash; 1 version",
    schedule=n_forward_one_backward,
    forward=Live(),
    backward=Live(),
    defaults={"backward_rule": "swap"},
    constraints=(staleness_free_nf1b,),
)
