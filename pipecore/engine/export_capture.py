"""The second capture path: ``torch.export`` (non-strict), for forwards that ``torch.fx`` cannot follow.

Hugging Face models and plain code such as ``torch.ones(T, T)`` with a traced length build masks and shapes
with Python that symbolic tracing cannot run. ``torch.export.export(..., strict=False)`` runs the forward on
fake tensors and records every ATen operation, with the batch and sequence dimensions of ``example_input``
declared dynamic. This module turns the exported program back into the form the rest of pipecore cuts
(:class:`~pipecore.engine.graph.CapturedModel`): an ``fx.GraphModule`` rooted at the user's model in which

- every parameter and buffer is a ``get_attr`` node under its fully qualified name in the model (so a
  stage's ``state_dict`` keys are the model's own). A parameter reachable under several names (a tied
  weight) is read under the name of the module that uses it (``lm_head.weight`` in the head,
  ``transformer.wte.weight`` in the embedding), so each stage holds it under that module's name;
- buffers mutated in place (BatchNorm's running statistics, ``num_batches_tracked``) stay in-place ATen
  operations on the model's own buffers: the training IR that ``torch.export`` produces keeps them;
- dropout, BatchNorm and the ``num_batches_tracked`` increment follow the stage module's training mode
  (``Pipeline.train()``/``eval()``), as the modules would in eager mode;
- symbolic sizes (``x.size(1)``) are recomputed in each stage that needs them from the graph inputs (they
  are Python ints, not tensors, so they never cross a cut);
- tensors the forward creates (``torch.ones(T, T, device=x.device)``, position ids) are created on the device
  of the stage that runs the operation, not on the device the capture ran on;
- the model's output is rebuilt as the model returns it (a ``ModelOutput``, dict, tuple or tensor).
"""

from __future__ import annotations

import inspect
import operator
import re
import sys
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

#: The forward arguments of a Hugging Face model that hold a cache when ``use_cache`` is on.
_CACHE_HINT = ("the model returns a cache object ({what}); a pipeline trains without one: set "
               "model.config.use_cache = False (or pass use_cache=False in the config) before building the Pipeline")

#: Checks that torch.export records (of dtypes and of its assumptions on sizes): the pipeline drops them.
_DROPPED = {getattr(torch.ops.aten, name).default for name in (
    "_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size", "sym_constrain_range")
    if hasattr(torch.ops.aten, name)}

#: A stage's device: an empty buffer of every generated module, which moves with it (``module.to(device)``).
DEVICE_ANCHOR = "_pipecore_device"


def _device_of(anchor: torch.Tensor) -> torch.device:
    """The device of the stage that runs the node (tensors the forward creates are made there)."""
    return anchor.device


class CacheReturned(TypeError):
    """The model returns a cache of keys and values (``use_cache``), which a pipeline does not train with."""


def _train_only_add_(buffer: torch.Tensor, other: Any, training: bool) -> torch.Tensor:
    """``buffer.add_(other)`` in training mode only: BatchNorm's ``num_batches_tracked`` increment."""
    return buffer.add_(other) if training else buffer


def _attention(training: bool, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``aten.scaled_dot_product_attention`` whose dropout applies in training mode only (the exported graph
    holds the probability the forward passed in the mode it was captured in)."""
    if not training:
        if len(args) > 4:
            args = (*args[:4], 0.0, *args[5:])
        kwargs = {**kwargs, "dropout_p": 0.0} if "dropout_p" in kwargs else kwargs
    return torch.ops.aten.scaled_dot_product_attention.default(*args, **kwargs)


#: Dropout operations: ``(input, p, train)``; ``train`` becomes the stage module's training flag.
_DROPOUTS = {
    torch.ops.aten.dropout.default, torch.ops.aten.feature_dropout.default, torch.ops.aten.alpha_dropout.default,
    torch.ops.aten.feature_alpha_dropout.default,
}


def _model_output(spec: pytree.TreeSpec):
    """A function rebuilding the model's output from the exported graph's flat outputs."""

    def model_output(*leaves: Any) -> Any:
        return pytree.tree_unflatten(list(leaves), spec)

    model_output.__module__ = __name__
    return model_output


def rebuilds_output(target: Any) -> bool:
    """Whether a node's target is the capture's own function that returns the output as the model does."""
    return getattr(target, "__name__", None) == "model_output" and getattr(target, "__module__", None) == __name__


def _example_arguments(model: nn.Module, example_input: Any, signature: inspect.Signature
                       ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``example_input`` as (args, kwargs) of the forward, as ``Pipeline.step`` reads it."""
    names = list(signature.parameters)
    if isinstance(example_input, torch.Tensor):
        return (example_input,), {}
    if isinstance(example_input, dict):
        unknown = [k for k in example_input if k not in names]
        if unknown:
            raise TypeError(f"example_input has {unknown} but {type(model).__name__}.forward takes {names}")
        return (), {k: v for k, v in example_input.items() if v is not None}
    if isinstance(example_input, (tuple, list)):
        return tuple(example_input), {}
    raise TypeError(f"example_input must be a tensor, a tuple or a dict of tensors, got {type(example_input).__name__}")


def _widened(value: Any) -> Any:
    """A tensor whose batch (and sequence) dimension has at least 2 entries: ``torch.export`` specialises
    dimensions of size 0 and 1, so an example of one sample would fix the batch size to 1."""
    if not isinstance(value, torch.Tensor):
        return value
    for dim in _dynamic_dims(value):
        if value.shape[dim] < 2:
            value = torch.cat([value] * 2, dim=dim)
    return value


def _dynamic_dims(value: torch.Tensor) -> list[int]:
    """The dimensions declared dynamic: the batch (0), and the sequence (1) of token ids, masks and other
    inputs of up to three dimensions (images, ``[B, C, H, W]``, keep their size)."""
    if value.dim() == 0:
        return []
    if value.dim() == 1 or (value.is_floating_point() and value.dim() > 3):
        return [0]
    return [0, 1]


def export_program(model: nn.Module, example_input: Any, signature: inspect.Signature):
    """``torch.export.export`` of the model (non-strict, dynamic batch and sequence dimensions), run in
    training mode on fake tensors: the model's parameters and buffers do not change. Returns the program and
    the example's (args, kwargs) as exported."""
    from torch.export import Dim

    args, kwargs = _example_arguments(model, example_input, signature)
    names = list(signature.parameters)
    if len(args) > len(names) or any(p.kind is p.VAR_POSITIONAL for p in signature.parameters.values()):
        raise TypeError(f"{type(model).__name__}.forward takes *args; the torch.export capture passes the "
                        "forward's arguments by name")
    kwargs = {**dict(zip(names, args)), **kwargs}  # by name: the exported inputs then carry the arguments' names
    args = ()
    kwargs = {k: _widened(v) for k, v in kwargs.items()}
    dynamic = {k: {d: Dim.AUTO for d in _dynamic_dims(v)} if isinstance(v, torch.Tensor) else None
               for k, v in kwargs.items()}
    was_training = model.training
    model.train()  # dropout and BatchNorm as training nodes; their mode is made a flag of the stage module
    try:
        program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False)
    except Exception as exc:
        found = re.search(r"<class '[\w.]*?(\w*Cache)'>", str(exc))
        if found:
            raise CacheReturned(_CACHE_HINT.format(what=found.group(1))) from exc
        raise
    finally:
        model.train(was_training)
    return program, args, kwargs


def captured_from_export(model: nn.Module, example_input: Any, signature: inspect.Signature
                         ) -> tuple[fx.GraphModule, set[fx.Node]]:
    """The model's forward captured with ``torch.export`` as a GraphModule rooted at ``model`` (see the
    module's docstring), and the nodes holding symbolic sizes, which each stage recomputes."""
    program, args, kwargs = export_program(model, example_input, signature)
    return graph_from_program(model, program, args, kwargs, signature)


def graph_from_program(model: nn.Module, program: Any, args: tuple, kwargs: dict, signature: inspect.Signature
                       ) -> tuple[fx.GraphModule, set[fx.Node]]:
    sig = program.graph_signature
    _check_no_cache(program)
    names = list(signature.parameters)
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    for name, b in model.named_buffers(remove_duplicate=False):
        aliases.setdefault(id(b), []).append(name)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    constants = program.constants
    state_of: dict[str, str] = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    const_of: dict[str, str] = dict(sig.inputs_to_lifted_tensor_constants)
    if getattr(sig, "inputs_to_lifted_custom_objs", None):
        raise TypeError(f"{type(model).__name__}.forward uses script objects, which pipecore cannot pipeline")
    # The user inputs, in the exported graph's order, named after the forward's arguments.
    leaves = pytree.tree_flatten_with_path((args, kwargs))[0]
    input_names: list[str] = []
    for path, _ in leaves:
        where, key = path[0], path[1]
        if len(path) != 2:
            raise TypeError(f"{type(model).__name__}.forward takes a nested container of tensors "
                            f"({pytree.keystr(path)}); the torch.export capture takes tensors as the forward's "
                            "arguments (input_ids=..., attention_mask=...)")
        input_names.append(names[key.idx] if where.idx == 0 else key.key)
    # The exported program's user inputs follow the flattened (args, kwargs), constants (a bool option) included.
    user_specs = [spec for spec in sig.input_specs if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    if len(user_specs) != len(input_names):
        tensors = [name for (_, leaf), name in zip(leaves, input_names) if isinstance(leaf, torch.Tensor)]
        user_specs = [s for s in user_specs if isinstance(s.arg, torch.export.graph_signature.TensorArgument)]
        input_names = tensors
    argument_of = {spec.arg.name: name for spec, name in zip(user_specs, input_names)}

    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    old = program.graph
    extra_constants: dict[str, torch.Tensor] = {}
    training: fx.Node | None = None

    def flag() -> fx.Node:
        """The stage module's ``training`` flag, read where the state is read."""
        nonlocal training
        if training is None:
            with graph.inserting_after(_last_placeholder(graph)):
                training = graph.get_attr("training")
        return training

    state_reads: dict[fx.Node, str] = {}   # exported placeholder -> the FQN it stands for
    for node in old.nodes:
        if node.op == "placeholder":
            if node.name in state_of:
                state_reads[node] = state_of[node.name]
            elif node.name in const_of:
                target = const_of[node.name]
                value = constants[target]
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"{type(model).__name__}.forward uses a constant of type {type(value).__name__}")
                attr = "_pipecore_constant_" + re.sub(r"\W", "_", target)
                extra_constants[attr] = value
                state_reads[node] = attr
            else:
                new = graph.placeholder(argument_of.get(node.name, node.name))
                new.meta = dict(node.meta)
                env[node] = new
            continue
        if node.op == "output":
            flat = node.args[0]
            outs = [(_read_state(graph, state_reads[a], [], aliases, params, buffers, env, a) if a in state_reads
                     else env[a]) if isinstance(a, fx.Node) else a for a in flat]
            rebuild = graph.call_function(_model_output(program.call_spec.out_spec), tuple(outs))
            rebuild.meta["nn_module_stack"] = {}
            graph.output(rebuild)
            continue
        if node.op == "call_function" and node.target in _DROPPED:
            continue
        stack = node.meta.get("nn_module_stack") or {}
        modules = [path for path, _ in stack.values()] if stack else []

        def arg(a: fx.Node) -> fx.Node:
            if a in state_reads:
                return _read_state(graph, state_reads[a], modules, aliases, params, buffers, env, a)
            return env[a]

        new = graph.node_copy(node, arg)
        target = node.target
        if target in _DROPOUTS:
            new.args = (new.args[0], new.args[1], flag())
        elif target is torch.ops.aten.scaled_dot_product_attention.default:
            new.target = _attention
            new.args = (flag(), *new.args)
        elif target is torch.ops.aten.batch_norm.default and new.args[3] is not None:
            # With running statistics, BatchNorm uses them in eval mode (without, it uses the batch's always).
            new.args = (*new.args[:5], flag(), *new.args[6:])
        elif target is torch.ops.aten.add_.Tensor and node.args[0] in state_reads and \
                state_reads[node.args[0]].endswith("num_batches_tracked"):
            new.target = _train_only_add_
            new.args = (*new.args, flag())
        env[node] = new
    graph.eliminate_dead_code(is_impure_node=_impure)
    for node in [n for n in graph.nodes if n.op == "placeholder" and not n.users]:
        graph.erase_node(node)  # an input the forward does not read (an option such as use_cache=False)
    device_nodes = _stage_devices(graph, _capture_device(model, args, kwargs))
    # The generated module reads the model's own modules, parameters and buffers, plus the pipeline's own
    # buffers (constants the forward made, the device anchor): a shallow root holding both.
    root = nn.Module()
    root._modules, root._parameters, root._buffers = dict(model._modules), dict(model._parameters), dict(model._buffers)
    root.training = model.training
    for attr, value in extra_constants.items():
        root.register_buffer(attr, value.detach().clone(), persistent=False)
    if device_nodes:
        root.register_buffer(DEVICE_ANCHOR, torch.empty(0, device=_capture_device(model, args, kwargs)),
                             persistent=False)
    gm = fx.GraphModule(root, graph, type(model).__name__)
    _anchor_sizes(gm.graph)
    rematerialized = {n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem
                      and isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float,
                                                         bool))}
    gm.recompile()
    return gm, rematerialized | set(device_nodes)


def _capture_device(model: nn.Module, args: tuple, kwargs: dict) -> torch.device:
    for t in (*model.parameters(), *model.buffers(), *pytree.tree_leaves((args, kwargs))):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def _stage_devices(graph: fx.Graph, device: torch.device) -> list[fx.Node]:
    """Make the operations that create tensors on the capture's device (``torch.ones(T, T, device=x.device)``,
    ``torch.arange(T)``) create them on the device of the stage that runs them: the device becomes a node
    reading the device of an empty buffer that moves with the stage. Returns the new nodes (empty if no
    operation names the device)."""
    users = [n for n in graph.nodes if n.op == "call_function" and isinstance(n.kwargs.get("device"), torch.device)
             and n.kwargs["device"] == device]
    if not users:
        return []
    with graph.inserting_after(_last_placeholder(graph)):
        anchor = graph.get_attr(DEVICE_ANCHOR)
    with graph.inserting_after(anchor):
        where = graph.call_function(_device_of, (anchor,))
    for node in users:
        node.kwargs = {**node.kwargs, "device": where}
    return [where]


def _last_placeholder(graph: fx.Graph) -> fx.Node:
    return [n for n in graph.nodes if n.op == "placeholder"][-1]


def _impure(node: fx.Node) -> bool:
    """Nodes kept without users: in-place updates of buffers and other side effects."""
    if node.op in ("placeholder", "output"):
        return True
    if node.target is _train_only_add_:
        return True
    if node.target is _attention:
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        schema = node.target._schema
        return schema.is_mutable or node.target in _DROPPED
    return node.is_impure()


def _read_state(graph: fx.Graph, fqn: str, modules: list[str], aliases: dict[int, list[str]],
                params: dict[str, nn.Parameter], buffers: dict[str, torch.Tensor], env: dict, key: fx.Node) -> fx.Node:
    """A ``get_attr`` of a parameter or buffer, under the name of the innermost module of ``modules`` that
    holds it (a tied weight is read under its user's name), one node per name."""
    tensor = params.get(fqn, buffers.get(fqn))
    names = aliases.get(id(tensor), [fqn]) if tensor is not None else [fqn]
    chosen = names[0]
    for module in reversed(modules):
        owned = [n for n in names if n.rpartition(".")[0] == module]
        if owned:
            chosen = owned[0]
            break
    cache = env.setdefault("__state__", {})
    if chosen not in cache:
        with graph.inserting_after(_last_placeholder(graph)):  # where the exported program read it
            cache[chosen] = graph.get_attr(chosen)
        cache[chosen].meta = dict(key.meta)
    return cache[chosen]


def _anchor_sizes(graph: fx.Graph) -> None:
    """Make every ``sym_size`` read its size from the smallest graph input that has it, so a stage that
    recomputes a size needs only that input (token ids rather than hidden states)."""
    inputs = [n for n in graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
    where: dict[Any, tuple[int, fx.Node, int]] = {}
    for node in inputs:
        value = node.meta["val"]
        for d, size in enumerate(value.shape):
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                if expr not in where or value.numel() < where[expr][0]:  # type: ignore[operator]
                    where[expr] = (value.numel(), node, d)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.sym_size.int:
            size = node.meta.get("val")
            if isinstance(size, torch.SymInt) and size.node.expr in where:
                _, source, d = where[size.node.expr]
                node.args = (source, d)


def _check_no_cache(program: Any) -> None:
    spec = program.call_spec.out_spec
    found: list[str] = []

    def walk(s: Any) -> None:
        typ = getattr(s, "type", None)
        if typ is not None and "Cache" in getattr(typ, "__name__", ""):
            found.append(typ.__name__)
        context = getattr(s, "context", None)
        if isinstance(context, (list, tuple)) and "past_key_values" in context:
            found.append("past_key_values")
        children = s.children() if hasattr(s, "children") else getattr(s, "children_specs", [])
        for child in children or []:
            walk(child)

    walk(spec)
    if found:
        raise CacheReturned(_CACHE_HINT.format(what=", ".join(dict.fromkeys(found))))


def unwrap_compiled(model: Any) -> Any:
    """The module inside a ``torch.compile``'d model (``OptimizedModule._orig_mod``), with a note: pipecore
    captures the original forward and runs its stages eagerly."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # a compiled model has imported it (costly to import)
    if dynamo is not None and isinstance(model, dynamo.OptimizedModule):
        import warnings

        warnings.warn("the model is a torch.compile'd module (OptimizedModule); pipecore pipelines the module it "
                      "wraps (model._orig_mod) and runs its stages without torch.compile", UserWarning, stacklevel=4)
        return model._orig_mod
    return model
