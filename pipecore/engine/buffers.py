"""Module buffers that a block may change without changing the originals."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import nn


@contextmanager
def buffer_copies(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Inside the block, every buffer of ``modules`` and their submodules is a copy (one per tensor, so a
    buffer held in several places stays shared); the originals come back after it, untouched by what the block
    did (BatchNorm updating its running statistics). Copies rather than restoring the values afterwards: a
    graph in flight may have saved the buffers, and autograd refuses a backward through a tensor modified in
    place since, even back to its old values."""
    unique = {id(m): m for root in modules for m in root.modules()}
    copies: dict[int, torch.Tensor] = {}
    swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
    for m in unique.values():
        for name, b in list(m._buffers.items()):
            if b is None:
                continue
            if id(b) not in copies:
                copies[id(b)] = b.detach().clone()
            m._buffers[name] = copies[id(b)]
            swapped.append((m, name, b))
    try:
        yield
    finally:
        for m, name, original in swapped:
            m._buffers[name] = original
