"""The user-facing :class:`Pipeline`: a model split into stages, trained by one algorithm.

In one process the pipeline owns every stage. When a ``torch.distributed`` process group is initialised
(or the ``torchrun`` environment is present) it owns only this rank's stage, and messages travel to the
neighbouring ranks; the executor, the schedule and the stage worker are the same either way.

The class composes: :mod:`~pipecore.engine.build` makes its parts, :mod:`~pipecore.engine.stepping` runs its
steps, :mod:`~pipecore.engine.recovery` takes failed ones back, :mod:`~pipecore.engine.prediction`,
:mod:`~pipecore.engine.state_io` and :mod:`~pipecore.engine.introspection` do the rest; what differs between
one process and a rank of ``torchrun`` is a :class:`~pipecore.engine.locality.Locality` chosen when it is built.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..planning.planner import Plan
from . import introspection, prediction, state_io
from .build import prepare
from .inputs import Batch
from .lazy import Assembly


class Pipeline(Assembly):
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
            a cut is checked to be a tensor at construction, and :meth:`describe` shows shapes. Without it, a
            model that only ``torch.export`` captures is captured at the first :meth:`step` (or :meth:`predict`)
            from its first micro-batch, with the same result; until then what needs the stages raises, except
            :meth:`load_state_dict` and :meth:`set_lr`, applied after the capture. Under torchrun it needs one.
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
            from traced lengths; from ``example_input``, or at the first step) or ``"auto"`` (default: fx, and
            export where fx cannot capture the forward). See docs/models.md, "Two captures".
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
        settings, captured = prepare(
            model, num_stages, algorithm=algorithm, n_microbatches=n_microbatches, optimizer=optimizer,
            loss_fn=loss_fn, partition=partition, on_nonfinite=on_nonfinite, timeout=timeout,
            split_backward=split_backward, example_input=example_input, leaf_modules=leaf_modules, devices=devices,
            concurrent=concurrent, overlap_steps=overlap_steps, threads_per_stage=threads_per_stage,
            lr_scheduler=lr_scheduler, clip_grad_norm=clip_grad_norm, autocast=autocast, recover=recover,
            track_memory=track_memory, capture=capture, data_parallel=data_parallel, mesh=mesh, options=options)
        self._closed = False
        # The settings as attributes (placement, rank, ...), and the stages: now, or at the first step.
        self._assemble(settings, captured, example_input)

    @property
    def process_rank(self) -> int | None:
        """This process's global rank under ``torch.distributed`` (``rank`` is its pipeline rank within its
        replica; the two differ with ``data_parallel``), or None in one process."""
        return self._settings.locality.process_rank

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
        self._ready("step()", x)
        return self._steps.step(x, y, local, self._recovery)

    @property
    def execution(self) -> str:
        """How steps run in this process: ``"stage threads"`` (a thread per stage), ``"in turn"`` (the stages one
        after the other on the calling thread), or ``"measuring"`` while a pipeline with the default
        ``concurrent`` and every stage on the CPU times steps both ways: over its first steps (it then keeps the
        stage threads only if they save at least 10% of a step's wall time), and again after 100 steps, 200
        more, and so on (see ``pipecore/runtime/choice.py``)."""
        self._ready("Pipeline.execution")
        return self._steps.execution

    @property
    def minibatches(self) -> int:
        """Mini-batches given by :meth:`step` since the pipeline was built, less those a failure undid (see
        :meth:`step`). A loop that gives ``data[pipe.minibatches]`` at each step resumes where a failure struck,
        giving the undone mini-batches again; with one process per stage it keeps every rank's data in step,
        whichever call raised on each rank."""
        return self._steps.kept if self._built() else 0

    def set_lr(self, lr: float) -> None:
        """Use learning rate ``lr`` for every stage's updates from now on (each stage's next update; with
        ``overlap_steps``, after the work already given). Checkpoints keep it. Not with ``lr_scheduler``,
        which sets the rate of every update itself."""
        if self.lr_scheduler is not None:
            raise RuntimeError("set_lr(): this pipeline has an lr_scheduler, which sets the learning rate of every "
                               "update; use one or the other")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise ValueError(f"set_lr(): the learning rate must be a finite number >= 0, got {lr!r}")
        if not self._hold("set_lr", partial(self._set_lr, float(lr))):
            self._set_lr(float(lr))

    def _set_lr(self, lr: float) -> None:
        self.synchronize()
        for st in self.stages.values():
            st.optimizer.set_lr(lr)

    def synchronize(self) -> None:
        """Wait until the stage threads have run all the work given so far (with ``overlap_steps``, a step's
        remaining backwards and updates), and raise the first error they met (after taking the pipeline back
        as a failed step does). Afterwards the model's parameters hold the live weights. Does nothing without
        ``overlap_steps``: every call returns settled."""
        if self._built():
            self._recovery.guarded(self._steps.executor.settle)

    def flush(self) -> None:
        """Run every in-flight backward and update; afterwards no micro-batch is in flight on any rank."""
        self._check_open("flush")
        if not self._built() or self._steps.fed == 0:
            return
        self.synchronize()  # the drain below changes the tied weights' sync, which stage threads read
        self._recovery.guarded(self._recovery.drain)

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
        if self._built():
            self._parts.release(deliver)

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
        return self._steps.in_flight() if self._built() else 0

    @property
    def training(self) -> bool:
        """Whether the model is in training mode: set by :meth:`train` and :meth:`eval`; at first, the mode
        of the model given to the pipeline (``model.training``)."""
        return self._settings.module.training

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
        self._settings.module.train(mode)  # (the stages made at a first step's capture take its mode)
        for st in self.stages.values() if self._built() else ():
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
        self._ready("predict()", x)
        return prediction.predict(self._parts, x, broadcast, self.synchronize)

    def state_dict(self) -> dict[str, Any]:
        """This process's stages: the model's ``state_dict`` keys (live weights, buffers) plus ``"pipecore"``
        (versions and optimizer state per stage, and the names and shapes of the parameters each stage's flat
        buffers hold, in order, so that :meth:`load_state_dict` can map it to any other pipeline of the model).
        In one process that is the whole model."""
        self._ready("state_dict()")
        return state_io.state_dict(self._parts, self.in_flight)

    def full_state_dict(self) -> dict[str, Any]:
        """Every stage's :meth:`state_dict` in one, on every process, tensors on the CPU: the whole model's
        keys plus ``"pipecore"`` for all stages. In one process that is :meth:`state_dict` on the CPU; with
        one process per stage it is collective (every rank calls it; a rank that does not is reported by
        name after the pipeline's timeout). For evaluating or saving the whole model on one rank; each
        rank's share of it is one stage's weights and optimizer state."""
        self._ready("full_state_dict()")
        return state_io.full_state_dict(self._parts, self.in_flight)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this process's stages from a :meth:`state_dict` that holds them: this process's own, a
        :meth:`full_state_dict`, or a merge of the ranks' (:func:`merge_state_dicts`). Keys of other stages
        are ignored; a missing key of this process's stages, or a key of no stage, is an error.

        The state may come from a pipeline of the same model with another number of stages, another
        partition, another number of micro-batches or another algorithm: weights, buffers and optimizer state
        (momentum, AdamW's moments, a torch optimizer's per-parameter state) are then mapped by parameter name
        (it must then hold every stage that holds a parameter of this process's stages, as a full state does).
        A checkpoint holds the live weights only (flush semantics); the buffers an algorithm declares map by name
        where both pipelines keep them, are dropped where this pipeline does not keep them and start at zero where
        the checkpoint does not hold them, each with a warning. See docs/training.md, "Universal checkpoints".
        Before a first step that captures the model, the state is held and loaded right after the capture."""
        if not self._hold("load_state_dict", partial(self._load, state_io.check_state(state))):
            self._load(state)

    def _load(self, state: dict[str, Any]) -> None:
        state_io.load_state_dict(self._parts, state, self.in_flight)
        self._recovery.restart()

    def _gather(self, obj: Any) -> list[Any]:
        """``obj`` from every process, in rank order (collective with one process per stage)."""
        return self._settings.locality.gather(obj)

    def stats(self, all_stages: bool = False) -> list[dict[str, Any]]:
        """Per stage of this process (with ``all_stages``, of every stage, in stage order, on every process;
        collective with one process per stage): layers, versions held, bytes of weight versions (and of the
        scratch buffer for derived weights, one weight-sized; ``buffers``: the bytes of each buffer the
        algorithm declares, and ``buffer_bytes`` their sum), staleness
        seen (``staleness``: live minus read version; ``delay``: updates between a forward's read and its
        backward), the learning rate of the stage's next update (``lr``, before per-stage scaling), the peak
        memory measured while training (``peak_bytes``: on CUDA the allocator's peak of the stage's device, on
        the CPU the stage's account of what it allocates and what its micro-batches in flight keep, see
        ``pipecore.engine.memory``, kept with ``track_memory=True``; None without it), and the median seconds of the stage's
        recent actions of each kind."""
        self._ready("stats()")
        return introspection.stats(self._parts, all_stages, self.synchronize)

    def describe(self) -> str:
        """Each stage's compute nodes (indices into the captured graph), parameters, what it runs by module path
        and the values that cross its cuts, with the modules computing them (and shapes and dtypes when an
        ``example_input`` was given); before a first step that captures the model, that it waits for it."""
        return introspection.describe(self._parts) if self._built() else self._waiting().describe()

    def __repr__(self) -> str:
        return self.describe()
