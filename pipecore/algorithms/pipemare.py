"""PipeMare (Yang et al., MLSys 2021): asynchronous, no stashing, delay-aware corrections.

The fine-grained asynchronous setting: an update after every micro-batch's backward (like PipeDream, but
without stashing), so stage ``s`` makes ``P-1-s`` updates between a micro-batch's forward and its backward.
Forward reads the live weights; the backward reads the live weights corrected towards the forward's,
``W - tau*delta`` (T2), where ``tau`` is the number of updates the stage made since that micro-batch's
forward and ``delta`` is an exponential average of the per-update weight change with decay
``gamma_s = D**(1/tau_s)`` (``delta_decay`` fixes it instead). The learning rate of stage ``s`` is divided by
its delay ``tau_s`` at the start and the division is annealed away over ``warmup_steps`` updates (T1):
``lr * tau_s**-(1 - min(k/K, 1))`` (``lr_warmup="power"``) or
``lr * (1/tau_s + (1 - 1/tau_s)*min(k/K, 1))`` (``"linear"``). The stage delay is
``tau_s = max(ceil((P-1-s)/update_every), 1)``. One version per stage plus the velocity buffer.

``lr_rescheduling=False`` turns T1 off and ``discrepancy_correction=False`` turns T2 off (the backward then
reads the live weights and no velocity is kept): the paper's ablations. ``update_every`` (default 1) makes
the updates coarser; with ``update_every = m >= P-1`` every delay is 1 and T1 leaves the learning rate alone.

Defaults follow the spec's proposals (the paper's exact forms were not verified): ``D = 0.1``,
``warmup_steps = 1000`` (the spec suggests five epochs of updates; ``pipecore train`` uses that).
"""

from __future__ import annotations

import math
import numbers

import torch

from .. import ops
from ..schedule import async_one_f_one_b
from ._common import update_every_divides_minibatch, update_every_option
from .base import Algorithm, AlgorithmSpec, Corrected, Live, Options, ReadContext, WeightRead
from .state import ChangeAverage, StateBuffer, WeightSource


def stage_delay(stage: int, algorithm: Algorithm) -> int:
    """Updates a stage makes between a micro-batch's F and B under async 1F1B (at least 1)."""
    return max(math.ceil((algorithm.num_stages - 1 - stage) / algorithm.update_every), 1)


def _lr_scale(stage: int, update_index: int, algorithm: Algorithm) -> float:
    if not algorithm.options["lr_rescheduling"]:
        return 1.0
    tau = stage_delay(stage, algorithm)
    warmup = algorithm.options["warmup_steps"]
    progress = 1.0 if warmup <= 0 else min(update_index / warmup, 1.0)
    if algorithm.options["lr_warmup"] == "linear":
        return 1.0 / tau + (1.0 - 1.0 / tau) * progress
    return tau ** -(1.0 - progress)


def velocity_decay(stage: int, algorithm: Algorithm) -> float | None:
    """The decay ``gamma_s`` of stage ``stage``'s velocity, or None where no correction reads it (T2 off)."""
    if not algorithm.options["discrepancy_correction"]:
        return None  # no correction reads the velocity: keep none
    fixed = algorithm.options["delta_decay"]
    if fixed is not None:
        return float(fixed)
    return algorithm.options["D"] ** (1.0 / stage_delay(stage, algorithm))


def _velocity(stage: int, algorithm: Algorithm) -> ChangeAverage | None:
    decay = velocity_decay(stage, algorithm)
    return None if decay is None else ChangeAverage(decay)


#: T2's weight velocity ``delta``: the running average of the updates' weight changes.
VELOCITY = StateBuffer("velocity", "weight velocity", _velocity, saved_as=("velocity",))


def correct(source: WeightSource, read: WeightRead, base: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """T2's read: ``W[version] - coef * delta`` (coef = tau, the updates since the micro-batch's forward)."""
    velocity = source.buffer(VELOCITY.name)
    return ops.predict(base, velocity.to(base.dtype), read.coef, out=out)


def _check_options(num_stages: int, n_microbatches: int, options) -> str | None:
    if options["lr_warmup"] not in ("power", "linear"):
        return f"lr_warmup must be 'power' or 'linear', got {options['lr_warmup']!r}"
    if not 0.0 <= options["D"] < 1.0:
        return f"D must be in [0, 1), got {options['D']}"
    decay = options["delta_decay"]
    if decay is not None and (not isinstance(decay, numbers.Real) or isinstance(decay, bool)):
        return f"delta_decay must be a number in [0, 1), got {decay!r}"
    if decay is not None and not 0.0 <= decay < 1.0:
        return f"delta_decay must be in [0, 1), got {decay}"
    return None


class _OptionalCorrection(Corrected):
    """T2 when ``discrepancy_correction`` is on; the live weights otherwise."""

    def resolve(self, ctx: ReadContext, options: Options) -> WeightRead:
        if not options["discrepancy_correction"]:
            return WeightRead(ctx.live)
        return super().resolve(ctx, options)


SPEC = AlgorithmSpec(
    name="pipemare",
    summary="async 1F1B, no stash; B reads live - tau*delta; per-stage LR warm-up; 1 version + delta",
    schedule=async_one_f_one_b,
    forward=Live(),
    backward=_OptionalCorrection(),
    update_every=update_every_option,
    defaults={
        "update_every": 1,
        "backward_rule": "swap",
        "warmup_steps": 1000,
        "lr_warmup": "power",
        "D": 0.1,
        "delta_decay": None,
        "lr_rescheduling": True,
        "discrepancy_correction": True,
    },
    constraints=(update_every_divides_minibatch, _check_options),
    lr_scale=_lr_scale,
    buffers=(VELOCITY,),
    derivations={"correct": correct},
)
