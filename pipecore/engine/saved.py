"""Saved-tensor hooks that nest.

``torch.autograd.graph.saved_tensors_hooks`` applies only the innermost pair of hooks. A stage packs saved
weights as references (the swap rule) and counts saved tensors (the CPU memory account); an offloaded
segment inside the stage moves its saved activations to host memory. :func:`saving` installs a pair and
records it, so that an inner pair can wrap the pair around it (:func:`outer_hooks`) instead of replacing it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

Pack = Callable[[torch.Tensor], Any]
Unpack = Callable[[Any], torch.Tensor]

_STACK = threading.local()


def identity(value: Any) -> Any:
    """A hook that packs or unpacks a saved tensor as itself."""
    return value


@contextmanager
def saving(pack: Pack, unpack: Unpack) -> Iterator[None]:
    """``torch.autograd.graph.saved_tensors_hooks(pack, unpack)``, recorded for :func:`outer_hooks`."""
    stack = getattr(_STACK, "hooks", None)
    if stack is None:
        stack = _STACK.hooks = []
    stack.append((pack, unpack))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        stack.pop()


def outer_hooks() -> tuple[Pack, Unpack]:
    """The innermost pair installed by :func:`saving` on this thread (identities when there is none)."""
    stack = getattr(_STACK, "hooks", None)
    return stack[-1] if stack else (identity, identity)
