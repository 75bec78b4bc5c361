"""Backward rules: how a stage's backward differentiates with the weights its read names.

A forward reads one weight version and a backward may read another (the version policy decides). Each rule
is one way to give the backward its weights, chosen by the algorithm's ``backward_rule`` option:

* ``stash`` (:class:`Stash`): the forward's graph keeps the forward's own weights, pinned until the backward,
  which reads them whatever else the read rule names (PipeDream's weight stashing; for another algorithm
  this changes what its backwards read, and the simulator's trace shows it).
* ``swap`` (:class:`Swap`): the forward's graph saves its weights as references (``saved_tensors_hooks``),
  resolved to the backward's read when the backward runs. One forward, no copy of the weights.
* ``recompute`` (:class:`Recompute`): the forward keeps only its inputs; the backward runs the forward again
  with its own read, replaying the forward's random state (dropout masks) on copies of the buffers
  (BatchNorm's running statistics count each micro-batch once).

A rule builds the :class:`InFlight` record of a forward, turns it into what the backward differentiates
(:meth:`BackwardRule.graph`), and wraps every autograd pass of that backward (:meth:`BackwardRule.reading`).
The stage runs the rest (inputs, outputs, the loss, gradients), the same for every rule. A rule sees its stage
only through :class:`RuleStage`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Protocol, Sequence

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.overrides import TorchFunctionMode

from ..algorithms.base import WeightRead
from .buffers import buffer_copies
from .saved import saving

if TYPE_CHECKING:
    from .flat import FlatLayout
    from .inputs import LossTarget
    from .memory import MemoryAccount

# Stage threads share torch's global random generator. The recompute rule saves its state before a
# forward and replays it to recompute that forward in the backward: no other stage may draw in between
# (the saved state would not be the one the forward drew from), and the replay, which restores the state
# afterwards, must not rewind another stage's draws.
GLOBAL_RANDOM = threading.Lock()
_new_tuple = tuple.__new__


class RuleStage(Protocol):
    """What a backward rule uses of its stage (a :class:`~pipecore.engine.stage.TensorStage`)."""

    stage: int
    device: torch.device
    module: nn.Module
    layout: "FlatLayout"
    memory: "MemoryAccount"
    autocast: torch.dtype | None  # the dtype its forwards autocast to, if any

    def materialize(self, read: WeightRead) -> torch.Tensor:
        """The flat weights ``read`` names."""

    def weight_views(self, weights: torch.Tensor) -> list[torch.Tensor]:
        """Parameter-shaped views of the flat ``weights``."""

    def weight_leaves(self, weights: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter autograd leaves viewing ``weights``, accumulating into the stage's gradient buffer."""

    def autocasting(self) -> AbstractContextManager[Any]:
        """Where a forward runs (autocast, if the stage has a dtype for it)."""

    def run_forward(self, k: int, params: Sequence[torch.Tensor], inputs: tuple[Any, ...],
                    target: LossTarget | None) -> Any:
        """Micro-batch ``k``'s forward with ``params``: the loss at the last stage (recorded), the checked
        outputs before it."""

    def rerun_forward(self, params: Sequence[torch.Tensor], inputs: tuple[Any, ...],
                      target: LossTarget | None) -> Any:
        """The same forward run again for its backward, recording nothing."""


@dataclass
class InFlight:
    """What a forward leaves for its backward."""

    inputs: tuple[Any, ...]               # the stage's arguments (those that carry a gradient require grad)
    leaves: list[torch.Tensor] | None     # per-parameter autograd leaves (views of the weights read)
    outputs: Any                          # the values sent (a tuple), or the last stage's loss
    rng_state: Any = None                 # kept only under the recompute rule: (CPU state, CUDA state or None)
    target: LossTarget | None = None      # last stage, recompute rule: the loss is recomputed too
    # The graph reaches tensors from outside the stage that require grad (a user input at the first stage, a
    # target at the last): its backward must name the leaves it accumulates into (see TensorStage._every_leaf).
    outside_grad: bool = False


class BackwardGraph(NamedTuple):
    """What one micro-batch's backward differentiates: the output (the loss, or the values sent), the leaves
    its weight gradients go to, the stage's inputs, and the weights its autograd passes read (see
    :meth:`BackwardRule.reading`; None where the graph already holds them). A named tuple: one per backward,
    built by ``tuple.__new__`` where that is the hot path."""

    leaves: list[torch.Tensor]
    outputs: Any
    inputs: tuple[Any, ...]
    weights: torch.Tensor | None = None


class BackwardRule(ABC):
    """One way to give a backward its weights (see the module docstring). One instance per stage."""

    name: str
    #: Whether the backward's autograd passes must be run inside :meth:`reading` (the rule gives them other
    #: weights than the graph holds); the others run without entering a context.
    swaps_weights: bool = False

    @abstractmethod
    def forward(self, stage: RuleStage, k: int, weights: torch.Tensor, derived: bool, inputs: tuple[Any, ...],
                target: LossTarget | None) -> tuple[Any, InFlight]:
        """Run micro-batch ``k``'s forward on ``weights`` (``derived``: the scratch buffer, which the next
        derived read overwrites); return the stage's output (checked outputs, or the loss at the last stage)
        and what the backward needs."""

    @abstractmethod
    def graph(self, stage: RuleStage, record: InFlight, read: WeightRead) -> BackwardGraph:
        """What the backward of ``record``'s micro-batch differentiates, reading the weights ``read`` names."""

    def reading(self, weights: torch.Tensor | None) -> AbstractContextManager[Any]:
        """Around each autograd pass of a backward: the saved weights it unpacks are ``weights``."""
        return nullcontext()


class Stash(BackwardRule):
    """The graph keeps the forward's own weights; the backward differentiates it as it is."""

    name = "stash"

    def forward(self, stage, k, weights, derived, inputs, target):
        if derived:
            # The scratch is reused; the backward needs these exact values (the leaves, views of the copy,
            # keep it alive until then).
            weights = weights.clone()
        leaves = stage.weight_leaves(weights)
        if stage.autocast is None and not stage.memory.enabled:  # no context to enter: this runs once per forward
            y = stage.run_forward(k, leaves, inputs, target)
        else:
            with stage.autocasting(), stage.memory.hooks():
                y = stage.run_forward(k, leaves, inputs, target)
        return y, InFlight(inputs, leaves, y)

    def graph(self, stage, record, read):
        # The read is the forward's. (BackwardGraph without its Python-level __new__: once per backward.)
        return _new_tuple(BackwardGraph, (record.leaves, record.outputs, record.inputs, None))


class _WeightRef:
    """A saved weight tensor, recorded as its layout inside the flat weights it was a view of."""

    __slots__ = ("size", "stride", "offset")

    def __init__(self, size: torch.Size, stride: tuple[int, ...], offset: int):
        self.size, self.stride, self.offset = size, stride, offset


class Swap(BackwardRule):
    """Saved weights are references into the flat weights, resolved to the backward's read when it unpacks
    them. A saved tensor is one of the weights when it shares the flat buffer's storage: autograd hands the
    pack hook new tensor objects, so only the memory they view identifies them."""

    name = "swap"
    swaps_weights = True

    def __init__(self) -> None:
        self._packing: torch.Tensor | None = None  # the forward's flat weights, while it runs
        self._memory: Any = None  # the stage's memory account, while a forward runs
        self._unpack_target: torch.Tensor | None = None  # the backward's flat weights, while it runs
        # The check for weights transformed before they are saved runs on the first forward only.
        self._tracker: _WeightDerived | None = None
        self._checked = False
        self._names: Sequence[str] = ()
        self._stage = -1

    def forward(self, stage, k, weights, derived, inputs, target):
        leaves = stage.weight_leaves(weights)
        self._packing, self._memory, self._names, self._stage = weights, stage.memory, stage.layout.names, stage.stage
        tracker = self._tracker = None if self._checked else _WeightDerived(leaves, inputs)
        try:
            with saving(self._pack, self._unpack), (tracker if tracker is not None else nullcontext()):
                y = stage.run_forward(k, leaves, inputs, target)
        finally:
            self._packing = self._memory = self._tracker = None
        self._checked = True
        return y, InFlight(inputs, leaves, y)

    def graph(self, stage, record, read):
        return BackwardGraph(record.leaves, record.outputs, record.inputs, stage.materialize(read))

    @contextmanager
    def reading(self, weights: torch.Tensor | None) -> Iterator[None]:
        self._unpack_target = weights
        try:
            yield
        finally:
            self._unpack_target = None

    def _pack(self, t: torch.Tensor) -> Any:
        flat = self._packing
        if flat is not None and t.device == flat.device and t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
            offset = t.storage_offset() - flat.storage_offset()
            if 0 <= offset < flat.numel():
                self._memory.note(t)
                return _WeightRef(t.size(), t.stride(), offset)
        self._check_saved(t)
        # Counted, and saved as a detached alias: a node's own output saved as itself would hold its node in a cycle
        # (see pipecore.engine.memory).
        return self._memory.pack(t)

    def _check_saved(self, t: torch.Tensor) -> None:
        """A saved tensor computed from the weights alone (a cast, a parametrization) would keep the forward's
        values: the backward could not swap it. Checked on the first forward."""
        tracker = self._tracker
        if tracker is None:
            return
        # Operators save views (a linear saves its weight transposed): the view's base is what was recorded.
        sources = tracker.derived.get(id(t)) or (tracker.derived.get(id(t._base)) if t._base is not None else None)
        if sources:
            params = [self._names[i] for i in sorted(sources)]
            modules = sorted({name.rpartition(".")[0] or "(the stage's top module)" for name in params})
            raise ValueError(
                f"stage {self._stage}: module(s) {', '.join(modules)} transform their weights before autograd saves them (a cast, a "
                f"parametrization or a compiled module; parameters {', '.join(params)}), so the 'swap' backward "
                "rule cannot give the backward other weights than the forward's; pass backward_rule='recompute' "
                "(or 'stash')"
            )

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _WeightRef):
            target = self._unpack_target
            assert target is not None, "a saved weight was unpacked outside a backward"
            return target.as_strided(packed.size, packed.stride, target.storage_offset() + packed.offset)
        return packed


class Recompute(BackwardRule):
    """The forward keeps its inputs and random state; the backward recomputes it with its own read."""

    name = "recompute"

    def forward(self, stage, k, weights, derived, inputs, target):
        with GLOBAL_RANDOM, torch.no_grad():
            rng = _random_state(stage.device)
            with stage.autocasting():
                y = stage.run_forward(k, stage.weight_views(weights), inputs, target)
        return y, InFlight(inputs, None, None, rng, target)

    def graph(self, stage, record, read):
        params = stage.weight_leaves(stage.materialize(read))
        inputs = tuple(x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.requires_grad else x
                       for x in record.inputs)
        cuda = [stage.device] if stage.device.type == "cuda" else []
        # The forward's random state (dropout masks) and buffers: the recomputation must draw the same masks,
        # and BatchNorm must not count the micro-batch in its running statistics twice.
        with GLOBAL_RANDOM, torch.random.fork_rng(devices=cuda), buffer_copies([stage.module]), \
                stage.autocasting(), stage.memory.counting() as recomputed, stage.memory.hooks():
            _set_random_state(record.rng_state, stage.device)
            outputs = stage.rerun_forward(params, inputs, record.target)
        stage.memory.transient(recomputed.nbytes())  # counts against the stage on the CPU (CUDA's allocator sees it)
        return BackwardGraph(params, outputs, inputs)


#: The rules by the names ``backward_rule`` takes.
RULES: dict[str, type[BackwardRule]] = {rule.name: rule for rule in (Stash, Swap, Recompute)}


def _random_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_random_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


class _WeightDerived(TorchFunctionMode):
    """Records, during one forward, which tensors are computed from the weights alone (a cast, a
    parametrization, ``weight * mask``): outputs of torch functions that take a weight or such a tensor and no
    value computed from the stage's inputs. Constants (buffers, numbers) do not count either way."""

    def __init__(self, weights: Sequence[torch.Tensor], inputs: Sequence[Any]):
        super().__init__()
        self.weight_index = {id(w): i for i, w in enumerate(weights)}
        self.data = {id(x) for x in inputs if isinstance(x, torch.Tensor)}
        self.derived: dict[int, set[int]] = {}  # id of a weight-derived tensor -> the weights it comes from
        self._keep: list[torch.Tensor] = []  # the tensors recorded, kept alive so that their ids stay theirs

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if any(id(t) in self.data for t in tensors):
            self.data.update(id(t) for t in outputs)
            self._keep += outputs
            return out
        sources: set[int] = set()
        for t in tensors:
            if id(t) in self.weight_index:
                sources.add(self.weight_index[id(t)])
            sources |= self.derived.get(id(t), set())
        if sources:
            for t in outputs:
                self.derived[id(t)] = sources
            self._keep += outputs
        return out
