"""Recovery: taking a failed step back, and draining the schedule at a flush.

Before each step every stage keeps an undo point (what it must go back to if the step fails), and the
pipeline keeps the random state; once no error can reach a mini-batch any more, what was kept for it goes.
When an action fails, :meth:`Recovery.recover` undoes the failed mini-batch and every later one on every
stage, completes the earlier ones as a flush would, and lets training continue; with one process per rank the
ranks first agree on what to undo (see the :class:`~.locality.Locality`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..runtime.link import PeerError
from ..schedule.ir import Action, U
from .backward_rules import GLOBAL_RANDOM
from .parts import Parts
from .stepping import Steps
from .state import Unrecoverable


class Recovery:
    """The undo points of the mini-batches not yet complete, and the work that takes a failed step back."""

    def __init__(self, parts: Parts, steps: Steps):
        self.parts, self.steps = parts, steps
        self.broken: BaseException | None = None  # the error after which the pipeline could not be taken back
        self.recovering = False
        # Per mini-batch not yet complete on every stage (oldest first): (mini-batch, random state at its step,
        # the tie exchange's epoch then); the stages keep the matching UndoPoints.
        self.undo_steps: list[tuple[int, Any, int]] = []
        sync = parts.tie_sync
        self.complete = parts.locality.completion_test(parts.algorithm, parts.stages,
                                                       steps.needs(None if sync is None else sync.needs))

    def restart(self) -> None:
        """Begin a fresh schedule (after a flush, or a loaded state): nothing before it can be undone."""
        for st in self.parts.stages.values():
            st.drop_undo_points()
        self.undo_steps = []
        self.steps.restart()

    def keep_undo_points(self, minibatch: int) -> None:
        """Before a step gives ``minibatch``: what each stage needs to go back to if it fails (and forget what
        was kept for the mini-batches complete on every stage, which no error can reach any more)."""
        parts = self.parts
        if not parts.recover:
            return
        m = parts.n_microbatches
        while self.undo_steps and self.complete(self.undo_steps[0][0], minibatch):
            self.undo_steps.pop(0)
        epoch = 0
        if parts.tie_exchange is not None:
            oldest = self.undo_steps[0][2] if self.undo_steps else None
            epoch = parts.tie_exchange.new_epoch(forget_before=oldest)
        cuda = sorted({st.device.index or 0 for st in parts.stages.values() if st.device.type == "cuda"})
        with GLOBAL_RANDOM:  # not halfway through a recomputation's replay of a forward's random state
            random = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in cuda], cuda)
        self.undo_steps.append((minibatch, random, epoch))
        kept = {j * m for j, _, _ in self.undo_steps}
        for st in parts.stages.values():
            st.keep_undo_points(kept, minibatch * m)

    def receive_loss(self, minibatch: int) -> float:
        """The loss the last rank published; a failure it reports instead is taken back like one of this rank."""
        try:
            return self.parts.transport.receive_loss(minibatch)
        except PeerError as exc:
            if exc.cause is not None and self.broken is None and not self.recovering:
                self.steps.executor.failure = exc
                self.recover(exc)
            raise

    def guarded(self, work: Callable[[], None]) -> None:
        """Run executor work; if it fails, take the pipeline back before the newest mini-batch (see
        :meth:`recover`) and raise the error."""
        try:
            work()
        except BaseException as exc:
            if self.steps.executor.failure is not None and self.broken is None and not self.recovering:
                self.recover(exc)
            raise

    def recover(self, exc: BaseException) -> None:
        """After ``exc`` stopped a step or a flush: undo the mini-batch of the failed action (the newest one if
        the failed actions left no trace; they run again) and every later one, on every stage, and complete the
        earlier ones, as :meth:`Pipeline.flush` would have done in place of the failed mini-batch. If that is
        impossible, the pipeline refuses to go on. Either way a note on ``exc`` says what happened."""
        parts, steps = self.parts, self.steps
        m, every = parts.n_microbatches, parts.algorithm.update_every
        executor = steps.executor

        def minibatch(action: Action) -> int:
            return ((action.index - 1) * every if action.kind is U else action.index) // m

        newest = steps.fed - 1
        failed = min([minibatch(a) for a, clean in executor.failed_actions if not clean] + [newest])
        self.recovering = True
        try:
            if not parts.recover:
                parts.locality.report_failure(exc, executor, parts.stages)  # the other ranks still learn the cause
                raise Unrecoverable("the pipeline was built with recover=False")
            failed, resync = parts.locality.agree_on_failure(exc, failed, executor, parts.stages)
            first = failed * m
            step = next((entry for entry in self.undo_steps if entry[0] == failed), None)
            if step is None:
                raise Unrecoverable(f"the pipeline kept nothing to go back to before mini-batch {failed}")
            undone_from = self.undo_stages(failed)

            def kept(action: Action) -> bool:
                return minibatch(action) < failed and not (
                    action.kind is U and action.index >= undone_from.get(action.stage, action.index + 1))

            if parts.global_norm is not None:  # its norms are kept by the stages' update counts
                parts.global_norm.discard(min(st.book.updates for st in parts.stages.values()))
            resync(first)
            if failed > 0:
                executor.recover(parts.algorithm.schedule(failed), keep=kept,
                                 drop_message=lambda stage, kind, k: k >= first)
            else:
                parts.transport.resume()
                parts.transport.drop(lambda stage, kind, k: True)
            steps.forget(failed, newest)
            cpu, cuda_states, cuda = step[1]
            torch.set_rng_state(cpu)
            for d, state in zip(cuda, cuda_states):
                torch.cuda.set_rng_state(state, d)
            self.drain()
        except BaseException as err:
            self.broken = exc
            steps.executor.failure = exc
            exc.add_note(f"pipecore could not take the pipeline back to before mini-batch {failed} since the last "
                         f"flush ({type(err).__name__}: {err}); it cannot continue. Build a new Pipeline (and load a "
                         "checkpoint)")
        else:
            dropped = f"mini-batch {failed}" if failed == newest else f"mini-batches {failed}..{newest}"
            exc.add_note(f"pipecore took the pipeline back: {dropped} since the last flush "
                         f"{'was' if failed == newest else 'were'} dropped (updates undone) and the earlier ones "
                         "completed, as flush() would have done in place of the first dropped; training can continue")
        finally:
            self.recovering = False

    def undo_stages(self, failed: int) -> dict[int, int]:
        """Take every stage back to before mini-batch ``failed``; return, per stage that undid updates, the
        first update undone."""
        first = failed * self.parts.n_microbatches
        undone_from: dict[int, int] = {}
        for st in self.parts.stages.values():
            point = next((p for p in st.undo_points if p.first == first), None)
            if point is None:
                raise Unrecoverable(f"stage {st.stage} kept nothing to go back to before mini-batch {failed}")
            if point.snapshot is not None:
                undone_from[st.stage] = point.snapshot.update
            st.undo(point)
        return undone_from

    def drain(self) -> None:
        """Run every in-flight backward and update, then begin a fresh schedule (the work of
        :meth:`Pipeline.flush`)."""
        parts, steps = self.parts, self.steps
        if steps.fed == 0:
            self.restart()
            return
        drained = parts.algorithm.schedule(steps.fed)
        if parts.tie_sync is not None:
            # The last update of each owner applies every tied gradient still pending.
            draining = parts.tie_sync.draining(drained)
            steps.executor.needs = steps.needs(draining.needs)
            for st in parts.stages.values():
                if st.ties is not None:
                    st.ties.sync = draining
        steps.executor.extend(drained)
        steps.executor.run()
        parts.locality.end_flush(steps.executor)
        self.restart()
