"""I-TiMePReSt (Dutta, Chaki, De; 2025): nF1B with backward on an interpolated weight.

The forward reads the live weights and stashes that version. The backward, ``d`` updates later, reads
``W_live + alpha(d)*(W_stash - W_live)`` with ``alpha(d) = exp(-lambda*d)`` by default (``lambda = 1``), so
the stale weight's influence decays with its staleness and the result leans towards the latest weights.
``alpha`` may be ``"exp"``, ``"inverse"`` (``1/(1+lambda*d)``), ``"constant"`` or a callable ``d -> alpha``.
The paper's exact coefficient was not available; this is the spec's proposal.
"""

from ..schedule import n_forward_one_backward
from ._common import staleness_free_nf1b
from .base import AlgorithmSpec, Interpolated, Live

SPEC = AlgorithmSpec(
    name="i-timeprest",
    summary="nF1B; F reads live, B reads lerp(live, stash, exp(-lambda*d))",
    schedule=n_forward_one_backward,
    forward=Live(),
    backward=Interpolated(),
    defaults={"backward_rule": "swap", "alpha": "exp", "lam": 1.0},
    constraints=(staleness_free_nf1b,),
)
