"""Tied parameters: gradients summed over the stages that share a parameter.

A tied parameter (a language model's token embedding and output head, say) lives in several stages, each
with its own copy. Before an update, the gradients of one update group from all owners are summed, so that
every copy applies the same gradient and the copies stay equal. The sum is always formed in increasing stage
order, ``((g_a + g_b) + g_c)``, by every owner, so all owners get a bit-identical result.

Two implementations of :class:`TiedGradients`:

* :class:`LocalTiedGradients`: every stage in this process; an in-memory mailbox.
* :class:`DistributedTiedGradients`: one process per stage over ``torch.distributed``; per tie and pair of
  owners, a stream of the link layer (:mod:`pipecore.runtime.link`) each way, which moves the gradients,
  acknowledges them, delivers them at exit, carries failure notices and resyncs after a failure.

Process groups: per tie, one group over its owners for each owner's outgoing streams, so every group carries
one direction between any two ranks (as the transport's links do). On NCCL a pair's sends and receives run
in order on one stream per communicator: with both directions on one group, the receive each owner posts
ahead of time would hold back its own send, on both sides, for ever. On gloo it also keeps one direction's
traffic from waiting for the other's.

A message is one frame of the link layer: per tie and update group, each owner sends every other owner::

    [gradient bytes, padded to 8] [update group: int64] [the link layer's trailer]

The two streams between two owners of a tie are paired, so each message acknowledges the other owner's
messages taken so far: an owner holds about one send per other owner and tie, as long as owners alternate
post and reduce. Sends that no later message acknowledges (an owner that posts several groups ahead, the
last group) are completed by :meth:`DistributedTiedGradients.wait_sends` or ``close()``.

Ordering: a send never waits for its receiver. Each owner keeps the receive of every other owner's next
message posted ahead of time, so a message is transferred as soon as it is sent, whether or not its receiver
has reached its reduce. The only operation that waits is :meth:`DistributedTiedGradients.reduce`, for the
other owners' messages of that group; an owner that is dead or silent is a
:class:`~pipecore.runtime.link.PeerError` after the timeout, naming the rank and the tie. Messages arrive in
order on each (tie, sender), so every owner must post the same update groups and reduce them in increasing
order; each message names its update group and a mismatch is a ``PeerError`` ("out of step") rather than a
wrong sum.

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

import datetime
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from .elastic import new_group
from .link import TRAILER, TRAILER_BYTES, Incoming, Links, Outgoing, PeerError, padded

# Each group carries one tie's messages from one sender, so one tag is enough (NCCL ignores tags and matches
# in order, which is the order here too).
_TIE_TAG = 50
_GROUP = -TRAILER - 1  # a message's update group: its last word before the link layer's trailer

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
class _Tie:
    """What this rank holds for one tie it owns."""

    name: str
    owners: tuple[int, ...]
    # Per other owner: the stream this rank sends its gradients on, and the one it takes that owner's from.
    streams: dict[int, tuple[Outgoing, Incoming]] = field(default_factory=dict)
    # Per other owner: its gradients taken off the stream and not reduced yet, by update group (taken by a
    # reduce that then failed, kept by resync, or given back by unreduce).
    early: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    shape: torch.Size | None = None
    dtype: torch.dtype | None = None

    @property
    def nbytes(self) -> int:
        assert self.shape is not None and self.dtype is not None
        return self.shape.numel() * self.dtype.itemsize

    @property
    def size(self) -> int:
        """Bytes of one message: the gradient padded to 8, the update group and the link layer's trailer."""
        return padded(self.nbytes) + 8 + TRAILER_BYTES


def _gradient(tie: _Tie, buffer: torch.Tensor, peer: int) -> torch.Tensor:
    """The gradient a message of ``tie`` from ``peer`` carries (a view into its buffer)."""
    if tie.shape is None or tie.dtype is None:
        raise RuntimeError(f"tie {tie.name!r} has no shape yet (no shapes given, nothing posted), so the message "
                           f"from rank {peer} cannot be read")
    return buffer[: tie.nbytes].view(tie.dtype).view(tie.shape)


class DistributedTiedGradients:
    """One process per stage (``rank == stage``) over an initialised ``torch.distributed`` (gloo or NCCL).

    Every rank must construct it, with the same ``ties``, at the same point relative to other process-group
    creations: it creates, per tie, one group over the tie's owners for each owner to send on, and
    ``new_group`` is collective over the default group. ``shapes`` (tie name -> gradient shape and dtype, for
    the ties this rank owns) sizes the receives posted at construction, so that the first messages need no
    announcement; every owner of a tie gives its shape, or none does (then the first message of each stream
    announces its size). ``timeout`` (seconds) bounds every wait. Gradients travel in buffers on ``device``
    (for NCCL, the GPU).
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
        for name, owners in self.ties.items():
            if owners[-1] >= world:
                raise ValueError(f"tie {name!r}: owner {owners[-1]} is not a rank (world size {world})")
        #: This rank's ends of the streams, keyed by tie name.
        self.links = Links(rank, self.timeout, self.device)
        self._ties: dict[str, _Tie] = {}
        for name in sorted(self.ties):  # the same order on every rank, whatever order the dict has
            owners = self.ties[name]
            # One group per sending owner and replica (see the module docstring), created by every process in
            # the same order.
            for i, row in enumerate(grid):
                groups = {sender: new_group([row[o] for o in owners], f"the exchange of tied weight {name!r}",
                                            self.timeout) for sender in owners}
                if i == replica and rank in owners:
                    self._ties[name] = self._tie(name, owners, row, groups, (shapes or {}).get(name))
        # update group -> tie -> this rank's own gradient (a view into a buffer it sent).
        self._own: dict[int, dict[str, torch.Tensor]] = {}
        self._last: int | None = None
        # Groups this rank reduced: update group -> (the epoch it was reduced in, this rank's own parts, the
        # other owners' parts by (tie, owner)), kept so that an undone update can reduce them again; from the
        # first new_epoch() on (before it, nothing would forget them).
        self._retired: dict[int, tuple[int, dict[str, torch.Tensor], dict[tuple[str, int], torch.Tensor]]] = {}
        self._epoch = 0

    def _tie(self, name: str, owners: tuple[int, ...], row: Sequence[int], groups: Mapping[int, Any],
             shape: Shape | None) -> _Tie:
        """This rank's streams of tie ``name``: to each other owner on this rank's group, from it on its group."""
        tie = _Tie(name, owners)
        if shape is not None:
            tie.shape, tie.dtype = torch.Size(shape[0]), shape[1]
        size = tie.size if tie.shape is not None else TRAILER_BYTES
        own = groups[self.rank]
        for o in owners:
            if o == self.rank:
                continue
            theirs = groups[o]
            outgoing = self.links.send_to(name, own, dist.get_group_rank(own, row[o]), o, _TIE_TAG,
                                          f"the gradients of tie {name!r}", size)
            incoming = self.links.receive_from(name, theirs, dist.get_group_rank(theirs, row[o]), o, _TIE_TAG,
                                               f"the next gradient of tie {name!r}", size)
            self.links.pair(outgoing, incoming)
            tie.streams[o] = (outgoing, incoming)
            tie.early[o] = {}
        return tie

    @property
    def closed(self) -> bool:
        return self.links.closed

    def _check_stage(self, stage: int) -> None:
        if stage != self.rank:
            raise ValueError(f"rank {self.rank} runs stage {self.rank} only, not stage {stage}")
        if self.closed:
            raise RuntimeError(f"rank {self.rank}: the tied-gradient exchange was closed")

    # Sending ---------------------------------------------------------------------------------------

    def post(self, stage: int, group: int, grads: dict[str, torch.Tensor]) -> None:
        """Send this rank's gradients of ``group`` to the other owners (without waiting) and keep them, copied
        into a message sent, for :meth:`reduce`."""
        self._check_stage(stage)
        _check_post(stage, group, grads, list(self._ties), self._last)
        own: dict[str, torch.Tensor] = {}
        for name in sorted(grads):
            tie, grad = self._ties[name], grads[name]
            if tie.shape is None:  # learned from the first post
                tie.shape, tie.dtype = grad.shape, grad.dtype
            elif (grad.shape, grad.dtype) != (tie.shape, tie.dtype):
                raise ValueError(f"rank {self.rank}: tie {name!r} has gradients of shape {tuple(tie.shape)} and "
                                 f"dtype {tie.dtype}, got {tuple(grad.shape)} {grad.dtype}")
            # Copied into each message: the caller zeroes its gradient after posting.
            frames = [outgoing.send(grad, (group,)) for outgoing, _ in tie.streams.values()]
            own[name] = _gradient(tie, frames[0], self.rank)
        self._own[group] = own
        self._last = group

    def wait_sends(self) -> None:
        """Complete every posted send; raises :class:`PeerError` if an owner does not take its messages
        within the timeout."""
        self.links.wait_sends()

    def close(self, deliver: bool = True) -> None:
        """Destroy the tie groups; with ``deliver``, first complete the posted sends. Receives still posted are
        dropped. Nothing can be exchanged afterwards; closing twice does nothing."""
        try:
            self.links.close(deliver)
        finally:
            self._own.clear()
            self._retired.clear()
            for tie in self._ties.values():
                for early in tie.early.values():
                    early.clear()

    # Receiving -------------------------------------------------------------------------------------

    def ready(self, stage: int, group: int) -> bool:
        """Always True: :meth:`reduce` waits, with the timeout, like the transport's receive."""
        return True

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
            for peer in tie.streams:
                self._collect(tie, peer, group)
        del self._own[group]
        sums: dict[str, torch.Tensor] = {}
        theirs: dict[tuple[str, int], torch.Tensor] = {}
        for name in sorted(own):
            tie = self._ties[name]
            parts = []
            for owner in tie.owners:
                if owner == self.rank:
                    parts.append(own[name])
                else:
                    part = theirs[name, owner] = tie.early[owner].pop(group)
                    parts.append(part)
            sums[name] = _sum_in_stage_order(parts)
        if self._epoch:
            self._retired[group] = (self._epoch, own, theirs)
        return sums

    def _collect(self, tie: _Tie, peer: int, group: int) -> None:
        """Make sure ``peer``'s gradient of ``group`` on ``tie`` was taken off its stream (waiting for it)."""
        early = tie.early[peer]
        if group in early:
            return
        buffer, _, tail = tie.streams[peer][1].take(f"its gradient of update group {group} for tie {tie.name!r}")
        got = tail[_GROUP]
        if got != group:
            raise PeerError(f"rank {self.rank} expected the gradient of update group {group} for tie {tie.name!r} "
                            f"from rank {peer} but received group {got}: the owners are out of step")
        early[group] = _gradient(tie, buffer, peer)

    # Going on after a failure ----------------------------------------------------------------------

    def notify_failure(self, text: str) -> None:
        """This rank stopped at an error (its own, or one another rank reported; ``text`` describes it): send a
        failure notice to every other owner of each tie, in place of the next gradient it may be waiting for,
        so that it raises a :class:`PeerError` with the cause at once rather than at its timeout. Best effort,
        once until :meth:`resync`: nothing here waits or raises."""
        self.links.notify_failure(text)

    def sent_counts(self) -> dict[tuple[str, int], int]:
        """What this rank has sent so far: per tie and other owner, the messages (notices included); the
        owners take as many in :meth:`resync`."""
        return self.links.sent_counts()

    def resync(self, counts: Sequence[Mapping[tuple[str, int], int]], first_group: int) -> None:
        """After a failure, with every rank's :meth:`sent_counts` (in rank order, taken before any rank
        withdrew) and ``first_group``, the first update group undone (every owner numbers its groups alike):
        take every message still on the way to this rank. The other owners' gradients of the groups before
        ``first_group`` (taken here, or given back by :meth:`unreduce`) wait for their :meth:`reduce`; those of
        ``first_group`` and later (withdrawn) and the failure notices are dropped. Each stream then carries only
        the groups its sender posts from now on."""

        def kept(stream: Incoming, buffer: torch.Tensor, array: np.ndarray | None, tail: list[int]) -> None:
            group = tail[_GROUP]
            if group < first_group:
                tie = self._ties[stream.key]
                tie.early[stream.src][group] = _gradient(tie, buffer, stream.src)

        self.links.resync(counts, kept)
        for tie in self._ties.values():
            for early in tie.early.values():
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
            for (name, owner), part in theirs.items():
                self._ties[name].early[owner][group] = part

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
