"""Learning-rate schedules: the rate of each of a stage's updates, from that stage's own update count.

A stage's ``u``-th update (``u`` from 0, counted since construction, carried by checkpoints) uses
``schedule.lr(u)``. Stages update at different times under the asynchronous algorithms, so each stage has
its own schedule object; all of them are built from the same ``lr_scheduler`` argument.

``lr_scheduler`` is either

* a function of the update index returning a multiplier of the base rate (``torch.optim.lr_scheduler.LambdaLR``
  semantics: ``lr(u) = base_lr * f(u)``), or
* a factory of a torch ``LRScheduler`` (``lambda opt: CosineAnnealingLR(opt, T_max=1000)``), given a
  one-parameter optimizer whose rate is the base rate; ``lr(u)`` is that optimizer's rate after ``u``
  ``scheduler.step()`` calls, as in plain training that steps the scheduler after every optimizer step.

Which one was given is found by calling it with that optimizer: a factory returns an ``LRScheduler``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import torch


class LrSchedule:
    """The learning rate of one stage's updates. ``lr(u)`` for non-decreasing ``u`` costs one scheduler step per
    update; going back (after loading an earlier checkpoint) rebuilds the torch scheduler."""

    def __init__(self, spec: Callable[..., Any], base_lr: float):
        if not callable(spec):
            raise TypeError(
                "lr_scheduler must be a function of the update index returning a multiplier of the learning rate "
                "(LambdaLR semantics) or a factory of a torch LRScheduler, e.g. lambda opt: "
                f"torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000); got {spec!r}"
            )
        self.spec, self.base_lr = spec, float(base_lr)
        self._scheduler, self._optimizer = self._try_factory()
        self._steps = 0  # scheduler.step() calls so far
        self.lr(0)  # a function of the index is checked here, at construction, rather than at the first update

    def _try_factory(self) -> tuple[Any, torch.optim.Optimizer | None]:
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=self.base_lr)
        try:
            made = self.spec(optimizer)
        except TypeError:
            return None, None  # a function of an integer, given an optimizer
        if isinstance(made, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError("lr_scheduler: ReduceLROnPlateau steps on a metric, not on the update count; call "
                            "pipe.set_lr() from your loop instead")
        if isinstance(made, torch.optim.lr_scheduler.LRScheduler):
            return made, optimizer
        return None, None

    @property
    def is_torch_scheduler(self) -> bool:
        return self._scheduler is not None

    def lr(self, update: int) -> float:
        """The learning rate of update ``update`` (0 = the first)."""
        if self._scheduler is None:
            factor = self.spec(update)
            try:
                value = self.base_lr * float(factor)
            except (TypeError, ValueError):
                raise TypeError(f"lr_scheduler({update}) returned {factor!r}; it must return a number (the "
                                "multiplier of the base learning rate)") from None
        else:
            if update < self._steps:
                self._scheduler, self._optimizer = self._try_factory()
                self._steps = 0
            while self._steps < update:
                with warnings.catch_warnings():
                    # The stand-in optimizer never steps; torch warns about the order otherwise.
                    warnings.simplefilter("ignore", UserWarning)
                    self._scheduler.step()
                self._steps += 1
            value = float(self._optimizer.param_groups[0]["lr"])
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"lr_scheduler gives learning rate {value} for update {update}; it must be finite and "
                             "not negative")
        return value
