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

Threads: the compute thread never calls into the backend. Posting an ``isend``/``irecv`` can block for
milliseconds (gloo locks a connection while its I/O thread moves data), so a posting thread issues them,
in the order the compute thread asked for; a second thread waits for sends to complete (gloo completes
a send only when someone waits on it, and the buffer must live until then). They are separate because a
thread blocked on a send's completion must not keep receives from being posted.

Latency hiding: each link's next receive is posted one message ahead (``plan``), and a message travels
as one buffer, the tensor's bytes followed by the header, sized like the previous tensor on that link.
Sender and receiver track that size identically. When it changes (or there is no tensor), the sender
first fills the pre-posted buffer with a header that announces the new layout, then sends the tensor in a
buffer of the new size; the first message on a link is announced the same way.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import datetime
import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..schedule.ir import B, F, Kind
from .worker import Message

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]
_MAX_DIMS = 8
_HEADER = 8 + _MAX_DIMS  # kind, microbatch, tag, poisoned, dtype, ndim, has_payload, reserved, shape...
_KIND_CODE = {F: 0, B: 1}
_TAG = {F: 10, B: 20}
_LOSS_TAG = 30
_HEADER_BYTES = _HEADER * 8

Layout = tuple[tuple[int, ...], torch.dtype]


_ITEMSIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _DTYPES}


def _raw_bytes(layout: Layout) -> int:
    shape, dtype = layout
    n = _ITEMSIZE[dtype]
    for d in shape:
        n *= d
    return n


def _payload_bytes(layout: Layout | None) -> int:
    """Bytes of a tensor with this layout, padded to 8 so the int64 header after it stays aligned."""
    return 0 if layout is None else (_raw_bytes(layout) + 7) // 8 * 8


class PeerError(RuntimeError):
    """A neighbouring rank died, stopped answering, or sent something this stage cannot take."""


@dataclass
class _Posted:
    """Receives posted for one expected message."""

    microbatch: int
    buffer: torch.Tensor
    work: concurrent.futures.Future  # resolves to the backend Work once posted
    layout: Layout | None  # the layout the buffer was sized for


def _deliver_at_exit(transport: "weakref.ref[DistributedTransport]") -> None:
    live = transport()
    if live is not None:
        try:
            live.wait_sends()
        except (PeerError, RuntimeError):
            pass  # the receiving rank is gone; nothing can be delivered


class _Poster:
    """Runs posting calls (``isend``/``irecv``) on one helper thread, in submission order."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue[tuple[concurrent.futures.Future, Callable[..., Any], tuple]] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self._calls.get()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)


class DistributedTransport:
    """Sends and receives stage messages between neighbouring ranks of the default process group."""

    def __init__(self, rank: int, num_stages: int, timeout: float = 30.0, device: torch.device | None = None):
        self.rank = rank
        self.num_stages = num_stages
        self.timeout = datetime.timedelta(seconds=timeout)
        self.device = device or torch.device("cpu")
        # The process group's send/recv are called directly rather than through ``dist.isend``/``irecv``, so
        # the posting thread holds the GIL for less time. Peer ranks are global ranks: the default group.
        self._group = dist.group.WORLD
        self._poster = _Poster(f"pipecore-post-rank{rank}")
        self._sends: queue.Queue[tuple[Any, torch.Tensor, int]] = queue.Queue()
        self._send_error: PeerError | None = None
        self._reaper = threading.Thread(target=self._complete_sends, name=f"pipecore-sends-rank{rank}", daemon=True)
        self._reaper.start()
        self._sent_layout: dict[Kind, Layout] = {}
        self._recv_layout: dict[Kind, Layout] = {}
        self._posted: dict[Kind, _Posted] = {}
        self._expected: dict[Kind, deque[int]] = {F: deque(), B: deque()}
        self._loss_posted: tuple[torch.Tensor, Any] | None = None
        # Sends still queued when the script ends (a last step's gradients and loss) are delivered before
        # the helper threads stop, rather than lost.
        atexit.register(_deliver_at_exit, weakref.ref(self))

    @staticmethod
    def _peer(stage: int, kind: Kind) -> int:
        return stage - 1 if kind is F else stage + 1

    # Sending ---------------------------------------------------------------------------------------

    def send(self, stage: int, kind: Kind, microbatch: int, message: Message) -> None:
        payload = message.payload
        if payload is not None and not isinstance(payload, torch.Tensor):
            raise TypeError(f"rank {self.rank}: stages exchange tensors, got {type(payload).__name__}")
        fields = [_KIND_CODE[kind], microbatch, -1 if message.tag is None else message.tag, int(message.poisoned)]
        layout = None
        if payload is None:
            fields += [0, 0, 0, 0]
        else:
            if payload.dim() > _MAX_DIMS:
                raise ValueError(f"rank {self.rank}: activations may have at most {_MAX_DIMS} dimensions")
            if payload.dtype not in _ITEMSIZE:
                raise ValueError(f"rank {self.rank}: cannot send dtype {payload.dtype}")
            layout = (tuple(payload.shape), payload.dtype)
            fields += [_DTYPES.index(payload.dtype), payload.dim(), 1, 0, *layout[0]]
        header = torch.tensor(fields + [0] * (_HEADER - len(fields)), dtype=torch.int64)
        previous = self._sent_layout.get(kind)
        if layout is None or layout != previous:
            # The receiver's posted buffer has the previous size: fill it with the announcing header.
            self._isend(self._pack(header, None, previous), stage, _TAG[kind])
        if layout is not None:
            self._isend(self._pack(header, payload, layout), stage, _TAG[kind])
            self._sent_layout[kind] = layout

    def _pack(self, header: torch.Tensor, payload: torch.Tensor | None, layout: Layout | None) -> torch.Tensor:
        size = _payload_bytes(layout)
        buffer = torch.empty(size + _HEADER_BYTES, dtype=torch.uint8, device=self.device)
        if payload is not None:
            raw = payload.detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[: raw.numel()].copy_(raw)
            buffer[raw.numel(): size].zero_()
        else:
            buffer[:size].zero_()
        buffer[size:].view(torch.int64).copy_(header)
        return buffer

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        if self._send_error is not None:
            raise self._send_error
        self._poster.post(self._post_send, tensor, dst, tag)

    def _post_send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        try:
            work = self._group.send([tensor], dst, tag)
        except RuntimeError as exc:
            self._send_error = self._send_failed(dst, exc)
            return
        self._sends.put((work, tensor, dst))

    def _send_failed(self, dst: int, exc: RuntimeError) -> PeerError:
        detail = str(exc).splitlines()[0] if str(exc) else "no detail"
        return PeerError(f"rank {self.rank}: sending to rank {dst} failed ({detail}); "
                         f"rank {dst} died or stopped answering")

    def _complete_sends(self) -> None:
        while True:
            work, _, dst = self._sends.get()
            try:
                work.wait()
            except RuntimeError as exc:
                self._send_error = self._send_failed(dst, exc)
            finally:
                self._sends.task_done()

    def wait_sends(self) -> None:
        """Complete every posted send (before a flush ends or the process exits)."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        try:  # every send asked for so far has been posted once a call posted after them has run
            self._poster.post(lambda: None).result(self.timeout.total_seconds())
        except concurrent.futures.TimeoutError:
            raise PeerError(f"rank {self.rank}: posting sends did not finish within "
                            f"{self.timeout.total_seconds():g} s") from None
        while self._sends.unfinished_tasks:
            if self._send_error is not None:
                raise self._send_error
            if time.monotonic() > deadline:
                raise PeerError(f"rank {self.rank}: a neighbouring rank did not take its messages within "
                                f"{self.timeout.total_seconds():g} s")
            time.sleep(0.0005)
        if self._send_error is not None:
            raise self._send_error

    # Mini-batch losses -----------------------------------------------------------------------------

    def publish_loss(self, minibatch: int, loss: float) -> None:
        """Last rank: send a mini-batch's loss to every other rank as soon as it is known. Point-to-point
        messages rather than a collective, so that no rank waits for another to reach the end of its step
        (a collective would re-synchronise an asynchronous pipeline at every step)."""
        value = torch.tensor([minibatch, loss], dtype=torch.float64, device=self.device)
        for dst in range(self.num_stages - 1):
            self._isend(value, dst, _LOSS_TAG)

    def expect_loss(self) -> None:
        """Post the receive of the next mini-batch loss (ranks other than the last), ahead of time."""
        if self._loss_posted is None:
            buffer = torch.empty(2, dtype=torch.float64, device=self.device)
            self._loss_posted = (buffer, self._poster.post(self._group.recv, [buffer], self.num_stages - 1, _LOSS_TAG))

    def receive_loss(self, minibatch: int) -> float:
        """The loss of ``minibatch`` that the last rank published."""
        self.expect_loss()
        assert self._loss_posted is not None
        (buffer, work), self._loss_posted = self._loss_posted, None
        self._wait(work, f"the loss of mini-batch {minibatch}", self.num_stages - 1)
        got, loss = buffer.tolist()
        if int(got) != minibatch:
            raise PeerError(f"rank {self.rank} expected the loss of mini-batch {minibatch} but rank "
                            f"{self.num_stages - 1} sent the loss of mini-batch {int(got)}: the ranks are out of step")
        return loss

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
        layout = self._recv_layout.get(kind)
        buffer, work = self._irecv(layout, stage, kind)
        self._posted[kind] = _Posted(k, buffer, work, layout)

    def _irecv(self, layout: Layout | None, stage: int, kind: Kind) -> tuple[torch.Tensor, Any]:
        buffer = torch.empty(_payload_bytes(layout) + _HEADER_BYTES, dtype=torch.uint8, device=self.device)
        return buffer, self._poster.post(self._group.recv, [buffer], self._peer(stage, kind), _TAG[kind])

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
        self._wait(posted.work, what, src)
        buffer = posted.buffer
        header = buffer[-_HEADER_BYTES:].view(torch.int64).tolist()
        got_kind, got_mb = header[0], header[1]
        if (got_kind, got_mb) != (_KIND_CODE[kind], microbatch):
            raise PeerError(
                f"rank {self.rank} expected {what} from rank {src} but received kind {got_kind} of micro-batch "
                f"{got_mb}: the ranks run different schedules (same algorithm, stages and micro-batches everywhere?)"
            )
        layout = None
        if header[6]:
            layout = (tuple(header[8: 8 + header[5]]), _DTYPES[header[4]])
        payload = None
        if layout is not None:
            if layout != posted.layout:  # the posted buffer held the announcement; the tensor follows
                buffer, work = self._irecv(layout, stage, kind)
                self._wait(work, what, src)
                self._recv_layout[kind] = layout
            shape, dtype = layout
            payload = buffer[: _raw_bytes(layout)].view(dtype).view(shape)
        self._post_next(stage, kind)
        tag = header[2]
        return Message(payload, None if tag < 0 else tag, poisoned=bool(header[3]))

    def _wait(self, posting: concurrent.futures.Future, what: str, peer: int | None) -> None:
        """Wait for a receive that the posting thread was asked to post."""
        who = f"rank {peer}" if peer is not None else "a neighbouring rank"
        seconds = self.timeout.total_seconds()
        try:
            work = posting.result(seconds)
            ok = work.wait(self.timeout)
        except concurrent.futures.TimeoutError:
            raise PeerError(f"rank {self.rank}: the receive of {what} from {who} was not posted within "
                            f"{seconds:g} s") from None
        except RuntimeError as exc:
            detail = str(exc).splitlines()[0] if str(exc) else "no detail"
            raise PeerError(
                f"rank {self.rank}: {who} failed while {what} was expected ({exc.__class__.__name__}: {detail}); "
                f"it died or stopped answering (timeout {self.timeout.total_seconds():g} s)"
            ) from exc
        if ok is False:
            raise PeerError(f"rank {self.rank}: no answer from {who} within {self.timeout.total_seconds():g} s "
                            f"while waiting for {what}")
