"""Which values of a captured graph cross each cut, and which nodes save them: what the profiler derives from
the graph's structure and the bytes it measured (:func:`~pipecore.planning.profiler.profile`)."""

from __future__ import annotations

import torch.fx as fx

from ..engine.graph import CapturedModel
from .costs import ValueCost


def crossing_saved(captured: CapturedModel, value_bytes: dict[fx.Node, int], savers: dict[fx.Node, set[int]],
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


def value_costs(captured: CapturedModel, value_bytes: dict[fx.Node, int], savers: dict[fx.Node, set[int]],
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


def uncuttable_cuts(captured: CapturedModel, opaque: set[fx.Node]) -> tuple[int, ...]:
    """The cut positions that a value holding something other than tensors would cross."""
    position = _positions(captured)
    last = _last_uses(captured, position)
    n = len(captured.nodes)
    return tuple(sorted({c for node in opaque for c in range(position[node] + 1, min(last.get(node, -1), n - 1) + 1)}))


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


def crossing_bytes(captured: CapturedModel, value_bytes: dict[fx.Node, int]) -> list[int]:
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
