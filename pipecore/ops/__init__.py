"""Fused element-wise ops over flat weight buffers, dispatched by device.

=====================  =============================================================
CUDA tensors           Triton kernels (``pipecore.kernels``)
CPU tensors            C++ kernels (``pipecore._C``: vectorized, ``at::parallel_for``)
any other device       plain torch (:mod:`pipecore.ops.reference`)
=====================  =============================================================

Every op takes contiguous tensors of one shape (normally the 1-D flat buffer of a pipeline stage or
one slot of a :class:`pipecore.ring.WeightRing`) and writes its result to ``out``.

Dtypes. Weights, gradients and outputs share one storage dtype: float64, float32, bfloat16 or
float16. Math runs in float32, or in float64 for float64 weights, and each result is rounded once
to the storage dtype. Optimizer state (``momentum_buf``, ``delta``, ``exp_avg``, ``exp_avg_sq``) is
kept in that math dtype, i.e. float32 even for bfloat16/float16 weights.

Aliasing. ``out`` may be exactly one of the weight inputs (same memory), e.g. ``out=w`` for an
in-place update; any other overlap between a tensor the op writes and another argument is a
``ValueError``. Arguments are checked before anything is written: a rejected call changes nothing.

Autograd. The ops run outside autograd; the version counter of every written tensor is bumped, as
an in-place torch op would, so autograd still detects use of a tensor that was overwritten.
"""

from __future__ import annotations

import numbers
from types import ModuleType

import torch

from . import _checks, reference

__all__ = ["adamw_step", "backend_for", "interpolate", "predict", "reference", "sgd_step", "state_dtype"]

state_dtype = _checks.state_dtype


def backend_for(t: torch.Tensor) -> str:
    """Which implementation handles tensors on ``t``'s device: ``"triton"``, ``"cpp"`` or ``"reference"``."""
    if t.device.type == "cuda":
        return "triton"
    if t.device.type == "cpu":
        return "cpp"
    return "reference"


def _cpp() -> ModuleType:
    try:
        from pipecore import _C
    except ImportError as exc:  # pragma: no cover - only on a broken build
        raise ImportError(
            "pipecore._C (the C++ extension) is not built; reinstall with "
            "`pip install --no-build-isolation -e .`"
        ) from exc
    return _C


def _triton() -> ModuleType:
    # Imported on first CUDA use: importing Triton costs time and CPU-only users never need it.
    import pipecore.kernels as kernels

    return kernels


def _bump(*tensors: torch.Tensor | None) -> None:
    written = [t for t in tensors if t is not None and not t.is_inference()]
    if written:
        torch.autograd.graph.increment_version(written)


def interpolate(live: torch.Tensor, stale: torch.Tensor, alpha: float, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Staleness-aware interpolation (I-TiMePReSt): ``out = live + alpha * (stale - live)``.

    Args:
        live: the live weights.
        stale: the stashed (older) weights.
        alpha: interpolation weight; 0 gives ``live``, 1 gives ``stale``.
        out: where to write; a new tensor when ``None``. May be ``live`` or ``stale`` itself.

    Returns:
        ``out``.
    """
    alpha = _checks.real("interpolate", "alpha", alpha)
    if out is None:
        _checks.check("interpolate", [("live", live), ("stale", stale)])
        out = torch.empty_like(live)
    _checks.check("interpolate", [("live", live), ("stale", stale), ("out", out)], written=["out"],
                  out_may_alias=["live", "stale"])
    backend = backend_for(live)
    if backend == "reference":
        return reference.interpolate(live, stale, alpha, out=out)
    (_triton() if backend == "triton" else _cpp()).interpolate(out, live, stale, alpha)
    _bump(out)
    return out


def predict(w: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Weight prediction: ``out = w - scale * v``.

    SpecTrain/PipeOptim predict future weights with ``v`` the momentum buffer and ``scale = s * lr``;
    PipeMare's discrepancy correction is ``predict(w, delta, tau)``.

    Args:
        w: the weights.
        v: the direction (momentum buffer, velocity, ...), same dtype as ``w``.
        scale: step length.
        out: where to write; a new tensor when ``None``. May be ``w`` or ``v`` itself.

    Returns:
        ``out``.
    """
    scale = _checks.real("predict", "scale", scale)
    if out is None:
        _checks.check("predict", [("w", w), ("v", v)])
        out = torch.empty_like(w)
    _checks.check("predict", [("w", w), ("v", v), ("out", out)], written=["out"], out_may_alias=["w", "v"])
    backend = backend_for(w)
    if backend == "reference":
        return reference.predict(w, v, scale, out=out)
    (_triton() if backend == "triton" else _cpp()).predict(out, w, v, scale)
    _bump(out)
    return out


def _sgd_args(w, grad, momentum_buf, lr, momentum, dampening, weight_decay, nesterov, out, delta, delta_decay):
    op = "sgd_step"
    lr = _checks.real(op, "lr", lr)
    momentum = _checks.real(op, "momentum", momentum)
    dampening = _checks.real(op, "dampening", dampening)
    weight_decay = _checks.real(op, "weight_decay", weight_decay)
    if lr < 0.0:
        raise ValueError(f"{op}: invalid learning rate lr={lr}")
    if momentum < 0.0:
        raise ValueError(f"{op}: invalid momentum={momentum}")
    if weight_decay < 0.0:
        raise ValueError(f"{op}: invalid weight_decay={weight_decay}")
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError(f"{op}: nesterov momentum requires momentum > 0 and dampening == 0 "
                         f"(got momentum={momentum}, dampening={dampening})")
    if momentum != 0.0 and momentum_buf is None:
        raise ValueError(f"{op}: argument 'momentum_buf' is required when momentum != 0 (momentum={momentum})")
    if delta is not None:
        if delta_decay is None:
            raise ValueError(f"{op}: argument 'delta_decay' is required when 'delta' is given")
        delta_decay = _checks.real(op, "delta_decay", delta_decay)
    else:
        delta_decay = 0.0
    if out is None:
        out = w
    states = []
    if momentum != 0.0:
        states.append(("momentum_buf", momentum_buf))
    if delta is not None:
        states.append(("delta", delta))
    _checks.check(op, [("w", w), ("grad", grad), ("out", out)], states,
                  written=["out", *(n for n, _ in states)], out_may_alias=["w"])
    return out, lr, momentum, dampening, weight_decay, delta_decay


def sgd_step(w: torch.Tensor, grad: torch.Tensor, momentum_buf: torch.Tensor | None, *, lr: float,
             momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
             first_step: bool = False, out: torch.Tensor | None = None, delta: torch.Tensor | None = None,
             delta_decay: float | None = None) -> torch.Tensor:
    """One ``torch.optim.SGD`` step (``maximize=False``) that reads ``w`` and writes the new weights to ``out``.

    Per element, with ``g = grad + weight_decay * w``::

        buf   = g                                      if first_step
              = momentum * buf + (1 - dampening) * g   otherwise
        d     = g + momentum * buf  if nesterov else buf      (d = g when momentum == 0)
        out   = w - lr * d
        delta = delta_decay * delta + (1 - delta_decay) * (out - w)    (only when delta is given)

    ``first_step=True`` marks the first update of this buffer: like torch, the momentum buffer is then
    set to ``g`` (its old contents are ignored; dampening is not applied). Pass it on the first step
    and ``False`` afterwards. ``delta`` is PipeMare's weight velocity; ``out - w`` uses the new weights
    as stored (rounded to the weight dtype).

    Args:
        w: current (live) weights.
        grad: gradient, same dtype as ``w``.
        momentum_buf: momentum buffer (state dtype, see module docs), updated in place; may be
            ``None`` when ``momentum == 0``.
        lr, momentum, dampening, weight_decay, nesterov: as in ``torch.optim.SGD``.
        first_step: initialise the momentum buffer from the gradient.
        out: where the new weights go, e.g. the next ring slot; defaults to ``w`` (in place).
        delta: optional PipeMare velocity buffer (state dtype), updated in place.
        delta_decay: decay of ``delta``; required when ``delta`` is given.

    Returns:
        ``out``.
    """
    out, lr, momentum, dampening, weight_decay, delta_decay = _sgd_args(
        w, grad, momentum_buf, lr, momentum, dampening, weight_decay, nesterov, out, delta, delta_decay)
    backend = backend_for(w)
    if backend == "reference":
        return reference.sgd_step(w, grad, momentum_buf, lr=lr, momentum=momentum, dampening=dampening,
                                  weight_decay=weight_decay, nesterov=nesterov, first_step=first_step, out=out,
                                  delta=delta, delta_decay=delta_decay if delta is not None else None)
    buf = momentum_buf if momentum != 0.0 else None
    if backend == "triton":
        _triton().sgd_step(out, w, grad, buf, delta, lr=lr, momentum=momentum, dampening=dampening,
                           weight_decay=weight_decay, nesterov=bool(nesterov), first_step=bool(first_step),
                           delta_decay=delta_decay)
    else:
        _cpp().sgd_step(out, w, grad, buf, delta, lr, momentum, dampening, weight_decay, bool(nesterov),
                        bool(first_step), delta_decay)
    _bump(out, buf, delta)
    return out


def _adamw_args(w, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, out):
    op = "adamw_step"
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"{op}: argument 'step' must be an integer >= 1 (the step count after this update), "
                         f"got {step!r}")
    lr = _checks.real(op, "lr", lr)
    beta1 = _checks.real(op, "beta1", beta1)
    beta2 = _checks.real(op, "beta2", beta2)
    eps = _checks.real(op, "eps", eps)
    weight_decay = _checks.real(op, "weight_decay", weight_decay)
    if lr < 0.0:
        raise ValueError(f"{op}: invalid learning rate lr={lr}")
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"{op}: invalid beta1={beta1}; expected 0 <= beta1 < 1")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"{op}: invalid beta2={beta2}; expected 0 <= beta2 < 1")
    if eps < 0.0:
        raise ValueError(f"{op}: invalid eps={eps}")
    if weight_decay < 0.0:
        raise ValueError(f"{op}: invalid weight_decay={weight_decay}")
    if out is None:
        out = w
    _checks.check(op, [("w", w), ("grad", grad), ("out", out)], [("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)],
                  written=["out", "exp_avg", "exp_avg_sq"], out_may_alias=["w"])
    return out, int(step), lr, beta1, beta2, eps, weight_decay


def adamw_step(w: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """One ``torch.optim.AdamW`` step (``amsgrad=False, maximize=False``) from ``w`` into ``out``.

    Per element::

        p          = w * (1 - lr * weight_decay)
        exp_avg    = lerp(exp_avg, grad, 1 - beta1)
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
        out        = p - lr / (1 - beta1**step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps)

    Args:
        w: current (live) weights.
        grad: gradient, same dtype as ``w``.
        exp_avg, exp_avg_sq: first and second moments (state dtype), updated in place; zeros before
            the first step, as in torch.
        step: the step number this update makes, counting from 1 (torch's ``state["step"]`` after
            its increment).
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW``.
        out: where the new weights go, e.g. the next ring slot; defaults to ``w`` (in place).

    Returns:
        ``out``.
    """
    out, step, lr, beta1, beta2, eps, weight_decay = _adamw_args(
        w, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, out)
    backend = backend_for(w)
    if backend == "reference":
        return reference.adamw_step(w, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
                                    eps=eps, weight_decay=weight_decay, out=out)
    wd_factor = 1.0 - lr * weight_decay
    step_size = lr / (1.0 - beta1**step)
    bias_correction2_sqrt = (1.0 - beta2**step) ** 0.5
    if backend == "triton":
        _triton().adamw_step(out, w, grad, exp_avg, exp_avg_sq, wd_factor=wd_factor, beta1=beta1, beta2=beta2,
                             eps=eps, step_size=step_size, bias_correction2_sqrt=bias_correction2_sqrt)
    else:
        _cpp().adamw_step(out, w, grad, exp_avg, exp_avg_sq, wd_factor, beta1, beta2, eps, step_size,
                          bias_correction2_sqrt)
    _bump(out, exp_avg, exp_avg_sq)
    return out
