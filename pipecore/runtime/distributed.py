"""Point-to-point transport over ``torch.distributed`` (gloo on CPU, NCCL on GPU): one process per rank.

Rank ``s`` runs stage ``s``, or with several stages per rank the stages ``placement`` gives it (looped:
``r, r+R, ...``; V: ``r`` and ``2R-1-r``). Messages between two stages of one rank stay in the process. With
several replicas of the pipeline (data parallel), ranks here are pipeline ranks within this process's replica.

What travels where. Each link (a pair of neighbouring stages on different ranks, and a direction) is a stream
of the link layer (:mod:`pipecore.runtime.link`, which moves frames, acknowledges them, delivers them at exit,
carries failure notices and resyncs after a failure) on a two-rank process group of its own: activations go
from stage ``b`` to ``b+1`` on link ``(F, b)``, gradients back on ``(B, b)``, and the two are paired for the
acknowledgements. Mini-batch losses travel from the last rank to every other rank on the default group.

One process group per link: for gloo each group is its own connection and I/O thread. On one shared connection
a gradient arriving would hold the connection's lock while the same rank posts its next activation (and the
reverse), so every message waited for the other direction's traffic; with a group per link, a message never
waits for one on another link.

A message is one frame::

    [payload bytes]  [description]  [kind, micro-batch, stage-0 version tag, non-finite mark, description length]
    [the link layer's trailer]

the payload and its description as :mod:`pipecore.runtime.payload` lays them out, so neither the number of
tensors nor their dimensions are bounded; a payload the wire cannot carry is refused with a :class:`TypeError`
or :class:`ValueError` before anything is sent.

Ordering rule (why no pair of ranks can deadlock): the only operation that waits for a neighbour is the
receive of the input of the next action in the rank's own schedule. Sends are posted without waiting and
completed once the receiver has acknowledged them, so completing them never waits for the neighbour. A rank
therefore waits only for a message that the schedule's dependency order guarantees its neighbour produces
first, and schedules are validated deadlock-free. Each link carries one kind of message in one direction, in
schedule order, which is the order in which the receiver takes them. ``flush()`` (and process exit)
completes the sends still outstanding, with the timeout.

Receives posted ahead: ``receives_ahead`` on each incoming link (``K``), from construction on and across
``step()`` and ``flush()``. Breadth-first schedules send a stage's ``m`` activations back to back, and with a
single receive posted such a burst would pay a late post's delay once per message. A message whose size
differs from the one before costs ``K`` announcements of the old size (the price of receives posted ahead
where message sizes change, for instance with the sequence length). A posted buffer is not tied to a
micro-batch; the header says which one arrived.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.distributed as dist

from .. import _C

from ..schedule.ir import B, F, Kind
from .elastic import new_group
from .link import TRAILER, Incoming, Links, Outgoing, PeerError, first_line
from .payload import describe, unpack, write
from .worker import Message

# A message's header: its last words before the link layer's trailer.
_HEADER = 5
_KIND, _MICROBATCH, _VERSION_TAG, _POISONED, _WORDS = range(-TRAILER - _HEADER, -TRAILER)
_KIND_CODE = {F: 0, B: 1}
_REVERSE = {F: B, B: F}  # the link that carries messages back from the same neighbour
# Tags keep the kinds of message apart on gloo. NCCL ignores tags and matches a pair's messages in order,
# which is enough here: each link group carries one kind; on the default group, losses travel only inside
# step() (a rank takes its loss before step() returns) and share() only between steps, never both at once.
_TAG = {F: 10, B: 20}
_NEXT = {F: "the next activation", B: "the next gradient"}  # what a link's posted receive waits for
_CARRIES = {F: "activations", B: "gradients"}
_LOSS_TAG = 30
_SHARE_TAG = 40
_PREDICT_TAG = 50  # Pipeline.predict's result, from the last rank to the others (between steps)
_LOSS = "loss"  # the key of a loss stream
_LOSS_BYTES = 16  # a loss frame's body: (mini-batch, loss) in float64

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
                group = new_group(sorted(pair), f"the link of stages {b} and {b + 1}", timeout)
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
        self._world = dist.group.WORLD
        groups = _link_groups(self._global[rank], self.placement, self._grid, self.timeout)
        #: Receives kept posted on each link (both ends of a link must use the same number; links missing from
        #: a mapping get 1).
        self.receives_ahead: dict[_Link, int] = {
            link: receives_ahead if isinstance(receives_ahead, int) else receives_ahead.get(link, 1)
            for link in groups}
        if any(not isinstance(k, int) or k < 1 for k in self.receives_ahead.values()):
            raise ValueError(f"receives_ahead must be at least 1 on every link, got {receives_ahead!r}")
        #: This rank's ends of the streams: the links, keyed by ``(kind, boundary)``, then the losses.
        self.links = Links(rank, self.timeout, self.device, self._name)
        self._out: dict[_Link, Outgoing] = {}
        self._in: dict[_Link, Incoming] = {}
        for link, (group, peer) in groups.items():
            kind, b = link
            ahead = self.receives_ahead[link]
            if self._incoming(link):
                self._in[link] = self.links.receive_from(link, group, peer, self._source(link), _TAG[kind],
                                                         _NEXT[kind], ahead=ahead)
            else:
                self._out[link] = self.links.send_to(link, group, peer, self.placement[self._consumer(link)],
                                                     _TAG[kind], _CARRIES[kind], ahead=ahead)
        for (kind, b), outgoing in self._out.items():
            self.links.pair(outgoing, self._in[_REVERSE[kind], b])
        loss_size = _LOSS_BYTES + 8 * TRAILER
        self._loss_out = [self.links.send_to(_LOSS, self._world, self._global[r], r, _LOSS_TAG, "losses",
                                             loss_size) for r in self._other_ranks()] if rank == self.last_rank else []
        # Posted by expect_loss(), ahead of the wait in receive_loss() (the default group carries other traffic
        # between steps: see _TAG).
        self._loss_in = None if rank == self.last_rank else self.links.receive_from(
            _LOSS, self._world, self._global[self.last_rank], self.last_rank, _LOSS_TAG, "a loss", loss_size,
            eager=False)
        # Messages received, returned by a failed action: (stage, kind, micro-batch) -> message.
        self._given_back: dict[tuple[int, Kind, int], Message] = {}
        self._aborted: str | None = None  # the reason given to abort(), until resume()

    @property
    def closed(self) -> bool:
        return self.links.closed

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

    def _other_ranks(self) -> list[int]:
        """Every rank but the last stage's (the ranks that wait for its losses)."""
        return [r for r in range(self.num_ranks) if r != self.last_rank]

    # Sending ---------------------------------------------------------------------------------------

    def send(self, stage: int, kind: Kind, microbatch: int, message: Message) -> None:
        """Send ``message`` (payload ``None``, a tensor, or a tuple of tensors and ``None``) to ``stage``.
        Raises :class:`TypeError` or :class:`ValueError` (an unsupported dtype) before sending anything."""
        dst = self.placement[stage]
        if dst == self.rank:  # the next stage is on this rank: no wire, no copy
            describe(message.payload, self.rank)  # the same checks as on a wire
            self._local[stage, kind, microbatch] = message
            return
        outgoing = self._out[kind, _boundary(stage, kind)]
        entries, words, data = describe(message.payload, self.rank)
        description = len(words)
        size = data + 8 * (description + _HEADER + TRAILER)
        buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        array = buffer.numpy() if self._on_cpu else None
        write(buffer, array, entries)
        tag = -1 if message.tag is None else message.tag
        words += (_KIND_CODE[kind], microbatch, tag, int(message.poisoned), description)
        words += outgoing.trailer(size)
        if array is not None:
            array[data:].view(np.int64)[:] = words
        else:
            buffer[data:].view(torch.int64).copy_(torch.tensor(words, dtype=torch.int64))
        outgoing.post(buffer)

    def wait_sends(self) -> None:
        """Complete every posted send (before a flush ends or the process exits); raises :class:`PeerError`
        if a neighbour does not take its messages within the timeout."""
        self.links.wait_sends()

    def complete_sends(self, kind: Kind) -> None:
        """Complete every posted send on the outgoing links that carry ``kind`` (waiting, with the timeout,
        until the neighbour has taken them), as if acknowledged. For messages no reply follows
        (``Pipeline.predict``'s activations), whose buffers would otherwise wait for training's next one."""
        for (link_kind, _), outgoing in self._out.items():
            if link_kind is kind:
                outgoing.complete()

    def close(self, deliver: bool = True) -> None:
        """Release this rank's link groups (for gloo: their connections and threads); with ``deliver``, first
        complete the posted sends. Receives still posted are dropped. The transport cannot be used afterwards;
        closing twice does nothing."""
        try:
            self.links.close(deliver)
        finally:
            self._local.clear()
            self._given_back.clear()

    # Failures ------------------------------------------------------------------------------------------

    def notify_failure(self, text: str) -> None:
        """This rank stopped at an error (its own, or one a neighbour reported): tell the neighbours, with a
        failure notice on each outgoing link (it takes the place of the next message they wait for, so a rank
        waiting for this one learns the cause at once, and passes it on), and, from the last rank, every rank
        that may be waiting for a mini-batch loss. Best effort, once until :meth:`resync`: nothing here waits
        or raises."""
        self.links.notify_failure(text)

    def abort(self, reason: str) -> None:
        """Make every later :meth:`receive` raise ``pipecore._C.Aborted(reason)``, until :meth:`resume`. A
        receive already waiting on a link ends with its message or its timeout."""
        self._aborted = reason

    def resume(self) -> None:
        """Undo :meth:`abort`. (A failure stops no link: :meth:`resync` brings them back in step.)"""
        self._aborted = None

    # Small objects from every rank -----------------------------------------------------------------

    def share(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank: each rank sends its own to rank 0,
        which sends the list back. Point-to-point over the default group rather than a collective: a gloo
        collective can leave work behind that aborts the process at exit when the script never destroys the
        group. Every rank must call it; a rank that does not answer within the timeout is a
        :class:`PeerError` naming it."""
        what = "its share of an exchange between all ranks"
        if self.rank == 0:
            objs = [obj] + [self.links.receive_object(self._world, self._global[src], src, _SHARE_TAG, what)
                            for src in range(1, self.num_ranks)]
            for dst in range(1, self.num_ranks):
                self.links.send_object(objs, self._world, self._global[dst], dst, _SHARE_TAG)
            return objs
        self.links.send_object(obj, self._world, self._global[0], 0, _SHARE_TAG)
        return self.links.receive_object(self._world, self._global[0], 0, _SHARE_TAG, what)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """``obj`` (picklable; tensors on the CPU) from rank ``src`` on every rank: ``src`` sends it to each
        other rank, point-to-point over the default group like :meth:`share`. Every rank must call it; ``obj``
        is read on ``src`` only."""
        if self.rank == src:
            for dst in range(self.num_ranks):
                if dst != src:
                    self.links.send_object(obj, self._world, self._global[dst], dst, _PREDICT_TAG)
            return obj
        return self.links.receive_object(self._world, self._global[src], src, _PREDICT_TAG,
                                         "the result of predict()")

    # Mini-batch losses -----------------------------------------------------------------------------

    def publish_loss(self, minibatch: int, loss: float) -> None:
        """Last rank: send a mini-batch's loss to every other rank as soon as it is known. Point-to-point
        messages rather than a collective, so that no rank waits for another to reach the end of its step
        (a collective would re-synchronise an asynchronous pipeline at every step).

        What was sent to a rank before is completed first, without waiting: this loss needed every rank's
        forwards of this mini-batch, and a rank runs them only after its previous ``step()`` returned, that is
        after it received the previous loss (and after a failure, after it took every notice)."""
        value = torch.tensor([minibatch, loss], dtype=torch.float64)
        for outgoing in self._loss_out:
            outgoing.complete()
            outgoing.send(value)

    def expect_loss(self) -> None:
        """Post the receive of the next mini-batch loss (ranks other than the last), ahead of time."""
        if self._loss_in is not None:
            self._loss_in.expect()

    def receive_loss(self, minibatch: int) -> float:
        """The loss of ``minibatch`` that the last rank published (ranks other than the last)."""
        if self._loss_in is None:
            raise RuntimeError(f"{self._name(self.rank)} runs the last stage: it computes the losses")
        buffer, _, _ = self._loss_in.take(f"the loss of mini-batch {minibatch}")
        got, loss = buffer[:_LOSS_BYTES].view(torch.float64).tolist()
        if int(got) != minibatch:
            raise PeerError(f"{self._name(self.rank)} expected the loss of mini-batch {minibatch} but rank "
                            f"{self.last_rank} sent the loss of mini-batch {int(got)}: the ranks are out of step")
        return loss

    # Receiving -------------------------------------------------------------------------------------

    def ready(self, stage: int, kind: Kind, microbatch: int) -> bool:
        """Always True: :meth:`receive` waits (with the timeout) until the message is there."""
        return True

    def give_back(self, stage: int, kind: Kind, microbatch: int, message: Message) -> None:
        """Keep a received message for the action that took it to run again."""
        self._given_back[stage, kind, microbatch] = message

    def receive(self, stage: int, kind: Kind, microbatch: int) -> Message:
        """The message for ``stage``'s ``kind`` action on ``microbatch``, waiting for it (with the timeout). A
        neighbour that died, stopped answering, reports a failure or sent another message is a
        :class:`PeerError`."""
        if self._aborted is not None:
            raise _C.Aborted(self._aborted)
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
        buffer, array, tail = self._in[kind, _boundary(stage, kind)].take(what)
        if (tail[_KIND], tail[_MICROBATCH]) != (_KIND_CODE[kind], microbatch):
            raise PeerError(
                f"{self._name(self.rank)} expected {what} from {self._name(src)} but received kind {tail[_KIND]} "
                f"of micro-batch "
                f"{tail[_MICROBATCH]}: the ranks run different schedules (same algorithm, stages and "
                "micro-batches everywhere?)"
            )
        return self._message(buffer, array, tail, what, src)

    def _message(self, buffer: torch.Tensor, array: np.ndarray | None, tail: list[int], what: str,
                 src: int) -> Message:
        """A taken frame (see :meth:`Incoming.take`) as the stage's input, its payload unpacked."""
        words = tail[_WORDS]
        end = len(tail) + _KIND  # the description ends where the header begins
        if words <= end:
            description = tail[end - words: end]
        else:  # a description longer than the tail read in one go
            stop = buffer.numel() + 8 * _KIND
            description = buffer[stop - 8 * words: stop].view(torch.int64).tolist()
        try:
            payload = unpack(buffer, description, array)
        except (IndexError, ValueError, RuntimeError) as exc:
            raise PeerError(f"{self._name(self.rank)}: the message from {self._name(src)} for {what} is "
                            f"malformed ({first_line(exc)})") from exc
        tag = tail[_VERSION_TAG]
        return Message(payload, None if tag < 0 else tag, poisoned=bool(tail[_POISONED]))

    # Going on after a failure ------------------------------------------------------------------------

    def sent_counts(self) -> dict[Any, int]:
        """What this rank has sent so far on each stream (links and losses; announcements and notices
        included); the ranks that receive them take as many in :meth:`resync`."""
        return self.links.sent_counts()

    def resync(self, counts: list[Any], keep: Callable[[Kind, int], bool]) -> None:
        """After a failure, with every rank's :meth:`sent_counts` (in rank order): take every message still
        on this rank's incoming links and every loss still sent to it. Those ``keep(kind, micro-batch)``
        accepts wait for their action (the drain after the failure); notices, losses and the rest are dropped.
        The links are then in step again: each side agrees on what was sent, taken and acknowledged."""

        def kept(stream: Incoming, buffer: torch.Tensor, array: np.ndarray | None, tail: list[int]) -> None:
            if stream.key == _LOSS:
                return
            kind, b = stream.key
            k = tail[_MICROBATCH]
            if keep(kind, k):
                what = "a message sent before the failure"
                self._given_back[self._consumer(stream.key), kind, k] = self._message(buffer, array, tail, what,
                                                                                     stream.src)

        self.links.resync(counts, kept)

    def drop(self, which: Callable[[int, Kind, int], bool]) -> None:
        """Throw away the messages received (or between this rank's stages) for which ``which(stage, kind,
        micro-batch)`` is true."""
        for key in [key for key in self._given_back if which(*key)]:
            del self._given_back[key]
        for key in [key for key in self._local if which(*key)]:
            del self._local[key]
