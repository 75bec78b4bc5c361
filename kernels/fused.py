"""Triton kernels for pipecore's fused element-wise ops over flat weight buffers.

One kernel per op, one launch per call over the whole flat buffer. Every program handles ``BLOCK``
consecutive elements; ``BLOCK`` is chosen so each thread moves 16-byte vectors of the storage dtype.
Math runs in float32 (float64 for float64 weights); scalars travel in a small device tensor of that
dtype, so they are exact in float64, never trigger a recompile when the learning rate changes, and
need no host synchronisation.

The launchers here do no validation: ``pipecore.ops`` checks arguments and then calls them. They
take ``out`` first, like the C++ kernels in ``pipecore._C``.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

# Threads per program and 16-byte vectors per thread: 4 warps x 32 threads x 4 vectors.
_NUM_WARPS = 4
_VECTORS_PER_THREAD = 4


def block_size(dtype: torch.dtype) -> int:
    """Elements per program for weights stored as ``dtype`` (16-byte accesses per thread)."""
    elems_per_vector = 16 // dtype.itemsize
    return elems_per_vector * 32 * _NUM_WARPS * _VECTORS_PER_THREAD


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tl_math(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _scalars(values: list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=_math_dtype(dtype))
    if device.type == "cpu":
        return host
    # Pinned + non_blocking: the copy is ordered on the current stream and the host does not wait.
    return host.pin_memory().to(device, non_blocking=True)


def _grid(n: int, dtype: torch.dtype):
    return (triton.cdiv(n, block_size(dtype)),)


def _on(device: torch.device):
    """Make ``device`` current for the launch: Triton launches on the current device's stream."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


@triton.jit
def _to_storage(x, DST: tl.constexpr):
    """Round math values to the storage dtype, to nearest even (NaN -> 0x7FC0 for bfloat16, as torch)."""
    if DST == tl.bfloat16:
        # Explicit bit arithmetic: compiled Triton rounds fp32->bf16 to nearest even, but the
        # interpreter truncates; this gives torch's rounding in both.
        bits = x.to(tl.uint32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DST)


@triton.jit
def _interpolate_kernel(out_ptr, live_ptr, stale_ptr, scal_ptr, n, BLOCK: tl.constexpr, MATH: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    alpha = tl.load(scal_ptr)
    live = tl.load(live_ptr + offs, mask=mask).to(MATH)
    stale = tl.load(stale_ptr + offs, mask=mask).to(MATH)
    res = live + alpha * (stale - live)
    tl.store(out_ptr + offs, _to_storage(res, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _predict_kernel(out_ptr, w_ptr, v_ptr, scal_ptr, n, BLOCK: tl.constexpr, MATH: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    scale = tl.load(scal_ptr)
    w = tl.load(w_ptr + offs, mask=mask).to(MATH)
    v = tl.load(v_ptr + offs, mask=mask).to(MATH)
    res = w - scale * v
    tl.store(out_ptr + offs, _to_storage(res, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sgd_kernel(out_ptr, w_ptr, grad_ptr, buf_ptr, delta_ptr, scal_ptr, n,
                BLOCK: tl.constexpr, MATH: tl.constexpr, WD: tl.constexpr, MOM: tl.constexpr,
                NESTEROV: tl.constexpr, FIRST: tl.constexpr, DELTA: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    lr = tl.load(scal_ptr + 0)
    momentum = tl.load(scal_ptr + 1)
    one_minus_dampening = tl.load(scal_ptr + 2)
    weight_decay = tl.load(scal_ptr + 3)
    delta_decay = tl.load(scal_ptr + 4)
    one_minus_delta_decay = tl.load(scal_ptr + 5)
    w = tl.load(w_ptr + offs, mask=mask).to(MATH)
    d = tl.load(grad_ptr + offs, mask=mask).to(MATH)
    if WD:
        d = d + weight_decay * w
    if MOM:
        if FIRST:
            b = d
        else:
            b = momentum * tl.load(buf_ptr + offs, mask=mask) + one_minus_dampening * d
        tl.store(buf_ptr + offs, b, mask=mask)
        if NESTEROV:
            d = d + momentum * b
        else:
            d = b
    new = _to_storage(w - lr * d, out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, new, mask=mask)
    if DELTA:
        delta = tl.load(delta_ptr + offs, mask=mask)
        delta = delta_decay * delta + one_minus_delta_decay * (new.to(MATH) - w)
        tl.store(delta_ptr + offs, delta, mask=mask)


@triton.jit
def _adamw_kernel(out_ptr, w_ptr, grad_ptr, m_ptr, v_ptr, scal_ptr, n,
                  BLOCK: tl.constexpr, MATH: tl.constexpr, LERP_SMALL: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    wd_factor = tl.load(scal_ptr + 0)
    beta1_weight = tl.load(scal_ptr + 1)
    beta2 = tl.load(scal_ptr + 2)
    one_minus_beta2 = tl.load(scal_ptr + 3)
    eps = tl.load(scal_ptr + 4)
    neg_step_size = tl.load(scal_ptr + 5)
    bc2_sqrt = tl.load(scal_ptr + 6)
    g = tl.load(grad_ptr + offs, mask=mask).to(MATH)
    p = tl.load(w_ptr + offs, mask=mask).to(MATH) * wd_factor
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    # exp_avg.lerp_(grad, 1 - beta1) with torch's two-sided formula.
    if LERP_SMALL:
        m = m + beta1_weight * (g - m)
    else:
        m = g - (g - m) * (1.0 - beta1_weight)
    v = v * beta2 + one_minus_beta2 * (g * g)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    # IEEE-rounded sqrt and division, as torch uses (Triton's defaults are approximate for fp32).
    if MATH == tl.float64:
        denom = tl.sqrt(v) / bc2_sqrt + eps
        upd = m / denom
    else:
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        upd = tl.div_rn(m, denom)
    tl.store(out_ptr + offs, _to_storage(p + neg_step_size * upd, out_ptr.dtype.element_ty), mask=mask)


# FMA contraction is disabled so GPU results round like the C++ kernels and the torch reference.
_LAUNCH = dict(num_warps=_NUM_WARPS, enable_fp_fusion=False)


def interpolate(out: torch.Tensor, live: torch.Tensor, stale: torch.Tensor, alpha: float) -> None:
    """``out = live + alpha * (stale - live)`` over flat contiguous tensors."""
    n = live.numel()
    if n == 0:
        return
    with _on(live.device):
        scal = _scalars([alpha], live.dtype, live.device)
        _interpolate_kernel[_grid(n, live.dtype)](out, live, stale, scal, n, BLOCK=block_size(live.dtype),
                                                  MATH=_tl_math(live.dtype), **_LAUNCH)


def predict(out: torch.Tensor, w: torch.Tensor, v: torch.Tensor, scale: float) -> None:
    """``out = w - scale * v`` over flat contiguous tensors."""
    n = w.numel()
    if n == 0:
        return
    with _on(w.device):
        scal = _scalars([scale], w.dtype, w.device)
        _predict_kernel[_grid(n, w.dtype)](out, w, v, scal, n, BLOCK=block_size(w.dtype), MATH=_tl_math(w.dtype),
                                           **_LAUNCH)


def sgd_step(out: torch.Tensor, w: torch.Tensor, grad: torch.Tensor, momentum_buf: torch.Tensor | None,
             delta: torch.Tensor | None, *, lr: float, momentum: float, dampening: float, weight_decay: float,
             nesterov: bool, first_step: bool, delta_decay: float) -> None:
    """torch.optim.SGD step from ``w`` into ``out`` (see ``pipecore.ops.sgd_step``)."""
    n = w.numel()
    if n == 0:
        return
    mom = momentum != 0.0
    with _on(w.device):
        scal = _scalars([lr, momentum, 1.0 - dampening, weight_decay, delta_decay, 1.0 - delta_decay], w.dtype,
                        w.device)
        # Unused pointer arguments get a valid tensor; the constexpr flags keep them from being touched.
        buf = momentum_buf if mom else scal
        dl = delta if delta is not None else scal
        _sgd_kernel[_grid(n, w.dtype)](out, w, grad, buf, dl, scal, n, BLOCK=block_size(w.dtype),
                                       MATH=_tl_math(w.dtype), WD=weight_decay != 0.0, MOM=mom,
                                       NESTEROV=bool(nesterov) and mom, FIRST=bool(first_step) and mom,
                                       DELTA=delta is not None, **_LAUNCH)


def adamw_step(out: torch.Tensor, w: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, *, wd_factor: float, beta1: float, beta2: float, eps: float,
               step_size: float, bias_correction2_sqrt: float) -> None:
    """torch.optim.AdamW step from ``w`` into ``out``; ``wd_factor = 1 - lr*weight_decay``,
    ``step_size = lr / (1 - beta1**step)``, ``bias_correction2_sqrt = (1 - beta2**step) ** 0.5``."""
    n = w.numel()
    if n == 0:
        return
    weight = 1.0 - beta1
    # Same test as torch's lerp, on the weight rounded to the math dtype.
    small = abs(float(torch.tensor(weight, dtype=_math_dtype(w.dtype)))) < 0.5
    with _on(w.device):
        scal = _scalars([wd_factor, weight, beta2, 1.0 - beta2, eps, -step_size, bias_correction2_sqrt], w.dtype,
                        w.device)
        _adamw_kernel[_grid(n, w.dtype)](out, w, grad, exp_avg, exp_avg_sq, scal, n, BLOCK=block_size(w.dtype),
                                         MATH=_tl_math(w.dtype), LERP_SMALL=small, **_LAUNCH)
