"""Where a tensor stage computes: its device, its CUDA stream, its intra-op threads and its profiler ranges.

These are the stage worker's hooks for where and how the compute runs (``running``, ``action_range``, ``accept``,
``stamp``; see :class:`~pipecore.runtime.worker.StageWorker`), written once for every tensor stage as a base class of
:class:`~pipecore.engine.stage.TensorStage`: the worker calls them as its own methods, with no call in between.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Iterator, Mapping

import torch

from ..algorithms.base import WeightRead
from ..runtime.worker import Message
from ..schedule.ir import Action, traced
from .inputs import to_device

_profiler_enabled = torch.autograd._profiler_enabled


class OnDevice:
    """The stage worker's hooks for a stage on ``device``; :meth:`place` sets what they read."""

    def place(self, device: torch.device) -> None:
        """Compute on ``device``: no stream of its own yet (see :meth:`compute_on`), the thread count as set."""
        self.device = device
        # The stream this stage computes on when stages run concurrently on CUDA (see compute_on).
        self.stream: Any = None
        # torch intra-op threads of its runs on a stage thread (Pipeline's threads_per_stage; None: as set).
        self.intra_op_threads: int | None = None
        self._nvtx = device.type == "cuda"

    def compute_on(self, stream: Any, intra_op_threads: int | None) -> None:
        """Compute on ``stream`` (None: the thread's current one) with ``intra_op_threads`` torch threads (None:
        as set). A stream of its own lets a stage on its own thread overlap its kernels with other stages';
        messages then carry CUDA events (see :meth:`stamp`, :meth:`accept`)."""
        self.stream = stream
        self.intra_op_threads = intra_op_threads

    def running(self) -> AbstractContextManager[Any]:
        # Entered on a stage thread after the caller's torch state (pipecore._C.ThreadState), which sets the
        # thread's intra-op count to the one last set on any thread: this stage's count again, so that every
        # run computes with it (a reduction's bits depend on it).
        if self.intra_op_threads is not None and torch.get_num_threads() != self.intra_op_threads:
            torch.set_num_threads(self.intra_op_threads)
        return nullcontext() if self.stream is None else self._on_own_stream()

    @contextmanager
    def _on_own_stream(self) -> Iterator[None]:
        ambient = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(ambient)  # what the caller queued before the run (inputs, loaded weights)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            ambient.wait_stream(self.stream)  # and whatever the caller does after the run sees its results

    def action_range(self, action: Action, reads: Mapping[int, WeightRead]) -> AbstractContextManager[Any] | None:
        if not (self._nvtx or _profiler_enabled()):
            return None  # the check costs far less than an idle record_function
        return ActionRange(traced(action, reads), self._nvtx)

    def accept(self, message: Message) -> Any:
        payload = message.payload
        if message.event is not None:
            # Computed on another stage's stream. What reads it here runs on this thread's current stream of
            # its device (this stage's own stream on the same device; a copy to another device runs on the
            # source device's current stream): that stream waits for the event, and the allocator learns that
            # it uses the memory, so the sender's stream cannot reuse it too early.
            tensors = [t for t in _tensors(payload) if t.is_cuda]
            for device in {t.device for t in tensors}:
                torch.cuda.current_stream(device).wait_event(message.event)
            for t in tensors:
                t.record_stream(torch.cuda.current_stream(t.device))
        return to_device(payload, self.device)

    def stamp(self, message: Message) -> Message:
        if self.stream is not None and message.payload is not None:
            message.event = torch.cuda.Event()
            message.event.record()  # on the stream that computed the payload: the current one
        return message


class ActionRange:
    """A ``torch.profiler`` range, and an NVTX range on CUDA, around one action."""

    __slots__ = ("name", "nvtx", "_record")

    def __init__(self, name: str, nvtx: bool):
        self.name, self.nvtx = name, nvtx
        self._record: Any = None

    def __enter__(self) -> None:
        if torch.autograd._profiler_enabled():
            self._record = torch.autograd.profiler.record_function(self.name)
            self._record.__enter__()
        if self.nvtx:
            torch.cuda.nvtx.range_push(self.name)

    def __exit__(self, *exc: Any) -> None:
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        if self._record is not None:
            self._record.__exit__(*exc)


def _tensors(payload: Any) -> list[torch.Tensor]:
    if isinstance(payload, torch.Tensor):
        return [payload]
    if isinstance(payload, tuple):
        return [t for t in payload if isinstance(t, torch.Tensor)]
    return []
