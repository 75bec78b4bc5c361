"""Splitting a sequential model into contiguous stages."""

from __future__ import annotations

from typing import Sequence

from torch import nn


def as_layers(model: nn.Module | Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The model's layers with their names in ``model.state_dict()`` (``"0"``, ``"1"``, ... for a list)."""
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    if isinstance(model, (list, tuple, nn.ModuleList)):
        return [(str(i), m) for i, m in enumerate(model)]
    raise TypeError(
        f"pipecore.Pipeline needs an nn.Sequential or a list of modules (stages are contiguous slices of it), "
        f"got {type(model).__name__}"
    )


def balanced_by_parameters(sizes: Sequence[int], num_stages: int) -> list[int]:
    """Split points (start index of stages 1..P-1) minimising the largest stage's parameter count.

    Ties are broken towards earlier, more even layer counts. Every stage gets at least one layer.
    """
    n = len(sizes)
    prefix = [0]
    for x in sizes:
        prefix.append(prefix[-1] + x)
    inf = float("inf")
    # best[p][i]: minimal max-stage size for the first i layers in p stages; cut[p][i]: where stage p starts.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for p in range(1, num_stages + 1):
        for i in range(p, n + 1):
            for j in range(p - 1, i):
                cost = max(best[p - 1][j], prefix[i] - prefix[j])
                if cost < best[p][i]:
                    best[p][i], cut[p][i] = cost, j
    splits, i = [], n
    for p in range(num_stages, 0, -1):
        i = cut[p][i]
        splits.append(i)
    return sorted(splits)[1:]


def split_points(
    layers: Sequence[tuple[str, nn.Module]], num_stages: int, partition: Sequence[int] | None
) -> list[int]:
    """Validated start indices of stages 1..P-1."""
    n = len(layers)
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > n:
        raise ValueError(f"num_stages={num_stages} is larger than the number of layers ({n}); each stage needs a layer")
    if partition is None:
        sizes = [sum(p.numel() for p in m.parameters()) for _, m in layers]
        return balanced_by_parameters(sizes, num_stages)
    points = list(partition)
    if len(points) != num_stages - 1:
        raise ValueError(
            f"partition must list {num_stages - 1} split indices (the first layer of stages 1..{num_stages - 1}), "
            f"got {points}"
        )
    if any(not 0 < p < n for p in points) or any(a >= b for a, b in zip(points, points[1:])):
        raise ValueError(f"partition {points} must be strictly increasing indices in 1..{n - 1}")
    return points
