"""Argument checks shared by every backend of ``pipecore.ops``.

All checks run before anything is written, so a rejected call leaves every tensor unchanged.
A :class:`Signature` describes one op's tensor arguments; :meth:`Signature.check` first asks the
extension for a cheap yes (one call: this runs before every kernel, and on small buffers the
checks would otherwise cost as much as the kernel), and only when that is not a clear yes runs the
detailed checks, which raise ``ValueError`` naming the argument.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

WEIGHT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_DTYPE_LIST = ", ".join(str(d) for d in WEIGHT_DTYPES)


def state_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """Dtype of optimizer state (and math) for weights stored as ``weight_dtype``."""
    return torch.float64 if weight_dtype == torch.float64 else torch.float32


def real(op: str, name: str, value: object) -> float:
    if type(value) is float:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{op}: argument '{name}' must be a real number, got {type(value).__name__}")
    return float(value)


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Meta tensors have no memory to overlap.
    if a.device != b.device or a.device.type == "meta" or a.numel() == 0 or b.numel() == 0:
        return False
    a0, a1 = _byte_range(a)
    b0, b1 = _byte_range(b)
    return a0 < b1 and b0 < a1


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and _byte_range(a) == _byte_range(b) and a.dtype == b.dtype


def _load_args_ok():
    try:
        from pipecore._C import _args_ok
    except ImportError:  # pragma: no cover - the extension is part of every install
        return None
    return _args_ok


_args_ok = _load_args_ok()


def check(
    op: str,
    weights: Sequence[tuple[str, object]],
    states: Sequence[tuple[str, object]] = (),
    written: Sequence[str] = (),
    out_may_alias: Sequence[str] = (),
) -> None:
    """Validate the tensor arguments of one op call (the detailed checks).

    ``weights`` are tensors in the weight storage dtype (the first one sets dtype, device and shape
    for all others), ``states`` are optimizer-state tensors in :func:`state_dtype`. ``written``
    names the tensors the op writes; a written tensor may not overlap any other argument, except
    that ``out`` may be exactly (same memory, same dtype) one of the arguments in ``out_may_alias``.
    """
    for name, t in [*weights, *states]:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    ref_name, ref = weights[0]
    assert isinstance(ref, torch.Tensor)
    if ref.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"{op}: argument '{ref_name}' has dtype {ref.dtype}; expected one of {_DTYPE_LIST}")
    sdt = state_dtype(ref.dtype)
    for name, t in weights[1:]:
        assert isinstance(t, torch.Tensor)
        if t.dtype != ref.dtype:
            raise ValueError(f"{op}: argument '{name}' has dtype {t.dtype} but '{ref_name}' has dtype {ref.dtype}; "
                             "weights, gradients and outputs must share one dtype")
    for name, t in states:
        assert isinstance(t, torch.Tensor)
        if t.dtype != sdt:
            raise ValueError(f"{op}: argument '{name}' has dtype {t.dtype}; optimizer state for {ref.dtype} "
                             f"weights must be {sdt}")
    tensors: list[tuple[str, torch.Tensor]] = [(n, t) for n, t in [*weights, *states]]  # type: ignore[misc]
    for name, t in tensors[1:]:
        if t.device != ref.device:
            raise ValueError(f"{op}: argument '{name}' is on {t.device} but '{ref_name}' is on {ref.device}")
    for name, t in tensors[1:]:
        if t.shape != ref.shape:
            raise ValueError(f"{op}: argument '{name}' has shape {tuple(t.shape)} but '{ref_name}' has shape "
                             f"{tuple(ref.shape)}")
    for name, t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"{op}: argument '{name}' must be contiguous (shape {tuple(t.shape)}, strides "
                             f"{t.stride()}); pass a flat buffer or call .contiguous()")
    for name, t in tensors:
        # The kernels' vector loads and stores assume element-aligned data (a misaligned float is undefined
        # behaviour in C++, and faults with the aligned stores compilers emit); torch's allocations always are.
        if t.data_ptr() % t.element_size():
            raise ValueError(f"{op}: argument '{name}' is not aligned to its {t.element_size()}-byte elements "
                             f"(address {t.data_ptr():#x}, a view at an odd byte offset); use a copy "
                             "(.clone()) or a tensor torch allocated")
    by_name = dict(tensors)
    for wname in written:
        w = by_name[wname]
        for name, t in tensors:
            if name == wname or not _overlap(w, t):
                continue
            if wname == "out" and name in out_may_alias and _same_memory(w, t):
                continue
            allowed = ""
            if wname == "out" and out_may_alias:
                names = " or ".join(repr(a) for a in out_may_alias)
                allowed = f"; 'out' may only be exactly {names} (same memory, same dtype)"
            raise ValueError(f"{op}: argument '{wname}' overlaps argument '{name}' in memory{allowed}")


class Signature:
    """The tensor arguments of one op: names of weight-dtype and state-dtype tensors, which ones the
    op writes, and which inputs ``out`` may be exactly."""

    def __init__(self, op: str, weights: Sequence[str], states: Sequence[str] = (), written: Sequence[str] = (),
                 out_may_alias: Sequence[str] = ()) -> None:
        self.op = op
        self.weights, self.states = tuple(weights), tuple(states)
        self.written, self.out_may_alias = tuple(written), tuple(out_may_alias)
        names = self.weights + self.states
        self._n_weights = len(self.weights)
        self._written_mask = sum(1 << i for i, n in enumerate(names) if n in self.written)
        self._alias_mask = sum(1 << i for i, n in enumerate(names) if n in self.out_may_alias)
        self._out_index = names.index("out") if "out" in names else -1

    def check(self, *tensors: object) -> None:
        """Validate ``tensors``, given in the order weights then states; raise ``ValueError`` if bad."""
        if _args_ok is not None:
            try:
                if _args_ok(list(tensors), self._n_weights, self._written_mask, self._out_index, self._alias_mask):
                    return
            except TypeError:  # an argument is not a tensor: the detailed checks say which
                pass
        n = self._n_weights
        check(self.op, list(zip(self.weights, tensors[:n])), list(zip(self.states, tensors[n:])), self.written,
              self.out_may_alias)


# -- per-op argument handling, shared by the dispatch and the reference ------------------------------

_INTERPOLATE = Signature("interpolate", ("live", "stale", "out"), written=("out",), out_may_alias=("live", "stale"))
_INTERPOLATE_NEW = Signature("interpolate", ("live", "stale"))
_PREDICT = Signature("predict", ("w", "v", "out"), written=("out",), out_may_alias=("w", "v"))
_PREDICT_NEW = Signature("predict", ("w", "v"))
_SGD = {
    (has_buf, has_delta): Signature(
        "sgd_step", ("w", "grad", "out"),
        ("momentum_buf",) * has_buf + ("delta",) * has_delta,
        written=("out",) + ("momentum_buf",) * has_buf + ("delta",) * has_delta,
        out_may_alias=("w",))
    for has_buf in (False, True) for has_delta in (False, True)
}
_ADAMW = Signature("adamw_step", ("w", "grad", "out"), ("exp_avg", "exp_avg_sq"),
                   written=("out", "exp_avg", "exp_avg_sq"), out_may_alias=("w",))
_NADAM = Signature("nadam_step", ("w", "grad", "out"), ("exp_avg", "exp_avg_sq"),
                   written=("out", "exp_avg", "exp_avg_sq"), out_may_alias=("w",))


def interpolate_args(live, stale, alpha, out):
    """Checks the arguments of ``interpolate``; allocates ``out`` when None. Returns (alpha, out)."""
    alpha = real("interpolate", "alpha", alpha)
    if out is None:
        _INTERPOLATE_NEW.check(live, stale)
        out = torch.empty_like(live)
    _INTERPOLATE.check(live, stale, out)
    return alpha, out


def predict_args(w, v, scale, out):
    """Checks the arguments of ``predict``; allocates ``out`` when None. Returns (scale, out)."""
    scale = real("predict", "scale", scale)
    if out is None:
        _PREDICT_NEW.check(w, v)
        out = torch.empty_like(w)
    _PREDICT.check(w, v, out)
    return scale, out


def sgd_args(w, grad, momentum_buf, lr, momentum, dampening, weight_decay, nesterov, out, delta, delta_decay):
    """Checks and normalises the arguments of ``sgd_step``; returns (out, lr, momentum, dampening,
    weight_decay, delta_decay)."""
    op = "sgd_step"
    lr = real(op, "lr", lr)
    momentum = real(op, "momentum", momentum)
    dampening = real(op, "dampening", dampening)
    weight_decay = real(op, "weight_decay", weight_decay)
    if lr < 0.0:
        raise ValueError(f"{op}: invalid learning rate lr={lr}")
    if momentum < 0.0:
        raise ValueError(f"{op}: invalid momentum={momentum}")
    if weight_decay < 0.0:
        raise ValueError(f"{op}: invalid weight_decay={weight_decay}")
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError(f"{op}: nesterov momentum requires momentum > 0 and dampening == 0 "
                         f"(got momentum={momentum}, dampening={dampening})")
    if momentum != 0.0 and momentum_buf is None:
        raise ValueError(f"{op}: argument 'momentum_buf' is required when momentum != 0 (momentum={momentum})")
    if delta is not None:
        if delta_decay is None:
            raise ValueError(f"{op}: argument 'delta_decay' is required when 'delta' is given")
        delta_decay = real(op, "delta_decay", delta_decay)
    else:
        delta_decay = 0.0
    if out is None:
        out = w
    has_buf = momentum != 0.0
    states = ((momentum_buf,) if has_buf else ()) + ((delta,) if delta is not None else ())
    _SGD[has_buf, delta is not None].check(w, grad, out, *states)
    return out, lr, momentum, dampening, weight_decay, delta_decay


def adamw_args(w, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, out):
    """Checks and normalises the arguments of ``adamw_step``; returns (out, step, lr, beta1, beta2,
    eps, weight_decay)."""
    op = "adamw_step"
    step = _step_number(op, step)
    lr, beta1, beta2, eps, weight_decay = _adam_hyperparameters(op, lr, beta1, beta2, eps, weight_decay)
    if out is None:
        out = w
    _ADAMW.check(w, grad, out, exp_avg, exp_avg_sq)
    return out, int(step), lr, beta1, beta2, eps, weight_decay


def _adam_hyperparameters(op: str, lr: object, beta1: object, beta2: object, eps: object,
                          weight_decay: object) -> tuple[float, float, float, float, float]:
    """The hyper-parameters the Adam family shares, as floats, checked as torch's optimizers check them."""
    lr = real(op, "lr", lr)
    beta1 = real(op, "beta1", beta1)
    beta2 = real(op, "beta2", beta2)
    eps = real(op, "eps", eps)
    weight_decay = real(op, "weight_decay", weight_decay)
    if lr < 0.0:
        raise ValueError(f"{op}: invalid learning rate lr={lr}")
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"{op}: invalid beta1={beta1}; expected 0 <= beta1 < 1")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"{op}: invalid beta2={beta2}; expected 0 <= beta2 < 1")
    if eps < 0.0:
        raise ValueError(f"{op}: invalid eps={eps}")
    if weight_decay < 0.0:
        raise ValueError(f"{op}: invalid weight_decay={weight_decay}")
    return lr, beta1, beta2, eps, weight_decay


def _step_number(op: str, step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"{op}: argument 'step' must be an integer >= 1 (the step count after this update), "
                         f"got {step!r}")
    return int(step)


def nadam_mu(step: int, beta1: float, momentum_decay: float) -> float:
    """NAdam's momentum coefficient of step ``step``: ``beta1 * (1 - 0.5 * 0.96 ** (step * momentum_decay))``,
    computed as ``torch.optim.NAdam`` computes it (Python floats)."""
    return beta1 * (1.0 - 0.5 * (0.96 ** (step * momentum_decay)))


def nadam_args(w, grad, exp_avg, exp_avg_sq, step, mu_product, lr, beta1, beta2, eps, weight_decay, momentum_decay,
               decoupled_weight_decay, out):
    """Checks and normalises the arguments of ``nadam_step``; returns (out, step, mu_product, lr, beta1, beta2,
    eps, weight_decay, momentum_decay, decoupled_weight_decay)."""
    op = "nadam_step"
    step = _step_number(op, step)
    mu_product = real(op, "mu_product", mu_product)
    lr, beta1, beta2, eps, weight_decay = _adam_hyperparameters(op, lr, beta1, beta2, eps, weight_decay)
    momentum_decay = real(op, "momentum_decay", momentum_decay)
    if not isinstance(decoupled_weight_decay, bool):
        raise ValueError(f"{op}: argument 'decoupled_weight_decay' must be True or False, got "
                         f"{type(decoupled_weight_decay).__name__}")
    if not 0.0 <= momentum_decay < float("inf"):
        raise ValueError(f"{op}: invalid momentum_decay={momentum_decay}; expected a finite value >= 0")
    # Every mu is at most beta1 < 1, so their product is in [0, 1); 1 - mu_product divides the step.
    if not 0.0 <= mu_product < 1.0:
        raise ValueError(f"{op}: invalid mu_product={mu_product}; expected 0 <= mu_product < 1 (the product of "
                         "NAdam's momentum coefficients mu_1 * ... * mu_step, this step's included)")
    if out is None:
        out = w
    _NADAM.check(w, grad, out, exp_avg, exp_avg_sq)
    return (out, step, mu_product, lr, beta1, beta2, eps, weight_decay, momentum_decay, decoupled_weight_decay)


def nadam_scalars(step: int, mu_product: float, lr: float, beta1: float, beta2: float, weight_decay: float,
                  momentum_decay: float, decoupled_weight_decay: bool) -> dict[str, float]:
    """The per-step scalars of a NAdam update, computed once on the host in ``torch.optim.NAdam``'s order (Python
    floats), so that the kernels are element-wise:

    * ``grad_decay``: added to the gradient times the weights (L2 weight decay; 0 when decoupled),
    * ``wd_factor``: the weights' factor ``1 - lr * weight_decay`` (decoupled weight decay; 1 otherwise),
    * ``bias_correction2 = 1 - beta2**step``,
    * ``grad_step = -lr * (1 - mu_t) / (1 - mu_product)``, the gradient's share of the step,
    * ``exp_avg_step = -lr * mu_{t+1} / (1 - mu_product * mu_{t+1})``, the first moment's share."""
    mu = nadam_mu(step, beta1, momentum_decay)
    mu_next = nadam_mu(step + 1, beta1, momentum_decay)
    decoupled = decoupled_weight_decay and weight_decay != 0.0
    return {
        "grad_decay": weight_decay if not decoupled_weight_decay else 0.0,
        "wd_factor": 1.0 - lr * weight_decay if decoupled else 1.0,
        "bias_correction2": 1.0 - beta2**step,
        "grad_step": -lr * (1.0 - mu) / (1.0 - mu_product),
        "exp_avg_step": (-lr * mu_next) / (1.0 - mu_product * mu_next),
    }
