"""The fourth declaration: the state an algorithm keeps at a stage besides its weight versions and optimizer.

Some algorithms read weights derived from more than the stored versions: PipeMare corrects a backward's weights
along a running average of the weight changes, SpecTrain extrapolates along the optimizer's next step. Each such
quantity is a buffer the size of the stage's weights, declared by the algorithm (:class:`StateBuffer`) with how it
changes after each update (:class:`BufferUpdate`); the derivations that read it name it
(:meth:`WeightSource.buffer`). The runtime keeps what is declared without knowing what it means: it allocates
each buffer (zero, in the optimizer state's dtype), updates it after every applied update, snapshots it for
undoing a failed step, saves and loads it in checkpoints, maps it by parameter name between layouts (universal
checkpoints) and counts it in the memory account, the planner's memory model and ``stats()``.

A derivation (:data:`pipecore.algorithms.base.Derive`) turns a :class:`~pipecore.algorithms.base.WeightRead` that names it into weights:
the algorithm declares the derivations its read rules name (``AlgorithmSpec.derivations``), and the stage
materializes a read through them into its scratch buffer.

A gradient transform (:class:`GradientTransform`, ``AlgorithmSpec.gradient_transform``) changes the gradient an
update applies just before the optimizer's step: delay compensation corrects it by the weights it was computed at,
the Nesterov method of asynchronous pipelines rewrites it for the optimizer's momentum. What it reads
(:class:`BeforeStep`) is the live weights, the weights the gradient was computed at (kept in the ring until the
update when the transform asks for them), the optimizer and the declared buffers, which it may change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch


class AfterUpdate(Protocol):
    """What a buffer's update may read, after its stage applied an update."""

    #: The weights before the update (flat): given only to updates that ask for them
    #: (:attr:`BufferUpdate.reads_previous_weights`), since an update in place overwrites them.
    previous: torch.Tensor | None
    #: The new weights (flat, the new live version).
    weights: torch.Tensor
    #: The gradient the update applied (the flat gradient buffer, after tied sums and clipping).
    grad: torch.Tensor
    #: The stage's optimizer (a :class:`~pipecore.engine.optim.StageOptimizer`), after its step.
    optimizer: Any


class BufferUpdate(ABC):
    """How a declared buffer changes when its stage applies an update (skipped updates leave it unchanged)."""

    #: Whether :meth:`apply` reads ``previous``: the stage then keeps a copy of the old weights across an update
    #: that overwrites them.
    reads_previous_weights: bool = False

    def check(self, optimizer: Any) -> None:
        """Refuse, with a ``TypeError`` that says what to use, an optimizer that cannot provide what :meth:`apply`
        reads. Called once per stage, when the pipeline is built."""

    def kept_with(self, optimizer: Any) -> bool:
        """Whether a stage with this optimizer keeps the buffer at all (asked once per stage, after :meth:`check`).
        A buffer only some optimizers need says no to the others: the stage then allocates, saves and counts none.
        (The planner, which does not know the optimizer, counts every declared buffer.)"""
        return True

    @abstractmethod
    def apply(self, buffer: torch.Tensor, after: AfterUpdate) -> None:
        """Update ``buffer`` in place."""


class ChangedBeforeStep(BufferUpdate):
    """A buffer only the algorithm's :class:`GradientTransform` changes, before the optimizer's step; nothing
    changes it after the step. ``optimizers`` (a predicate of the stage's optimizer, None: every one) says with
    which optimizers a stage keeps it."""

    def __init__(self, optimizers: Callable[[Any], bool] | None = None):
        self.optimizers = optimizers

    def kept_with(self, optimizer: Any) -> bool:
        return self.optimizers is None or bool(self.optimizers(optimizer))

    def apply(self, buffer: torch.Tensor, after: AfterUpdate) -> None:
        pass


@dataclass(frozen=True)
class ChangeAverage(BufferUpdate):
    """``buffer <- decay * buffer + (1 - decay) * (W_new - W_old)``: the running average of the change each
    update makes to the weights, in the buffer's dtype. Optimizers whose update is one fused pass fold it into
    that pass (:meth:`~pipecore.engine.optim.StageOptimizer.step_averaging_change`)."""

    decay: float
    reads_previous_weights = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"the weight-change average needs 0 <= decay < 1, got {self.decay}")

    def apply(self, buffer: torch.Tensor, after: AfterUpdate) -> None:
        assert after.previous is not None
        add_change(buffer, self.decay, after.previous, after.weights)


def add_change(buffer: torch.Tensor, decay: float, old: torch.Tensor, new: torch.Tensor) -> None:
    """``buffer <- decay * buffer + (1 - decay) * (new - old)`` in the buffer's dtype: :class:`ChangeAverage`'s
    step, which optimizers without a fused form of it run after their own."""
    dtype = buffer.dtype
    buffer.mul_(decay).add_(new.to(dtype) - old.to(dtype), alpha=1.0 - decay)


@dataclass(frozen=True)
class StateBuffer:
    """A weight-sized buffer an algorithm keeps at each stage that ``update`` gives an update for.

    Attributes:
        name: its key in checkpoints, ``stats()["buffers"]`` and :meth:`WeightSource.buffer`.
        label: how messages name it (``"weight velocity"``).
        update: ``(stage, algorithm) -> BufferUpdate`` for a stage that keeps the buffer, None for one that keeps
            none (``algorithm`` is the configured :class:`~pipecore.algorithms.base.Algorithm`).
        saved_as: where checkpoints of pipecore's state format 2 held it in a stage's entry (``"velocity"``, or
            ``"optimizer.next_direction"`` inside the optimizer state), so that they still load.
    """

    name: str
    label: str
    update: Callable[[int, Any], BufferUpdate | None]
    saved_as: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"a state buffer's name must be an identifier, got {self.name!r}")


class BeforeStep(Protocol):
    """What a :class:`GradientTransform` reads, just before its stage's optimizer steps."""

    #: The live weights the update applies to (flat).
    weights: torch.Tensor
    #: The weights the gradient was computed at (flat: the version its backward read), for a transform that
    #: reads them (:attr:`GradientTransform.reads_gradient_weights`); None otherwise.
    gradient_weights: torch.Tensor | None
    #: The stage's optimizer (a :class:`~pipecore.engine.optim.StageOptimizer`), before its step.
    optimizer: Any
    #: ``(start, stop)`` ranges of the flat buffers holding weights tied to copies at other stages. Every owner
    #: applies the same (summed) gradient to its copy so that the copies stay identical: a transform must change
    #: these ranges alike on every owner (not by what only this stage holds, such as its stash) or leave them.
    tied: Sequence[tuple[int, int]]

    def buffer(self, name: str) -> torch.Tensor:
        """The stage's declared buffer ``name``, which the transform may change."""


class GradientTransform(ABC):
    """How an algorithm changes the gradient an update applies, in place, before the optimizer's step (skipped
    updates apply none and transform none).

    Declared per stage by ``AlgorithmSpec.gradient_transform`` (``(stage, algorithm) -> GradientTransform | None``).
    The gradient is the flat gradient buffer after tied sums, the replicas' sum and clipping; the optimizer steps
    with what the transform leaves there, and the declared buffers' updates after the step read the same.
    """

    #: Whether :meth:`apply` reads ``before.gradient_weights``: the version book then keeps the version each
    #: backward read until the update that applies its gradient (one more version in the ring while a gradient
    #: waits for its update, which the simulator counts), and the update's gradient must come from one version.
    reads_gradient_weights: bool = False

    def check(self, optimizer: Any) -> None:
        """Refuse, with a ``TypeError`` that says what to use, an optimizer the transform cannot work with. Called
        once per stage, when the pipeline is built."""

    @abstractmethod
    def apply(self, grad: torch.Tensor, before: BeforeStep) -> None:
        """Transform ``grad`` in place."""


class WeightSource(Protocol):
    """What a derivation reads from the stage that materializes the weights."""

    def slot_of(self, version: int) -> torch.Tensor:
        """The flat weights of ``version``."""

    def buffer(self, name: str) -> torch.Tensor:
        """The stage's declared buffer ``name`` (a ``ValueError`` if the stage keeps none of that name)."""

    @property
    def optimizer(self) -> Any:
        """The stage's optimizer."""

    def next_lr(self) -> float:
        """The learning rate of the stage's next update (before per-stage scaling)."""

