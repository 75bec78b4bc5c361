"""One stage's parameters as one flat buffer, and views that make a flat tensor look like the module's."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class FlatLayout:
    """Names, shapes and offsets of a stage's parameters inside a flat buffer."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: torch.dtype

    @classmethod
    def of(cls, module: nn.Module, stage: int) -> "FlatLayout":
        names, shapes, offsets, total, dtypes = [], [], [], 0, set()
        for name, p in module.named_parameters():
            names.append(name)
            shapes.append(p.shape)
            offsets.append(total)
            total += p.numel()
            dtypes.add(p.dtype)
        if len(dtypes) > 1:
            raise ValueError(f"stage {stage} mixes parameter dtypes {sorted(map(str, dtypes))}; use one floating dtype per stage")
        dtype = dtypes.pop() if dtypes else torch.float32
        if not dtype.is_floating_point:
            raise ValueError(f"stage {stage} has parameters of dtype {dtype}; pipecore trains floating-point weights")
        return cls(tuple(names), tuple(shapes), tuple(offsets), total, dtype)

    @property
    def buffer_numel(self) -> int:
        """Elements to allocate per flat buffer: a stage without parameters still gets one (unused) element,
        so that every stage runs the same code."""
        return max(self.numel, 1)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter-shaped views into ``flat`` (no copy)."""
        return {
            name: flat[off: off + shape.numel()].view(shape)
            for name, shape, off in zip(self.names, self.shapes, self.offsets)
        }

    def gather(self, module: nn.Module, out: torch.Tensor) -> None:
        """Copy the module's current parameter values into ``out``."""
        params = dict(module.named_parameters())
        for name, view in self.views(out).items():
            view.copy_(params[name].detach())
