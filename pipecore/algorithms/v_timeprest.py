"""V-TiMePReSt (Dutta, Chaki, De; 2025): staleness-free nF1B.

Every forward and every backward reads the stage's latest weights; no stashing, one version per stage.
The paper runs with ``n_microbatches >= num_stages - 1`` (TiMePReSt's condition for a version difference
of 1); pipecore does not require it: every read is the live version whatever ``m``, so the condition
protects nothing here (the delay between a forward and its backward is what the simulator shows).
"""

from ..schedule import n_forward_one_backward
from .base import AlgorithmSpec, Live

SPEC = AlgorithmSpec(
    name="v-timeprest",
    summary="nF1B; F and B read live weights, no stash; 1 version",
    schedule=n_forward_one_backward,
    forward=Live(),
    backward=Live(),
    defaults={"backward_rule": "swap"},
)
