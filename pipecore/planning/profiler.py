"""Measure the per-node costs of a model's captured graph (:func:`profile`), for the planner.

Method. The model is captured as :class:`~pipecore.engine.graph.CapturedModel` captures it for a pipeline, and
its graph is interpreted node by node on the example input, so that every compute node gets its real inputs.
Each node is then measured in isolation:

* forward: the node runs on detached copies of its inputs (aliases of the same storage, so views stay views).
  A floating input that may carry a gradient in training (it was computed from a parameter that requires one)
  is made a leaf that requires a gradient; the model's inputs do not. Parameters and buffers are passed as
  themselves. The forward runs with autograd recording, as in training.
* backward: ``torch.autograd.grad`` of the node's outputs that require a gradient, with a gradient of ones
  of each output's shape, with respect to the node's input leaves and the parameters it reads (input and
  weight gradients). ``torch.autograd.grad`` returns the gradients instead of accumulating them into
  ``.grad``, so the parameters' ``.grad`` are never touched.
* each time is the median of ``repeats`` runs after ``warmup`` runs; on the CPU with ``time.perf_counter``,
  on CUDA with CUDA events, synchronising only before and after each node's runs.
* saved bytes: the storages autograd saves for the node's backward during one extra forward, seen through
  ``torch.autograd.graph.saved_tensors_hooks``; each storage counts once and whole (a saved view keeps all of
  the tensor it views alive), and storages of parameters and buffers are left out. A value saved by several
  nodes (a convolution's output that BatchNorm saves, or a ReLU's output the next Linear saves) is one tensor
  in training: it is charged once, to the first node that saves it.
* output bytes: the bytes of every tensor in the node's output structure (their own elements, not the
  storage they view); crossing bytes: the bytes of the values produced before a cut (the model's inputs
  included) and used at or after it (the graph's output included), as :meth:`CapturedModel.split` decides
  what crosses.

Limits. Isolated nodes do not see what happens across nodes: kernels fused across node boundaries, caches
warmed by the previous node, overlap of one node's work with the next's, and autograd's cost of
accumulating a gradient that several users of one value send back. A node that writes its input in place
runs on a copy, so a value it saves is not matched with the input it would share in training (it is charged
again). Tensors kept on ``ctx`` other than through
``save_for_backward`` are not seen. Values whose shapes depend on data see the example input's values only.
A node that modifies an input in place runs on clones of its inputs (copied outside the timed region).
A node none of whose outputs needs a gradient has a backward time of 0. Nodes run in the parameters' dtype,
without autocast; the figures do not include buffers (BatchNorm's statistics) or state a pipeline algorithm
adds to the optimizer's (a weight-prediction direction).

The model does not change: its parameters are only read, ``.grad`` is left alone (see above), its buffers
are replaced by copies while it is profiled (BatchNorm's running statistics update the copies), and the
random state (CPU, and the CUDA device's) is put back afterwards. It is profiled in the mode it is in
(``model.train()`` for training costs: dropout on, BatchNorm on batch statistics).

This module checks what is given and charges parameters and optimizer state to nodes; the nodes are measured
by :class:`~pipecore.planning.node_profiler.NodeProfiler`, and what crosses each cut is derived from the graph
in :mod:`~pipecore.planning.value_flow`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch import nn

from ..engine.graph import CapturedModel
from ..engine.inputs import as_model_inputs
from ..engine.optim import SGD, AdamW, NAdam
from ..engine.buffers import buffer_copies
from .costs import GraphCosts, TiedParameter
from .device_timing import host_bandwidth, on_device
from .node_profiler import NodeProfiler
from .tensor_values import map_tensors, storage_key, storages, tensors_in
from .value_flow import crossing_bytes, crossing_saved, uncuttable_cuts, value_costs

__all__ = ["profile"]


def profile(model: nn.Module, example_input: Any, *, leaf_modules: Sequence[type | str] = (),
            optimizer: Any = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
            example_target: Any = None, warmup: int = 2, repeats: int = 5, progress: bool = False,
            threads: int | None = None) -> GraphCosts:
    """Measure the costs of every compute node of ``model``'s captured graph for one micro-batch.

    Args:
        model: the model, as :class:`pipecore.Pipeline` takes it (captured with ``torch.fx``). Its parameters
            must all be on one device, where the measurements run; the inputs are moved there.
        example_input: one micro-batch of inputs (a tensor, a tuple or a dict of tensors, as
            ``Pipeline.step`` takes them); its size along dimension 0 is the ``microbatch_size`` of the
            result. Which forward arguments it gives decides what the graph reads, as for ``Pipeline``.
        leaf_modules: module types or qualified names kept whole as one node (as for ``Pipeline``).
        optimizer: the optimizer the pipeline will use, for the optimizer-state bytes: ``pipecore.SGD``
            (momentum: one float32 buffer per parameter, float64 for float64 weights; none without momentum),
            ``pipecore.AdamW`` and ``pipecore.NAdam`` (two such buffers), a torch optimizer factory (its state is measured after one
            step on a zero parameter of each shape and dtype), or None for the pipeline's default
            (``pipecore.SGD`` without momentum: no state).
        loss_fn, example_target: the pipeline's loss and the targets of ``example_input``; when given, the
            loss's time and what it saves for the backward are measured too (``GraphCosts.loss_s`` and
            ``loss_saved_bytes``: the last stage keeps them per micro-batch in flight).
        warmup: untimed runs of each node before the timed ones (>= 0).
        repeats: timed runs of each node; each time is their median (>= 1).
        progress: show a progress bar on stderr (tqdm if installed, else a counter).
        threads: torch intra-op threads while measuring (restored after), as a stage thread of the pipeline
            will compute with (``Pipeline(threads_per_stage=...)``); None: the calling thread's setting.

    Returns:
        A :class:`GraphCosts` with one entry per node of ``CapturedModel(model).nodes``, in order; ``device``
        is where it was measured (``"cpu"``, ``"cuda:0"``, ...). On CUDA, ``host_bytes_per_s`` is the measured
        bandwidth to and from pinned host memory (what activation offload moves over); on the CPU it is 0.

    Each parameter is charged to the first node that reads it (a tied parameter once); a parameter the
    forward never reads is charged to the first node of its module (the first node if none), the stage the
    pipeline puts it in. See the module's documentation for the measurement method and its limits; the
    model's parameters, buffers, ``.grad`` and the random state are as before the call.
    """
    _check_count("warmup", warmup, 0)
    _check_count("repeats", repeats, 1)
    if not isinstance(progress, bool):
        raise TypeError(f"profile(): progress must be True or False, got {progress!r}")
    if (loss_fn is None) != (example_target is None):
        raise TypeError("profile(): give loss_fn and example_target together (the loss of example_input's "
                        "output against its targets), or neither")
    if example_input is None:
        raise TypeError("profile() needs an example_input: one micro-batch of the model's inputs (a tensor, a "
                        "tuple or a dict of tensors) to run every node on")
    _check_optimizer(optimizer)
    from ..engine.threads import check_threads_per_stage  # here: engine imports the planner

    threads = check_threads_per_stage(threads)
    caller_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _profile(model, example_input, leaf_modules, optimizer, loss_fn, example_target, warmup, repeats,
                        progress)
    finally:
        torch.set_num_threads(caller_threads)


def _profile(model: nn.Module, example_input: Any, leaf_modules: Sequence[type | str], optimizer: Any,
             loss_fn: Callable[[Any, Any], torch.Tensor] | None, example_target: Any, warmup: int, repeats: int,
             progress: bool) -> GraphCosts:
    captured = CapturedModel(model, leaf_modules, example_input)
    model = captured.model
    inputs = as_model_inputs(example_input, captured)
    microbatch = _microbatch_size(captured.input_names, inputs)
    device = _device_of(model, inputs)
    # Private, compact copies: the nodes never write the caller's tensors, and a slice of a larger tensor
    # does not count as its whole storage when a node saves it.
    values = {name: t.detach().to(device).clone() for name, t in zip(captured.input_names, inputs)}

    charged = _charge_parameters(captured)
    param_bytes = [sum(p.numel() * p.element_size() for p in ps) for ps in charged]
    cuda = [device.index] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), buffer_copies([model, captured.gm]), on_device(device):
        state = _optimizer_state(optimizer, [p for ps in charged for p in ps], device)
        optimizer_bytes = [sum(state[id(p)] for p in ps) for ps in charged]
        profiler = NodeProfiler(captured, device, warmup, repeats)
        measured = profiler.run(values, progress)
        loss_saved, loss_s = 0, 0.0
        if loss_fn is not None:
            target = map_tensors(example_target, lambda t: t.detach().to(device))
            loss_saved, loss_s = profiler.measure_loss(measured.output, target, loss_fn)

    n = len(captured.nodes)
    before, after = crossing_saved(captured, measured.value_bytes, profiler.savers, profiler.aliases)
    return GraphCosts(
        names=tuple(node.name for node in captured.nodes),
        forward_s=tuple(m.forward_s for m in measured.nodes),
        backward_s=tuple(m.backward_s for m in measured.nodes),
        output_bytes=tuple(m.output_bytes for m in measured.nodes),
        saved_bytes=tuple(m.saved_bytes for m in measured.nodes),
        param_bytes=tuple(param_bytes),
        optimizer_bytes=tuple(optimizer_bytes),
        crossing_bytes=tuple(crossing_bytes(captured, measured.value_bytes)[1:n]),
        microbatch_size=microbatch,
        device=str(device),
        input_bytes=sum(measured.value_bytes[p] for p in captured.placeholders if p.users),
        crossing_saved_before=tuple(before[:n]),
        crossing_saved_after=tuple(after[:n]),
        values=value_costs(captured, measured.value_bytes, profiler.savers, profiler.aliases),
        tied=_tied(captured, charged, state),
        loss_saved_bytes=loss_saved,
        loss_s=loss_s,
        uncuttable=uncuttable_cuts(captured, measured.opaque),
        host_bytes_per_s=host_bandwidth(device, warmup, repeats),
    )


# -- checking what is given ----------------------------------------------------------------------------


def _check_count(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"profile(): {name} must be an int, got {value!r}")
    if value < least:
        raise ValueError(f"profile(): {name} must be >= {least}, got {value}")


def _check_optimizer(spec: Any) -> None:
    if spec is None or isinstance(spec, (SGD, AdamW, NAdam)) or callable(spec):
        return
    raise TypeError("profile(): optimizer must be None, pipecore.SGD(...), pipecore.AdamW(...), pipecore.NAdam(...) "
                    "or a factory "
                    f"such as functools.partial(torch.optim.RMSprop, lr=1e-3); got {spec!r}")


def _microbatch_size(names: Sequence[str], inputs: Sequence[torch.Tensor]) -> int:
    """Samples in the example input: the size of its tensors along dimension 0 (the same for all)."""
    if not inputs:
        raise ValueError("profile(): the model's forward reads no input, so the example input gives no "
                         "micro-batch size")
    for name, t in zip(names, inputs):
        if t.dim() == 0:
            raise ValueError(f"profile(): example input {name!r} is a scalar; every input has the samples along "
                             f"dimension 0")
    sizes = {name: t.shape[0] for name, t in zip(names, inputs)}
    if len(set(sizes.values())) > 1:
        raise ValueError("profile(): the example inputs have different sizes along dimension 0 (samples): "
                         + ", ".join(f"{name}: {size}" for name, size in sizes.items()))
    samples = int(inputs[0].shape[0])
    if samples < 1:
        raise ValueError("profile(): the example input holds no samples (dimension 0 is empty); give at least one")
    return samples


def _device_of(model: nn.Module, inputs: Sequence[torch.Tensor]) -> torch.device:
    """The device of the model's parameters (else of its buffers, else of its first input), with its index."""
    for kind, tensors in (("parameters", list(model.parameters())), ("buffers", list(model.buffers()))):
        devices = sorted({str(t.device) for t in tensors})
        if len(devices) > 1:
            raise ValueError(f"profile() measures on one device, but the model's {kind} are on {', '.join(devices)}")
        if devices:
            device = torch.device(devices[0])
            break
    else:
        device = inputs[0].device if inputs else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# -- parameters and optimizer state ----------------------------------------------------------------------


def _charge_parameters(captured: CapturedModel) -> list[list[nn.Parameter]]:
    """Per compute node, the parameters charged to it: each parameter at the first node that reads it (a
    module call's parameters, or a ``get_attr`` parameter among its arguments); one that no node reads at the
    first node of its module, like the pipeline's stages adopt it (node 0 when its module has no node)."""
    gm = captured.gm
    params = dict(gm.named_parameters(remove_duplicate=False))
    seen: set[int] = set()
    charged: list[list[nn.Parameter]] = []
    for node in captured.nodes:
        mine: list[nn.Parameter] = []
        for p in _parameters_read(gm, params, node):
            if id(p) not in seen:
                seen.add(id(p))
                mine.append(p)
        charged.append(mine)
    modules = [captured.module_of(node) or "" for node in captured.nodes]
    for name, p in captured.model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        owner = name.rpartition(".")[0]
        first = next((i for i, m in enumerate(modules) if not owner or m == owner or m.startswith(owner + ".")), 0)
        charged[first].append(p)
    return charged


def _parameters_read(gm: fx.GraphModule, params: dict[str, nn.Parameter], node: fx.Node) -> list[nn.Parameter]:
    """The parameters ``node`` reads: its module's, and ``get_attr`` parameters among its arguments."""
    reads = list(gm.get_submodule(str(node.target)).parameters()) if node.op == "call_module" else []
    return reads + [params[str(a.target)] for a in node.all_input_nodes if a.op == "get_attr" and a.target in params]


def _tied(captured: CapturedModel, charged: Sequence[Sequence[nn.Parameter]], state: dict[int, int]
          ) -> tuple[TiedParameter, ...]:
    """The parameters that several nodes read (a tied embedding, say): a stage holding a reader other than
    the first holds the parameter too."""
    gm = captured.gm
    params = dict(gm.named_parameters(remove_duplicate=False))
    readers: dict[int, list[int]] = {}
    for i, node in enumerate(captured.nodes):
        for p in {id(p): p for p in _parameters_read(gm, params, node)}.values():
            readers.setdefault(id(p), []).append(i)
    return tuple(TiedParameter(p.numel() * p.element_size(), state[id(p)], tuple(readers[id(p)]))
                 for ps in charged for p in ps if len(readers.get(id(p), ())) > 1)


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    # pipecore's fused optimizers keep their state in float32 (float64 for float64 weights).
    return torch.float64 if dtype == torch.float64 else torch.float32


def _optimizer_state(spec: Any, params: Sequence[torch.Tensor], device: torch.device) -> dict[int, int]:
    """Bytes of optimizer state per parameter (by ``id``) under ``spec`` (see :func:`profile`)."""
    if spec is None or isinstance(spec, (SGD, AdamW, NAdam)):
        buffers = 0 if spec is None else 2 if isinstance(spec, (AdamW, NAdam)) else int(spec.momentum != 0.0)
        return {id(p): buffers * p.numel() * _state_dtype(p.dtype).itemsize for p in params}
    measured: dict[tuple[torch.Size, torch.dtype], int] = {}
    out = {}
    for p in params:
        key = (p.shape, p.dtype)
        if key not in measured:
            measured[key] = _torch_optimizer_state(spec, p.shape, p.dtype, device)
        out[id(p)] = measured[key]
    return out


def _torch_optimizer_state(factory: Callable[..., Any], shape: torch.Size, dtype: torch.dtype,
                           device: torch.device) -> int:
    """Bytes of state a torch optimizer keeps for one parameter of ``shape`` and ``dtype``, after one step
    (state is created lazily), on a zero parameter as pipecore's unfused optimizer path builds them."""
    probe = torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)
    try:
        built = factory([probe])
    except Exception as exc:  # noqa: BLE001 - any failure of the user's factory gets the same context
        raise RuntimeError(f"profile(): the optimizer factory {factory!r} failed on a parameter list: "
                           f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(f"profile(): the optimizer factory must return a torch.optim.Optimizer, got "
                        f"{type(built).__name__}")
    probe.grad = torch.zeros_like(probe)
    try:
        built.step()
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError(f"profile(): one step of {type(built).__name__} failed while measuring its state "
                           f"(pipecore steps torch optimizers without a closure): {type(exc).__name__}: {exc}") from exc
    mine = {storage_key(probe), storage_key(probe.grad)}
    return sum(nbytes for key, nbytes in storages(tensors_in(built.state.get(probe, {}))) if key not in mine)
