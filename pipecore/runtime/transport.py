"""Transports move messages between stages. The executor and the stage workers are the same for all."""

from __future__ import annotations

from typing import Protocol

from ..schedule.ir import Kind
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


class LocalTransport:
    """In-process mailboxes: every stage lives in this process."""

    def __init__(self) -> None:
        self._mailbox: dict[tuple[int, Kind, int], Message] = {}

    def send(self, stage: int, kind: Kind, microbatch: int, message: Message) -> None:
        self._mailbox[(stage, kind, microbatch)] = message

    def ready(self, stage: int, kind: Kind, microbatch: int) -> bool:
        return (stage, kind, microbatch) in self._mailbox

    def receive(self, stage: int, kind: Kind, microbatch: int) -> Message:
        return self._mailbox.pop((stage, kind, microbatch))

    def close(self, deliver: bool = True) -> None:
        self._mailbox.clear()
