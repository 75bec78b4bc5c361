"""Option handling shared by several algorithm declarations."""

from __future__ import annotations

from typing import Any, Callable

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


def sizes_allowed_by(generator: Callable[..., Any], *options: str) -> Callable[[int, int, Options], str | None]:
    """A constraint that asks ``generator`` (a schedule family) whether it takes these sizes and schedule
    ``options``: its error, without the generator's name, or None. The algorithm then refuses bad sizes when
    it is configured, not when its first schedule is built."""
    def check(num_stages: int, n_microbatches: int, values: Options) -> str | None:
        try:
            generator(num_stages, n_microbatches, 1, **{key: values[key] for key in options})
        except ValueError as exc:
            return str(exc).partition(": ")[2] or str(exc)
        return None
    return check
