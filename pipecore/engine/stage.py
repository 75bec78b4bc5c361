"""The tensor stage: a :class:`~pipecore.runtime.StageWorker` whose hooks run a module chunk on real tensors.

Weights live in a :class:`~pipecore.ring.WeightRing`: each version is a slot; a forward runs the module
with its parameters as views of the slot (or of a scratch buffer holding derived weights). How a backward
reads the weights the version policy chose (the forward's own, or others) is its backward rule
(:mod:`pipecore.engine.backward_rules`); the stage runs the rest the same for every rule.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Mapping, Sequence

import torch

from ..algorithms.base import Algorithm, WeightRead
from ..ring import WeightRing
from ..runtime.worker import ActionRecord, StageWorker
from ..schedule.ir import Action
from ..versions import UpdateInfo
from .action_times import ActionTimes
from .autograd_call import accumulate_backward, leaves_reached
from .backward_rules import RULES, BackwardRule, InFlight
from .clip import GradClip
from .data_parallel import GradientSum
from .describe import carries_grad, describe
from .flat import FlatLayout
from .flat_parameters import FlatParameters
from .graph import StageGraph
from .inputs import LossTarget, as_payload, from_payload
from .losses import MicrobatchLosses
from .lr import LrSchedule
from .member_access import speed_up_member_access
from .memory import MemoryAccount, peak_bytes, storage_bytes
from .optim import LrScales, StageOptimizer, uniform_scale
from .split_backward import PendingWeightGradients, input_gradient, weight_gradients
from .stage_device import OnDevice
from .state import StageState, StateSnapshot, Unrecoverable
from .tied import StageTies
from .undo import UndoPoint, release, slot_for_update


_NO_RANGE = nullcontext()  # reusable: it holds nothing


class TensorStage(OnDevice, StageWorker):
    """One stage of a :class:`~pipecore.Pipeline`, computing on tensors."""

    def __init__(
        self,
        algorithm: Algorithm,
        stage: int,
        graph: StageGraph,
        optimizer: StageOptimizer,
        num_slots: int,
        derived: bool,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
        target: Callable[[int], LossTarget] | None,
        on_nonfinite: str,
        device: torch.device | None = None,
        *,
        state_keys: Sequence[str] | None = None,
        track_memory: bool = True,
        autocast: torch.dtype | None = None,
        split_backward: bool = False,
        weight_actions: bool = False,
        lr_schedule: LrSchedule | None = None,
    ):
        """``state_keys``: the model's state_dict keys this stage holds (default: its module's; the generated
        module may hold more, e.g. constants). ``track_memory``: keep the CPU memory account. ``autocast``: the
        dtype forwards run in (weights and optimizer state keep theirs). ``split_backward``: send the input
        gradient before computing the weight gradients. ``weight_actions``: the schedule runs each backward's weight
        gradients as a ``W`` action of its own (zero-bubble schedules). ``lr_schedule``: the learning rate by update
        index (None: the optimizer's own rate). What the stage shares with other stages (tied weights, the
        replicas' gradient sum, clipping) is given by :meth:`share_ties` and :meth:`connect` once they exist."""
        super().__init__(algorithm, stage)
        module = graph.module
        self.module = module
        speed_up_member_access(module)  # the generated forward reaches its submodules by attribute
        self.boundary = graph
        # One input that may carry a gradient, past the first stage: _stage_inputs' usual case.
        self._one_grad_input = stage > 0 and tuple(graph.grad_inputs) == (True,)
        self.state_keys: list[str] = list(module.state_dict()) if state_keys is None else list(state_keys)
        self.layout = FlatLayout.of(module, stage)
        if device is None:
            device = next((p.device for p in module.parameters()), torch.device("cpu"))
        self.place(device)
        # The modules that hold buffers (BatchNorm's statistics), found once: an undo point copies their buffers
        # at every step, and the module's structure does not change while it trains.
        self.modules_with_buffers = [m for m in module.modules() if m._buffers]
        # With messages between CPU stages of one process, the worker skips accept, stamp and action_range
        # while this says nothing profiles (see StageWorker.plain_messages).
        self._profiling = torch.autograd._profiler_enabled
        self.records = False  # nothing reads a training stage's action records: it tallies its reads itself
        flat = torch.zeros(self.layout.buffer_numel, dtype=self.layout.dtype, device=device)
        self.layout.gather(module, flat)
        # What the stage holds between actions: weight versions, gradients, optimizer state, declared buffers.
        self.state = StageState(stage, self.layout, flat, num_slots, derived, optimizer, self.book,
                                algorithm.buffer_updates(stage))
        # Whether a backward's graph reaches no leaf but the stage's weight leaves and inputs, so that the engine
        # need not be told which leaves to accumulate into (autograd_call.accumulate_backward's every_leaf):
        # checked on the first backward (None until then) for a module whose graph is the same every call, that
        # is one made of torch's modules only; False for one that keeps a user module whole (leaf_modules),
        # whose Python may reach other tensors on some calls. A micro-batch whose input or target requires grad
        # names its leaves whatever this says (InFlight.outside_grad).
        self._every_leaf: bool | None = (
            None if all(type(m).__module__.startswith("torch.") for m in module.modules()) else False)
        self.lr_schedule = lr_schedule
        self._scheduled_lr = 0.0  # the rate of the update being applied, when lr_schedule is set
        self.clip: GradClip | None = None  # Pipeline's clip_grad_norm (see connect)
        self.autocast = autocast
        self.rule: BackwardRule = RULES[self.backward_rule]()  # how its backwards read their weights
        # The module's parameters as views of flat weights (a ring slot, the scratch buffer).
        self.flat_parameters = FlatParameters(module, self.layout, self.state.grad, self.state.storages())
        self._grad_views = self.flat_parameters.grad_views
        # Parameter-shaped views of flat weights and autograd leaves accumulating into the gradient buffer, as
        # the backward rules ask for them (RuleStage.weight_views, weight_leaves): FlatParameters' own methods.
        self.weight_views = self.flat_parameters.views
        self.weight_leaves = self.flat_parameters.leaves
        # The weights' storages count once. On CUDA the allocator measures, so the account keeps nothing.
        self.memory = MemoryAccount(self.flat_parameters.stable, module, enabled=track_memory and device.type == "cpu",
                                    watch=split_backward or weight_actions)  # a W may come after its B
        self.loss_fn = loss_fn
        self.target = target
        self.is_last = stage == algorithm.num_stages - 1
        self.in_flight: dict[int, InFlight] = {}
        self.microbatch_losses = MicrobatchLosses(loss_fn, on_nonfinite, stage, algorithm.n_microbatches,
                                                  algorithm.update_every, lambda group: self.poisoned_groups.add(group))
        # How long each action's compute took, per kind (see seconds and seconds_per_action).
        self._times = {"F": ActionTimes(), "B": ActionTimes(), "U": ActionTimes()}
        self._forward_times, self._backward_times, self._update_times = self._times.values()
        self.split_backward = split_backward  # see split_backward: the input gradient first
        # The schedule runs each backward's weight gradients as a W action of its own (zero-bubble schedules):
        # every backward leaves them, until its W.
        self.weight_actions = weight_actions
        # Weight gradients a backward left for later, by micro-batch: with split_backward until the backward's
        # messages are sent, with weight_actions until the micro-batch's W.
        self._deferred: dict[int, tuple[PendingWeightGradients, torch.Tensor | None]] = {}
        # Tied weights this stage shares with others; None when it shares none (see share_ties).
        self.ties: StageTies | None = None
        # With data_parallel: the sum of this stage's gradients over its replicas (see connect).
        self.gradient_sum: GradientSum | None = None
        self._last_backward_count = 0
        # Where the pipeline can take this stage back to, one per mini-batch not yet complete (see engine.undo);
        # the pipeline replaces the list (stage threads read it), oldest first.
        self.undo_points: list[UndoPoint] = []
        self.snapshot_pool: list[StateSnapshot] = []  # snapshots no point needs any more, reused (engine.undo)
        self._bind_module_to_live()

    # What the stage shares with the other stages is built once they all exist: first the tied weights (a global
    # gradient norm reads them), then the rest.
    def share_ties(self, ties: StageTies) -> None:
        """Exchange the gradients of the tied weights this stage holds with their other owners (``ties``)."""
        self.ties = ties
        self.state.tied_ranges = [(start, stop) for start, stop, _, _ in ties.ranges(self.state.grad)]

    def connect(self, *, gradient_sum: GradientSum | None = None, clip: GradClip | None = None) -> None:
        """Sum each update group's gradients over the stage's replicas (``gradient_sum``, data parallelism) and
        clip them (``clip``: by a global norm that reads every stage, or by the stage's own)."""
        self.gradient_sum, self.clip = gradient_sum, clip

    # -- weights -------------------------------------------------------------------------------

    # What the stage's state holds, by the names the stage's collaborators (clipping, ties, backward rules, the
    # pipeline) read them under.
    @property
    def ring(self) -> WeightRing:
        """The weight versions (:attr:`state`'s ring)."""
        return self.state.ring

    @property
    def grad(self) -> torch.Tensor:
        """The flat gradient buffer (:attr:`state`'s)."""
        return self.state.grad

    @property
    def scratch(self) -> torch.Tensor | None:
        """Where derived weights are written (None when no read derives)."""
        return self.state.scratch

    @property
    def optimizer(self) -> Any:
        """The stage's optimizer (a :class:`~pipecore.engine.optim.StageOptimizer`)."""
        return self.state.optimizer

    @property
    def grad_span(self) -> tuple[int, int] | None:
        """The first and last micro-batch whose gradients the buffer holds (None: it is zero)."""
        return self.state.grad_span

    @property
    def losses(self) -> dict[int, float]:
        """The last stage's losses by micro-batch, read from the device (taken out as mini-batches complete)."""
        return self.microbatch_losses.values

    def slot_of(self, version: int) -> torch.Tensor:
        """The flat weights of ``version``."""
        return self.state.slot_of(version)

    def buffer(self, name: str) -> torch.Tensor:
        """The algorithm's declared buffer ``name`` (see :mod:`pipecore.algorithms.state`)."""
        return self.state.buffer(name)

    def materialize(self, read: WeightRead) -> torch.Tensor:
        """The flat weights a read names; derived weights are written into the scratch buffer by the algorithm's
        derivation."""
        if read.derivation is None:
            return self.state.slot_of(read.version)
        derive = self.algorithm.derivation(read.derivation)
        if self.state.scratch is None:
            raise ValueError(f"{read}: derived weights need the scratch buffer the simulation sizes")
        return derive(self, read, self.state.slot_of(read.version), self.state.scratch)

    def sync_ring(self) -> None:
        """Pin exactly the non-live versions the version book still holds; the rest become reusable."""
        self.state.sync_ring()

    def _bind_module_to_live(self) -> None:
        self.flat_parameters.bind(self.state.ring.live)

    @property
    def backward_rule(self) -> str:
        """The algorithm's backward rule, except that ``swap`` becomes ``recompute`` under autocast: autocast's
        weight casts are copies that a swap cannot replace, while a recomputation casts the backward's weights."""
        rule = self.algorithm.backward_rule
        return "recompute" if rule == "swap" and self.autocast is not None else rule

    def autocasting(self) -> AbstractContextManager:
        """Where a forward runs: under ``torch.autocast`` to the stage's ``autocast`` dtype, if it has one."""
        if self.autocast is None:
            return _NO_RANGE  # a shared null context: this runs once per forward
        return torch.autocast(device_type=self.device.type, dtype=self.autocast)

    # -- boundary values -------------------------------------------------------------------------

    def _stage_inputs(self, payload: Any) -> tuple[Any, ...]:
        """The received values as the module's arguments; those that may carry a gradient (floating tensors
        computed from parameters upstream) become leaves that require grad."""
        if self._one_grad_input and type(payload) is torch.Tensor and payload.dtype is self.layout.dtype:
            # The usual case, without the loop below: one floating tensor of the stage's own dtype.
            return (payload.detach().requires_grad_(True),)
        values = from_payload(payload, len(self.boundary.inputs))
        if self.stage == 0:
            return values
        out = []
        for value, wants_grad in zip(values, self.boundary.grad_inputs):
            if isinstance(value, torch.Tensor):
                if wants_grad and value.is_floating_point():
                    if value.dtype is not self.layout.dtype:  # the stage's own dtype needs no check
                        self._check_input(value)
                    value = value.detach().requires_grad_(True)
            out.append(value)
        return tuple(out)

    def _stage_outputs(self, y: Any) -> tuple[torch.Tensor, ...]:
        """The generated module's outputs, checked: only tensors cross a cut."""
        for name, value in zip(self.boundary.outputs, y):
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"stage {self.stage} would send {name!r} to stage {self.stage + 1}, but it is a "
                    f"{type(value).__name__} ({value!r}), not a tensor: only tensors cross a cut. Move the cut "
                    f"(partition=...) so that {name!r} is computed in the stage that uses it"
                )
        return tuple(y)

    # -- compute hooks ---------------------------------------------------------------------------

    def compute_forward(self, action: Action, read: WeightRead, payload: Any) -> Any:
        t0 = time.perf_counter()
        k = action.index
        weights = self.materialize(read)
        inputs = self._stage_inputs(payload)
        target = self.target(k) if self.is_last else None
        self.mutated = True  # the module may update buffers (BatchNorm) and draws random numbers
        memory = self.memory
        if memory.enabled:
            with memory.counting((*inputs, None if target is None else target.value)) as kept:
                y, record = self.rule.forward(self, k, weights, read.derivation is not None, inputs, target)
            memory.forwarded(k, kept, () if self.is_last else y)
        else:  # nothing to count: no context to enter (this runs once per forward)
            y, record = self.rule.forward(self, k, weights, read.derivation is not None, inputs, target)
        if (self.stage == 0 and carries_grad(inputs)) or (target is not None and carries_grad(target.value)):
            record.outside_grad = True
        self.in_flight[k] = record
        self.state.sync_ring()
        self._forward_times.add_since(t0)
        if self.is_last:
            return None
        return y[0].detach() if len(y) == 1 else tuple(t.detach() for t in y)  # as_payload of the detached outputs

    def run_forward(self, k: int, params: Sequence[torch.Tensor], inputs: tuple[Any, ...],
                    target: LossTarget | None) -> Any:
        """Micro-batch ``k``'s forward: the module on ``inputs`` with ``params`` as its parameters; the loss at
        the last stage (recorded, see :meth:`_loss`), the checked outputs before it (what every backward rule
        runs in its forward)."""
        try:
            y = self.flat_parameters.run(params, inputs)
        except Exception as exc:
            self._note_module_error(exc, inputs)
            raise
        return self.microbatch_losses.compute(k, y, target) if self.is_last else self._stage_outputs(y)

    def rerun_forward(self, params: Sequence[torch.Tensor], inputs: tuple[Any, ...],
                      target: LossTarget | None) -> Any:
        """A forward run again for its backward (the recompute rule): what :meth:`run_forward` returned, the
        loss or the outputs, but nothing recorded; the first run already checked them."""
        y = self.flat_parameters.run(params, inputs)
        if not self.is_last:
            return tuple(y)
        assert self.loss_fn is not None
        return self.loss_fn(y, target.value) / target.divisor

    def compute_backward(self, action: Action, reads: Sequence[WeightRead], forward_reads: Sequence[WeightRead],
                         payloads: Sequence[Any]) -> list[Any]:
        t0 = time.perf_counter()
        # The property builds a range; one micro-batch (the usual case) needs no call.
        microbatches = action.microbatches if action.count > 1 else (action.index,)
        self._last_backward_count = len(microbatches)
        rule = self.rule
        outs = []
        # A recomputed segment's transient counts against this stage (on the CPU; CUDA's allocator sees it).
        memory = self.memory
        with memory.backward():
            for k, read, grad_out in zip(microbatches, reads, payloads):
                if memory.enabled:
                    memory.released()  # the action's previous micro-batch, if any, is done
                # Taken out of in_flight once the backward starts changing state (see _committed).
                record = self.in_flight[k]
                graph = rule.graph(self, record, read)
                inputs = graph.inputs
                # The first stage has no upstream neighbour: a user input that requires grad gets nothing. (One
                # input and one output, the usual case, without the comprehensions: this runs once per backward.)
                if self.stage == 0:
                    wanted = []
                elif len(inputs) == 1:
                    x = inputs[0]
                    wanted = [x] if isinstance(x, torch.Tensor) and x.requires_grad else []
                else:
                    wanted = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
                outputs = graph.outputs
                if self.is_last:
                    tensors, grads = [outputs], None
                elif len(outputs) == 1:
                    y = outputs[0]
                    tensors, grads = ([y], [grad_out]) if grad_out is not None and y.requires_grad else ([], [])
                else:
                    pairs = [(y, g) for y, g in zip(outputs, from_payload(grad_out, len(outputs)))
                             if g is not None and y.requires_grad]
                    tensors, grads = [y for y, _ in pairs], [g for _, g in pairs]
                if not (graph.leaves or wanted) or not tensors:  # nothing to differentiate, or no gradient arrived
                    self._committed(k)
                    outs.append(None if self.stage == 0 else as_payload((None,) * len(inputs)))
                    continue
                # Only the action's last micro-batch defers: an earlier one's derived weights (scratch) are
                # overwritten by the next micro-batch's read. Split backwards take one tensor in and one out.
                # A W that follows at once, with no earlier W pending (the gradients then still add in micro-batch
                # order): one full backward costs less than the two passes of a split one.
                at_once = self.weights_at_once and not self._deferred
                defer = self.split_backward or (self.weight_actions and not at_once)
                if (defer and len(wanted) == 1 and len(inputs) == 1
                        and len(tensors) == 1 and graph.leaves and k == microbatches[-1]):
                    self._committed(k, deferred=True)
                    with rule.reading(graph.weights):
                        dx, pending = input_gradient(tensors[0], None if grads is None else grads[0], wanted[0],
                                                     graph.leaves)
                    self._deferred[k] = (pending, graph.weights)
                    outs.append(dx)
                    continue
                # Weight gradients accumulate into the leaves' .grad, the gradient buffer (see weight_leaves); a
                # parameter that takes no part gets nothing added.
                self._committed(k)
                targets = graph.leaves + wanted
                every_leaf = self._every_leaf
                if record.outside_grad:
                    every_leaf = False
                elif every_leaf is None:  # the first backward: does the graph reach other leaves?
                    ours = {id(t) for t in targets}
                    every_leaf = self._every_leaf = all(id(t) in ours for t in leaves_reached(tensors))
                if rule.swaps_weights:
                    with rule.reading(graph.weights):
                        accumulate_backward(tensors, grads, targets, every_leaf)
                else:  # the graph reads its own weights: no context to enter (this runs once per backward)
                    accumulate_backward(tensors, grads, targets, every_leaf)
                if self.stage == 0:
                    outs.append(None)
                elif len(inputs) == 1:  # as_payload of one input's gradient
                    x = inputs[0]
                    outs.append(x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None)
                else:
                    outs.append(tuple(x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None
                                      for x in inputs))
        self._backward_times.add_since(t0)
        return outs

    def _committed(self, k: int, deferred: bool = False) -> None:
        """Micro-batch ``k``'s backward starts adding to the gradient buffer: from here on, a failure cannot be
        undone by putting the micro-batch back. ``deferred``: its weight gradients are left for later."""
        self.mutated = True
        del self.in_flight[k]
        if self.memory.enabled:
            self.memory.backwarded(k, deferred)
        state = self.state
        span = state.grad_span
        if span is None:
            state.grad_span = (k, k)
        elif k > span[1]:  # micro-batches usually come in order: the span grows at its end
            state.grad_span = (span[0], k)
        elif k < span[0]:
            state.grad_span = (k, span[1])

    def finish_backward(self) -> None:
        if self.weight_actions:  # the W actions complete the gradients
            return
        if self._deferred:
            self.compute_weight_gradients()
        if self.ties is not None or self.gradient_sum is not None:  # _gradients_complete's work, if it has any
            self._gradients_complete(self._last_backward_count)

    def _gradients_complete(self, microbatches: int) -> None:
        """``microbatches`` more have all their gradients in the buffer: post the tied ones (a clone, before the
        replicas' sum starts changing the buffer), then start that sum once they complete an update group."""
        if self.ties is not None:
            self.ties.after_backward(microbatches)
        if self.gradient_sum is not None:
            self.gradient_sum.after_backward(self.state.grad, microbatches)

    def compute_weight_gradients(self) -> None:
        if self._deferred and not self.weight_actions:
            (k, deferred), = self._deferred.items()
            del self._deferred[k]
            self._weight_gradients(k, *deferred)

    def compute_weight(self, action: Action) -> None:
        deferred = self._deferred.pop(action.index, None)
        # None: the backward could not split (the first stage sends no input gradient; a stage with several
        # inputs or outputs) and computed its weight gradients itself.
        if deferred is not None:
            self.mutated = True
            self._weight_gradients(action.index, *deferred)
        self._gradients_complete(1)  # this micro-batch's gradients are complete only now

    def _weight_gradients(self, k: int, pending: PendingWeightGradients, weights: torch.Tensor | None) -> None:
        t0 = time.perf_counter()
        with self.rule.reading(weights):
            self._accumulate(weight_gradients(pending, len(self._grad_views)))
        if self.memory.enabled:
            self.memory.weighted(k)  # the graph micro-batch k's B retained goes with its pending gradients
        # The rest of the backward whose input gradient went first: its time adds to that backward's.
        self._backward_times.extend_last(time.perf_counter() - t0)

    def _accumulate(self, grads: Sequence[torch.Tensor | None]) -> None:
        pairs = [(acc, g) for acc, g in zip(self._grad_views, grads) if g is not None]
        if pairs:
            accumulators, new = zip(*pairs)
            torch._foreach_add_(list(accumulators), list(new))  # one call instead of one per parameter

    def update(self, action: Action) -> ActionRecord:
        every = self.algorithm.update_every
        first = (action.index - 1) * every  # the first micro-batch of the group the update applies
        # With tied gradients applied late, a flush ends with an update that applies every pending group, unlike
        # the same update in a running schedule: undoing a mini-batch then undoes that update too (the one before
        # the mini-batch's first), gradients included, so that the drain runs it as a flush would.
        ahead = every if self.ties is not None and self.ties.sync.delay > 0 else 0
        snapshot = None
        for point in self.undo_points:
            if point.snapshot is None and first + ahead >= point.first:
                snapshot = point.snapshot = snapshot or self.state.snapshot(
                    action.index, with_grad=first < point.first,
                    spare=self.snapshot_pool.pop() if self.snapshot_pool else None,
                    ties=None if self.ties is None else self.ties.counts())
        # The scheduled rate first: a schedule that raises leaves the version book untouched.
        if self.lr_schedule is not None:
            self._scheduled_lr = self.lr_schedule.lr(self.book.updates)
        return super().update(action)

    def compute_update(self, action: Action, info: UpdateInfo) -> None:
        t0 = time.perf_counter()
        tied = None
        if self.ties is not None:
            # The other owners' tied gradients first, before anything changes: an update stopped while it waits
            # for them (another rank failed) leaves no trace and can run again.
            applied = self.ties.counts()[1]
            try:
                tied = self.ties.gather(action.index, self.poisoned_groups)
            except BaseException:
                self.mutated = self.ties.counts()[1] != applied  # a group was already summed: it cannot run again
                raise
        self.mutated = True
        if self.gradient_sum is not None:
            self.gradient_sum.finish(self.state.grad)  # the replicas' sum, started when the group's backwards ended
        state = self.state
        ring = state.ring
        state.sync_ring()
        live_slot = ring.live_slot
        w = ring.slot(live_slot)
        # Undo snapshots copy what the slot held before it is written.
        target_slot = slot_for_update(state, self.undo_points, in_place=not info.keeps_previous)
        out = ring.slot(target_slot)
        group = action.index - 1
        if self.clip is not None:
            self.clip.before_ties(self, info.index)
        if tied is not None:
            self.ties.write(tied)
            if self.gradient_sum is not None:
                for view in self.ties.views.values():
                    self.gradient_sum.reduce(view)  # the owners' sum of this replica, summed over the replicas
        if self.clip is not None:
            # Every group, skipped or not: with one process per stage the norms are gathered from every rank.
            self.clip.apply(self, info.index)
        if group in self.poisoned_groups:
            if target_slot != live_slot:
                out.copy_(w)  # skipped update: the new version carries the old weights unchanged
        else:
            if self.lr_schedule is not None:
                state.optimizer.set_lr(self._scheduled_lr)
            state.step(w, out, self._lr_scales(info))
        if target_slot == live_slot:
            ring.advance(info.new_version)
        else:
            ring.publish(target_slot, info.new_version)
        state.clear_gradients()
        state.sync_ring()
        self._bind_module_to_live()
        self._update_times.add_since(t0)

    def next_lr(self) -> float:
        """The learning rate of this stage's next update (before any per-stage scaling)."""
        if self.lr_schedule is not None:
            return self.lr_schedule.lr(self.book.updates)
        return self.optimizer.lr

    def _lr_scales(self, info: UpdateInfo) -> LrScales:
        """The learning-rate scale of each range of the flat buffer (a tied weight's shared by its owners)."""
        if self.ties is None:
            return uniform_scale(self.state.grad.numel(), info.lr_scale)
        return self.ties.lr_scales(self.state.grad, info.lr_scale, lambda owner: self.algorithm.lr_scale(owner, info.index))

    # -- evaluation (Pipeline.predict) -----------------------------------------------------------

    def predict_forward(self, payload: Any) -> Any:
        """Run this stage's module on ``payload`` (what :meth:`compute_forward` takes: the model's inputs at
        stage 0, the previous stage's outputs after it) with the live weights, under ``torch.no_grad()``.
        Returns the payload for the next stage, or at the last stage the model's output as its forward
        returns it (no loss).

        Evaluation only: no weight version is read through the version book, nothing is recorded in flight,
        no time is counted, so the training schedule cannot tell that it ran. Buffers and the random state
        are the caller's to protect (:meth:`Pipeline.predict` gives the forwards copies of the buffers and puts
        the random state back)."""
        values = from_payload(payload, len(self.boundary.inputs))
        if self.stage > 0:
            for value, wants_grad in zip(values, self.boundary.grad_inputs):
                if wants_grad and isinstance(value, torch.Tensor) and value.is_floating_point():
                    self._check_input(value)  # the dtype error training would give, not a matmul's
        with torch.no_grad(), self.autocasting():
            # The newest version (what the next update starts from), whatever stale one a schedule would read.
            y = self._forward_checked(self.weight_views(self.slot_of(self.book.live)), values)
        return y if self.is_last else as_payload(self._stage_outputs(y))

    # -- helpers ---------------------------------------------------------------------------------

    def seconds_per_action(self) -> dict[str, float]:
        """Median seconds of the recent actions of each kind. A median, because a few actions also pay
        one-time costs: torch imports sympy the first time a backward is given output gradients (many times
        an action's usual time), and the garbage collector then walks the new objects once."""
        return {kind: times.median() for kind, times in self._times.items() if times.count}

    @property
    def seconds(self) -> dict[str, float]:
        """Total seconds of the actions of each kind so far (the kinds that ran)."""
        return {kind: times.total for kind, times in self._times.items() if times.count}

    def _check_input(self, x: torch.Tensor) -> None:
        if x.is_floating_point() and x.dtype not in (self.layout.dtype, self.autocast) and self.layout.numel:
            raise ValueError(
                f"stage {self.stage - 1} sends activations of dtype {x.dtype} (shape {tuple(x.shape)}) but stage "
                f"{self.stage} has {self.layout.dtype} weights; give both stages one dtype"
            )

    def _forward_checked(self, params: Sequence[torch.Tensor], inputs: tuple[Any, ...]) -> Any:
        try:
            return self.flat_parameters.run(params, inputs)
        except Exception as exc:
            self._note_module_error(exc, inputs)
            raise

    def _note_module_error(self, exc: Exception, inputs: tuple[Any, ...]) -> None:
        # The module's own error, as itself (a shape mismatch or the user's code), with what it was given.
        source = f"stage {self.stage - 1}'s output" if self.stage > 0 else "the input micro-batch"
        exc.add_note(f"raised by stage {self.stage}'s forward, given {source} {describe(inputs, self.boundary.inputs)}")

    # -- checkpoint ----------------------------------------------------------------------------

    def module_state(self) -> dict[str, torch.Tensor]:
        """This stage's entries of the model's ``state_dict``: live weights and buffers, cloned."""
        params = self.live_parameters()
        state = self.module.state_dict()
        return {key: params[key] if key in params else state[key].detach().clone() for key in self.state_keys}

    def live_parameters(self) -> dict[str, torch.Tensor]:
        return {name: v.detach().clone() for name, v in self.layout.views(self.ring.live).items()}

    def load(self, params: Mapping[str, torch.Tensor], version: int, updates: int,
             optimizer_state: Mapping[str, Any], buffers: Mapping[str, torch.Tensor]) -> None:
        """Start again from a checkpoint: the parameters ``params`` (by name) as weight version ``version`` after
        ``updates`` updates, the optimizer's state and the algorithm's declared buffers (see
        :meth:`StageState.load`)."""
        flat = torch.empty_like(self.state.grad)
        for name, view in self.layout.views(flat).items():
            view.copy_(params[name])
        self.state.load(flat, version, updates, optimizer_state, buffers)
        self.flat_parameters.restable(self.state.storages())
        self.memory.excluded = self.flat_parameters.stable
        if self.ties is not None:
            self.ties.reset()
        self._bind_module_to_live()

    # -- undo (Pipeline recovery; see engine.undo) -----------------------------------------------

    def keep_undo_points(self, kept_firsts: set[int], first: int) -> None:
        """Keep the undo points of the mini-batches starting at ``kept_firsts`` (their snapshots' buffers of the
        others go back to the pool) and add one before micro-batch ``first``."""
        points = [p for p in self.undo_points if p.first in kept_firsts]
        release(self.snapshot_pool, [p for p in self.undo_points if p.first not in kept_firsts], points)
        self.undo_points = points + [UndoPoint.at(self.modules_with_buffers, first, self.book.latest_tag)]

    def drop_undo_points(self) -> None:
        """Forget every undo point (their snapshots' buffers go back to the pool)."""
        release(self.snapshot_pool, self.undo_points)
        self.undo_points = []

    def undo(self, point: UndoPoint) -> None:
        """Take the stage back to ``point``: forget the forwards, backwards and updates of micro-batch
        ``point.first`` and later; earlier micro-batches stay in flight. The stage keeps no undo point after."""
        first, snap, state = point.first, point.snapshot, self.state
        span = state.grad_span
        if snap is None and span is not None and span[1] >= first and span[0] < first:
            raise Unrecoverable(f"stage {self.stage}: its gradient buffer holds micro-batches {span[0]}..{span[1]} of "
                                f"an update group that straddles the failed mini-batch")
        for k in [k for k in self.in_flight if k >= first]:
            del self.in_flight[k]
        self.memory.forget(first)
        self.microbatch_losses.forget(first)
        every = self.algorithm.update_every
        self.poisoned_groups = {g for g in self.poisoned_groups if g * every < first}
        waiting = sum(1 for k in self._deferred if k < first)  # backwarded, their weight gradients still to come
        self._deferred = {k: d for k, d in self._deferred.items() if k < first}
        live, updates = (self.book.live, self.book.updates) if snap is None else (snap.live, snap.updates)
        self.book.discard(first, live, updates, point.latest_tag)
        state.sync_ring()  # unpins the versions only the discarded micro-batches held
        if snap is not None:
            state.restore(snap)
        if self.ties is not None:
            # Every earlier micro-batch had its forward here; those not in flight any more had their backward (and,
            # unless waiting for their W, posted their tied gradients).
            self.ties.undo(first - len(self.in_flight) - waiting, None if snap is None else snap.ties[1])
        if snap is not None and snap.grad is not None:
            state.grad.copy_(snap.grad)
            state.grad_span = snap.grad_span
        elif snap is not None or (span is not None and span[0] >= first):
            state.clear_gradients()
        point.restore_buffers()
        self._bind_module_to_live()
        self.drop_undo_points()

    # -- memory ----------------------------------------------------------------------------------

    def static_bytes(self) -> int:
        """What the stage allocates once: its state (weight ring, gradient and scratch buffers, optimizer state,
        declared buffers) and the copies kept to undo a failed step."""
        snapshots = {id(p.snapshot): p.snapshot for p in self.undo_points if p.snapshot is not None}
        snapshots.update((id(s), s) for s in self.snapshot_pool)
        return storage_bytes([self.state.tensors()] + [snap.tensors() for snap in snapshots.values()])

    def peak_bytes(self) -> int | None:
        """The stage's peak memory (see :func:`pipecore.engine.memory.peak_bytes`)."""
        return peak_bytes(self.device, self.memory, self.static_bytes)

    def grad_view(self, name: str) -> torch.Tensor:
        """The slice of the gradient buffer that holds parameter ``name``'s gradient."""
        return self._grad_views[self.layout.names.index(name)]


