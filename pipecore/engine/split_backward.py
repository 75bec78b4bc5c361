"""Backward in two passes: the input gradient first, the weight gradients after.

A pipeline stage's upstream neighbour waits for the gradient of the stage's input, not for the stage's
weight gradients. Computing the input gradient first and sending it before the weight gradients takes
the weight-gradient work off the critical path between ranks (the B/W split of zero-bubble schedules),
without changing any value: the weight gradients are computed by the same autograd nodes from the same
gradients, only later.

How: the autograd graph from the stage input to the output is the *input path*. Every weight joins the
input path at some nodes (for ``Linear``, its ``addmm`` node); those are the weight's *junctions*. The
first pass runs ``autograd.grad`` for the input only, while pre-hooks record the gradient flowing into
every junction. The second pass starts at the junctions with the recorded gradients and runs down to
the weights. Weights that do not join the input path (e.g. a bias added after the last use of the
input) get their gradient in the first pass.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node


def _node(t: torch.Tensor) -> Node:
    """The autograd node of ``t``: its grad_fn, or for a leaf its gradient accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    node = t.view_as(t).grad_fn.next_functions[0][0]  # a view's edge leads to the leaf's accumulator
    assert node is not None, "a tensor that requires grad has an autograd node"
    return node


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """For every node reachable from ``root``, the nodes that feed gradient into it (reverse edges)."""
    reverse: dict[Node, list[Node]] = {root: []}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in reverse:
                reverse[child] = []
                queue.append(child)
            reverse[child].append(node)
    return reverse


def _upward(start: Node, reverse: dict[Node, list[Node]], stop: set[Node] | None = None) -> tuple[set[Node], set[Node]]:
    """Nodes reachable from ``start`` towards the output; nodes in ``stop`` are reported, not crossed."""
    seen, hit = {start}, set()
    queue = deque([start])
    while queue:
        for parent in reverse.get(queue.popleft(), ()):
            if stop is not None and parent in stop:
                hit.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen, hit


@dataclass
class _Group:
    """Weights (by index) that join the input path at the same junction nodes."""

    weights: list[int]
    junctions: list[Node]
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


@dataclass
class PendingWeightGradients:
    """What the input pass leaves for :func:`weight_gradients`."""

    groups: list[_Group]
    weight_nodes: list[Node]
    early: dict[int, torch.Tensor | None]  # gradients of weights that do not join the input path


def input_gradient(
    output: torch.Tensor, grad_output: torch.Tensor | None, stage_input: torch.Tensor, weights: Sequence[torch.Tensor]
) -> tuple[torch.Tensor | None, PendingWeightGradients]:
    """The gradient of ``stage_input``; the weights' gradients are left for :func:`weight_gradients`.

    ``output`` is the stage output (``grad_output`` its gradient) or the loss (``grad_output`` None).
    The graph is retained until :func:`weight_gradients` runs.
    """
    reverse = _consumers(output.grad_fn)
    input_node = _node(stage_input)
    on_input_path, _ = _upward(input_node, reverse)
    by_junctions: dict[frozenset[Node], _Group] = {}
    detached: list[int] = []
    weight_nodes = []
    for i, w in enumerate(weights):
        node = _node(w)
        weight_nodes.append(node)
        if node not in reverse:  # the weight does not take part in this output
            continue
        _, junctions = _upward(node, reverse, on_input_path)
        if not junctions:
            detached.append(i)
            continue
        key = frozenset(junctions)
        group = by_junctions.get(key)
        if group is None:
            group = by_junctions[key] = _Group([], list(junctions))
        group.weights.append(i)
    groups = _merge_overlapping(list(by_junctions.values()))

    handles = []
    for group in groups:
        for junction in group.junctions:
            def record(grad_outputs, group=group, junction=junction):
                group.grads[junction] = tuple(grad_outputs)
            handles.append(junction.register_prehook(record))
    inputs = [stage_input] + [weights[i] for i in detached]
    try:
        grads = torch.autograd.grad(output, inputs, grad_outputs=grad_output, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    early = {i: g for i, g in zip(detached, grads[1:])}
    return grads[0], PendingWeightGradients(groups, weight_nodes, early)


def _merge_overlapping(groups: list[_Group]) -> list[_Group]:
    """Groups sharing a junction become one, so every junction's gradient is used exactly once."""
    merged: list[_Group] = []
    for group in groups:
        overlapping = [g for g in merged if set(g.junctions) & set(group.junctions)]
        for g in overlapping:
            merged.remove(g)
            group = _Group(g.weights + group.weights, list(dict.fromkeys(g.junctions + group.junctions)))
        merged.append(group)
    return merged


def weight_gradients(pending: PendingWeightGradients, num_weights: int) -> list[torch.Tensor | None]:
    """The weights' gradients (None where a weight took no part), from the recorded junction gradients.
    Frees the graph."""
    out: list[torch.Tensor | None] = [None] * num_weights
    for i, g in pending.early.items():
        out[i] = g
    for n, group in enumerate(pending.groups):
        edges, grads = [], []
        for junction in group.junctions:
            for k, g in enumerate(group.grads.get(junction, ())):
                if g is not None:
                    edges.append(GradientEdge(junction, k))
                    grads.append(g)
        if not edges:
            continue
        handles = []
        if len(group.junctions) > 1:
            # A junction below another would otherwise receive the upper one's gradient a second time.
            for junction in group.junctions:
                recorded = group.grads.get(junction)
                if recorded is not None:
                    handles.append(junction.register_prehook(lambda _, recorded=recorded: recorded))
        try:
            targets = [GradientEdge(pending.weight_nodes[i], 0) for i in group.weights]
            last = n == len(pending.groups) - 1
            result = torch.autograd.grad(edges, targets, grad_outputs=grads, retain_graph=not last, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        for i, g in zip(group.weights, result):
            out[i] = g
    return out
