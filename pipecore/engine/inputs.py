"""Mini-batches as users give them (a tensor, a tuple or a dict of tensors), their micro-batches, and the
payloads that carry a stage's values to the next."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, Union

import torch

if TYPE_CHECKING:
    from .graph import CapturedModel

Batch = Union[torch.Tensor, Sequence[torch.Tensor], Mapping[str, torch.Tensor]]


def as_payload(values: tuple[Any, ...]) -> Any:
    """A message payload between stages: one value travels as itself, several as a tuple."""
    return values[0] if len(values) == 1 else values


def from_payload(payload: Any, count: int) -> tuple[Any, ...]:
    """The ``count`` values of a payload made by :func:`as_payload`."""
    return (payload,) if count == 1 else tuple(payload)


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` (a tensor, None, or tuples, lists and dicts of them: a message payload, a target) on
    ``device``. Copies to a GPU are non-blocking (ordered on the current stream); a copy to the CPU waits,
    since the CPU reads it next."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device, non_blocking=device.type == "cuda")
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    return value


def as_model_inputs(x: Batch, captured: "CapturedModel") -> tuple[torch.Tensor, ...]:
    """The tensors the captured forward reads, in its argument order, from ``x``: a tensor (a forward that
    reads one input), a tuple (positional arguments) or a dict (arguments by name)."""
    names = captured.input_names
    arguments = captured.argument_names
    if isinstance(x, torch.Tensor):
        if len(names) != 1:
            raise TypeError(f"the model's forward reads {len(names)} inputs ({', '.join(names)}); give x as a tuple "
                            f"or a dict of tensors, not one tensor")
        return (x,)
    if isinstance(x, Mapping):
        given = dict(x)
    elif isinstance(x, (tuple, list)):
        if len(x) > len(arguments):
            raise TypeError(f"x has {len(x)} values but the model's forward takes {len(arguments)} arguments "
                            f"({', '.join(arguments)})")
        given = dict(zip(arguments, x))
    else:
        raise TypeError(f"x must be a tensor, a tuple or a dict of tensors, got {type(x).__name__}")
    unknown = [k for k in given if k not in arguments]
    if unknown:
        raise KeyError(f"x has {unknown} but the model's forward takes {list(arguments)}")
    specialised = [k for k in given if k in captured.specialised and given[k] is not None]
    if specialised:
        raise ValueError(f"x gives {specialised}, which the pipeline captured as their defaults (they were not in "
                         f"example_input); pass example_input with them to Pipeline(...) so the graph reads them")
    missing = [k for k in names if k not in given]
    if missing:
        raise KeyError(f"x is missing {missing}: the model's forward reads {list(names)}")
    out = tuple(given[k] for k in names)
    for name, value in zip(names, out):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"input {name!r} must be a tensor, got {type(value).__name__}")
    return out


@dataclass(frozen=True)
class Chunks:
    """A batch's tensors split into micro-batches: ``chunks[u]`` holds micro-batch ``u``'s slice of each."""

    chunks: list[tuple[torch.Tensor, ...]]
    samples: int
    rebuild: Callable[[tuple[torch.Tensor, ...]], Any]


def split_batch(batch: Any, n: int, what: str, *, uneven: bool = False) -> Chunks:
    """Split every tensor of ``batch`` (a tensor, tuple or dict of tensors) into ``n`` micro-batches along
    dimension 0; all must have the same number of samples, divisible by ``n``.

    With ``uneven`` (evaluation, where no loss is averaged over micro-batches), any positive number of
    samples is split into ``min(n, samples)`` micro-batches whose sizes differ by at most one, the larger
    ones first (``torch.tensor_split``)."""
    if isinstance(batch, torch.Tensor):
        names, tensors, rebuild = ["0"], [batch], lambda t: t[0]
    elif isinstance(batch, Mapping):
        keys = list(batch)
        names, tensors = [repr(k) for k in keys], list(batch.values())
        rebuild = lambda t, keys=keys: dict(zip(keys, t))  # noqa: E731
    elif isinstance(batch, (tuple, list)):
        names, tensors = [str(i) for i in range(len(batch))], list(batch)
        kind = type(batch)
        rebuild = lambda t, kind=kind: kind(t)  # noqa: E731
    else:
        raise TypeError(f"{what} must be a tensor, a tuple or a dict of tensors, got {type(batch).__name__}")
    if not tensors:
        raise ValueError(f"{what} holds no tensor")
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}[{name}] must be a tensor, got {type(t).__name__}")
        if t.dim() == 0:
            raise ValueError(f"{what}[{name}] is a scalar; every tensor of a batch has the samples along dimension 0")
    sizes = {name: t.shape[0] for name, t in zip(names, tensors)}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"the tensors of {what} have different batch sizes (dimension 0): "
                         + ", ".join(f"{name}: {size}" for name, size in sizes.items()))
    samples = tensors[0].shape[0]
    if uneven:
        if samples == 0:
            raise ValueError(f"{what} holds no samples (dimension 0 is empty); give at least one")
        count = min(n, samples)
        pieces = [t.tensor_split(count) for t in tensors]
        return Chunks([tuple(p[u] for p in pieces) for u in range(count)], samples, rebuild)
    if samples % n:
        raise ValueError(
            f"batch of {samples} samples is not divisible by n_microbatches={n}; pipecore does not "
            f"re-chunk silently: use a batch size that is a multiple of {n} (e.g. drop_last=True)"
        )
    parts = [t.split(samples // n) for t in tensors]
    return Chunks([tuple(p[u] for p in parts) for u in range(n)], samples, rebuild)
