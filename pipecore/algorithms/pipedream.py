"""PipeDream (Narayanan et al., SOSP 2019): asynchronous 1F1B with weight stashing.

Forward reads the live weights and stashes that version; the backward of the same micro-batch reads
the stashed version, so each stage's gradient is exact for the weights its forward used. An update after
every ``update_every`` backwards (default 1). Stage ``s`` holds ``P-s`` versions.

Option ``slack`` (default 0): extra warm-up forwards per downstream stage (see ``async_one_f_one_b``),
to hide message latency between processes. Unlike 2BW's, PipeDream's reads depend on timing: with slack
stage ``s`` runs ``(P-s-1)*(1+slack)`` forwards ahead, so its staleness and its stashed versions grow to
``(P-s-1)*(1+slack)`` and ``(P-s-1)*(1+slack)+1`` (the simulator shows them).
"""

from ..schedule import async_one_f_one_b
from ._common import update_every_divides_minibatch, update_every_option
from .base import AlgorithmSpec, Live, SameAsForward

SPEC = AlgorithmSpec(
    name="pipedream",
    summary="async 1F1B, weight stashing: B reads F's version; P-s versions",
    schedule=async_one_f_one_b,
    forward=Live(),
    backward=SameAsForward(),
    update_every=update_every_option,
    defaults={"update_every": 1, "slack": 0},
    constraints=(update_every_divides_minibatch,),
    schedule_options=("slack",),
)
