"""The link layer: ordered streams of tensor frames between ranks over ``torch.distributed`` (gloo or NCCL).

The pipeline's messages (:mod:`pipecore.runtime.distributed`) and the tied gradients' exchange
(:mod:`pipecore.runtime.ties`) both travel here; each says what its frames mean, between which ranks and on
which process groups and tags, and this module moves them.

**Streams.** A stream carries frames from one rank to one other, in order, on one process group and tag.
This rank holds an :class:`Outgoing` end or an :class:`Incoming` end of it; a :class:`Links` holds all the
ends one user has, and does what concerns all of them at once (completing sends, failure notices, resync,
closing). Every wait is bounded by the timeout, and a peer that died, stopped answering or sent something
out of step is a :class:`PeerError` that names it.

**Frames.** A frame is one ``uint8`` buffer, aligned to 8 bytes throughout::

    [body bytes, padded to 8] [the user's words: int64] [trailer: 3 int64 words]   at the very end

The trailer is ``acknowledgement, size of the frame in bytes, what the frame is`` (:data:`MESSAGE`,
:data:`ANNOUNCEMENT` or :data:`NOTICE`). Only the trailer has a fixed place, so a frame's layout is the
user's: the receiver reads the last words of a frame in one go (one device-to-host copy on a GPU) and the user
finds its own words before the trailer.

**Acknowledgements.** A send's buffer must live until the backend has delivered it, and gloo reports a send
complete only when someone waits on it. Two streams in opposite directions between the same ranks can be
paired (:meth:`Links.pair`): every frame on one then carries how many frames its sender has taken from the
other, and the rank that takes it completes that many of its own sends, which returns at once because they
were received. Where traffic goes both ways, the sends held stay bounded by the frames in flight; a user
whose stream has no reverse completes its sends when it knows they were taken (:meth:`Outgoing.complete`).
Sends that NCCL reports complete by itself are dropped as the next ones are posted. Everything runs on the
calling thread: no helper thread competes with compute for a core or the GIL.

**Receives posted ahead.** gloo transfers a frame only once its receive is posted, and a receive posted
after its frame was sent is slow in the tail (``bench/post_latency.py``). An incoming stream keeps ``ahead``
receives posted from construction on, and posts the next as soon as one is taken (a lazy stream posts only
when asked, :meth:`Incoming.expect`). A posted buffer has the size that the announcements taken before it
was posted say (the size the stream started with before any). The sender tracks the sizes of the ``ahead``
buffers before its next frame identically; when a frame's size differs from its buffer's, it first fills
buffers with announcements: frames of exactly the buffer's size whose trailer gives the new size, until the
buffer for the frame has that size (``ahead`` announcements: the buffers already posted have the old size).
The receiver takes announcements until another frame comes. Announcements count as frames everywhere (for
the acknowledgements, the counts of :meth:`Links.sent_counts`).

**Failure notices.** A rank that stops at an error sends a notice on each of its outgoing streams
(:meth:`Links.notify_failure`), in place of the next frame a peer may be waiting for, so that the peer
raises a :class:`PeerError` with the cause at once (and passes it on) rather than at its timeout. A notice is
a frame whose body is the cause as UTF-8 text, followed by its length.

**Resync.** After a failure that the ranks recover from, every rank shares what it sent on each stream
(:meth:`Links.sent_counts`) and takes whatever is still on its way to it (:meth:`Links.resync`): notices are
dropped, the user decides for every other frame. Each side then agrees on what was sent, taken and
acknowledged, and the streams go on.

**Delivery at exit.** Sends not yet completed when the script ends (a last step's gradients and loss) are
completed before the process exits, with the timeout, rather than lost; then the streams let go of their
process groups, before interpreter teardown (a gloo group destroyed that late can abort the process).
"""

from __future__ import annotations

import atexit
import datetime
import pickle
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .. import _C

#: What a frame is: the last word of its trailer.
MESSAGE, ANNOUNCEMENT, NOTICE = 0, 1, 2
#: The words at the end of every frame: acknowledgement, size in bytes, what the frame is.
TRAILER = 3
TRAILER_BYTES = 8 * TRAILER
_ACK, _SIZE, _WHAT = -3, -2, -1  # the trailer's words, counted from a frame's end
# Words read from a frame's end in one go: the trailer and, but for very long ones, the user's words.
_TAIL_WORDS = 64


class PeerError(RuntimeError):
    """A neighbouring rank died, stopped answering, or sent something this stage cannot take; or another rank
    stopped at an error, which ``cause`` then describes (``"NonFiniteLoss at stage 3 (rank 3), 3F5: ..."``)."""

    cause: str | None = None

    @classmethod
    def reported(cls, rank: int, src: int, cause: str) -> "PeerError":
        err = cls(f"rank {rank}: rank {src} reports that {cause}")
        err.cause = cause
        return err


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message: a backend's errors run to many lines, an error quoting one says
    what failed in one."""
    return str(exc).splitlines()[0] if str(exc) else "no detail"


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to 8, so that what follows stays aligned for int64 and float64 views."""
    return (nbytes + 7) // 8 * 8


@dataclass
class _Sent:
    """A posted send; its buffer lives until the send is completed."""

    work: Any  # the backend's Work
    buffer: torch.Tensor


@dataclass
class _FailedReceive:
    """A receive that could not be posted (the peer had closed its connection): what the take waiting for
    its frame raises. A receive is posted ahead, before anyone waits for its frame, so a peer that has finished
    and left is no error until a frame from it is waited for."""

    error: PeerError


class Outgoing:
    """This rank's sending end of a stream: frames to rank ``dst`` (``peer`` in ``group``) with ``tag``, in
    order, posted without waiting and held until completed. ``label`` says what the stream carries in errors
    ("activations"); ``size`` and ``ahead`` are the receiving end's (:class:`Incoming`), which must agree."""

    def __init__(self, links: "Links", key: Hashable, group: Any, peer: int, dst: int, tag: int, label: str,
                 size: int, ahead: int):
        self.links, self.key, self.group, self.peer, self.dst, self.tag, self.label = (
            links, key, group, peer, dst, tag, label)
        #: The stream in the other direction whose frames taken this stream's frames acknowledge (see Links.pair).
        self.reverse: Incoming | None = None
        self.completed = 0  # sends completed so far
        self._pending: deque[_Sent] = deque()  # sends posted and not completed, oldest first
        # The sizes of the receiver's buffers for the next ``ahead`` frames, and the size the last announcement
        # gave (the size of the buffers it posts next).
        self._ahead = deque([size] * ahead)
        self._announced = size

    @property
    def sent(self) -> int:
        """Frames posted so far (announcements and notices included)."""
        return self.completed + len(self._pending)

    @property
    def held(self) -> int:
        """Sends posted and not completed yet: their buffers are still held."""
        return len(self._pending)

    def trailer(self, size: int, what: int = MESSAGE) -> list[int]:
        """The last words of a frame of ``size`` bytes sent now: the acknowledgement, the size, what it is."""
        reverse = self.reverse
        return [0 if reverse is None else reverse.received, size, what]

    def post(self, frame: torch.Tensor) -> None:
        """Send ``frame`` (``uint8``, its trailer from :meth:`trailer` in place) without waiting; announcements of
        its size go first where the receiver's buffer for it has another size."""
        size = frame.numel()
        ahead = self._ahead
        while ahead[0] != size:
            # Only an announcement's trailer is read: the rest of it need not be written.
            announcement = torch.empty(ahead[0], dtype=torch.uint8, device=frame.device)
            announcement[-TRAILER_BYTES:].view(torch.int64).copy_(
                torch.tensor(self.trailer(size, ANNOUNCEMENT), dtype=torch.int64))
            self._post(announcement)
            self._announced = size
            ahead.popleft()
            ahead.append(size)
        self._post(frame)
        ahead.popleft()
        ahead.append(self._announced)

    def send(self, body: torch.Tensor, words: Sequence[int] = (), what: int = MESSAGE) -> torch.Tensor:
        """Send a frame of ``body`` (a tensor, copied in) and ``words`` without waiting, and return it (the body
        is a view at its start, ``body.numel() * body.element_size()`` bytes)."""
        nbytes = body.numel() * body.element_size()
        start = padded(nbytes)
        size = start + 8 * (len(words) + TRAILER)
        frame = torch.empty(size, dtype=torch.uint8, device=self.links.device)
        if nbytes:
            frame[:nbytes].view(body.dtype).view(body.shape).copy_(body.detach())
        if start != nbytes:
            frame[nbytes:start].zero_()
        frame[start:].view(torch.int64).copy_(torch.tensor([*words, *self.trailer(size, what)], dtype=torch.int64))
        self.post(frame)
        return frame

    def notify(self, text: str) -> None:
        """Send a failure notice: ``text`` (the cause) and its length, in place of the next frame."""
        data = text.encode()
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        self.send(body, [len(data)], NOTICE)

    def _post(self, buffer: torch.Tensor) -> None:
        pending = self._pending
        while pending and pending[0].work.is_completed():  # NCCL says so by itself; gloo only once waited on
            pending.popleft()
            self.completed += 1
        pending.append(_Sent(self.links.post_send(self.group, self.peer, buffer, self.tag, self.dst, self.label),
                             buffer))

    def acknowledge(self, count: int) -> None:
        """The receiver has taken ``count`` frames of this stream: complete those sends (at once: they were
        delivered)."""
        pending = self._pending
        while self.completed < count and pending:
            self.links.complete(pending.popleft().work, self.dst, self.label)
            self.completed += 1

    def complete(self) -> None:
        """Complete every send posted, waiting (with the timeout) until the receiver has taken them; the count
        stays in step with the receiver's, so later acknowledgements complete only later sends."""
        self.acknowledge(self.sent)

    def release(self) -> None:
        """Drop the sends held and the process group."""
        self.group = None
        self._pending.clear()


class Incoming:
    """This rank's receiving end of a stream: frames from rank ``src`` (``peer`` in ``group``) with ``tag``, in
    order. ``ahead`` receives are kept posted, from construction on (``eager``), or from :meth:`expect` on;
    ``size`` is the size of the first buffers (the sender's :class:`Outgoing` must have the same ``size`` and
    ``ahead``). ``label`` says what the next frame is in errors ("the next activation")."""

    def __init__(self, links: "Links", key: Hashable, group: Any, peer: int, src: int, tag: int, label: str,
                 size: int, ahead: int, eager: bool):
        self.links, self.key, self.group, self.peer, self.src, self.tag, self.label = (
            links, key, group, peer, src, tag, label)
        self.ahead, self.eager = ahead, eager
        #: The stream in the other direction whose sends this stream's frames acknowledge (see Links.pair).
        self.reverse: Outgoing | None = None
        self.received = 0  # frames taken so far
        self._size = size  # the size the announcements taken so far give: that of the next receive posted
        self._posted: deque[tuple[torch.Tensor, Any]] = deque()  # receives posted, oldest first
        if eager:
            self.expect()

    @property
    def posted(self) -> int:
        """Receives posted now."""
        return len(self._posted)

    def expect(self) -> None:
        """Post receives until ``ahead`` are posted, at the size announced so far."""
        posted, links = self._posted, self.links
        while len(posted) < self.ahead:
            buffer = torch.empty(self._size, dtype=torch.uint8, device=links.device)
            try:
                work: Any = links.post_receive(self.group, self.peer, buffer, self.tag, self.src, self.label)
            except PeerError as error:
                work = _FailedReceive(error)
            posted.append((buffer, work))

    def take(self, what: str) -> tuple[torch.Tensor, np.ndarray | None, list[int]]:
        """The next frame, waiting for it (the announcements before it are taken on the way): its buffer, the
        buffer's numpy view on the CPU (else None), and the int64 words at its end, the trailer last. A failure
        notice raises :class:`PeerError` with its cause. ``what`` names the frame in errors."""
        buffer, array, tail = self.take_any(what)
        if tail[_WHAT] == NOTICE:
            raise PeerError.reported(self.links.rank, self.src, _notice_text(buffer, tail))
        return buffer, array, tail

    def take_any(self, what: str) -> tuple[torch.Tensor, np.ndarray | None, list[int]]:
        """As :meth:`take`, but a notice is returned like any frame (the last word of its tail says
        :data:`NOTICE`)."""
        links = self.links
        self.expect()
        posted = self._posted
        while True:
            work = posted[0][1]
            if isinstance(work, _FailedReceive):
                raise work.error
            links.wait(work, what, self.src)  # a receive that timed out stays posted for a later take
            buffer = posted.popleft()[0]
            self.received += 1
            array = buffer.numpy() if links.on_cpu else None
            tail = (array[-min(array.size, 8 * _TAIL_WORDS):].view(np.int64).tolist() if array is not None
                    else buffer[-min(buffer.numel(), 8 * _TAIL_WORDS):].view(torch.int64).tolist())
            if tail[_WHAT] != ANNOUNCEMENT:
                break
            # The frames from here on are posted at the announced size (the next ones, posted already, are
            # announcements of it too, or the frame if the sizes agree).
            size = tail[_SIZE]
            if size < TRAILER_BYTES or size % 8:
                raise PeerError(f"{links.name(links.rank)}: {links.name(self.src)} announced a frame of {size} "
                                f"bytes for {what}")
            self._size = size
            self.expect()
        if self.eager:
            self.expect()  # before anything else: the peer's next frame finds its receive posted
        if tail[_SIZE] != buffer.numel():
            raise PeerError(f"{links.name(links.rank)}: the frame from {links.name(self.src)} for {what} has "
                            f"{tail[_SIZE]} bytes, its buffer {buffer.numel()}: the ranks are out of step")
        if self.reverse is not None:
            self.reverse.acknowledge(tail[_ACK])
        return buffer, array, tail

    def release(self) -> None:
        """Drop the receives posted and the process group."""
        self.group = None
        self._posted.clear()


def _notice_text(buffer: torch.Tensor, tail: list[int]) -> str:
    """The cause a failure notice carries."""
    length = tail[-TRAILER - 1]
    return bytes(buffer[:length].cpu().numpy()).decode(errors="replace")


def _deliver_at_exit(links: "weakref.ref[Links]") -> None:
    live = links()
    if live is not None and not live.closed:
        try:
            live.wait_sends()
        except (PeerError, RuntimeError):
            pass  # the receiving rank is gone; nothing can be delivered
        finally:
            live.release()


#: What ``keep`` of :meth:`Links.resync` is given for a frame taken: its stream, buffer, numpy view and tail.
Keep = Callable[[Incoming, torch.Tensor, "np.ndarray | None", list[int]], None]


class Links:
    """The ends of streams that one user on this rank holds (``rank`` names it in the streams' counts and
    errors; ``name`` says how errors name a rank, ``"rank 3"`` without it). Every wait is bounded by
    ``timeout``; frames live on ``device`` (for NCCL, the GPU). The sends still held at exit are completed
    then (see the module docstring)."""

    def __init__(self, rank: int, timeout: datetime.timedelta, device: torch.device,
                 name: Callable[[int], str] | None = None):
        self.rank, self.timeout, self.device = rank, timeout, device
        self.on_cpu = device.type == "cpu"
        self._name = name
        self.outgoing: list[Outgoing] = []
        self.incoming: list[Incoming] = []
        self._groups: dict[int, Any] = {}  # the streams' process groups, the default group left out, by id
        self.failure_notified = False
        self.closed = False
        atexit.register(_deliver_at_exit, weakref.ref(self))

    def name(self, rank: int) -> str:
        """How errors name ``rank``."""
        return f"rank {rank}" if self._name is None else self._name(rank)

    # Streams -----------------------------------------------------------------------------------------

    def send_to(self, key: Hashable, group: Any, peer: int, dst: int, tag: int, label: str,
                size: int = TRAILER_BYTES, ahead: int = 1) -> Outgoing:
        """A new stream to ``dst`` (``peer`` in ``group``); ``key`` names it, with ``dst``, in
        :meth:`sent_counts` (the receiving end has the same key). See :class:`Outgoing`."""
        self._add(group, size)
        stream = Outgoing(self, key, group, peer, dst, tag, label, size, ahead)
        self.outgoing.append(stream)
        return stream

    def receive_from(self, key: Hashable, group: Any, peer: int, src: int, tag: int, label: str,
                     size: int = TRAILER_BYTES, ahead: int = 1, eager: bool = True) -> Incoming:
        """A new stream from ``src`` (``peer`` in ``group``), the sender's stream ``key``. See :class:`Incoming`."""
        self._add(group, size)
        stream = Incoming(self, key, group, peer, src, tag, label, size, ahead, eager)
        self.incoming.append(stream)
        return stream

    def _add(self, group: Any, size: int) -> None:
        if size < TRAILER_BYTES or size % 8:
            raise ValueError(f"a frame has a multiple of 8 bytes, at least {TRAILER_BYTES}, not {size}")
        if group is not dist.group.WORLD:
            self._groups[id(group)] = group

    @staticmethod
    def pair(outgoing: Outgoing, incoming: Incoming) -> None:
        """Two streams between this rank and one peer, in opposite directions: each frame sent on ``outgoing``
        acknowledges the frames taken from ``incoming``, and each taken from ``incoming`` completes the sends on
        ``outgoing`` it acknowledges (the peer pairs the same two)."""
        outgoing.reverse, incoming.reverse = incoming, outgoing

    def held(self) -> int:
        """Sends posted and not completed, on every outgoing stream."""
        return sum(stream.held for stream in self.outgoing)

    # Posting and waiting, failures named -------------------------------------------------------------

    def post_send(self, group: Any, peer: int, buffer: torch.Tensor, tag: int, dst: int, label: str) -> Any:
        """Post the send of ``buffer`` to ``dst`` (``peer`` in ``group``) without waiting; its Work."""
        if group is None:
            raise RuntimeError(f"{self.name(self.rank)}: the links were closed")
        try:
            # Outside any profiler recording: a send or receive completes whenever the peer takes part, maybe
            # after the profiler stopped, and a profiler event ended then crashes torch 2.13's profiler results
            # when they are freed. The stages' actions are recorded as ranges anyway.
            with _C.RecordingOff():
                return group.send([buffer], peer, tag)
        except RuntimeError as exc:
            raise self._send_failed(dst, label, exc) from exc

    def post_receive(self, group: Any, peer: int, buffer: torch.Tensor, tag: int, src: int, what: str) -> Any:
        """Post the receive of ``what`` into ``buffer`` from ``src`` (``peer`` in ``group``); its Work."""
        if group is None:
            raise RuntimeError(f"{self.name(self.rank)}: the links were closed")
        try:
            with _C.RecordingOff():  # see post_send
                return group.recv([buffer], peer, tag)
        except RuntimeError as exc:
            raise PeerError(f"{self.name(self.rank)}: could not post the receive of {what} from {self.name(src)} "
                            f"({first_line(exc)}); {self.name(src)} died or stopped answering") from exc

    def wait(self, work: Any, what: str, src: int) -> None:
        """Wait (with the timeout) for a posted receive of ``what`` from ``src``."""
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as exc:
            raise PeerError(
                f"{self.name(self.rank)}: {self.name(src)} failed while {what} was expected "
                f"({exc.__class__.__name__}: "
                f"{first_line(exc)}); it died or stopped answering (timeout {self.timeout.total_seconds():g} s)"
            ) from exc
        if ok is False:
            raise PeerError(f"{self.name(self.rank)}: no answer from {self.name(src)} within "
                            f"{self.timeout.total_seconds():g} s while waiting for {what}")

    def complete(self, work: Any, dst: int, label: str) -> None:
        """Wait (with the timeout) for a posted send of ``label`` to ``dst``."""
        try:
            done = work.wait(self.timeout)
        except RuntimeError as exc:
            raise self._send_failed(dst, label, exc) from exc
        if done is False:
            raise self._send_failed(dst, label, TimeoutError("the send did not complete"))

    def _send_failed(self, dst: int, label: str, exc: BaseException) -> PeerError:
        return PeerError(f"{self.name(self.rank)}: sending {label} to {self.name(dst)} failed ({first_line(exc)}); "
                         f"{self.name(dst)} died or stopped answering (timeout {self.timeout.total_seconds():g} s)")

    # Objects, outside the streams --------------------------------------------------------------------

    def send_object(self, obj: Any, group: Any, peer: int, dst: int, tag: int) -> None:
        """Send ``obj`` (picklable; tensors on the CPU) to ``dst`` (``peer`` in ``group``) and wait until it
        was taken: its size, then its pickled bytes."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        for tensor in (torch.tensor([data.numel()], dtype=torch.int64, device=self.device), data):
            self.complete(self.post_send(group, peer, tensor, tag, dst, "an object"), dst, "an object")

    def receive_object(self, group: Any, peer: int, src: int, tag: int, what: str) -> Any:
        """The object :meth:`send_object` sends from ``src`` (``peer`` in ``group``); ``what`` names it in errors."""
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        self.wait(self.post_receive(group, peer, size, tag, src, what), what, src)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.wait(self.post_receive(group, peer, data, tag, src, what), what, src)
        return pickle.loads(data.cpu().numpy().tobytes())

    # Every stream at once ----------------------------------------------------------------------------

    def wait_sends(self) -> None:
        """Complete every posted send (before a flush ends or the process exits); raises :class:`PeerError` if
        a peer does not take its frames within the timeout."""
        for stream in self.outgoing:
            stream.complete()

    def notify_failure(self, text: str) -> None:
        """This rank stopped at an error (its own, or one a peer reported; ``text`` describes it): send a
        failure notice on every outgoing stream. Best effort, once until :meth:`resync`: nothing here waits or
        raises."""
        if self.failure_notified or self.closed:
            return
        self.failure_notified = True
        for stream in self.outgoing:
            try:
                stream.notify(text)
            except (PeerError, RuntimeError):
                pass  # that peer is gone

    def sent_counts(self) -> dict[tuple[Hashable, int], int]:
        """Frames sent so far on each outgoing stream, by ``(key, destination)``; the receivers take as many in
        :meth:`resync`."""
        return {(stream.key, stream.dst): stream.sent for stream in self.outgoing}

    def resync(self, counts: Sequence[Mapping[tuple[Hashable, int], int]], keep: Keep) -> None:
        """After a failure, with every rank's :meth:`sent_counts` (in rank order): take every frame still on
        its way to this rank. Notices are dropped; ``keep(stream, buffer, array, tail)`` is given every other
        frame, as :meth:`Incoming.take` returns it, and decides. A later failure is notified again."""
        self.failure_notified = False
        me = self.name(self.rank)
        for stream in self.incoming:
            sent = counts[stream.src].get((stream.key, self.rank))
            if sent is None:
                raise PeerError(f"{me}: {self.name(stream.src)} sent no count for {stream.label}; the ranks "
                                "disagree on their links")
            if stream.received > sent:
                raise PeerError(f"{me} took {stream.received} frames of {stream.label} from "
                                f"{self.name(stream.src)}, which sent {sent}: the ranks are out of step")
            while stream.received < sent:
                buffer, array, tail = stream.take_any("a message sent before the failure")
                if tail[_WHAT] != NOTICE:
                    keep(stream, buffer, array, tail)

    def release(self) -> list[Any]:
        """Let go of every stream's sends, receives and process group (the receives still posted are dropped);
        return the groups the streams used, the default group left out, each once."""
        for stream in [*self.outgoing, *self.incoming]:
            stream.release()
        groups, self._groups = list(self._groups.values()), {}
        return groups

    def close(self, deliver: bool = True) -> None:
        """Destroy the streams' process groups (for gloo: their connections and threads; the default group
        stays); with ``deliver``, first complete the posted sends. Receives still posted are dropped. Nothing
        can be sent or taken afterwards; closing twice does nothing."""
        if self.closed:
            return
        try:
            if deliver:
                self.wait_sends()
        finally:
            self.closed = True
            groups = self.release()
            if dist.is_initialized():  # after destroy_process_group() of the default group, all are gone
                for group in groups:
                    dist.destroy_process_group(group)

