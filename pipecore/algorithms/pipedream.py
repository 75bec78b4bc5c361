"""PipeDream (Narayanan et al., SOSP 2019): asynchronous 1F1B with weight stashing.

Forward reads the live weights and stashes that version; the backward of the same micro-batch reads
the stashed version, so each stage's gradient is exact for the weights its forward used. An update after
every ``update_every`` backwards (default 1). Stage ``s`` holds ``P-s`` versions.
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
    defaults={"update_every": 1},
    constraints=(update_every_divides_minibatch,),
)
