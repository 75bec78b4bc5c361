"""Plain-torch reference implementations of :mod:`pipecore.ops` (the test oracle).

Each function has the same signature and the same argument checks as its fused counterpart and
follows torch.optim's order of operations, computing in float32 (float64 for float64 weights) and
rounding once to the storage dtype. It is slow (several passes and temporaries) but obviously
right; it is also the implementation used for tensors on devices other than CPU and CUDA.

Every product is its own torch op, rounded before it is added: ``a + b * c`` is written as two
ops, never ``a.add(b, alpha=c)``, ``lerp``, ``addcmul`` or ``addcdiv``. Those fuse the multiply and
the add into one rounding (an FMA) on CUDA, where nvcc contracts them, and on AVX2 CPUs, where
torch's vectorized code calls ``fmadd``, but not in the scalar tail, so the oracle itself rounded
differently by device and position. The Triton kernels (compiled with ``enable_fp_fusion=False``)
and the C++ kernels (``-ffp-contract=off``) round every product, in the order written here, so
all three agree bit for bit. Division by a scalar goes through a 0-dim tensor on the operands'
device: torch divides a CUDA tensor by a Python number as a multiplication by its reciprocal. The
square root is IEEE-rounded: on the CPU it is numpy's (the hardware instruction), because torch's
vectorized CPU ``sqrt`` (SLEEF, within 0.5001 ulp) is not always correctly rounded.
"""

from __future__ import annotations

import numpy as np
import torch

from . import _checks

__all__ = ["adamw_step", "interpolate", "nadam_step", "predict", "sgd_step"]


def _sqrt(t: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root (see the module docs)."""
    if t.device.type == "cpu":
        return torch.from_numpy(np.sqrt(t.contiguous().numpy()))
    return t.sqrt()


def interpolate(live: torch.Tensor, stale: torch.Tensor, alpha: float, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """``out = live + alpha * (stale - live)``."""
    alpha, out = _checks.interpolate_args(live, stale, alpha, out)
    md = _checks.state_dtype(live.dtype)
    with torch.no_grad():
        lv = live.to(md)
        res = lv + alpha * (stale.to(md) - lv)
        out.copy_(res)
    return out


def predict(w: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out = w - scale * v``."""
    scale, out = _checks.predict_args(w, v, scale, out)
    md = _checks.state_dtype(w.dtype)
    with torch.no_grad():
        res = w.to(md) - scale * v.to(md)
        out.copy_(res)
    return out


def sgd_step(w: torch.Tensor, grad: torch.Tensor, momentum_buf: torch.Tensor | None, *, lr: float,
             momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
             first_step: bool = False, out: torch.Tensor | None = None, delta: torch.Tensor | None = None,
             delta_decay: float | None = None) -> torch.Tensor:
    """torch.optim.SGD step written to ``out`` (default: ``w``); see :func:`pipecore.ops.sgd_step`."""
    out, lr, momentum, dampening, weight_decay, delta_decay = _checks.sgd_args(
        w, grad, momentum_buf, lr, momentum, dampening, weight_decay, nesterov, out, delta, delta_decay)
    md = _checks.state_dtype(w.dtype)
    with torch.no_grad():
        wm = w.to(md)
        d = grad.to(md)
        if weight_decay != 0.0:
            d = d + wm * weight_decay
        buf = None
        if momentum != 0.0:
            assert momentum_buf is not None
            if first_step:
                buf = d.clone()
            else:
                buf = momentum_buf * momentum + d * (1.0 - dampening)
            d = d + buf * momentum if nesterov else buf
        new = (wm - d * lr).to(w.dtype)
        new_delta = None
        if delta is not None:
            new_delta = delta * delta_decay + (new.to(md) - wm) * (1.0 - delta_decay)
        # All results exist before anything is written, so out may be w.
        if buf is not None:
            assert momentum_buf is not None
            momentum_buf.copy_(buf)
        if new_delta is not None:
            assert delta is not None
            delta.copy_(new_delta)
        out.copy_(new)
    return out


def _lerp_moment(exp_avg: torch.Tensor, g: torch.Tensor, beta1: float, md: torch.dtype) -> torch.Tensor:
    """``exp_avg.lerp(g, 1 - beta1)`` with torch's two-sided formula, its weight rounded to the math dtype."""
    weight = torch.tensor(1.0 - beta1, dtype=md)
    diff = g - exp_avg
    if abs(float(weight)) < 0.5:
        return exp_avg + diff * float(weight)
    return g - diff * float(1.0 - weight)  # 1 - weight rounded in the math dtype, as the kernels do


def adamw_step(w: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.optim.AdamW step written to ``out`` (default: ``w``); see :func:`pipecore.ops.adamw_step`."""
    out, step, lr, beta1, beta2, eps, weight_decay = _checks.adamw_args(
        w, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, out)
    md = _checks.state_dtype(w.dtype)
    with torch.no_grad():
        p = w.to(md)
        g = grad.to(md)
        if weight_decay != 0.0:
            p = p * (1.0 - lr * weight_decay)
        m = _lerp_moment(exp_avg, g, beta1, md)
        v = exp_avg_sq * beta2 + (g * g) * (1.0 - beta2)
        bias_correction1 = 1.0 - beta1**step
        bias_correction2 = 1.0 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = torch.tensor(bias_correction2**0.5, dtype=md, device=v.device)
        denom = _sqrt(v) / bias_correction2_sqrt + eps
        new = (p + (m / denom) * -step_size).to(w.dtype)
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
        out.copy_(new)
    return out


def nadam_step(w: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, step: int,
               mu_product: float, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               momentum_decay: float, decoupled_weight_decay: bool = False, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """torch.optim.NAdam step written to ``out`` (default: ``w``); see :func:`pipecore.ops.nadam_step`.

    torch's single-tensor update, in its order: ``param.addcdiv_(grad, denom, value=c)`` is
    ``param + (c * grad) / denom`` (a quotient is never fused into an add), once for the gradient and once for
    the first moment, each rounded in the math dtype."""
    (out, step, mu_product, lr, beta1, beta2, eps, weight_decay, momentum_decay, decoupled_weight_decay) = \
        _checks.nadam_args(w, grad, exp_avg, exp_avg_sq, step, mu_product, lr, beta1, beta2, eps, weight_decay,
                           momentum_decay, decoupled_weight_decay, out)
    s = _checks.nadam_scalars(step, mu_product, lr, beta1, beta2, weight_decay, momentum_decay,
                              decoupled_weight_decay)
    md = _checks.state_dtype(w.dtype)
    with torch.no_grad():
        p = w.to(md)
        g = grad.to(md)
        if s["grad_decay"] != 0.0:
            g = g + p * s["grad_decay"]
        if s["wd_factor"] != 1.0:
            p = p * s["wd_factor"]
        m = _lerp_moment(exp_avg, g, beta1, md)
        v = exp_avg_sq * beta2 + (g * (1.0 - beta2)) * g
        bias_correction2 = torch.tensor(s["bias_correction2"], dtype=md, device=v.device)
        denom = _sqrt(v / bias_correction2) + eps
        p = p + (g * s["grad_step"]) / denom
        p = p + (m * s["exp_avg_step"]) / denom
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
        out.copy_(p.to(w.dtype))
    return out
