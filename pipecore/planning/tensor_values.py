"""The tensors in a value (tuples, lists and dicts of tensors), and the storages they occupy."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a value made of tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with every tensor in its tuples, lists and dicts replaced by ``fn(tensor)``."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, torch.Size):
        return value
    if isinstance(value, tuple):
        items = [map_tensors(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if isinstance(value, dict):
        mapped = {k: map_tensors(v, fn) for k, v in value.items()}
        if type(value) is not dict:  # a dict of the model's own type (a Hugging Face ModelOutput) keeps it
            try:
                return type(value)(**mapped)
            except TypeError:
                return type(value)(mapped)
        return mapped
    return value


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in a value (their own elements), each tensor once."""
    unique = {id(t): t for t in tensors_in(value)}
    return sum(t.numel() * t.element_size() for t in unique.values())


def storage_key(t: torch.Tensor) -> Any:
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage: each counts by itself
        return ("tensor", id(t))


def storages(tensors: Iterator[torch.Tensor] | Sequence[torch.Tensor]) -> Iterator[tuple[Any, int]]:
    """``(key, bytes)`` of the storage of each tensor (each storage once)."""
    seen = set()
    for t in tensors:
        key = storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        try:
            nbytes = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            nbytes = t.numel() * t.element_size()
        yield key, nbytes
