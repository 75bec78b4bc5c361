"""Prediction: the model's output through the stages, forwards only (:meth:`Pipeline.predict`).

The micro-batches go through every stage with its live weights; in one process in turn on the calling
thread (:func:`forward_here`), with one process per rank down the links that carry training's activations
(:func:`forward_across_ranks`). Nothing of training changes: the forwards write into copies of the buffers and
the random state is put back.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from ..runtime.distributed import DistributedTransport
from ..runtime.worker import Message
from ..schedule.ir import F
from .buffers import buffer_copies
from .inputs import Batch, as_model_inputs, as_payload, split_batch, to_device
from .parts import Parts
from .stage import TensorStage

# predict()'s messages between ranks: micro-batch numbers below training's (which count up from 0).
_PREDICT_HEADER = -1


def _predict_microbatch(u: int) -> int:
    return -2 - u


def predict(parts: Parts, x: Batch | None, broadcast: bool, synchronize: Callable[[], None]) -> Any:
    """:meth:`Pipeline.predict` (``synchronize`` waits for the stage threads' remaining work first)."""
    if not isinstance(broadcast, bool):
        raise TypeError(f"predict(): broadcast must be True or False, got {broadcast!r}")
    synchronize()  # with overlap_steps, the stage threads may still be updating the live weights
    chunks: list[Any] = []
    if 0 in parts.stages:
        if x is None:
            raise TypeError("predict(): x is required on the rank that runs the first stage, got None"
                            + parts.locality.input_note)
        inputs = as_model_inputs(x, parts.captured)
        split = split_batch(dict(zip(parts.captured.input_names, inputs)), parts.n_microbatches, "x", uneven=True)
        chunks = [to_device(as_payload(chunk), parts.devices[0]) for chunk in split.chunks]
    # Forwards in training mode write buffers (BatchNorm's running statistics) and draw random numbers
    # (dropout): the forwards here write into copies of the buffers, and the random state is put back, so
    # that the training that follows sees neither. Copies rather than restoring the buffers in place: the
    # graphs of micro-batches in flight saved some of them (BatchNorm's), and autograd refuses a backward
    # through a tensor modified in place since, even to its old values.
    stages = parts.stages
    cuda = sorted({st.device.index or 0 for st in stages.values() if st.device.type == "cuda"})
    with buffer_copies([st.module for st in stages.values()]), torch.random.fork_rng(devices=cuda):
        return parts.locality.predict(stages, chunks, broadcast)


def forward_here(stages: Mapping[int, TensorStage], payload: Any) -> Any:
    """One micro-batch through every stage, in turn on the calling thread (one process)."""
    for s in sorted(stages):
        st = stages[s]
        payload = st.predict_forward(to_device(payload, st.device))
    return payload


def forward_across_ranks(transport: DistributedTransport, rank: int, placement: Sequence[int],
                         stages: Mapping[int, TensorStage], chunks: list[Any], broadcast: bool) -> Any:
    """This rank's share of :meth:`Pipeline.predict` with one process per rank.

    The messages travel through the training transport, on the links that carry activations, between
    steps: by then every activation of the steps so far has been taken (the last stage's loss needs
    them), so the link is empty, and its per-link bookkeeping (sizes, acknowledgements, the receive kept
    posted) stays what the next step expects. Their micro-batch numbers are negative, apart from
    training's; a rank out of step is reported by the transport rather than mixing messages up."""
    last = len(placement) - 1
    last_rank = placement[last]
    outputs: list[Any] = []
    shared = broadcast
    # This rank's stages in order (with several per rank, the messages go round the ranks in between).
    for s in sorted(stages):
        st = stages[s]
        # First, down the same link: how many micro-batches follow and rank 0's `broadcast`, so that every
        # rank knows what to expect and all broadcast alike (none is left waiting by a rank that disagrees).
        if s == 0:
            header = torch.tensor([len(chunks), int(broadcast)], dtype=torch.int64)
        else:
            header = transport.receive(s, F, _PREDICT_HEADER).payload.cpu()
        if s < last:
            transport.send(s + 1, F, _PREDICT_HEADER, Message(header))
        count, shared = int(header[0]), bool(header[1])
        for u in range(count):
            payload = chunks[u] if s == 0 else transport.receive(s, F, _predict_microbatch(u)).payload
            out = st.predict_forward(to_device(payload, st.device))
            if s < last:
                transport.send(s + 1, F, _predict_microbatch(u), Message(out))
            else:
                outputs.append(out)
    # Complete the sends now (the next rank takes them in its own predict), rather than holding their
    # buffers until training's next gradient acknowledges them: an evaluation loop would pile them up.
    transport.complete_sends(F)
    result = concatenate(outputs) if rank == last_rank else None
    if shared:
        received = transport.broadcast_object(to_device(result, torch.device("cpu")) if rank == last_rank else None,
                                              last_rank)
        if rank != last_rank:
            result = to_device(received, stages[min(stages)].device)
    if broadcast != shared:
        raise ValueError(f"predict(): rank {rank} passed broadcast={broadcast} but rank 0 passed broadcast={shared}; "
                         f"every rank must pass the same (this rank followed rank 0's)")
    return result


def concatenate(parts: Sequence[Any]) -> Any:
    """The last stage's outputs of the micro-batches, in order, as one output of the same structure: tensors
    concatenated along dimension 0; tuples (named ones too), lists and dicts entry by entry; None and plain
    constants (equal in every part) kept."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise ValueError("predict(): the model's output holds a 0-dimensional tensor, which has no samples to "
                             "concatenate along dimension 0; predict() needs every output tensor to have the "
                             "samples along dimension 0")
        return first if len(parts) == 1 else torch.cat(list(parts))
    if isinstance(first, dict):
        merged = {k: concatenate([p[k] for p in parts]) for k in first}
        if type(first) is dict:
            return merged
        try:  # a dict of the model's own type, such as a Hugging Face ModelOutput (a dataclass)
            return type(first)(**merged)
        except TypeError:
            return type(first)(merged)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(concatenate(column) for column in zip(*parts)))
    if isinstance(first, (tuple, list)):
        return type(first)(concatenate(column) for column in zip(*parts))
    if (first is None or isinstance(first, (bool, int, float, str))) and all(p == first for p in parts):
        return first
    raise TypeError(f"predict(): the model's output holds a {type(first).__name__} ({first!r}) that differs "
                    "between micro-batches; predict() concatenates tensors along dimension 0 and keeps only "
                    "constants that are the same in every micro-batch")
