"""The last stage's losses: each micro-batch's loss computed, read from the device an update group at a time, and
checked to be finite."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from .describe import describe
from .inputs import LossTarget


class NonFiniteLoss(FloatingPointError):
    """A micro-batch's loss was NaN or infinite."""


class MicrobatchLosses:
    """The losses of the micro-batches of a last stage.

    Args:
        loss_fn: ``loss_fn(output, target)``, the mean loss of a micro-batch (a scalar).
        on_nonfinite: ``"raise"`` (:class:`NonFiniteLoss`) or ``"skip"`` (``skip(group)`` is called for the update
            group of a non-finite loss, whose update is then skipped).
        stage, n_microbatches, update_every: the stage's index and the algorithm's sizes (for messages and groups).
        skip: marks an update group to be skipped.
    """

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor] | None, on_nonfinite: str, stage: int,
                 n_microbatches: int, update_every: int, skip: Callable[[int], None]):
        self.loss_fn = loss_fn
        self.on_nonfinite = on_nonfinite
        self.stage, self.n_microbatches, self.update_every = stage, n_microbatches, update_every
        self.skip = skip
        #: Each micro-batch's loss, read from the device (the pipeline takes a mini-batch's out when it is complete).
        self.values: dict[int, float] = {}
        self.unread: dict[int, torch.Tensor] = {}  # losses not read from the device yet

    def compute(self, k: int, y: Any, target: LossTarget) -> torch.Tensor:
        """Micro-batch ``k``'s loss divided by ``target.divisor`` (the micro-batches per update, weighted by the
        micro-batch's size when a mini-batch's micro-batches differ in size; see :func:`.inputs.loss_divisor`),
        so that accumulated gradients are a mean, like plain training; records the undivided value and handles
        non-finite losses."""
        assert self.loss_fn is not None
        try:
            loss = self.loss_fn(y, target.value)
        except Exception as exc:
            # The loss function's own error, as itself (its type is what the caller may catch), with what it got.
            exc.add_note(f"raised by loss_fn, given the last stage's output {describe(y)} and the target "
                         f"{describe(target.value)}")
            raise
        if loss.dim() != 0:
            raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)} (use reduction='mean')")
        self.unread[k] = loss.detach()
        if (k + 1) % self.update_every == 0 or (k + 1) % self.n_microbatches == 0:
            self.read()
        return loss / target.divisor

    def read(self) -> None:
        """Read the losses of an update group (or of a mini-batch's end) in one go: on a GPU, one wait for
        the device per group instead of one per micro-batch. A non-finite one raises, or marks its group's
        update to be skipped; the group's update comes after its last loss is read, here."""
        pending, self.unread = self.unread, {}
        values = torch.stack(list(pending.values())).tolist()
        for k, value in zip(pending, values):
            self.values[k] = value
            if math.isfinite(value):
                continue
            if self.on_nonfinite == "raise":
                m = self.n_microbatches
                raise NonFiniteLoss(
                    f"non-finite loss {value} at stage {self.stage}, micro-batch {k} (micro-batch {k % m} of "
                    f"mini-batch {k // m} since the last flush); pass on_nonfinite='skip' to skip such updates"
                )
            self.skip(k // self.update_every)

    def forget(self, first: int) -> None:
        """Forget the losses of micro-batch ``first`` and later (undone)."""
        for table in (self.values, self.unread):
            for k in [k for k in table if k >= first]:
                del table[k]
