"""Measuring each compute node of a captured graph in isolation, for :func:`~pipecore.planning.profiler.profile`
(whose documentation gives the method and its limits): the graph is interpreted node by node on the example
input, and each node's forward and backward are timed and the storages it saves for its backward counted.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from ..engine.graph import CapturedModel
from .device_timing import clock, synchronize
from .tensor_values import map_tensors, storage_key, storages, tensor_bytes, tensors_in


class NodeCost:
    """One compute node's measured costs: forward and backward seconds, bytes of its output and bytes it
    saves for its backward that no earlier node saved."""

    __slots__ = ("forward_s", "backward_s", "output_bytes", "saved_bytes")

    def __init__(self, forward_s: float, backward_s: float, output_bytes: int, saved_bytes: int):
        self.forward_s, self.backward_s = forward_s, backward_s
        self.output_bytes, self.saved_bytes = output_bytes, saved_bytes


class MeasuredGraph:
    """What :meth:`NodeProfiler.run` measured over the whole graph."""

    def __init__(self) -> None:
        self.nodes: list[NodeCost] = []
        self.value_bytes: dict[fx.Node, int] = {}  # per placeholder and compute node: bytes of its value
        self.output: Any = None  # the graph's output
        self.opaque: set[fx.Node] = set()  # nodes whose value holds something other than tensors


class NodeProfiler:
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
        self.frozen_storages = {storage_key(t) for t in frozen}
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

    def run(self, inputs: dict[str, torch.Tensor], progress: bool) -> MeasuredGraph:
        graph_nodes = list(self.gm.graph.nodes)
        last_use = {arg: i for i, user in enumerate(graph_nodes) for arg in user.all_input_nodes}
        env: dict[fx.Node, Any] = {}
        out = MeasuredGraph()
        bar = _Progress(len(self.captured.nodes), progress)
        try:
            for i, node in enumerate(graph_nodes):
                if node.op == "placeholder":
                    if node.users:
                        env[node] = inputs[str(node.target)]
                        out.value_bytes[node] = tensor_bytes(env[node])
                        self.producer.update((key, node) for key, _ in storages(list(tensors_in(env[node]))))
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
            mark, seconds = clock(self.device)
            times = []
            synchronize(self.device)
            for r in range(self.warmup + self.repeats):
                (y, t), _, leaves = self._prepare((output, target), {}, clone=False)
                with torch.enable_grad():
                    start = mark()
                    loss = loss_fn(y, t)
                    if leaves and loss.requires_grad:
                        torch.autograd.grad(loss, leaves, allow_unused=True)
                    times.append((start, mark()))
            synchronize(self.device)
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

    def _measure(self, node: fx.Node, env: dict[fx.Node, Any]) -> tuple[NodeCost, Any]:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
        fn = self._function(node)
        try:
            return self._measure_call(node, fn, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - every node failure gets the node's name
            where = f"{node.op} {node.target}" if node.op != "call_function" else \
                f"call_function {getattr(node.target, '__name__', node.target)}"
            raise RuntimeError(f"profile(): node {node.name!r} ({where}) failed on the example input: "
                               f"{type(exc).__name__}: {exc}") from exc

    def _measure_call(self, node: fx.Node, fn: Callable[..., Any], args: Any, kwargs: Any) -> tuple[NodeCost, Any]:
        clone = _may_write_inputs(node, fn)
        if not clone:
            # The untimed run that counts saved tensors also finds in-place writes that the node's name does
            # not announce; the inputs it wrote are put back, so later nodes see what a forward gives them.
            watched = {id(t): (t, t._version, t.clone()) for t in tensors_in((args, kwargs))
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

        mark, seconds = clock(self.device)
        own_params = [p for p in self._node_parameters(node, args) if p.requires_grad]
        forward_marks, backward_marks = [], []
        ones: list[torch.Tensor] | None = None
        result: Any = None
        synchronize(self.device)
        for r in range(self.warmup + self.repeats):
            a, k, leaves = self._prepare(args, kwargs, clone)
            with torch.enable_grad():
                f0 = mark()
                result = fn(*a, **k)
                f1 = mark()
            outputs = list({id(t): t for t in tensors_in(result) if t.requires_grad}.values())
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
        synchronize(self.device)
        forward_s = statistics.median(seconds(s, e) for s, e in forward_marks)
        backward_s = statistics.median(seconds(s, e) for s, e in backward_marks) if backward_marks else 0.0
        value = map_tensors(result, lambda t: t.detach().requires_grad_(t.requires_grad))
        given = {key for key, _ in storages(list(tensors_in((args, kwargs))))}
        for key, _ in storages(list(tensors_in(value))):
            # A view of an argument keeps the argument's producer; a new storage is this node's, even at an
            # address that a freed value held before.
            if key not in given or key not in self.producer:
                self.producer[key] = node
            self.aliases.setdefault(node, set()).add(self.producer[key])
        charged = self._charge(node, saved, counted, value, given)
        return NodeCost(forward_s, backward_s, tensor_bytes(value), charged), value

    def _charge(self, node: fx.Node, saved: dict[Any, tuple[int, Any]], counted: Any, value: Any,
                given: set[Any]) -> int:
        """The bytes of ``saved`` not charged to an earlier node. A value saved by several nodes (a
        convolution's output that BatchNorm saves as its input and a ReLU saves again) is kept once in
        training, so it is charged once, to the first. The counting run made its own output tensors: its
        storages stand for those of ``value``, which later nodes receive."""
        outputs = [key for key, _ in storages(list(tensors_in(counted)))]
        real = dict(zip(outputs, ((key, t) for (key, _), t in zip(storages(list(tensors_in(value))),
                                                                   tensors_in(value)))))
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
        found += [t for t in tensors_in(args) if id(t) in self.params]
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

        a, k = map_tensors((args, kwargs), prepare)
        return a, k, leaves

    def _saved_bytes(self, fn: Callable[..., Any], args: Any, kwargs: Any, clone: bool) -> tuple[dict[Any, Any], Any]:
        """The storages autograd saves during one forward of the node (key -> bytes and a tensor on it),
        parameters' and buffers' excluded, each once; and that forward's result."""
        a, k, _ = self._prepare(args, kwargs, clone)
        saved: dict[Any, tuple[int, torch.Tensor]] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            for key, nbytes in storages([t]):
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


def _opaque(value: Any) -> bool:
    """Whether ``value`` holds anything but tensors (and the tuples, lists and dicts around them)."""
    if isinstance(value, torch.Tensor):
        return False
    if isinstance(value, (tuple, list)):
        return any(_opaque(v) for v in value)
    if isinstance(value, dict):
        return any(_opaque(v) for v in value.values())
    return value is not None


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
