"""Where each stage runs: the device of every stage, from ``Pipeline(devices=...)`` or the model's parameters."""

from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from ..planning.planner import Plan
from .graph import StageGraph


def stage_devices(devices: Any, graphs: Sequence[StageGraph], placement: Sequence[int],
                  nccl_rank: int | None) -> list[torch.device]:
    """The device of every stage: as given (one per stage, one per rank, or one for all), else where each
    stage's parameters are. ``nccl_rank`` is this process's rank when its stages talk over NCCL: by default
    its stages then go on its ``LOCAL_RANK`` GPU, and a device given for them must be a GPU."""
    P = len(graphs)
    ranks = max(placement) + 1
    if devices is not None and not isinstance(devices, (str, torch.device)) and len(devices) == ranks != P:
        devices = [list(devices)[placement[s]] for s in range(P)]  # one per rank: each stage on its rank's
    if devices is None:
        if nccl_rank is not None:
            own = torch.device("cuda", int(os.environ.get("LOCAL_RANK", nccl_rank)))
            return [own if placement[s] == nccl_rank else device_of(g.module) for s, g in enumerate(graphs)]
        return [device_of(g.module) for g in graphs]
    if isinstance(devices, (str, torch.device)):
        devices = [devices] * P
    devices = list(devices)
    if len(devices) != P:
        per_rank = f", one per rank ({ranks})" if ranks != P else ""
        raise ValueError(f"devices has {len(devices)} entries but there are {P} stages; give one device per "
                         f"stage{per_rank}, or one device for all of them")
    out = []
    for s, spec in enumerate(devices):
        try:
            device = torch.device(spec)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"devices[{s}] = {spec!r} is not a device (e.g. 'cpu', 'cuda:0'): {exc}") from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"devices[{s}] = {spec!r}, but CUDA is not available on this machine")
            count = torch.cuda.device_count()
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            elif device.index >= count:
                raise ValueError(f"devices[{s}] = {spec!r}, but this machine has {count} CUDA device(s)")
        elif device.type != "cpu":
            raise ValueError(f"devices[{s}] = {spec!r}: stages run on 'cpu' or 'cuda' devices")
        out.append(device)
    if nccl_rank is not None:
        for s in (s for s in range(P) if placement[s] == nccl_rank):
            if out[s].type != "cuda":
                raise ValueError(f"devices[{s}] = {out[s]}: with the NCCL backend every rank's stages are on a GPU")
    return out


def check_offload_devices(plan: Plan, devices: Sequence[torch.device], owned: Iterable[int]) -> None:
    """Offload moves saved tensors from a CUDA device to pinned host memory: a CPU stage has nowhere to move them."""
    for s in owned:
        if plan.offloaded[s] and devices[s].type != "cuda":
            raise ValueError(f"the plan offloads segments of stage {s}, which runs on {devices[s]}: activation "
                             "offload moves saved tensors from a CUDA device to pinned host memory and does not "
                             "apply on the CPU; plan on the device that trains (a CPU profile never offloads)")


def device_of(module: nn.Module) -> torch.device:
    """Where ``module``'s parameters are (the CPU for a module without parameters)."""
    return next((p.device for p in module.parameters()), torch.device("cpu"))
