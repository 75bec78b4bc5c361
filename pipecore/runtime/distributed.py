"""Point-to-point transport over ``torch.distributed`` (gloo on CPU, NCCL on GPU): one process per stage.

Rank ``s`` runs stage ``s``. A message is one buffer: the tensor's bytes followed by a small int64 header
(kind, micro-batch, stage-0 version tag, non-finite mark, acknowledgement, dtype and shape), so activations
whose shape changes between steps need no configuration.

Ordering rule (why no pair of ranks can deadlock): the only operation that waits for a neighbour is the
receive of the input of the next action in the rank's own schedule. Sends are posted without waiting and
completed later, only once the receiver has told us that it took them (below), so completing them never
waits for the neighbour. A rank therefore waits only for a message that the schedule's dependency order
guarantees its neighbour produces first, and schedules are validated deadlock-free. Each link carries one
kind of message in one direction (activations to ``s+1``, gradients to ``s-1``), in schedule order, which is
the order in which the receiver takes them. ``flush()`` (and process exit) completes the sends
still outstanding, with the timeout.

One process group per link: each link (a pair of neighbouring ranks and a direction) is its own
two-rank process group, which for gloo is its own connection and I/O thread. On one shared connection a
gradient arriving would hold the connection's lock while the same rank posts its next activation (and the
reverse), so every message waited for the other direction's traffic; with a group per link, a message
never waits for one on another link. Mini-batch losses go over the default group.

Acknowledgements: a send's buffer must live until the backend has delivered it, and gloo reports a send
complete only when someone waits on it. Every message therefore carries the number of messages its sender
has received on the reverse link; a rank that reads it completes that many of its own sends to that
neighbour, which returns at once because they were already received. Between neighbours, activations go
one way and gradients the other within every mini-batch, so the sends held stay bounded by the micro-batches
in flight. Everything runs on the calling thread: no helper thread competes with compute for a core or the
GIL, which matters most when ranks share a machine's cores.

Latency hiding: a receive is always posted on each of this rank's incoming links, from construction on,
sized like the previous tensor on that link. Sender and receiver track that size identically. When it
changes (or there is no tensor), the sender first fills the pre-posted buffer with a header that announces
the new layout, then sends the tensor in a buffer of the new size; the first message on a link is announced
the same way. The next receive is posted as soon as the previous message is taken, also across ``step()``
and ``flush()``: gloo transfers a message only once its receive is posted, and posting a receive after its
message was sent takes milliseconds in the tail (``bench/post_latency.py``). The posted buffer is not tied
to a micro-batch; the header says which one arrived. A receive still posted at exit is dropped.
"""

from __future__ import annotations

import atexit
import datetime
import pickle
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..schedule.ir import B, F, Kind
from .worker import Message

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]
_MAX_DIMS = 8
_HEADER = 8 + _MAX_DIMS  # kind, microbatch, tag, poisoned, dtype, ndim, has_payload, acknowledged, shape...
_ACK = 7
_KIND_CODE = {F: 0, B: 1}
_REVERSE = {F: B, B: F}  # the link that carries messages back from the same neighbour
# Tags keep the kinds of message apart on gloo. NCCL ignores tags and matches a pair's messages in order,
# which is enough here: each link group carries one kind; on the default group, losses travel only inside
# step() (a rank takes its loss before step() returns) and share() only between steps, never both at once.
_TAG = {F: 10, B: 20}
_LOSS_TAG = 30
_SHARE_TAG = 40
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


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else "no detail"


class PeerError(RuntimeError):
    """A neighbouring rank died, stopped answering, or sent something this stage cannot take."""


@dataclass
class _Posted:
    """The receive posted for a link's next message."""

    buffer: torch.Tensor
    work: Any  # the backend's Work
    layout: Layout | None  # the layout the buffer was sized for


@dataclass
class _Sent:
    """A posted send; its buffer lives until the send is completed."""

    work: Any
    buffer: torch.Tensor
    dst: int


def _deliver_at_exit(transport: "weakref.ref[DistributedTransport]") -> None:
    live = transport()
    if live is not None and not live.closed:
        try:
            live.wait_sends()
        except (PeerError, RuntimeError):
            pass  # the receiving rank is gone; nothing can be delivered
        finally:
            # Release the link groups now rather than during interpreter teardown: a gloo group that outlives
            # destroy_process_group() and is destroyed that late can abort the process.
            live._links = {}


def _link_groups(rank: int, num_stages: int, timeout: datetime.timedelta) -> dict[tuple[Kind, int], tuple[Any, int]]:
    """This rank's links: ``(kind, neighbour) -> (process group, the neighbour's rank in it)``.

    Every rank creates every link's group, in the same order (``new_group`` is collective over the default
    group, members or not); it keeps those it belongs to. Links carry activations (``F``) from stage ``s``
    to ``s+1`` and gradients (``B``) from ``s+1`` to ``s``."""
    links: dict[tuple[Kind, int], tuple[Any, int]] = {}
    for s in range(num_stages - 1):
        for kind in (F, B):
            group = dist.new_group([s, s + 1], timeout=timeout)
            if rank in (s, s + 1):
                neighbour = s + 1 if rank == s else s
                links[kind, neighbour] = (group, dist.get_group_rank(group, neighbour))
    return links


class DistributedTransport:
    """Sends and receives stage messages between neighbouring ranks, one two-rank process group per link."""

    def __init__(self, rank: int, num_stages: int, timeout: float = 30.0, device: torch.device | None = None):
        self.rank = rank
        self.num_stages = num_stages
        self.timeout = datetime.timedelta(seconds=timeout)
        self.device = device or torch.device("cpu")
        # The process groups' send/recv are called directly rather than through ``dist.isend``/``irecv``
        # (less Python per message); they take ranks within the group.
        self._world = dist.group.WORLD
        self._links = _link_groups(rank, num_stages, self.timeout)
        self._sent_layout: dict[Kind, Layout] = {}
        self._recv_layout: dict[Kind, Layout] = {}
        self._posted: dict[Kind, _Posted] = {}
        # Per link (named by the kind of message it carries): the sends not completed yet, in posting
        # order; how many sends were completed; how many messages were received.
        self._unacknowledged: dict[Kind, deque[_Sent]] = {F: deque(), B: deque()}
        self._acknowledged: dict[Kind, int] = {F: 0, B: 0}
        self._received: dict[Kind, int] = {F: 0, B: 0}
        self._loss_sends: dict[int, _Sent] = {}
        self._loss_posted: tuple[torch.Tensor, Any] | None = None
        self.closed = False
        for kind, neighbour in self._links:  # the first message on each incoming link finds its receive posted
            if neighbour == self._peer(rank, kind):
                self._post_next(rank, kind)
        # Sends not yet completed when the script ends (a last step's gradients and loss) are delivered
        # before the process exits, rather than lost.
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
            fields += [0, 0, 0]
        else:
            if payload.dim() > _MAX_DIMS:
                raise ValueError(f"rank {self.rank}: activations may have at most {_MAX_DIMS} dimensions")
            if payload.dtype not in _ITEMSIZE:
                raise ValueError(f"rank {self.rank}: cannot send dtype {payload.dtype}")
            layout = (tuple(payload.shape), payload.dtype)
            fields += [_DTYPES.index(payload.dtype), payload.dim(), 1]
        fields.append(self._received[_REVERSE[kind]])  # what we took from this neighbour so far
        if layout is not None:
            fields += layout[0]
        header = torch.tensor(fields + [0] * (_HEADER - len(fields)), dtype=torch.int64)
        previous = self._sent_layout.get(kind)
        if layout is None or layout != previous:
            # The receiver's posted buffer has the previous size: fill it with the announcing header.
            self._post_send(kind, self._pack(header, None, previous), stage)
        if layout is not None:
            self._post_send(kind, self._pack(header, payload, layout), stage)
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

    def _post(self, buffer: torch.Tensor, dst: int, tag: int, kind: Kind | None = None) -> _Sent:
        group, peer = (self._world, dst) if kind is None else self._links[kind, dst]
        try:
            return _Sent(group.send([buffer], peer, tag), buffer, dst)
        except RuntimeError as exc:
            raise self._send_failed(dst, exc) from exc

    def _post_send(self, kind: Kind, buffer: torch.Tensor, dst: int) -> None:
        self._unacknowledged[kind].append(self._post(buffer, dst, _TAG[kind], kind))

    def _complete(self, sent: _Sent) -> None:
        try:
            done = sent.work.wait(self.timeout)
        except RuntimeError as exc:
            raise self._send_failed(sent.dst, exc) from exc
        if done is False:
            raise self._send_failed(sent.dst, TimeoutError("the send did not complete"))

    def _acknowledge(self, kind: Kind, count: int) -> None:
        """The neighbour has received ``count`` messages on link ``kind``: complete those sends."""
        pending = self._unacknowledged[kind]
        while self._acknowledged[kind] < count and pending:
            self._complete(pending.popleft())
            self._acknowledged[kind] += 1

    def _send_failed(self, dst: int, exc: BaseException) -> PeerError:
        return PeerError(f"rank {self.rank}: sending to rank {dst} failed ({_first_line(exc)}); "
                         f"rank {dst} died or stopped answering (timeout {self.timeout.total_seconds():g} s)")

    def wait_sends(self) -> None:
        """Complete every posted send (before a flush ends or the process exits); raises :class:`PeerError`
        if a neighbour does not take its messages within the timeout."""
        for kind, pending in self._unacknowledged.items():
            self._acknowledge(kind, self._acknowledged[kind] + len(pending))
        while self._loss_sends:
            dst = next(iter(self._loss_sends))
            self._complete(self._loss_sends[dst])
            del self._loss_sends[dst]

    def close(self, deliver: bool = True) -> None:
        """Release this rank's link groups (for gloo: their connections and threads); with ``deliver``, first
        complete the posted sends. Receives still posted are dropped. The transport cannot be used afterwards;
        closing twice does nothing."""
        if self.closed:
            return
        try:
            if deliver:
                self.wait_sends()
        finally:
            self.closed = True
            self._posted.clear()
            self._loss_posted = None
            groups = [group for group, _ in self._links.values()]
            self._links = {}
            # After destroy_process_group() of the default group every group is gone already.
            if dist.is_initialized():
                for group in groups:
                    dist.destroy_process_group(group)

    # Small objects from every rank -----------------------------------------------------------------

    def share(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank: each rank sends its own to rank 0,
        which sends the list back. Point-to-point over the default group rather than a collective: a gloo
        collective can leave work behind that aborts the process at exit when the script never destroys the
        group. Every rank must call it; a rank that does not answer within the timeout is a
        :class:`PeerError` naming it."""
        if self.rank == 0:
            objs = [obj] + [self._receive_object(src) for src in range(1, self.num_stages)]
            for dst in range(1, self.num_stages):
                self._send_object(objs, dst)
            return objs
        self._send_object(obj, 0)
        return self._receive_object(0)

    def _send_object(self, obj: Any, dst: int) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        for tensor in (torch.tensor([data.numel()], dtype=torch.int64, device=self.device), data):
            self._complete(self._post(tensor, dst, _SHARE_TAG))

    def _receive_object(self, src: int) -> Any:
        what = "its share of an exchange between all ranks"
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        self._wait(self._post_receive(size, src, _SHARE_TAG, what), what, src)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._wait(self._post_receive(data, src, _SHARE_TAG, what), what, src)
        return pickle.loads(data.cpu().numpy().tobytes())

    # Mini-batch losses -----------------------------------------------------------------------------

    def publish_loss(self, minibatch: int, loss: float) -> None:
        """Last rank: send a mini-batch's loss to every other rank as soon as it is known. Point-to-point
        messages rather than a collective, so that no rank waits for another to reach the end of its step
        (a collective would re-synchronise an asynchronous pipeline at every step).

        The previous loss send to each rank is completed first, without waiting: this loss needed every
        rank's forwards of this mini-batch, and a rank runs them only after its previous ``step()``
        returned, that is after it received the previous loss."""
        value = torch.tensor([minibatch, loss], dtype=torch.float64, device=self.device)
        for dst in range(self.num_stages - 1):
            previous = self._loss_sends.pop(dst, None)
            if previous is not None:
                self._complete(previous)
            self._loss_sends[dst] = self._post(value, dst, _LOSS_TAG)

    def expect_loss(self) -> None:
        """Post the receive of the next mini-batch loss (ranks other than the last), ahead of time."""
        if self._loss_posted is None:
            buffer = torch.empty(2, dtype=torch.float64, device=self.device)
            self._loss_posted = (buffer, self._post_receive(buffer, self.num_stages - 1, _LOSS_TAG, "a loss"))

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

    def _post_next(self, stage: int, kind: Kind) -> None:
        if kind not in self._posted:
            layout = self._recv_layout.get(kind)
            buffer, work = self._irecv(layout, stage, kind)
            self._posted[kind] = _Posted(buffer, work, layout)

    def _irecv(self, layout: Layout | None, stage: int, kind: Kind) -> tuple[torch.Tensor, Any]:
        buffer = torch.empty(_payload_bytes(layout) + _HEADER_BYTES, dtype=torch.uint8, device=self.device)
        peer = self._peer(stage, kind)
        what = f"the next {'activation' if kind is F else 'gradient'}"
        return buffer, self._post_receive(buffer, peer, _TAG[kind], what, kind)

    def _post_receive(self, buffer: torch.Tensor, src: int, tag: int, what: str, kind: Kind | None = None) -> Any:
        group, peer = (self._world, src) if kind is None else self._links[kind, src]
        try:
            return group.recv([buffer], peer, tag)
        except RuntimeError as exc:
            raise PeerError(f"rank {self.rank}: could not post the receive of {what} from rank {src} "
                            f"({_first_line(exc)}); rank {src} died or stopped answering") from exc

    def ready(self, stage: int, kind: Kind, microbatch: int) -> bool:
        return True  # receive blocks (with a timeout) until the message is there

    def receive(self, stage: int, kind: Kind, microbatch: int) -> Message:
        src = self._peer(stage, kind)
        what = f"the {'activation' if kind is F else 'gradient'} of micro-batch {microbatch}"
        self._post_next(stage, kind)
        posted = self._posted.pop(kind)
        self._wait(posted.work, what, src)
        self._received[kind] += 1
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
                self._received[kind] += 1
                self._recv_layout[kind] = layout
            shape, dtype = layout
            payload = buffer[: _raw_bytes(layout)].view(dtype).view(shape)
        self._post_next(stage, kind)  # the link's next message: later in this step, or in the next one
        self._acknowledge(_REVERSE[kind], header[_ACK])
        tag = header[2]
        return Message(payload, None if tag < 0 else tag, poisoned=bool(header[3]))

    def _wait(self, work: Any, what: str, peer: int) -> None:
        """Wait for a posted receive."""
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as exc:
            raise PeerError(
                f"rank {self.rank}: rank {peer} failed while {what} was expected ({exc.__class__.__name__}: "
                f"{_first_line(exc)}); it died or stopped answering (timeout {self.timeout.total_seconds():g} s)"
            ) from exc
        if ok is False:
            raise PeerError(f"rank {self.rank}: no answer from rank {peer} within {self.timeout.total_seconds():g} s "
                            f"while waiting for {what}")
