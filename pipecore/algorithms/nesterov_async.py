"""The Nesterov method for asynchronous pipelines (Ajanthan et al., ICML 2025, arXiv 2505.01099).

PipeDream's schedule and weight stashing, with the optimizer's momentum taken as a Nesterov look-ahead whose
gradient term is discounted by ``1 - gamma``. The paper modifies the look-ahead of Nesterov's accelerated gradient
for a gradient delayed by ``tau`` updates:

    d_t     = gamma_t * (w_t - w_{t-1})
    w_{t+1} = w_t + d_t - eta * (1 - gamma_t) * grad f(w_{t-tau} + d_{t-tau})

(plain NAG has no ``1 - gamma_t`` and takes the gradient at ``w_t + d_t``). pipecore stores the look-ahead point
``W_t = w_t + d_t``: the gradient is then taken at ``W_{t-tau}``, the weights the micro-batch's forward read at the
stage, which is exactly PipeDream's stash (forward on the live weights, backward on the stashed ones), and with
``m_{t+1} = gamma_t*m_t + (1 - gamma_t)*g_t`` the update of the stored weights is

    W_{t+1} = W_t - eta * ((1 - gamma_t) * g_t + gamma_{t+1} * m_{t+1})

which is NAdam's numerator (torch's ``NAdam``: ``mu_t`` for ``gamma_t``, with its bias corrections and adaptive
denominator), the form the paper implements the method with. With a constant ``gamma`` the discount is a
reparametrization of the learning rate: with ``b = m / (1 - gamma)`` (``b <- gamma*b + g``) the step is
``eta*(1 - gamma) * (g + gamma*b)``, torch's Nesterov momentum at ``lr = eta*(1 - gamma)``. pipecore keeps the
optimizer's learning rate as the user set it (``eta = lr / (1 - gamma)``) and makes its momentum that look-ahead.
The gradient each optimizer steps with (a :class:`~pipecore.algorithms.state.GradientTransform`, from the
optimizer's :meth:`~pipecore.engine.optim.StageOptimizer.momentum_form`):

- NAdam (``torch.optim.NAdam``, or pipecore's fused NAdam): the step is the form above; the gradient is unchanged.
- SGD with Nesterov momentum (``b <- gamma*b + g``, ``W <- W - lr*(g + gamma*b)``): the form above; unchanged.
- SGD with heavy-ball momentum ``gamma`` (``b <- gamma*b + g'``, ``W <- W - lr*b``): ``g'_t = (1 + gamma)*g_t -
  gamma*g_{t-1}`` makes ``b_{t+1} = g_t + gamma*(gamma*b'_t + g_t)``, the Nesterov step of the same ``lr`` (``b'`` the
  Nesterov buffer); the stage keeps ``g_{t-1}`` as a buffer (``previous_gradient``, only under heavy-ball momentum).
- SGD without momentum: ``gamma = 0``, the method is PipeDream's delayed SGD; the gradient is unchanged.

Other optimizers (AdamW, whose first moment is a plain moving average; a dampened momentum) are refused when the
pipeline is built. Weight decay coupled into the gradient by SGD is added after the rewrite (the paper's NAdam
decouples it). Zero delay (the last stage) is the Nesterov method itself: NAdam, or SGD's Nesterov momentum at the
optimizer's own ``lr`` and ``momentum``.

The paper's recipe (its code, ``run.bash``): NAdam with ``betas=(0.99, 0.999)``, ``momentum_decay=0.004``, decoupled
weight decay 0.01, lr 3e-4 with a linear warm-up and a cosine decay to 0.1*lr, gradients clipped at norm 10, one
update per micro-batch. Evidence: the formula and its reduction to NAdam were read in a detailed second-hand
summary of the paper (its own text was not reachable); the schedule, the stash, the optimizer and its settings in
the official code (PluralisResearch/AsyncPP), which runs torch's NAdam unchanged on PipeDream's stash, so that code
and paper agree. The code's options ``--adaptive_momentum`` (per-stage beta1) and ``--lr_correction`` and the
paper's memory-saving variant without stashing are not offered.
"""

from __future__ import annotations

from typing import Any

import torch

from ..schedule import async_one_f_one_b
from ._common import update_every_divides_minibatch, update_every_option
from .base import AlgorithmSpec, Live, SameAsForward
from .state import BeforeStep, ChangedBeforeStep, GradientTransform, StateBuffer

_USE = ("use pipecore.SGD (its momentum made Nesterov's), pipecore.SGD(nesterov=True), "
        "functools.partial(torch.optim.NAdam, ...) or another NAdam")


def _form(optimizer: Any) -> Any:
    """The optimizer's momentum form, or a ``TypeError`` that says which optimizers the method takes."""
    try:
        form = optimizer.momentum_form()
    except TypeError as exc:
        raise TypeError(f"nesterov-async takes Nesterov's look-ahead from the optimizer's momentum: {exc}; {_USE}") \
            from None
    return form


def _heavy_ball(optimizer: Any) -> bool:
    return _form(optimizer).kind == "heavy-ball"


#: ``g_{t-1}``, the gradient of the stage's previous update, which rewrites a heavy-ball step as the method's.
PREVIOUS_GRADIENT = StateBuffer(
    "previous_gradient", "previous gradient (Nesterov look-ahead under heavy-ball momentum)",
    lambda stage, algorithm: _PREVIOUS)
_PREVIOUS = ChangedBeforeStep(_heavy_ball)


class NesterovLookAhead(GradientTransform):
    """The gradient the optimizer steps with, so that its step is the method's: a heavy-ball step is made Nesterov's
    (see the module docstring); the others are left as they are."""

    def check(self, optimizer: Any) -> None:
        _form(optimizer)

    def apply(self, grad: torch.Tensor, before: BeforeStep) -> None:
        form = before.optimizer.momentum_form()
        if form.kind != "heavy-ball":
            return  # no momentum, Nesterov's, or NAdam's: the step is the method's
        gamma = form.momentum
        previous = before.buffer(PREVIOUS_GRADIENT.name)  # in the state's dtype (float32 for bfloat16 weights)
        now = grad.to(previous.dtype, copy=True)
        rewritten = now * (1.0 + gamma)
        rewritten.sub_(previous, alpha=gamma)
        grad.copy_(rewritten)
        previous.copy_(now)


_LOOK_AHEAD = NesterovLookAhead()

SPEC = AlgorithmSpec(
    name="nesterov-async",
    summary="async 1F1B, weight stashing; the optimizer's momentum as Nesterov's look-ahead (NAdam); P-s versions",
    schedule=async_one_f_one_b,
    forward=Live(),
    backward=SameAsForward(),
    update_every=update_every_option,
    defaults={"update_every": 1, "slack": 0},
    constraints=(update_every_divides_minibatch,),
    buffers=(PREVIOUS_GRADIENT,),
    gradient_transform=lambda stage, algorithm: _LOOK_AHEAD,
    schedule_options=("slack",),
)
