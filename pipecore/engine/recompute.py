"""Recomputed segments: parts of a stage whose forward is run again in the backward instead of kept.

A plan (``pipecore.plan``) may recompute node ranges ``[i, j)`` of a stage to fit a memory limit. Each range
becomes a :class:`Recomputed` module in the stage's generated graph: its forward runs the segment under
``torch.utils.checkpoint`` (non-reentrant), which keeps only the segment's inputs and drops what the segment's
nodes save; the backward recomputes the segment, with the same random state (dropout masks), with the weights
the forward read (they are passed to the checkpoint, not looked up again: by the backward the stage's modules
hold other weights), and on copies of the buffers (BatchNorm counts each micro-batch once).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from .memory import counting_recomputation, note_kept
from .segments import replace_segments
from .buffers import buffer_copies


class Recomputed(nn.Module):
    """A segment of a stage's graph, recomputed in the backward (see the module docstring)."""

    def __init__(self, segment: fx.GraphModule):
        super().__init__()
        self.segment = segment

    def forward(self, *inputs: Any) -> Any:
        # The weights the segment's modules hold now (the stage swapped in those its forward reads).
        slots = [(m, name, p) for m in self.segment.modules() for name, p in m._parameters.items() if p is not None]
        weights = list({id(p): p for _, _, p in slots}.values())
        where = {id(w): i for i, w in enumerate(weights)}
        places = [(m, name, where[id(p)]) for m, name, p in slots]
        count = len(inputs)
        first = [True]

        def run(*values: Any) -> Any:
            if first[0]:  # the forward itself: the modules hold these weights already
                first[0] = False
                return self.segment(*values[:count])
            # The recomputation's outputs are dropped (the checkpoint keeps what it saves) before its
            # transient is counted.
            with _holding(places, values[count:]), buffer_copies([self.segment]), counting_recomputation():
                self.segment(*values[:count])
            return None

        note_kept(inputs)  # the checkpoint keeps them for the backward, outside autograd's saved tensors
        # No early stop: the recomputation runs the whole segment, as the plan's time model counts it, and
        # ends normally, so that its transient is counted without the interrupted frame's temporaries.
        with set_checkpoint_early_stop(False):
            return checkpoint(run, *inputs, *weights, use_reentrant=False, preserve_rng_state=True)


@contextmanager
def _holding(places: Sequence[tuple[nn.Module, str, int]], weights: Sequence[torch.Tensor]) -> Iterator[None]:
    originals = [m._parameters[name] for m, name, _ in places]
    try:
        for m, name, i in places:
            m._parameters[name] = weights[i]
        yield
    finally:
        for (m, name, _), original in zip(places, originals):
            m._parameters[name] = original


def recompute_segments(gm: fx.GraphModule, segments: Sequence[Sequence[str]]) -> None:
    """Rewrite ``gm`` (a stage's generated module) so that each segment, a run of consecutive compute nodes
    named in order, is one :class:`Recomputed` call whose outputs replace the segment's values."""
    replace_segments(gm, segments, Recomputed, "recomputed")
