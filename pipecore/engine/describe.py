"""Values described for error messages, and the questions the stage asks of values and modules."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.modules.module as _module_hooks


def describe(value: Any, names: Sequence[str] = ()) -> str:
    """Shapes and dtypes of a value or a structure of tensors, for error messages (``names`` label the items of a
    tuple or list)."""
    if isinstance(value, torch.Tensor):
        return f"of shape {tuple(value.shape)} (dtype {value.dtype})"
    if isinstance(value, (tuple, list)):
        if len(value) == 1:
            return describe(value[0])
        labels = list(names) + [str(i) for i in range(len(names), len(value))]
        return "(" + ", ".join(f"{label} {describe(v)}" for label, v in zip(labels, value)) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r} {describe(v)}" for k, v in value.items()) + "}"
    return f"of type {type(value).__name__}"


def carries_grad(value: Any) -> bool:
    """Whether a value (a tensor, or tuples, lists and dicts of them) holds a tensor that requires grad."""
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (tuple, list)):
        return any(carries_grad(v) for v in value)
    if isinstance(value, dict):
        return any(carries_grad(v) for v in value.values())
    return False


def calls_more_than_forward(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` would do more than call its forward: run a hook (its own or a global one),
    a compiled call (``module.compile()``) or a JIT trace, as ``nn.Module.__call__`` checks."""
    return bool(getattr(module, "_compiled_call_impl", None) is not None or torch._C._get_tracing_state()
                or module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _module_hooks._global_forward_hooks
                or _module_hooks._global_forward_pre_hooks or _module_hooks._global_backward_hooks
                or _module_hooks._global_backward_pre_hooks)
