"""Tied parameters: gradients summed over the stages that share a parameter.

A tied parameter (a language model's token embedding and output head, say) lives in several stages, each
with its own copy. Before an update, the gradients of one update group from all owners are summed, so that
every copy applies the same gradient and the copies stay equal. The sum is always formed in increasing stage
order, ``((g_a + g_b) + g_c)``, by every owner, so all owners get a bit-identical result.

Two implementations of :class:`TiedGradients`:

* :class:`LocalTiedGradients`: every stage in this process; an in-memory mailbox.
* :class:`DistributedTiedGradients`: one process per stage over ``torch.distributed``; process groups over
  each tie's owners.

Process groups: per tie, one group over its owners for each owner's outgoing messages, so every group carries
one direction between any two ranks (as the transport's links do). On NCCL a pair's sends and receives run
in order on one stream per communicator: with both directions on one group, the receive each owner posts
ahead of time would hold back its own send, on both sides, for ever. On gloo it also keeps one direction's
traffic from waiting for the other's.

Wire format of :class:`DistributedTiedGradients`: per tie and update group, each owner sends one ``uint8``
buffer to every other owner (the same buffer to all of them)::

    [gradient bytes, padded to 8] [update group: int64] [acknowledgements: one int64 per owner, in owner order]

A failure notice has the same size, the group word ``-1`` and, in place of the gradient, the failure's
description as UTF-8 text (cut to the gradient's bytes).

The acknowledgement for owner ``o`` is how many of ``o``'s messages on this tie the sender had received when
it posted the message. gloo reports a send complete only once someone waits on it (``Work.is_completed()``
stays false until then), so sends are pruned both by ``is_completed()`` (enough on NCCL) and by these
acknowledgements: waiting on a send that the peer says it received returns at once. Without them a long run
on gloo would keep every gradient it ever sent; with them an owner holds about one send per other owner and
tie, as long as owners alternate post and reduce. Sends that no later message acknowledges (an owner that
posts several groups ahead, the last group) are completed by :meth:`DistributedTiedGradients.wait_sends` or
``close()``.

Ordering: a send never waits for its receiver. Each owner keeps the receive of every other owner's next
message posted ahead of time (from construction when the shapes are given, else from its first post), so a
message is transferred as soon as it is sent, whether or not its receiver has reached its reduce. The only
operation that waits is :meth:`DistributedTiedGradients.reduce`, for the other owners' messages of that
group; an owner that is dead or silent is a :class:`~pipecore.runtime.distributed.PeerError` after the
timeout, naming the rank and the tie. Messages arrive in order on each (tie, sender), so every owner must
post the same update groups and reduce them in increasing order; each message names its update group and a
mismatch is a ``PeerError`` ("out of step") rather than a wrong sum.

After a failure (``Pipeline`` recovery): a rank that stops at an error sends a failure notice on each of its
streams (:meth:`DistributedTiedGradients.notify_failure`), so that an owner waiting in ``reduce`` for its
gradients raises a ``PeerError`` with the cause at once rather than at its timeout. Each owner then takes
back its own undone work: :meth:`~DistributedTiedGradients.withdraw` drops its posts of the undone groups,
:meth:`~DistributedTiedGradients.unreduce` gives back the parts of the groups its undone updates reduced
(kept per epoch, as :class:`LocalTiedGradients` keeps them). Messages may still be on their way, some of
withdrawn groups: :meth:`~DistributedTiedGradients.resync` takes every message each owner sent before the
failure (the ranks share :meth:`~DistributedTiedGradients.sent_counts`), keeps the gradients of the groups
before the first undone one for their reduce and drops the rest. Every owner numbers its groups alike (one
per update group of micro-batches it backwarded), so the first undone group is the same number on every
owner and each can tell, from a message's group word, whether it was withdrawn. Afterwards every stream
carries only the groups its sender posts again, in order.
"""

from __future__ import annotations

import atexit
import datetime
import threading
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .. import _C

from .distributed import PeerError, _first_line, _padded

# Each group carries one tie's messages from one sender, so one tag is enough (NCCL ignores tags and matches
# in order, which is the order here too).
_TIE_TAG = 50
# The group word of a failure notice (update groups count from 0).
_NOTICE_GROUP = -1

Shape = tuple[torch.Size | Sequence[int], torch.dtype]


class TiedGradients(Protocol):
    """Exchanges the gradients of tied parameters between the stages that own them."""

    def post(self, stage: int, group: int, grads: dict[str, torch.Tensor]) -> None:
        """Stage ``stage``'s own gradients of update group ``group`` (a running count, per stage, that never
        resets), one tensor per tie name it owns. Called once per group, in increasing group order."""

    def ready(self, stage: int, group: int) -> bool:
        """Whether ``reduce(stage, group)`` can return without waiting (a blocking transport always says True)."""

    def reduce(self, stage: int, group: int) -> dict[str, torch.Tensor]:
        """For each tie name ``stage`` owns: the sum of ALL owners' gradients of ``group`` (its own included),
        added in increasing stage order so every owner gets a bit-identical result. Each (stage, group) is
        reduced once; afterwards nothing of that group needs to be kept for this stage."""

    def wait_sends(self) -> None:
        """Complete every posted send (at a flush; a networked implementation waits with its timeout)."""

    def withdraw(self, stage: int, first_group: int) -> None:
        """Take back ``stage``'s posts of group ``first_group`` and later (their backwards were undone)."""

    def unreduce(self, stage: int, groups: range) -> None:
        """``stage``'s updates that reduced ``groups`` were undone: they will reduce them again."""

    def new_epoch(self, forget_before: int | None) -> int:
        """Start a new epoch and return its number; what was reduced before epoch ``forget_before`` (None: all)
        is forgotten (no :meth:`unreduce` asks for it)."""

    def close(self, deliver: bool = True) -> None:
        """Release what is held (a networked implementation: its process groups, after completing the sends
        if ``deliver``)."""


def _check_ties(ties: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    checked: dict[str, tuple[int, ...]] = {}
    for name, owners in ties.items():
        owners = tuple(owners)
        if len(owners) < 2 or list(owners) != sorted(set(owners)) or owners[0] < 0:
            raise ValueError(f"tie {name!r}: owners must be at least two distinct stages in increasing order, "
                             f"got {owners}")
        checked[name] = owners
    return checked


def _owned(ties: Mapping[str, tuple[int, ...]], stage: int) -> list[str]:
    return [name for name, owners in ties.items() if stage in owners]


def _check_post(stage: int, group: int, grads: Mapping[str, torch.Tensor], owned: Sequence[str],
                last: int | None) -> None:
    if set(grads) != set(owned):
        raise ValueError(f"stage {stage} owns the ties {sorted(owned)} but posted gradients for {sorted(grads)}")
    if last is not None and group <= last:
        raise ValueError(f"stage {stage} posted update group {group} after group {last}; groups are posted once "
                         "each, in increasing order")


def _sum_in_stage_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``((p0 + p1) + p2) ...``: the same operations in the same order on every owner, hence the same bits."""
    total = torch.add(parts[0], parts[1])
    for part in parts[2:]:
        total.add_(part)
    return total


class LocalTiedGradients:
    """Every stage in this process: posted gradients wait in a mailbox until every owner reduced them."""

    def __init__(self, ties: Mapping[str, Sequence[int]]):
        self.ties = _check_ties(ties)
        # (tie, group) -> owner stage -> its gradient (a clone: the caller zeroes its buffer after posting).
        self._posted: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
        # (tie, group) -> the owners that reduced it; the entry goes once all have.
        self._reduced: dict[tuple[str, int], set[int]] = {}
        self._last: dict[int, int] = {}
        # (tie, group) -> owner -> the CUDA event its copy is ready at (stages on their own streams).
        self._ready_at: dict[tuple[str, int], dict[int, Any]] = {}
        # Groups every owner reduced, with the epoch they were reduced in (see new_epoch), kept so that an undone
        # update can reduce them again; from the first new_epoch() on (before it, nothing would forget them).
        self._retired: dict[tuple[str, int], tuple[int, dict[int, torch.Tensor]]] = {}
        self._epoch = 0
        # Stages may run on their own threads.
        self._lock = threading.Lock()

    def post(self, stage: int, group: int, grads: dict[str, torch.Tensor]) -> None:
        """Keep a copy of ``stage``'s gradients of ``group`` until every owner reduced it."""
        with self._lock:
            _check_post(stage, group, grads, _owned(self.ties, stage), self._last.get(stage))
            self._last[stage] = group
            for name, grad in grads.items():
                self._posted.setdefault((name, group), {})[stage] = grad.detach().clone()
                if grad.is_cuda:
                    event = torch.cuda.Event()
                    event.record()
                    self._ready_at.setdefault((name, group), {})[stage] = event

    def ready(self, stage: int, group: int) -> bool:
        """Whether every owner of every tie ``stage`` owns has posted ``group``."""
        with self._lock:
            return self._ready(stage, group)

    def _ready(self, stage: int, group: int) -> bool:
        for name in _owned(self.ties, stage):
            posted = self._posted.get((name, group), {})
            if any(owner not in posted for owner in self.ties[name]):
                return False
        return True

    def reduce(self, stage: int, group: int) -> dict[str, torch.Tensor]:
        """Per tie ``stage`` owns, the sum in stage order (fresh tensors, on the device of ``stage``'s own
        copy); raises if not :meth:`ready`."""
        with self._lock:
            return self._reduce(stage, group)

    def _reduce(self, stage: int, group: int) -> dict[str, torch.Tensor]:
        owned = _owned(self.ties, stage)
        if not self._ready(stage, group):
            missing = {name: [o for o in self.ties[name] if o not in self._posted.get((name, group), {})]
                       for name in owned}
            raise RuntimeError(f"stage {stage}: update group {group} cannot be reduced yet; not posted by "
                               f"{ {k: v for k, v in missing.items() if v} } (check ready() first)")
        sums: dict[str, torch.Tensor] = {}
        for name in owned:
            key = (name, group)
            done = self._reduced.setdefault(key, set())
            if stage in done:
                raise RuntimeError(f"stage {stage} reduced update group {group} of tie {name!r} twice")
            posted = self._posted[key]
            sums[name] = _sum_in_stage_order(_readable(posted, self._ready_at.get(key, {}), self.ties[name], stage))
            done.add(stage)
            if len(done) == len(self.ties[name]):  # every owner has its sum: nothing of this group is needed
                posted = self._posted.pop(key)
                if self._epoch:  # but an undone update may reduce it again (kept only while epochs are counted)
                    self._retired[key] = (self._epoch, posted)
                del self._reduced[key]
                self._ready_at.pop(key, None)
        return sums

    def new_epoch(self, forget_before: int | None) -> int:
        """Start a new epoch (a pipeline starts one per step) and return its number; the groups every owner
        reduced before epoch ``forget_before`` (None: all) are dropped, no :meth:`unreduce` will ask for them."""
        with self._lock:
            for key in [k for k, (epoch, _) in self._retired.items() if forget_before is None or epoch < forget_before]:
                del self._retired[key]
            self._epoch += 1
            return self._epoch

    def withdraw(self, stage: int, first_group: int) -> None:
        """Take back ``stage``'s posts of group ``first_group`` and later (their backwards were undone)."""
        with self._lock:
            for key in [key for key in self._posted if key[1] >= first_group]:
                self._posted[key].pop(stage, None)
                self._ready_at.get(key, {}).pop(stage, None)
                if not self._posted[key]:
                    del self._posted[key]
                    self._reduced.pop(key, None)
                    self._ready_at.pop(key, None)
            if self._last.get(stage, -1) >= first_group:
                self._last[stage] = first_group - 1

    def unreduce(self, stage: int, groups: range) -> None:
        """``stage``'s updates that reduced ``groups`` were undone: they will reduce them again."""
        with self._lock:
            for name in _owned(self.ties, stage):
                for group in groups:
                    key = (name, group)
                    if key in self._retired:
                        self._posted[key] = self._retired.pop(key)[1]
                        self._reduced[key] = set(self.ties[name])
                    if key not in self._reduced or stage not in self._reduced[key]:
                        raise RuntimeError(f"stage {stage} did not reduce update group {group} of tie {name!r}, or "
                                           "the group was forgotten")
                    self._reduced[key].discard(stage)

    def wait_sends(self) -> None:
        """Nothing to complete: posting stores the gradients."""

    def close(self, deliver: bool = True) -> None:
        """Drop everything posted."""
        with self._lock:
            self._posted.clear()
            self._reduced.clear()
            self._ready_at.clear()
            self._retired.clear()


def _readable(posted: Mapping[int, torch.Tensor], events: Mapping[int, Any], owners: Sequence[int],
              stage: int) -> list[torch.Tensor]:
    """The owners' posted copies, in owner order, readable on ``stage``'s device and current stream: a copy
    made on another stage's CUDA stream is waited for, and marked in use on this stream, first."""
    device = posted[stage].device
    parts = []
    for owner in owners:
        t = posted[owner]
        if owner in events:
            torch.cuda.current_stream(t.device).wait_event(events[owner])
            t.record_stream(torch.cuda.current_stream(t.device))
        parts.append(t.to(device, non_blocking=device.type == "cuda"))
    return parts


@dataclass
class _FailedReceive:
    """A receive posted ahead that could not be posted (the peer had closed its connection): what the take
    waiting for that message raises."""

    error: PeerError


@dataclass
class _Sent:
    """A posted send; its buffer lives until the send is completed."""

    work: Any
    buffer: torch.Tensor


@dataclass
class _Tie:
    """What this rank holds for one tie it owns."""

    name: str
    owners: tuple[int, ...]
    group: Any  # the group this rank sends its gradients on
    peers: dict[int, int]  # other owner -> its rank in ``group``
    sources: dict[int, tuple[Any, int]]  # other owner -> (the group it sends on, its rank there)
    me: int  # this rank's index among the owners (its acknowledgement slot)
    shape: torch.Size | None = None
    dtype: torch.dtype | None = None

    @property
    def nbytes(self) -> int:
        assert self.shape is not None and self.dtype is not None
        return self.shape.numel() * self.dtype.itemsize

    @property
    def size(self) -> int:
        """Bytes of one message: the gradient padded to 8, the group and one acknowledgement per owner."""
        return _padded(self.nbytes) + 8 * (1 + len(self.owners))


def _gradient(tie: _Tie, buffer: torch.Tensor) -> torch.Tensor:
    """The gradient a received message of ``tie`` carries (a view into its buffer)."""
    assert tie.shape is not None and tie.dtype is not None
    return buffer[: tie.nbytes].view(tie.dtype).view(tie.shape)


def _release_at_exit(ties: "weakref.ref[DistributedTiedGradients]") -> None:
    live = ties()
    if live is not None and not live.closed:
        try:
            live.wait_sends()
        except (PeerError, RuntimeError):
            pass  # the receiving rank is gone; nothing can be delivered
        finally:
            # Release the groups now rather than during interpreter teardown (see DistributedTransport).
            live._posted_recv.clear()
            live._ties = {}


class DistributedTiedGradients:
    """One process per stage (``rank == stage``) over an initialised ``torch.distributed`` (gloo or NCCL).

    Every rank must construct it, with the same ``ties``, at the same point relative to other process-group
    creations: it creates, per tie, one group over the tie's owners for each owner to send on, and
    ``new_group`` is collective over the default group. ``shapes`` (tie name -> gradient shape and dtype, for
    the ties this rank owns) lets the first receives be posted at construction; without it they are posted
    at this rank's first :meth:`post`, from its own gradients (every owner's copy has the same shape).
    ``timeout`` (seconds) bounds every wait. Gradients travel in buffers on ``device`` (for NCCL, the GPU).
    """

    def __init__(self, ties: Mapping[str, Sequence[int]], rank: int, timeout: float = 30.0,
                 device: torch.device | None = None, shapes: Mapping[str, Shape] | None = None,
                 grid: Sequence[Sequence[int]] | None = None, replica: int = 0):
        self.ties = _check_ties(ties)
        self.rank = rank
        self.timeout = datetime.timedelta(seconds=timeout)
        self.device = device or torch.device("cpu")
        # With several replicas of the pipeline (data parallel), ranks here are pipeline ranks; grid[i][r] is the
        # global rank of pipeline rank r of replica i, and every replica's owners exchange among themselves.
        grid = [list(range(dist.get_world_size()))] if grid is None else [list(row) for row in grid]
        world = len(grid[0])
        self._ties: dict[str, _Tie] = {}
        for name in sorted(self.ties):  # the same order on every rank, whatever order the dict has
            owners = self.ties[name]
            if owners[-1] >= world:
                raise ValueError(f"tie {name!r}: owner {owners[-1]} is not a rank (world size {world})")
            # One group per sending owner and replica (see the module docstring), created by every process in
            # the same order.
            for i, row in enumerate(grid):
                members = [row[o] for o in owners]
                groups = {sender: dist.new_group(members, timeout=self.timeout) for sender in owners}
                if i == replica and rank in owners:
                    own = groups[rank]
                    peers = {o: dist.get_group_rank(own, row[o]) for o in owners if o != rank}
                    sources = {o: (groups[o], dist.get_group_rank(groups[o], row[o])) for o in owners if o != rank}
                    self._ties[name] = _Tie(name, owners, own, peers, sources, owners.index(rank))
        # Per (tie, other owner): the posted receive of its next message; sends not completed yet, in order;
        # how many of them were completed; how many messages were received; its gradients taken off the stream
        # and not reduced yet, by update group (taken by a reduce that then failed, kept by resync, or given
        # back by unreduce).
        self._posted_recv: dict[tuple[str, int], tuple[torch.Tensor, Any]] = {}  # the work, or a _FailedReceive
        self._sends: dict[tuple[str, int], deque[_Sent]] = {}
        self._completed: dict[tuple[str, int], int] = {}
        self._received: dict[tuple[str, int], int] = {}
        self._early: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
        for tie in self._ties.values():
            for peer in tie.peers:
                self._sends[tie.name, peer] = deque()
                self._completed[tie.name, peer] = self._received[tie.name, peer] = 0
                self._early[tie.name, peer] = {}
        # update group -> tie -> this rank's own gradient (a view into the buffer it sent).
        self._own: dict[int, dict[str, torch.Tensor]] = {}
        self._last: int | None = None
        # Groups this rank reduced: update group -> (the epoch it was reduced in, this rank's own parts, the
        # other owners' parts by (tie, owner)), kept so that an undone update can reduce them again; from the
        # first new_epoch() on (before it, nothing would forget them).
        self._retired: dict[int, tuple[int, dict[str, torch.Tensor], dict[tuple[str, int], torch.Tensor]]] = {}
        self._epoch = 0
        self.failure_notified = False
        self.closed = False
        for name, (shape, dtype) in (shapes or {}).items():
            tie = self._ties.get(name)
            if tie is not None:
                tie.shape, tie.dtype = torch.Size(shape), dtype
                self._post_receives(tie)
        atexit.register(_release_at_exit, weakref.ref(self))

    def _check_stage(self, stage: int) -> None:
        if stage != self.rank:
            raise ValueError(f"rank {self.rank} runs stage {self.rank} only, not stage {stage}")
        if self.closed:
            raise RuntimeError(f"rank {self.rank}: the tied-gradient exchange was closed")

    # Sending ---------------------------------------------------------------------------------------

    def post(self, stage: int, group: int, grads: dict[str, torch.Tensor]) -> None:
        """Send this rank's gradients of ``group`` to the other owners (without waiting) and keep them, copied
        into the buffer sent, for :meth:`reduce`."""
        self._check_stage(stage)
        _check_post(stage, group, grads, list(self._ties), self._last)
        own: dict[str, torch.Tensor] = {}
        for name in sorted(grads):
            tie, grad = self._ties[name], grads[name]
            if tie.shape is None:  # learned from the first post; the receives can now be posted
                tie.shape, tie.dtype = grad.shape, grad.dtype
                self._post_receives(tie)
            elif (grad.shape, grad.dtype) != (tie.shape, tie.dtype):
                raise ValueError(f"rank {self.rank}: tie {name!r} has gradients of shape {tuple(tie.shape)} and "
                                 f"dtype {tie.dtype}, got {tuple(grad.shape)} {grad.dtype}")
            buffer = torch.empty(tie.size, dtype=torch.uint8, device=self.device)
            nbytes = tie.nbytes
            view = buffer[:nbytes].view(grad.dtype).view(grad.shape)
            view.copy_(grad.detach())  # the caller zeroes its gradient after posting
            end = _padded(nbytes)
            if end != nbytes:
                buffer[nbytes:end].zero_()
            self._send(tie, buffer, group)
            own[name] = view
        self._own[group] = own
        self._last = group

    def _send(self, tie: _Tie, buffer: torch.Tensor, group: int) -> None:
        """Write the words (``group``, the acknowledgements) at the end of ``buffer`` and send it to every
        other owner of ``tie``, without waiting."""
        words = [group] + [self._received.get((tie.name, o), 0) for o in tie.owners]
        buffer[_padded(tie.nbytes):].view(torch.int64).copy_(torch.tensor(words, dtype=torch.int64))
        for peer, peer_in_group in tie.peers.items():
            sends = self._sends[tie.name, peer]
            self._prune(tie.name, peer)
            try:
                with _C.RecordingOff():  # as the transport's messages (DistributedTransport._post_receive)
                    sends.append(_Sent(tie.group.send([buffer], peer_in_group, _TIE_TAG), buffer))
            except RuntimeError as exc:
                raise self._failed(tie.name, peer, "sending to", exc) from exc

    def _prune(self, name: str, peer: int) -> None:
        """Drop the sends already completed (NCCL says so by itself; gloo only once waited on)."""
        sends = self._sends[name, peer]
        while sends and sends[0].work.is_completed():
            sends.popleft()
            self._completed[name, peer] += 1

    def _acknowledge(self, name: str, peer: int, count: int) -> None:
        """``peer`` has received ``count`` of our messages on tie ``name``: complete those sends (at once)."""
        self._prune(name, peer)
        sends = self._sends[name, peer]
        while self._completed[name, peer] < count and sends:
            self._complete(name, peer, sends.popleft())
            self._completed[name, peer] += 1

    def _complete(self, name: str, peer: int, sent: _Sent) -> None:
        try:
            done = sent.work.wait(self.timeout)
        except RuntimeError as exc:
            raise self._failed(name, peer, "sending to", exc) from exc
        if done is False:
            raise self._failed(name, peer, "sending to", TimeoutError("the send did not complete"))

    def wait_sends(self) -> None:
        """Complete every posted send; raises :class:`PeerError` if an owner does not take its messages
        within the timeout."""
        for (name, peer), sends in self._sends.items():
            while sends:
                self._complete(name, peer, sends.popleft())
                self._completed[name, peer] += 1

    def close(self, deliver: bool = True) -> None:
        """Destroy the tie groups; with ``deliver``, first complete the posted sends. Receives still posted are
        dropped. Nothing can be exchanged afterwards; closing twice does nothing."""
        if self.closed:
            return
        try:
            if deliver:
                self.wait_sends()
        finally:
            self.closed = True
            self._posted_recv.clear()
            self._own.clear()
            self._early.clear()
            self._retired.clear()
            groups = [tie.group for tie in self._ties.values()]
            groups += [group for tie in self._ties.values() for group, _ in tie.sources.values()]
            self._ties = {}
            if dist.is_initialized():  # after destroy_process_group() of the default group, all are gone
                for group in groups:
                    dist.destroy_process_group(group)

    # Receiving -------------------------------------------------------------------------------------

    def _post_receives(self, tie: _Tie) -> None:
        for peer in tie.peers:
            self._post_receive(tie, peer)

    def _post_receive(self, tie: _Tie, peer: int, ahead: bool = False) -> None:
        """Post the receive of ``peer``'s next message on ``tie``. ``ahead``: posted as soon as the previous
        message is taken, before anyone waits for this one, so a peer that has finished and closed its
        connection is no error yet: the failure is kept, and raised by the take that waits for the message
        (if one ever does)."""
        buffer = torch.empty(tie.size, dtype=torch.uint8, device=self.device)
        group, peer_in_group = tie.sources[peer]
        try:
            with _C.RecordingOff():  # as the transport's messages (DistributedTransport._post_receive)
                work = group.recv([buffer], peer_in_group, _TIE_TAG)
        except RuntimeError as exc:
            error = self._failed(tie.name, peer, "posting the receive from", exc)
            if not ahead:
                raise error from exc
            error.__cause__ = exc
            work = _FailedReceive(error)
        self._posted_recv[tie.name, peer] = (buffer, work)

    def ready(self, stage: int, group: int) -> bool:
        """Always True: :meth:`reduce` waits, with the timeout, like the transport's receive."""
        return True  # reduce blocks (with the timeout) until the other owners' gradients are there

    def reduce(self, stage: int, group: int) -> dict[str, torch.Tensor]:
        """Per tie this rank owns, the sum of every owner's gradient of ``group`` in stage order (fresh
        tensors). Waits for the other owners' messages, which must come in the order of the groups posted:
        reduce the groups in increasing order. :class:`PeerError` if an owner does not answer in time, or
        sent a failure notice instead (``cause`` says what failed); nothing is consumed then, and the group
        can be reduced later."""
        self._check_stage(stage)
        own = self._own.get(group)
        if own is None:
            raise RuntimeError(f"rank {self.rank}: update group {group} was not posted, or was reduced already")
        # Every other owner's part first: a reduce that raises while waiting leaves the group whole.
        for name in sorted(own):
            tie = self._ties[name]
            for peer in tie.peers:
                self._collect(tie, peer, group)
        del self._own[group]
        sums: dict[str, torch.Tensor] = {}
        theirs: dict[tuple[str, int], torch.Tensor] = {}
        for name in sorted(own):
            parts = []
            for owner in self._ties[name].owners:
                if owner == self.rank:
                    parts.append(own[name])
                else:
                    part = theirs[name, owner] = self._early[name, owner].pop(group)
                    parts.append(part)
            sums[name] = _sum_in_stage_order(parts)
        if self._epoch:
            self._retired[group] = (self._epoch, own, theirs)
        return sums

    def _collect(self, tie: _Tie, peer: int, group: int) -> None:
        """Make sure ``peer``'s gradient of ``group`` on ``tie`` was taken off its stream (waiting for it)."""
        early = self._early[tie.name, peer]
        if group in early:
            return
        what = f"its gradient of update group {group} for tie {tie.name!r}"
        got, buffer = self._take(tie, peer, what)
        if got == _NOTICE_GROUP:
            raise PeerError.reported(self.rank, peer, self._notice_text(tie, buffer))
        if got != group:
            raise PeerError(f"rank {self.rank} expected the gradient of update group {group} for tie {tie.name!r} "
                            f"from rank {peer} but received group {got}: the owners are out of step")
        early[group] = _gradient(tie, buffer)

    def _take(self, tie: _Tie, peer: int, what: str) -> tuple[int, torch.Tensor]:
        """``peer``'s next message on ``tie``: ``(its group word, its buffer)``. Waits for it, posts the
        receive of the next one and completes the sends that it acknowledges."""
        if (tie.name, peer) not in self._posted_recv:
            raise RuntimeError(f"rank {self.rank}: tie {tie.name!r} has no shape yet (no shapes given, nothing "
                               f"posted), so the message from rank {peer} cannot be received")
        buffer, work = self._posted_recv.pop((tie.name, peer))
        if isinstance(work, _FailedReceive):
            raise work.error
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as exc:
            raise PeerError(f"rank {self.rank}: rank {peer} failed while {what} was expected "
                            f"({exc.__class__.__name__}: {_first_line(exc)}); it died or stopped answering "
                            f"(timeout {self.timeout.total_seconds():g} s)") from exc
        if ok is False:
            raise PeerError(f"rank {self.rank}: no answer from rank {peer} within "
                            f"{self.timeout.total_seconds():g} s while waiting for {what}")
        self._received[tie.name, peer] += 1
        self._post_receive(tie, peer, ahead=True)  # before anything else: the peer's next send finds it posted
        words = buffer[_padded(tie.nbytes):].view(torch.int64).tolist()
        self._acknowledge(tie.name, peer, words[1 + tie.me])
        return words[0], buffer

    def _failed(self, name: str, peer: int, doing: str, exc: BaseException) -> PeerError:
        return PeerError(f"rank {self.rank}: {doing} rank {peer} failed for tie {name!r} ({_first_line(exc)}); "
                         f"rank {peer} died or stopped answering (timeout {self.timeout.total_seconds():g} s)")

    # Going on after a failure ----------------------------------------------------------------------

    def notify_failure(self, text: str) -> None:
        """This rank stopped at an error (its own, or one another rank reported; ``text`` describes it): send a
        failure notice to every other owner of each tie, in place of the next gradient it may be waiting for,
        so that it raises a :class:`PeerError` with the cause at once rather than at its timeout. Best effort,
        once until :meth:`resync`: nothing here waits or raises."""
        if self.failure_notified or self.closed:
            return
        self.failure_notified = True
        data = text.encode()
        for tie in self._ties.values():
            if tie.shape is None:
                continue  # nothing was sent or received on it: no size for a message yet
            buffer = torch.zeros(tie.size, dtype=torch.uint8, device=self.device)
            cut = data[: _padded(tie.nbytes)]
            if cut:
                buffer[: len(cut)].copy_(torch.frombuffer(bytearray(cut), dtype=torch.uint8))
            try:
                self._send(tie, buffer, _NOTICE_GROUP)
            except (PeerError, RuntimeError):
                pass  # that owner is gone

    def _notice_text(self, tie: _Tie, buffer: torch.Tensor) -> str:
        """The failure's description a notice on ``tie`` carries."""
        return bytes(buffer[: _padded(tie.nbytes)].cpu().numpy()).rstrip(b"\0").decode(errors="replace")

    def sent_counts(self) -> dict[str, dict[int, int]]:
        """What this rank has sent so far: per tie and other owner, the messages (notices included); the
        owners take as many in :meth:`resync`."""
        return {name: {peer: self._completed[name, peer] + len(self._sends[name, peer]) for peer in tie.peers}
                for name, tie in self._ties.items()}

    def resync(self, counts: Sequence[Mapping[str, Mapping[int, int]]], first_group: int) -> None:
        """After a failure, with every rank's :meth:`sent_counts` (in rank order, taken before any rank
        withdrew) and ``first_group``, the first update group undone (every owner numbers its groups alike):
        take every message still on the way to this rank. The other owners' gradients of the groups before
        ``first_group`` (taken here, or given back by :meth:`unreduce`) wait for their :meth:`reduce`; those of
        ``first_group`` and later (withdrawn) and the failure notices are dropped. Each stream then carries only
        the groups its sender posts from now on."""
        self.failure_notified = False  # a later failure is notified again
        for tie in self._ties.values():
            for peer in tie.peers:
                key = (tie.name, peer)
                sent = counts[peer].get(tie.name, {}).get(self.rank)
                if sent is None:
                    raise PeerError(f"rank {self.rank}: rank {peer} sent no count for tie {tie.name!r}; the ranks "
                                    "disagree on the tied weights")
                if self._received[key] > sent:
                    raise PeerError(f"rank {self.rank} received {self._received[key]} messages from rank {peer} on "
                                    f"tie {tie.name!r}, which sent {sent}: the owners are out of step")
                early = self._early[key]
                while self._received[key] < sent:
                    group, buffer = self._take(tie, peer, "a tied gradient sent before the failure")
                    if 0 <= group < first_group:
                        early[group] = _gradient(tie, buffer)
                for group in [g for g in early if g >= first_group]:
                    del early[group]

    def withdraw(self, stage: int, first_group: int) -> None:
        """Take back this rank's posts of group ``first_group`` and later (their backwards were undone): they
        are not reduced here, and the other owners drop them in :meth:`resync`."""
        self._check_stage(stage)
        for group in [g for g in self._own if g >= first_group]:
            del self._own[group]
        if self._last is not None and self._last >= first_group:
            self._last = first_group - 1

    def unreduce(self, stage: int, groups: range) -> None:
        """This rank's updates that reduced ``groups`` were undone: they will reduce them again, from the parts
        kept (those of groups the other owners withdraw are dropped in :meth:`resync`)."""
        self._check_stage(stage)
        missing = [g for g in groups if g not in self._retired]
        if missing:
            raise RuntimeError(f"rank {self.rank} did not reduce update groups {missing}, or they were forgotten")
        for group in groups:
            _, own, theirs = self._retired.pop(group)
            self._own[group] = own
            for key, part in theirs.items():
                self._early[key][group] = part

    def new_epoch(self, forget_before: int | None) -> int:
        """Start a new epoch (a pipeline starts one per step) and return its number; the groups this rank
        reduced before epoch ``forget_before`` (None: all) are dropped, no :meth:`unreduce` will ask for them."""
        for group, (epoch, _, _) in list(self._retired.items()):
            if forget_before is None or epoch < forget_before:
                del self._retired[group]
        self._epoch += 1
        return self._epoch


class StagesAsRanks:
    """A :class:`DistributedTiedGradients` whose owners are ranks, used by stages: with several stages per rank,
    each owner of a tie on a rank of its own, a stage speaks for its rank (``placement[stage]``)."""

    def __init__(self, exchange: DistributedTiedGradients, placement: Sequence[int]):
        self._exchange, self._placement = exchange, placement

    def post(self, stage: int, group: int, grads: dict[str, torch.Tensor]) -> None:
        self._exchange.post(self._placement[stage], group, grads)

    def ready(self, stage: int, group: int) -> bool:
        return self._exchange.ready(self._placement[stage], group)

    def reduce(self, stage: int, group: int) -> dict[str, torch.Tensor]:
        return self._exchange.reduce(self._placement[stage], group)

    def withdraw(self, stage: int, first_group: int) -> None:
        self._exchange.withdraw(self._placement[stage], first_group)

    def unreduce(self, stage: int, groups: range) -> None:
        self._exchange.unreduce(self._placement[stage], groups)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._exchange, name)  # the rest (epochs, failures, resync, close) is per rank anyway
