"""I-TiMePReSt (Dutta, Chaki, De; 2025): nF1B with backward on an interpolated weight.

The forward reads the live weights and stashes that version. The backward, ``d`` updates later, reads
``W_live + alpha(d)*(W_stash - W_live)`` with ``alpha(d) = exp(-lambda*d)`` by default (``lambda = 1``), so
the stale weight's influence decays with its staleness and the result leans towards the latest weights.
``alpha`` may be ``"exp"``, ``"inverse"`` (``1/(1+lambda*d)``), ``"constant"`` or a callable ``d -> alpha``;
``lam`` ranges over [0, inf] (0: the stashed weights, as PipeDream; inf: the live weights, as V-TiMePReSt).
``degree`` chooses ``d``: ``"versions"`` (live minus forward version, default) or ``"timeprest"``
(TiMePReSt's version difference ``floor((P+N-2)/N)``). The paper's exact coefficient was not available;
this is the spec's proposal. The paper runs with ``N >= P-1``; pipecore does not require it (it changes no
read).
"""

import torch

from .. import ops
from ..schedule import n_forward_one_backward
from .base import DEGREES, AlgorithmSpec, Interpolated, Live, Options, WeightRead
from .state import WeightSource


def interpolate(source: WeightSource, read: WeightRead, base: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``W[version] + coef * (W[other] - W[version])``: the live weights moved towards the stashed ones by alpha(d)."""
    return ops.interpolate(base, source.slot_of(read.other), read.coef, out=out)


def _check_interpolation(num_stages: int, n_microbatches: int, options: Options) -> str | None:
    """``alpha`` must stay in [0, 1]: ``lam >= 0`` for the exp and inverse forms, ``lam`` in [0, 1] for the
    constant one (a callable is checked when a read resolves it)."""
    alpha, lam = options["alpha"], options["lam"]
    if alpha == "constant" and not 0.0 <= lam <= 1.0:
        return f"with alpha='constant', lam is the weight of the stashed weights and must lie in [0, 1], got {lam}"
    if alpha in ("exp", "inverse") and lam < 0:
        return (f"lam must be >= 0 (0: the stashed weights, inf: the live weights), got {lam}: a negative lam "
                "gives alpha > 1, which extrapolates past the stashed weights")
    if options["degree"] not in DEGREES:
        return f"degree must be one of {DEGREES}, got {options['degree']!r}"
    return None


SPEC = AlgorithmSpec(
    name="i-timeprest",
    summary="nF1B; F reads live, B reads lerp(live, stash, exp(-lambda*d))",
    schedule=n_forward_one_backward,
    forward=Live(),
    backward=Interpolated(),
    defaults={"backward_rule": "swap", "alpha": "exp", "lam": 1.0, "degree": "versions"},
    constraints=(_check_interpolation,),
    derivations={"interpolate": interpolate},
)
