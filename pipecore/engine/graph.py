"""Capture a model's forward as a graph and cut it into stages of generated code.

The model is captured once with ``torch.fx.symbolic_trace``: calls of ``torch.nn`` modules stay single
nodes (``call_module``), so a stage holds the user's own module objects under their own names and its
``state_dict`` keys are the model's; everything else in ``forward`` (residual additions, reshapes, masks)
becomes function and method nodes. The graph's compute nodes, in order, are the units a partition cuts
between. Each stage is a generated :class:`torch.fx.GraphModule` whose inputs are exactly the values that
cross the cut before it and whose outputs are exactly the values that cross the cut after it (the last
stage returns the model's output). A value used further down the pipeline (a padding mask, a residual)
passes through the stages in between; parameter and buffer reads (``get_attr``) are repeated in every
stage that uses them rather than sent.

An ``nn.Sequential`` captures to a chain of its children, so it is the special case whose cut points are
layer indices.
"""

from __future__ import annotations

import copy
import inspect
import operator
import re
import traceback
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn

_COMPUTE = ("call_module", "call_function", "call_method")
#: The ways a forward is captured (``Pipeline(..., capture=...)``).
CAPTURES = ("fx", "export", "auto")


class CaptureError(TypeError):
    """The model's forward cannot be captured as a graph."""


class NeedsExample(CaptureError):
    """The forward can only be captured with ``torch.export``, which runs it on an input, and none was given: a
    pipeline then captures it at its first step (see ``engine/lazy.py``). ``reason`` says why, in a few words."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class StageGraph:
    """One stage's generated module and what crosses its boundaries."""

    index: int
    module: fx.GraphModule
    inputs: tuple[str, ...]         # names of the values it receives, in argument order
    outputs: tuple[str, ...]        # names of the values it sends, in order (empty for the last stage)
    grad_inputs: tuple[bool, ...]   # per input: may carry a gradient (computed from parameters)
    nodes: tuple[str, ...]          # its compute nodes, in order
    modules: tuple[str, ...]        # the model's submodules it calls or reads, in order of first use


class _Tracer(fx.Tracer):
    def __init__(self, leaves: Sequence[type | str]):
        super().__init__()
        self._leaf_types = tuple(t for t in leaves if isinstance(t, type))
        self._leaf_names = {t for t in leaves if isinstance(t, str)}

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, self._leaf_types) or qualname in self._leaf_names:
            return True
        return super().is_leaf_module(m, qualname)


def _user_frame(exc: BaseException, model: nn.Module | None = None) -> str:
    """``file:line: code`` of the innermost frame outside torch in ``exc``'s traceback; without one (fx
    failing to patch the forward's code), where ``model``'s forward is defined."""
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(torch_dir)
              and not f.filename.startswith("<") and not f.filename.endswith(("graph.py", "export_capture.py"))]
    if not frames:
        if model is not None:
            try:
                forward = inspect.unwrap(type(model).forward)
                lines, start = inspect.getsourcelines(forward)
                return (f"{inspect.getsourcefile(forward)}:{start}: {lines[0].strip()} (the forward itself: "
                        "no line of it was reached)")
            except (OSError, TypeError):
                pass
        return "an unknown place"
    f = frames[-1]
    return f"{f.filename}:{f.lineno}: {f.line}"


class CapturedModel:
    """A model's forward as an fx graph, with the compute nodes that partitions cut between.

    Args:
        model: any ``nn.Module`` whose forward ``torch.fx.symbolic_trace`` can follow (no Python control
            flow on tensor values).
        leaf_modules: module types or qualified names to keep whole as one node (their forward is not
            traced): the fallback for code that cannot be captured.
        example_input: optional inputs (a tensor, tuple or dict, as ``Pipeline.step`` takes them). Forward
            arguments with defaults that it does not give are captured as their defaults.
    """

    def __init__(self, model: nn.Module, leaf_modules: Sequence[type | str] = (), example_input: Any = None,
                 capture: str = "auto"):
        if capture not in CAPTURES:
            raise ValueError(f"capture must be one of {CAPTURES} ('fx': torch.fx symbolic tracing; 'export': "
                             f"torch.export, which needs example_input; 'auto': fx, and export where fx cannot "
                             f"capture the forward), got {capture!r}")
        from .export_capture import CacheReturned, captured_from_export, unwrap_compiled

        model = unwrap_compiled(model)
        if isinstance(model, (list, tuple, nn.ModuleList)):
            model = nn.Sequential(*model)
        if not isinstance(model, nn.Module):
            raise TypeError(f"pipecore.Pipeline needs an nn.Module (or a list of modules), got {type(model).__name__}")
        self.model = model
        signature = inspect.signature(model.forward)
        given = _given_names(example_input, signature)
        concrete = {name: p.default for name, p in signature.parameters.items()
                    if p.default is not inspect.Parameter.empty and name not in given}
        #: Nodes computing Python numbers (symbolic sizes) that every stage using them recomputes from its own
        #: inputs; they are not cut between and never cross a cut (the torch.export capture has them).
        self.rematerialized: set[fx.Node] = set()
        #: Which capture made the graph: "fx" or "export".
        self.capture = "fx"
        fx_failure: CaptureError | None = None
        if capture != "export":
            try:
                self._trace(model, leaf_modules, concrete)
            except CaptureError as exc:
                if capture == "fx":
                    raise
                fx_failure = exc
                if example_input is None:
                    first = str(exc).splitlines()[0].partition(": ")[2]
                    raise NeedsExample(
                        f"{exc}\nOr give the pipeline example_input=... (a mini-batch as step() takes it): with it, "
                        "capture='auto' (the default) captures what torch.fx cannot with torch.export",
                        f"torch.fx cannot capture {type(model).__name__}.forward ({first})") from exc
        if capture == "export" or fx_failure is not None:
            if example_input is None:
                raise NeedsExample("capture='export' needs example_input=... (a mini-batch as step() takes it): "
                                   "torch.export runs the forward on it to record the graph", "capture='export'")
            try:
                gm, self.rematerialized = captured_from_export(model, example_input, signature)
            except Exception as exc:  # noqa: BLE001 - reported with the fx failure, if any
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
                said = f"torch.export failed: {type(exc).__name__}: {first}\n  at {_user_frame(exc)}"
                if isinstance(exc, CacheReturned):
                    raise CaptureError(f"cannot capture {type(model).__name__}.forward: {exc}") from exc
                if fx_failure is not None:
                    raise CaptureError(f"neither capture works for {type(model).__name__}.forward.\n"
                                       f"torch.fx failed: {fx_failure}\n{said}") from exc
                raise CaptureError(f"cannot capture {type(model).__name__}.forward with torch.export: {said}") from exc
            self.capture = "export"
            self.gm, self.graph = gm, gm.graph
            self.input_paths: dict[str, tuple[str, tuple[Access, ...]]] = {}
            self._finish(model, signature, tuple(concrete))
            return
        self._finish(model, signature, tuple(concrete))

    def _trace(self, model: nn.Module, leaf_modules: Sequence[type | str], concrete: dict[str, Any]) -> None:
        """Capture with ``torch.fx.symbolic_trace`` (arguments in ``concrete`` as constants)."""
        tracer = _Tracer(leaf_modules)
        try:
            graph = tracer.trace(model, concrete_args=concrete or None)
        except Exception as exc:  # noqa: BLE001 - every capture failure gets the same advice
            raise CaptureError(
                f"cannot capture {type(model).__name__}.forward as a graph: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else exc!r}\n  at {_user_frame(exc, model)}\n"
                "pipecore captures forwards with torch.fx, which cannot follow Python control flow on tensor values "
                "or other data-dependent Python. Fallback: move that code into a submodule and pass its type (or "
                "its name) in Pipeline(..., leaf_modules=[...]) so it stays one node, or give the pipeline an "
                "nn.Sequential of modules."
            ) from exc
        _drop_specialisation_checks(graph)
        self.input_paths = _split_containers(graph, set(concrete))
        self.gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
        self.graph = self.gm.graph

    def _finish(self, model: nn.Module, signature: inspect.Signature, concrete: tuple[str, ...]) -> None:
        self.placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.input_names = tuple(n.target for n in self.placeholders if n.users)
        self.specialised = concrete
        self.argument_names = tuple(signature.parameters)
        #: Arguments that the forward reads as a dict or dataclass of tensors (``batch["x"]``, ``batch.x``):
        #: the graph reads their entries, each as an input of its own (see :func:`_split_containers`).
        self.container_arguments = tuple(dict.fromkeys(argument for argument, _ in self.input_paths.values()))
        self.nodes = [n for n in self.graph.nodes if n.op in _COMPUTE and n not in self.rematerialized]
        if not self.nodes:
            raise CaptureError(f"{type(model).__name__}.forward captured no computation; nothing to pipeline")
        self._output = next(n for n in self.graph.nodes if n.op == "output")
        self._grad = _depends_on_parameters(self.gm)

    # -- describing nodes ---------------------------------------------------------------------------

    def module_of(self, node: fx.Node) -> str | None:
        """The innermost named submodule a node belongs to (None for the model's own forward)."""
        if node.op == "call_module":
            return str(node.target)
        stack = node.meta.get("nn_module_stack") or {}
        names = [path for path, _ in stack.values()] if stack and isinstance(next(iter(stack.values())), tuple) \
            else list(stack)
        return names[-1] if names else None

    def node_parameters(self) -> list[int]:
        """Parameter elements each compute node reads (a module's parameters, or ``get_attr`` parameters it
        takes as arguments); a tied parameter counts at each node that reads it."""
        params = dict(self.gm.named_parameters(remove_duplicate=False))
        sizes = []
        for node in self.nodes:
            total = 0
            if node.op == "call_module":
                total += sum(p.numel() for p in self.gm.get_submodule(node.target).parameters())
            for arg in node.all_input_nodes:
                if arg.op == "get_attr" and arg.target in params:
                    total += params[arg.target].numel()
            sizes.append(total)
        return sizes

    def cut_index(self, point: int | str) -> int:
        """The compute-node index at which a stage starts, from a node index or a module name (the stage
        starts at the first node of that module)."""
        n = len(self.nodes)
        if isinstance(point, bool) or not isinstance(point, (int, str)):
            raise TypeError(f"a cut point is a node index or a module name, got {point!r}")
        if isinstance(point, int):
            if not 0 < point < n:
                raise ValueError(f"cut point {point} is outside the captured graph: node indices 1..{n - 1} "
                                 f"(the graph has {n} compute nodes; see Pipeline.describe())")
            return point
        for i, node in enumerate(self.nodes):
            name = self.module_of(node)
            if name is not None and (name == point or name.startswith(point + ".")):
                if i == 0:
                    raise ValueError(f"cut point {point!r} is the first node of the graph; a stage must start later")
                return i
        known = sorted({m.split(".")[0] for m in (self.module_of(x) for x in self.nodes) if m})
        raise ValueError(f"cut point {point!r} names no module of the captured graph; top-level modules: {known}")

    # -- splitting ----------------------------------------------------------------------------------

    def split(self, starts: Sequence[int], tied_copies: bool = True) -> list[StageGraph]:
        """Generated stages for the given start indices of stages ``1..P-1``.

        Tied parameters (one tensor read by several stages) get a private copy in every stage but the
        first that reads it, so each stage can hold its own copy of the weights.
        """
        bounds = list(zip([0, *starts], [*starts, len(self.nodes)]))
        stage_of: dict[fx.Node, int] = {}
        for s, (a, b) in enumerate(bounds):
            for node in self.nodes[a:b]:
                stage_of[node] = s
        last = len(bounds) - 1
        for node in self.placeholders:
            stage_of[node] = -1
        # The stages that use each value; the output node belongs to the last stage.
        uses: dict[fx.Node, set[int]] = {}
        for node in [*self.nodes, self._output]:
            s = stage_of.get(node, last)
            for arg in self.reads(node):
                if arg.op != "get_attr":
                    uses.setdefault(arg, set()).add(s)
        values = [n for n in self.graph.nodes if n.op == "placeholder" and n.users] + self.nodes
        crossing = [[v for v in values if stage_of[v] <= s < max(uses.get(v, {-1}))] for s in range(last)]
        stages = []
        for s, (a, b) in enumerate(bounds):
            inputs = [n for n in self.placeholders if n.users] if s == 0 else crossing[s - 1]
            outputs = crossing[s] if s < last else None
            gm = self._generate(s, inputs, self.nodes[a:b], outputs)
            stages.append(StageGraph(
                s, gm, tuple(n.name for n in inputs), tuple(n.name for n in outputs or ()),
                tuple(s > 0 and self._grad[n] for n in inputs), tuple(n.name for n in self.nodes[a:b]),
                tuple(dict.fromkeys(m for m in (self.module_of(n) for n in self.nodes[a:b]) if m)),
            ))
        self._adopt_unused(stages)
        if tied_copies:
            _private_tied_copies([st.module for st in stages])
        return stages

    def reads(self, node: fx.Node) -> list[fx.Node]:
        """The values a node needs from its stage: its inputs, with a recomputed size replaced by what it is
        computed from."""
        out, work = [], list(node.all_input_nodes)
        while work:
            arg = work.pop()
            if arg in self.rematerialized:
                work.extend(arg.all_input_nodes)
            elif arg not in out:
                out.append(arg)
        return out

    def _adopt_unused(self, stages: Sequence[StageGraph]) -> None:
        """Parameters and buffers the forward never reads still belong to the model's state: each goes to the
        stage holding its module's first node (stage 0 if none), which keeps it unchanged."""
        held = {id(t) for st in stages for t in (*st.module.parameters(), *st.module.buffers())}
        first_stage: dict[str, int] = {}
        for st in stages:
            for name in st.modules:
                first_stage.setdefault(name, st.index)
        for kind, named in (("parameter", self.model.named_parameters()), ("buffer", self.model.named_buffers())):
            for name, tensor in named:
                if id(tensor) in held:
                    continue
                owner = name.rpartition(".")[0]
                candidates = [s for m, s in first_stage.items() if m == owner or m.startswith(owner + ".") or not owner]
                target = stages[min(candidates) if candidates else 0].module
                *path, leaf = name.split(".")
                parent = target
                for part in path:
                    if part not in parent._modules:
                        parent.add_module(part, nn.Module())
                    parent = parent._modules[part]
                if kind == "parameter":
                    parent.register_parameter(leaf, tensor)
                else:
                    parent.register_buffer(leaf, tensor)
                held.add(id(tensor))

    def _generate(self, s: int, inputs: Sequence[fx.Node], nodes: Sequence[fx.Node],
                  outputs: Sequence[fx.Node] | None) -> fx.GraphModule:
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in inputs:
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)

        def value(arg: fx.Node) -> fx.Node:
            if arg not in env:
                assert arg.op == "get_attr" or arg in self.rematerialized, \
                    f"stage {s} uses {arg.name} before it is defined"
                env[arg] = graph.node_copy(arg, value)
            return env[arg]

        # Sizes this stage recomputes come first, so that they never sit inside a run of its nodes (a
        # segment that recompute or offload replaces).
        for node in nodes:
            for arg in node.all_input_nodes:
                if arg in self.rematerialized:
                    value(arg)
        for node in nodes:
            env[node] = graph.node_copy(node, value)
        if outputs is None:
            graph.output(fx.map_arg(self._output.args[0], value))
        else:
            graph.output(tuple(value(n) for n in outputs))
        graph.lint()
        return fx.GraphModule(self.gm, graph, f"Stage{s}")


def _given_names(example_input: Any, signature: inspect.Signature) -> set[str]:
    """Forward argument names that ``example_input`` provides (all of them when it is None)."""
    names = list(signature.parameters)
    if example_input is None:
        return {n for n, p in signature.parameters.items() if p.default is inspect.Parameter.empty}
    if isinstance(example_input, dict) and set(example_input) <= set(names):
        return set(example_input)
    if isinstance(example_input, (tuple, list)):
        return set(names[: len(example_input)])
    return set(names[:1])


#: One step into a container argument: ``("item", key)`` for ``value[key]``, ``("attr", name)`` for ``value.name``.
Access = tuple[str, str]


def _access(node: fx.Node, of: fx.Node) -> Access | None:
    """What ``node`` reads from ``of`` if it is ``of[key]`` with a string key or ``of.name``, else None."""
    if node.op != "call_function" or len(node.args) != 2 or node.args[0] is not of or node.kwargs:
        return None
    key = node.args[1]
    if node.target is operator.getitem and isinstance(key, str):
        return ("item", key)
    if node.target is getattr and isinstance(key, str):
        return ("attr", key)
    return None


def describe_path(argument: str, path: Sequence[Access]) -> str:
    """How the forward reads an entry of a container argument, as Python: ``batch['x']``, ``batch.x``."""
    return argument + "".join(f"[{key!r}]" if kind == "item" else f".{key}" for kind, key in path)


def _split_containers(graph: fx.Graph, specialised: set[str]) -> dict[str, tuple[str, tuple[Access, ...]]]:
    """Give every entry that the forward reads from a dict (or dataclass) argument a placeholder of its own.

    fx traces a forward's argument as one value whatever it holds; ``batch["x"]`` becomes a ``getitem`` node.
    A dict cannot cross a cut between stages, and a mini-batch is split tensor by tensor, so an argument (or,
    recursively, an entry) that is read only as ``value["key"]`` or ``value.name`` is replaced by one
    placeholder per entry read. That is decided from the graph alone: an argument read that way is a
    container, since a tensor has no string keys; a name that is also a tensor attribute (``x.shape``, ``x.T``)
    does not count by itself. Returns, per new placeholder, the argument and the path to its entry."""
    paths: dict[str, tuple[str, tuple[Access, ...]]] = {}
    work = [n for n in graph.nodes if n.op == "placeholder" and n.users and n.target not in specialised]
    origin = {n: (str(n.target), ()) for n in work}
    while work:
        node = work.pop(0)
        reads = [(user, _access(user, node)) for user in node.users]
        if any(access is None for _, access in reads):
            continue
        if all(kind == "attr" and hasattr(torch.Tensor, key) for _, (kind, key) in reads):  # type: ignore[misc]
            continue
        argument, path = origin.pop(node)
        paths.pop(str(node.target), None)
        made: dict[Access, fx.Node] = {}
        with graph.inserting_before(node):
            for user, access in reads:
                assert access is not None
                if access not in made:
                    new = graph.placeholder(re.sub(r"\W", "_", f"{node.name}_{access[1]}"))
                    new.target = new.name  # the generated code's argument: a unique identifier, like the name
                    made[access] = new
                    origin[new] = (argument, (*path, access))
                    paths[new.name] = origin[new]
                    work.append(new)
                user.replace_all_uses_with(made[access])
                graph.erase_node(user)
        graph.erase_node(node)
        for new in made.values():
            if not new.users:  # an entry read but not used (fx keeps dead reads): no input for it
                paths.pop(new.name)
                origin.pop(new)
                work.remove(new)
                graph.erase_node(new)
    return paths


def _drop_specialisation_checks(graph: fx.Graph) -> None:
    """Remove the checks fx inserts for arguments captured as constants (their defaults); the pipeline
    checks that such arguments are not given instead."""
    for node in list(graph.nodes):
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "_assert_is_none":
            node.replace_all_uses_with(None)  # type: ignore[arg-type]
            graph.erase_node(node)


def _depends_on_parameters(gm: fx.GraphModule) -> dict[fx.Node, bool]:
    """Per node: whether its value is computed from a parameter (and so may carry a gradient)."""
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    out: dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        direct = (node.op == "get_attr" and node.target in params) or (
            node.op == "call_module" and any(True for _ in gm.get_submodule(node.target).parameters()))
        out[node] = direct or any(out.get(a, False) for a in node.all_input_nodes)
    return out


def _private_tied_copies(modules: Sequence[nn.Module]) -> None:
    """Give every stage but the first that reads a shared parameter its own copy of it.

    The copy replaces the parameter only inside that stage: modules on the path to it are shallow-copied
    first, so the user's model keeps its own (shared) parameter, which follows the first owner's weights.
    """
    seen: set[int] = set()
    for module in modules:
        shared = [(name, p) for name, p in module.named_parameters(remove_duplicate=False) if id(p) in seen]
        replaced: dict[int, nn.Parameter] = {}
        for name, p in shared:
            copy_ = replaced.setdefault(id(p), nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
            _set_parameter(module, name, copy_)
        seen |= {id(p) for _, p in module.named_parameters(remove_duplicate=False)} - set(replaced)


def _set_parameter(root: nn.Module, qualname: str, value: nn.Parameter) -> None:
    *path, leaf = qualname.split(".")
    parent = root
    for part in path:
        child = parent._modules[part]
        assert child is not None
        own = copy.copy(child)  # a shallow copy: the user's module object stays untouched
        own._parameters = dict(child._parameters)
        own._modules = dict(child._modules)
        own._buffers = dict(child._buffers)
        parent._modules[part] = own
        parent = own
    parent._parameters[leaf] = value


def tied_parameters(stages: Sequence[StageGraph], model: nn.Module) -> dict[str, tuple[tuple[int, str], ...]]:
    """Parameters of ``model`` read by more than one stage: a name (the model's first name for it) ->
    ``(stage, name inside that stage)`` for each stage that reads it, in stage order."""
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    by_name = {name: names[0] for names in names_of.values() for name in names}
    owners: dict[str, list[tuple[int, str]]] = {}
    for st in stages:
        seen: set[str] = set()
        for name, _ in st.module.named_parameters():
            canonical = by_name.get(name)
            if canonical is not None and canonical not in seen:
                seen.add(canonical)
                owners.setdefault(canonical, []).append((st.index, name))
    return {name: tuple(o) for name, o in owners.items() if len(o) > 1}


def state_aliases(stages: Sequence[StageGraph], model: nn.Module) -> list[dict[str, str]]:
    """Per stage: the names of the model's parameters that the stage serves from another name it holds.

    A parameter reachable under several names (a tied weight: BART's ``model.shared.weight``,
    ``model.encoder.embed_tokens.weight``, ``model.decoder.embed_tokens.weight`` and ``lm_head.weight``) is one
    entry of a stage's flat weights, under the first of its names that the stage's module has. Every other
    name is an alias of that entry, in the first stage holding it, so that a checkpoint holds every key of the
    model's own ``state_dict`` with the live value and loads strictly into a plain copy of the model."""
    ids = {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}
    holder: dict[int, tuple[int, str]] = {}
    held: set[str] = set()
    for st in stages:
        for name, _ in st.module.named_parameters():
            if name in ids:
                holder.setdefault(ids[name], (st.index, name))
                held.add(name)
    aliases: list[dict[str, str]] = [{} for _ in stages]
    for name, key in ids.items():
        if name not in held and key in holder:
            s, own = holder[key]
            aliases[s][name] = own
    return aliases
