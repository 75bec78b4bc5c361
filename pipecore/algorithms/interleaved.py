"""Interleaved 1F1B (Narayanan et al., SC'21; Megatron-LM's virtual pipeline; torch's ScheduleInterleaved1F1B).

Each rank holds ``v = stages_per_rank`` model chunks, looped (rank ``r`` holds stages ``r, r+R, ...``), and
runs 1F1B over them depth first: the bubble of 1F1B, ``(p-1)/(m+p-1)``, shrinks about ``v``-fold for ``v``
times the messages. Synchronous: every F and B of mini-batch ``t`` reads ``theta(t)``, as sequential training.
``n_microbatches`` must be a multiple of the number of ranks when ``v > 1``.

Option ``slack`` (default 1, Megatron's and torch's warm-up): extra warm-up forwards per rank downstream, which
fill the wait for the first backward when messages take time; ``slack=0`` holds 1F1B's activations (see
``interleaved_one_f_one_b``).
"""

from ..schedule.modern import interleaved_one_f_one_b
from ._common import sizes_allowed_by
from .base import AlgorithmSpec, Live

SPEC = AlgorithmSpec(
    name="interleaved-1f1b",
    aliases=("interleaved", "virtual-pipeline"),
    summary="synchronous; 1F1B over stages_per_rank looped chunks per rank (Megatron's order); 1 version",
    schedule=interleaved_one_f_one_b,
    forward=Live(),
    backward=Live(),
    defaults={"stages_per_rank": 1, "slack": 1},
    schedule_options=("stages_per_rank", "slack"),
    constraints=(sizes_allowed_by(interleaved_one_f_one_b, "stages_per_rank", "slack"),),
)
