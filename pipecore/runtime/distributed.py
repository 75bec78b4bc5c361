"""Point-to-point transport over ``torch.distributed`` (gloo on CPU, NCCL on GPU): one process per rank.

Rank ``s`` runs stage ``s``, or with several stages per rank the stages ``placement`` gives it (looped:
``r, r+R, ...``; V: ``r`` and ``2R-1-r``). Messages between two stages of one rank stay in the process. With
several replicas of the pipeline (data parallel), ranks here are pipeline ranks within this process's replica.

A message's payload is ``None``, one tensor, or a tuple whose entries are tensors
or ``None`` (a stage with several boundary tensors; an integer tensor's gradient is ``None``). The receiver
gets back the same structure, with each tensor's dtype and shape, so activations whose shape changes between
steps need no configuration.

Wire format: a message is one ``uint8`` buffer, aligned to 8 bytes throughout::

    [tensor 0 bytes, padded to 8] [tensor 1 bytes, padded to 8] ...   the payload's tensors, in order
    [description: int64 words]                                        what the payload looks like
    [header: 8 int64 words]                                           at the very end, at a known place

The description is ``structure, count`` (structure 0: ``None``, 1: one tensor, 2: a tuple of ``count``
entries), then per entry its dtype code and, for a tensor, ``ndim, *shape`` (a ``None`` entry is the code
``-1`` alone). The header is ``kind, micro-batch, stage-0 version tag, non-finite mark, acknowledgement,
description length in words, total bytes of the message, announcement flag``. Only the header has a fixed
place, so neither the number of tensors nor their dimensions are bounded; a dtype outside ``_DTYPES`` (for
instance a complex one) is refused on the sender with a :class:`ValueError` before anything is sent.

Ordering rule (why no pair of ranks can deadlock): the only operation that waits for a neighbour is the
receive of the input of the next action in the rank's own schedule. Sends are posted without waiting and
completed later, only once the receiver has told us that it took them (below), so completing them never
waits for the neighbour. A rank therefore waits only for a message that the schedule's dependency order
guarantees its neighbour produces first, and schedules are validated deadlock-free. Each link carries one
kind of message in one direction (activations to ``s+1``, gradients to ``s-1``), in schedule order, which is
the order in which the receiver takes them. ``flush()`` (and process exit) completes the sends
still outstanding, with the timeout.

One process group per link: each link (a pair of neighbouring stages on different ranks, and a direction) is
its own two-rank process group, which for gloo is its own connection and I/O thread. On one shared connection a
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

Latency hiding: ``receives_ahead`` receives (``K``) are always posted on each of this rank's incoming links,
from construction on: gloo transfers a message only once its receive is posted, and posting a receive after
its message was sent takes milliseconds in the tail (``bench/post_latency.py``), which a burst of messages
(breadth-first schedules send a stage's ``m`` activations back to back) would pay once per message with a
single receive posted. The buffer for a link's message ``j`` is posted as soon as message ``j - K`` is taken,
sized as the announcements taken so far say (a bare header before the first); the sender tracks the sizes of
the ``K`` buffers ahead of its next message identically. When the next message's size differs from its
buffer's (its layout description travels inside it, so a new shape of the same byte size needs nothing
more), the sender first fills buffers with announcements: messages of exactly the buffer's size whose header
has the announcement flag set and gives the new size, until the buffer for the message has that size (``K``
announcements: the buffers already posted have the old size); the receiver takes announcements until a
message comes. The first message on a link is announced the same way. Announcements count as messages for
the acknowledgements (so a size change costs ``K`` messages of the old size: the price of receives posted
ahead where message sizes change, for instance with the sequence length). Receives stay posted across
``step()`` and ``flush()``. A posted buffer is not tied to
a micro-batch; the header says which one arrived. A receive still posted at exit is dropped.
"""

from __future__ import annotations

import atexit
import datetime
import math
import pickle
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.distributed as dist

from .. import _C

from ..schedule.ir import B, F, Kind
from .worker import Message

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
_ITEMSIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _DTYPES}
# On the CPU a message's words and tensors are written and read through a numpy view of its buffer: one torch
# call per buffer instead of a slice and two views per tensor (a message's host cost is mostly such calls).
# bfloat16 has no numpy dtype and takes the torch path.
_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16, torch.int64: np.int64,
          torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8,
          torch.bool: np.bool_}
# Header words, at the end of every message.
_KIND, _MICROBATCH, _VERSION_TAG, _POISONED, _ACK, _WORDS, _SIZE, _ANNOUNCE = range(8)
_HEADER = 8
_HEADER_BYTES = _HEADER * 8
# Structure codes, the first word of a description.
_NONE, _TENSOR, _TUPLE = 0, 1, 2
# Words read from a message's end in one go: the header and, but for very large tuples, the description
# (on a GPU each read is a device-to-host copy that waits for the device).
_TAIL_WORDS = 64
_KIND_CODE = {F: 0, B: 1}
_REVERSE = {F: B, B: F}  # the link that carries messages back from the same neighbour
# Tags keep the kinds of message apart on gloo. NCCL ignores tags and matches a pair's messages in order,
# which is enough here: each link group carries one kind; on the default group, losses travel only inside
# step() (a rank takes its loss before step() returns) and share() only between steps, never both at once.
_TAG = {F: 10, B: 20}
_NEXT = {F: "the next activation", B: "the next gradient"}  # what a link's posted receive waits for
_LOSS_TAG = 30
_SHARE_TAG = 40
_FAILURE_TAG = 45  # the text of a failure notice, from the last rank to the ranks waiting for a loss
# The announcement word of a failure notice, whose payload is the failure as UTF-8 text, and its micro-batch
# word (an announcement before it carries the same: the receiver takes both whatever micro-batch it expects).
_NOTICE = 2
_NOTICE_MICROBATCH = -(1 << 62)
# The micro-batch word of a loss message that reports a failure instead (its text follows on _FAILURE_TAG).
_FAILED_LOSS = -2
_PREDICT_TAG = 50  # Pipeline.predict's result, from the last rank to the others (between steps)


def _padded(nbytes: int) -> int:
    """``nbytes`` rounded up to 8, so that what follows stays aligned for int64 and float64 views."""
    return (nbytes + 7) // 8 * 8


def _copy_into(array: np.ndarray, offset: int, nbytes: int, entry: torch.Tensor) -> bool:
    """Copy ``entry`` into the CPU buffer ``array`` (its numpy view) at ``offset``; False where numpy cannot
    (bfloat16, a tensor on another device, a lazily negated view): the caller copies with torch."""
    np_dtype = _NUMPY.get(entry.dtype)
    if np_dtype is None:
        return False
    try:
        source = entry.detach().numpy()
    except (RuntimeError, TypeError):
        return False
    np.copyto(array[offset: offset + nbytes].view(np_dtype).reshape(source.shape), source)
    return True


def _describe(payload: Any, rank: int) -> tuple[list[torch.Tensor | None], list[int], int]:
    """The payload's entries, its description words and the bytes its tensors take (padded). Checks
    everything before anything is sent: a refused payload leaves the link as it was."""
    if payload is None:
        return [], [_NONE, 0], 0
    if isinstance(payload, torch.Tensor):
        structure, entries = _TENSOR, [payload]
    elif isinstance(payload, tuple):
        structure, entries = _TUPLE, list(payload)
    else:
        raise TypeError(f"rank {rank}: a message carries None, a tensor or a tuple of tensors and None, "
                        f"not {type(payload).__name__}")
    words = [structure, len(entries)]
    nbytes = 0
    for entry in entries:
        if entry is None:
            words.append(-1)
            continue
        if not isinstance(entry, torch.Tensor):
            raise TypeError(f"rank {rank}: a message's tuple holds tensors and None, not {type(entry).__name__}")
        code = _DTYPE_CODE.get(entry.dtype)
        if code is None:
            raise ValueError(f"rank {rank}: cannot send a tensor of dtype {entry.dtype}; the transport supports "
                             + ", ".join(str(d) for d in _DTYPES))
        shape = entry.shape
        words += (code, len(shape), *shape)
        nbytes += _padded(entry.numel() * _ITEMSIZE[entry.dtype])
    return entries, words, nbytes


def _unpack(buffer: torch.Tensor, tail: list[int], array: np.ndarray | None = None) -> Any:
    """The payload of a received message (views into ``buffer``), given the int64 words at its end and, for
    a CPU buffer, its numpy view ``array``."""
    header = tail[-_HEADER:]
    words = header[_WORDS]
    if words + _HEADER <= len(tail):
        description = tail[len(tail) - _HEADER - words: len(tail) - _HEADER]
    else:  # a description longer than the tail read in one go
        end = buffer.numel() - _HEADER_BYTES
        description = buffer[end - 8 * words: end].view(torch.int64).tolist()
    structure, count = description[0], description[1]
    entries: list[torch.Tensor | None] = []
    i, offset = 2, 0
    for _ in range(count):
        code = description[i]
        if code < 0:
            entries.append(None)
            i += 1
            continue
        ndim = description[i + 1]
        shape = description[i + 2: i + 2 + ndim]
        i += 2 + ndim
        dtype = _DTYPES[code]
        nbytes = math.prod(shape) * _ITEMSIZE[dtype]
        np_dtype = None if array is None else _NUMPY.get(dtype)
        if np_dtype is not None:
            entries.append(torch.from_numpy(array[offset: offset + nbytes].view(np_dtype).reshape(shape)))
        else:
            entries.append(buffer[offset: offset + nbytes].view(dtype).view(shape))
        offset += _padded(nbytes)
    if structure == _NONE:
        return None
    if structure == _TENSOR:
        return entries[0]
    if structure == _TUPLE:
        return tuple(entries)
    raise ValueError(f"unknown structure code {structure}")


def _tail(buffer: torch.Tensor, array: np.ndarray | None = None) -> list[int]:
    """The int64 words at the end of a received message: its header and usually its description (read through
    ``array``, the buffer's numpy view, on the CPU)."""
    if array is not None:
        return array[-min(array.size, 8 * _TAIL_WORDS):].view(np.int64).tolist()
    return buffer[-min(buffer.numel(), 8 * _TAIL_WORDS):].view(torch.int64).tolist()


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else "no detail"


class PeerError(RuntimeError):
    """A neighbouring rank died, stopped answering, or sent something this stage cannot take; or another rank
    stopped at an error, which ``cause`` then describes (``"NonFiniteLoss at stage 3 (rank 3), 3F5: ..."``)."""

    cause: str | None = None

    @classmethod
    def reported(cls, rank: int, src: int, cause: str) -> "PeerError":
        err = cls(f"rank {rank}: rank {src} reports that {cause}")
        err.cause = cause
        return err


@dataclass
class _Posted:
    """A receive posted for one of a link's next messages."""

    buffer: torch.Tensor  # sized as the link's announcements taken before it was posted say
    work: Any  # the backend's Work


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


_Link = tuple[Kind, int]  # (kind of message, boundary b): F from stage b to b+1, B from b+1 to b


def _link_groups(me: int, placement: tuple[int, ...], grid: tuple[tuple[int, ...], ...],
                 timeout: datetime.timedelta) -> dict[_Link, tuple[Any, int]]:
    """This process's links: ``(kind, boundary) -> (process group, the other process's rank in it)``.

    Every process creates every link's group of every pipeline replica (``grid[i][r]``: the global rank of
    pipeline rank ``r`` of replica ``i``), in the same order (``new_group`` is collective over the default group,
    members or not); it keeps those it belongs to (``me``: its global rank). Link ``(F, b)`` carries activations
    from stage ``b`` to ``b+1``, ``(B, b)`` gradients from ``b+1`` to ``b``; a boundary inside one rank has no link."""
    links: dict[_Link, tuple[Any, int]] = {}
    for row in grid:
        for b in range(len(placement) - 1):
            pair = row[placement[b]], row[placement[b + 1]]
            if pair[0] == pair[1]:
                continue
            for kind in (F, B):
                group = dist.new_group(sorted(pair), timeout=timeout)
                if me in pair:
                    other = pair[1] if me == pair[0] else pair[0]
                    links[kind, b] = (group, dist.get_group_rank(group, other))
    return links


def _boundary(stage: int, kind: Kind) -> int:
    """The boundary a message for ``stage``'s ``kind`` action crosses (F from ``stage-1``, B from ``stage+1``)."""
    return stage - 1 if kind is F else stage


class DistributedTransport:
    """Sends and receives stage messages between neighbouring ranks, one two-rank process group per link."""

    def __init__(self, rank: int, num_stages: int, timeout: float = 30.0, device: torch.device | None = None,
                 placement: tuple[int, ...] | None = None, grid: tuple[tuple[int, ...], ...] | None = None,
                 replica: int = 0, receives_ahead: int | Mapping[_Link, int] = 1):
        self.rank = rank
        self.num_stages = num_stages
        #: The rank of every stage (one stage per rank without it).
        self.placement = tuple(range(num_stages)) if placement is None else tuple(placement)
        self.num_ranks = max(self.placement) + 1
        # With several replicas of the pipeline (data parallel): the global rank of each of their pipeline ranks.
        # Ranks here (``rank``, message peers) are pipeline ranks within this replica.
        self._grid = grid if grid is not None else (tuple(range(self.num_ranks)),)
        self._global = self._grid[replica]
        #: The rank that runs the last stage: it computes the losses and publishes them.
        self.last_rank = self.placement[-1]
        self._local: dict[tuple[int, Kind, int], Message] = {}  # messages between two stages of this rank
        self.timeout = datetime.timedelta(seconds=timeout)
        self.device = device or torch.device("cpu")
        self._on_cpu = self.device.type == "cpu"
        # The process groups' send/recv are called directly rather than through ``dist.isend``/``irecv``
        # (less Python per message); they take ranks within the group.
        self._world = dist.group.WORLD
        self._links = _link_groups(self._global[rank], self.placement, self._grid, self.timeout)
        #: Receives kept posted on each link (both ends of a link must use the same number; links missing from
        #: a mapping get 1).
        self.receives_ahead: dict[_Link, int] = {
            link: receives_ahead if isinstance(receives_ahead, int) else receives_ahead.get(link, 1)
            for link in self._links}
        if any(not isinstance(k, int) or k < 1 for k in self.receives_ahead.values()):
            raise ValueError(f"receives_ahead must be at least 1 on every link, got {receives_ahead!r}")
        # Per outgoing link: the sizes of the receiver's buffers for the next receives_ahead messages, and the
        # size the last announcement gave (the size of the buffers it posts next). Per incoming link: that
        # size, and the receives posted, oldest first. Sender and receiver track the sizes identically.
        self._ahead: dict[_Link, deque[int]] = {
            link: deque([_HEADER_BYTES] * self.receives_ahead[link]) for link in self._links}
        self._announced: dict[_Link, int] = {link: _HEADER_BYTES for link in self._links}
        self._recv_size: dict[_Link, int] = {link: _HEADER_BYTES for link in self._links}
        self._posted: dict[_Link, deque[_Posted]] = {link: deque() for link in self._links}
        # Per link: the sends not completed yet, in posting order; how many sends were completed; how many
        # messages were received.
        self._unacknowledged: dict[_Link, deque[_Sent]] = {link: deque() for link in self._links}
        self._acknowledged: dict[_Link, int] = {link: 0 for link in self._links}
        self._received: dict[_Link, int] = {link: 0 for link in self._links}
        self._loss_sends: dict[int, _Sent] = {}
        self._loss_posted: tuple[torch.Tensor, Any] | None = None
        self._notices: list[_Sent] = []  # failure notices posted to the ranks waiting for a loss
        # Messages received, returned by a failed action: (stage, kind, micro-batch) -> message.
        self._given_back: dict[tuple[int, Kind, int], Message] = {}
        self._losses_sent: dict[int, int] = {}  # last rank: loss messages (and failure notices) sent to each rank
        self._losses_taken = 0  # other ranks: loss messages taken
        self.failure_notified = False
        self.closed = False
        for link in self._links:  # the first message on each incoming link finds its receive posted
            if self._incoming(link):
                self._post_next(link)
        # Sends not yet completed when the script ends (a last step's gradients and loss) are delivered
        # before the process exits, rather than lost.
        atexit.register(_deliver_at_exit, weakref.ref(self))

    def _name(self, rank: int) -> str:
        """How messages name a pipeline rank: ``rank r``, or with several replicas its global rank and place."""
        if len(self._grid) == 1:
            return f"rank {rank}"
        return f"rank {self._global[rank]} (replica {self._grid.index(self._global)}, pipeline rank {rank})"

    def _peer(self, stage: int, kind: Kind) -> int:
        """The rank that sends ``stage`` the messages of its ``kind`` actions."""
        return self.placement[stage - 1 if kind is F else stage + 1]

    def _incoming(self, link: _Link) -> bool:
        """Whether this rank receives on ``link`` (else it sends on it)."""
        kind, b = link
        return self.placement[b + 1 if kind is F else b] == self.rank

    @staticmethod
    def _consumer(link: _Link) -> int:
        """The stage that takes the messages of ``link``."""
        kind, b = link
        return b + 1 if kind is F else b

    def _source(self, link: _Link) -> int:
        """The rank at the sending end of ``link``."""
        kind, b = link
        return self.placement[b if kind is F else b + 1]

    # Sending ---------------------------------------------------------------------------------------

    def send(self, stage: int, kind: Kind, microbatch: int, message: Message, notice: bool = False) -> None:
        """Send ``message`` (payload ``None``, a tensor, or a tuple of tensors and ``None``) to ``stage``.
        Raises :class:`TypeError` or :class:`ValueError` (an unsupported dtype) before sending anything.
        With ``notice``, the message is a failure notice (see :meth:`notify_failure`)."""
        dst = self.placement[stage]
        if dst == self.rank:  # the next stage is on this rank: no wire, no copy
            _describe(message.payload, self.rank)  # the same checks as on a wire
            self._local[stage, kind, microbatch] = message
            return
        link = (kind, _boundary(stage, kind))
        entries, words, data = _describe(message.payload, self.rank)
        description = len(words)
        size = data + 8 * (description + _HEADER)
        tag = -1 if message.tag is None else message.tag
        # What we took from this neighbour so far acknowledges its sends.
        header = [_KIND_CODE[kind], microbatch, tag, int(message.poisoned), self._received[_REVERSE[kind], link[1]]]
        ahead = self._ahead[link]
        while ahead[0] != size:
            # The buffer for this message has another size: fill it with the announcement of this size (only
            # its header is read: the rest need not be written).
            announcement = torch.empty(ahead[0], dtype=torch.uint8, device=self.device)
            announcement[-_HEADER_BYTES:].view(torch.int64).copy_(
                torch.tensor(header + [0, size, 1], dtype=torch.int64))
            self._post_send(link, announcement, dst)
            self._announced[link] = size
            ahead.popleft()
            ahead.append(size)
        buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        array = buffer.numpy() if self._on_cpu else None
        offset = 0
        for entry in entries:
            if entry is None:
                continue
            nbytes = entry.numel() * _ITEMSIZE[entry.dtype]
            end = _padded(nbytes) + offset
            # One copy, straight from the (possibly strided, possibly other-device) tensor into the buffer.
            if not (array is not None and _copy_into(array, offset, nbytes, entry)):
                buffer[offset: offset + nbytes].view(entry.dtype).view(entry.shape).copy_(entry.detach())
            if end != offset + nbytes:
                buffer[offset + nbytes: end].zero_()
            offset = end
        words += header
        words += (description, size, _NOTICE if notice else 0)
        if array is not None:
            array[data:].view(np.int64)[:] = words
        else:
            buffer[data:].view(torch.int64).copy_(torch.tensor(words, dtype=torch.int64))
        self._post_send(link, buffer, dst)
        ahead.popleft()
        ahead.append(self._announced[link])

    def _post(self, buffer: torch.Tensor, dst: int, tag: int, link: _Link | None = None) -> _Sent:
        group, peer = (self._world, self._global[dst]) if link is None else self._links[link]
        try:
            with _C.RecordingOff():  # see _post_receive
                return _Sent(group.send([buffer], peer, tag), buffer, dst)
        except RuntimeError as exc:
            raise self._send_failed(dst, exc) from exc

    def _post_send(self, link: _Link, buffer: torch.Tensor, dst: int) -> None:
        self._unacknowledged[link].append(self._post(buffer, dst, _TAG[link[0]], link))

    def _complete(self, sent: _Sent) -> None:
        try:
            done = sent.work.wait(self.timeout)
        except RuntimeError as exc:
            raise self._send_failed(sent.dst, exc) from exc
        if done is False:
            raise self._send_failed(sent.dst, TimeoutError("the send did not complete"))

    def _acknowledge(self, link: _Link, count: int) -> None:
        """The neighbour has received ``count`` messages on ``link``: complete those sends."""
        pending = self._unacknowledged[link]
        while self._acknowledged[link] < count and pending:
            self._complete(pending.popleft())
            self._acknowledged[link] += 1

    def _send_failed(self, dst: int, exc: BaseException) -> PeerError:
        return PeerError(f"{self._name(self.rank)}: sending to {self._name(dst)} failed ({_first_line(exc)}); "
                         f"{self._name(dst)} died or stopped answering (timeout {self.timeout.total_seconds():g} s)")

    def wait_sends(self) -> None:
        """Complete every posted send (before a flush ends or the process exits); raises :class:`PeerError`
        if a neighbour does not take its messages within the timeout."""
        for link, pending in self._unacknowledged.items():
            self._acknowledge(link, self._acknowledged[link] + len(pending))
        while self._loss_sends:
            dst = next(iter(self._loss_sends))
            self._complete(self._loss_sends[dst])
            del self._loss_sends[dst]

    def complete_sends(self, kind: Kind) -> None:
        """Complete every posted send on the outgoing link that carries ``kind`` (waiting, with the timeout,
        until the neighbour has taken them), as if acknowledged: the acknowledgement count stays in step with
        the neighbour's, so later acknowledgements complete only later sends. For messages no reply follows
        (``Pipeline.predict``'s activations), whose buffers would otherwise wait for training's next one."""
        for link in self._links:
            if link[0] is kind and not self._incoming(link):
                self._acknowledge(link, self._acknowledged[link] + len(self._unacknowledged[link]))

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
            self._local.clear()
            self._loss_posted = None
            groups = [group for group, _ in self._links.values()]
            self._links = {}
            # After destroy_process_group() of the default group every group is gone already.
            if dist.is_initialized():
                for group in groups:
                    dist.destroy_process_group(group)

    # Failures ------------------------------------------------------------------------------------------

    def notify_failure(self, text: str) -> None:
        """This rank stopped at an error (its own, or one a neighbour reported): tell the neighbours, with a
        failure notice on each outgoing link (it takes the place of the next message they wait for, so a rank
        waiting for this one learns the cause at once, and passes it on), and, from the last rank, every rank
        that may be waiting for a mini-batch loss. Best effort, once: nothing here waits or raises."""
        if self.failure_notified or self.closed:
            return
        self.failure_notified = True
        data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).to(self.device)
        for link in list(self._links):
            if not self._incoming(link):  # an outgoing link: this rank sends on it
                try:
                    self.send(self._consumer(link), link[0], _NOTICE_MICROBATCH, Message(data), notice=True)
                except (PeerError, RuntimeError):
                    pass  # that neighbour is gone
        if self.rank == self.last_rank:
            failed = torch.tensor([_FAILED_LOSS, math.nan], dtype=torch.float64, device=self.device)
            size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
            for dst in self._other_ranks():
                try:
                    for tensor, tag in ((failed, _LOSS_TAG), (size, _FAILURE_TAG), (data, _FAILURE_TAG)):
                        self._notices.append(self._post(tensor, dst, tag))
                    self._losses_sent[dst] = self._losses_sent.get(dst, 0) + 1
                except (PeerError, RuntimeError):
                    pass

    def _failure_reported(self, buffer: torch.Tensor, tail: list[int], src: int) -> PeerError:
        """The error for a failure notice received from ``src``."""
        return PeerError.reported(self.rank, src, bytes(_unpack(buffer, tail).cpu().numpy()).decode(errors="replace"))

    # Small objects from every rank -----------------------------------------------------------------

    def share(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank: each rank sends its own to rank 0,
        which sends the list back. Point-to-point over the default group rather than a collective: a gloo
        collective can leave work behind that aborts the process at exit when the script never destroys the
        group. Every rank must call it; a rank that does not answer within the timeout is a
        :class:`PeerError` naming it."""
        if self.rank == 0:
            objs = [obj] + [self._receive_object(src) for src in range(1, self.num_ranks)]
            for dst in range(1, self.num_ranks):
                self._send_object(objs, dst)
            return objs
        self._send_object(obj, 0)
        return self._receive_object(0)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """``obj`` (picklable; tensors on the CPU) from rank ``src`` on every rank: ``src`` sends it to each
        other rank, point-to-point over the default group like :meth:`share`. Every rank must call it; ``obj``
        is read on ``src`` only."""
        if self.rank == src:
            for dst in range(self.num_ranks):
                if dst != src:
                    self._send_object(obj, dst, _PREDICT_TAG)
            return obj
        return self._receive_object(src, _PREDICT_TAG, "the result of predict()")

    def _send_object(self, obj: Any, dst: int, tag: int = _SHARE_TAG) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        for tensor in (torch.tensor([data.numel()], dtype=torch.int64, device=self.device), data):
            self._complete(self._post(tensor, dst, tag))

    def _receive_object(self, src: int, tag: int = _SHARE_TAG,
                        what: str = "its share of an exchange between all ranks") -> Any:
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        self._wait(self._post_receive(size, src, tag, what), what, src)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._wait(self._post_receive(data, src, tag, what), what, src)
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
        for dst in self._other_ranks():
            previous = self._loss_sends.pop(dst, None)
            if previous is not None:
                self._complete(previous)
            self._loss_sends[dst] = self._post(value, dst, _LOSS_TAG)
            self._losses_sent[dst] = self._losses_sent.get(dst, 0) + 1

    def expect_loss(self) -> None:
        """Post the receive of the next mini-batch loss (ranks other than the last), ahead of time."""
        if self._loss_posted is None:
            buffer = torch.empty(2, dtype=torch.float64, device=self.device)
            self._loss_posted = (buffer, self._post_receive(buffer, self.last_rank, _LOSS_TAG, "a loss"))

    def receive_loss(self, minibatch: int) -> float:
        """The loss of ``minibatch`` that the last rank published."""
        last = self.last_rank
        got, loss, failure = self._take_loss(f"the loss of mini-batch {minibatch}")
        if failure is not None:
            raise PeerError.reported(self.rank, last, failure)
        if got != minibatch:
            raise PeerError(f"{self._name(self.rank)} expected the loss of mini-batch {minibatch} but rank "
                            f"{last} sent the loss of mini-batch {int(got)}: the ranks are out of step")
        return loss

    def _take_loss(self, what: str) -> tuple[int, float, str | None]:
        """The next loss message from the last rank: ``(mini-batch, loss, None)``, or for a failure notice
        ``(-2, nan, its text)``."""
        self.expect_loss()
        assert self._loss_posted is not None
        (buffer, work), self._loss_posted = self._loss_posted, None
        last = self.last_rank
        self._wait(work, what, last)
        self._losses_taken += 1
        got, loss = buffer.tolist()
        if int(got) != _FAILED_LOSS:
            return int(got), loss, None
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        self._wait(self._post_receive(size, last, _FAILURE_TAG, "a failure notice"), "a failure notice", last)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._wait(self._post_receive(data, last, _FAILURE_TAG, "a failure notice"), "a failure notice", last)
        return _FAILED_LOSS, math.nan, bytes(data.cpu().numpy()).decode(errors="replace")

    # Receiving -------------------------------------------------------------------------------------

    def _other_ranks(self) -> list[int]:
        """Every rank but the last stage's (the ranks that wait for its losses)."""
        return [r for r in range(self.num_ranks) if r != self.last_rank]

    def _post_next(self, link: _Link) -> None:
        """Post receives on ``link`` until ``receives_ahead`` are posted, at the size announced so far."""
        posted = self._posted[link]
        while len(posted) < self.receives_ahead[link]:
            buffer, work = self._irecv(self._recv_size[link], link)
            posted.append(_Posted(buffer, work))

    def _irecv(self, size: int, link: _Link) -> tuple[torch.Tensor, Any]:
        buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        return buffer, self._post_receive(buffer, self._source(link), _TAG[link[0]], _NEXT[link[0]], link)

    def _post_receive(self, buffer: torch.Tensor, src: int, tag: int, what: str, link: _Link | None = None) -> Any:
        group, peer = (self._world, self._global[src]) if link is None else self._links[link]
        try:
            # Outside any profiler recording: a receive kept posted between steps completes whenever the
            # neighbour sends, maybe after the profiler stopped, and a profiler event ended then crashes torch
            # 2.13's profiler results when they are freed. The stages' actions are recorded as ranges anyway.
            with _C.RecordingOff():
                return group.recv([buffer], peer, tag)
        except RuntimeError as exc:
            raise PeerError(f"{self._name(self.rank)}: could not post the receive of {what} from {self._name(src)} "
                            f"({_first_line(exc)}); {self._name(src)} died or stopped answering") from exc

    def ready(self, stage: int, kind: Kind, microbatch: int) -> bool:
        return True  # receive blocks (with a timeout) until the message is there

    def give_back(self, stage: int, kind: Kind, microbatch: int, message: Message) -> None:
        self._given_back[stage, kind, microbatch] = message

    def receive(self, stage: int, kind: Kind, microbatch: int) -> Message:
        if self._given_back:
            returned = self._given_back.pop((stage, kind, microbatch), None)
            if returned is not None:
                return returned
        src = self._peer(stage, kind)
        if src == self.rank:
            local = self._local.pop((stage, kind, microbatch), None)
            if local is None:  # the rank's own order runs the sender first: a schedule that does not is invalid
                raise PeerError(f"{self._name(self.rank)}: stage {stage} expected its "
                                f"{'activation' if kind is F else 'gradient'}"
                                f" of micro-batch {microbatch} from a stage of the same rank, which has not sent it")
            return local
        what = f"the {'activation' if kind is F else 'gradient'} of micro-batch {microbatch}"
        if self.num_ranks != self.num_stages:
            what += f" for stage {stage}"
        link = (kind, _boundary(stage, kind))
        buffer, array, tail, header = self._take(link, what)
        if header[_ANNOUNCE] == _NOTICE:
            raise self._failure_reported(buffer, tail, src)
        if (header[_KIND], header[_MICROBATCH]) != (_KIND_CODE[kind], microbatch):
            raise PeerError(
                f"{self._name(self.rank)} expected {what} from {self._name(src)} but received kind {header[_KIND]} "
                f"of micro-batch "
                f"{header[_MICROBATCH]}: the ranks run different schedules (same algorithm, stages and "
                "micro-batches everywhere?)"
            )
        return self._accept(link, buffer, array, tail, header, what)

    def _take(self, link: _Link, what: str) -> tuple[torch.Tensor, np.ndarray | None, list[int], list[int]]:
        """The next message on the incoming ``link`` (after the announcements before it, if any): its buffer,
        the buffer's numpy view (on the CPU; else None), the words at its end and its header. The receive of the
        message ``receives_ahead`` later is posted."""
        src = self._source(link)
        self._post_next(link)
        posted = self._posted[link]
        announced: tuple[int, int] | None = None
        while True:
            self._wait(posted[0].work, what, src)
            buffer = posted.popleft().buffer
            self._received[link] += 1
            array = buffer.numpy() if self._on_cpu else None
            tail = _tail(buffer, array)
            header = tail[-_HEADER:]
            if header[_ANNOUNCE] != 1:
                break
            # An announcement: the messages from here on are posted at its size (the next ones, posted
            # already, are announcements of it too, or the message if the sizes agree).
            size = header[_SIZE]
            if size < _HEADER_BYTES or size % 8:
                raise PeerError(f"{self._name(self.rank)}: {self._name(src)} announced a message of {size} bytes "
                                f"for {what}")
            if announced is not None and (header[_KIND], header[_MICROBATCH]) != announced:
                raise PeerError(f"{self._name(self.rank)}: two announcements from {self._name(src)} for {what} "
                                "disagree: the ranks are out of step")
            announced = (header[_KIND], header[_MICROBATCH])
            self._recv_size[link] = size
            self._post_next(link)
        self._post_next(link)
        if header[_SIZE] != buffer.numel() or (announced is not None
                                               and (header[_KIND], header[_MICROBATCH]) != announced):
            raise PeerError(f"{self._name(self.rank)}: the message from {self._name(src)} for {what} does not "
                            f"match the buffer ({buffer.numel()} bytes) or the announcement before it: the ranks "
                            "are out of step")
        return buffer, array, tail, header

    def _accept(self, link: _Link, buffer: torch.Tensor, array: np.ndarray | None, tail: list[int],
                header: list[int], what: str) -> Message:
        """A taken message (see :meth:`_take`) as the stage's input: its payload unpacked, the sends it
        acknowledges completed."""
        try:
            payload = _unpack(buffer, tail, array)
        except (IndexError, ValueError, RuntimeError) as exc:
            raise PeerError(f"{self._name(self.rank)}: the message from {self._name(self._source(link))} for {what} is "
                            f"malformed ({_first_line(exc)})") from exc
        self._acknowledge((_REVERSE[link[0]], link[1]), header[_ACK])
        tag = header[_VERSION_TAG]
        return Message(payload, None if tag < 0 else tag, poisoned=bool(header[_POISONED]))

    # Going on after a failure ------------------------------------------------------------------------

    def sent_counts(self) -> dict[str, Any]:
        """What this rank has sent so far: messages per outgoing link (announcements and notices included)
        and losses per rank; the ranks that receive them take as many in :meth:`resync`."""
        links = {f"{kind}{b}": self._acknowledged[kind, b] + len(self._unacknowledged[kind, b])
                 for kind, b in self._links if not self._incoming((kind, b))}
        return {"links": links, "losses": dict(self._losses_sent)}

    def resync(self, counts: list[dict[str, Any]], keep: Callable[[Kind, int], bool]) -> None:
        """After a failure, with every rank's :meth:`sent_counts` (in rank order): take every message still
        on this rank's incoming links and every loss still sent to it. Those ``keep(kind, micro-batch)``
        accepts wait for their action (the drain after the failure); notices and the rest are dropped. The
        links are then in step again: each side agrees on what was sent, taken and acknowledged."""
        self.failure_notified = False  # a later failure is reported again
        for link in self._links:
            if not self._incoming(link):
                continue
            kind, b = link
            total = counts[self._source(link)]["links"][f"{kind}{b}"]
            stage = self._consumer(link)
            while self._received[link] < total:
                buffer, array, tail, header = self._take(link, "a message sent before the failure")
                if header[_ANNOUNCE] == _NOTICE:
                    self._post_next(link)
                    self._acknowledge((_REVERSE[kind], b), header[_ACK])
                    continue
                k = header[_MICROBATCH]
                message = self._accept(link, buffer, array, tail, header, "a message sent before the failure")
                if keep(kind, k):
                    self._given_back[stage, kind, k] = message
        last = self.last_rank
        if self.rank != last:
            while self._losses_taken < counts[last]["losses"].get(self.rank, 0):
                self._take_loss("a loss sent before the failure")

    def resume(self) -> None:
        """Nothing to undo: a failure stops no link (see :meth:`resync`)."""

    def drop(self, which: Callable[[int, Kind, int], bool]) -> None:
        for key in [key for key in self._given_back if which(*key)]:
            del self._given_back[key]
        for key in [key for key in self._local if which(*key)]:
            del self._local[key]

    def _wait(self, work: Any, what: str, peer: int) -> None:
        """Wait for a posted receive."""
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as exc:
            raise PeerError(
                f"{self._name(self.rank)}: {self._name(peer)} failed while {what} was expected "
                f"({exc.__class__.__name__}: "
                f"{_first_line(exc)}); it died or stopped answering (timeout {self.timeout.total_seconds():g} s)"
            ) from exc
        if ok is False:
            raise PeerError(f"{self._name(self.rank)}: no answer from {self._name(peer)} within "
                            f"{self.timeout.total_seconds():g} s "
                            f"while waiting for {what}")
