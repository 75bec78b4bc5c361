"""A pipeline's state in and out: :meth:`Pipeline.state_dict`, :meth:`Pipeline.full_state_dict`,
:meth:`Pipeline.load_state_dict` and :func:`merge_state_dicts`.

A state holds the model's ``state_dict`` keys of the stages it covers (live weights, buffers) and a
``"pipecore"`` entry with each stage's versions, optimizer state, the buffers its algorithm declares and the
names of the parameters its flat buffers hold, so that it loads into a pipeline of the same layout as it is, and into any other pipeline of
the model by parameter name (:mod:`pipecore.engine.reshard`).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any, Sequence

import torch

from .parts import Parts
from .reshard import canonical_names, has_parameter_names, parameter_states, stage_state, upgrade_format

#: The format of :meth:`Pipeline.state_dict`'s ``"pipecore"`` entry: 2 names the parameters each stage's flat
#: buffers hold (format 1, without the names, loads only into the same layout); 3 keeps the buffers an algorithm
#: declares under each stage's ``"buffers"`` (older formats are read through ``reshard.upgrade_format``).
STATE_FORMAT = 3


class CheckpointNote(UserWarning):
    """A checkpoint was loaded into another layout or algorithm and some state was dropped or started at zero."""


def state_dict(parts: Parts, in_flight: int) -> dict[str, Any]:
    """:meth:`Pipeline.state_dict` of the stages here (``in_flight``: their micro-batches in flight, settled)."""
    if in_flight:
        raise RuntimeError(
            f"{in_flight} micro-batch backwards are in flight; call flush() before state_dict() so the "
            "checkpoint holds one consistent version per stage"
        )
    state: dict[str, Any] = OrderedDict()
    meta = {}
    for s, st in parts.stages.items():
        state.update(st.module_state())
        state.update({alias: state[own].clone() for alias, own in parts.aliases[s].items()})
        held = st.state.state_dict()
        meta[s] = {
            "version": held["version"],
            "updates": held["updates"],
            "optimizer": _clone(held["optimizer"]),
            "buffers": _clone(held["buffers"]),
            "lr": held["lr"],
            "params": [[name, list(shape)] for name, shape in zip(st.layout.names, st.layout.shapes)],
        }
    state["pipecore"] = {
        "format": STATE_FORMAT,
        "algorithm": parts.algorithm.name,
        "num_stages": parts.num_stages,
        "n_microbatches": parts.n_microbatches,
        "stage_layers": parts.stage_layers,
        "stages": meta,
        "buffer_labels": {b.name: b.label for b in parts.algorithm.spec.buffers},
    }
    return state


def full_state_dict(parts: Parts, in_flight: int) -> dict[str, Any]:
    """:meth:`Pipeline.full_state_dict`: every process's :func:`state_dict`, on the CPU, merged."""
    return merge_state_dicts(parts.locality.gather(_on_cpu(state_dict(parts, in_flight))))


def load_state_dict(parts: Parts, state: dict[str, Any], in_flight: int) -> None:
    """:meth:`Pipeline.load_state_dict` into the stages here (``in_flight``: their micro-batches in flight,
    settled); the pipeline then begins a fresh schedule."""
    if "pipecore" not in state:
        raise KeyError(
            "load_state_dict: the state has no 'pipecore' entry: it is a plain model's state_dict, not a "
            "Pipeline.state_dict(); load it into the model before building the pipeline "
            "(model.load_state_dict(...)), which then starts with a new optimizer state")
    stages = parts.stages
    own = {k for s in stages for k in parts.stage_keys[s]} | {"pipecore"}
    known = {k for keys in parts.stage_keys for k in keys} | {"pipecore"} | {a for d in parts.aliases for a in d}
    missing, extra = sorted(own - set(state)), sorted(set(state) - known)
    if missing or extra:
        raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {extra}")
    meta = state["pipecore"]
    version = meta.get("format", 1)
    if version > STATE_FORMAT:
        raise ValueError(f"load_state_dict: the state is in pipecore state format {version}, newer than this "
                         f"pipecore reads ({STATE_FORMAT}); upgrade pipecore")
    meta = upgrade_format(meta)
    if in_flight:
        raise RuntimeError("call flush() before load_state_dict()")
    wrong = [f"{n} {tuple(state[n].shape)} in the checkpoint, {tuple(shape)} here"
             for st in stages.values() for n, shape in zip(st.layout.names, st.layout.shapes)
             if state[n].shape != shape]
    if wrong:
        raise ValueError(f"load_state_dict: the checkpoint is of another model: shapes differ for {'; '.join(wrong)}")
    if _same_layout(parts, meta):
        for s, st in stages.items():  # every stage checked before any changes: an error leaves all as they were
            st.state.check_load(meta["stages"][s]["optimizer"], meta["stages"][s]["buffers"])
        for s, st in stages.items():
            sm = meta["stages"][s]
            st.load({n: state[n] for n in st.layout.names}, sm["version"], sm["updates"], sm["optimizer"],
                    sm["buffers"])
            if "lr" in sm and st.lr_schedule is None:  # a scheduler's rate follows from the update count
                st.optimizer.set_lr(sm["lr"])
    else:
        _load_by_name(parts, state, meta)
    for st in stages.values():
        for name, buf in st.module.named_buffers():
            if name in state:
                buf.copy_(state[name])


def _same_layout(parts: Parts, meta: dict[str, Any]) -> bool:
    """Whether ``meta`` holds this process's stages with the same flat layouts and the same algorithm, so
    that each stage's state loads as it is (bit for bit, derived state included)."""
    if meta["num_stages"] != parts.num_stages or meta["algorithm"] != parts.algorithm.name:
        return False
    if any(s not in meta["stages"] for s in parts.stages):
        return False
    if not has_parameter_names(meta):  # format 1: the partition identifies the layouts
        return meta.get("stage_layers", parts.stage_layers) == parts.stage_layers
    return all([n for n, _ in meta["stages"][s]["params"]] == list(st.layout.names)
               for s, st in parts.stages.items())


def _load_by_name(parts: Parts, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Load a state saved by another layout (stages, partition, algorithm): each stage's flat buffers are
    assembled from the checkpoint's per-parameter pieces (see :mod:`pipecore.engine.reshard`)."""
    theirs = (meta["algorithm"], meta["num_stages"], meta["n_microbatches"])
    mine = (parts.algorithm.name, parts.num_stages, parts.n_microbatches)
    if not has_parameter_names(meta):
        raise ValueError(
            f"load_state_dict: the state is in pipecore state format {meta.get('format', 1)}, which does not "
            f"name the parameters each stage holds, so it loads only into a pipeline with the same algorithm, "
            f"stages and partition: it is for (algorithm, stages, micro-batches) {theirs} with layers "
            f"{meta.get('stage_layers')}, this pipeline is {mine} with layers {parts.stage_layers}")
    canonical = canonical_names(parts.captured.model)
    pieces = parameter_states(meta, canonical)
    notes: list[str] = []
    loaded = {}
    for s, st in parts.stages.items():
        sizes = [shape.numel() for shape in st.layout.shapes]
        labels = {**meta.get("buffer_labels", {}), **{b.name: b.label for b in parts.algorithm.spec.buffers}}
        loaded[s] = stage_state(s, st.layout.names, sizes, canonical, pieces, meta, st.optimizer.state_dict(),
                                st.state.buffers, labels, st.layout.buffer_numel, notes)
    for s, st in parts.stages.items():  # every stage assembled and checked before any changes
        st.state.check_load(loaded[s].optimizer, loaded[s].buffers)
    for s, st in parts.stages.items():
        got = loaded[s]
        st.load({n: state[n] for n in st.layout.names}, got.version, got.updates, got.optimizer, got.buffers)
        if got.lr is not None and st.lr_schedule is None:
            st.optimizer.set_lr(got.lr)
    if notes:
        warnings.warn(f"load_state_dict: checkpoint of {theirs} loaded into {mine} by parameter name; "
                      + "; ".join(notes), CheckpointNote, stacklevel=4)


def merge_state_dicts(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One state dict from :meth:`Pipeline.state_dict` parts that hold different stages (e.g. one per rank):
    the union of their keys, with ``"pipecore"`` holding every part's stages."""
    merged: dict[str, Any] = OrderedDict()
    meta: dict[str, Any] | None = None
    for part in parts:
        merged.update((k, v) for k, v in part.items() if k != "pipecore")
        if meta is None:
            meta = {**part["pipecore"], "stages": {}}
        meta["stages"].update(part["pipecore"]["stages"])
    if meta is None:
        raise ValueError("merge_state_dicts needs at least one state dict")
    meta["stages"] = dict(sorted(meta["stages"].items()))
    merged["pipecore"] = meta
    return merged


def _on_cpu(value: Any) -> Any:
    """``value`` with every tensor in its nested dicts moved to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    return value


def _clone(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
