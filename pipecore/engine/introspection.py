"""What a pipeline tells about itself: per-stage statistics (:meth:`Pipeline.stats`) and its layout
(:meth:`Pipeline.describe`)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

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
    for g in parts.stage_graphs:
        params = sum(p.numel() for p in g.module.parameters())
        first, last = index[g.nodes[0]], index[g.nodes[-1]]
        lines.append(f"stage {g.index}: nodes {first}-{last} ({len(g.nodes)}), {params:,} parameters")
        outer = [m for m in g.modules if not any(m.startswith(o + ".") for o in g.modules)]
        lines.append(f"  modules: {_abbreviate(outer)}")
        if g.index > 0:
            lines.append("  receives: " + ", ".join(f"{n}{' ' + meta[n] if n in meta else ''}" for n in g.inputs))
        if g.outputs:
            lines.append("  sends:    " + ", ".join(f"{n}{' ' + meta[n] if n in meta else ''}" for n in g.outputs))
    sync = parts.tie_sync
    for name, held in parts.ties.items():
        lines.append(f"tied: {name} held by stages {', '.join(f'{s} ({local})' for s, local in held)}"
                     + (f"; gradients applied {sync.delay} update(s) late" if sync and sync.delay else ""))
    return "\n".join(lines)


def _abbreviate(names: Sequence[str], limit: int = 12) -> str:
    shown = list(names[:limit])
    return ", ".join(shown) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "") if shown else "-"
