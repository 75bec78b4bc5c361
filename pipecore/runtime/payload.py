"""A stage message's payload as bytes: ``None``, one tensor, or a tuple of tensors and ``None``.

A stage with several boundary tensors sends a tuple; an integer tensor's gradient is ``None``. The receiver
gets back the same structure, with each tensor's dtype and shape, so activations whose shape changes between
steps need no configuration. The bytes and the words that describe them go into one frame of the link layer
(:mod:`pipecore.runtime.link`); :mod:`pipecore.runtime.distributed` puts them there.

Layout, aligned to 8 bytes throughout::

    [tensor 0 bytes, padded to 8] [tensor 1 bytes, padded to 8] ...   the payload's tensors, in order

and, elsewhere in the frame, the description: ``structure, count`` (structure 0: ``None``, 1: one tensor,
2: a tuple of ``count`` entries), then per entry its dtype code and, for a tensor, ``ndim, *shape`` (a
``None`` entry is the code ``-1`` alone). Neither the number of tensors nor their dimensions are bounded; a
dtype outside :data:`DTYPES` (a complex one, say) is refused before anything is sent.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

from .link import padded

#: The dtypes a payload may hold, by their code in a description.
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}
_ITEMSIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in DTYPES}
# On the CPU a frame's words and tensors are written and read through a numpy view of its buffer: one torch
# call per buffer instead of a slice and two views per tensor (a message's host cost is mostly such calls).
# bfloat16 has no numpy dtype and takes the torch path.
_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16, torch.int64: np.int64,
          torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8,
          torch.bool: np.bool_}
# Structure codes, the first word of a description.
_NONE, _TENSOR, _TUPLE = 0, 1, 2


def describe(payload: Any, rank: int) -> tuple[list[torch.Tensor | None], list[int], int]:
    """The payload's entries, its description words and the bytes its tensors take (padded). Checks
    everything before anything is sent (``rank`` names the sender in the errors): a refused payload leaves the
    link as it was."""
    if payload is None:
        return [], [_NONE, 0], 0
    if isinstance(payload, torch.Tensor):
        structure, entries = _TENSOR, [payload]
    elif isinstance(payload, tuple):
        structure, entries = _TUPLE, list(payload)
    else:
        raise TypeError(f"rank {rank}: a message carries None, a tensor or a tuple of tensors and None, "
                        f"not {type(payload).__name__}")
    words = [structure, len(entries)]
    nbytes = 0
    for entry in entries:
        if entry is None:
            words.append(-1)
            continue
        if not isinstance(entry, torch.Tensor):
            raise TypeError(f"rank {rank}: a message's tuple holds tensors and None, not {type(entry).__name__}")
        code = _DTYPE_CODE.get(entry.dtype)
        if code is None:
            raise ValueError(f"rank {rank}: cannot send a tensor of dtype {entry.dtype}; the transport supports "
                             + ", ".join(str(d) for d in DTYPES))
        shape = entry.shape
        words += (code, len(shape), *shape)
        nbytes += padded(entry.numel() * _ITEMSIZE[entry.dtype])
    return entries, words, nbytes


def write(buffer: torch.Tensor, array: np.ndarray | None, entries: Sequence[torch.Tensor | None]) -> None:
    """Copy the payload's tensors (:func:`describe`'s entries) to the start of ``buffer``, each padded to 8
    bytes with zeros; ``array`` is the buffer's numpy view on the CPU (else None)."""
    offset = 0
    for entry in entries:
        if entry is None:
            continue
        nbytes = entry.numel() * _ITEMSIZE[entry.dtype]
        end = padded(nbytes) + offset
        # One copy, straight from the (possibly strided, possibly other-device) tensor into the buffer.
        if not (array is not None and _copy_into(array, offset, nbytes, entry)):
            buffer[offset: offset + nbytes].view(entry.dtype).view(entry.shape).copy_(entry.detach())
        if end != offset + nbytes:
            buffer[offset + nbytes: end].zero_()
        offset = end


def _copy_into(array: np.ndarray, offset: int, nbytes: int, entry: torch.Tensor) -> bool:
    """Copy ``entry`` into the CPU buffer ``array`` (its numpy view) at ``offset``; False where numpy cannot
    (bfloat16, a tensor on another device, a lazily negated view): the caller copies with torch."""
    np_dtype = _NUMPY.get(entry.dtype)
    if np_dtype is None:
        return False
    try:
        source = entry.detach().numpy()
    except (RuntimeError, TypeError):
        return False
    np.copyto(array[offset: offset + nbytes].view(np_dtype).reshape(source.shape), source)
    return True


def unpack(buffer: torch.Tensor, description: Sequence[int], array: np.ndarray | None = None) -> Any:
    """The payload at the start of a received ``buffer`` (views into it), given its ``description`` words and,
    for a CPU buffer, its numpy view ``array``."""
    structure, count = description[0], description[1]
    entries: list[torch.Tensor | None] = []
    i, offset = 2, 0
    for _ in range(count):
        code = description[i]
        if code < 0:
            entries.append(None)
            i += 1
            continue
        ndim = description[i + 1]
        shape = description[i + 2: i + 2 + ndim]
        i += 2 + ndim
        dtype = DTYPES[code]
        nbytes = math.prod(shape) * _ITEMSIZE[dtype]
        np_dtype = None if array is None else _NUMPY.get(dtype)
        if np_dtype is not None:
            entries.append(torch.from_numpy(array[offset: offset + nbytes].view(np_dtype).reshape(shape)))
        else:
            entries.append(buffer[offset: offset + nbytes].view(dtype).view(shape))
        offset += padded(nbytes)
    if structure == _NONE:
        return None
    if structure == _TENSOR:
        return entries[0]
    if structure == _TUPLE:
        return tuple(entries)
    raise ValueError(f"unknown structure code {structure}")
