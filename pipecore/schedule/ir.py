"""Schedule IR: actions as data, with the short grammar of ``torch.distributed.pipelining``.

An action is ``<stage><kind><microbatch>``: ``"2F0"`` is stage 2's forward of micro-batch 0, ``"1B3"``
stage 1's backward of micro-batch 3, ``"1W3"`` its weight-gradient part when the schedule splits the backward
(zero-bubble schedules: ``B`` then computes only the gradient of the stage's input, which the upstream stage
waits for, and ``W`` the weights' gradients, later, in a bubble). pipecore extends the grammar in three small
ways:

* ``"1B4-7"``: one backward that covers micro-batches 4..7 (the nF1B family runs one backward per
  mini-batch);
* ``"0U3"``: stage 0's optimizer update that produces weight version 3;
* ``"2F0@v3"``: in traces, the weight version an action read (derived weights print their derivation,
  e.g. ``"1B5@v4~interp(v2,a=0.135)"``).

Communication is not an action: it is implied by the data flow (F of a micro-batch at stage ``s`` takes what
F at ``s - 1`` sent; B at ``s`` what B at ``s + 1`` sent), and the transports carry it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Mapping


class Kind(str, Enum):
    """What an action does. Values are the grammar's letters."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"
    UPDATE = "U"

    def __str__(self) -> str:
        return self.value


F, B, W, U = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT, Kind.UPDATE

_KINDS = "|".join(k.value for k in Kind)
_ACTION_RE = re.compile(rf"^(\d+)({_KINDS})(\d+)(?:-(\d+))?(?:@(\S+))?$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one stage's action list.

    ``index`` is the (first) micro-batch for ``F``/``B``/``W``, and the produced version for
    ``U``. ``count`` is the number of consecutive micro-batches a backward covers (1 except in nF1B).
    """

    stage: int
    kind: Kind
    index: int
    count: int = 1

    def __post_init__(self) -> None:
        if self.stage < 0 or self.index < 0 or self.count < 1:
            raise ValueError(f"invalid action fields: stage={self.stage}, index={self.index}, count={self.count}")
        if self.count > 1 and self.kind is not B:
            raise ValueError(f"only backward actions may cover several micro-batches, got {self.kind} x{self.count}")

    @property
    def microbatches(self) -> range:
        """The micro-batches this action covers (empty for an update)."""
        if self.kind is U:
            return range(0)
        return range(self.index, self.index + self.count)

    def __str__(self) -> str:
        tail = f"-{self.index + self.count - 1}" if self.count > 1 else ""
        return f"{self.stage}{self.kind.value}{self.index}{tail}"

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Parse ``"2F0"``, ``"1B4-7"``, ``"1W4"``, ``"0U3"``; a trailing ``@version`` tag is accepted and ignored."""
        action, _ = parse_traced(text)
        return action


def traced(action: Action, reads: Mapping[int, object]) -> str:
    """The action as traces name it: ``"2F0@v3"`` with the weights each micro-batch read (their ``str``),
    one tag when all agree (``"1B4-7@v2"``), else one per micro-batch joined by ``/``; an update is bare."""
    if action.kind is U or not reads:
        return str(action)
    tags = {str(r) for r in reads.values()}
    tag = tags.pop() if len(tags) == 1 else "/".join(str(reads[k]) for k in action.microbatches)
    return f"{action}@{tag}"


def parse_traced(text: str) -> tuple[Action, str | None]:
    """Parse an action with an optional version tag: ``"2F0@v3"`` -> ``(Action(2, F, 0), "v3")``."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
        raise ValueError(
            f"cannot parse action {text!r}: expected <stage><kind><microbatch>[-<last>][@<version>] with kind "
            f"one of {', '.join(k.value for k in Kind)} (e.g. '2F0', '1B4-7', '1W4', '0U3', '2F0@v3')"
        )
    stage, kind, first, last, tag = match.groups()
    count = int(last) - int(first) + 1 if last is not None else 1
    if count < 1:
        raise ValueError(f"cannot parse action {text!r}: range end {last} is before its start {first}")
    return Action(int(stage), Kind(kind), int(first), count), tag
