"""What a pipeline is made of: its :class:`Settings`, known when it is constructed, and the :class:`Parts` built
from the captured graph (:func:`~pipecore.engine.build.prepare` and :func:`~pipecore.engine.build.assemble` make
them; the pipeline's steps, recovery, prediction, state and statistics read the parts). Without
``example_input``, a model that ``torch.fx`` cannot capture has its settings from construction and its parts
from the first step (see ``engine/lazy.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..algorithms.base import Algorithm
from ..runtime.choice import ThreadsOrInTurn
from ..runtime.threads import StageThreads
from ..runtime.transport import Transport
from ..schedule.ties import TieSync
from .clip import DistributedGlobalNorm, GlobalNorm
from .data_parallel import Topology
from .graph import CapturedModel, StageGraph
from .inputs import LossTarget
from .locality import Locality
from .stage import TensorStage


@dataclass
class Settings:
    """The pipeline's arguments, checked, and what follows from them without the graph: the algorithm, where the
    stages run and which of them run in this process."""

    #: The model as given to the pipeline.
    model: nn.Module | Sequence[nn.Module]
    #: The module the pipeline trains: the model, unwrapped from ``torch.compile``, a list of modules as an
    #: ``nn.Sequential`` (whose mode ``Pipeline.train()`` sets).
    module: nn.Module
    algorithm: Algorithm
    num_stages: int
    n_microbatches: int
    on_nonfinite: str
    #: The rank (worker thread, or process) of every stage: several stages share one with ``stages_per_rank``.
    placement: tuple[int, ...]
    num_ranks: int
    #: Where this process is among the pipeline's replicas and ranks (None: everything in this process).
    topology: Topology | None
    locality: Locality
    data_parallel: int
    replica: int
    recover: bool
    #: Whether the stages here run on threads of their own.
    concurrent: bool
    #: The stages this process runs, in order.
    owned: list[int]
    threads_per_stage: int
    overlap_steps: bool
    lr_scheduler: Callable[..., Any] | None
    autocast: torch.dtype | None
    clip_grad_norm: float | None
    # What building the stages takes, as the pipeline was given it (see Pipeline).
    optimizer: Any
    loss_fn: Callable[..., Any]
    partition: Any
    leaf_modules: Sequence[type | str]
    capture: str
    device_choice: Any
    concurrent_choice: bool | None
    split_backward: bool
    track_memory: bool
    timeout: float

    @property
    def rank(self) -> int | None:
        """This process's pipeline rank (None: one process runs every stage)."""
        return self.locality.rank


@dataclass
class Parts(Settings):
    """The model cut into stages, the stages this process runs, and what connects them."""

    captured: CapturedModel
    stage_graphs: list[StageGraph]
    stage_layers: list[list[str]]
    #: The state_dict keys of every stage, this process's or not (a full state names them all).
    stage_keys: list[list[str]]
    #: Per stage, a tied weight's other names (aliases), served from the one name its first stage holds it under.
    aliases: list[dict[str, str]]
    #: Shape and dtype of every value that crosses a cut, when an example input was given.
    boundary_meta: dict[str, str] | None
    devices: list[torch.device]
    stages: dict[int, TensorStage]
    #: The first stage's input of every micro-batch given and not yet taken (the executor's source).
    inputs: dict[int, Any]
    #: The last stage's target of every micro-batch given and not yet taken (the stage's loss pops it).
    targets: dict[int, LossTarget]
    ties: dict[str, tuple[tuple[int, str], ...]]
    tie_sync: TieSync | None
    tie_exchange: Any
    global_norm: GlobalNorm | None
    transport: Transport
    #: With several replicas, the groups each stage's gradients are summed over.
    dp_group: Any
    #: Worker threads, one per rank (a rank runs its stages' actions in one list), kept from step to step.
    threads: StageThreads | None
    #: Threads or in turn, timed (the default with every stage on the CPU); None: fixed by ``threads``.
    choice: ThreadsOrInTurn | None

    def release(self, deliver: bool) -> None:
        """Release the stage threads and the connections between processes (after delivering what was sent
        if ``deliver``)."""
        if self.threads is not None:
            self.threads.close()
        if isinstance(self.global_norm, DistributedGlobalNorm):
            self.global_norm.close()
        try:
            if self.tie_exchange is not None:
                self.tie_exchange.close(deliver)
        finally:
            self.transport.close(deliver)
