"""Checkpoints as one file per stage plus a small manifest.

A checkpoint written by P ranks (each rank saves its stage) can be read by the one-process pipeline and
the reverse: files are per stage, not per process. Call ``pipe.flush()`` first for asynchronous
algorithms (no micro-batch may be in flight).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from .engine.pipeline import Pipeline

MANIFEST = "manifest.json"
FORMAT = 1


def _stage_file(stage: int) -> str:
    return f"stage{stage:03d}.pt"


def save(pipe: Pipeline, directory: str | os.PathLike) -> None:
    """Write this process's stages to ``directory`` (and the manifest, from the process that owns stage 0)."""
    os.makedirs(directory, exist_ok=True)
    state = pipe.state_dict()
    meta = state["pipecore"]
    for s, st in pipe.stages.items():
        keys = list(st.module.state_dict())
        torch.save(
            {"tensors": {k: state[k] for k in keys}, "pipecore": {**meta, "stages": {s: meta["stages"][s]}}},
            os.path.join(directory, _stage_file(s)),
        )
    if 0 in pipe.stages:
        manifest = {
            "format": FORMAT,
            "algorithm": meta["algorithm"],
            "num_stages": meta["num_stages"],
            "n_microbatches": meta["n_microbatches"],
            "stage_layers": meta["stage_layers"],
            "files": [_stage_file(s) for s in range(pipe.num_stages)],
        }
        with open(os.path.join(directory, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2)


def load(pipe: Pipeline, directory: str | os.PathLike) -> None:
    """Read this process's stages from a checkpoint written by :func:`save` (by any number of processes)."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{directory} holds no pipecore checkpoint ({MANIFEST} is missing)")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"checkpoint format {manifest.get('format')} is not supported (expected {FORMAT})")
    state: dict[str, Any] = {}
    meta: dict[str, Any] | None = None
    for s in pipe.stages:
        part = torch.load(os.path.join(directory, manifest["files"][s]), weights_only=False)
        state.update(part["tensors"])
        if meta is None:
            meta = {**part["pipecore"], "stages": {}}
        meta["stages"].update(part["pipecore"]["stages"])
    state["pipecore"] = meta
    pipe.load_state_dict(state)
