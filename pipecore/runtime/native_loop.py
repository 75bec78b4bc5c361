"""The native stage loop: a stage's program of takes, replays and posts, run by a C++ thread without the GIL.

On a GPU, once a stage's forward and backward for a micro-batch are captured as graphs, what is left for the host
per action is to wait for the inputs, copy them into the graph's static input buffers, replay, and post copies of
the outputs. Python still decides what every action is (the schedule, the version book); it hands each stage a
:class:`Program` per step and a :class:`NativeStageLoop` runs it on its own thread, so a step no longer hands the
GIL from stage to stage for every op. Messages are native messages in the pipeline's mailboxes (lists of tensors,
``Mailbox.put_tensors``): Python threads running eager actions exchange them with the loops alike.

The loop's semantics (order, errors, aborts) are independent of what a replay is, so they are tested on the CPU
with :class:`StandInGraph` (``outputs[i] = inputs[i] * scale + shift``, in place, as a replay writes its static
outputs)::

    from pipecore import _C
    from pipecore.runtime.native_loop import NativeStageLoop, Post, Replay, StandInGraph, Take

    inbox, outbox = _C.Mailbox(), _C.Mailbox()
    x, y = torch.zeros(4), torch.zeros(4)                      # the graph's static input and output
    loop = NativeStageLoop(0, graphs=[StandInGraph("f", [x], [y], scale=2.0)], buffers=[x, y],
                           mailboxes=[inbox, outbox])
    loop.start([Take(0, key=7, buffers=[0]), Replay(0), Post(1, key=7, buffers=[1])])
    inbox.put_tensors(7, [torch.ones(4)])
    loop.join(timeout=10)
    outbox.take(7)                                             # [tensor([2., 2., 2., 2.])]

The first failure stops the loop and aborts every mailbox it uses with a reason naming the stage and the
instruction, so the loops and threads waiting on it stop too; :meth:`NativeStageLoop.join` raises it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

import torch

from .. import _C

#: ``pipecore._C.Aborted``: what :meth:`NativeStageLoop.join` raises when one of the loop's mailboxes was aborted.
Aborted = _C.Aborted
#: The CPU stand-in for a captured graph (see the module's docstring).
StandInGraph = _C.StandInGraph


@dataclass(frozen=True)
class Take:
    """Wait for the native message under ``key`` in mailbox ``mailbox`` and copy its tensors into the static
    buffers ``buffers`` (indices into the loop's buffers, in message order). A message whose tensors do not match
    the buffers' count, shapes, dtypes or devices fails the loop before anything is copied."""

    mailbox: int
    key: int
    buffers: Sequence[int] = field(default_factory=tuple)


@dataclass(frozen=True)
class Replay:
    """Replay graph ``graph`` (an index into the loop's graphs)."""

    graph: int


@dataclass(frozen=True)
class Post:
    """Post copies of the static buffers ``buffers`` under ``key`` in mailbox ``mailbox`` (copies, because the
    next replay overwrites the buffers)."""

    mailbox: int
    key: int
    buffers: Sequence[int] = field(default_factory=tuple)


Instruction = Union[Take, Replay, Post]
Program = Sequence[Instruction]


def encode(program: Program) -> list[tuple]:
    """The tuples ``pipecore._C.StageLoop.start`` takes."""
    out: list[tuple] = []
    for i, ins in enumerate(program):
        if isinstance(ins, Replay):
            out.append(("replay", ins.graph))
        elif isinstance(ins, (Take, Post)):
            out.append(("take" if isinstance(ins, Take) else "post", ins.mailbox, ins.key, list(ins.buffers)))
        else:
            raise TypeError(f"program instruction {i} is a {type(ins).__name__}; expected Take, Replay or Post")
    return out


class NativeStageLoop:
    """One stage's native loop over its graphs, static buffers and mailboxes.

    Args:
        stage: the stage's index (in error messages).
        graphs: what :class:`Replay` instructions replay (``pipecore._C.Replayable``: a captured graph, or
            :class:`StandInGraph`).
        buffers: the static buffers :class:`Take` copies into and :class:`Post` copies from.
        mailboxes: ``pipecore._C.Mailbox`` objects; the loop keeps them alive while it exists.
    """

    def __init__(self, stage: int, graphs: Sequence[_C.Replayable], buffers: Sequence[torch.Tensor],
                 mailboxes: Sequence[_C.Mailbox]) -> None:
        self._loop = _C.StageLoop(stage, list(graphs), list(buffers), list(mailboxes))

    @property
    def stage(self) -> int:
        return self._loop.stage

    @property
    def running(self) -> bool:
        """Whether a program started and has not ended yet (ended: joined or not)."""
        return self._loop.running

    def start(self, program: Program, timeout: float | None = None) -> None:
        """Check ``program`` (``ValueError`` naming the instruction) and start it on the loop's thread, with the
        caller's torch thread-local state (grad mode, autocast, profiler). ``timeout``: seconds each :class:`Take`
        may wait (None: forever); a take that times out fails the loop like any other error."""
        self._loop.start(encode(program), -1.0 if timeout is None else float(timeout))

    def join(self, timeout: float | None = None) -> None:
        """Wait for the program to end, with the GIL released, and raise its failure: :data:`Aborted` (a mailbox
        was aborted; the reason names who failed first), ``TimeoutError`` (a take waited too long) or
        ``RuntimeError`` (naming the stage, the instruction and what went wrong). ``TimeoutError`` also when the
        program is still running after ``timeout`` seconds; it keeps running then (join again, or abort)."""
        self._loop.join(-1.0 if timeout is None else float(timeout))

    def abort(self, reason: str) -> None:
        """Abort the loop's mailboxes with ``reason``: the program stops at its next wait, and so does everyone
        else waiting on those mailboxes."""
        self._loop.abort(reason)

    def completed(self) -> list[tuple[int, int]]:
        """``(instruction index, sequence number)`` for each instruction the latest program completed; the
        sequence numbers are process-wide, so they order the instructions of several loops."""
        return [tuple(p) for p in self._loop.completed()]

    def __repr__(self) -> str:
        return f"NativeStageLoop(stage={self.stage}, running={self.running})"
