"""Transports move messages between stages. The executor and the stage workers are the same for all."""

from __future__ import annotations

from typing import Any, Callable, Protocol

from .. import _C
from ..schedule.ir import B, F, Kind
from .worker import Message


class Transport(Protocol):
    """Delivers the output of one stage's action to the stage that consumes it, and carries what the ranks of
    a multi-process pipeline exchange besides: mini-batch losses, small objects, failures.

    ``kind`` and ``microbatch`` name the consuming action (F of micro-batch k at ``stage`` receives what
    F of k at ``stage - 1`` sent; B of k at ``stage`` receives what B of k at ``stage + 1`` sent). The executor
    calls the stage messages' methods; the pipeline calls the others too, and only with one process per rank
    does anything travel there. With every stage in one process (:class:`LocalTransport`) there is one rank,
    which is also the last: what other ranks would be told or asked, nobody waits for.
    """

    # Stage messages ----------------------------------------------------------------------------------

    def send(self, stage: int, kind: Kind, microbatch: int, message: Message) -> None:
        """Send ``message`` to ``stage`` for its ``kind`` action on ``microbatch``, without waiting for it to
        be taken."""

    def ready(self, stage: int, kind: Kind, microbatch: int) -> bool:
        """Whether :meth:`receive` can return now (a blocking transport always says yes)."""

    def receive(self, stage: int, kind: Kind, microbatch: int) -> Message:
        """The message for ``stage``'s ``kind`` action on ``microbatch``, waiting for it (with a timeout)."""

    def give_back(self, stage: int, kind: Kind, microbatch: int, message: Message) -> None:
        """Return a received message, for the action that took it to run again (it failed before using it)."""

    def drop(self, which: Callable[[int, Kind, int], bool]) -> None:
        """Throw away the messages not yet received for which ``which(stage, kind, micro-batch)`` is true."""

    def abort(self, reason: str) -> None:
        """A stage failed: make later receives (and the waiting ones, where the transport can wake them) raise
        ``pipecore._C.Aborted(reason)``, so that the other stage threads stop, until :meth:`resume`."""

    def resume(self) -> None:
        """Undo :meth:`abort`, after a failure was dealt with (the messages delivered stay)."""

    # Between ranks -----------------------------------------------------------------------------------

    def wait_sends(self) -> None:
        """Complete every send not yet completed, waiting until its receiver took it (at the end of a flush:
        nothing stays in flight)."""

    def complete_sends(self, kind: Kind) -> None:
        """Complete the sends of ``kind`` messages: those no reply will acknowledge (``Pipeline.predict``'s
        activations)."""

    def publish_loss(self, minibatch: int, loss: float) -> None:
        """On the rank of the last stage: the loss of ``minibatch``, for every other rank's :meth:`receive_loss`."""

    def expect_loss(self) -> None:
        """On the other ranks: get ready for the next loss ahead of :meth:`receive_loss` (a networked transport
        posts its receive)."""

    def receive_loss(self, minibatch: int) -> float:
        """The loss of ``minibatch`` that the last stage's rank published; a failure it reports instead raises
        (:class:`~pipecore.PeerError` with its ``cause``)."""

    def share(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank; every rank calls it."""

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s ``obj`` (picklable), on every rank; every rank calls it."""

    # After a failure ---------------------------------------------------------------------------------

    def notify_failure(self, text: str) -> None:
        """This rank stopped at an error (``text`` describes it): tell the ranks that may be waiting for it,
        so that they raise with the cause rather than wait for their timeout. Best effort: never raises."""

    def sent_counts(self) -> Any:
        """What this rank has sent so far (picklable), for the other ranks' :meth:`resync`."""

    def resync(self, counts: list[Any], keep: Callable[[Kind, int], bool]) -> None:
        """After a failure, with every rank's :meth:`sent_counts` (in rank order): take what is still on its
        way to this rank; the messages for which ``keep(kind, micro-batch)`` is true wait for their action, the
        rest is dropped. Every rank calls it, and the ranks are in step again."""

    def close(self, deliver: bool = True) -> None:
        """Release what the transport holds (a networked one: its connections), after delivering what was
        sent if ``deliver``."""


_STAGE_BITS = 20
#: A mailbox key packs (micro-batch, stage, kind) into one integer: ``(micro-batch << KEY_SHIFT) | (stage << 1) |
#: (kind is B)``.
KEY_SHIFT = _STAGE_BITS + 1


def mailbox_key(stage: int, kind: Kind, microbatch: int) -> int:
    """The key of the message for ``stage``'s ``kind`` action on ``microbatch`` in :class:`LocalTransport`'s
    mailbox."""
    return (microbatch << KEY_SHIFT) | (stage << 1) | (kind is not F)


def _unkey(key: int) -> tuple[int, Kind, int]:
    """``(stage, kind, micro-batch)`` of a mailbox key (:func:`mailbox_key`)."""
    return (key >> 1) & ((1 << _STAGE_BITS) - 1), B if key & 1 else F, key >> KEY_SHIFT


class LocalTransport:
    """In-process mailboxes: every stage lives in this process. ``receive`` blocks until the message is
    there (without holding the GIL), so stage threads can wait on it, for at most ``timeout`` seconds (then
    ``TimeoutError``; None waits as long as it takes); :meth:`abort` wakes them all. This process is the only
    rank: a message is delivered when it is sent, and there is no other rank to tell or to ask."""

    def __init__(self, timeout: float | None = None) -> None:
        #: The mailbox, keyed by :func:`mailbox_key`: the executor's hot path puts and checks messages there.
        self.mailbox = _C.Mailbox()
        self._timeout = -1.0 if timeout is None else float(timeout)
        self._losses: dict[int, float] = {}  # published, not yet received

    def send(self, stage: int, kind: Kind, microbatch: int, message: Message) -> None:
        self.mailbox.put(mailbox_key(stage, kind, microbatch), message)

    def ready(self, stage: int, kind: Kind, microbatch: int) -> bool:
        return self.mailbox.contains(mailbox_key(stage, kind, microbatch))

    def receive(self, stage: int, kind: Kind, microbatch: int) -> Message:
        try:
            # mailbox_key, inline: this runs once per F and B
            return self.mailbox.take((microbatch << KEY_SHIFT) | (stage << 1) | (kind is not F), self._timeout)
        except TimeoutError:
            sender = stage - 1 if kind is F else stage + 1
            what = "activations" if kind is F else "gradient"
            raise TimeoutError(
                f"stage {stage} waited {self._timeout:g} s for stage {sender}'s {what} of micro-batch {microbatch} "
                "(the pipeline's timeout; raise it for stages whose actions take longer)"
            ) from None

    def abort(self, reason: str) -> None:
        """Make every waiting and later :meth:`receive` raise ``pipecore._C.Aborted(reason)``."""
        self.mailbox.abort(reason)

    def resume(self) -> None:
        """Undo :meth:`abort` (the messages already delivered stay)."""
        self.mailbox.reset()

    def give_back(self, stage: int, kind: Kind, microbatch: int, message: Message) -> None:
        self.send(stage, kind, microbatch, message)

    def drop(self, which: Callable[[int, Kind, int], bool]) -> None:
        for key in self.mailbox.keys():
            if which(*_unkey(key)):
                self.mailbox.take(key, 0.0)

    def wait_sends(self) -> None:
        """Nothing to complete: a message is in its mailbox once sent."""

    def complete_sends(self, kind: Kind) -> None:
        """Nothing to complete (see :meth:`wait_sends`)."""

    def publish_loss(self, minibatch: int, loss: float) -> None:
        """Keep the loss for :meth:`receive_loss`."""
        self._losses[minibatch] = loss

    def expect_loss(self) -> None:
        """Nothing to post: :meth:`publish_loss` keeps the loss here."""

    def receive_loss(self, minibatch: int) -> float:
        """The loss :meth:`publish_loss` kept (this process runs the last stage, which computes it first)."""
        loss = self._losses.pop(minibatch, None)
        if loss is None:
            raise RuntimeError(f"the loss of mini-batch {minibatch} was not published; this process runs the "
                               "last stage, which publishes it when its last forward of the mini-batch ends")
        return loss

    def share(self, obj: Any) -> list[Any]:
        """``[obj]``: this process is the only rank."""
        return [obj]

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """``obj``: this process is the only rank."""
        return obj

    def notify_failure(self, text: str) -> None:
        """No other process waits for this one (the stage threads here are stopped by :meth:`abort`)."""

    def sent_counts(self) -> dict[str, int]:
        """Nothing is on its way: every message sent is in the mailbox."""
        return {}

    def resync(self, counts: list[Any], keep: Callable[[Kind, int], bool]) -> None:
        """Nothing to take: every message sent is in the mailbox already (:meth:`drop` throws away those of
        undone actions)."""

    def close(self, deliver: bool = True) -> None:
        self.mailbox.clear()
        self._losses.clear()
