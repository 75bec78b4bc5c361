"""Point-to-point transport over ``torch.distributed`` (gloo on CPU, NCCL on GPU): one process per stage.

Rank ``s`` runs stage ``s``. Every message is a small int64 header (what it is, the micro-batch, the
stage-0 version tag, the non-finite mark, dtype and shape) followed by the tensor, so activations whose
shape changes between steps need no configuration.

Ordering rule (why no pair of ranks can deadlock): sends are posted without waiting (``isend``) and are only
completed later; the only blocking operation is the receive of the input of the next action in the rank's
own schedule. A rank therefore never waits for anything but a message that the schedule's dependency
order guarantees its neighbour produces first; since the schedule is validated deadlock-free, every
receive is eventually matched. Messages on one link travel in one direction per kind (activations to
``s+1``, gradients to ``s-1``) and in schedule order, which is the order the receiver posts its receives.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from ..schedule.ir import B, F, Kind
from .worker import Message

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]
_MAX_DIMS = 8
_HEADER = 8 + _MAX_DIMS  # kind, microbatch, tag, poisoned, dtype, ndim, has_payload, reserved, shape...
_KIND_CODE = {F: 0, B: 1}
_TAGS = {F: 1, B: 2}


class PeerError(RuntimeError):
    """A neighbouring rank died, stopped answering, or sent something this stage cannot take."""


class DistributedTransport:
    """Sends and receives stage messages between neighbouring ranks of the default process group."""

    def __init__(self, rank: int, num_stages: int, timeout: float = 30.0, device: torch.device | None = None):
        self.rank = rank
        self.num_stages = num_stages
        self.timeout = datetime.timedelta(seconds=timeout)
        self.device = device or torch.device("cpu")
        self._pending: list[tuple[Any, Any]] = []  # (work, tensor kept alive until the send completes)

    # Sending ---------------------------------------------------------------------------------------

    def send(self, stage: int, kind: Kind, microbatch: int, message: Message) -> None:
        payload = message.payload
        if payload is not None and not isinstance(payload, torch.Tensor):
            raise TypeError(f"rank {self.rank}: stages exchange tensors, got {type(payload).__name__}")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = _KIND_CODE[kind]
        header[1] = microbatch
        header[2] = -1 if message.tag is None else message.tag
        header[3] = int(message.poisoned)
        if payload is not None:
            if payload.dim() > _MAX_DIMS:
                raise ValueError(f"rank {self.rank}: activations may have at most {_MAX_DIMS} dimensions")
            if payload.dtype not in _DTYPES:
                raise ValueError(f"rank {self.rank}: cannot send dtype {payload.dtype}")
            header[4] = _DTYPES.index(payload.dtype)
            header[5] = payload.dim()
            header[6] = 1
            header[8: 8 + payload.dim()] = torch.tensor(payload.shape, dtype=torch.int64)
        self._isend(header.to(self.device), stage, kind)
        if payload is not None:
            self._isend(payload.detach().contiguous(), stage, kind)
        self._prune()

    def _isend(self, tensor: torch.Tensor, dst: int, kind: Kind) -> None:
        self._pending.append((dist.isend(tensor, dst, tag=_TAGS[kind]), tensor))

    def _prune(self) -> None:
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def wait_sends(self) -> None:
        """Complete every posted send (before a flush ends or the process exits)."""
        for work, _ in self._pending:
            self._wait(work, "delivering a message to a neighbour", None)
        self._pending.clear()

    # Receiving -------------------------------------------------------------------------------------

    def ready(self, stage: int, kind: Kind, microbatch: int) -> bool:
        return True  # receive blocks (with a timeout) until the message is there

    def receive(self, stage: int, kind: Kind, microbatch: int) -> Message:
        src = stage - 1 if kind is F else stage + 1
        what = f"the {'activation' if kind is F else 'gradient'} of micro-batch {microbatch}"
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        self._wait(dist.irecv(header, src, tag=_TAGS[kind]), what, src)
        header = header.cpu()
        got_kind, got_mb = int(header[0]), int(header[1])
        if (got_kind, got_mb) != (_KIND_CODE[kind], microbatch):
            raise PeerError(
                f"rank {self.rank} expected {what} from rank {src} but received kind {got_kind} of micro-batch "
                f"{got_mb}: the ranks run different schedules (same algorithm, stages and micro-batches everywhere?)"
            )
        payload = None
        if int(header[6]):
            shape = [int(d) for d in header[8: 8 + int(header[5])]]
            payload = torch.empty(shape, dtype=_DTYPES[int(header[4])], device=self.device)
            self._wait(dist.irecv(payload, src, tag=_TAGS[kind]), what, src)
        tag = int(header[2])
        return Message(payload, None if tag < 0 else tag, poisoned=bool(header[3]))

    def _wait(self, work: Any, what: str, peer: int | None) -> None:
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as exc:
            who = f"rank {peer}" if peer is not None else "a neighbouring rank"
            raise PeerError(
                f"rank {self.rank}: {who} failed while {what} was expected ({exc.__class__.__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); it died or stopped answering "
                f"(timeout {self.timeout.total_seconds():g} s)"
            ) from exc
        if ok is False:
            who = f"rank {peer}" if peer is not None else "a neighbouring rank"
            raise PeerError(f"rank {self.rank}: no answer from {who} within {self.timeout.total_seconds():g} s "
                            f"while waiting for {what}")
