"""PipeDream-2BW (Narayanan et al., ICML 2021): double-buffered weights, 1F1B without flushes.

Micro-batch ``k`` reads version ``max(k//m - 1, 0)`` in both F and B; one update per mini-batch
(``theta(t+1) = theta(t) - lr*grad(theta(t-1))``). Needs ``m >= P``; two versions per stage.
"""

from ..schedule import async_one_f_one_b
from .base import AlgorithmSpec, MinibatchDelay, SameAsForward


def _needs_m_at_least_p(num_stages: int, n_microbatches: int, options) -> str | None:
    if n_microbatches < num_stages:
        return (
            f"needs n_microbatches >= num_stages (got {n_microbatches} < {num_stages}): with fewer micro-batches "
            "per update, a third weight version would still be in flight when the next one is produced"
        )
    return None


SPEC = AlgorithmSpec(
    name="2bw",
    aliases=("pipedream-2bw",),
    summary="async 1F1B, update every m, micro-batch k reads max(k//m-1,0); 2 versions",
    schedule=async_one_f_one_b,
    forward=MinibatchDelay(1),
    backward=SameAsForward(),
    constraints=(_needs_m_at_least_p,),
)
