"""Building a pipeline: capture the model, cut it into stages, place them, and connect them.

Two halves. :func:`prepare` takes :class:`~pipecore.Pipeline`'s arguments, checks them and returns its
:class:`~.parts.Settings` (the algorithm, where the stages run, which run here) and the captured model.
:func:`assemble` returns the :class:`~.parts.Parts` the pipeline holds: the captured graph and its stages, the
devices, the stages this process runs (with their optimizers, ties, clipping and data-parallel sums), the
transport between them, and the threads that run them. A model that only ``torch.export`` can capture, given
no ``example_input``, is assembled at the first step from its first micro-batch (``engine/lazy.py``). What
depends on whether every stage is in this process or only a rank's is asked of the
:class:`~.locality.Locality` chosen here, once.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from ..algorithms import get_algorithm
from ..algorithms.base import Algorithm
from ..planning.planner import Plan
from ..runtime.choice import ThreadsOrInTurn
from ..runtime.threads import StageThreads
from ..schedule.ties import TieSync, partners_of, smallest_delay
from ..simulate import simulate
from .clip import GlobalNorm, GradClip, check_max_norm, flushes_every_minibatch
from .data_parallel import GradientSum, dp_groups, join as join_topology
from .devices import check_offload_devices, stage_devices
from .flat import FlatLayout
from .export_capture import unwrap_compiled
from .graph import CaptureError, CapturedModel, NeedsExample, StageGraph, state_aliases, tied_parameters
from .inputs import LossTarget, as_model_inputs
from .locality import Locality
from .lr import LrSchedule
from .offload import offload_segments
from .one_process import OneProcess
from .optim import SGD, build_optimizer, check_optimizer
from ..planning.cuts import stage_starts
from .parts import Parts, Settings
from .rank_of_group import RankOfGroup
from .recompute import recompute_segments
from .stage import TensorStage
from .threads import check_threads_per_stage, default_threads_per_stage, thread_setup
from .tied import StageTies

_NONFINITE = ("raise", "skip")


def prepare(model: nn.Module | Sequence[nn.Module], num_stages: int, *, algorithm: str, n_microbatches: int,
            optimizer: Any, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
            partition: Sequence[int | str] | Plan | None, on_nonfinite: str, timeout: float, split_backward: bool,
            example_input: Any, leaf_modules: Sequence[type | str],
            devices: Sequence[str | torch.device] | str | torch.device | None, concurrent: bool | None,
            overlap_steps: bool, threads_per_stage: int | None, lr_scheduler: Callable[..., Any] | None,
            clip_grad_norm: float | None, autocast: torch.dtype | None, recover: bool, track_memory: bool,
            capture: str, data_parallel: int | None, mesh: Any, options: dict[str, Any]
            ) -> tuple[Settings, CapturedModel | NeedsExample]:
    """The first half of building a pipeline: its arguments checked, the algorithm and where the stages run, and
    the captured model, or why it can only be captured from an input (:class:`~.graph.NeedsExample`: then the
    pipeline captures it at its first step). :func:`assemble` builds the stages from the graph."""
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
    if on_nonfinite not in _NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {_NONFINITE}, got {on_nonfinite!r}")
    if loss_fn is None:
        raise ValueError("loss_fn is required, e.g. torch.nn.CrossEntropyLoss()")
    if optimizer is not None:
        check_optimizer(optimizer)  # before capture and partitioning, which take a while
    max_norm = check_max_norm(clip_grad_norm)
    chosen = get_algorithm(algorithm, num_stages, n_microbatches, **options)
    layout_schedule = chosen.schedule(1)
    placement, num_ranks = layout_schedule.placement, layout_schedule.num_ranks
    module = unwrap_compiled(model)  # (once: the capture at a first step finds it unwrapped)
    if isinstance(module, (list, tuple, nn.ModuleList)):
        module = nn.Sequential(*module)
    captured: CapturedModel | NeedsExample
    try:
        captured = CapturedModel(module, leaf_modules, example_input, capture)
    except NeedsExample as needs:
        captured = needs
    topology = join_topology(num_stages, num_ranks, timeout, data_parallel, mesh)
    if topology is not None and isinstance(captured, NeedsExample):
        # Every rank must capture the same graph before a message can travel between ranks (the links follow
        # from the stages' devices), and only the first stage's rank will have the first step's input.
        raise CaptureError(
            f"{captured.reason}, and under torchrun the pipeline cannot capture it at the first step() (only the first "
            "stage's rank has that input, and every rank needs the graph): pass example_input=... (a mini-batch as "
            "step() takes it, the same on every rank) to Pipeline(...)") from captured
    locality: Locality = OneProcess(timeout) if topology is None else RankOfGroup(topology, placement, timeout)
    width = 1 if topology is None else topology.data_parallel
    if width > 1:
        # A failed step cannot be taken back on one replica while the others go on: it leaves the pipeline
        # unusable, and the other replicas raise at their next sum over the replicas (see docs/distributed.md).
        recover = False
    if width > 1 and on_nonfinite == "skip":
        raise ValueError("on_nonfinite='skip' with data_parallel > 1 is not supported: the replicas would have to "
                         "agree on which updates to skip; use on_nonfinite='raise'")
    owned = locality.stages_here(num_stages, placement)
    on_threads = locality.concurrent_by_default(num_stages) if concurrent is None else concurrent
    ranks_here = len({placement[s] for s in owned})
    threads_per_stage = default_threads_per_stage(ranks_here) if threads_per_stage is None else threads_per_stage
    if overlap_steps and not (on_threads and ranks_here > 1):
        raise ValueError(
            "overlap_steps=True needs a worker thread per stage: concurrent=True with more than one stage in "
            f"this process (this process runs {len(owned)} stage(s), concurrent={on_threads})"
        )
    settings = Settings(
        model=model, module=module, algorithm=chosen, num_stages=num_stages, n_microbatches=n_microbatches,
        on_nonfinite=on_nonfinite, placement=placement, num_ranks=num_ranks, topology=topology, locality=locality,
        data_parallel=width, replica=0 if topology is None else topology.replica, recover=recover,
        concurrent=on_threads, owned=owned, threads_per_stage=threads_per_stage, overlap_steps=overlap_steps,
        lr_scheduler=lr_scheduler, autocast=autocast, clip_grad_norm=max_norm, optimizer=optimizer, loss_fn=loss_fn,
        partition=partition, leaf_modules=leaf_modules, capture=capture, device_choice=devices,
        concurrent_choice=concurrent, split_backward=split_backward, track_memory=track_memory, timeout=timeout,
    )
    return settings, captured


def assemble(settings: Settings, captured: CapturedModel, example_input: Any) -> Parts:
    """The second half of building a pipeline: cut the captured graph, place the stages, build the ones this
    process runs and connect them (``example_input``, if any, describes the values that cross the cuts)."""
    s_ = settings
    chosen, num_stages, n_microbatches, partition = s_.algorithm, s_.num_stages, s_.n_microbatches, s_.partition
    placement, owned, topology, locality = s_.placement, s_.owned, s_.topology, s_.locality
    graphs = captured.split(stage_starts(captured, num_stages, partition))
    if isinstance(partition, Plan) and any(partition.recomputed):
        _recompute_planned(chosen, captured, partition, graphs)
    model_keys = set(captured.model.state_dict())
    aliases = state_aliases(graphs, captured.model)
    aliased = {a for names in aliases for a in names}
    stage_keys = [[k for k in g.module.state_dict() if k in model_keys and k not in aliased] for g in graphs]
    boundary_meta = _boundary_meta(captured, graphs, example_input) if example_input is not None else None
    stage_device = stage_devices(s_.device_choice, graphs, placement, locality.nccl_rank)
    if isinstance(partition, Plan) and any(partition.offloaded):
        _offload_planned(chosen, captured, partition, graphs, stage_device, owned)
    # The ring of each stage holds exactly the versions the algorithm needs; the simulator says how many.
    sizing = simulate(chosen, num_stages, n_microbatches, n_minibatches=chosen.warmup_minibatches)
    optimizer = s_.optimizer if s_.optimizer is not None else SGD(lr=0.01)
    layout_schedule = chosen.schedule(1)
    targets: dict[int, LossTarget] = {}
    stages: dict[int, TensorStage] = {}
    for s in owned:
        device = stage_device[s]
        # Each stage gathers its weights right after the move: a tied parameter, moved again by a later
        # stage on another device, has already been copied into this stage's own buffer.
        graphs[s].module.to(device)
        layout = FlatLayout.of(graphs[s].module, s)
        stage_optimizer = build_optimizer(optimizer, layout, device)
        stages[s] = TensorStage(
            chosen, s, graphs[s], stage_optimizer,
            sizing.weight_versions(s), sizing.derived_weights(s), s_.loss_fn, targets.pop, s_.on_nonfinite,
            device=device, state_keys=stage_keys[s], track_memory=s_.track_memory, autocast=s_.autocast,
            split_backward=s_.split_backward and s > 0,  # stage 0 sends no input gradient
            # Zero-bubble schedules run each backward's weight gradients as an action of its own (W).
            weight_actions=layout_schedule.splits_backward(s),
            lr_schedule=None if s_.lr_scheduler is None else LrSchedule(s_.lr_scheduler, stage_optimizer.lr),
        )
    locality.release_other_stages(captured.model, [graphs[s].module for s in owned])
    ties = tied_parameters(graphs, captured.model)
    tie_sync, tie_exchange = _tie_stages(chosen, ties, stages, stage_device, locality) if ties else (None, None)
    max_norm = s_.clip_grad_norm
    global_norm: GlobalNorm | None = None
    if max_norm is not None and flushes_every_minibatch(chosen.schedule(2), n_microbatches, chosen.update_every):
        global_norm = locality.build_global_norm(stages)
    transport = locality.build_transport(chosen, stage_device, owned)
    # With several replicas: each stage's gradients summed over its replicas before every update.
    dp_group: Any = None
    if s_.data_parallel > 1:
        assert topology is not None
        dp_group = dp_groups(topology, s_.timeout)
    for st in stages.values():
        st.connect(gradient_sum=None if dp_group is None else GradientSum(dp_group, chosen.update_every,
                                                                          topology.describe()),
                   clip=None if max_norm is None else GradClip(max_norm, global_norm))
    # Worker threads, one per rank (a rank runs its stages' actions in one list), kept from step to step
    # (one process, several ranks, concurrent).
    ranks_here = len({placement[s] for s in stages})
    on_threads = s_.concurrent and ranks_here > 1
    threads = StageThreads(thread_setup(s_.threads_per_stage)) if on_threads else None
    plain = _place_streams(stages, placement, threads is not None, s_.threads_per_stage)
    # The default with every stage on the CPU: stage threads if the first steps time them clearly faster, else
    # in turn, probed again later (see runtime/choice.py); concurrent=True, overlap_steps or a GPU keep the
    # threads.
    choice = (ThreadsOrInTurn() if s_.concurrent_choice is None and threads is not None and plain
              and not s_.overlap_steps else None)
    return Parts(
        **{f.name: getattr(settings, f.name) for f in fields(Settings)}, captured=captured, stage_graphs=graphs,
        stage_layers=[list(g.modules) for g in graphs], stage_keys=stage_keys, aliases=aliases,
        boundary_meta=boundary_meta, devices=stage_device, stages=stages, inputs={}, targets=targets, ties=ties,
        tie_sync=tie_sync, tie_exchange=tie_exchange, global_norm=global_norm, transport=transport,
        dp_group=dp_group, threads=threads, choice=choice,
    )


def _recompute_planned(algorithm: Algorithm, captured: CapturedModel, plan: Plan, graphs: Sequence[StageGraph]) -> None:
    """Make the plan's recomputed node ranges segments that the stages recompute in the backward."""
    rule = algorithm.backward_rule
    if rule != "stash":
        raise ValueError(f"the plan recomputes segments of stages, which needs the 'stash' backward rule (the "
                         f"segment is recomputed with the weights its forward read); {algorithm.name} uses "
                         f"{rule!r}: pass backward_rule='stash', or plan without recomputation")
    names = [node.name for node in captured.nodes]
    for s, segments in enumerate(plan.recomputed):
        if segments:
            recompute_segments(graphs[s].module, [names[i:j] for i, j in segments])


def _offload_planned(algorithm: Algorithm, captured: CapturedModel, plan: Plan, graphs: Sequence[StageGraph],
                     devices: Sequence[torch.device], owned: Iterable[int]) -> None:
    """Make the plan's offloaded node ranges segments whose saved activations wait in pinned host memory."""
    if algorithm.backward_rule == "recompute":
        raise ValueError(f"the plan offloads segments of stages, but {algorithm.name} uses the 'recompute' "
                         "backward rule: its forwards save nothing to offload; plan without offload, or pass "
                         "backward_rule='stash' or 'swap'")
    check_offload_devices(plan, devices, owned)
    names = [node.name for node in captured.nodes]
    for s, segments in enumerate(plan.offloaded):
        if segments:
            offload_segments(graphs[s].module, [names[i:j] for i, j in segments])


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


def _tie_stages(algorithm: Algorithm, ties: dict[str, tuple[tuple[int, str], ...]], stages: dict[int, TensorStage],
                devices: Sequence[torch.device], locality: Locality) -> tuple[TieSync, Any]:
    """Give every owner of a tied weight its share of the gradient exchange; the tied gradients are
    applied with the smallest delay that keeps the schedule running (0 for synchronous schedules)."""
    owners = {name: tuple(s for s, _ in held) for name, held in ties.items()}
    partners = partners_of(list(owners.values()))
    split = algorithm.schedule(1).splits_backward(0)
    sync = TieSync(partners, algorithm.update_every, smallest_delay(algorithm, partners), weight_actions=split)
    # Per owned stage, the slices of its gradient buffer that hold its tied weights' gradients.
    views = {s: {name: st.grad_view(local) for name, held in ties.items() for owner, local in held if owner == s}
             for s, st in stages.items()}
    exchange = locality.build_tie_exchange(owners, views, devices)
    for s, own in views.items():
        if own:
            stages[s].share_ties(StageTies(s, own, exchange, sync, owners))
    return sync, exchange


def _place_streams(stages: dict[int, TensorStage], placement: Sequence[int], on_threads: bool,
                   threads_per_stage: int) -> bool:
    """Set how each stage computes: its stream, its intra-op threads, its messages. Returns whether every stage
    here is on the CPU (then a message's payload needs no copy and no event: one received from another rank is
    in a CPU buffer too, the transport's device being this rank's)."""
    rank_streams: dict[tuple[int, torch.device], Any] = {}
    plain = all(st.device.type == "cpu" for st in stages.values())
    for s, st in stages.items():
        st.plain_messages(plain)
        # A stream of its own only on CUDA where it runs on its own thread; the stages of one rank on one device
        # compute on one stream, in the rank's order.
        key = (placement[s], st.device)
        if key not in rank_streams:
            rank_streams[key] = torch.cuda.Stream(st.device) if on_threads and st.device.type == "cuda" else None
        st.compute_on(rank_streams[key], threads_per_stage)
    return plain
