"""Triton kernels for pipecore's fused element-wise ops over flat weight buffers.

One kernel per op, one launch per call over the whole flat buffer. Every program handles ``BLOCK``
consecutive elements, a multiple of 16-byte vectors of the storage dtype per thread.

Math runs in float32 (float64 for float64 weights). Scalars (learning rate, momentum, ...) are kernel
arguments for float32 math: rounded to float32 on the host, as a float32 tensor would hold them, so
nothing is allocated, pinned or copied per call and a new learning rate never recompiles. For float64
weights a float argument would lose precision, so their scalars travel in a small float64 device tensor,
cached per set of values (the ``SCAL_PTR`` variant of each kernel). Every derived scalar
(``1 - dampening``, ``1 - (1 - beta1)``, ...) is computed on the host in the math dtype, so the
kernel, its interpreter run and the torch reference see the same values.

Block size and ``num_warps``: on CUDA, for calls of at least ``_TUNE_MIN_NUMEL`` elements, a small set of
configurations is timed once per kernel, storage dtype, device and power-of-two size bucket, on scratch
copies of what the kernel writes (the caller's tensors are never touched twice), and the fastest is
cached; smaller calls and the interpreter use the default (4 warps, 4 vectors per thread). The
configuration never changes a result: every element is computed alone. ``PIPECORE_TRITON_AUTOTUNE=0``
turns the timing off.

Rounding: every launch passes ``enable_fp_fusion=False``, so Triton emits no fused multiply-add (its
multiplies become ``mul.rn``, which ptxas never contracts) and ``a + b * c`` rounds the product first,
as the C++ kernels (``-ffp-contract=off``) and ``pipecore.ops.reference`` do.

The launchers here do no validation: ``pipecore.ops`` checks arguments and then calls them. They
take ``out`` first, like the C++ kernels in ``pipecore._C``.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

# Default launch: 4 warps x 32 threads x 4 vectors of 16 bytes per thread.
_NUM_WARPS = 4
_VECTORS_PER_THREAD = 4
# The configurations timed on CUDA: (num_warps, 16-byte vectors per thread); the default first.
_CANDIDATES = ((4, 4), (8, 4), (4, 8), (8, 2))
_TUNE_MIN_NUMEL = 1 << 20
_TUNE_REPS = 5


def block_size(dtype: torch.dtype, num_warps: int = _NUM_WARPS, vectors: int = _VECTORS_PER_THREAD) -> int:
    """Elements per program for weights stored as ``dtype`` (16-byte accesses per thread)."""
    elems_per_vector = 16 // dtype.itemsize
    return elems_per_vector * 32 * num_warps * vectors


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tl_math(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _f32(x: float) -> float:
    """``x`` rounded to float32 to nearest, as a float32 tensor (or Triton's fp32 argument) holds it (numpy: no
    tensor is allocated per call)."""
    return float(np.float32(x))


def _in_math(values: list[float], dtype: torch.dtype) -> list[float]:
    """The scalars as the kernel sees them: float32 for float32 math, unchanged for float64."""
    return values if dtype == torch.float64 else [_f32(v) for v in values]


_scalar_cache: dict[tuple[Any, ...], torch.Tensor] = {}
_scalar_lock = threading.Lock()


def _scalars(values: list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The float64 scalars as a device tensor, cached per values (float64 weights only; see the module docs)."""
    md = _math_dtype(dtype)
    if device.type == "cpu":
        return torch.tensor(values, dtype=md)
    key = (device, md, tuple(values))
    t = _scalar_cache.get(key)
    if t is None:
        # A blocking copy from pageable memory: complete before any stream reads it, and nothing is pinned.
        t = torch.tensor(values, dtype=md, device=device)
        with _scalar_lock:
            if len(_scalar_cache) >= 256:
                _scalar_cache.clear()
            _scalar_cache[key] = t
    return t


def _scalar_args(values: list[float], dtype: torch.dtype, device: torch.device, anchor: torch.Tensor
                 ) -> tuple[torch.Tensor, list[float], bool]:
    """(scal_ptr, float arguments, SCAL_PTR) for a launch: arguments for float32 math, a tensor for float64."""
    if dtype == torch.float64:
        return _scalars(values, dtype, device), [0.0] * len(values), True
    return anchor, _in_math(values, dtype), False


_tuned: dict[tuple[Any, ...], tuple[int, int]] = {}


def _autotune_enabled() -> bool:
    return os.environ.get("PIPECORE_TRITON_AUTOTUNE", "1") != "0"


def _config(name: str, n: int, dtype: torch.dtype, device: torch.device,
            scratch_launch: Callable[[], Callable[[int, int], Any]]) -> tuple[int, int]:
    """(num_warps, vectors per thread) for ``name`` on ``n`` elements: the default, or on CUDA for large calls
    the fastest of :data:`_CANDIDATES`, timed once per (kernel, dtype, device, power-of-two size bucket).
    ``scratch_launch()`` returns a launcher ``(num_warps, vectors) -> None`` that writes only scratch copies."""
    default = (_NUM_WARPS, _VECTORS_PER_THREAD)
    if device.type != "cuda" or n < _TUNE_MIN_NUMEL or not _autotune_enabled():
        return default
    key = (name, dtype, device.index, 1 << (n - 1).bit_length())
    cfg = _tuned.get(key)
    if cfg is not None:
        return cfg
    try:
        launch = scratch_launch()
        best = None
        for warps, vectors in _CANDIDATES:
            t = _time_launch(launch, warps, vectors)
            if best is None or t < best[0]:
                best = (t, (warps, vectors))
        cfg = best[1] if best is not None else default
        del launch
    except torch.cuda.OutOfMemoryError:
        cfg = default  # no room for the scratch copies: the default is a good configuration too
    except Exception as exc:  # noqa: BLE001 - tuning is an optimisation: say so, and compute with the default
        warnings.warn(f"pipecore.kernels: timing {name}'s launch configurations failed ({type(exc).__name__}: "
                      f"{exc}); using the default ({default[0]} warps, {default[1]} vectors per thread)",
                      RuntimeWarning, stacklevel=3)
        cfg = default
    _tuned[key] = cfg
    return cfg


def _time_launch(launch: Callable[[int, int], Any], warps: int, vectors: int) -> float:
    """The fastest of ``_TUNE_REPS`` launches in milliseconds (CUDA events), after one that compiles and warms up."""
    launch(warps, vectors)
    times = []
    for _ in range(_TUNE_REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch(warps, vectors)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return min(times)


def _grid(n: int, block: int):
    return (triton.cdiv(n, block),)


_FMA = re.compile(r"\bfma\.rn(?:\.ftz)?\.f(?:32|64)\b")


def fma_count(handle: Any) -> int | None:
    """Fused multiply-adds in a compiled kernel's PTX (the value a launcher returns); None without PTX."""
    ptx = getattr(handle, "asm", {}).get("ptx") if handle is not None else None
    return None if ptx is None else len(_FMA.findall(ptx))


def ptx_fma_counts(device: torch.device | str = "cuda") -> dict[str, int | None]:
    """Compile (if needed) and launch every kernel once on tiny tensors of ``device`` for float32, bfloat16 and
    float64 weights, and count the fused multiply-adds in each one's PTX (0 expected: contraction is off)."""
    device = torch.device(device)
    out: dict[str, int | None] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        md = _math_dtype(dtype)
        w = torch.randn(1000, device=device).to(dtype)
        g, o = torch.randn_like(w), torch.empty_like(w)
        a, b, c = (torch.randn(1000, device=device, dtype=md) for _ in range(3))
        name = str(dtype).replace("torch.", "")
        out[f"interpolate {name}"] = fma_count(interpolate(o, w, g, 0.3))
        out[f"predict {name}"] = fma_count(predict(o, w, g, 0.1))
        out[f"sgd {name}"] = fma_count(sgd_step(o, w, g, a, b, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01,
                                                nesterov=True, first_step=False, delta_decay=0.5))
        out[f"adamw {name}"] = fma_count(adamw_step(o, w, g, a, c.abs(), wd_factor=0.999, beta1=0.9, beta2=0.999,
                                                    eps=1e-8, step_size=0.01, bias_correction2_sqrt=0.1))
        out[f"nadam {name}"] = fma_count(nadam_step(o, w, g, a, c.abs(), grad_decay=0.01, wd_factor=1.0, beta1=0.9,
                                                    beta2=0.999, eps=1e-8, bias_correction2=0.01, grad_step=-0.01,
                                                    exp_avg_step=-0.09))
    return out


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
def _interpolate_kernel(out_ptr, live_ptr, stale_ptr, scal_ptr, alpha, n, BLOCK: tl.constexpr, MATH: tl.constexpr,
                        SCAL_PTR: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if SCAL_PTR:
        alpha = tl.load(scal_ptr)
    live = tl.load(live_ptr + offs, mask=mask).to(MATH)
    stale = tl.load(stale_ptr + offs, mask=mask).to(MATH)
    res = live + alpha * (stale - live)
    tl.store(out_ptr + offs, _to_storage(res, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _predict_kernel(out_ptr, w_ptr, v_ptr, scal_ptr, scale, n, BLOCK: tl.constexpr, MATH: tl.constexpr,
                    SCAL_PTR: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if SCAL_PTR:
        scale = tl.load(scal_ptr)
    w = tl.load(w_ptr + offs, mask=mask).to(MATH)
    v = tl.load(v_ptr + offs, mask=mask).to(MATH)
    res = w - scale * v
    tl.store(out_ptr + offs, _to_storage(res, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sgd_kernel(out_ptr, w_ptr, grad_ptr, buf_ptr, delta_ptr, scal_ptr, lr, momentum, one_minus_dampening,
                weight_decay, delta_decay, one_minus_delta_decay, n,
                BLOCK: tl.constexpr, MATH: tl.constexpr, SCAL_PTR: tl.constexpr, WD: tl.constexpr, MOM: tl.constexpr,
                NESTEROV: tl.constexpr, FIRST: tl.constexpr, DELTA: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if SCAL_PTR:
        lr = tl.load(scal_ptr + 0)
        momentum = tl.load(scal_ptr + 1)
        one_minus_dampening = tl.load(scal_ptr + 2)
        weight_decay = tl.load(scal_ptr + 3)
        delta_decay = tl.load(scal_ptr + 4)
        one_minus_delta_decay = tl.load(scal_ptr + 5)
    w = tl.load(w_ptr + offs, mask=mask).to(MATH)
    d = tl.load(grad_ptr + offs, mask=mask).to(MATH)
    # The order of pipecore.ops.reference.sgd_step; every product rounded before it is added.
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
def _adamw_kernel(out_ptr, w_ptr, grad_ptr, m_ptr, v_ptr, scal_ptr, wd_factor, beta1_weight, one_minus_beta1_weight,
                  beta2, one_minus_beta2, eps, neg_step_size, bc2_sqrt, n,
                  BLOCK: tl.constexpr, MATH: tl.constexpr, SCAL_PTR: tl.constexpr, LERP_SMALL: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if SCAL_PTR:
        wd_factor = tl.load(scal_ptr + 0)
        beta1_weight = tl.load(scal_ptr + 1)
        one_minus_beta1_weight = tl.load(scal_ptr + 2)
        beta2 = tl.load(scal_ptr + 3)
        one_minus_beta2 = tl.load(scal_ptr + 4)
        eps = tl.load(scal_ptr + 5)
        neg_step_size = tl.load(scal_ptr + 6)
        bc2_sqrt = tl.load(scal_ptr + 7)
    g = tl.load(grad_ptr + offs, mask=mask).to(MATH)
    p = tl.load(w_ptr + offs, mask=mask).to(MATH) * wd_factor
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    # exp_avg.lerp_(grad, 1 - beta1) with torch's two-sided formula.
    if LERP_SMALL:
        m = m + beta1_weight * (g - m)
    else:
        m = g - (g - m) * one_minus_beta1_weight
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


@triton.jit
def _nadam_kernel(out_ptr, w_ptr, grad_ptr, m_ptr, v_ptr, scal_ptr, grad_decay, wd_factor, beta1_weight,
                  one_minus_beta1_weight, beta2, one_minus_beta2, eps, bias_correction2, grad_step, exp_avg_step, n,
                  BLOCK: tl.constexpr, MATH: tl.constexpr, SCAL_PTR: tl.constexpr, LERP_SMALL: tl.constexpr,
                  L2_DECAY: tl.constexpr, DECOUPLED_DECAY: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if SCAL_PTR:
        grad_decay = tl.load(scal_ptr + 0)
        wd_factor = tl.load(scal_ptr + 1)
        beta1_weight = tl.load(scal_ptr + 2)
        one_minus_beta1_weight = tl.load(scal_ptr + 3)
        beta2 = tl.load(scal_ptr + 4)
        one_minus_beta2 = tl.load(scal_ptr + 5)
        eps = tl.load(scal_ptr + 6)
        bias_correction2 = tl.load(scal_ptr + 7)
        grad_step = tl.load(scal_ptr + 8)
        exp_avg_step = tl.load(scal_ptr + 9)
    p = tl.load(w_ptr + offs, mask=mask).to(MATH)
    g = tl.load(grad_ptr + offs, mask=mask).to(MATH)
    # The order of pipecore.ops.reference.nadam_step (torch's single-tensor NAdam).
    if L2_DECAY:
        g = g + p * grad_decay
    if DECOUPLED_DECAY:
        p = p * wd_factor
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    if LERP_SMALL:
        m = m + beta1_weight * (g - m)
    else:
        m = g - (g - m) * one_minus_beta1_weight
    v = v * beta2 + (g * one_minus_beta2) * g
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    # IEEE-rounded sqrt and division, as torch uses (Triton's defaults are approximate for fp32).
    if MATH == tl.float64:
        denom = tl.sqrt(v / bias_correction2) + eps
        p = p + (g * grad_step) / denom
        p = p + (m * exp_avg_step) / denom
    else:
        denom = tl.sqrt_rn(tl.div_rn(v, bias_correction2)) + eps
        p = p + tl.div_rn(g * grad_step, denom)
        p = p + tl.div_rn(m * exp_avg_step, denom)
    tl.store(out_ptr + offs, _to_storage(p, out_ptr.dtype.element_ty), mask=mask)


# FMA contraction is disabled so GPU results round like the C++ kernels and the torch reference.
_FUSION = dict(enable_fp_fusion=False)


def interpolate(out: torch.Tensor, live: torch.Tensor, stale: torch.Tensor, alpha: float) -> Any:
    """``out = live + alpha * (stale - live)`` over flat contiguous tensors; returns Triton's launch handle."""
    n = live.numel()
    if n == 0:
        return None
    dt, dev = live.dtype, live.device
    md = _tl_math(dt)
    scal, (a,), sp = _scalar_args([alpha], dt, dev, out)

    def launch(dst: torch.Tensor, warps: int, vectors: int) -> Any:
        block = block_size(dt, warps, vectors)
        return _interpolate_kernel[_grid(n, block)](dst, live, stale, scal, a, n, BLOCK=block, MATH=md, SCAL_PTR=sp,
                                                    num_warps=warps, **_FUSION)

    with _on(dev):
        warps, vectors = _config("interpolate", n, dt, dev, lambda: _scratch(launch, torch.empty_like(out)))
        return launch(out, warps, vectors)


def predict(out: torch.Tensor, w: torch.Tensor, v: torch.Tensor, scale: float) -> Any:
    """``out = w - scale * v`` over flat contiguous tensors; returns Triton's launch handle."""
    n = w.numel()
    if n == 0:
        return None
    dt, dev = w.dtype, w.device
    md = _tl_math(dt)
    scal, (sc,), sp = _scalar_args([scale], dt, dev, out)

    def launch(dst: torch.Tensor, warps: int, vectors: int) -> Any:
        block = block_size(dt, warps, vectors)
        return _predict_kernel[_grid(n, block)](dst, w, v, scal, sc, n, BLOCK=block, MATH=md, SCAL_PTR=sp,
                                                num_warps=warps, **_FUSION)

    with _on(dev):
        warps, vectors = _config("predict", n, dt, dev, lambda: _scratch(launch, torch.empty_like(out)))
        return launch(out, warps, vectors)


def _scratch(launch: Callable[..., Any], *tensors: torch.Tensor) -> Callable[[int, int], Any]:
    """A launcher for the autotuner that writes ``tensors`` (scratch copies) instead of the caller's."""
    return lambda warps, vectors: launch(*tensors, warps, vectors)


def sgd_step(out: torch.Tensor, w: torch.Tensor, grad: torch.Tensor, momentum_buf: torch.Tensor | None,
             delta: torch.Tensor | None, *, lr: float, momentum: float, dampening: float, weight_decay: float,
             nesterov: bool, first_step: bool, delta_decay: float) -> Any:
    """torch.optim.SGD step from ``w`` into ``out`` (see ``pipecore.ops.sgd_step``); returns Triton's launch handle."""
    n = w.numel()
    if n == 0:
        return None
    mom = momentum != 0.0
    dt, dev = w.dtype, w.device
    md = _tl_math(dt)
    scal, args, sp = _scalar_args([lr, momentum, 1.0 - dampening, weight_decay, delta_decay, 1.0 - delta_decay],
                                  dt, dev, out)
    flags = dict(WD=weight_decay != 0.0, MOM=mom, NESTEROV=bool(nesterov) and mom, FIRST=bool(first_step) and mom,
                 DELTA=delta is not None)

    def launch(dst: torch.Tensor, buf: torch.Tensor | None, dl: torch.Tensor | None, warps: int, vectors: int) -> Any:
        block = block_size(dt, warps, vectors)
        # Unused pointer arguments get a valid tensor; the constexpr flags keep them from being touched.
        return _sgd_kernel[_grid(n, block)](dst, w, grad, buf if mom else scal, dl if dl is not None else scal, scal,
                                            *args, n, BLOCK=block, MATH=md, SCAL_PTR=sp, **flags, num_warps=warps,
                                            **_FUSION)

    def scratch() -> Callable[[int, int], Any]:
        return _scratch(launch, torch.empty_like(out), momentum_buf.clone() if mom else None,
                        None if delta is None else delta.clone())

    with _on(dev):
        warps, vectors = _config("sgd", n, dt, dev, scratch)
        return launch(out, momentum_buf, delta, warps, vectors)


def _lerp_weights(beta1: float, dtype: torch.dtype) -> tuple[float, float, bool]:
    """torch's lerp weight ``1 - beta1``, its complement and whether the weight is under 0.5 (which of lerp's two
    formulas runs), rounded in the math dtype of weights stored as ``dtype``."""
    if dtype == torch.float64:
        weight = 1.0 - beta1
        complement = 1.0 - weight
    else:
        weight = float(np.float32(1.0 - beta1))
        complement = float(np.float32(1.0) - np.float32(weight))
    return weight, complement, abs(weight) < 0.5


def adamw_step(out: torch.Tensor, w: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, *, wd_factor: float, beta1: float, beta2: float, eps: float,
               step_size: float, bias_correction2_sqrt: float) -> Any:
    """torch.optim.AdamW step from ``w`` into ``out``; ``wd_factor = 1 - lr*weight_decay``,
    ``step_size = lr / (1 - beta1**step)``, ``bias_correction2_sqrt = (1 - beta2**step) ** 0.5``; returns
    Triton's launch handle."""
    n = w.numel()
    if n == 0:
        return None
    dt, dev = w.dtype, w.device
    md = _tl_math(dt)
    weight, complement, small = _lerp_weights(beta1, dt)
    scal, args, sp = _scalar_args([wd_factor, weight, complement, beta2, 1.0 - beta2, eps, -step_size,
                                   bias_correction2_sqrt], dt, dev, out)

    def launch(dst: torch.Tensor, m: torch.Tensor, v: torch.Tensor, warps: int, vectors: int) -> Any:
        block = block_size(dt, warps, vectors)
        return _adamw_kernel[_grid(n, block)](dst, w, grad, m, v, scal, *args, n, BLOCK=block, MATH=md, SCAL_PTR=sp,
                                              LERP_SMALL=small, num_warps=warps, **_FUSION)

    def scratch() -> Callable[[int, int], Any]:
        return _scratch(launch, torch.empty_like(out), exp_avg.clone(), exp_avg_sq.clone())

    with _on(dev):
        warps, vectors = _config("adamw", n, dt, dev, scratch)
        return launch(out, exp_avg, exp_avg_sq, warps, vectors)


def nadam_step(out: torch.Tensor, w: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, *, grad_decay: float, wd_factor: float, beta1: float, beta2: float,
               eps: float, bias_correction2: float, grad_step: float, exp_avg_step: float) -> Any:
    """torch.optim.NAdam step from ``w`` into ``out``, with the per-step scalars of
    ``pipecore.ops._checks.nadam_scalars`` (``grad_decay``: L2 weight decay, 0 for none; ``wd_factor``: decoupled
    weight decay's ``1 - lr*weight_decay``, 1 for none); returns Triton's launch handle."""
    n = w.numel()
    if n == 0:
        return None
    dt, dev = w.dtype, w.device
    md = _tl_math(dt)
    weight, complement, small = _lerp_weights(beta1, dt)
    scal, args, sp = _scalar_args([grad_decay, wd_factor, weight, complement, beta2, 1.0 - beta2, eps,
                                   bias_correction2, grad_step, exp_avg_step], dt, dev, out)
    flags = dict(LERP_SMALL=small, L2_DECAY=grad_decay != 0.0, DECOUPLED_DECAY=wd_factor != 1.0)

    def launch(dst: torch.Tensor, m: torch.Tensor, v: torch.Tensor, warps: int, vectors: int) -> Any:
        block = block_size(dt, warps, vectors)
        return _nadam_kernel[_grid(n, block)](dst, w, grad, m, v, scal, *args, n, BLOCK=block, MATH=md, SCAL_PTR=sp,
                                              **flags, num_warps=warps, **_FUSION)

    def scratch() -> Callable[[int, int], Any]:
        return _scratch(launch, torch.empty_like(out), exp_avg.clone(), exp_avg_sq.clone())

    with _on(dev):
        warps, vectors = _config("nadam", n, dt, dev, scratch)
        return launch(out, exp_avg, exp_avg_sq, warps, vectors)
