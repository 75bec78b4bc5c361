"""Faster attribute access to the members of generated modules.

A generated forward (``torch.fx``) reaches each submodule, parameter and buffer it uses as an attribute of the
module (``getattr(self, "4")(x)``). ``nn.Module`` keeps those in dicts of its own, so Python's attribute lookup
fails first, building an ``AttributeError``, before ``nn.Module.__getattr__`` finds them: on a small stage that
costs more than the rest of the module call. :func:`speed_up_member_access` puts a descriptor for each member
on the module's class, which ``GraphModule`` makes for each instance (so no other module sees them); the
descriptor reads the member from its dict on every access, so a member replaced later (``add_module``,
``setattr``, a parameter swapped in for one call) is what it returns, and one removed falls back to
``nn.Module``'s own lookup.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

_MEMBER_DICTS = ("_parameters", "_buffers", "_modules")  # nn.Module.__getattr__'s order


class _Member:
    """A non-data descriptor: the instance's own ``__dict__`` still wins (as for any attribute), and a member no
    longer in its dict is looked up as ``nn.Module`` would."""

    __slots__ = ("name", "where")

    def __init__(self, name: str, where: str):
        self.name, self.where = name, where

    def __get__(self, module: Any, owner: type | None = None) -> Any:
        if module is None:
            return self
        members = module.__dict__[self.where]
        name = self.name
        if name in members:
            return members[name]
        return torch.nn.Module.__getattr__(module, name)  # moved to another dict, or gone: AttributeError


def speed_up_member_access(module: torch.nn.Module) -> None:
    """Give every ``GraphModule`` in ``module`` (itself included) direct access to its members (see the module
    docstring). Other modules are left alone: their classes are shared."""
    for sub in module.modules():
        cls = type(sub)
        # GraphModule.__new__ makes the class (renamed after the traced module, so its qualified name tells).
        if not isinstance(sub, fx.GraphModule) or cls.__qualname__.rpartition(".")[2] != "GraphModuleImpl":
            continue  # only GraphModule's per-instance classes are ours to add to
        for where in _MEMBER_DICTS:
            for name in getattr(sub, where):
                # Never over a method or class attribute; one the instance holds itself would win anyway.
                if not hasattr(cls, name) and name not in sub.__dict__:
                    setattr(cls, name, _Member(name, where))
