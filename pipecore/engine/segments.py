"""Segments of a stage's graph: runs of consecutive compute nodes replaced by one module call.

A plan (``pipecore.plan``) may recompute or offload node ranges of a stage. :func:`replace_segments` turns
each range into a submodule (a :class:`~pipecore.engine.recompute.Recomputed` or an
:class:`~pipecore.engine.offload.Offloaded` wrapping the range's own graph) whose outputs replace the
range's values in the stage's generated module.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.fx as fx
from torch import nn

from .graph import _COMPUTE


def replace_segments(gm: fx.GraphModule, segments: Sequence[Sequence[str]],
                     wrap: Callable[[fx.GraphModule], nn.Module], prefix: str) -> None:
    """Rewrite ``gm`` (a stage's generated module) so that each segment, a run of consecutive compute nodes
    named in order, is one call of ``wrap(segment_graph_module)``, added as submodule ``{prefix}_{k}``."""
    graph = gm.graph
    for k, names in enumerate(segments):
        wanted = set(names)
        compute = [n for n in graph.nodes if n.op in _COMPUTE]
        at = [i for i, n in enumerate(compute) if n.name in wanted]
        nodes = [compute[i] for i in at]
        if not at or [n.name for n in nodes] != list(names) or at != list(range(at[0], at[0] + len(at))):
            raise ValueError(f"{prefix} segment {list(names)} is not a run of this stage's nodes")
        inside = set(nodes)
        inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes
                                    if a not in inside and a.op != "get_attr"))
        outputs = [n for n in nodes if any(user not in inside for user in n.users)]
        sub = fx.Graph()
        env: dict[fx.Node, fx.Node] = {a: sub.placeholder(a.name) for a in inputs}

        def value(arg: fx.Node) -> fx.Node:
            if arg not in env:  # a parameter or buffer read: repeated inside the segment
                env[arg] = sub.node_copy(arg, value)
            return env[arg]

        for n in nodes:
            env[n] = sub.node_copy(n, value)
        sub.output(tuple(env[n] for n in outputs))
        name = f"{prefix}_{k}"
        gm.add_submodule(name, wrap(fx.GraphModule(gm, sub, f"{prefix.capitalize()}Segment{k}")))
        with graph.inserting_before(nodes[0]):
            call = graph.call_module(name, tuple(inputs))
            results = [graph.call_function(_item, (call, i)) for i in range(len(outputs))]
        for n, result in zip(outputs, results):
            n.replace_all_uses_with(result, delete_user_cb=lambda user: user not in inside)
        for n in reversed(nodes):
            graph.erase_node(n)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()


def _item(values: tuple[Any, ...], i: int) -> Any:
    return values[i]
