"""One autograd backward that accumulates into given leaves, with less Python around the engine.

Before it reaches the engine, ``torch.autograd.backward`` normalises its arguments, checks every tensor for
``__torch_function__`` overrides and builds the output gradients one by one (``_make_grads``), each a Python
call or several, on every backward. A stage's backward always calls it the same way, with plain tensors, so
:func:`accumulate_backward` checks that case once per call and hands the engine the same arguments
``torch.autograd.backward`` would; anything else (a tensor subclass, a shape mismatch, a functorch transform)
goes through ``torch.autograd.backward`` itself, with its checks and its error messages. The gradients are
the same: the same engine call computes them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

try:  # the engine call torch.autograd.backward ends in (torch >= 2.4)
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # pragma: no cover - older torch: every call takes the public path
    _engine_run_backward = None

_Tensor = torch.Tensor
_PLAIN = frozenset({_Tensor})  # ``_PLAIN.issuperset(map(type, ts))``: every one of ``ts`` is a plain tensor (in C)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)


def accumulate_backward(tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None,
                        inputs: Sequence[torch.Tensor], every_leaf: bool = False) -> None:
    """``torch.autograd.backward(tensors, grad_tensors=grads, inputs=inputs)``: the gradients of ``tensors``
    (weighted by ``grads``; None: each tensor is a scalar and its gradient is one) added into the ``.grad``
    of each of ``inputs``. ``every_leaf``: the caller knows that ``inputs`` are all the leaves the graph reaches
    (:func:`leaves_reached`), so the engine is not given them: it then accumulates into the same tensors without
    first walking the graph to mark which of its nodes lead to them."""
    if _fast(tensors, grads, inputs):
        if grads is None:
            grads = [torch.ones_like(t, memory_format=torch.preserve_format) for t in tensors]
        _engine_run_backward(tuple(tensors), tuple(grads), False, False, () if every_leaf else tuple(inputs),
                             allow_unreachable=True, accumulate_grad=True)
    else:
        torch.autograd.backward(tensors, grad_tensors=grads, inputs=inputs)


def leaves_reached(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The leaves a backward from ``tensors`` would accumulate into: every gradient accumulator's tensor in
    their autograd graph."""
    seen: set[Any] = set()
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    leaves = [t for t in tensors if t.grad_fn is None and t.requires_grad]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if variable is not None:
            leaves.append(variable)
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return leaves


def _fast(tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None,
          inputs: Sequence[torch.Tensor]) -> bool:
    """Whether the call is one that ``torch.autograd.backward`` would pass to the engine unchanged: plain
    tensors (no ``__torch_function__`` to dispatch to), gradients of the outputs' shapes (or scalar outputs),
    no functorch transform active, and at least one input."""
    if _engine_run_backward is None or not inputs or (_functorch_active is not None and _functorch_active()):
        return False
    if not (_PLAIN.issuperset(map(type, tensors)) and _PLAIN.issuperset(map(type, inputs))):
        return False
    if grads is None:
        for t in tensors:
            if t.numel() != 1:
                return False
        return True
    if len(grads) != len(tensors):
        return False
    for t, g in zip(tensors, grads):
        if type(g) is not _Tensor or g.shape != t.shape:
            return False
    return True
