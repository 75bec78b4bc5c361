"""Point-to-point transport over ``torch.distributed`` (gloo on CPU, NCCL on GPU): one process per stage.

Rank ``s`` runs stage ``s``. A message is a small int64 header (kind, micro-batch, stage-0 version tag,
non-finite mark, dtype and shape) and the tensor, so activations whose shape changes between steps need no
configuration.

Ordering rule (why no pair of ranks can deadlock): sends are posted without waiting (``isend``) and only
completed later; the only blocking operation is the receive of the input of the next action in the rank's
own schedule. A rank therefore waits only for a message that the schedule's dependency order guarantees
its neighbour produces first, and schedules are validated deadlock-free. Each link carries one kind of
message in one direction (activations to ``s+1``, gradients to ``s-1``), in schedule order, which is the
order in which the receiver posts its receives.

Latency hiding: a receive is posted one message ahead on each link (``plan``), and the payload's receive is
posted together with its header's, sized like the previous payload on that link. Sender and receiver track
that size identically; when it changes, the sender first sends a placeholder of the old size, then the real
payload, so the pre-posted receive is always matched.
"""

from __future__ import annotations

import datetime
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..schedule.ir import B, F, Kind
from .worker import Message

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]
_MAX_DIMS = 8
_HEADER = 8 + _MAX_DIMS  # kind, microbatch, tag, poisoned, dtype, ndim, has_payload, reserved, shape...
_KIND_CODE = {F: 0, B: 1}
_HEADER_TAG = {F: 10, B: 20}
_PAYLOAD_TAG = {F: 11, B: 21}

Layout = tuple[tuple[int, ...], torch.dtype]


class PeerError(RuntimeError):
    """A neighbouring rank died, stopped answering, or sent something this stage cannot take."""


@dataclass
class _Posted:
    """Receives posted for one expected message."""

    microbatch: int
    header: torch.Tensor
    header_work: Any
    payload: torch.Tensor | None
    payload_work: Any


class DistributedTransport:
    """Sends and receives stage messages between neighbouring ranks of the default process group."""

    def __init__(self, rank: int, num_stages: int, timeout: float = 30.0, device: torch.device | None = None):
        self.rank = rank
        self.num_stages = num_stages
        self.timeout = datetime.timedelta(seconds=timeout)
        self.device = device or torch.device("cpu")
        self._pending: list[tuple[Any, Any]] = []  # (work, tensor kept alive until the send completes)
        self._sent_layout: dict[Kind, Layout] = {}
        self._recv_layout: dict[Kind, Layout] = {}
        self._posted: dict[Kind, _Posted] = {}
        self._expected: dict[Kind, deque[int]] = {F: deque(), B: deque()}

    @staticmethod
    def _peer(stage: int, kind: Kind) -> int:
        return stage - 1 if kind is F else stage + 1

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
        layout = None
        if payload is not None:
            if payload.dim() > _MAX_DIMS:
                raise ValueError(f"rank {self.rank}: activations may have at most {_MAX_DIMS} dimensions")
            if payload.dtype not in _DTYPES:
                raise ValueError(f"rank {self.rank}: cannot send dtype {payload.dtype}")
            layout = (tuple(payload.shape), payload.dtype)
            header[4] = _DTYPES.index(payload.dtype)
            header[5] = payload.dim()
            header[6] = 1
            header[8: 8 + payload.dim()] = torch.tensor(payload.shape, dtype=torch.int64)
        self._isend(header.to(self.device), stage, _HEADER_TAG[kind])
        previous = self._sent_layout.get(kind)
        if previous is not None and layout != previous:
            # The receiver pre-posted a payload receive of the previous layout: satisfy it with a placeholder.
            self._isend(torch.zeros(previous[0], dtype=previous[1], device=self.device), stage, _PAYLOAD_TAG[kind])
        if payload is not None:
            self._isend(payload.detach().contiguous(), stage, _PAYLOAD_TAG[kind])
            self._sent_layout[kind] = layout
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._pending.append((dist.isend(tensor, dst, tag=tag), tensor))

    def wait_sends(self) -> None:
        """Complete every posted send (before a flush ends or the process exits)."""
        for work, _ in self._pending:
            self._wait(work, "delivering a message to a neighbour", None)
        self._pending.clear()

    # Receiving -------------------------------------------------------------------------------------

    def plan(self, stage: int, receives: Sequence[tuple[Kind, int]]) -> None:
        """The receives this stage will make next, in order; each link's next one is posted early."""
        for kind, k in receives:
            self._expected[kind].append(k)
        for kind in (F, B):
            self._post_next(stage, kind)

    def _post_next(self, stage: int, kind: Kind) -> None:
        if kind in self._posted or not self._expected[kind]:
            return
        k = self._expected[kind].popleft()
        src = self._peer(stage, kind)
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        header_work = dist.irecv(header, src, tag=_HEADER_TAG[kind])
        payload, payload_work = None, None
        layout = self._recv_layout.get(kind)
        if layout is not None:
            payload = torch.empty(layout[0], dtype=layout[1], device=self.device)
            payload_work = dist.irecv(payload, src, tag=_PAYLOAD_TAG[kind])
        self._posted[kind] = _Posted(k, header, header_work, payload, payload_work)

    def ready(self, stage: int, kind: Kind, microbatch: int) -> bool:
        return True  # receive blocks (with a timeout) until the message is there

    def receive(self, stage: int, kind: Kind, microbatch: int) -> Message:
        src = self._peer(stage, kind)
        what = f"the {'activation' if kind is F else 'gradient'} of micro-batch {microbatch}"
        if kind not in self._posted:
            self._expected[kind].appendleft(microbatch)
            self._post_next(stage, kind)
        posted = self._posted.pop(kind)
        if posted.microbatch != microbatch:
            raise RuntimeError(f"rank {self.rank}: receives out of plan ({microbatch} vs {posted.microbatch}); a bug")
        self._wait(posted.header_work, what, src)
        header = posted.header.cpu()
        got_kind, got_mb = int(header[0]), int(header[1])
        if (got_kind, got_mb) != (_KIND_CODE[kind], microbatch):
            raise PeerError(
                f"rank {self.rank} expected {what} from rank {src} but received kind {got_kind} of micro-batch "
                f"{got_mb}: the ranks run different schedules (same algorithm, stages and micro-batches everywhere?)"
            )
        layout = None
        if int(header[6]):
            layout = (tuple(int(d) for d in header[8: 8 + int(header[5])]), _DTYPES[int(header[4])])
        payload = None
        if posted.payload_work is not None:
            self._wait(posted.payload_work, what, src)
            payload = posted.payload if layout == self._recv_layout.get(kind) else None  # else a placeholder
        if layout is not None and payload is None:
            payload = torch.empty(layout[0], dtype=layout[1], device=self.device)
            self._wait(dist.irecv(payload, src, tag=_PAYLOAD_TAG[kind]), what, src)
        if layout is not None:
            self._recv_layout[kind] = layout
        self._post_next(stage, kind)
        tag = int(header[2])
        return Message(payload, None if tag < 0 else tag, poisoned=bool(header[3]))

    def _wait(self, work: Any, what: str, peer: int | None) -> None:
        who = f"rank {peer}" if peer is not None else "a neighbouring rank"
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as exc:
            detail = str(exc).splitlines()[0] if str(exc) else "no detail"
            raise PeerError(
                f"rank {self.rank}: {who} failed while {what} was expected ({exc.__class__.__name__}: {detail}); "
                f"it died or stopped answering (timeout {self.timeout.total_seconds():g} s)"
            ) from exc
        if ok is False:
            raise PeerError(f"rank {self.rank}: no answer from {who} within {self.timeout.total_seconds():g} s "
                            f"while waiting for {what}")
