"""A running average of the change each update makes to a stage's weights.

PipeMare's discrepancy correction reads ``W - tau * delta``, with ``delta`` the exponential moving average of
the weight changes: ``delta <- decay * delta + (1 - decay) * (W_new - W_old)`` after every update. The
algorithm declares it (``velocity_decay``); the stage keeps the buffer and has its optimizer add every step's
change (:meth:`~pipecore.engine.optim.StageOptimizer.step_averaging_change`). Optimizers know nothing of the
algorithm: the default adds the change after the step, and the fused SGD kernel folds it into its own pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ChangeAverage:
    """``buffer <- decay * buffer + (1 - decay) * (new - old)``, in the buffer's dtype."""

    buffer: torch.Tensor
    decay: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"the weight-change average needs 0 <= decay < 1, got {self.decay}")

    def add(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Add the change from weights ``old`` to weights ``new`` (flat, the buffer's size)."""
        dtype = self.buffer.dtype
        self.buffer.mul_(self.decay).add_(new.to(dtype) - old.to(dtype), alpha=1.0 - self.decay)
