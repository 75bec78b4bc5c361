"""Fused element-wise ops over flat weight buffers, dispatched by device.

=====================  =============================================================
CUDA tensors           Triton kernels (``pipecore.kernels``)
CPU tensors            C++ kernels (``pipecore._C``: vectorized, ``at::parallel_for``)
any other device       plain torch (:mod:`pipecore.ops.reference`)
=====================  =============================================================

Every op takes contiguous tensors of one shape (normally the 1-D flat buffer of a pipeline stage or
one slot of a :class:`pipecore.ring.WeightRing`) and writes its result to ``out``.

Dtypes. Weights, gradients and outputs share one storage dtype: float64, float32, bfloat16 or
float16. Math runs in float32, or in float64 for float64 weights, and each result is rounded once
to the storage dtype. Optimizer state (``momentum_buf``, ``delta``, ``exp_avg``, ``exp_avg_sq``) is
kept in that math dtype, i.e. float32 even for bfloat16/float16 weights.

Aliasing. ``out`` may be exactly one of the weight inputs (same memory), e.g. ``out=w`` for an
in-place update; any other overlap between a tensor the op writes and another argument is a
``ValueError``. Arguments are checked before anything is written: a rejected call changes nothing.

Autograd. The ops run outside autograd; the version counter of every written tensor is bumped, as
an in-place torch op would, so autograd still detects use of a tensor that was overwritten.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import _checks, reference

__all__ = ["adamw_step", "backend_for", "interpolate", "nadam_mu", "nadam_step", "predict", "reference", "sgd_step",
           "state_dtype"]

state_dtype = _checks.state_dtype
nadam_mu = _checks.nadam_mu


def backend_for(t: torch.Tensor) -> str:
    """Which implementation handles tensors on ``t``'s device: ``"triton"``, ``"cpp"`` or ``"reference"``."""
    if t.device.type == "cuda":
        return "triton"
    if t.device.type == "cpu":
        return "cpp"
    return "reference"


_modules: dict[str, ModuleType] = {}


def _cpp() -> ModuleType:
    mod = _modules.get("cpp")
    if mod is None:
        try:
            from pipecore import _C as mod
        except ImportError as exc:  # pragma: no cover - only on a broken build
            raise ImportError(
                "pipecore._C (the C++ extension) is not built; reinstall with "
                "`pip install --no-build-isolation -e .`"
            ) from exc
        _modules["cpp"] = mod
    return mod


def _triton() -> ModuleType:
    # Imported on first CUDA use: importing Triton costs time and CPU-only users never need it.
    mod = _modules.get("triton")
    if mod is None:
        try:
            import pipecore.kernels.fused as mod  # (the package itself imports nothing: see its docstring)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] != "triton":
                raise
            # Triton is the optional extra [gpu]: say so rather than leave a bare ModuleNotFoundError.
            raise ModuleNotFoundError(
                "pipecore's fused ops on CUDA tensors are Triton kernels, and Triton is not installed: install "
                "pipecore with its GPU extra (pip install --no-build-isolation -e \".[gpu]\") or pip install "
                "triton; CPU training does not need it", name=exc.name) from exc
        _modules["triton"] = mod
    return mod


def _impl(t: torch.Tensor) -> ModuleType | None:
    """The kernel module for ``t``'s device, or None for the reference (attribute reads are cheap;
    ``t.device.type`` is not)."""
    if t.is_cpu:
        return _cpp()
    if t.is_cuda:
        return _triton()
    return None


_bump = torch.autograd.graph.increment_version


def interpolate(live: torch.Tensor, stale: torch.Tensor, alpha: float, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Staleness-aware interpolation (I-TiMePReSt): ``out = live + alpha * (stale - live)``.

    Args:
        live: the live weights.
        stale: the stashed (older) weights.
        alpha: interpolation weight; 0 gives ``live``, 1 gives ``stale``.
        out: where to write; a new tensor when ``None``. May be ``live`` or ``stale`` itself.

    Returns:
        ``out``.
    """
    alpha, out = _checks.interpolate_args(live, stale, alpha, out)
    impl = _impl(live)
    if impl is None:
        return reference.interpolate(live, stale, alpha, out=out)
    impl.interpolate(out, live, stale, alpha)
    _bump(out)
    return out


def predict(w: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Weight prediction: ``out = w - scale * v``.

    SpecTrain/PipeOptim predict future weights with ``v`` the momentum buffer and ``scale = s * lr``;
    PipeMare's discrepancy correction is ``predict(w, delta, tau)``.

    Args:
        w: the weights.
        v: the direction (momentum buffer, velocity, ...), same dtype as ``w``.
        scale: step length.
        out: where to write; a new tensor when ``None``. May be ``w`` or ``v`` itself.

    Returns:
        ``out``.
    """
    scale, out = _checks.predict_args(w, v, scale, out)
    impl = _impl(w)
    if impl is None:
        return reference.predict(w, v, scale, out=out)
    impl.predict(out, w, v, scale)
    _bump(out)
    return out


def sgd_step(w: torch.Tensor, grad: torch.Tensor, momentum_buf: torch.Tensor | None, *, lr: float,
             momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
             first_step: bool = False, out: torch.Tensor | None = None, delta: torch.Tensor | None = None,
             delta_decay: float | None = None) -> torch.Tensor:
    """One ``torch.optim.SGD`` step (``maximize=False``) that reads ``w`` and writes the new weights to ``out``.

    Per element, with ``g = grad + weight_decay * w``::

        buf   = g                                      if first_step
              = momentum * buf + (1 - dampening) * g   otherwise
        d     = g + momentum * buf  if nesterov else buf      (d = g when momentum == 0)
        out   = w - lr * d
        delta = delta_decay * delta + (1 - delta_decay) * (out - w)    (only when delta is given)

    ``first_step=True`` marks the first update of this buffer: like torch, the momentum buffer is then
    set to ``g`` (its old contents are ignored; dampening is not applied). Pass it on the first step
    and ``False`` afterwards. ``delta`` is PipeMare's weight velocity; ``out - w`` uses the new weights
    as stored (rounded to the weight dtype).

    Args:
        w: current (live) weights.
        grad: gradient, same dtype as ``w``.
        momentum_buf: momentum buffer (state dtype, see module docs), updated in place; may be
            ``None`` when ``momentum == 0``.
        lr, momentum, dampening, weight_decay, nesterov: as in ``torch.optim.SGD``.
        first_step: initialise the momentum buffer from the gradient.
        out: where the new weights go, e.g. the next ring slot; defaults to ``w`` (in place).
        delta: optional PipeMare velocity buffer (state dtype), updated in place.
        delta_decay: decay of ``delta``; required when ``delta`` is given.

    Returns:
        ``out``.
    """
    out, lr, momentum, dampening, weight_decay, delta_decay = _checks.sgd_args(
        w, grad, momentum_buf, lr, momentum, dampening, weight_decay, nesterov, out, delta, delta_decay)
    impl = _impl(w)
    if impl is None:
        return reference.sgd_step(w, grad, momentum_buf, lr=lr, momentum=momentum, dampening=dampening,
                                  weight_decay=weight_decay, nesterov=nesterov, first_step=first_step, out=out,
                                  delta=delta, delta_decay=delta_decay if delta is not None else None)
    buf = momentum_buf if momentum != 0.0 else None
    # pipecore._C and pipecore.kernels take the same arguments.
    impl.sgd_step(out, w, grad, buf, delta, lr=lr, momentum=momentum, dampening=dampening,
                  weight_decay=weight_decay, nesterov=bool(nesterov), first_step=bool(first_step),
                  delta_decay=delta_decay)
    _bump([t for t in (out, buf, delta) if t is not None])
    return out


def adamw_step(w: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """One ``torch.optim.AdamW`` step (``amsgrad=False, maximize=False``) from ``w`` into ``out``.

    Per element::

        p          = w * (1 - lr * weight_decay)
        exp_avg    = lerp(exp_avg, grad, 1 - beta1)
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
        out        = p - lr / (1 - beta1**step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps)

    Args:
        w: current (live) weights.
        grad: gradient, same dtype as ``w``.
        exp_avg, exp_avg_sq: first and second moments (state dtype), updated in place; zeros before
            the first step, as in torch.
        step: the step number this update makes, counting from 1 (torch's ``state["step"]`` after
            its increment).
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW``.
        out: where the new weights go, e.g. the next ring slot; defaults to ``w`` (in place).

    Returns:
        ``out``.
    """
    out, step, lr, beta1, beta2, eps, weight_decay = _checks.adamw_args(
        w, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, out)
    impl = _impl(w)
    if impl is None:
        return reference.adamw_step(w, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
                                    eps=eps, weight_decay=weight_decay, out=out)
    wd_factor = 1.0 - lr * weight_decay
    step_size = lr / (1.0 - beta1**step)
    bias_correction2_sqrt = (1.0 - beta2**step) ** 0.5
    impl.adamw_step(out, w, grad, exp_avg, exp_avg_sq, wd_factor=wd_factor, beta1=beta1, beta2=beta2, eps=eps,
                    step_size=step_size, bias_correction2_sqrt=bias_correction2_sqrt)
    _bump([out, exp_avg, exp_avg_sq])
    return out


def nadam_step(w: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, step: int,
               mu_product: float, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               momentum_decay: float, decoupled_weight_decay: bool = False, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """One ``torch.optim.NAdam`` step (``maximize=False``) from ``w`` into ``out``.

    With ``mu_t = nadam_mu(t, beta1, momentum_decay) = beta1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))``, per
    element::

        g          = grad + weight_decay * w              (L2 weight decay: decoupled_weight_decay=False)
        p          = w * (1 - lr * weight_decay)          (decoupled weight decay, as AdamW's)
        exp_avg    = lerp(exp_avg, g, 1 - beta1)
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
        denom      = sqrt(exp_avg_sq / (1 - beta2**step)) + eps
        out        = p - lr * (1 - mu_step) / (1 - mu_product) * g / denom
                       - lr * mu_{step+1} / (1 - mu_product * mu_{step+1}) * exp_avg / denom

    The scalars depend on the step only; they are computed once per call on the host, so the kernels are
    element-wise.

    Args:
        w: current (live) weights.
        grad: gradient, same dtype as ``w``.
        exp_avg, exp_avg_sq: first and second moments (state dtype), updated in place; zeros before the first
            step, as in torch.
        step: the step number this update makes, counting from 1 (torch's ``state["step"]`` after its increment).
        mu_product: ``mu_1 * ... * mu_step``, the product of the momentum coefficients with this step's included
            (torch's ``state["mu_product"]`` after its update): the caller keeps the running product, multiplying
            it by ``nadam_mu(step, beta1, momentum_decay)`` before each step.
        lr, beta1, beta2, eps, weight_decay, momentum_decay, decoupled_weight_decay: as in ``torch.optim.NAdam``.
        out: where the new weights go, e.g. the next ring slot; defaults to ``w`` (in place).

    Returns:
        ``out``.
    """
    (out, step, mu_product, lr, beta1, beta2, eps, weight_decay, momentum_decay, decoupled_weight_decay) = \
        _checks.nadam_args(w, grad, exp_avg, exp_avg_sq, step, mu_product, lr, beta1, beta2, eps, weight_decay,
                           momentum_decay, decoupled_weight_decay, out)
    impl = _impl(w)
    if impl is None:
        return reference.nadam_step(w, grad, exp_avg, exp_avg_sq, step=step, mu_product=mu_product, lr=lr,
                                    beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                                    momentum_decay=momentum_decay, decoupled_weight_decay=decoupled_weight_decay,
                                    out=out)
    scalars = _checks.nadam_scalars(step, mu_product, lr, beta1, beta2, weight_decay, momentum_decay,
                                    decoupled_weight_decay)
    impl.nadam_step(out, w, grad, exp_avg, exp_avg_sq, beta1=beta1, beta2=beta2, eps=eps, **scalars)
    _bump([out, exp_avg, exp_avg_sq])
    return out
