"""PipeDream-2BW (Narayanan et al., ICML 2021): double-buffered weights, 1F1B without flushes.

Micro-batch ``k`` reads version ``max(k//m - 1, 0)`` in both F and B; one update per mini-batch
(``theta(t+1) = theta(t) - lr*grad(theta(t-1))``). Two versions per stage.

Option ``slack`` (default 0): extra warm-up forwards per downstream stage (see ``async_one_f_one_b``).
Reads are fixed by the micro-batch index, so slack changes neither the weights nor the losses, only when
messages are needed (it hides their latency) and how many activations a stage holds. Needs
``m >= (P-1)*(1+slack) + 1`` (``m >= P`` without slack).
"""

from ..schedule import async_one_f_one_b
from .base import AlgorithmSpec, MinibatchDelay, SameAsForward


def _needs_m_at_least_p(num_stages: int, n_microbatches: int, options) -> str | None:
    slack = options.get("slack", 0)
    if slack == 0 and n_microbatches < num_stages:
        return (
            f"needs n_microbatches >= num_stages (got {n_microbatches} < {num_stages}): with fewer micro-batches "
            "per update, a third weight version would still be in flight when the next one is produced"
        )
    warmup = (num_stages - 1) * (1 + slack)
    if n_microbatches < warmup + 1:
        return (
            f"with slack={slack} needs n_microbatches >= (num_stages-1)*(1+slack)+1 = {warmup + 1} (got "
            f"{n_microbatches}): stage 0 would run a forward of a mini-batch whose weight version is not "
            "produced yet; use more micro-batches or less slack"
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
    defaults={"slack": 0},
    schedule_options=("slack",),
)
