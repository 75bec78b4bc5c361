"""PipeDream with delay compensation (DC-ASGD: Zheng et al., ICML 2017, arXiv 1609.08326).

PipeDream's schedule and weight stashing (forward on the live weights, backward on the stashed version), and each
update's gradient corrected for its delay before the optimizer steps. DC-ASGD approximates the gradient at the
weights it is applied to, ``W_now``, from the gradient ``g`` computed at older weights ``W_bak`` by a first-order
Taylor expansion whose Hessian is approximated by the diagonal of the gradient's outer product:

    g_dc = g + lam * g * g * (W_now - W_bak)          (element-wise)

In a pipeline ``W_bak`` is the stash, the version the micro-batch's forward read at the stage, and ``W_now`` the
live weights the update applies to: ``P-1-s`` updates newer in the steady state (with ``slack``, up to
``(P-1-s)*(1+slack)``). The optimizer then steps with ``g_dc`` as it would with any gradient (the paper's is
SGD: ``W <- W - lr * g_dc``). The last stage has no delay; it keeps and corrects nothing. A weight tied across
stages (an embedding and a language model's head) takes the sum of its owners' gradients, computed at their own
stashes: there is no one ``W_bak`` to correct it by, and every copy must take the same step, so it is applied
uncorrected.

The adaptive variant (DC-ASGD-a, ``adaptive=True``) scales ``lam`` element-wise by a running mean square of the
gradient, kept per stage as a declared buffer (``mean_square``) and updated with the gradient before it is used:

    MeanSquare <- m * MeanSquare + (1 - m) * g * g
    lam_t      = lam / sqrt(MeanSquare + eps)

Options: ``lam`` (the paper's lambda, or lambda_0 when adaptive; default 0.04, or 2.0 when adaptive),
``adaptive`` (False), ``mean_square_decay`` (``m``, 0.95), ``eps`` (1e-7; keeps ``lam_t`` finite where the
gradient has been zero, an implementation choice), ``slack`` (as PipeDream's). One update per micro-batch: the
correction of one micro-batch's gradient reads the one version its forward read. Stage ``s`` holds ``P-s+1``
versions (one more than PipeDream: the stashed version stays until the update that reads it).

Evidence: the correction is the paper's (recalled, as the algorithms specification gives it; the full text was
not re-read here); DC-ASGD-a's form (the mean square updated with the gradient first, ``lam`` divided by its square
root) and the defaults (``lam`` 0.04 for the constant variant; ``lam`` 2 and ``m`` 0.95 for DC-ASGD-a, CIFAR-10)
were read in third-party implementations of the paper (secondary) and agree with the specification's
recollection. The paper's setting is a parameter server, its ``W_bak`` the model a worker pulled; here the stash.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..schedule import async_one_f_one_b
from .base import Algorithm, AlgorithmSpec, Live, Options, SameAsForward
from .state import BeforeStep, ChangedBeforeStep, GradientTransform, StateBuffer

DEFAULT_LAM = 0.04
DEFAULT_ADAPTIVE_LAM = 2.0


def compensation(algorithm: Algorithm) -> float:
    """``lam``, or its default for the variant."""
    lam = algorithm.options["lam"]
    if lam is None:
        return DEFAULT_ADAPTIVE_LAM if algorithm.options["adaptive"] else DEFAULT_LAM
    return float(lam)


def _delayed(stage: int, algorithm: Algorithm) -> bool:
    """Whether the stage's gradients are ever older than the weights they update (all but the last stage)."""
    return stage < algorithm.num_stages - 1


class DelayCompensation(GradientTransform):
    """``g <- g + lam_t * g * g * (W_now - W_bak)``, with ``lam_t = lam`` or, adaptive,
    ``lam / sqrt(MeanSquare + eps)`` after ``MeanSquare <- m*MeanSquare + (1-m)*g*g``."""

    reads_gradient_weights = True

    def __init__(self, lam: float, adaptive: bool, decay: float, eps: float):
        self.lam, self.adaptive, self.decay, self.eps = lam, adaptive, decay, eps

    def apply(self, grad: torch.Tensor, before: BeforeStep) -> None:
        assert before.gradient_weights is not None
        mean_square = before.buffer(MEAN_SQUARE.name) if self.adaptive else None
        dtype = torch.float64 if grad.dtype == torch.float64 else torch.float32  # the state's dtype
        g = grad.to(dtype)
        term = g * g
        term.mul_(before.weights.to(dtype) - before.gradient_weights.to(dtype))
        if mean_square is not None:
            mean_square.mul_(self.decay).addcmul_(g, g, value=1.0 - self.decay)
            term.div_(torch.sqrt(mean_square + self.eps))
        for start, stop in before.tied:
            term[start:stop] = 0.0  # summed over owners whose stashes differ: no one W_bak, applied as computed
        grad.add_(term.to(grad.dtype), alpha=self.lam)


def _transform(stage: int, algorithm: Algorithm) -> DelayCompensation | None:
    if not _delayed(stage, algorithm):
        return None
    o = algorithm.options
    return DelayCompensation(compensation(algorithm), o["adaptive"], float(o["mean_square_decay"]), float(o["eps"]))


_MEAN_SQUARE = ChangedBeforeStep()

#: DC-ASGD-a's ``MeanSquare``, the running mean of ``g*g``, at the stages that correct (adaptive only).
MEAN_SQUARE = StateBuffer("mean_square", "mean square of the gradient (adaptive delay compensation)",
                          lambda stage, algorithm: _MEAN_SQUARE if algorithm.options["adaptive"]
                          and _delayed(stage, algorithm) else None)


def _check_options(num_stages: int, n_microbatches: int, options: Options) -> str | None:
    lam = options["lam"]
    if lam is not None and (not isinstance(lam, numbers.Real) or isinstance(lam, bool) or not math.isfinite(lam)
                            or lam < 0):
        return f"lam must be a finite number >= 0 (0: no compensation), got {lam!r}"
    if not 0.0 <= options["mean_square_decay"] < 1.0:
        return f"mean_square_decay must be in [0, 1), got {options['mean_square_decay']}"
    if not options["eps"] > 0.0:
        return f"eps must be > 0 (it keeps lam / sqrt(MeanSquare + eps) finite), got {options['eps']}"
    return None


SPEC = AlgorithmSpec(
    name="pipedream-dc",
    summary="async 1F1B, weight stashing; gradient delay-compensated g + lam*g*g*(W_now - W_stash); P-s+1 versions",
    schedule=async_one_f_one_b,
    forward=Live(),
    backward=SameAsForward(),
    update_every=lambda n_microbatches, options: 1,
    defaults={"lam": None, "adaptive": False, "mean_square_decay": 0.95, "eps": 1e-7, "slack": 0},
    constraints=(_check_options,),
    buffers=(MEAN_SQUARE,),
    gradient_transform=_transform,
    schedule_options=("slack",),
)
