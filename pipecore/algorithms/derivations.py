"""Derived weights: how the weights of a :class:`~pipecore.algorithms.base.WeightRead` with a derivation are
computed from the stage's weight versions.

The read rules name a derivation (``WeightRead.derivation``); this module says what each one computes, so
that the runtime only supplies the weights and the state they read (:class:`WeightSource`) and never
branches on a derivation's name:

* ``"interpolate"`` (I-TiMePReSt): ``W[version] + coef * (W[other] - W[version])``;
* ``"predict"`` (SpecTrain): ``W[version] - coef * lr * v``, with ``v`` the optimizer's next update
  direction and ``lr`` the stage's next learning rate;
* ``"correct"`` (PipeMare): ``W[version] - coef * delta``, with ``delta`` the stage's weight velocity.

Each writes into the stage's scratch buffer with the fused ops (:mod:`pipecore.ops`).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from .. import ops
from .base import WeightRead


class WeightSource(Protocol):
    """What a derivation reads from the stage that materializes the weights."""

    scratch: torch.Tensor | None  # where derived weights are written
    velocity: torch.Tensor | None  # PipeMare's weight velocity, where the algorithm keeps one

    def slot_of(self, version: int) -> torch.Tensor:
        """The flat weights of ``version``."""

    def update_direction(self, weights: torch.Tensor) -> torch.Tensor:
        """The optimizer's next update direction for ``weights`` (before the learning rate)."""

    def next_lr(self) -> float:
        """The learning rate of the stage's next update."""


def _interpolate(source: WeightSource, read: WeightRead, base: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return ops.interpolate(base, source.slot_of(read.other), read.coef, out=out)


def _predict(source: WeightSource, read: WeightRead, base: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    direction = source.update_direction(base).to(base.dtype)
    return ops.predict(base, direction, read.coef * source.next_lr(), out=out)


def _correct(source: WeightSource, read: WeightRead, base: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if source.velocity is None:
        raise ValueError(f"{read}: a corrected read needs the weight velocity, which this stage does not keep")
    return ops.predict(base, source.velocity.to(base.dtype), read.coef, out=out)


Derive = Callable[[WeightSource, WeightRead, torch.Tensor, torch.Tensor], torch.Tensor]

#: Every derivation a read rule may name, with how it is computed.
DERIVATIONS: dict[str, Derive] = {"interpolate": _interpolate, "predict": _predict, "correct": _correct}


def derive(source: WeightSource, read: WeightRead) -> torch.Tensor:
    """The weights ``read`` names, derived from ``source``'s versions into its scratch buffer."""
    rule = DERIVATIONS.get(read.derivation)  # type: ignore[arg-type]
    if rule is None:
        raise ValueError(f"unknown weight derivation {read.derivation!r}; known: {', '.join(DERIVATIONS)}")
    if source.scratch is None:
        raise ValueError(f"{read}: derived weights need the scratch buffer the simulation sizes")
    return rule(source, read, source.slot_of(read.version), source.scratch)
