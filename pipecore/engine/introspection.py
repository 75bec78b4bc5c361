"""What a pipeline tells about itself: per-stage statistics (:meth:`Pipeline.stats`) and its layout
(:meth:`Pipeline.describe`)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .export_capture import rebuilds_output
from .graph import CapturedModel, StageGraph
from .inputs import input_label
from .parts import Parts


def stats(parts: Parts, all_stages: bool, synchronize: Callable[[], None]) -> list[dict[str, Any]]:
    """:meth:`Pipeline.stats` (``synchronize`` waits for the stage threads' remaining work first)."""
    if all_stages:
        gathered = parts.locality.gather(stats(parts, False, synchronize))
        return sorted((st for part in gathered for st in part), key=lambda st: st["stage"])
    synchronize()
    out = []
    for s, st in parts.stages.items():
        stale, delay = st.staleness, st.delays
        itemsize = st.grad.element_size()
        out.append({
            "stage": s,
            "layers": parts.stage_layers[s],
            "parameters": st.layout.numel,
            "weight_versions": st.ring.num_slots,
            "versions_held": len(st.book.held),
            "weight_version_bytes": st.ring.num_slots * st.layout.numel * itemsize,
            "scratch_bytes": 0 if st.scratch is None else st.layout.numel * itemsize,
            "buffers": (buffers := {name: st.layout.numel * b.element_size() for name, b in st.state.buffers.items()}),
            "buffer_bytes": sum(buffers.values()),
            "live_version": st.book.live,
            "lr": st.next_lr(),
            "grad_norm": None if st.clip is None else st.clip.last_norm,
            "peak_bytes": st.peak_bytes(),
            "staleness_mean": stale.mean,
            "staleness_max": stale.max,
            "delay_mean": delay.mean,
            "delay_max": delay.max,
            "seconds_per_action": st.seconds_per_action(),
        })
    return out


def describe(parts: Parts) -> str:
    """:meth:`Pipeline.describe`: each stage's modules, compute nodes, parameters and the values that cross
    its cuts."""
    captured = parts.captured
    inputs = ", ".join(input_label(captured, name) for name in captured.input_names)
    lines = [f"Pipeline: {type(captured.model).__name__} as {parts.num_stages} stages, {parts.algorithm.name}, "
             f"{parts.n_microbatches} micro-batches; inputs {inputs}"]
    index = {node.name: i for i, node in enumerate(captured.nodes)}
    meta = parts.boundary_meta or {}
    runs, producer = stage_contents(captured, parts.stage_graphs)

    def value(name: str) -> str:
        made = f" from {producer[name]}" if producer.get(name) else ""
        return f"{name}{made}{' ' + meta[name] if name in meta else ''}"

    for g in parts.stage_graphs:
        params = sum(p.numel() for p in g.module.parameters())
        first, last = index[g.nodes[0]], index[g.nodes[-1]]
        lines.append(f"stage {g.index}: nodes {first}-{last} ({len(g.nodes)}), {params:,} parameters")
        lines.append(f"  runs:     {_abbreviate(runs[g.index])}")
        if g.index > 0:
            lines.append("  receives: " + ", ".join(value(n) for n in g.inputs))
        if g.outputs:
            lines.append("  sends:    " + ", ".join(value(n) for n in g.outputs))
    sync = parts.tie_sync
    for name, held in parts.ties.items():
        lines.append(f"tied: {name} held by stages {', '.join(f'{s} ({local})' for s, local in held)}"
                     + (f"; gradients applied {sync.delay} update(s) late" if sync and sync.delay else ""))
    return "\n".join(lines)


def stage_contents(captured: CapturedModel, graphs: Sequence[StageGraph]) -> tuple[list[list[str]], dict[str, str]]:
    """What each stage runs, by the model's module paths, in order of first use, and the module that computes
    each node (for the values that cross cuts).

    A node is named by the outermost module that holds it and whose nodes all run in its stage
    (``transformer.h.1``, not its ``attn.c_attn``); a module whose nodes run in several stages is named by its
    path with ``(part)`` for its own code (``transformer (part)``: the embeddings' sum, the mask); a node of the
    model's own forward (``add``, ``getattr``) by its name. Consecutive siblings collapse into a range
    (``transformer.h.0-h.2``)."""
    stage_of = {name: g.index for g in graphs for name in g.nodes}
    paths = {node.name: captured.module_of(node) or None for node in captured.nodes}
    # The export capture's own node that returns the output as the model does: not the user's code.
    rebuild = {node.name for node in captured.nodes if rebuilds_output(node.target)}
    stages_of: dict[str, set[int]] = {}  # per module: the stages that run its nodes (its submodules' included)
    for name, path in paths.items():
        for prefix in _prefixes(path):
            stages_of.setdefault(prefix, set()).add(stage_of[name])
    producer: dict[str, str] = {}
    runs: list[list[str]] = []
    for g in graphs:
        items: list[str] = []
        for name in g.nodes:
            path = paths[name]
            whole = next((p for p in _prefixes(path) if stages_of[p] == {g.index}), None)
            if path is not None:
                producer[name] = whole or path
            if name in rebuild:
                continue
            item = whole or (name if path is None else f"{path} (part)")
            if item not in items:
                items.append(item)
        runs.append(_ranges(items))
    return runs, producer


def _prefixes(path: str | None) -> list[str]:
    """``a``, ``a.b``, ``a.b.c`` for ``a.b.c`` (outermost first); none for no module."""
    parts = path.split(".") if path else []
    return [".".join(parts[:k]) for k in range(1, len(parts) + 1)]


def _ranges(items: Sequence[str]) -> list[str]:
    """Runs of consecutive numbered siblings as one range: ``h.0, h.1, h.2`` -> ``h.0-h.2``."""
    out: list[str] = []
    run: list[tuple[str, int]] = []  # (parent, index) of the run so far

    def close() -> None:
        if run:
            parent, first = run[0]
            last = run[-1][1]
            dotted = f"{parent}." if parent else ""
            tail = f"{parent.rpartition('.')[2]}." if parent else ""
            out.append(f"{dotted}{first}" if len(run) == 1 else f"{dotted}{first}-{tail}{last}")
            run.clear()

    for item in items:
        parent, _, leaf = item.rpartition(".")
        if leaf.isdigit() and " " not in item and run and run[-1] == (parent, int(leaf) - 1):
            run.append((parent, int(leaf)))
        elif leaf.isdigit() and " " not in item:
            close()
            run.append((parent, int(leaf)))
        else:
            close()
            out.append(item)
    close()
    return out


def _abbreviate(names: Sequence[str], limit: int = 12) -> str:
    shown = list(names[:limit])
    return ", ".join(shown) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "") if shown else "-"
