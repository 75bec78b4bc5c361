"""Where a pipeline's stages are: every stage in this process, or this rank's stages under ``torchrun``.

A pipeline is built the same way and its steps run through the same executor either way; what differs is
answered by one :class:`Locality`, chosen once when the pipeline is built: :class:`~.one_process.OneProcess`
or :class:`~.rank_of_group.RankOfGroup`. It says which stages are here, builds the transport, the tied
gradients' exchange and the global gradient norm that fit, gathers objects from every process, brings the
mini-batch loss to every rank, says how long a mini-batch stays reachable by an error (how many undo points
to keep), agrees with the other processes on what a failure undoes, and runs :meth:`Pipeline.predict`'s
forwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

import torch
from torch import nn

if TYPE_CHECKING:
    from ..algorithms.base import Algorithm
    from ..runtime.executor import Executor
    from ..runtime.ties import TiedGradients
    from ..runtime.transport import Transport
    from ..schedule.ir import Action, Kind
    from .clip import GlobalNorm
    from .stage import TensorStage

#: What an executor action waits for besides its message (see ``Executor.needs``).
Needs = Callable[["Action"], Sequence[tuple[int, "Kind", int]]]


class Locality(Protocol):
    """What depends on whether every stage is in this process (one process) or only this rank's (torchrun)."""

    #: This process's pipeline rank; None in one process.
    rank: int | None
    #: This rank when its stages talk over NCCL (its stages are then on a GPU); None otherwise.
    nccl_rank: int | None
    #: What an error about an input missing on the first stage adds (where other ranks may pass None).
    input_note: str

    @property
    def process_rank(self) -> int | None:
        """This process's global rank under ``torch.distributed``; None in one process."""

    def stages_here(self, num_stages: int, placement: Sequence[int]) -> list[int]:
        """The stages this process runs, in order."""

    def concurrent_by_default(self, num_stages: int) -> bool:
        """Whether the stages here run on threads of their own unless the user says otherwise."""

    def release_other_stages(self, model: nn.Module, own: Sequence[nn.Module]) -> None:
        """Let go of the weights of the stages that run elsewhere (``own``: the modules of the stages here)."""

    def build_transport(self, algorithm: "Algorithm", devices: Sequence[torch.device],
                        stages: Sequence[int]) -> "Transport":
        """The transport that carries the activations and gradients between the stages."""

    def build_tie_exchange(self, owners: Mapping[str, tuple[int, ...]],
                           views: Mapping[int, Mapping[str, torch.Tensor]],
                           devices: Sequence[torch.device]) -> "TiedGradients":
        """The exchange of tied weights' gradients among their ``owners`` (``views``: per stage here, the
        slices of its gradient buffer that hold its tied weights' gradients)."""

    def build_global_norm(self, stages: Mapping[int, "TensorStage"]) -> "GlobalNorm":
        """The global gradient norm over every stage, for clipping a synchronous schedule's updates."""

    def completion_test(self, algorithm: "Algorithm", stages: Mapping[int, "TensorStage"],
                        needs: Needs | None) -> Callable[[int, int], bool]:
        """``complete(j, newest)``: whether no error can reach mini-batch ``j`` any more when mini-batch
        ``newest`` is about to be given, so that the undo points kept for ``j`` can go."""

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` from every process, in rank order (collective with one process per rank)."""

    def publish_loss(self, minibatch: int, loss: float) -> None:
        """The last stage has the loss of ``minibatch``: make it reach every rank."""

    def predict(self, stages: Mapping[int, "TensorStage"], chunks: list[Any], broadcast: bool) -> Any:
        """The model's output on the micro-batches ``chunks`` (held where stage 0 is), through every stage."""

    def report_failure(self, exc: BaseException, executor: "Executor", stages: Mapping[int, "TensorStage"]) -> None:
        """Tell the other processes what stopped this one, so that none waits for its timeout."""

    def agree_on_failure(self, exc: BaseException, failed: int, executor: "Executor",
                         stages: Mapping[int, "TensorStage"]) -> tuple[int, Callable[[int], None]]:
        """After ``exc`` stopped a step here (``failed``: the first mini-batch this process would undo): the first
        mini-batch every process undoes, and ``resync(first)``, which brings the exchanges between processes
        back in step, keeping what belongs to micro-batches before ``first``."""

    def end_flush(self, executor: "Executor") -> None:
        """After a flush's actions have run here: complete what was sent, and learn whether every process
        finished its share of the flush (raising if one failed)."""
