"""The user-facing :class:`Pipeline`: a model split into stages, trained by one algorithm.

In one process the pipeline owns every stage. When a ``torch.distributed`` process group is initialised
(or the ``torchrun`` environment is present) it owns only this rank's stage, and messages travel to the
neighbouring ranks; the executor, the schedule and the stage worker are the same either way.
"""

from __future__ import annotations

import math
import os
import statistics
import time
import warnings
from collections import OrderedDict
from functools import partial
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from ..algorithms import get_algorithm
from ..planning.planner import Plan
from ..runtime.link import PeerError
from ..runtime.choice import IN_TURN, THREADS, ThreadsOrInTurn
from ..runtime.executor import Costs, Executor
from ..runtime.ties import LocalTiedGradients, StagesAsRanks
from ..runtime.threads import StageThreads
from ..runtime.transport import LocalTransport, Transport
from ..runtime.worker import ActionRecord
from ..schedule.ir import Action, B, F, Kind, U
from ..schedule.validate import validate
from ..simulate import simulate
from ..schedule.ties import TieSync, partners_of, smallest_delay
from .flat import FlatLayout
from .graph import CapturedModel, StageGraph, state_aliases, tied_parameters
from .inputs import (Batch, LossTarget, as_model_inputs, as_payload, input_label, loss_divisor, split_batch,
                     to_device)
from .clip import (ClipDependencies, DistributedGlobalNorm, GlobalNorm, GradClip, LocalGlobalNorm, RankGlobalNorm,
                   check_max_norm,
                   flushes_every_minibatch)
from .lr import LrSchedule
from .optim import SGD, build_optimizer, check_optimizer
from ..planning.cuts import stage_starts
from .offload import offload_segments
from .recompute import recompute_segments
from .reshard import canonical_names, has_parameter_names, parameter_states, stage_state, upgrade_format
from .backward_rules import GLOBAL_RANDOM
from .buffers import buffer_copies
from .stage import TensorStage
from .data_parallel import GradientSum, dp_groups, join as join_topology, shard, sum_over
from .threads import calling_thread_threads, check_threads_per_stage, default_threads_per_stage, thread_setup
from .state import Unrecoverable
from .undo import minibatches_in_flight
from .tied import StageTies

_NONFINITE = ("raise", "skip")
# The most receives a process keeps posted on one link: each is a buffer the size of a message, held between
# steps too, so a schedule that sends m activations back to back (GPipe, looped BFS) gets at most this many.
_MOST_RECEIVES_AHEAD = 8
#: The format of :meth:`Pipeline.state_dict`'s ``"pipecore"`` entry: 2 names the parameters each stage's flat
#: buffers hold (format 1, without the names, loads only into the same layout); 3 keeps the buffers an algorithm
#: declares under each stage's ``"buffers"`` (older formats are read through ``reshard.upgrade_format``).
STATE_FORMAT = 3


class CheckpointNote(UserWarning):
    """A checkpoint was loaded into another layout or algorithm and some state was dropped or started at zero."""


class Pipeline:
    """Train ``model`` as ``num_stages`` pipeline stages with a staleness-aware algorithm.

    Args:
        model: any ``nn.Module`` whose forward ``torch.fx`` can capture (an ``nn.Sequential`` or a list of
            modules included). The captured graph is cut into stages of generated code whose inputs and
            outputs are the values that cross each cut. Its parameters become views of the live weights;
            a parameter shared by several stages (tied) is held by each and kept identical; with one process
            per stage, the modules of other stages move to the meta device (this rank holds only its
            stage; see :meth:`full_state_dict`).
        num_stages: number of stages ``P``.
        algorithm: one of :func:`pipecore.algorithm_names` (or an alias such as ``"pipedream-flush"``).
        n_microbatches: micro-batches per mini-batch ``m``; ``step()`` needs a batch of at least ``m`` samples.
        optimizer: ``pipecore.SGD(...)``, ``pipecore.AdamW(...)`` (fused), or a torch optimizer factory.
        lr_scheduler: the learning rate of each stage's updates by that stage's update count ``u`` (from 0):
            a function of ``u`` returning a multiplier of the optimizer's rate (``LambdaLR`` semantics), or a
            factory of a torch ``LRScheduler`` (``lambda opt: CosineAnnealingLR(opt, T_max=1000)``), stepped
            once per update. Per-stage scaling (PipeMare) multiplies it; weight prediction (SpecTrain) uses
            the rate of the stage's next update. Default None: the optimizer's rate (see :meth:`set_lr`).
        loss_fn: ``loss_fn(output, target)`` returning the mean loss of a micro-batch.
        partition: None (balanced by parameter count, cutting only where a module starts) or where stages
            ``1..P-1`` start: compute-node indices of the captured graph (for an ``nn.Sequential``, layer
            indices) or module names such as ``"blocks.3"`` (see :meth:`describe`); or a plan from
            :func:`pipecore.plan`: its cuts, its recomputed node ranges, recomputed in the backward, and on CUDA
            its offloaded node ranges, whose saved activations wait in pinned host memory for the backward.
        on_nonfinite: ``"raise"`` (default: :class:`NonFiniteLoss`, after the mini-batch is undone, see
            :meth:`step`) or ``"skip"`` (drop the update a NaN/inf loss belongs to).
        timeout: seconds a stage waits for a neighbour's message before raising: a rank for another rank, or
            a stage thread for another stage's (``concurrent``).
        split_backward: compute each backward's input gradient first, send it, then compute the weight
            gradients (same values, bit for bit), so the upstream rank waits for less. It pays off when
            the gradient's round trip between ranks is the bottleneck; each split backward costs one more
            ``autograd.grad`` call per parameter group. Default False.
        example_input: optional inputs as :meth:`step` takes them. Forward arguments with a default that
            it does not give are captured as constants (their defaults); with it, every value that crosses
            a cut is checked to be a tensor at construction, and :meth:`describe` shows shapes.
        leaf_modules: module types or names whose forward is not traced (kept as one node): the fallback
            for code ``torch.fx`` cannot capture, such as Python control flow on tensor values.
        devices: one device per stage (``["cuda:0", "cuda:1", ...]``, the same device for every stage, or
            ``"cpu"``); with one process per stage, this rank's entry places its stage. Default: each stage
            stays where the model's parameters are (on NCCL, each rank's ``LOCAL_RANK`` GPU). Activations and
            gradients move between stages' devices with non-blocking copies.
        concurrent: run each stage's actions on its own worker thread (and, on CUDA, its own stream), so
            that stages in one process compute at the same time; each stage keeps the schedule's order, so
            the results are bit-identical to ``concurrent=False`` (one thread running the stages in turn).
            Default None: stage threads in one process with more than one stage, except that with every
            stage on the CPU (and no ``overlap_steps``) the pipeline times its first steps both ways and keeps
            the stage threads only if they save at least 10% of a step's wall time, else runs the stages in
            turn, and times both again after 100 steps, 200 more, and so on (:attr:`execution` says which;
            see ``pipecore/runtime/choice.py``): on the CPU, threads pay only where ops are large enough (each
            torch op hands the GIL to another stage thread and back).
        threads_per_stage: torch intra-op threads a stage computes with: set once on each stage thread when
            it starts (``concurrent``), and on the calling thread around the actions it runs in turn (then
            restored), so that results are the same bits either way. Default None: the process's share,
            ``cores // stages in this process`` (at least 1, at most the caller's ``torch.get_num_threads()``);
            without a share each stage thread would use every core and the stages would oversubscribe the
            machine. In turn, a larger count (up to the cores) lets the one stage running use them all.
        overlap_steps: let the stage threads go on with a mini-batch's remaining work after ``step()`` has
            returned its loss, so that they work while the caller prepares the next mini-batch (``step()``
            returns once the last stage has computed the loss; the stages keep their order, so the results
            are unchanged). Until :meth:`synchronize`, the model's parameters may be mid-update: the
            pipeline's own methods (:meth:`flush`, :meth:`state_dict`, :meth:`stats`, checkpoints, ...)
            synchronize first, but code that reads the parameters directly must call :meth:`synchronize`.
            An error in the remaining work is raised by the next call into the pipeline. Needs stage threads
            (``concurrent`` with more than one stage in this process). Default False.
        clip_grad_norm: clip each update's gradient to this norm (``torch.nn.utils.clip_grad_norm_``'s rule).
            Synchronous algorithms (gpipe, 1f1b) use the global norm over all stages, which equals clipping
            the whole model; asynchronous ones the norm of each stage's own gradient at its update (a tied
            weight's by its own norm). ``stats()[s]["grad_norm"]`` is the norm before clipping. Default None.
        autocast: run every forward (and the loss) under ``torch.autocast`` with this dtype, e.g.
            ``torch.bfloat16``, on each stage's device; weights, gradients and optimizer state keep their
            dtype. Activations that cross a cut may then be in either dtype. The ``swap`` backward rule
            becomes ``recompute`` under autocast (its weight casts are copies a swap cannot replace).
            Default None.
        recover: take a failed step back (see :meth:`step`). It costs, per step and stage, a copy of the
            optimizer state (before the stage's first update of the step), of the buffers, and of the live
            weights unless the ring still holds them when the step completes (algorithms that keep the previous
            version, such as 2bw, mostly skip that copy). False skips the copies; a failed step then leaves the
            pipeline unusable. Default True.
        track_memory: keep each CPU stage's memory account (``stats()[s]["peak_bytes"]``), counted only when
            asked for: it sees the saved tensors through saved-tensor hooks, a Python call per saved tensor in
            every forward and backward (each wrapping the tensor in a new Python object), which with stages on
            threads also waits for the GIL inside the backward; with small stages that made steps 1.14x as long
            (docs/training.md, "What an action costs"). Without it, ``peak_bytes`` of a CPU stage is None.
            CUDA stages need no account (the allocator measures) and never install the hooks. Default False.
        capture: how the forward becomes a graph: ``"fx"`` (``torch.fx`` symbolic tracing: modules stay nodes,
            no example needed), ``"export"`` (``torch.export``, non-strict, with the batch and sequence dimensions
            of ``example_input`` dynamic: captures what fx cannot, such as Hugging Face models and masks built
            from traced lengths; needs ``example_input``) or ``"auto"`` (default: fx, and export where fx cannot
            capture the forward). See docs/models.md, "Two captures".
        data_parallel: under torchrun, ``W`` replicas of the pipeline with ``WORLD_SIZE = W x`` its ranks: process
            ``(i, r)`` (global rank ``i * ranks + r``) runs pipeline rank ``r`` of replica ``i``; each replica
            trains on its ``1/W`` of every mini-batch (see :meth:`step`) and each stage's gradients are summed
            over its replicas before every update, so training equals one process on the global mini-batch.
            Default None: one replica (under torchrun the world size must then be the pipeline's ranks).
        mesh: instead of ``data_parallel``, a ``torch.distributed.device_mesh.DeviceMesh`` with dimensions named
            ``"dp"`` and ``"pp"`` (``init_device_mesh(device, (W, ranks), mesh_dim_names=("dp", "pp"))``): its
            layout places the replicas and ranks.
        **options: algorithm options (``backward_rule``, ``update_every``, ``lam``, ``alpha``, ``stages_per_rank``
            for the interleaved and zero-bubble schedules, ...).

    Each micro-batch loss is divided by the number of micro-batches one update accumulates (``m`` for the
    synchronous algorithms), so the accumulated gradient is the mean over the mini-batch, as in plain
    training with ``loss.mean()``.
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        num_stages: int,
        algorithm: str = "1f1b",
        n_microbatches: int = 4,
        optimizer: Any = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        partition: Sequence[int | str] | Plan | None = None,
        on_nonfinite: str = "raise",
        timeout: float = 30.0,
        split_backward: bool = False,
        example_input: Any = None,
        leaf_modules: Sequence[type | str] = (),
        devices: Sequence[str | torch.device] | str | torch.device | None = None,
        concurrent: bool | None = None,
        overlap_steps: bool = False,
        threads_per_stage: int | None = None,
        lr_scheduler: Callable[..., Any] | None = None,
        clip_grad_norm: float | None = None,
        autocast: torch.dtype | None = None,
        recover: bool = True,
        track_memory: bool = False,
        capture: str = "auto",
        data_parallel: int | None = None,
        mesh: Any = None,
        **options: Any,
    ):
        if concurrent is not None and not isinstance(concurrent, bool):
            raise TypeError(f"concurrent must be True, False or None (the default), got {concurrent!r}")
        if not isinstance(overlap_steps, bool):
            raise TypeError(f"overlap_steps must be True or False, got {overlap_steps!r}")
        if not isinstance(recover, bool):
            raise TypeError(f"recover must be True or False, got {recover!r}")
        threads_per_stage = check_threads_per_stage(threads_per_stage)
        if not isinstance(track_memory, bool):
            raise TypeError(f"track_memory must be True or False, got {track_memory!r}")
        if not isinstance(split_backward, bool):
            raise TypeError(f"split_backward must be True or False, got {split_backward!r}")
        if autocast is not None and not (isinstance(autocast, torch.dtype) and autocast.is_floating_point):
            raise TypeError(f"autocast must be a floating torch dtype such as torch.bfloat16 (or None), got {autocast!r}")
        self.recover = recover
        if on_nonfinite not in _NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {_NONFINITE}, got {on_nonfinite!r}")
        if loss_fn is None:
            raise ValueError("loss_fn is required, e.g. torch.nn.CrossEntropyLoss()")
        if optimizer is not None:
            check_optimizer(optimizer)  # before capture and partitioning, which take a while
        self.algorithm = get_algorithm(algorithm, num_stages, n_microbatches, **options)
        layout_schedule = self.algorithm.schedule(1)
        #: The rank (worker thread, or process) of every stage: several stages share one with ``stages_per_rank``.
        self.placement: tuple[int, ...] = layout_schedule.placement
        self.num_ranks = layout_schedule.num_ranks
        self.model = model
        self.num_stages = num_stages
        self.n_microbatches = n_microbatches
        self.on_nonfinite = on_nonfinite
        self.captured = captured = CapturedModel(model, leaf_modules, example_input, capture)
        graphs = captured.split(stage_starts(captured, num_stages, partition))
        if isinstance(partition, Plan) and any(partition.recomputed):
            self._recompute_planned(partition, graphs)
        self.stage_graphs = graphs
        self.stage_layers = [list(g.modules) for g in graphs]
        # The state_dict keys of every stage, this process's or not (a full state names them all).
        model_keys = set(captured.model.state_dict())
        # A tied weight's other names (aliases) are served from the one name its first stage holds it under.
        self._aliases = state_aliases(graphs, captured.model)
        aliased = {a for names in self._aliases for a in names}
        self._stage_keys = [[k for k in g.module.state_dict() if k in model_keys and k not in aliased] for g in graphs]
        self._boundary_meta = _boundary_meta(captured, graphs, example_input) if example_input is not None else None
        #: Where this process is among the pipeline's replicas and ranks (None: everything in this process).
        self.topology = join_topology(num_stages, self.num_ranks, timeout, data_parallel, mesh)
        #: This process's pipeline rank (None: one process runs every stage); with ``data_parallel``, within its
        #: replica (``replica``).
        self.rank = None if self.topology is None else self.topology.rank
        self.data_parallel = 1 if self.topology is None else self.topology.data_parallel
        self.replica = 0 if self.topology is None else self.topology.replica
        if self.data_parallel > 1:
            # A failed step cannot be taken back on one replica while the others go on: it leaves the pipeline
            # unusable, and the other replicas raise at their next sum over the replicas (see docs/distributed.md).
            self.recover = False
        if self.data_parallel > 1 and on_nonfinite == "skip":
            raise ValueError("on_nonfinite='skip' with data_parallel > 1 is not supported: the replicas would have to "
                             "agree on which updates to skip; use on_nonfinite='raise'")
        owned = (range(num_stages) if self.rank is None
                 else [s for s in range(num_stages) if self.placement[s] == self.rank])
        self.concurrent = (self.rank is None and num_stages > 1) if concurrent is None else concurrent
        self.devices = _stage_devices(devices, graphs, self.rank, self.placement)
        if isinstance(partition, Plan) and any(partition.offloaded):
            self._offload_planned(partition, graphs, owned)
        # The ring of each stage holds exactly the versions the algorithm needs; the simulator says how many.
        sizing = simulate(self.algorithm, num_stages, n_microbatches, n_minibatches=self.algorithm.warmup_minibatches)
        optimizer = optimizer if optimizer is not None else SGD(lr=0.01)
        self._targets: dict[int, LossTarget] = {}
        self._inputs: dict[int, Any] = {}
        self.stages: dict[int, TensorStage] = {}
        for s in owned:
            device = self.devices[s]
            # Each stage gathers its weights right after the move: a tied parameter, moved again by a later
            # stage on another device, has already been copied into this stage's own buffer.
            graphs[s].module.to(device)
            layout = FlatLayout.of(graphs[s].module, s)
            stage_optimizer = build_optimizer(optimizer, layout, device)
            self.stages[s] = TensorStage(
                self.algorithm, s, graphs[s], stage_optimizer,
                sizing.weight_versions(s), sizing.derived_weights(s), loss_fn, self._targets.pop, on_nonfinite,
                device=device, state_keys=self._stage_keys[s], track_memory=track_memory, autocast=autocast,
                split_backward=split_backward and s > 0,  # stage 0 sends no input gradient
                lr_schedule=None if lr_scheduler is None else LrSchedule(lr_scheduler, stage_optimizer.lr),
            )
            # Zero-bubble schedules run each backward's weight gradients as an action of its own (W).
            self.stages[s].weight_actions = layout_schedule.splits_backward(s)
        self.lr_scheduler = lr_scheduler
        if self.rank is not None:
            _release_other_stages(captured.model, [graphs[s].module for s in owned])
        self.ties = tied_parameters(graphs, captured.model)
        self._tie_sync: TieSync | None = None
        self._tie_exchange: Any = None
        if self.ties:
            self._tie_sync = self._tie_stages(timeout)
        self.autocast = autocast
        self.clip_grad_norm = check_max_norm(clip_grad_norm)
        self._global_norm: GlobalNorm | None = None
        if self.clip_grad_norm is not None:
            algorithm = self.algorithm
            if flushes_every_minibatch(algorithm.schedule(2), n_microbatches, algorithm.update_every):
                if self.rank is None:
                    self._global_norm = LocalGlobalNorm(self.stages)
                elif len(self.stages) == 1:
                    self._global_norm = DistributedGlobalNorm(self.rank, self.num_ranks, timeout, *self._grid())
                else:
                    self._global_norm = RankGlobalNorm(self.stages, self.rank, self.num_ranks, timeout, *self._grid())
            for st in self.stages.values():
                st.clip = GradClip(self.clip_grad_norm, self._global_norm)
        self._transport: Transport
        if self.rank is None:
            self._transport = LocalTransport(timeout)
        else:
            from ..runtime.distributed import DistributedTransport
            from ..schedule.links import messages_ahead

            # Receives posted ahead on each link: as many messages as the schedule lets its sender get ahead
            # (two mini-batches show the lead across a step's end), at most _MOST_RECEIVES_AHEAD buffers.
            ahead = {link: min(lead, _MOST_RECEIVES_AHEAD)
                     for link, lead in messages_ahead(self.algorithm.schedule(2)).items()}
            self._transport = DistributedTransport(self.rank, num_stages, timeout, self.devices[owned[0]],
                                                   self.placement, *self._grid(), receives_ahead=ahead)
        # With several replicas: each stage's gradients summed over its replicas before every update.
        self._dp_group: Any = None
        if self.data_parallel > 1:
            assert self.topology is not None
            self._dp_group = dp_groups(self.topology, timeout)
            for st in self.stages.values():
                st.gradient_sum = GradientSum(self._dp_group, self.algorithm.update_every, self.topology.describe())
        # Worker threads, one per rank (a rank runs its stages' actions in one list), kept from step to step
        # (one process, several ranks, concurrent).
        ranks_here = len({self.placement[s] for s in self.stages})
        self.threads_per_stage = (default_threads_per_stage(ranks_here) if threads_per_stage is None
                                  else threads_per_stage)
        self._threads = (StageThreads(thread_setup(self.threads_per_stage))
                         if self.concurrent and ranks_here > 1 else None)
        if overlap_steps and self._threads is None:
            raise ValueError(
                "overlap_steps=True needs a worker thread per stage: concurrent=True with more than one stage in "
                f"this process (this process runs {len(self.stages)} stage(s), concurrent={self.concurrent})"
            )
        self.overlap_steps = overlap_steps
        rank_streams: dict[tuple[int, torch.device], Any] = {}
        # Every stage of this process on the CPU: a message's payload needs no copy and no event (one received
        # from another rank is in a CPU buffer too: the transport's device is this rank's).
        plain = all(st.device.type == "cpu" for st in self.stages.values())
        for s, st in self.stages.items():
            st.plain_messages(plain)
            st.use_stream(self._threads is not None)  # a stream of its own only where it runs on its own thread
            # The stages of one rank on one device compute on one stream, in the rank's order.
            st.stream = rank_streams.setdefault((self.placement[s], st.device), st.stream)
            st.intra_op_threads = self.threads_per_stage
            st.records = False  # nothing here reads the actions' records (the stages tally their reads)
        # The default with every stage on the CPU: stage threads if the first steps time them clearly faster, else
        # in turn, probed again later (see runtime/choice.py); concurrent=True, overlap_steps or a GPU keep the
        # threads.
        self._choice = (ThreadsOrInTurn() if concurrent is None and self._threads is not None and plain
                        and not overlap_steps else None)
        self._closed = False
        self._broken: BaseException | None = None  # the error after which the pipeline could not be taken back
        self._kept = 0  # see minibatches
        self._shared_failure: list[dict[str, Any]] | None = None  # see _confirm_flush
        self._recovering = False
        # Per mini-batch not yet complete on every stage (oldest first): (mini-batch, random state at its step,
        # the tie exchange's epoch then); the stages keep the matching UndoPoints.
        self._undo_steps: list[tuple[int, Any, int]] = []
        self._undo_depth = 0 if self.rank is None else minibatches_in_flight(self.algorithm, self._needs(
            None if self._tie_sync is None else self._tie_sync.needs))
        self._restart()

    # -- running ---------------------------------------------------------------------------------

    def _restart(self) -> None:
        """Begin a fresh schedule (at construction and after every flush)."""
        for st in self.stages.values():
            st.restart()
            if st.gradient_sum is not None:
                st.gradient_sum.restart()
            st.drop_undo_points()
        self._undo_steps = []
        self._fed = 0  # mini-batches given since the schedule started
        self._minibatch_loss: dict[int, float] = {}
        # Last stage: per mini-batch whose micro-batches differ (or with several replicas), the micro-batch sizes and
        # the samples of the (global) mini-batch.
        self._microbatch_sizes: dict[int, tuple[list[int], int]] = {}
        self._horizon = 2
        schedule = validate(self.algorithm.schedule(self._horizon))
        sync = self._tie_sync
        for st in self.stages.values():
            if st.ties is not None and sync is not None:
                st.ties.restart(sync)
        self._executor = Executor(
            schedule, self.stages, Costs.uniform(self.num_stages), transport=self._transport,
            source=self._inputs.pop, keep_events=False, on_record=self._observe,
            recorded_stages=frozenset({self.num_stages - 1}),  # _observe looks at the last stage's forwards
            needs=self._needs(None if sync is None else sync.needs), threads=self._threads,
            calling_thread=partial(calling_thread_threads, self.threads_per_stage),
        )

    def _recompute_planned(self, plan: Plan, graphs: Sequence[StageGraph]) -> None:
        """Make the plan's recomputed node ranges segments that the stages recompute in the backward."""
        rule = self.algorithm.backward_rule
        if rule != "stash":
            raise ValueError(f"the plan recomputes segments of stages, which needs the 'stash' backward rule (the "
                             f"segment is recomputed with the weights its forward read); {self.algorithm.name} uses "
                             f"{rule!r}: pass backward_rule='stash', or plan without recomputation")
        names = [node.name for node in self.captured.nodes]
        for s, segments in enumerate(plan.recomputed):
            if segments:
                recompute_segments(graphs[s].module, [names[i:j] for i, j in segments])

    def _offload_planned(self, plan: Plan, graphs: Sequence[StageGraph], owned: Iterable[int]) -> None:
        """Make the plan's offloaded node ranges segments whose saved activations wait in pinned host memory."""
        if self.algorithm.backward_rule == "recompute":
            raise ValueError(f"the plan offloads segments of stages, but {self.algorithm.name} uses the 'recompute' "
                             "backward rule: its forwards save nothing to offload; plan without offload, or pass "
                             "backward_rule='stash' or 'swap'")
        _check_offload_devices(plan, self.devices, owned)
        names = [node.name for node in self.captured.nodes]
        for s, segments in enumerate(plan.offloaded):
            if segments:
                offload_segments(graphs[s].module, [names[i:j] for i, j in segments])

    def _needs(self, ties: Callable[[Action], Sequence[tuple[int, Kind, int]]] | None
               ) -> Callable[[Action], Sequence[tuple[int, Kind, int]]] | None:
        """What an action waits for besides its message: tied weights' partners, and with a global gradient
        norm in one process, every stage's last backward of the group an update applies."""
        if isinstance(self._global_norm, LocalGlobalNorm):
            return ClipDependencies(self.num_stages, self.algorithm.update_every, ties,
                                    weight_actions=self.algorithm.schedule(1).splits_backward(0))
        return ties

    def _tie_stages(self, timeout: float) -> TieSync:
        """Give every owner of a tied weight its share of the gradient exchange; the tied gradients are
        applied with the smallest delay that keeps the schedule running (0 for synchronous schedules)."""
        from ..runtime.ties import DistributedTiedGradients

        owners = {name: tuple(s for s, _ in held) for name, held in self.ties.items()}
        partners = partners_of(list(owners.values()))
        split = self.algorithm.schedule(1).splits_backward(0)
        sync = TieSync(partners, self.algorithm.update_every, smallest_delay(self.algorithm, partners),
                       weight_actions=split)
        # Per owned stage, the slices of its gradient buffer that hold its tied weights' gradients.
        views = {s: {name: st.grad_view(local) for name, held in self.ties.items() for owner, local in held if owner == s}
                 for s, st in self.stages.items()}
        if self.rank is None or all(len({self.placement[o] for o in group}) == 1 for group in owners.values()):
            exchange: Any = LocalTiedGradients(owners)  # every tie's owners are in this process
        elif all(len({self.placement[o] for o in group}) == len(group) for group in owners.values()):
            # Each owner on a rank of its own: the exchange between ranks, its owners named by their ranks.
            mine = [s for s in self.stages if views[s]]
            shapes = {name: (view.shape, view.dtype) for s in mine for name, view in views[s].items()}
            exchange = DistributedTiedGradients(
                {name: tuple(self.placement[o] for o in group) for name, group in owners.items()}, self.rank, timeout,
                self.devices[mine[0]] if mine else self.devices[next(iter(self.stages))], shapes,
                *self._grid())
            if self.num_ranks != self.num_stages:
                exchange = StagesAsRanks(exchange, self.placement)
        else:
            raise ValueError(
                "with several stages per rank, each tied weight must have its owners all on one rank or each on a "
                f"rank of its own; here {', '.join(f'{n!r} is held by stages {g}' for n, g in owners.items())} on "
                f"ranks {[self.placement[o] for g in owners.values() for o in g]} (move the cuts, or use a V "
                "placement, zb-v or dualpipe-v, which puts the first and last stage on one rank)")
        self._tie_exchange = exchange
        for s, own in views.items():
            if own:
                self.stages[s].ties = StageTies(s, own, exchange, sync, owners)
        return sync

    @property
    def process_rank(self) -> int | None:
        """This process's global rank under ``torch.distributed`` (``rank`` is its pipeline rank within its
        replica; the two differ with ``data_parallel``), or None in one process."""
        return None if self.topology is None else self.topology.grid[self.replica][self.rank]

    def _grid(self) -> tuple[Any, ...]:
        """``(grid, replica)`` for the exchanges between processes with several replicas; nothing with one."""
        if self.topology is None or self.data_parallel == 1:
            return ()
        return self.topology.grid, self.topology.replica

    def _observe(self, action: Action, record: ActionRecord) -> None:
        """After each action (the executor's ``on_record``): the last stage's forward of a mini-batch's last
        micro-batch completes the mini-batch loss. (What the reads were, the stages tally themselves.)"""
        if action.kind is not F or action.stage != self.num_stages - 1:
            return
        s, m = action.stage, self.n_microbatches
        if (action.index + 1) % m == 0:
            # The last micro-batch of a mini-batch has its loss: the mini-batch loss is known now.
            j = action.index // m
            losses = [self.stages[s].losses.pop(j * m + u) for u in range(m)]
            weights = self._microbatch_sizes.pop(j, None)
            # The mean over the mini-batch's samples: each micro-batch's (mean) loss weighs by its size (with
            # several replicas, this replica's share of the global mean, summed over the replicas).
            if weights is None:
                self._minibatch_loss[j] = statistics.fmean(losses)
            else:
                sizes, samples = weights
                self._minibatch_loss[j] = math.fsum(n * loss for n, loss in zip(sizes, losses)) / samples
                if self.data_parallel > 1:
                    self._minibatch_loss[j] = sum_over(self._dp_group, [self._minibatch_loss[j]], self.devices[s],
                                                       f"the loss of mini-batch {j}")[0]
            if self.rank is not None:
                self._transport.publish_loss(j, self._minibatch_loss[j])

    def _owns(self, stage: int) -> bool:
        return stage in self.stages

    def step(self, x: Batch | None, y: Batch | None, *, local: bool = False) -> float:
        """Train on one mini-batch; returns its mean loss (the mean over its samples).

        ``x`` holds the model's inputs: a tensor (a forward with one input), a tuple (positional) or a dict
        (by argument name) of tensors, or, for a forward that takes one dict (or dataclass) of tensors, that
        dict; ``y`` is the target as ``loss_fn`` takes it (a tensor, tuple or dict of tensors). Every tensor is
        split into ``n_microbatches`` along dimension 0 as ``torch.tensor_split`` splits it: any batch of at
        least ``n_microbatches`` samples, in micro-batches whose sizes differ by at most one. Each micro-batch's
        (mean-reduced) loss is weighted by its size, so the step's gradient is the one of the mean loss over
        the mini-batch, as in plain training (see docs/training.md, "Batches and inputs"). In a multi-process run only
        the first stage reads ``x`` and only the last reads ``y`` (others may pass None); every rank gets the
        mini-batch loss. Asynchronous algorithms leave later micro-batches' backwards in flight;
        :meth:`flush` drains them.

        With ``data_parallel``, ``x`` and ``y`` are the global mini-batch (on the ranks that run the first and the
        last stage) and each replica takes its part ``i`` of ``torch.tensor_split(batch, W)``; with ``local=True``
        they are this replica's own shard (the global sample count, which the losses are divided by, is then
        summed over the replicas). Either way the returned loss is the global mini-batch's.

        If it raises (a non-finite loss, an error in ``loss_fn`` or a module, ``KeyboardInterrupt``), the
        failed mini-batch (and any given after it) is first undone on every stage and the earlier ones
        complete, as :meth:`flush` would have done in its place; a note on the exception says which were
        dropped, and training can continue (one process; see docs/training.md, "When a step fails").
        """
        self._check_open("step")
        if not isinstance(local, bool):
            raise TypeError(f"step(): local must be True or False, got {local!r}")
        m = self.n_microbatches
        first_stage, last_stage = self._owns(0), self._owns(self.num_stages - 1)
        for name, value, required in [("x", x, first_stage), ("y", y, last_stage)]:
            if required and value is None:
                raise TypeError(f"step(): {name} is required on the rank that runs "
                                f"{'the first' if name == 'x' else 'the last'} stage, got None")
        inputs = as_model_inputs(x, self.captured) if first_stage else None
        global_samples = None  # with several replicas: the global mini-batch's samples (the losses' divisor)
        if self.data_parallel > 1:
            assert self.topology is not None
            if not local:  # the global mini-batch: this replica's share of it
                global_samples = _samples(y) if last_stage else None
                inputs = shard(inputs, self.topology) if inputs is not None else None
                y = shard(y, self.topology) if last_stage else None
            elif last_stage:  # this replica's own shard: the global count is the sum over the replicas
                global_samples = int(sum_over(self._dp_group, [_samples(y)], self.devices[self.num_stages - 1],
                                              "the mini-batch's sample count")[0])
        x_chunks = split_batch(dict(zip(self.captured.input_names, inputs)), m, "x") if inputs is not None else None
        y_chunks = split_batch(y, m, "y") if last_stage else None
        if x_chunks is not None and y_chunks is not None and x_chunks.samples != y_chunks.samples:
            raise ValueError(f"input batch has {x_chunks.samples} samples but target batch has {y_chunks.samples}")
        first = self._fed * m
        if x_chunks is not None:
            device = self.devices[0]
            for u, chunk in enumerate(x_chunks.chunks):
                self._inputs[first + u] = as_payload(tuple(t.to(device) for t in chunk))
        if y_chunks is not None:
            device = self.devices[self.num_stages - 1]
            sizes, every = y_chunks.sizes, self.algorithm.update_every
            samples = y_chunks.samples if global_samples is None else global_samples
            for u, chunk in enumerate(y_chunks.chunks):
                divisor = loss_divisor(sizes[u], samples, m, every)
                self._targets[first + u] = LossTarget(to_device(y_chunks.rebuild(chunk), device), divisor)
            # (set or cleared: a step that failed before it ran may have left this mini-batch's entry)
            if global_samples is not None:
                self._microbatch_sizes[self._fed] = (sizes, global_samples)
            elif len(set(sizes)) > 1:
                self._microbatch_sizes[self._fed] = (sizes, sum(sizes))
            else:
                self._microbatch_sizes.pop(self._fed, None)
        minibatch = self._fed
        self._guarded(self._executor.check)  # an error left by the previous step's remaining work (overlap_steps)
        self._keep_undo_points(minibatch)
        self._fed += 1
        self._kept += 1
        if self.rank is not None and not last_stage:
            self._transport.expect_loss()
        if self._fed + 1 > self._horizon:
            # Regenerate further ahead, doubling, so regeneration costs stay linear in the number of steps.
            self._horizon = max(2 * self._horizon, self._fed + 1)
            self._executor.extend(self.algorithm.schedule(self._horizon))
        # With overlap_steps, return once the last stage has the loss (its last forward of this mini-batch);
        # not under a profiler, whose session must not end while stage threads still record into it.
        overlap = self.overlap_steps and not torch.autograd._profiler_enabled()
        until = (self.num_stages - 1, F, self._fed * m - 1) if overlap else None
        choice = self._choice
        if choice is None:
            self._guarded(lambda: self._executor.run(available=self._fed * m, until=until))
        else:  # steps end settled here (no overlap_steps): the threads are idle, either way can run next
            way = choice.next()
            self._executor.threads = self._threads if way == THREADS else None
            started = time.perf_counter()
            self._guarded(lambda: self._executor.run(available=self._fed * m, until=until))
            choice.record(way, time.perf_counter() - started)
        if not last_stage:
            return self._receive_loss(minibatch)
        loss = self._minibatch_loss.pop(minibatch)
        if until is not None and not math.isfinite(loss) and self.on_nonfinite == "raise":
            self.synchronize()  # the stage reading it raises NonFiniteLoss: from this step, as without overlap
        return loss

    @property
    def execution(self) -> str:
        """How steps run in this process: ``"stage threads"`` (a thread per stage), ``"in turn"`` (the stages one
        after the other on the calling thread), or ``"measuring"`` while a pipeline with the default
        ``concurrent`` and every stage on the CPU times steps both ways: over its first steps (it then keeps the
        stage threads only if they save at least 10% of a step's wall time), and again after 100 steps, 200
        more, and so on (see ``pipecore/runtime/choice.py``)."""
        if self._choice is not None:
            return self._choice.state
        return THREADS if self._threads is not None else IN_TURN

    @property
    def minibatches(self) -> int:
        """Mini-batches given by :meth:`step` since the pipeline was built, less those a failure undid (see
        :meth:`step`). A loop that gives ``data[pipe.minibatches]`` at each step resumes where a failure struck,
        giving the undone mini-batches again; with one process per stage it keeps every rank's data in step,
        whichever call raised on each rank."""
        return self._kept

    def set_lr(self, lr: float) -> None:
        """Use learning rate ``lr`` for every stage's updates from now on (each stage's next update; with
        ``overlap_steps``, after the work already given). Checkpoints keep it. Not with ``lr_scheduler``,
        which sets the rate of every update itself."""
        if self.lr_scheduler is not None:
            raise RuntimeError("set_lr(): this pipeline has an lr_scheduler, which sets the learning rate of every "
                               "update; use one or the other")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise ValueError(f"set_lr(): the learning rate must be a finite number >= 0, got {lr!r}")
        self.synchronize()
        for st in self.stages.values():
            st.optimizer.set_lr(float(lr))

    def synchronize(self) -> None:
        """Wait until the stage threads have run all the work given so far (with ``overlap_steps``, a step's
        remaining backwards and updates), and raise the first error they met (after taking the pipeline back
        as a failed step does). Afterwards the model's parameters hold the live weights. Does nothing without
        ``overlap_steps``: every call returns settled."""
        self._guarded(self._executor.settle)

    def flush(self) -> None:
        """Run every in-flight backward and update; afterwards no micro-batch is in flight on any rank."""
        self._check_open("flush")
        if self._fed == 0:
            return
        self.synchronize()  # the drain below changes the tied weights' sync, which stage threads read
        self._guarded(self._drain)

    # -- errors ----------------------------------------------------------------------------------

    def _keep_undo_points(self, minibatch: int) -> None:
        """Before a step gives ``minibatch``: what each stage needs to go back to if it fails (and forget what
        was kept for the mini-batches complete on every stage, which no error can reach any more)."""
        if not self.recover:
            return
        m, every = self.n_microbatches, self.algorithm.update_every
        while self._undo_steps:
            j = self._undo_steps[0][0]
            if self.rank is not None:
                # This rank cannot see the others' progress: keep the mini-batches that may still be in flight.
                if j >= minibatch - self._undo_depth:
                    break
            else:
                # Complete once every stage has applied the update of its last group (after all its backwards).
                last_update = (j + 1) * m // every
                if any(st.book.live - st.book.base < last_update for st in self.stages.values()):
                    break
            self._undo_steps.pop(0)
        epoch = 0
        if self._tie_exchange is not None:
            oldest = self._undo_steps[0][2] if self._undo_steps else None
            epoch = self._tie_exchange.new_epoch(forget_before=oldest)
        cuda = sorted({st.device.index or 0 for st in self.stages.values() if st.device.type == "cuda"})
        with GLOBAL_RANDOM:  # not halfway through a recomputation's replay of a forward's random state
            random = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in cuda], cuda)
        self._undo_steps.append((minibatch, random, epoch))
        kept = {j * m for j, _, _ in self._undo_steps}
        for st in self.stages.values():
            st.keep_undo_points(kept, minibatch * m)

    def _receive_loss(self, minibatch: int) -> float:
        """The loss the last rank published; a failure it reports instead is taken back like one of this rank."""
        try:
            return self._transport.receive_loss(minibatch)
        except PeerError as exc:
            if exc.cause is not None and self._broken is None and not self._recovering:
                self._executor.failure = exc
                self._recover(exc)
            raise

    def _guarded(self, work: Callable[[], None]) -> None:
        """Run executor work; if it fails, take the pipeline back before the newest mini-batch (see
        :meth:`_recover`) and raise the error."""
        try:
            work()
        except BaseException as exc:
            if self._executor.failure is not None and self._broken is None and not self._recovering:
                self._recover(exc)
            raise

    def _recover(self, exc: BaseException) -> None:
        """After ``exc`` stopped a step or a flush: undo the mini-batch of the failed action (the newest one if
        the failed actions left no trace; they run again) and every later one, on every stage, and complete the
        earlier ones, as :meth:`flush` would have done in place of the failed mini-batch. If that is impossible,
        the pipeline refuses to go on. Either way a note on ``exc`` says what happened."""
        m, every = self.n_microbatches, self.algorithm.update_every

        def minibatch(action: Action) -> int:
            return ((action.index - 1) * every if action.kind is U else action.index) // m

        newest = self._fed - 1
        failed = min([minibatch(a) for a, clean in self._executor.failed_actions if not clean] + [newest])
        self._recovering = True
        try:
            if not self.recover:
                if self.rank is not None:
                    self._report_failure(exc)  # the other ranks still learn the cause
                raise Unrecoverable("the pipeline was built with recover=False")
            counts = None
            if self.rank is not None:
                failed, counts = self._agree_on_failure(exc, failed)
            first = failed * m
            step = next((entry for entry in self._undo_steps if entry[0] == failed), None)
            if step is None:
                raise Unrecoverable(f"the pipeline kept nothing to go back to before mini-batch {failed}")
            undone_from = self._undo_stages(failed)

            def kept(action: Action) -> bool:
                return minibatch(action) < failed and not (
                    action.kind is U and action.index >= undone_from.get(action.stage, action.index + 1))

            if self._global_norm is not None:  # its norms are kept by the stages' update counts
                self._global_norm.discard(min(st.book.updates for st in self.stages.values()))
            if counts is not None:
                self._resync_exchanges(counts, first)
            if failed > 0:
                self._executor.recover(self.algorithm.schedule(failed), keep=kept,
                                       drop_message=lambda stage, kind, k: k >= first)
            else:
                self._transport.resume()
                self._transport.drop(lambda stage, kind, k: True)
            self._forget_minibatches(failed, newest)
            cpu, cuda_states, cuda = step[1]
            torch.set_rng_state(cpu)
            for d, state in zip(cuda, cuda_states):
                torch.cuda.set_rng_state(state, d)
            self._drain()
        except BaseException as err:
            self._broken = exc
            self._executor.failure = exc
            exc.add_note(f"pipecore could not take the pipeline back to before mini-batch {failed} since the last "
                         f"flush ({type(err).__name__}: {err}); it cannot continue. Build a new Pipeline (and load a "
                         "checkpoint)")
        else:
            dropped = f"mini-batch {failed}" if failed == newest else f"mini-batches {failed}..{newest}"
            exc.add_note(f"pipecore took the pipeline back: {dropped} since the last flush "
                         f"{'was' if failed == newest else 'were'} dropped (updates undone) and the earlier ones "
                         "completed, as flush() would have done in place of the first dropped; training can continue")
        finally:
            self._recovering = False

    def _undo_stages(self, failed: int) -> dict[int, int]:
        """Take every stage back to before mini-batch ``failed``; return, per stage that undid updates, the
        first update undone."""
        first = failed * self.n_microbatches
        undone_from: dict[int, int] = {}
        for st in self.stages.values():
            point = next((p for p in st.undo_points if p.first == first), None)
            if point is None:
                raise Unrecoverable(f"stage {st.stage} kept nothing to go back to before mini-batch {failed}")
            if point.snapshot is not None:
                undone_from[st.stage] = point.snapshot.update
            st.undo(point)
        return undone_from

    def _resync_exchanges(self, counts: dict[str, list[Any]], first: int) -> None:
        """With one process per stage: bring the links and the side exchanges back in step with the other
        ranks (``counts``: what every rank sent), keeping what belongs to micro-batches before ``first``."""
        self._transport.resync(counts["sent"], keep=lambda kind, k: k < first)
        if "ties" in counts:
            # The tied gradients' streams likewise: groups before micro-batch `first` wait for their reduce,
            # later ones were withdrawn (every owner numbers the groups alike; a rank owning no tie has none).
            ties = next((st.ties for st in self.stages.values() if st.ties is not None), None)
            self._tie_exchange.resync(counts["ties"], 0 if ties is None else ties.group_of(first))
        if "norms" in counts:
            self._global_norm.resync(counts["norms"])  # all of a synchronous schedule's undone updates

    def _forget_minibatches(self, failed: int, newest: int) -> None:
        """Drop the inputs, targets and losses of mini-batches ``failed..newest``: they were never given."""
        first = failed * self.n_microbatches
        for table in (self._inputs, self._targets):
            for k in [k for k in table if k >= first]:
                del table[k]
        for table in (self._minibatch_loss, self._microbatch_sizes):
            for j in [j for j in table if j >= failed]:
                del table[j]
        self._kept -= newest - failed + 1
        self._fed = failed

    def _side_exchanges(self) -> dict[str, Any]:
        """With one process per stage, the exchanges besides the links that a failure must bring back in step:
        the tied gradients' and the global gradient norm's."""
        side: dict[str, Any] = {}
        if self._tie_exchange is not None and not isinstance(self._tie_exchange, LocalTiedGradients):
            side["ties"] = self._tie_exchange  # (a rank's own ties, all owners here, need no bringing back)
        if isinstance(self._global_norm, DistributedGlobalNorm):
            side["norms"] = self._global_norm
        return side

    def _agree_on_failure(self, exc: BaseException, failed: int) -> tuple[int, dict[str, list[Any]]]:
        """With one process per stage: report the failure to the other ranks, then agree with them (every rank
        gets here, having raised) on the first mini-batch to undo, and learn what each rank has sent on its
        links (``counts["sent"]``) and on the other exchanges (:meth:`_side_exchanges`), in rank order."""
        side = self._side_exchanges()
        shared, self._shared_failure = self._shared_failure, None
        if shared is None:  # (else this rank learnt of the failure from the exchange that ends a flush: all know)
            # Notices first: the counts shared next include them, so that every rank takes them off its streams.
            cause = self._report_failure(exc)
            if isinstance(exc, PeerError) and exc.cause is None:
                raise Unrecoverable("a rank died or stopped answering")
            entry = {"failed": failed, "cause": cause, "sent": self._transport.sent_counts(),
                     **{key: exchange.sent_counts() for key, exchange in side.items()}}
            shared = self._transport.share(entry)
        counts = {"sent": [e["sent"] for e in shared]}
        for key, exchange in side.items():
            got = [e.get(key) for e in shared]
            if None in got:
                # The exchange that ends a flush does not carry them: every rank sees the same entries, so every
                # rank shares them now.
                got = self._transport.share(exchange.sent_counts())
            counts[key] = got
        return min(e["failed"] for e in shared if e["failed"] is not None), counts

    def _confirm_flush(self) -> None:
        """With one process per stage, the end of a flush: the ranks tell each other whether they got there. A
        rank may fail after the others have finished their share of the flush; then they take the pipeline back
        with it (each learns here what failed, and takes the shared counts along)."""
        shared = self._transport.share({"failed": None, "cause": None, "sent": self._transport.sent_counts()})
        failures = [(r, e) for r, e in enumerate(shared) if e["failed"] is not None]
        if failures:
            r, entry = failures[0]
            self._shared_failure = shared
            exc = PeerError.reported(self.rank, r, entry["cause"])
            self._executor.failure = exc
            raise exc

    def _report_failure(self, exc: BaseException) -> str:
        """With one process per stage: tell the other ranks what stopped this one (or pass on what a neighbour
        reported), so that each raises with the cause rather than waiting for its timeout."""
        cause = getattr(exc, "cause", None)
        if cause is None:
            actions = [a for a, _ in self._executor.failed_actions if a.stage in self.stages]
            stage = actions[0].stage if actions else min(self.stages)
            where = f"stage {stage} (rank {self.rank})" + (f", action {actions[0]}" if actions else "")
            detail = str(exc).splitlines()[0] if str(exc) else ""
            cause = f"{type(exc).__name__} at {where}" + (f": {detail}" if detail else "")
        self._transport.notify_failure(cause)
        for exchange in self._side_exchanges().values():
            exchange.notify_failure(cause)  # a rank waiting for a tied gradient or a norm learns it at once too
        return cause

    def _drain(self) -> None:
        """Run every in-flight backward and update, then begin a fresh schedule (the work of :meth:`flush`)."""
        if self._fed == 0:
            self._restart()
            return
        drained = self.algorithm.schedule(self._fed)
        if self._tie_sync is not None:
            # The last update of each owner applies every tied gradient still pending.
            draining = self._tie_sync.draining(drained)
            self._executor.needs = self._needs(draining.needs)
            for st in self.stages.values():
                if st.ties is not None:
                    st.ties.sync = draining
        self._executor.extend(drained)
        self._executor.run()
        if self.rank is not None:
            self._transport.wait_sends()
            if self._tie_exchange is not None:
                self._tie_exchange.wait_sends()
            self._confirm_flush()
        self._restart()

    def close(self) -> None:
        """Flush, then release what the pipeline holds: its stage worker threads (``concurrent``; they also
        end when the pipeline is garbage collected) and, in a multi-process run, its process groups, each
        with a connection and threads (gloo), which otherwise live until the process ends. Every rank calls
        it. Afterwards ``step()`` and ``flush()`` raise; ``state_dict()``, the
        checkpoint functions and ``stats()`` still work. Closing twice does nothing. Leaving a ``with``
        block closes the pipeline; if the block raised, it releases without flushing."""
        if self._closed:
            return
        try:
            self.flush()
        except BaseException:
            self._release(deliver=False)
            raise
        self._release(deliver=True)

    def _release(self, deliver: bool) -> None:
        self._closed = True
        if self._threads is not None:
            self._threads.close()
        if isinstance(self._global_norm, DistributedGlobalNorm):
            self._global_norm.close()
        try:
            if self._tie_exchange is not None:
                self._tie_exchange.close(deliver)
        finally:
            self._transport.close(deliver)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}(): this pipeline was closed; build a new Pipeline to train again")

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        elif not self._closed:
            self._release(deliver=False)  # a failed step cannot be drained; release and let the error out

    @property
    def in_flight(self) -> int:
        """Micro-batches whose backward has not run yet, summed over this process's stages."""
        self.synchronize()
        return sum(st.book.in_flight() for st in self.stages.values())

    # -- evaluation ------------------------------------------------------------------------------

    @property
    def training(self) -> bool:
        """Whether the model is in training mode: set by :meth:`train` and :meth:`eval`; at first, the mode
        of the model given to the pipeline (``model.training``)."""
        return self.captured.model.training

    def train(self, mode: bool = True) -> "Pipeline":
        """Put every stage module this process holds (and the model given to the pipeline) in training mode,
        or with ``mode=False`` in evaluation mode, like ``nn.Module.train``: dropout and BatchNorm in later
        forwards, of :meth:`step` and of :meth:`predict`, follow it (a step in evaluation mode trains with
        BatchNorm's running statistics, as torch does). Returns the pipeline.

        Switch modes between steps. With ``overlap_steps``, this waits for the stage threads first (their
        remaining backwards may still read the mode). Under the ``recompute`` backward rule, a micro-batch in
        flight is recomputed in the mode at its backward: :meth:`flush` first where that matters."""
        if not isinstance(mode, bool):
            raise TypeError(f"train(mode): mode must be True or False, got {mode!r}")
        self.synchronize()
        self.captured.model.train(mode)
        for st in self.stages.values():
            st.module.train(mode)  # a stage may hold private copies of modules (tied weights); set them too
        return self

    def eval(self) -> "Pipeline":
        """Evaluation mode for every stage module this process holds: ``train(False)``. Returns the pipeline."""
        return self.train(False)

    def predict(self, x: Batch | None, *, broadcast: bool = False) -> Any:
        """The model's output on ``x``, computed through the stages: forwards only, under ``torch.no_grad()``,
        with each stage's live weights (its newest version, not a stale one the schedule would read), in the
        current mode (:meth:`eval` for dropout off and BatchNorm's running statistics).

        ``x`` holds the model's inputs as :meth:`step` takes them (a tensor, a tuple or a dict of tensors).
        It is split along dimension 0 into ``n_microbatches`` micro-batches like a step's, except that any
        number of samples is accepted: ``min(n_microbatches, samples)`` micro-batches whose sizes differ by
        at most one (``torch.tensor_split``). Each micro-batch runs through every stage; the last stage's
        outputs are concatenated along dimension 0 in the model's output structure (a tensor, or tuples,
        lists and dicts of tensors). The result is on the last stage's device.

        Nothing of training changes: no backward, update, weight version or statistic; the forwards write
        into copies of the buffers (BatchNorm's running statistics, in training mode), and the random
        generators (dropout) are put back afterwards, so two calls in training mode draw the same dropout
        masks (reseed between them for others). A :meth:`step` after ``predict`` continues exactly, bit for
        bit, as it would have without it, also with micro-batches in flight. With ``overlap_steps`` it first
        waits for the stage threads (:meth:`synchronize`), which may still be updating the weights.

        With one process per stage it is collective: every rank calls it. Rank 0 reads ``x`` (the others may
        pass None; what they pass is ignored); each rank runs its stage on every micro-batch and sends the
        outputs to the next rank, down the links that carry training's activations. The last rank returns
        the result and the others None; with ``broadcast=True`` every rank gets it (sent from the last rank
        through the CPU, returned on each rank's stage device). Every rank must pass the same ``broadcast``;
        a rank that passes the other value follows rank 0's, so that no rank is left waiting, and raises
        ValueError afterwards. A rank that does not take part is reported after the pipeline's ``timeout``."""
        self._check_open("predict")
        if not isinstance(broadcast, bool):
            raise TypeError(f"predict(): broadcast must be True or False, got {broadcast!r}")
        self.synchronize()  # with overlap_steps, the stage threads may still be updating the live weights
        chunks: list[Any] = []
        if self._owns(0):
            if x is None:
                where = "" if self.rank is None else " (the ranks that run other stages may pass None)"
                raise TypeError(f"predict(): x is required on the rank that runs the first stage, got None{where}")
            inputs = as_model_inputs(x, self.captured)
            split = split_batch(dict(zip(self.captured.input_names, inputs)), self.n_microbatches, "x", uneven=True)
            chunks = [to_device(as_payload(chunk), self.devices[0]) for chunk in split.chunks]
        # Forwards in training mode write buffers (BatchNorm's running statistics) and draw random numbers
        # (dropout): the forwards here write into copies of the buffers, and the random state is put back, so
        # that the training that follows sees neither. Copies rather than restoring the buffers in place: the
        # graphs of micro-batches in flight saved some of them (BatchNorm's), and autograd refuses a backward
        # through a tensor modified in place since, even to its old values.
        cuda = sorted({st.device.index or 0 for st in self.stages.values() if st.device.type == "cuda"})
        with buffer_copies([st.module for st in self.stages.values()]), torch.random.fork_rng(devices=cuda):
            if self.rank is None:
                return _concatenate([self._predict_here(payload) for payload in chunks])
            return self._predict_across_ranks(chunks, broadcast)

    def _predict_here(self, payload: Any) -> Any:
        """One micro-batch through every stage, in turn on the calling thread (one process)."""
        for s in range(self.num_stages):
            st = self.stages[s]
            payload = st.predict_forward(to_device(payload, st.device))
        return payload

    def _predict_across_ranks(self, chunks: list[Any], broadcast: bool) -> Any:
        """This rank's share of :meth:`predict` with one process per stage.

        The messages travel through the training transport, on the links that carry activations, between
        steps: by then every activation of the steps so far has been taken (the last stage's loss needs
        them), so the link is empty, and its per-link bookkeeping (sizes, acknowledgements, the receive kept
        posted) stays what the next step expects. Their micro-batch numbers are negative, apart from
        training's; a rank out of step is reported by the transport rather than mixing messages up."""
        from ..runtime.worker import Message

        transport = self._transport
        r, last = self.rank, self.num_stages - 1
        assert r is not None
        last_rank = self.placement[last]
        outputs: list[Any] = []
        shared = broadcast
        # This rank's stages in order (with several per rank, the messages go round the ranks in between).
        for s in sorted(self.stages):
            st = self.stages[s]
            # First, down the same link: how many micro-batches follow and rank 0's `broadcast`, so that every
            # rank knows what to expect and all broadcast alike (none is left waiting by a rank that disagrees).
            if s == 0:
                header = torch.tensor([len(chunks), int(broadcast)], dtype=torch.int64)
            else:
                header = transport.receive(s, F, _PREDICT_HEADER).payload.cpu()
            if s < last:
                transport.send(s + 1, F, _PREDICT_HEADER, Message(header))
            count, shared = int(header[0]), bool(header[1])
            for u in range(count):
                payload = chunks[u] if s == 0 else transport.receive(s, F, _predict_microbatch(u)).payload
                out = st.predict_forward(to_device(payload, st.device))
                if s < last:
                    transport.send(s + 1, F, _predict_microbatch(u), Message(out))
                else:
                    outputs.append(out)
        # Complete the sends now (the next rank takes them in its own predict), rather than holding their
        # buffers until training's next gradient acknowledges them: an evaluation loop would pile them up.
        transport.complete_sends(F)
        result = _concatenate(outputs) if r == last_rank else None
        if shared:
            received = transport.broadcast_object(to_device(result, torch.device("cpu")) if r == last_rank else None,
                                                  last_rank)
            if r != last_rank:
                result = to_device(received, self.devices[min(self.stages)])
        if broadcast != shared:
            raise ValueError(f"predict(): rank {r} passed broadcast={broadcast} but rank 0 passed broadcast={shared}; "
                             f"every rank must pass the same (this rank followed rank 0's)")
        return result

    def state_dict(self) -> dict[str, Any]:
        """This process's stages: the model's ``state_dict`` keys (live weights, buffers) plus ``"pipecore"``
        (versions and optimizer state per stage, and the names and shapes of the parameters each stage's flat
        buffers hold, in order, so that :meth:`load_state_dict` can map it to any other pipeline of the model).
        In one process that is the whole model."""
        if self.in_flight:
            raise RuntimeError(
                f"{self.in_flight} micro-batch backwards are in flight; call flush() before state_dict() so the "
                "checkpoint holds one consistent version per stage"
            )
        state: dict[str, Any] = OrderedDict()
        meta = {}
        for s, st in self.stages.items():
            state.update(st.module_state())
            state.update({alias: state[own].clone() for alias, own in self._aliases[s].items()})
            held = st.state.state_dict()
            meta[s] = {
                "version": held["version"],
                "updates": held["updates"],
                "optimizer": _clone(held["optimizer"]),
                "buffers": _clone(held["buffers"]),
                "lr": held["lr"],
                "params": [[name, list(shape)] for name, shape in zip(st.layout.names, st.layout.shapes)],
            }
        state["pipecore"] = {
            "format": STATE_FORMAT,
            "algorithm": self.algorithm.name,
            "num_stages": self.num_stages,
            "n_microbatches": self.n_microbatches,
            "stage_layers": self.stage_layers,
            "stages": meta,
            "buffer_labels": {b.name: b.label for b in self.algorithm.spec.buffers},
        }
        return state

    def full_state_dict(self) -> dict[str, Any]:
        """Every stage's :meth:`state_dict` in one, on every process, tensors on the CPU: the whole model's
        keys plus ``"pipecore"`` for all stages. In one process that is :meth:`state_dict` on the CPU; with
        one process per stage it is collective (every rank calls it; a rank that does not is reported by
        name after the pipeline's timeout). For evaluating or saving the whole model on one rank; each
        rank's share of it is one stage's weights and optimizer state."""
        return merge_state_dicts(self._gather(_on_cpu(self.state_dict())))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this process's stages from a :meth:`state_dict` that holds them: this process's own, a
        :meth:`full_state_dict`, or a merge of the ranks' (:func:`merge_state_dicts`). Keys of other stages
        are ignored; a missing key of this process's stages, or a key of no stage, is an error.

        The state may come from a pipeline of the same model with another number of stages, another
        partition, another number of micro-batches or another algorithm: weights, buffers and optimizer state
        (momentum, AdamW's moments, a torch optimizer's per-parameter state) are then mapped by parameter name
        (it must then hold every stage that holds a parameter of this process's stages, as a full state does).
        A checkpoint holds the live weights only (flush semantics); the buffers an algorithm declares (PipeMare's
        velocity, weight prediction's update direction) map by name where both keep them, are dropped where this
        pipeline does not keep them and start at zero where the checkpoint does not hold them, each with a
        warning. See docs/training.md, "Universal checkpoints"."""
        self.synchronize()
        if "pipecore" not in state:
            raise KeyError(
                "load_state_dict: the state has no 'pipecore' entry: it is a plain model's state_dict, not a "
                "Pipeline.state_dict(); load it into the model before building the pipeline "
                "(model.load_state_dict(...)), which then starts with a new optimizer state")
        own = {k for s in self.stages for k in self._stage_keys[s]} | {"pipecore"}
        known = {k for keys in self._stage_keys for k in keys} | {"pipecore"} | {a for d in self._aliases for a in d}
        missing, extra = sorted(own - set(state)), sorted(set(state) - known)
        if missing or extra:
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {extra}")
        meta = state["pipecore"]
        version = meta.get("format", 1)
        if version <= STATE_FORMAT:
            meta = upgrade_format(meta)
        if version > STATE_FORMAT:
            raise ValueError(f"load_state_dict: the state is in pipecore state format {version}, newer than this "
                             f"pipecore reads ({STATE_FORMAT}); upgrade pipecore")
        if self.in_flight:
            raise RuntimeError("call flush() before load_state_dict()")
        wrong = [f"{n} {tuple(state[n].shape)} in the checkpoint, {tuple(shape)} here"
                 for st in self.stages.values() for n, shape in zip(st.layout.names, st.layout.shapes)
                 if state[n].shape != shape]
        if wrong:
            raise ValueError(f"load_state_dict: the checkpoint is of another model: shapes differ for {'; '.join(wrong)}")
        if self._same_layout(meta):
            for s, st in self.stages.items():
                sm = meta["stages"][s]
                st.load({n: state[n] for n in st.layout.names}, sm["version"], sm["updates"], sm["optimizer"],
                        sm["buffers"])
                if "lr" in sm and st.lr_schedule is None:  # a scheduler's rate follows from the update count
                    st.optimizer.set_lr(sm["lr"])
        else:
            self._load_by_name(state, meta)
        for st in self.stages.values():
            for name, buf in st.module.named_buffers():
                if name in state:
                    buf.copy_(state[name])
        self._restart()

    def _same_layout(self, meta: dict[str, Any]) -> bool:
        """Whether ``meta`` holds this process's stages with the same flat layouts and the same algorithm, so
        that each stage's state loads as it is (bit for bit, derived state included)."""
        if meta["num_stages"] != self.num_stages or meta["algorithm"] != self.algorithm.name:
            return False
        if any(s not in meta["stages"] for s in self.stages):
            return False
        if not has_parameter_names(meta):  # format 1: the partition identifies the layouts
            return meta.get("stage_layers", self.stage_layers) == self.stage_layers
        return all([n for n, _ in meta["stages"][s]["params"]] == list(st.layout.names)
                   for s, st in self.stages.items())

    def _load_by_name(self, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Load a state saved by another layout (stages, partition, algorithm): each stage's flat buffers are
        assembled from the checkpoint's per-parameter pieces (see :mod:`pipecore.engine.reshard`)."""
        theirs = (meta["algorithm"], meta["num_stages"], meta["n_microbatches"])
        mine = (self.algorithm.name, self.num_stages, self.n_microbatches)
        if not has_parameter_names(meta):
            raise ValueError(
                f"load_state_dict: the state is in pipecore state format {meta.get('format', 1)}, which does not "
                f"name the parameters each stage holds, so it loads only into a pipeline with the same algorithm, "
                f"stages and partition: it is for (algorithm, stages, micro-batches) {theirs} with layers "
                f"{meta.get('stage_layers')}, this pipeline is {mine} with layers {self.stage_layers}")
        canonical = canonical_names(self.captured.model)
        pieces = parameter_states(meta, canonical)
        notes: list[str] = []
        loaded = {}
        for s, st in self.stages.items():
            sizes = [shape.numel() for shape in st.layout.shapes]
            labels = {**meta.get("buffer_labels", {}), **{b.name: b.label for b in self.algorithm.spec.buffers}}
            loaded[s] = stage_state(s, st.layout.names, sizes, canonical, pieces, meta, st.optimizer.state_dict(),
                                    st.state.buffers, labels, st.layout.buffer_numel, notes)
        for s, st in self.stages.items():  # every stage assembled before any changes: an error leaves all as they were
            got = loaded[s]
            st.load({n: state[n] for n in st.layout.names}, got.version, got.updates, got.optimizer, got.buffers)
            if got.lr is not None and st.lr_schedule is None:
                st.optimizer.set_lr(got.lr)
        if notes:
            warnings.warn(f"load_state_dict: checkpoint of {theirs} loaded into {mine} by parameter name; "
                          + "; ".join(notes), CheckpointNote, stacklevel=3)

    def _gather(self, obj: Any) -> list[Any]:
        """``obj`` from every process, in rank order (collective with one process per stage)."""
        if self.rank is None:
            return [obj]
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("the process group was destroyed; with one process per stage, gather state and "
                               "statistics or save checkpoints before torch.distributed.destroy_process_group()")
        return self._transport.share(obj)

    # -- introspection ---------------------------------------------------------------------------

    def stats(self, all_stages: bool = False) -> list[dict[str, Any]]:
        """Per stage of this process (with ``all_stages``, of every stage, in stage order, on every process;
        collective with one process per stage): layers, versions held, bytes of weight versions (and of the
        scratch buffer for derived weights, one weight-sized; ``buffers``: the bytes of each buffer the algorithm
        declares, such as PipeMare's velocity, and ``buffer_bytes`` their sum), staleness
        seen (``staleness``: live minus read version; ``delay``: updates between a forward's read and its
        backward), the learning rate of the stage's next update (``lr``, before per-stage scaling), the peak
        memory measured while training (``peak_bytes``: on CUDA the allocator's peak of the stage's device, on
        the CPU the stage's account of what it allocates and what its micro-batches in flight keep, see
        ``pipecore.engine.memory``, kept with ``track_memory=True``; None without it), and the median seconds of the stage's
        recent actions of each kind."""
        if all_stages:
            return sorted((st for part in self._gather(self.stats()) for st in part), key=lambda st: st["stage"])
        self.synchronize()
        out = []
        for s, st in self.stages.items():
            stale, delay = st.staleness, st.delays
            itemsize = st.grad.element_size()
            out.append({
                "stage": s,
                "layers": self.stage_layers[s],
                "parameters": st.layout.numel,
                "weight_versions": st.ring.num_slots,
                "versions_held": len(st.book.held),
                "weight_version_bytes": st.ring.num_slots * st.layout.numel * itemsize,
                "scratch_bytes": 0 if st.scratch is None else st.layout.numel * itemsize,
                "buffers": (buffers := {name: st.layout.numel * b.element_size() for name, b in st.state.buffers.items()}),
                "buffer_bytes": sum(buffers.values()),
                "live_version": st.book.live,
                "lr": st.next_lr(),
                "grad_norm": None if st.clip is None else st.clip.last_norm,
                "peak_bytes": st.peak_bytes(),
                "staleness_mean": stale.mean,
                "staleness_max": stale.max,
                "delay_mean": delay.mean,
                "delay_max": delay.max,
                "seconds_per_action": st.seconds_per_action(),
            })
        return out

    def describe(self) -> str:
        """Each stage's modules, compute nodes (indices into the captured graph), parameters and the values
        that cross its cuts (with shapes and dtypes when an ``example_input`` was given)."""
        inputs = ", ".join(input_label(self.captured, name) for name in self.captured.input_names)
        lines = [f"Pipeline: {type(self.captured.model).__name__} as {self.num_stages} stages, {self.algorithm.name}, "
                 f"{self.n_microbatches} micro-batches; inputs {inputs}"]
        index = {node.name: i for i, node in enumerate(self.captured.nodes)}
        meta = self._boundary_meta or {}
        for g in self.stage_graphs:
            params = sum(p.numel() for p in g.module.parameters())
            first, last = index[g.nodes[0]], index[g.nodes[-1]]
            lines.append(f"stage {g.index}: nodes {first}-{last} ({len(g.nodes)}), {params:,} parameters")
            outer = [m for m in g.modules if not any(m.startswith(o + ".") for o in g.modules)]
            lines.append(f"  modules: {_abbreviate(outer)}")
            if g.index > 0:
                lines.append("  receives: " + ", ".join(f"{n}{' ' + meta[n] if n in meta else ''}" for n in g.inputs))
            if g.outputs:
                lines.append("  sends:    " + ", ".join(f"{n}{' ' + meta[n] if n in meta else ''}" for n in g.outputs))
        for name, held in self.ties.items():
            lines.append(f"tied: {name} held by stages {', '.join(f'{s} ({local})' for s, local in held)}"
                         + (f"; gradients applied {self._tie_sync.delay} update(s) late" if self._tie_sync and self._tie_sync.delay else ""))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.describe()


def _abbreviate(names: Sequence[str], limit: int = 12) -> str:
    shown = list(names[:limit])
    return ", ".join(shown) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "") if shown else "-"


def merge_state_dicts(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One state dict from :meth:`Pipeline.state_dict` parts that hold different stages (e.g. one per rank):
    the union of their keys, with ``"pipecore"`` holding every part's stages."""
    merged: dict[str, Any] = OrderedDict()
    meta: dict[str, Any] | None = None
    for part in parts:
        merged.update((k, v) for k, v in part.items() if k != "pipecore")
        if meta is None:
            meta = {**part["pipecore"], "stages": {}}
        meta["stages"].update(part["pipecore"]["stages"])
    if meta is None:
        raise ValueError("merge_state_dicts needs at least one state dict")
    meta["stages"] = dict(sorted(meta["stages"].items()))
    merged["pipecore"] = meta
    return merged


def _on_cpu(value: Any) -> Any:
    """``value`` with every tensor in its nested dicts moved to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    return value


# predict()'s messages between ranks: micro-batch numbers below training's (which count up from 0).
_PREDICT_HEADER = -1


def _predict_microbatch(u: int) -> int:
    return -2 - u


def _concatenate(parts: Sequence[Any]) -> Any:
    """The last stage's outputs of the micro-batches, in order, as one output of the same structure: tensors
    concatenated along dimension 0; tuples (named ones too), lists and dicts entry by entry; None and plain
    constants (equal in every part) kept."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise ValueError("predict(): the model's output holds a 0-dimensional tensor, which has no samples to "
                             "concatenate along dimension 0; predict() needs every output tensor to have the "
                             "samples along dimension 0")
        return first if len(parts) == 1 else torch.cat(list(parts))
    if isinstance(first, dict):
        merged = {k: _concatenate([p[k] for p in parts]) for k in first}
        if type(first) is dict:
            return merged
        try:  # a dict of the model's own type, such as a Hugging Face ModelOutput (a dataclass)
            return type(first)(**merged)
        except TypeError:
            return type(first)(merged)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(_concatenate(column) for column in zip(*parts)))
    if isinstance(first, (tuple, list)):
        return type(first)(_concatenate(column) for column in zip(*parts))
    if (first is None or isinstance(first, (bool, int, float, str))) and all(p == first for p in parts):
        return first
    raise TypeError(f"predict(): the model's output holds a {type(first).__name__} ({first!r}) that differs "
                    "between micro-batches; predict() concatenates tensors along dimension 0 and keeps only "
                    "constants that are the same in every micro-batch")


def _release_other_stages(model: nn.Module, own: Sequence[nn.Module]) -> None:
    """With one process per rank, move the parameters and buffers of the other ranks' stages to the meta
    device: each rank then holds only its stages' weights, and running the other modules by mistake fails
    loudly instead of computing with weights that never train. Tensors this rank's stages hold stay."""
    mine = {id(t) for module in own for t in (*module.parameters(), *module.buffers())}
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is None or id(t) in mine or t.device.type == "meta":
                    continue
                if id(t) not in moved:
                    meta = t.detach().to("meta")
                    moved[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
                table[name] = moved[id(t)]


def _boundary_meta(captured: CapturedModel, graphs: Sequence[StageGraph], example_input: Any) -> dict[str, str]:
    """Run the captured graph once on ``example_input`` (no gradients) and describe every value that crosses
    a cut; a value that is not a tensor is an error naming it and the stage that would send it."""
    values = as_model_inputs(example_input, captured)
    recorded: dict[str, Any] = {}

    class _Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            recorded[n.name] = out
            return out

    # The example never trains: buffers updated in place by the run (BatchNorm's statistics) are put back.
    buffers = {id(b): b for b in (*captured.model.buffers(), *captured.gm.buffers())}
    saved = [(b, b.detach().clone()) for b in buffers.values()]
    try:
        with torch.no_grad():
            _Recorder(captured.gm).run(*values)
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)
    meta = {}
    for g in graphs[:-1]:
        for name in g.outputs:
            value = recorded[name]
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"stage {g.index} would send {name!r} to stage {g.index + 1}, but on the example input it is a "
                    f"{type(value).__name__} ({value!r}), not a tensor: only tensors cross a cut. Move the cut "
                    f"(partition=...) so that {name!r} is computed in the stage that uses it"
                )
            meta[name] = f"{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    return meta


def _stage_devices(devices: Any, graphs: Sequence[StageGraph], rank: int | None,
                   placement: Sequence[int]) -> list[torch.device]:
    """The device of every stage: as given (one per stage, one per rank, or one for all), else where each
    stage's parameters are (with one process per stage on NCCL, this rank's ``LOCAL_RANK`` GPU)."""
    P = len(graphs)
    ranks = max(placement) + 1
    if devices is not None and not isinstance(devices, (str, torch.device)) and len(devices) == ranks != P:
        devices = [list(devices)[placement[s]] for s in range(P)]  # one per rank: each stage on its rank's
    if devices is None:
        if rank is not None and torch.distributed.get_backend() == "nccl":
            own = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            return [own if placement[s] == rank else _device_of(g.module) for s, g in enumerate(graphs)]
        return [_device_of(g.module) for g in graphs]
    if isinstance(devices, (str, torch.device)):
        devices = [devices] * P
    devices = list(devices)
    if len(devices) != P:
        per_rank = f", one per rank ({ranks})" if ranks != P else ""
        raise ValueError(f"devices has {len(devices)} entries but there are {P} stages; give one device per "
                         f"stage{per_rank}, or one device for all of them")
    out = []
    for s, spec in enumerate(devices):
        try:
            device = torch.device(spec)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"devices[{s}] = {spec!r} is not a device (e.g. 'cpu', 'cuda:0'): {exc}") from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"devices[{s}] = {spec!r}, but CUDA is not available on this machine")
            count = torch.cuda.device_count()
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            elif device.index >= count:
                raise ValueError(f"devices[{s}] = {spec!r}, but this machine has {count} CUDA device(s)")
        elif device.type != "cpu":
            raise ValueError(f"devices[{s}] = {spec!r}: stages run on 'cpu' or 'cuda' devices")
        out.append(device)
    if rank is not None and torch.distributed.get_backend() == "nccl":
        for s in (s for s in range(P) if placement[s] == rank):
            if out[s].type != "cuda":
                raise ValueError(f"devices[{s}] = {out[s]}: with the NCCL backend every rank's stages are on a GPU")
    return out


def _check_offload_devices(plan: Plan, devices: Sequence[torch.device], owned: Iterable[int]) -> None:
    """Offload moves saved tensors from a CUDA device to pinned host memory: a CPU stage has nowhere to move them."""
    for s in owned:
        if plan.offloaded[s] and devices[s].type != "cuda":
            raise ValueError(f"the plan offloads segments of stage {s}, which runs on {devices[s]}: activation "
                             "offload moves saved tensors from a CUDA device to pinned host memory and does not "
                             "apply on the CPU; plan on the device that trains (a CPU profile never offloads)")


def _device_of(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def _samples(batch: Any) -> int:
    """The samples of a batch: dimension 0 of its (first) tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, dict):
        return _samples(next(iter(batch.values())))
    if isinstance(batch, (tuple, list)) and batch:
        return _samples(batch[0])
    raise TypeError(f"a batch is a tensor, or a tuple or dict of tensors, got {type(batch).__name__}")


def _clone(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
