"""Universal checkpoints: what each stage's flat buffers hold, mapped back to the model's parameter names.

A stage keeps its weights, its optimizer state (SGD's momentum, AdamW's and NAdam's ``exp_avg``/``exp_avg_sq``) and the
buffers its algorithm declares (:mod:`pipecore.algorithms.state`) as flat buffers in the order of its
:class:`~pipecore.engine.flat.FlatLayout`.
:meth:`Pipeline.state_dict` records that order per stage (``"params"``: names and shapes), so a checkpoint
can be cut into per-parameter pieces (:func:`parameter_states`) and reassembled in the layout of any other
pipeline of the same model (:func:`stage_state`): another number of stages, another partition, another
number of micro-batches or another algorithm. A tied parameter is one logical weight under several names
(GPT's ``head.weight`` is ``tok_emb.weight``): pieces are keyed by the model's first name for it.

A checkpoint holds one weight version per stage, the live one (``state_dict`` needs a flushed pipeline), so
the older versions an asynchronous algorithm keeps in flight are never part of it. The buffers an algorithm
declares map by name where the target keeps them too; where the target does not keep one, it is dropped with a
warning, and where the checkpoint does not hold it, the target starts it at zero (as a new pipeline does) with a
warning. Checkpoints of older formats are read through :func:`upgrade_format`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..algorithms import SPECS


@dataclass
class ParameterState:
    """One parameter's share of a checkpoint: the stage that held it and its slices of that stage's flat
    optimizer tensors (parameter-shaped), of a torch optimizer's per-parameter state, and of the declared buffers."""

    stage: int
    optimizer: dict[str, torch.Tensor] = field(default_factory=dict)
    torch_state: dict[str, Any] | None = None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


def upgrade_format(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's ``"pipecore"`` entry in the current format (3: each stage's declared buffers under
    ``"buffers"``, their labels under ``"buffer_labels"``). Formats 1 and 2 kept the buffers where the checkpoint's
    algorithm declares they were saved (``StateBuffer.saved_as``): a key of the stage's entry, or
    ``"optimizer.<key>"`` inside its optimizer state. Tensors are shared, not copied."""
    if meta.get("format", 1) >= 3:
        return dict(meta)
    spec = SPECS.get(meta["algorithm"])
    declared = () if spec is None else spec.buffers
    stages = {}
    for s, sm in meta["stages"].items():
        sm = dict(sm)
        optimizer = dict(sm["optimizer"])
        buffers = {}
        for buffer in declared:
            for path in buffer.saved_as:
                table, key = (optimizer, path.partition(".")[2]) if path.startswith("optimizer.") else (sm, path)
                value = table.pop(key, None)
                if value is not None:
                    buffers[buffer.name] = value
        for path in {p for b in declared for p in b.saved_as}:  # None entries of buffers a stage did not keep
            (optimizer if path.startswith("optimizer.") else sm).pop(path.partition(".")[2] or path, None)
        sm["optimizer"], sm["buffers"] = optimizer, buffers
        stages[s] = sm
    return {**meta, "stages": stages, "buffer_labels": {b.name: b.label for b in declared}}


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every name of every parameter of ``model`` -> the model's first name for that parameter (tied weights
    have several names; ``named_parameters()`` reports the first)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def has_parameter_names(meta: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's ``"pipecore"`` entry records each stage's parameter names (format 2 on)."""
    return all("params" in sm for sm in meta["stages"].values())


def parameter_states(meta: Mapping[str, Any], canonical: Mapping[str, str]) -> dict[str, ParameterState]:
    """The checkpoint's per-parameter state, keyed by canonical name (the first stage holding a tied parameter
    gives it: the owners of a tied weight keep identical copies)."""
    out: dict[str, ParameterState] = {}
    for s, sm in sorted(meta["stages"].items()):
        names = [n for n, _ in sm["params"]]
        shapes = [torch.Size(shape) for _, shape in sm["params"]]
        numel = sum(math.prod(shape) for shape in shapes)
        buffer_numel = max(numel, 1)  # FlatLayout.buffer_numel
        opt = sm["optimizer"]
        flat = {k: v for k, v in opt.items() if _is_flat(v, buffer_numel)}
        torch_state = opt["torch"]["state"] if "torch" in opt else None
        buffers = sm["buffers"]
        offset = 0
        for i, (name, shape) in enumerate(zip(names, shapes)):
            n = math.prod(shape)
            key = canonical.get(name, name)
            if key not in out:
                piece = lambda t: t[offset: offset + n].view(shape)  # noqa: E731
                out[key] = ParameterState(
                    stage=s,
                    optimizer={k: piece(v) for k, v in flat.items()},
                    torch_state=None if torch_state is None else torch_state.get(i),
                    buffers={name: piece(b) for name, b in buffers.items()},
                )
            offset += n
    return out


def _is_flat(value: Any, buffer_numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == buffer_numel


@dataclass
class LoadedStage:
    """What :meth:`TensorStage.load` takes, assembled for one stage of the target pipeline."""

    version: int
    updates: int
    optimizer: dict[str, Any]
    buffers: dict[str, torch.Tensor]
    lr: float | None


def stage_state(stage: int, names: Sequence[str], sizes: Sequence[int], canonical: Mapping[str, str],
                pieces: Mapping[str, ParameterState], meta: Mapping[str, Any], template: Mapping[str, Any],
                buffers: Mapping[str, torch.Tensor], labels: Mapping[str, str], buffer_numel: int,
                notes: list[str]) -> LoadedStage:
    """The state of target stage ``stage`` whose flat buffers hold ``names`` (of ``sizes`` elements) in order:
    its optimizer state in the format of ``template`` (the target optimizer's own ``state_dict()``), each of its
    declared ``buffers`` (the target's, by name; ``labels`` name them and the checkpoint's in notes), the largest
    version and update count of the checkpoint's stages that held its parameters (after a flush they agree) and
    the learning rate of the one that held its first parameter. ``meta`` is in the current format
    (:func:`upgrade_format`). Lossy conversions are appended to ``notes``."""
    missing = [n for n in names if canonical.get(n, n) not in pieces]
    if missing:
        raise KeyError(f"load_state_dict: the state holds no optimizer state or versions of stage(s) [{stage}]: "
                       f"none for its parameter(s) {_few(missing)} (a state of some stages only loads into the same "
                       "stages; pass a full_state_dict())")
    mine = [pieces[canonical.get(n, n)] for n in names]
    sources = sorted({p.stage for p in mine}) or [min(meta["stages"])]
    source_meta = [meta["stages"][s] for s in sources]
    updates = {sm["updates"] for sm in source_meta}
    if len(updates) > 1:
        notes.append(f"stage {stage} takes parameters from checkpoint stages {sources}, which applied different "
                     f"numbers of updates ({sorted(updates)}); it continues from the largest")
    first = source_meta[0]
    optimizer: dict[str, Any] = {}
    for key, value in template.items():
        if key == "torch":
            optimizer[key] = _torch_state(value, mine, first["optimizer"], stage)
        elif isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == buffer_numel:
            optimizer[key] = _assemble(key, [p.optimizer.get(key) for p in mine], value, names, sizes, stage,
                                       notes)
        elif value is None:
            if any(p.optimizer.get(key) is not None for p in mine):
                notes.append(f"stage {stage}: the checkpoint's optimizer state {key!r} is dropped (this pipeline "
                             "does not keep it)")
            optimizer[key] = None
        else:  # per-stage scalars (the step count, NAdam's mu_product): see _scalar_source
            holders = [sm for sm in source_meta if key in sm["optimizer"]]
            if not holders:
                raise KeyError(f"load_state_dict: the checkpoint's optimizer state has no {key!r}, which this "
                               f"pipeline's optimizer keeps (it was saved with another optimizer)")
            found = {sm["optimizer"][key] for sm in holders}
            if len(found) > 1:
                notes.append(f"stage {stage}: optimizer {key!r} differs between checkpoint stages {sources} "
                             f"({sorted(found)}); it continues from the stage that made the most steps")
            optimizer[key] = _scalar_source(holders)["optimizer"][key]
    kept_by_target = set(template)
    dropped = sorted({key for sm in source_meta for key, value in sm["optimizer"].items()
                      if key not in kept_by_target and value is not None}
                     | {key for p in mine for key in p.optimizer if key not in kept_by_target})
    for key in dropped:  # state of another optimizer this one does not keep (NAdam's mu_product into AdamW)
        notes.append(f"stage {stage}: the checkpoint's optimizer state {key!r} is dropped (this pipeline's optimizer "
                     "does not keep it)")
    own = {name: _assemble(name, [p.buffers.get(name) for p in mine], like, names, sizes, stage, notes,
                           label=labels.get(name, repr(name)))
           for name, like in buffers.items()}
    for name in sorted({n for p in mine for n in p.buffers} - set(buffers)):
        notes.append(f"stage {stage}: the checkpoint's {labels.get(name, repr(name))} is dropped (this pipeline's "
                     "algorithm keeps none)")
    versions = [sm["version"] for sm in source_meta]
    return LoadedStage(version=max(versions), updates=max(updates), optimizer=optimizer, buffers=own,
                       lr=first.get("lr"))


def _scalar_source(holders: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The checkpoint stage whose optimizer scalars a target stage takes when its source stages disagree: the one
    that made the most steps (the first of them). All scalars come from one stage, so that those that go together
    stay together: NAdam's ``mu_product`` is the product of the momentum coefficients of exactly ``steps`` steps
    (and shrinks as ``steps`` grows, so the largest of each would not match)."""
    return max(holders, key=lambda sm: sm["optimizer"].get("steps", 0))


def _assemble(key: str, parts: Sequence[torch.Tensor | None], like: torch.Tensor, names: Sequence[str],
              sizes: Sequence[int], stage: int, notes: list[str], label: str | None = None) -> torch.Tensor:
    """One flat tensor like ``like`` from per-parameter ``parts`` (of ``sizes`` elements) in layout order. An
    absent part of a declared buffer (``label`` given) stays zero, as a new pipeline starts it; of optimizer state
    it is an error."""
    absent = [n for n, p in zip(names, parts) if p is None]
    if absent:
        if label is None:
            raise KeyError(f"load_state_dict: the checkpoint's optimizer state has no {key!r} for {_few(absent)} "
                           f"(stage {stage}); it was saved with another optimizer or optimizer configuration")
        which = "" if len(absent) == len(names) else f" for {_few(absent)}"
        notes.append(f"stage {stage}: the checkpoint holds no {label}{which}; it starts at zero")
    out = torch.zeros_like(like)
    offset = 0
    for part, n in zip(parts, sizes):
        if part is not None:
            out[offset: offset + n].copy_(part.reshape(-1))
        offset += n
    return out


def _few(names: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _torch_state(template: Mapping[str, Any], mine: Sequence[ParameterState], source: Mapping[str, Any],
                 stage: int) -> dict[str, Any]:
    """A torch optimizer's ``state_dict`` for this stage: per-parameter state by name, the hyperparameters of
    the checkpoint's stage that held the first parameter."""
    if "torch" not in source:
        raise KeyError(f"load_state_dict: stage {stage} uses a torch optimizer, but the checkpoint's optimizer state "
                       "is pipecore's fused SGD, AdamW or NAdam; load it with the optimizer it was saved with")
    groups = template["param_groups"]
    theirs = source["torch"]["param_groups"]
    if len(groups) != 1 or len(theirs) != 1:
        raise ValueError("load_state_dict: a torch optimizer with several parameter groups loads only into the same "
                         "stages and partition it was saved with")
    group = {**{k: v for k, v in theirs[0].items() if k != "params"}, "params": groups[0]["params"]}
    state = {i: p.torch_state for i, p in zip(groups[0]["params"], mine) if p.torch_state is not None}
    return {"state": state, "param_groups": [group]}
