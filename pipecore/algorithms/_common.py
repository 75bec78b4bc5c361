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
