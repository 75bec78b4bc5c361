"""Argument checks shared by every backend of ``pipecore.ops``.

All checks run before anything is written, so a rejected call leaves every tensor unchanged.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

WEIGHT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_DTYPE_LIST = ", ".join(str(d) for d in WEIGHT_DTYPES)


def state_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """Dtype of optimizer state (and math) for weights stored as ``weight_dtype``."""
    return torch.float64 if weight_dtype == torch.float64 else torch.float32


def real(op: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{op}: argument '{name}' must be a real number, got {type(value).__name__}")
    return float(value)


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Meta tensors have no memory to overlap.
    if a.device != b.device or a.device.type == "meta" or a.numel() == 0 or b.numel() == 0:
        return False
    a0, a1 = _byte_range(a)
    b0, b1 = _byte_range(b)
    return a0 < b1 and b0 < a1


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and _byte_range(a) == _byte_range(b) and a.dtype == b.dtype


def check(
    op: str,
    weights: Sequence[tuple[str, object]],
    states: Sequence[tuple[str, object]] = (),
    written: Sequence[str] = (),
    out_may_alias: Sequence[str] = (),
) -> None:
    """Validate the tensor arguments of one op call.

    ``weights`` are tensors in the weight storage dtype (the first one sets dtype, device and shape
    for all others), ``states`` are optimizer-state tensors in :func:`state_dtype`. ``written``
    names the tensors the op writes; a written tensor may not overlap any other argument, except
    that ``out`` may be exactly (same memory, same dtype) one of the arguments in ``out_may_alias``.
    """
    for name, t in [*weights, *states]:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    ref_name, ref = weights[0]
    assert isinstance(ref, torch.Tensor)
    if ref.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"{op}: argument '{ref_name}' has dtype {ref.dtype}; expected one of {_DTYPE_LIST}")
    sdt = state_dtype(ref.dtype)
    for name, t in weights[1:]:
        assert isinstance(t, torch.Tensor)
        if t.dtype != ref.dtype:
            raise ValueError(f"{op}: argument '{name}' has dtype {t.dtype} but '{ref_name}' has dtype {ref.dtype}; "
                             "weights, gradients and outputs must share one dtype")
    for name, t in states:
        assert isinstance(t, torch.Tensor)
        if t.dtype != sdt:
            raise ValueError(f"{op}: argument '{name}' has dtype {t.dtype}; optimizer state for {ref.dtype} "
                             f"weights must be {sdt}")
    tensors: list[tuple[str, torch.Tensor]] = [(n, t) for n, t in [*weights, *states]]  # type: ignore[misc]
    for name, t in tensors[1:]:
        if t.device != ref.device:
            raise ValueError(f"{op}: argument '{name}' is on {t.device} but '{ref_name}' is on {ref.device}")
    for name, t in tensors[1:]:
        if t.shape != ref.shape:
            raise ValueError(f"{op}: argument '{name}' has shape {tuple(t.shape)} but '{ref_name}' has shape "
                             f"{tuple(ref.shape)}")
    for name, t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"{op}: argument '{name}' must be contiguous (shape {tuple(t.shape)}, strides "
                             f"{t.stride()}); pass a flat buffer or call .contiguous()")
    by_name = dict(tensors)
    for wname in written:
        w = by_name[wname]
        for name, t in tensors:
            if name == wname or not _overlap(w, t):
                continue
            if wname == "out" and name in out_may_alias and _same_memory(w, t):
                continue
            allowed = ""
            if wname == "out" and out_may_alias:
                names = " or ".join(repr(a) for a in out_may_alias)
                allowed = f"; 'out' may only be exactly {names} (same memory, same dtype)"
            raise ValueError(f"{op}: argument '{wname}' overlaps argument '{name}' in memory{allowed}")
