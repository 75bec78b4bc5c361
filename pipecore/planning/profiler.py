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
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch import nn

from ..engine.graph import CapturedModel
from ..engine.inputs import as_model_inputs
from ..engine.optim import SGD, AdamW
from ..engine.buffers import buffer_copies
from .costs import GraphCosts, TiedParameter, ValueCost

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
            ``pipecore.AdamW`` (two such buffers), a torch optimizer factory (its state is measured after one
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
    with torch.random.fork_rng(devices=cuda), buffer_copies([model, captured.gm]), _on_device(device):
        state = _optimizer_state(optimizer, [p for ps in charged for p in ps], device)
        optimizer_bytes = [sum(state[id(p)] for p in ps) for ps in charged]
        profiler = _Profiler(captured, device, warmup, repeats)
        measured = profiler.run(values, progress)
        loss_saved, loss_s = 0, 0.0
        if loss_fn is not None:
            target = _map_tensors(example_target, lambda t: t.detach().to(device))
            loss_saved, loss_s = profiler.measure_loss(measured.output, target, loss_fn)

    n = len(captured.nodes)
    before, after = _crossing_saved(captured, measured.value_bytes, profiler.savers, profiler.aliases)
    return GraphCosts(
        names=tuple(node.name for node in captured.nodes),
        forward_s=tuple(m.forward_s for m in measured.nodes),
        backward_s=tuple(m.backward_s for m in measured.nodes),
        output_bytes=tuple(m.output_bytes for m in measured.nodes),
        saved_bytes=tuple(m.saved_bytes for m in measured.nodes),
        param_bytes=tuple(param_bytes),
        optimizer_bytes=tuple(optimizer_bytes),
        crossing_bytes=tuple(_crossing_bytes(captured, measured.value_bytes)[1:n]),
        microbatch_size=microbatch,
        device=str(device),
        input_bytes=sum(measured.value_bytes[p] for p in captured.placeholders if p.users),
        crossing_saved_before=tuple(before[:n]),
        crossing_saved_after=tuple(after[:n]),
        values=_values(captured, measured.value_bytes, profiler.savers, profiler.aliases),
        tied=_tied(captured, charged, state),
        loss_saved_bytes=loss_saved,
        loss_s=loss_s,
        uncuttable=_uncuttable(captured, measured.opaque),
        host_bytes_per_s=_host_bandwidth(device, warmup, repeats),
    )


# -- checking what is given ----------------------------------------------------------------------------


def _check_count(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"profile(): {name} must be an int, got {value!r}")
    if value < least:
        raise ValueError(f"profile(): {name} must be >= {least}, got {value}")


def _check_optimizer(spec: Any) -> None:
    if spec is None or isinstance(spec, (SGD, AdamW)) or callable(spec):
        return
    raise TypeError("profile(): optimizer must be None, pipecore.SGD(...), pipecore.AdamW(...) or a factory "
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
    if spec is None or isinstance(spec, (SGD, AdamW)):
        buffers = 0 if spec is None else 2 if isinstance(spec, AdamW) else int(spec.momentum != 0.0)
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
    mine = {_storage_key(probe), _storage_key(probe.grad)}
    return sum(nbytes for key, nbytes in _storages(_tensors(built.state.get(probe, {}))) if key not in mine)


# -- interpreting and measuring the graph -----------------------------------------------------------------


class _NodeCost:
    __slots__ = ("forward_s", "backward_s", "output_bytes", "saved_bytes")

    def __init__(self, forward_s: float, backward_s: float, output_bytes: int, saved_bytes: int):
        self.forward_s, self.backward_s = forward_s, backward_s
        self.output_bytes, self.saved_bytes = output_bytes, saved_bytes


class _Measured:
    def __init__(self) -> None:
        self.nodes: list[_NodeCost] = []
        self.value_bytes: dict[fx.Node, int] = {}  # per placeholder and compute node: bytes of its value
        self.output: Any = None  # the graph's output
        self.opaque: set[fx.Node] = set()  # nodes whose value holds something other than tensors


class _Profiler:
    """Interprets the captured graph node by node and measures each compute node in isolation."""

    def __init__(self, captured: CapturedModel, device: torch.device, warmup: int, repeats: int):
        self.captured = captured
        self.gm = captured.gm
        self.device = device
        self.warmup, self.repeats = warmup, repeats
        # Inside buffer_copies: the buffers here are the copies, which is what nodes read.
        model = captured.model
        frozen = [*model.parameters(), *model.buffers(), *self.gm.parameters(), *self.gm.buffers()]
        self.frozen_ids = {id(t) for t in frozen}
        self.frozen_storages = {_storage_key(t) for t in frozen}
        self.params = {id(p) for p in (*model.parameters(), *self.gm.parameters())}
        self.trainable = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
        # Storages of the graph's values already charged as saved, and the storages themselves (held, so that
        # their addresses cannot be reused by later values: a training forward keeps them all too).
        self.charged: set[Any] = set()
        self.charged_storages: list[Any] = []
        self.producer: dict[Any, fx.Node] = {}  # storage key -> the placeholder or node whose value it holds
        self.savers: dict[fx.Node, set[int]] = {}  # value -> indices of every compute node that saves it
        self.aliases: dict[fx.Node, set[fx.Node]] = {}  # graph node -> the values its output's storages hold
        self.index = {node: i for i, node in enumerate(captured.nodes)}

    def run(self, inputs: dict[str, torch.Tensor], progress: bool) -> _Measured:
        graph_nodes = list(self.gm.graph.nodes)
        last_use = {arg: i for i, user in enumerate(graph_nodes) for arg in user.all_input_nodes}
        env: dict[fx.Node, Any] = {}
        out = _Measured()
        bar = _Progress(len(self.captured.nodes), progress)
        try:
            for i, node in enumerate(graph_nodes):
                if node.op == "placeholder":
                    if node.users:
                        env[node] = inputs[str(node.target)]
                        out.value_bytes[node] = _value_bytes(env[node])
                        self.producer.update((key, node) for key, _ in _storages(list(_tensors(env[node]))))
                        self.aliases[node] = {node}
                elif node.op == "get_attr":
                    env[node] = _fetch_attr(self.gm, str(node.target))
                elif node in self.captured.rematerialized:  # a size every stage recomputes: not a node to cut
                    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
                    env[node] = node.target(*args, **kwargs)
                elif node.op == "output":
                    out.output = fx.node.map_arg(node.args[0], lambda n: env[n])
                    break
                else:
                    cost, value = self._measure(node, env)
                    env[node] = value
                    if _opaque(value):
                        out.opaque.add(node)
                    out.nodes.append(cost)
                    out.value_bytes[node] = cost.output_bytes
                    bar.update()
                for arg in node.all_input_nodes:
                    if last_use.get(arg) == i:
                        del env[arg]  # keep no more than a forward without autograd would
        finally:
            bar.close()
        return out

    def measure_loss(self, output: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor]
                     ) -> tuple[int, float]:
        """What ``loss_fn(output, target)`` saves for its backward that no node saved already (the last stage
        keeps it per micro-batch in flight), and the median seconds of its forward and backward."""
        try:
            saved, _ = self._saved_bytes(loss_fn, (output, target), {}, clone=False)
            mark, seconds = _clock(self.device)
            times = []
            _synchronize(self.device)
            for r in range(self.warmup + self.repeats):
                (y, t), _, leaves = self._prepare((output, target), {}, clone=False)
                with torch.enable_grad():
                    start = mark()
                    loss = loss_fn(y, t)
                    if leaves and loss.requires_grad:
                        torch.autograd.grad(loss, leaves, allow_unused=True)
                    times.append((start, mark()))
            _synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - the loss's failure names it
            raise RuntimeError(f"profile(): loss_fn failed on the model's output and example_target: "
                               f"{type(exc).__name__}: {exc}") from exc
        nbytes = sum(n for key, (n, _) in saved.items() if key not in self.charged)
        return nbytes, statistics.median(seconds(a, b) for a, b in times[self.warmup:])

    def _function(self, node: fx.Node) -> Callable[..., Any]:
        if node.op == "call_module":
            return self.gm.get_submodule(str(node.target))
        if node.op == "call_method":
            name = str(node.target)
            return lambda obj, *args, **kwargs: getattr(obj, name)(*args, **kwargs)
        return node.target  # type: ignore[return-value]

    def _measure(self, node: fx.Node, env: dict[fx.Node, Any]) -> tuple[_NodeCost, Any]:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
        fn = self._function(node)
        try:
            return self._measure_call(node, fn, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - every node failure gets the node's name
            where = f"{node.op} {node.target}" if node.op != "call_function" else \
                f"call_function {getattr(node.target, '__name__', node.target)}"
            raise RuntimeError(f"profile(): node {node.name!r} ({where}) failed on the example input: "
                               f"{type(exc).__name__}: {exc}") from exc

    def _measure_call(self, node: fx.Node, fn: Callable[..., Any], args: Any, kwargs: Any) -> tuple[_NodeCost, Any]:
        clone = _may_write_inputs(node, fn)
        if not clone:
            # The untimed run that counts saved tensors also finds in-place writes that the node's name does
            # not announce; the inputs it wrote are put back, so later nodes see what a forward gives them.
            watched = {id(t): (t, t._version, t.clone()) for t in _tensors((args, kwargs))
                       if id(t) not in self.frozen_ids}
            try:
                saved, counted = self._saved_bytes(fn, args, kwargs, clone=False)
            except RuntimeError as exc:
                if "in-place" not in str(exc) and "inplace" not in str(exc):
                    raise
                clone = True
            with torch.no_grad():
                for t, version, backup in watched.values():
                    if t._version != version:
                        t.copy_(backup)
                        clone = True
            del watched
        if clone:
            saved, counted = self._saved_bytes(fn, args, kwargs, clone=True)

        mark, seconds = _clock(self.device)
        own_params = [p for p in self._node_parameters(node, args) if p.requires_grad]
        forward_marks, backward_marks = [], []
        ones: list[torch.Tensor] | None = None
        result: Any = None
        _synchronize(self.device)
        for r in range(self.warmup + self.repeats):
            a, k, leaves = self._prepare(args, kwargs, clone)
            with torch.enable_grad():
                f0 = mark()
                result = fn(*a, **k)
                f1 = mark()
            outputs = list({id(t): t for t in _tensors(result) if t.requires_grad}.values())
            targets = leaves + own_params or self.trainable  # the model's parameters if the node reads others
            b = None
            if outputs and targets:
                if ones is None:
                    ones = [torch.ones_like(t) for t in outputs]
                b0 = mark()
                torch.autograd.grad(outputs, targets, ones, allow_unused=True)
                b = (b0, mark())
            if r >= self.warmup:
                forward_marks.append((f0, f1))
                if b is not None:
                    backward_marks.append(b)
        _synchronize(self.device)
        forward_s = statistics.median(seconds(s, e) for s, e in forward_marks)
        backward_s = statistics.median(seconds(s, e) for s, e in backward_marks) if backward_marks else 0.0
        value = _map_tensors(result, lambda t: t.detach().requires_grad_(t.requires_grad))
        given = {key for key, _ in _storages(list(_tensors((args, kwargs))))}
        for key, _ in _storages(list(_tensors(value))):
            # A view of an argument keeps the argument's producer; a new storage is this node's, even at an
            # address that a freed value held before.
            if key not in given or key not in self.producer:
                self.producer[key] = node
            self.aliases.setdefault(node, set()).add(self.producer[key])
        charged = self._charge(node, saved, counted, value, given)
        return _NodeCost(forward_s, backward_s, _value_bytes(value), charged), value

    def _charge(self, node: fx.Node, saved: dict[Any, tuple[int, Any]], counted: Any, value: Any,
                given: set[Any]) -> int:
        """The bytes of ``saved`` not charged to an earlier node. A value saved by several nodes (a
        convolution's output that BatchNorm saves as its input and a ReLU saves again) is kept once in
        training, so it is charged once, to the first. The counting run made its own output tensors: its
        storages stand for those of ``value``, which later nodes receive."""
        outputs = [key for key, _ in _storages(list(_tensors(counted)))]
        real = dict(zip(outputs, ((key, t) for (key, _), t in zip(_storages(list(_tensors(value))),
                                                                   _tensors(value)))))
        total = 0
        # A saved storage is a value of the graph if it is one of the node's arguments or outputs; anything else
        # the node made for itself (its address may be one a dropped value had).
        values = given | {key for key, _ in real.values()}
        for key, (nbytes, tensor) in saved.items():
            key, tensor = real.get(key, (key, tensor))
            is_value = key in values and key in self.producer
            if is_value:
                self.savers.setdefault(self.producer[key], set()).add(self.index[node])
            if key not in self.charged:
                self.charged.add(key)
                self.charged_storages.append(tensor.untyped_storage())
                total += nbytes
        return total

    def _node_parameters(self, node: fx.Node, args: Any) -> list[torch.Tensor]:
        """The parameters a node reads: its module's, and parameters among its arguments."""
        found = list(self.gm.get_submodule(str(node.target)).parameters()) if node.op == "call_module" else []
        found += [t for t in _tensors(args) if id(t) in self.params]
        return list({id(p): p for p in found}.values())

    def _prepare(self, args: Any, kwargs: Any, clone: bool) -> tuple[Any, Any, list[torch.Tensor]]:
        """The node's inputs for one run, and the leaves among them that require a gradient.

        Values computed by earlier nodes are detached; those that may carry a gradient (stored with
        ``requires_grad`` set, from the node that made them) become leaves that require one. With
        ``clone`` (a node that writes its inputs) they are copies, the leaf's clone taken as the input so
        that autograd allows the in-place write."""
        leaves: list[torch.Tensor] = []
        done: dict[int, torch.Tensor] = {}

        def prepare(t: torch.Tensor) -> torch.Tensor:
            if id(t) in self.frozen_ids:
                return t
            if id(t) not in done:
                x = t.detach().clone() if clone else t.detach()
                if t.requires_grad:
                    x.requires_grad_(True)
                    leaves.append(x)
                    if clone:
                        x = x.clone()
                done[id(t)] = x
            return done[id(t)]

        a, k = _map_tensors((args, kwargs), prepare)
        return a, k, leaves

    def _saved_bytes(self, fn: Callable[..., Any], args: Any, kwargs: Any, clone: bool) -> tuple[dict[Any, Any], Any]:
        """The storages autograd saves during one forward of the node (key -> bytes and a tensor on it),
        parameters' and buffers' excluded, each once; and that forward's result."""
        a, k, _ = self._prepare(args, kwargs, clone)
        saved: dict[Any, tuple[int, torch.Tensor]] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            for key, nbytes in _storages([t]):
                if key not in self.frozen_storages:
                    saved[key] = (nbytes, t)
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            counted = fn(*a, **k)
        return saved, counted


def _may_write_inputs(node: fx.Node, fn: Callable[..., Any]) -> bool:
    """Whether the node announces an in-place write: ``x.add_(...)``, ``torch.relu_``, ``inplace=True``."""
    if node.op == "call_module":
        return bool(getattr(fn, "inplace", False))
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or node.kwargs.get("inplace") is True


def _fetch_attr(root: nn.Module, qualname: str) -> Any:
    value: Any = root
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def _crossing_saved(captured: CapturedModel, value_bytes: dict[fx.Node, int], savers: dict[fx.Node, set[int]],
                    aliases: dict[fx.Node, set[fx.Node]]) -> tuple[list[int], list[int]]:
    """Per cut position ``c`` in ``0..N``, the bytes of the values crossing it that a node saves: first before
    ``c`` (the stage that sends the value keeps it anyway) and first at or after ``c`` (the stage that receives
    it keeps it anyway). A view is saved when its storage is (``savers`` is per storage's value)."""
    n = len(captured.nodes)
    position = _positions(captured)
    last = _last_uses(captured, position)
    before, after = [0] * (n + 2), [0] * (n + 2)
    for value, end in last.items():
        saving = [i for v in aliases.get(value, {value}) for i in savers.get(v, ())]
        nbytes = value_bytes.get(value, 0)
        start = position[value] + 1
        if not saving or start > end:
            continue
        saver = min(saving)
        # Cuts start..saver see the saver after them; cuts saver+1..end see it before.
        if saver >= start:
            after[start] += nbytes
            after[min(saver, end) + 1] -= nbytes
        if max(saver + 1, start) <= end:
            before[max(saver + 1, start)] += nbytes
            before[end + 1] -= nbytes
    for c in range(1, n + 2):
        before[c] += before[c - 1]
        after[c] += after[c - 1]
    return before[: n + 1], after[: n + 1]


def _values(captured: CapturedModel, value_bytes: dict[fx.Node, int], savers: dict[fx.Node, set[int]],
            aliases: dict[fx.Node, set[fx.Node]]) -> tuple[ValueCost, ...]:
    """The graph's values, a value being a storage with its views (see :class:`ValueCost`)."""
    n = len(captured.nodes)
    position = _positions(captured)
    users: dict[fx.Node, set[int]] = {}
    for node in captured.gm.graph.nodes:
        if node.op in ("placeholder", "get_attr") or node in captured.rematerialized:
            continue
        at = n if node.op == "output" else position[node]
        for arg in captured.reads(node):
            for value in aliases.get(arg, ()):
                users.setdefault(value, set()).add(at)
    made = [node for node in (*captured.placeholders, *captured.nodes) if node in value_bytes and node in users]
    return tuple(ValueCost(position[node], value_bytes[node], tuple(sorted(savers.get(node, ()))),
                           tuple(sorted(users[node]))) for node in made)


def _uncuttable(captured: CapturedModel, opaque: set[fx.Node]) -> tuple[int, ...]:
    """The cut positions that a value holding something other than tensors would cross."""
    position = _positions(captured)
    last = _last_uses(captured, position)
    n = len(captured.nodes)
    return tuple(sorted({c for node in opaque for c in range(position[node] + 1, min(last.get(node, -1), n - 1) + 1)}))


def _opaque(value: Any) -> bool:
    """Whether ``value`` holds anything but tensors (and the tuples, lists and dicts around them)."""
    if isinstance(value, torch.Tensor):
        return False
    if isinstance(value, (tuple, list)):
        return any(_opaque(v) for v in value)
    if isinstance(value, dict):
        return any(_opaque(v) for v in value.values())
    return value is not None


def _positions(captured: CapturedModel) -> dict[fx.Node, int]:
    """Each compute node's index, and -1 for the graph's inputs."""
    return {**{p: -1 for p in captured.placeholders}, **{node: i for i, node in enumerate(captured.nodes)}}


def _last_uses(captured: CapturedModel, position: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """Per value, the position of its last user (``N`` for the graph's output)."""
    n = len(captured.nodes)
    last: dict[fx.Node, int] = {}
    for node in captured.gm.graph.nodes:
        if node.op in ("placeholder", "get_attr") or node in captured.rematerialized:
            continue
        at = n if node.op == "output" else position[node]
        for arg in captured.reads(node):
            if arg.op != "get_attr":
                last[arg] = max(last.get(arg, -1), at)
    return last


def _crossing_bytes(captured: CapturedModel, value_bytes: dict[fx.Node, int]) -> list[int]:
    """Entry ``c`` for ``c`` in ``0..N``: bytes of the values produced before node ``c`` (inputs at -1) and
    used at node ``c`` or later (the output at ``N``); parameters and buffers (``get_attr``) never cross."""
    n = len(captured.nodes)
    position = _positions(captured)
    last = _last_uses(captured, position)
    # A value crosses the cuts c with produced < c <= last: add its bytes over that range.
    change = [0] * (n + 2)
    for value, end in last.items():
        start = position[value] + 1
        if start <= end:
            change[start] += value_bytes.get(value, 0)
            change[end + 1] -= value_bytes.get(value, 0)
    out, total = [], 0
    for c in range(n + 1):
        total += change[c]
        out.append(total)
    return out


# -- tensors in values ------------------------------------------------------------------------------------


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a value made of tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with every tensor in its tuples, lists and dicts replaced by ``fn(tensor)``."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, torch.Size):
        return value
    if isinstance(value, tuple):
        items = [_map_tensors(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, dict):
        mapped = {k: _map_tensors(v, fn) for k, v in value.items()}
        if type(value) is not dict:  # a dict of the model's own type (a Hugging Face ModelOutput) keeps it
            try:
                return type(value)(**mapped)
            except TypeError:
                return type(value)(mapped)
        return mapped
    return value


def _value_bytes(value: Any) -> int:
    """Bytes of the tensors in a value (their own elements), each tensor once."""
    unique = {id(t): t for t in _tensors(value)}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _storage_key(t: torch.Tensor) -> Any:
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage: each counts by itself
        return ("tensor", id(t))


def _storages(tensors: Iterator[torch.Tensor] | Sequence[torch.Tensor]) -> Iterator[tuple[Any, int]]:
    """``(key, bytes)`` of the storage of each tensor (each storage once)."""
    seen = set()
    for t in tensors:
        key = _storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        try:
            nbytes = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            nbytes = t.numel() * t.element_size()
        yield key, nbytes


# -- time, state and progress ----------------------------------------------------------------------------


def _clock(device: torch.device) -> tuple[Callable[[], Any], Callable[[Any, Any], float]]:
    """A function that marks a moment, and one that gives the seconds between two marks (on CUDA, after
    a synchronisation: the marks are events on the current stream)."""
    if device.type == "cuda":
        def mark() -> Any:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event

        return mark, lambda start, end: start.elapsed_time(end) / 1000.0
    return time.perf_counter, lambda start, end: end - start


_LINK_PROBE_BYTES = 64 * 2 ** 20


def _host_bandwidth(device: torch.device, warmup: int, repeats: int) -> float:
    """Bytes per second between ``device`` and pinned host memory, the slower direction (median of ``repeats``
    copies of 64 MiB each way); 0 on the CPU, where activation offload does not apply."""
    if device.type != "cuda":
        return 0.0
    with _on_device(device):
        host = torch.empty(_LINK_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
        data = torch.empty(_LINK_PROBE_BYTES, dtype=torch.uint8, device=device)
        mark, seconds = _clock(device)
        directions = []
        for destination, source in ((host, data), (data, host)):
            times = []
            for i in range(warmup + repeats):
                start = mark()
                destination.copy_(source, non_blocking=True)
                end = mark()
                _synchronize(device)
                if i >= warmup:
                    times.append(seconds(start, end))
            directions.append(_LINK_PROBE_BYTES / max(statistics.median(times), 1e-12))
    return min(directions)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _on_device(device: torch.device) -> Iterator[None]:
    """CUDA events and allocations on ``device`` inside the block."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


class _Progress:
    """A progress bar over the nodes on stderr: tqdm's if installed, else a counter."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.done = total, enabled, 0
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, desc="profile", unit="node", file=sys.stderr)

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled:
            print(f"\rprofile: {self.done}/{self.total} nodes", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr, flush=True)
