"""Optimizers over a stage's flat weight buffer.

:class:`SGD`, :class:`AdamW` and :class:`NAdam` run on pipecore's fused ops: one pass reads the live weights, the flat
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
from ..algorithms.state import add_change
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


@dataclass(frozen=True)
class NAdam:
    """torch.optim.NAdam semantics on the fused path (``maximize=False``): Adam with Nesterov momentum whose
    coefficient ``mu_t = beta1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))`` warms up over the steps; weight decay is
    added to the gradient (L2), or with ``decoupled_weight_decay=True`` applied to the weights as AdamW does.

    The stage keeps the running product of the ``mu_t`` in float64; torch keeps it in its default dtype (float32
    unless ``torch.set_default_dtype(torch.float64)``), so float64 weights agree with torch to round-off when
    torch's default dtype is float64."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum_decay: float = 4e-3
    decoupled_weight_decay: bool = False

    def __post_init__(self) -> None:
        # Refused here, where the pipeline is built, rather than at the first update.
        def number(name: str, value: Any, high: float | None = None) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    0 <= value and (high is None or value < high) and value != float("inf")):
                allowed = f"0 <= {name} < {high:g}" if high is not None else "a finite number >= 0"
                raise ValueError(f"pipecore.NAdam: invalid {name}={value!r}; expected {allowed}")

        number("lr", self.lr)
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2):
            raise ValueError(f"pipecore.NAdam: betas must be a pair (beta1, beta2), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(self.betas))  # a list as torch takes it; a tuple keeps it hashable
        number("betas[0]", self.betas[0], 1.0)
        number("betas[1]", self.betas[1], 1.0)
        number("eps", self.eps)
        number("weight_decay", self.weight_decay)
        number("momentum_decay", self.momentum_decay)
        if not isinstance(self.decoupled_weight_decay, bool):
            raise ValueError("pipecore.NAdam: decoupled_weight_decay must be True or False, got "
                             f"{self.decoupled_weight_decay!r}")

    def build(self, layout: FlatLayout, device: torch.device) -> "FusedNAdam":
        return FusedNAdam(self, layout, device)


@dataclass(frozen=True)
class MomentumForm:
    """How an optimizer's step takes momentum, for algorithms whose gradient transform rewrites the gradient it steps
    with (a Nesterov look-ahead for delayed gradients, say; see :class:`pipecore.algorithms.state.GradientTransform`).

    ``kind`` is one of:

    - ``"none"``: no momentum, ``W <- W - lr*g``;
    - ``"heavy-ball"``: ``b <- momentum*b + g``, ``W <- W - lr*b`` (``torch.optim.SGD``, ``b = g`` at the first step);
    - ``"nesterov"``: ``b <- momentum*b + g``, ``W <- W - lr*(g + momentum*b)`` (``torch.optim.SGD(nesterov=True)``);
    - ``"nesterov-ema"``: Nesterov's look-ahead with the gradient already weighed by ``1 - mu_t`` and the moving
      average of the gradients by ``mu_{t+1}`` (``torch.optim.NAdam``; its ``mu_t`` change every step).

    ``momentum`` is the coefficient of the first three (0 for ``"none"``), None for ``"nesterov-ema"``. The weight
    decay the optimizer couples into the gradient (``g + weight_decay*W``) is added after an algorithm's rewrite.
    """

    kind: str
    momentum: float | None = None

    KINDS = ("none", "heavy-ball", "nesterov", "nesterov-ema")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"momentum form {self.kind!r}: one of {self.KINDS}")


class StageOptimizer(ABC):
    """Optimizer state of one stage and the step that writes the next weight version."""

    lr: float

    def set_lr(self, lr: float) -> None:
        """Use learning rate ``lr`` from the next step on."""
        self.lr = lr

    @abstractmethod
    def step(self, w: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, lr_scales: "LrScales") -> None:
        """Write the updated weights to ``out`` (which may be ``w``).

        ``lr_scales`` are ``(start, stop, scale)`` ranges covering the flat buffer in order: the learning
        rate of each range is multiplied by its scale (one range unless tied weights take a shared scale)."""

    def step_averaging_change(self, w: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, lr_scales: "LrScales",
                              average: torch.Tensor, decay: float) -> None:
        """:meth:`step`, and add the change it makes to the weights to the running ``average`` (``average <- decay *
        average + (1 - decay) * (new - old)``, :class:`~pipecore.algorithms.state.ChangeAverage`). The old weights
        are copied only when the step overwrites them (``out`` is ``w``); an optimizer whose pass can fold the
        average in overrides this."""
        old = w.clone() if out.data_ptr() == w.data_ptr() else w
        self.step(w, grad, out, lr_scales)
        add_change(average, decay, old, out)

    def check_next_step_direction(self) -> None:
        """Refuse, at construction, to estimate :meth:`next_step_direction` if this optimizer cannot."""
        raise TypeError(
            f"weight prediction needs the optimizer's update direction; {type(self).__name__} does not provide "
            "one (use pipecore.SGD, pipecore.AdamW or pipecore.NAdam)"
        )

    def next_step_direction(self, grad: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """Write into ``out`` the direction ``v`` of the next update per unit of learning rate, estimated after a
        step that applied ``grad`` and produced weights ``w``: the step the next update would take if its
        gradient equalled this one (weight prediction reads ``W - s*lr*v``). Only optimizers that pass
        :meth:`check_next_step_direction` override it."""
        raise TypeError(f"{type(self).__name__} provides no update direction")

    def momentum_form(self) -> MomentumForm:
        """How this optimizer's step takes momentum (:class:`MomentumForm`); a ``TypeError`` for an optimizer whose
        step has none of those forms."""
        raise TypeError(f"{type(self).__name__} does not take its momentum in a form pipecore knows (plain, "
                        "heavy-ball or Nesterov SGD, NAdam)")

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Optimizer state (tensors are live references; the caller clones)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; a state it refuses changes nothing (see :meth:`check_state`)."""

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise, writing nothing, if :meth:`load_state_dict` would refuse ``state`` (a pipeline checks every
        stage's state before it loads any)."""


def _require(state: dict[str, Any], keys: Sequence[str], name: str) -> None:
    missing = [k for k in keys if k not in state]
    if missing:
        raise KeyError(f"{name} optimizer state has no {', '.join(map(repr, missing))}: it was saved with another "
                       "optimizer")


def _same_shape(name: str, key: str, value: Any, like: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(like.shape):
        got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
        raise ValueError(f"{name} optimizer state {key!r} has {got}, this stage's {tuple(like.shape)}")


#: ``(start, stop, scale)`` ranges of a flat buffer, in order, covering it.
LrScales = Sequence[tuple[int, int, float]]


def uniform_scale(numel: int, scale: float) -> list[tuple[int, int, float]]:
    """One range over a whole buffer of ``numel`` elements."""
    return [(0, numel, scale)]


def _part(t: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    return None if t is None else t[start:stop]


def _state_tensor(layout: FlatLayout, device: torch.device) -> torch.Tensor:
    # Optimizer state is float32 (float64 for float64 weights) whatever the weight storage dtype.
    dtype = torch.float64 if layout.dtype == torch.float64 else torch.float32
    return torch.zeros(layout.buffer_numel, dtype=dtype, device=device)


class FusedSGD(StageOptimizer):
    def __init__(self, config: SGD, layout: FlatLayout, device: torch.device):
        self.config = config
        self.lr = config.lr
        self.momentum_buf = _state_tensor(layout, device) if config.momentum != 0.0 else None
        self.steps = 0

    def step(self, w, grad, out, lr_scales):
        self._step(w, grad, out, lr_scales, None, None)

    def step_averaging_change(self, w, grad, out, lr_scales, average, decay):
        self._step(w, grad, out, lr_scales, average, decay)  # the kernel adds the change in its own pass

    def _step(self, w: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, lr_scales: "LrScales",
              average: torch.Tensor | None, decay: float | None) -> None:
        c = self.config
        for start, stop, scale in lr_scales:
            ops.sgd_step(
                w[start:stop], grad[start:stop], _part(self.momentum_buf, start, stop), lr=self.lr * scale,
                momentum=c.momentum, dampening=c.dampening, weight_decay=c.weight_decay, nesterov=c.nesterov,
                first_step=self.steps == 0, out=out[start:stop], delta=_part(average, start, stop),
                delta_decay=decay,
            )
        self.steps += 1

    def check_next_step_direction(self) -> None:
        pass  # from the gradient and the momentum buffer

    def next_step_direction(self, grad: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """The step the next update would take if its gradient equalled this one: with
        ``g = grad + weight_decay*w`` (``w`` the new weights) and ``buf' = momentum*buf + (1-dampening)*g``,
        that is ``buf'`` (``g + momentum*buf'`` with Nesterov; ``g`` without momentum). Without dampening
        and weight decay it is the official SpecTrain code's ``momentum*buf + grad``: one pass, after the step,
        while the gradient is still there."""
        c, target = self.config, out
        g = grad if c.weight_decay == 0.0 else grad + c.weight_decay * w
        if self.momentum_buf is None:
            target.copy_(g)
        elif c.dampening == 0.0 and not c.nesterov:
            torch.add(g, self.momentum_buf, alpha=c.momentum, out=target)
        else:
            buf = self.momentum_buf * c.momentum + (1.0 - c.dampening) * g
            if c.nesterov:
                torch.add(g, buf, alpha=c.momentum, out=target)
            else:
                target.copy_(buf)

    def momentum_form(self) -> MomentumForm:
        c = self.config
        if c.momentum == 0.0:
            return MomentumForm("none", 0.0)
        if c.dampening != 0.0:
            raise TypeError(f"pipecore.SGD(momentum={c.momentum}, dampening={c.dampening}): a dampened momentum "
                            "buffer starts undampened (b = g at the first step), so its step has no fixed form; "
                            "use dampening=0")
        return MomentumForm("nesterov" if c.nesterov else "heavy-ball", c.momentum)

    def state_dict(self):
        return {"steps": self.steps, "momentum_buf": self.momentum_buf}

    def check_state(self, state):
        _require(state, ("steps", "momentum_buf"), "SGD")
        mine, theirs = self.momentum_buf, state["momentum_buf"]
        if (mine is None) != (theirs is None):
            raise ValueError("optimizer state 'momentum_buf' does not match this optimizer's configuration")
        if mine is not None:
            _same_shape("SGD", "momentum_buf", theirs, mine)

    def load_state_dict(self, state):
        self.check_state(state)
        self.steps = int(state["steps"])
        if self.momentum_buf is not None:
            self.momentum_buf.copy_(state["momentum_buf"])


class FusedAdamW(StageOptimizer):
    def __init__(self, config: AdamW, layout: FlatLayout, device: torch.device):
        self.config = config
        self.lr = config.lr
        self.exp_avg = _state_tensor(layout, device)
        self.exp_avg_sq = _state_tensor(layout, device)
        self.steps = 0

    def step(self, w, grad, out, lr_scales):
        c = self.config
        self.steps += 1
        for start, stop, scale in lr_scales:
            ops.adamw_step(
                w[start:stop], grad[start:stop], self.exp_avg[start:stop], self.exp_avg_sq[start:stop],
                step=self.steps, lr=self.lr * scale, beta1=c.betas[0], beta2=c.betas[1], eps=c.eps,
                weight_decay=c.weight_decay, out=out[start:stop],
            )

    def check_next_step_direction(self) -> None:
        pass  # the moments are all the direction needs

    def next_step_direction(self, grad: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """PipeOptim's AdamW direction: the bias-corrected Adam step of the moments now, plus decoupled weight
        decay of the new weights ``w`` (the moments already hold ``grad``)."""
        c = self.config
        if self.steps == 0:
            out.zero_()
            return
        m_hat = self.exp_avg / (1 - c.betas[0] ** self.steps)
        v_hat = self.exp_avg_sq / (1 - c.betas[1] ** self.steps)
        out.copy_(m_hat / (v_hat.sqrt() + c.eps) + c.weight_decay * w.to(m_hat.dtype))

    def momentum_form(self) -> MomentumForm:
        raise TypeError("pipecore.AdamW's first moment is a moving average of the gradients that it steps along, with "
                        "no look-ahead (Adam with Nesterov's look-ahead is NAdam)")

    def state_dict(self):
        return {"steps": self.steps, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def check_state(self, state):
        _require(state, ("steps", "exp_avg", "exp_avg_sq"), "AdamW")
        for key in ("exp_avg", "exp_avg_sq"):
            _same_shape("AdamW", key, state[key], self.exp_avg)

    def load_state_dict(self, state):
        self.check_state(state)
        self.steps = int(state["steps"])
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])


class FusedNAdam(StageOptimizer):
    """:class:`NAdam`'s state over a stage's flat buffer: the moments (state dtype), the step count and the running
    product of the momentum coefficients, which advances once per update."""

    def __init__(self, config: NAdam, layout: FlatLayout, device: torch.device):
        self.config = config
        self.lr = config.lr
        self.exp_avg = _state_tensor(layout, device)
        self.exp_avg_sq = _state_tensor(layout, device)
        self.steps = 0
        #: ``mu_1 * ... * mu_steps`` (torch's ``state["mu_product"]``), a float64 Python float.
        self.mu_product = 1.0

    def step(self, w, grad, out, lr_scales):
        c = self.config
        step = self.steps + 1
        # One product per update, whatever the learning-rate ranges: the mu's do not depend on the rate.
        mu_product = self.mu_product * ops.nadam_mu(step, c.betas[0], c.momentum_decay)
        for start, stop, scale in lr_scales:
            ops.nadam_step(
                w[start:stop], grad[start:stop], self.exp_avg[start:stop], self.exp_avg_sq[start:stop],
                step=step, mu_product=mu_product, lr=self.lr * scale, beta1=c.betas[0], beta2=c.betas[1], eps=c.eps,
                weight_decay=c.weight_decay, momentum_decay=c.momentum_decay,
                decoupled_weight_decay=c.decoupled_weight_decay, out=out[start:stop],
            )
        self.steps, self.mu_product = step, mu_product

    def check_next_step_direction(self) -> None:
        pass  # the moments and the gradient are all the direction needs

    def next_step_direction(self, grad: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """As AdamW's, from the moments now (they already hold ``grad``): NAdam's step per unit of learning rate
        with this step's coefficients, ``((1 - mu_t)/(1 - mu_product) * g + mu_{t+1}/(1 - mu_product*mu_{t+1}) *
        exp_avg) / (sqrt(exp_avg_sq / (1 - beta2**t)) + eps)`` with ``g = grad`` (plus ``weight_decay * w`` for L2
        weight decay), plus ``weight_decay * w`` for decoupled weight decay; ``w`` are the new weights."""
        c = self.config
        if self.steps == 0:
            out.zero_()
            return
        (beta1, beta2), t = c.betas, self.steps
        md = self.exp_avg.dtype
        mu, mu_next = ops.nadam_mu(t, beta1, c.momentum_decay), ops.nadam_mu(t + 1, beta1, c.momentum_decay)
        g = grad.to(md)
        decay = c.weight_decay * w.to(md) if c.weight_decay != 0.0 else None
        if decay is not None and not c.decoupled_weight_decay:
            g = g + decay
        denom = (self.exp_avg_sq / (1 - beta2**t)).sqrt() + c.eps
        direction = ((1 - mu) / (1 - self.mu_product) * g
                     + mu_next / (1 - self.mu_product * mu_next) * self.exp_avg) / denom
        if decay is not None and c.decoupled_weight_decay:
            direction = direction + decay
        out.copy_(direction)

    def momentum_form(self) -> MomentumForm:
        return MomentumForm("nesterov-ema")  # torch.optim.NAdam's look-ahead, as the fused step takes it

    def state_dict(self):
        return {"steps": self.steps, "mu_product": self.mu_product, "exp_avg": self.exp_avg,
                "exp_avg_sq": self.exp_avg_sq}

    def check_state(self, state):
        _require(state, ("steps", "mu_product", "exp_avg", "exp_avg_sq"), "NAdam")
        mu_product = float(state["mu_product"])  # a tensor too, as torch keeps it
        if not 0.0 <= mu_product <= 1.0:
            raise ValueError(f"NAdam optimizer state 'mu_product' is {mu_product}; expected a product of momentum "
                             "coefficients in [0, 1]")
        for key in ("exp_avg", "exp_avg_sq"):
            _same_shape("NAdam", key, state[key], self.exp_avg)

    def load_state_dict(self, state):
        self.check_state(state)
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.steps, self.mu_product = int(state["steps"]), float(state["mu_product"])


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

    def set_lr(self, lr: float) -> None:
        self.lr = lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, w, grad, out, lr_scales):
        scales = {scale for _, _, scale in lr_scales}
        if len(scales) != 1:
            raise ValueError(
                "this update needs a different learning rate for some weights (tied weights under a per-stage "
                "learning-rate scale, such as PipeMare's T1); a torch optimizer steps every parameter at one "
                "rate: use pipecore.SGD, pipecore.AdamW or pipecore.NAdam, or turn the scaling off "
                "(lr_rescheduling=False)"
            )
        (lr_scale,) = scales
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

    def momentum_form(self) -> MomentumForm:
        """``torch.optim.SGD`` (plain, heavy-ball or Nesterov, undampened) and ``torch.optim.NAdam``, with one value
        of each setting across the parameter groups."""
        opt, name = self.optimizer, type(self.optimizer).__name__
        if type(opt) is torch.optim.NAdam:
            return MomentumForm("nesterov-ema")
        if type(opt) is torch.optim.SGD:
            settings = {(g.get("momentum", 0.0), g.get("dampening", 0.0), g.get("nesterov", False))
                        for g in opt.param_groups}
            if len(settings) == 1:
                (momentum, dampening, nesterov), = settings
                if momentum == 0.0:
                    return MomentumForm("none", 0.0)
                if dampening == 0.0:
                    return MomentumForm("nesterov" if nesterov else "heavy-ball", float(momentum))
            raise TypeError(f"torch.optim.SGD with momentum, dampening and nesterov {sorted(settings)} (per parameter "
                            "group): its step has no one form; use one undampened setting for every group")
        raise TypeError(f"torch.optim.{name} does not take its momentum in a form pipecore knows (plain, heavy-ball or "
                        "Nesterov SGD, NAdam)")

    def state_dict(self):
        return {"torch": self.optimizer.state_dict()}

    def check_state(self, state):
        _require(state, ("torch",), f"torch.optim.{type(self.optimizer).__name__}")
        groups = state["torch"].get("param_groups", [])
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.optimizer.param_groups]:
            raise ValueError(f"torch.optim.{type(self.optimizer).__name__} state has parameter groups of sizes "
                             f"{[len(g['params']) for g in groups]}, this stage's optimizer "
                             f"{[len(g['params']) for g in self.optimizer.param_groups]}")

    def load_state_dict(self, state):
        self.check_state(state)
        self.optimizer.load_state_dict(state["torch"])


_ALLOWED = ("pipecore.SGD(...), pipecore.AdamW(...), pipecore.NAdam(...) or a factory such as "
            "lambda params: torch.optim.SGD(params, lr=0.1)")
#: The fused optimizers' configurations.
FUSED = (SGD, AdamW, NAdam)


def check_optimizer(spec: Any) -> None:
    """Refuse, in one line, an ``optimizer`` argument that is none of ``pipecore.SGD``, ``pipecore.AdamW``,
    ``pipecore.NAdam`` or a callable (a torch optimizer factory). A torch optimizer instance is the common mistake:
    it holds the whole model's parameters, while each stage updates its own flat buffer, so the pipeline needs the
    recipe, not the instance."""
    if isinstance(spec, FUSED):
        return
    if isinstance(spec, torch.optim.Optimizer):
        raise TypeError(f"optimizer is a torch.optim.{type(spec).__name__} instance; each stage builds its own "
                        f"optimizer over its weights: pass {_ALLOWED}")
    if not callable(spec):
        # The type, not the repr: an object's repr may run over many lines.
        raise TypeError(f"optimizer must be {_ALLOWED}; got a {type(spec).__name__}")


def build_optimizer(spec: Any, layout: FlatLayout, device: torch.device) -> StageOptimizer:
    """A stage optimizer from ``pipecore.SGD``, ``pipecore.AdamW``, ``pipecore.NAdam`` or a torch optimizer
    factory."""
    check_optimizer(spec)
    if isinstance(spec, FUSED):
        return spec.build(layout, device)
    return TorchOptimizer(spec, layout, device)
