"""Transports move messages between stages. The executor and the stage workers are the same for all."""

from __future__ import annotations

from typing import Callable, Protocol

from .. import _C
from ..schedule.ir import B, F, Kind
from .worker import Message


class Transport(Protocol):
    """Delivers the output of one stage's action to the stage that consumes it.

    ``kind`` and ``microbatch`` name the consuming action (F of micro-batch k at ``stage`` receives what
    F of k at ``stage - 1`` sent; B of k at ``stage`` receives what B of k at ``stage + 1`` sent).
    """

    def send(self, stage: int, kind: Kind, microbatch: int, message: Message) -> None:
        """Send ``message`` to ``stage`` for its ``kind`` action on ``microbatch``."""

    def ready(self, stage: int, kind: Kind, microbatch: int) -> bool:
        """Whether :meth:`receive` can return now (a blocking transport always says yes)."""

    def receive(self, stage: int, kind: Kind, microbatch: int) -> Message:
        """The message for ``stage``'s ``kind`` action on ``microbatch``."""

    def close(self, deliver: bool = True) -> None:
        """Release what the transport holds (a networked one: its connections), after delivering what was
        sent if ``deliver``."""

    def drop(self, which: Callable[[int, Kind, int], bool]) -> None:
        """Throw away the messages not yet received for which ``which(stage, kind, micro-batch)`` is true."""

    def give_back(self, stage: int, kind: Kind, microbatch: int, message: Message) -> None:
        """Return a received message, for the action that took it to run again (it failed before using it)."""


_STAGE_BITS = 20  # a mailbox key packs (micro-batch, stage, kind) into one integer


def _key(stage: int, kind: Kind, microbatch: int) -> int:
    return (microbatch << (_STAGE_BITS + 1)) | (stage << 1) | (kind is not F)


def _unkey(key: int) -> tuple[int, Kind, int]:
    """``(stage, kind, micro-batch)`` of a mailbox key (:func:`_key`)."""
    return (key >> 1) & ((1 << _STAGE_BITS) - 1), B if key & 1 else F, key >> (_STAGE_BITS + 1)


class LocalTransport:
    """In-process mailboxes: every stage lives in this process. ``receive`` blocks until the message is
    there (without holding the GIL), so stage threads can wait on it, for at most ``timeout`` seconds (then
    ``TimeoutError``; None waits as long as it takes); :meth:`abort` wakes them all."""

    def __init__(self, timeout: float | None = None) -> None:
        self._mailbox = _C.Mailbox()
        self._timeout = -1.0 if timeout is None else float(timeout)

    def send(self, stage: int, kind: Kind, microbatch: int, message: Message) -> None:
        self._mailbox.put(_key(stage, kind, microbatch), message)

    def ready(self, stage: int, kind: Kind, microbatch: int) -> bool:
        return self._mailbox.contains(_key(stage, kind, microbatch))

    def receive(self, stage: int, kind: Kind, microbatch: int) -> Message:
        try:
            # _key, inline: this runs once per F and B
            return self._mailbox.take((microbatch << (_STAGE_BITS + 1)) | (stage << 1) | (kind is not F), self._timeout)
        except TimeoutError:
            sender = stage - 1 if kind is F else stage + 1
            what = "activations" if kind is F else "gradient"
            raise TimeoutError(
                f"stage {stage} waited {self._timeout:g} s for stage {sender}'s {what} of micro-batch {microbatch} "
                "(the pipeline's timeout; raise it for stages whose actions take longer)"
            ) from None

    def abort(self, reason: str) -> None:
        """Make every waiting and later :meth:`receive` raise ``pipecore._C.Aborted(reason)``."""
        self._mailbox.abort(reason)

    def resume(self) -> None:
        """Undo :meth:`abort` (the messages already delivered stay)."""
        self._mailbox.reset()

    def give_back(self, stage: int, kind: Kind, microbatch: int, message: Message) -> None:
        self.send(stage, kind, microbatch, message)

    def drop(self, which: Callable[[int, Kind, int], bool]) -> None:
        for key in self._mailbox.keys():
            if which(*_unkey(key)):
                self._mailbox.take(key, 0.0)

    def close(self, deliver: bool = True) -> None:
        self._mailbox.clear()
