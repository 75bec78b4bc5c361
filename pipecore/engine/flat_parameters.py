"""A stage's module run on flat weights: its parameters as views of a weight version, swapped in per call.

A stage keeps its weights as flat buffers (one ring slot per version, a scratch buffer for derived weights); its
module keeps ``nn.Parameter`` objects. :class:`FlatParameters` connects the two: parameter-shaped views and
autograd leaves of any flat weights (cached for the buffers that never move), one call of the module with given
tensors swapped in as its parameters, and the module's own parameters bound to the live weights between calls.
"""

from __future__ import annotations

from collections import deque
from operator import getitem, setitem
from typing import Any, Sequence

import torch
from torch import nn

from .describe import calls_more_than_forward
from .flat import FlatLayout

_consume = deque(maxlen=0).extend  # runs an iterator to its end, keeping nothing


class FlatParameters:
    """``module``'s parameters as views of flat weights in ``layout``'s order; leaves accumulate into ``grad``.

    ``stable`` are the storages whose views and leaves may be cached (the ring's and the scratch buffer's: they
    never move until a checkpoint is loaded, see :meth:`restable`).
    """

    def __init__(self, module: nn.Module, layout: FlatLayout, grad: torch.Tensor, stable: set[int]):
        self.module = module
        self.layout = layout
        self.stable = stable
        self.grad_views = list(layout.views(grad).values())
        self._views: dict[int, list[torch.Tensor]] = {}
        self._leaves: dict[int, list[torch.Tensor]] = {}
        index = {id(p): i for i, (_, p) in enumerate(module.named_parameters())}
        named = dict(module.named_parameters())
        self._module_params = [named[name] for name in layout.names]  # in the flat layout's order
        # Where each parameter sits (a submodule's _parameters dict and the name in it; a tied one in several) and
        # which of the flat layout's tensors goes there: what run swaps.
        slots = [(module.get_submodule(full.rpartition(".")[0])._parameters, full.rpartition(".")[2], index[id(p)])
                 for full, p in module.named_parameters(remove_duplicate=False)]
        self._slot_dicts = [d for d, _, _ in slots]
        self._slot_names = [name for _, name, _ in slots]
        self._slot_order = None if [i for _, _, i in slots] == list(range(len(index))) else [i for _, _, i in slots]

    def restable(self, stable: set[int]) -> None:
        """The stable storages moved (a checkpoint was loaded): forget the cached views and leaves."""
        self.stable = stable
        self._views.clear()
        self._leaves.clear()

    def views(self, weights: torch.Tensor) -> list[torch.Tensor]:
        """Parameter-shaped views of ``weights``, cached for the stable storages."""
        key = weights.data_ptr()
        views = self._views.get(key)
        if views is None:
            views = list(self.layout.views(weights).values())
            if weights.untyped_storage().data_ptr() in self.stable:
                self._views[key] = views
        return views

    def leaves(self, weights: torch.Tensor) -> list[torch.Tensor]:
        """One autograd leaf per parameter, each a view of ``weights``, whose ``.grad`` is the parameter's
        slice of the stage's gradient buffer: a backward accumulates into it in place, inside autograd, as
        each gradient is produced (summing afterwards would hold all of a micro-batch's weight gradients
        at once and pass over them again). Per-parameter leaves (rather than one flat leaf) keep autograd from
        materialising a full-size zero gradient for every parameter slice. Leaves of the stable storages are
        cached like their views; micro-batches in flight may share them."""
        key = weights.data_ptr()
        leaves = self._leaves.get(key)
        if leaves is None:
            leaves = [view.detach().requires_grad_(True) for view in self.views(weights)]
            for leaf, accumulator in zip(leaves, self.grad_views):
                leaf.grad = accumulator
            if weights.untyped_storage().data_ptr() in self.stable:
                self._leaves[key] = leaves
        return leaves

    def run(self, params: Sequence[torch.Tensor], inputs: tuple[Any, ...]) -> Any:
        """The module on ``inputs`` with ``params`` (in the layout's order) swapped in as its parameters for this
        one call (what ``torch.func.functional_call`` does, without re-resolving names on every call)."""
        # map() over the slots, consumed by a zero-length deque: loops in C (this runs once per forward).
        dicts, names, order = self._slot_dicts, self._slot_names, self._slot_order
        originals = list(map(getitem, dicts, names))
        try:
            _consume(map(setitem, dicts, names, params if order is None else [params[i] for i in order]))
            module = self.module
            if calls_more_than_forward(module):
                return module(*inputs)
            # No hook to run: the generated forward itself, without the four Python frames of the module call
            # (GraphModule's wrapper, nn.Module's call and its dispatch) that would only find no hook.
            return module.forward(*inputs)
        finally:
            _consume(map(setitem, dicts, names, originals))

    def bind(self, weights: torch.Tensor) -> None:
        """Make the module's own parameters views of ``weights`` (the user's module sees the latest weights, e.g.
        for evaluation, without a copy)."""
        for param, view in zip(self._module_params, self.views(weights)):
            param.data = view
