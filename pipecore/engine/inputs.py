"""Mini-batches as users give them (a tensor, a tuple or a dict of tensors), their micro-batches, and the
payloads that carry a stage's values to the next."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, Union

import torch

from .graph import describe_path

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


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def as_model_inputs(x: Batch, captured: "CapturedModel") -> tuple[torch.Tensor, ...]:
    """The tensors the captured forward reads, in its input order, from ``x``: a tensor (a forward that
    reads one input), a tuple (positional arguments), a dict (arguments by name), or the one dict or dataclass
    of tensors that a forward such as ``forward(self, batch)`` takes (its entries that the forward reads)."""
    names = captured.input_names
    arguments = captured.argument_names
    containers = captured.container_arguments
    if isinstance(x, torch.Tensor):
        if containers:
            listed = ", ".join(input_label(captured, name) for name in names)
            raise TypeError(f"the model's forward reads its argument {containers[0]!r} as a dict or dataclass "
                            f"({listed}); give x as that dict or dataclass, not one tensor")
        if len(names) != 1:
            raise TypeError(f"the model's forward reads {len(names)} inputs ({', '.join(names)}); give x as a tuple "
                            f"or a dict of tensors, not one tensor")
        return (x,)
    if isinstance(x, Mapping) and not set(x) <= set(arguments) and arguments and arguments[0] in containers:
        # A forward(self, batch) whose batch is a dict: x is that dict, not arguments by name.
        given = {arguments[0]: x}
    elif _is_dataclass_instance(x):
        given = {arguments[0]: x} if arguments else {}
    elif isinstance(x, Mapping):
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
        hint = ("; pipecore takes x as the one dict this forward takes only if the forward reads its entries as "
                f"{arguments[0]}['key'] (or {arguments[0]}.key for a dataclass)" if len(arguments) == 1 else "")
        raise KeyError(f"x has {unknown} but the model's forward takes {list(arguments)}{hint}")
    specialised = [k for k in given if k in captured.specialised and given[k] is not None]
    if specialised:
        raise ValueError(f"x gives {specialised}, which the pipeline captured as their defaults (they were not in "
                         f"example_input, or in the first step's x); pass example_input with them to Pipeline(...) so "
                         f"the graph reads them")
    read = list(dict.fromkeys(captured.input_paths.get(name, (name, ()))[0] for name in names))
    missing = [argument for argument in read if argument not in given]
    if missing:
        raise KeyError(f"x is missing {missing}: the model's forward reads {read}")
    out = []
    for name in names:
        argument, path = captured.input_paths.get(name, (name, ()))
        value = given[argument]
        for depth, (kind, key) in enumerate(path):
            where = describe_path(argument, path[:depth])
            if kind == "item":
                if not isinstance(value, Mapping):
                    raise TypeError(f"the model's forward reads {describe_path(argument, path[:depth + 1])}, so "
                                    f"{where} must be a dict, got {type(value).__name__}")
                if key not in value:
                    raise KeyError(f"{where} has no entry {key!r}, which the model's forward reads; it has "
                                   f"{list(value)}")
                value = value[key]
            else:
                if not hasattr(value, key):
                    raise AttributeError(f"{where} ({type(value).__name__}) has no attribute {key!r}, which the "
                                         f"model's forward reads")
                value = getattr(value, key)
        if not isinstance(value, torch.Tensor):
            container = not path and (isinstance(value, Mapping) or _is_dataclass_instance(value))
            raise TypeError(f"input {_describe_input(captured, name)} must be a tensor, got {type(value).__name__}"
                            + ("; pipecore splits a dict or dataclass argument into the tensors the forward reads "
                               "from it by key (batch['x']) or attribute (batch.x), and this forward reads it "
                               "otherwise" if container else ""))
        out.append(value)
    return tuple(out)


def _describe_input(captured: "CapturedModel", name: str) -> str:
    """An input of the captured graph as the user's forward reads it: ``'x'``, ``batch['x']``."""
    argument, path = captured.input_paths.get(name, (name, ()))
    return describe_path(argument, path) if path else repr(name)


def input_label(captured: "CapturedModel", name: str) -> str:
    """An input of the captured graph as the forward reads it, for listings: ``x``, ``batch['x']``."""
    argument, path = captured.input_paths.get(name, (name, ()))
    return describe_path(argument, path)


@dataclass(frozen=True)
class Chunks:
    """A batch's tensors split into micro-batches: ``chunks[u]`` holds micro-batch ``u``'s slice of each."""

    chunks: list[tuple[torch.Tensor, ...]]
    samples: int
    rebuild: Callable[[tuple[torch.Tensor, ...]], Any]

    @property
    def sizes(self) -> list[int]:
        """The number of samples of each micro-batch."""
        return [chunk[0].shape[0] for chunk in self.chunks]


@dataclass(frozen=True)
class LossTarget:
    """What the last stage's loss of one micro-batch needs: the target as ``loss_fn`` takes it, and the number
    the (mean-reduced) loss is divided by before its backward. That divisor is ``update_every`` when the
    micro-batches of a mini-batch are of equal size (the accumulated gradients are then a plain mean); see
    :func:`loss_divisor` otherwise."""

    value: Any
    divisor: float


def loss_divisor(size: int, samples: int, n_microbatches: int, update_every: int) -> float:
    """What a micro-batch of ``size`` samples, out of a mini-batch of ``samples`` split into ``n_microbatches``,
    divides its mean loss by before its backward.

    A micro-batch counts in proportion to its samples: its loss is weighted by ``size * m / samples`` (1 for
    equal sizes) and divided by the micro-batches per update, as with equal sizes. When the update groups are
    the mini-batches (``update_every == m``, the synchronous schedules and 2BW), the weight is ``size /
    samples``: the accumulated gradient is the one of the plain mean loss over the mini-batch. With equal sizes
    the divisor is exactly ``update_every``, so nothing changes for batches that divide."""
    if size * n_microbatches == samples:
        return update_every
    return update_every * samples / (size * n_microbatches)


def split_batch(batch: Any, n: int, what: str, *, uneven: bool = False) -> Chunks:
    """Split every tensor of ``batch`` (a tensor, tuple or dict of tensors) into ``n`` micro-batches along
    dimension 0 as ``torch.tensor_split`` does: sizes differ by at most one, the larger ones first. All the
    tensors must have the same number of samples, at least ``n`` (every micro-batch holds one sample or more).

    With ``uneven`` (evaluation), any positive number of samples is accepted: fewer than ``n`` samples give
    ``samples`` micro-batches of one."""
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
    if samples == 0:
        raise ValueError(f"{what} holds no samples (dimension 0 is empty); a batch needs at least "
                         f"{1 if uneven else n} (n_microbatches={n})")
    if uneven:
        n = min(n, samples)
    elif samples < n:
        raise ValueError(f"batch of {samples} samples is smaller than n_microbatches={n}: every micro-batch needs at "
                         f"least one sample; give at least {n} samples (a smaller last batch: drop_last=True) or "
                         f"use fewer micro-batches")
    # Equal sizes when n divides the batch; otherwise the first `samples % n` micro-batches hold one more.
    pieces = [t.tensor_split(n) for t in tensors]
    return Chunks([tuple(p[u] for p in pieces) for u in range(n)], samples, rebuild)
