"""Stepping: feeding a mini-batch's micro-batches and targets to the stages and running the schedule.

:class:`Steps` keeps what the schedule has been given since the last flush (inputs, targets, how far the
schedule is generated) and the executor that runs it, on stage threads or in turn as the pipeline chose;
the last stage's forwards complete each mini-batch's loss. Taking a failed step back is the work of
:mod:`pipecore.engine.recovery`, which :meth:`Steps.step` calls through a :class:`Guard`.
"""

from __future__ import annotations

import math
import statistics
import time
from functools import partial
from typing import Any, Callable, Protocol

import torch

from ..runtime.choice import IN_TURN, THREADS
from ..runtime.executor import Costs, Executor
from ..runtime.worker import ActionRecord
from ..schedule.ir import Action, F
from ..schedule.validate import validate
from .clip import ClipDependencies, LocalGlobalNorm
from .data_parallel import shard, sum_over
from .inputs import Batch, LossTarget, as_model_inputs, as_payload, loss_divisor, split_batch, to_device
from .locality import Needs
from .parts import Parts
from .threads import calling_thread_threads


class Guard(Protocol):
    """What a step asks of the pipeline's recovery (:class:`pipecore.engine.recovery.Recovery`)."""

    def guarded(self, work: Callable[[], None]) -> None:
        """Run executor work; if it fails, take the pipeline back and raise the error."""

    def keep_undo_points(self, minibatch: int) -> None:
        """Keep what each stage needs to go back to before ``minibatch``."""

    def receive_loss(self, minibatch: int) -> float:
        """The loss of ``minibatch`` from the rank that runs the last stage."""


class Steps:
    """The mini-batches given since the schedule started and the executor that runs their actions."""

    def __init__(self, parts: Parts):
        self.parts = parts
        self.kept = 0  # see Pipeline.minibatches
        self._last_stage = parts.num_stages - 1
        self.restart()

    def restart(self) -> None:
        """Begin a fresh schedule (at construction and after every flush)."""
        parts = self.parts
        for st in parts.stages.values():
            st.restart()
            if st.gradient_sum is not None:
                st.gradient_sum.restart()
        self.fed = 0  # mini-batches given since the schedule started
        self.minibatch_loss: dict[int, float] = {}
        # Last stage: per mini-batch whose micro-batches differ (or with several replicas), the micro-batch sizes and
        # the samples of the (global) mini-batch.
        self.microbatch_sizes: dict[int, tuple[list[int], int]] = {}
        self.horizon = 2
        schedule = validate(parts.algorithm.schedule(self.horizon))
        sync = parts.tie_sync
        for st in parts.stages.values():
            if st.ties is not None and sync is not None:
                st.ties.restart(sync)
        self.executor = Executor(
            schedule, parts.stages, Costs.uniform(parts.num_stages), transport=parts.transport,
            source=parts.inputs.pop, keep_events=False, on_record=self.observe,
            recorded_stages=frozenset({self._last_stage}),  # observe looks at the last stage's forwards
            needs=self.needs(None if sync is None else sync.needs), threads=parts.threads,
            calling_thread=partial(calling_thread_threads, parts.threads_per_stage),
        )

    def needs(self, ties: Needs | None) -> Needs | None:
        """What an action waits for besides its message: tied weights' partners, and with a global gradient
        norm in one process, every stage's last backward of the group an update applies."""
        if isinstance(self.parts.global_norm, LocalGlobalNorm):
            algorithm = self.parts.algorithm
            return ClipDependencies(self.parts.num_stages, algorithm.update_every, ties,
                                    weight_actions=algorithm.schedule(1).splits_backward(0))
        return ties

    def in_flight(self) -> int:
        """Micro-batches whose backward has not run yet, summed over this process's stages."""
        return sum(st.book.in_flight() for st in self.parts.stages.values())

    @property
    def execution(self) -> str:
        """How steps run in this process (:attr:`Pipeline.execution`)."""
        if self.parts.choice is not None:
            return self.parts.choice.state
        return THREADS if self.parts.threads is not None else IN_TURN

    def observe(self, action: Action, record: ActionRecord) -> None:
        """After each action (the executor's ``on_record``): the last stage's forward of a mini-batch's last
        micro-batch completes the mini-batch loss. (What the reads were, the stages tally themselves.)"""
        if action.kind is not F or action.stage != self._last_stage:
            return
        parts = self.parts
        s, m = action.stage, parts.n_microbatches
        if (action.index + 1) % m == 0:
            # The last micro-batch of a mini-batch has its loss: the mini-batch loss is known now.
            j = action.index // m
            losses = [parts.stages[s].losses.pop(j * m + u) for u in range(m)]
            weights = self.microbatch_sizes.pop(j, None)
            # The mean over the mini-batch's samples: each micro-batch's (mean) loss weighs by its size (with
            # several replicas, this replica's share of the global mean, summed over the replicas).
            if weights is None:
                self.minibatch_loss[j] = statistics.fmean(losses)
            else:
                sizes, samples = weights
                self.minibatch_loss[j] = math.fsum(n * loss for n, loss in zip(sizes, losses)) / samples
                if parts.data_parallel > 1:
                    self.minibatch_loss[j] = sum_over(parts.dp_group, [self.minibatch_loss[j]], parts.devices[s],
                                                      f"the loss of mini-batch {j}")[0]
            parts.locality.publish_loss(j, self.minibatch_loss[j])

    def step(self, x: Batch | None, y: Batch | None, local: bool, guard: Guard) -> float:
        """:meth:`Pipeline.step`: give one mini-batch, run the schedule as far as it allows, return the loss."""
        if not isinstance(local, bool):
            raise TypeError(f"step(): local must be True or False, got {local!r}")
        parts = self.parts
        m = parts.n_microbatches
        first_stage, last_stage = 0 in parts.stages, self._last_stage in parts.stages
        for name, value, required in [("x", x, first_stage), ("y", y, last_stage)]:
            if required and value is None:
                raise TypeError(f"step(): {name} is required on the rank that runs "
                                f"{'the first' if name == 'x' else 'the last'} stage, got None")
        inputs = as_model_inputs(x, parts.captured) if first_stage else None
        global_samples = None  # with several replicas: the global mini-batch's samples (the losses' divisor)
        if parts.data_parallel > 1:
            assert parts.topology is not None
            if not local:  # the global mini-batch: this replica's share of it
                global_samples = _samples(y) if last_stage else None
                inputs = shard(inputs, parts.topology) if inputs is not None else None
                y = shard(y, parts.topology) if last_stage else None
            elif last_stage:  # this replica's own shard: the global count is the sum over the replicas
                global_samples = int(sum_over(parts.dp_group, [_samples(y)], parts.devices[self._last_stage],
                                              "the mini-batch's sample count")[0])
        x_chunks = split_batch(dict(zip(parts.captured.input_names, inputs)), m, "x") if inputs is not None else None
        y_chunks = split_batch(y, m, "y") if last_stage else None
        if x_chunks is not None and y_chunks is not None and x_chunks.samples != y_chunks.samples:
            raise ValueError(f"input batch has {x_chunks.samples} samples but target batch has {y_chunks.samples}")
        first = self.fed * m
        if x_chunks is not None:
            device = parts.devices[0]
            for u, chunk in enumerate(x_chunks.chunks):
                parts.inputs[first + u] = as_payload(tuple(t.to(device) for t in chunk))
        if y_chunks is not None:
            device = parts.devices[self._last_stage]
            sizes, every = y_chunks.sizes, parts.algorithm.update_every
            samples = y_chunks.samples if global_samples is None else global_samples
            for u, chunk in enumerate(y_chunks.chunks):
                divisor = loss_divisor(sizes[u], samples, m, every)
                parts.targets[first + u] = LossTarget(to_device(y_chunks.rebuild(chunk), device), divisor)
            # (set or cleared: a step that failed before it ran may have left this mini-batch's entry)
            if global_samples is not None:
                self.microbatch_sizes[self.fed] = (sizes, global_samples)
            elif len(set(sizes)) > 1:
                self.microbatch_sizes[self.fed] = (sizes, sum(sizes))
            else:
                self.microbatch_sizes.pop(self.fed, None)
        minibatch = self.fed
        guard.guarded(self.executor.check)  # an error left by the previous step's remaining work (overlap_steps)
        guard.keep_undo_points(minibatch)
        self.fed += 1
        self.kept += 1
        if not last_stage:  # (only a rank can lack the last stage: the loss comes from the rank that has it)
            parts.transport.expect_loss()
        if self.fed + 1 > self.horizon:
            # Regenerate further ahead, doubling, so regeneration costs stay linear in the number of steps.
            self.horizon = max(2 * self.horizon, self.fed + 1)
            self.executor.extend(parts.algorithm.schedule(self.horizon))
        # With overlap_steps, return once the last stage has the loss (its last forward of this mini-batch);
        # not under a profiler, whose session must not end while stage threads still record into it.
        overlap = parts.overlap_steps and not torch.autograd._profiler_enabled()
        until = (self._last_stage, F, self.fed * m - 1) if overlap else None
        choice = parts.choice
        if choice is None:
            guard.guarded(lambda: self.executor.run(available=self.fed * m, until=until))
        else:  # steps end settled here (no overlap_steps): the threads are idle, either way can run next
            way = choice.next()
            self.executor.threads = parts.threads if way == THREADS else None
            started = time.perf_counter()
            guard.guarded(lambda: self.executor.run(available=self.fed * m, until=until))
            choice.record(way, time.perf_counter() - started)
        if not last_stage:
            return guard.receive_loss(minibatch)
        loss = self.minibatch_loss.pop(minibatch)
        if until is not None and not math.isfinite(loss) and parts.on_nonfinite == "raise":
            # The stage reading it raises NonFiniteLoss: from this step, as without overlap.
            guard.guarded(self.executor.settle)
        return loss

    def forget(self, failed: int, newest: int) -> None:
        """Drop the inputs, targets and losses of mini-batches ``failed..newest``: they were never given."""
        first = failed * self.parts.n_microbatches
        for table in (self.parts.inputs, self.parts.targets):
            for k in [k for k in table if k >= first]:
                del table[k]
        for table in (self.minibatch_loss, self.microbatch_sizes):
            for j in [j for j in table if j >= failed]:
                del table[j]
        self.kept -= newest - failed + 1
        self.fed = failed


def _samples(batch: Any) -> int:
    """The samples of a batch: dimension 0 of its (first) tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, dict):
        return _samples(next(iter(batch.values())))
    if isinstance(batch, (tuple, list)) and batch:
        return _samples(batch[0])
    raise TypeError(f"a batch is a tensor, or a tuple or dict of tensors, got {type(batch).__name__}")
