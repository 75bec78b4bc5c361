"""Every stage in this process: the :class:`~.locality.Locality` of a pipeline without ``torch.distributed``."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ..algorithms.base import Algorithm
from ..runtime.executor import Executor
from ..runtime.ties import LocalTiedGradients
from ..runtime.transport import LocalTransport, Transport
from .clip import GlobalNorm, LocalGlobalNorm
from .locality import Needs
from .prediction import concatenate, forward_here
from .stage import TensorStage


class OneProcess:
    """The pipeline owns every stage: messages, tied gradients and norms stay in this process, and an error
    reaches every stage at once."""

    rank = None
    nccl_rank = None
    input_note = ""

    def __init__(self, timeout: float):
        self.timeout = timeout  # how long a stage thread waits for another stage's message

    @property
    def process_rank(self) -> int | None:
        return None

    def stages_here(self, num_stages: int, placement: Sequence[int]) -> list[int]:
        return list(range(num_stages))

    def concurrent_by_default(self, num_stages: int) -> bool:
        return num_stages > 1  # one thread per stage, when there are several to overlap

    def release_other_stages(self, model: nn.Module, own: Sequence[nn.Module]) -> None:
        """Every stage runs here: the model keeps all its weights."""

    def build_transport(self, algorithm: Algorithm, devices: Sequence[torch.device],
                        stages: Sequence[int]) -> Transport:
        return LocalTransport(self.timeout)

    def build_tie_exchange(self, owners: Mapping[str, tuple[int, ...]],
                           views: Mapping[int, Mapping[str, torch.Tensor]],
                           devices: Sequence[torch.device]) -> LocalTiedGradients:
        return LocalTiedGradients(owners)

    def build_global_norm(self, stages: Mapping[int, TensorStage]) -> GlobalNorm:
        return LocalGlobalNorm(stages)

    def completion_test(self, algorithm: Algorithm, stages: Mapping[int, TensorStage],
                        needs: Needs | None) -> Callable[[int, int], bool]:
        m, every = algorithm.n_microbatches, algorithm.update_every

        def complete(j: int, newest: int) -> bool:
            # Once every stage has applied the update of its last group (after all its backwards).
            last_update = (j + 1) * m // every
            return all(st.book.live - st.book.base >= last_update for st in stages.values())

        return complete

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def publish_loss(self, minibatch: int, loss: float) -> None:
        """The loss is where :meth:`Pipeline.step` returns it: nothing travels."""

    def predict(self, stages: Mapping[int, TensorStage], chunks: list[Any], broadcast: bool) -> Any:
        return concatenate([forward_here(stages, payload) for payload in chunks])

    def report_failure(self, exc: BaseException, executor: Executor, stages: Mapping[int, TensorStage]) -> None:
        """No other process waits: the stages here see the error themselves."""

    def agree_on_failure(self, exc: BaseException, failed: int, executor: Executor,
                         stages: Mapping[int, TensorStage]) -> tuple[int, Callable[[int], None]]:
        return failed, _in_step

    def end_flush(self, executor: Executor) -> None:
        """The flush's actions ran on every stage: nothing is left to complete or confirm."""


def _in_step(first: int) -> None:
    """In one process the transport and the exchanges are taken back with the stages: nothing to bring back."""
