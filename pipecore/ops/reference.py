"""Plain-torch reference implementations of :mod:`pipecore.ops` (the test oracle).

Each function has the same signature and the same argument checks as its fused counterpart and
follows torch.optim's order of operations, computing in float32 (float64 for float64 weights) and
rounding once to the storage dtype. It is slow (several passes and temporaries) but obviously
right; it is also the implementation used for tensors on devices other than CPU and CUDA.
"""

from __future__ import annotations

import torch

from . import _checks

__all__ = ["adamw_step", "interpolate", "predict", "sgd_step"]


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
            d = d.add(wm, alpha=weight_decay)
        buf = None
        if momentum != 0.0:
            assert momentum_buf is not None
            if first_step:
                buf = d.clone()
            else:
                buf = momentum_buf.mul(momentum).add_(d, alpha=1.0 - dampening)
            d = d.add(buf, alpha=momentum) if nesterov else buf
        new = wm.add(d, alpha=-lr).to(w.dtype)
        new_delta = None
        if delta is not None:
            new_delta = delta.mul(delta_decay).add_(new.to(md) - wm, alpha=1.0 - delta_decay)
        # All results exist before anything is written, so out may be w.
        if buf is not None:
            assert momentum_buf is not None
            momentum_buf.copy_(buf)
        if new_delta is not None:
            assert delta is not None
            delta.copy_(new_delta)
        out.copy_(new)
    return out


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
            p = p.mul(1.0 - lr * weight_decay)
        m = exp_avg.lerp(g, 1.0 - beta1)
        v = exp_avg_sq.mul(beta2).addcmul_(g, g, value=1.0 - beta2)
        bias_correction1 = 1.0 - beta1**step
        bias_correction2 = 1.0 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        new = p.addcdiv(m, denom, value=-step_size).to(w.dtype)
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
        out.copy_(new)
    return out
