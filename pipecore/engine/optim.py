"""Optimizers over a stage's flat weight buffer.

:class:`SGD` and :class:`AdamW` run on pipecore's fused ops: one pass reads the live weights, the flat
gradient and the optimizer state, and writes the next weight version into its ring slot. Any other torch
optimizer can be given as a factory (``functools.partial(torch.optim.RMSprop, lr=1e-3)``); it runs unfused
over parameter views of the new slot.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .. import ops
from .flat import FlatLayout


@dataclass(frozen=True)
class SGD:
    """torch.optim.SGD semantics on the fused path."""

    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def build(self, layout: FlatLayout, device: torch.device) -> "FusedSGD":
        return FusedSGD(self, layout, device)


@dataclass(frozen=True)
class AdamW:
    """torch.optim.AdamW semantics on the fused path."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    def build(self, layout: FlatLayout, device: torch.device) -> "FusedAdamW":
        return FusedAdamW(self, layout, device)


class StageOptimizer(ABC):
    """Optimizer state of one stage and the step that writes the next weight version."""

    lr: float

    @abstractmethod
    def step(self, w: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, lr_scale: float,
             velocity: torch.Tensor | None, velocity_decay: float | None) -> None:
        """Write the updated weights to ``out`` (which may be ``w``); update ``velocity`` if given."""

    def direction(self, w: torch.Tensor) -> torch.Tensor:
        """The smoothed update direction ``v`` used for weight prediction (``W - s*lr*v``)."""
        raise TypeError(
            f"weight prediction needs the optimizer's update direction; {type(self).__name__} does not provide "
            "one (use pipecore.SGD or pipecore.AdamW)"
        )

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Optimizer state (tensors are live references; the caller clones)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


def _state_tensor(layout: FlatLayout, device: torch.device) -> torch.Tensor:
    # Optimizer state is float32 (float64 for float64 weights) whatever the weight storage dtype.
    dtype = torch.float64 if layout.dtype == torch.float64 else torch.float32
    return torch.zeros(layout.buffer_numel, dtype=dtype, device=device)


class FusedSGD(StageOptimizer):
    def __init__(self, config: SGD, layout: FlatLayout, device: torch.device):
        self.config = config
        self.lr = config.lr
        self.momentum_buf = _state_tensor(layout, device) if config.momentum != 0.0 else None
        self.last_grad = _state_tensor(layout, device) if config.momentum == 0.0 else None
        self.steps = 0

    def step(self, w, grad, out, lr_scale, velocity, velocity_decay):
        c = self.config
        ops.sgd_step(
            w, grad, self.momentum_buf, lr=c.lr * lr_scale, momentum=c.momentum, dampening=c.dampening,
            weight_decay=c.weight_decay, nesterov=c.nesterov, first_step=self.steps == 0, out=out,
            delta=velocity, delta_decay=velocity_decay,
        )
        if self.last_grad is not None:
            self.last_grad.copy_(grad)
        self.steps += 1

    def direction(self, w):
        return self.momentum_buf if self.momentum_buf is not None else self.last_grad

    def state_dict(self):
        return {"steps": self.steps, "momentum_buf": self.momentum_buf, "last_grad": self.last_grad}

    def load_state_dict(self, state):
        self.steps = int(state["steps"])
        for name in ("momentum_buf", "last_grad"):
            mine, theirs = getattr(self, name), state[name]
            if (mine is None) != (theirs is None):
                raise ValueError(f"optimizer state {name!r} does not match this optimizer's configuration")
            if mine is not None:
                mine.copy_(theirs)


class FusedAdamW(StageOptimizer):
    def __init__(self, config: AdamW, layout: FlatLayout, device: torch.device):
        self.config = config
        self.lr = config.lr
        self.exp_avg = _state_tensor(layout, device)
        self.exp_avg_sq = _state_tensor(layout, device)
        self.steps = 0

    def step(self, w, grad, out, lr_scale, velocity, velocity_decay):
        c = self.config
        old = w.clone() if velocity is not None else None
        self.steps += 1
        ops.adamw_step(
            w, grad, self.exp_avg, self.exp_avg_sq, step=self.steps, lr=c.lr * lr_scale, beta1=c.betas[0],
            beta2=c.betas[1], eps=c.eps, weight_decay=c.weight_decay, out=out,
        )
        if velocity is not None:
            _update_velocity(velocity, velocity_decay, out, old)

    def direction(self, w):
        # PipeOptim's AdamW direction: the bias-corrected Adam step plus decoupled weight decay.
        c = self.config
        if self.steps == 0:
            return torch.zeros_like(self.exp_avg)
        m_hat = self.exp_avg / (1 - c.betas[0] ** self.steps)
        v_hat = self.exp_avg_sq / (1 - c.betas[1] ** self.steps)
        return m_hat / (v_hat.sqrt() + c.eps) + c.weight_decay * w.to(m_hat.dtype)

    def state_dict(self):
        return {"steps": self.steps, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_state_dict(self, state):
        self.steps = int(state["steps"])
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])


def _update_velocity(velocity: torch.Tensor, decay: float | None, new: torch.Tensor, old: torch.Tensor) -> None:
    assert decay is not None
    velocity.mul_(decay).add_(new.to(velocity.dtype) - old.to(velocity.dtype), alpha=1.0 - decay)


class TorchOptimizer(StageOptimizer):
    """Any torch optimizer, unfused, over parameter views of the slot being written."""

    def __init__(self, factory: Callable[[Sequence[torch.Tensor]], torch.optim.Optimizer], layout: FlatLayout,
                 device: torch.device):
        self.layout = layout
        self.params = [torch.zeros(s, dtype=layout.dtype, device=device, requires_grad=True) for s in layout.shapes]
        self.optimizer = factory(self.params)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer factory must return a torch.optim.Optimizer, got {type(self.optimizer).__name__}")
        self.lr = float(self.optimizer.param_groups[0].get("lr", 0.0))

    def step(self, w, grad, out, lr_scale, velocity, velocity_decay):
        old = w.clone() if velocity is not None else None
        if out.data_ptr() != w.data_ptr():
            out.copy_(w)
        for p, view, g in zip(self.params, self.layout.views(out).values(), self.layout.views(grad).values()):
            p.data = view
            p.grad = g.to(p.dtype)
        saved = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * lr_scale
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, saved):
            group["lr"] = lr
        for p in self.params:
            p.grad = None
        if velocity is not None:
            _update_velocity(velocity, velocity_decay, out, old)

    def state_dict(self):
        return {"torch": self.optimizer.state_dict()}

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state["torch"])


def build_optimizer(spec: Any, layout: FlatLayout, device: torch.device) -> StageOptimizer:
    """A stage optimizer from ``pipecore.SGD``, ``pipecore.AdamW`` or a torch optimizer factory."""
    if isinstance(spec, (SGD, AdamW)):
        return spec.build(layout, device)
    if callable(spec):
        return TorchOptimizer(spec, layout, device)
    raise TypeError(
        "optimizer must be pipecore.SGD(...), pipecore.AdamW(...) or a factory such as "
        f"functools.partial(torch.optim.RMSprop, lr=1e-3); got {spec!r}"
    )
