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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Protocol

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

    @abstractmethod
    def apply(self, buffer: torch.Tensor, after: AfterUpdate) -> None:
        """Update ``buffer`` in place."""


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

