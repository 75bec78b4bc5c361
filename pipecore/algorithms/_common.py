"""Option handling shared by several algorithm declarations."""

from __future__ import annotations

from .base import Options


def update_every_option(n_microbatches: int, options: Options) -> int:
    """The ``update_every`` option, defaulting to one update per mini-batch."""
    every = options.get("update_every")
    return n_microbatches if every is None else int(every)


def update_every_divides_minibatch(num_stages: int, n_microbatches: int, options: Options) -> str | None:
    every = update_every_option(n_microbatches, options)
    if every < 1 or n_microbatches % every:
        return (
            f"update_every={every} must divide n_microbatches={n_microbatches} (an update may not straddle "
            "a mini-batch, so that flush() never leaves half-accumulated gradients)"
        )
    return None


def staleness_free_nf1b(num_stages: int, n_microbatches: int, options: Options) -> str | None:
    if n_microbatches < num_stages - 1:
        return (
            f"needs n_microbatches >= num_stages - 1 (got n_microbatches={n_microbatches}, "
            f"num_stages={num_stages}): under nF1B the version difference v equals 1 only when P <= N + 1; "
            "with fewer micro-batches, several independent update chains interleave and the weights are no "
            "longer the latest ones (TiMePReSt's constraint)"
        )
    return None
