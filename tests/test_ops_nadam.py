"""pipecore.ops.nadam_step: the C++ (CPU) kernel against the torch reference, the reference against torch.optim.NAdam's
single-tensor update over several steps, and the argument checks.

The Triton kernel is compared with the reference under the interpreter in test_kernels_triton.py (group "nadam");
the CUDA tests at the end run it through the dispatch on a GPU machine.

torch keeps NAdam's running product of momentum coefficients (``state["mu_product"]``) in its default dtype, float32
unless ``torch.set_default_dtype(torch.float64)``; pipecore's stage optimizer keeps it in float64. The comparisons
with torch in float64 therefore run with float64 as torch's default dtype (the ``float64_default`` fixture).
"""

from __future__ import annotations

import re

import pytest
import torch

import pipecore._C as _C
import pipecore.ops as ops
from pipecore.ops import reference as ref
from pipecore.ring import WeightRing

from test_ops import CUDA, DTYPES, assert_matches, rand, sdt


@pytest.fixture
def float64_default():
    """torch's default dtype float64 for the test, so that torch.optim.NAdam keeps ``mu_product`` in float64."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def mu_products(steps: int, beta1: float, momentum_decay: float) -> list[float]:
    """``mu_1 * ... * mu_t`` for t = 1..steps, multiplied up as torch does."""
    out, product = [], 1.0
    for t in range(1, steps + 1):
        product *= ops.nadam_mu(t, beta1, momentum_decay)
        out.append(product)
    return out


# (beta1, weight_decay, decoupled_weight_decay, momentum_decay): both branches of lerp (|1 - beta1| < 0.5 or
# not), no weight decay, L2 and decoupled weight decay, torch's default momentum decay and others.
KERNEL_CONFIGS = [
    (0.9, 0.0, False, 0.004),
    (0.9, 0.01, False, 0.004),
    (0.9, 0.1, True, 0.1),
    (0.3, 0.02, False, 0.0),
    (0.3, 0.05, True, 0.004),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 33, 200_003])
@pytest.mark.parametrize("beta1, weight_decay, decoupled, momentum_decay", KERNEL_CONFIGS)
def test_nadam_step_matches_reference(dtype, n, beta1, weight_decay, decoupled, momentum_decay):
    torch.manual_seed(n)
    w, grad = rand(n, dtype), rand(n, dtype)
    m, v = rand(n, sdt(dtype)), rand(n, sdt(dtype), positive=True)
    rm, rv = m.clone(), v.clone()
    out, rout = torch.empty_like(w), torch.empty_like(w)
    step = 3
    kw = dict(step=step, mu_product=mu_products(step, beta1, momentum_decay)[-1], lr=1e-2, beta1=beta1, beta2=0.999,
              eps=1e-8, weight_decay=weight_decay, momentum_decay=momentum_decay, decoupled_weight_decay=decoupled)
    w0 = w.clone()
    assert ops.nadam_step(w, grad, m, v, out=out, **kw) is out
    ref.nadam_step(w, grad, rm, rv, out=rout, **kw)
    assert torch.equal(w, w0)  # w is only read
    assert_matches(out, rout)
    assert_matches(m, rm)
    assert_matches(v, rv)
    if dtype == torch.float64:  # the same operations in the same order, correctly rounded: identical
        assert torch.equal(out, rout) and torch.equal(m, rm) and torch.equal(v, rv)


def test_nadam_mu_is_torchs_momentum_schedule():
    for t, md in ((1, 0.004), (7, 0.004), (3, 0.1), (5, 0.0)):
        assert ops.nadam_mu(t, 0.9, md) == 0.9 * (1.0 - 0.5 * (0.96 ** (t * md)))
    assert ops.nadam_mu(4, 0.0, 0.004) == 0.0


# -- equivalence with torch.optim.NAdam over several steps ------------------------------------------------

NADAM_CONFIGS = [
    dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum_decay=4e-3),
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05, momentum_decay=4e-3),
    dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, momentum_decay=0.1),
    dict(lr=5e-2, betas=(0.3, 0.9), eps=1e-8, weight_decay=0.0, momentum_decay=0.0),
    dict(lr=5e-2, betas=(0.95, 0.9), eps=1e-8, weight_decay=0.02, momentum_decay=1.0),
]


def _torch_single_tensor_nadam(param: torch.nn.Parameter, config: dict, decoupled: bool) -> torch.optim.NAdam:
    opt = torch.optim.NAdam([param], foreach=False, decoupled_weight_decay=decoupled, **config)
    assert opt.defaults["foreach"] is False  # the loop over tensors: torch's _single_tensor_nadam
    return opt


@pytest.mark.parametrize("config", NADAM_CONFIGS)
@pytest.mark.parametrize("decoupled", [False, True])
def test_nadam_reference_and_kernel_equal_torch_optim_nadam_over_steps_float64(config, decoupled, float64_default):
    """Updates go from the live slot into the next ring slot, as the pipeline engine does; the reference and the
    C++ kernel each keep their own state and must agree with torch to round-off, and with each other exactly."""
    torch.manual_seed(2)
    n, steps = 4099, 7
    dtype = torch.float64
    init = rand(n, dtype)
    param = torch.nn.Parameter(init.clone())
    opt = _torch_single_tensor_nadam(param, config, decoupled)
    ring = WeightRing.from_flat(init, num_slots=2)
    m, v = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
    rw, rm, rv = init.clone(), torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
    (beta1, beta2) = config["betas"]
    hp = dict(lr=config["lr"], beta1=beta1, beta2=beta2, eps=config["eps"], weight_decay=config["weight_decay"],
              momentum_decay=config["momentum_decay"], decoupled_weight_decay=decoupled)
    tol = dict(rtol=1e-13, atol=1e-14)
    for step, mu_product in enumerate(mu_products(steps, beta1, config["momentum_decay"]), start=1):
        grad = rand(n, dtype)
        param.grad = grad.clone()
        opt.step()
        slot = ring.acquire()
        ops.nadam_step(ring.live, grad, m, v, step=step, mu_product=mu_product, out=ring.slot(slot), **hp)
        ring.publish(slot, step)
        ref.nadam_step(rw, grad, rm, rv, step=step, mu_product=mu_product, **hp)
        state = opt.state[param]
        assert state["mu_product"].dtype == torch.float64 and float(state["mu_product"]) == mu_product
        for ours in (ring.live, rw):
            torch.testing.assert_close(ours, param.detach(), **tol)
        for ours_m, ours_v in ((m, v), (rm, rv)):
            torch.testing.assert_close(ours_m, state["exp_avg"], **tol)
            torch.testing.assert_close(ours_v, state["exp_avg_sq"], **tol)
        assert torch.equal(ring.live, rw) and torch.equal(m, rm) and torch.equal(v, rv)


@pytest.mark.parametrize("decoupled", [False, True])
def test_nadam_kernel_equals_torch_optim_nadam_float32(decoupled):
    """float32 weights under torch's own defaults (its mu_product then in float32, ours in float64): float32
    round-off."""
    torch.manual_seed(3)
    n, config = 4099, NADAM_CONFIGS[1]
    init = rand(n, torch.float32)
    param = torch.nn.Parameter(init.clone())
    opt = _torch_single_tensor_nadam(param, config, decoupled)
    w, m, v = init.clone(), torch.zeros(n), torch.zeros(n)
    for step, mu_product in enumerate(mu_products(6, 0.9, config["momentum_decay"]), start=1):
        grad = rand(n, torch.float32)
        param.grad = grad.clone()
        opt.step()
        ops.nadam_step(w, grad, m, v, step=step, mu_product=mu_product, lr=config["lr"], beta1=0.9, beta2=0.999,
                       eps=config["eps"], weight_decay=config["weight_decay"],
                       momentum_decay=config["momentum_decay"], decoupled_weight_decay=decoupled)
        torch.testing.assert_close(w, param.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(m, opt.state[param]["exp_avg"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(v, opt.state[param]["exp_avg_sq"], rtol=1e-6, atol=1e-6)


# -- properties of the call ------------------------------------------------------------------------------------

def _nadam_kw(**change) -> dict:
    kw = dict(step=2, mu_product=0.5, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
              momentum_decay=0.004, decoupled_weight_decay=False)
    kw.update(change)
    return kw


@pytest.mark.parametrize("decoupled", [False, True])
def test_nadam_in_place_equals_out_of_place(decoupled):
    w, grad = rand(777, torch.float32), rand(777, torch.float32)
    m, v = rand(777, torch.float32), rand(777, torch.float32, positive=True)
    m2, v2 = m.clone(), v.clone()
    out = ops.nadam_step(w, grad, m, v, out=torch.empty_like(w), **_nadam_kw(decoupled_weight_decay=decoupled))
    w2 = w.clone()
    assert ops.nadam_step(w2, grad, m2, v2, **_nadam_kw(decoupled_weight_decay=decoupled)) is w2  # default: in place
    assert torch.equal(out, w2) and torch.equal(m, m2) and torch.equal(v, v2)


def test_nadam_without_weight_decay_never_touches_nonfinite_weights():
    """Weight decay 0 skips its term, as torch does (0 * inf would turn the weight into NaN)."""
    for decoupled in (False, True):
        w = torch.tensor([float("inf"), 1.0])
        out = ops.nadam_step(w, torch.zeros(2), torch.zeros(2), torch.zeros(2), out=torch.empty_like(w),
                             **_nadam_kw(weight_decay=0.0, decoupled_weight_decay=decoupled))
        assert out.tolist() == [float("inf"), 1.0]


def test_nadam_written_tensors_get_their_autograd_version_bumped():
    w, grad, m, v, out = torch.ones(10), torch.ones(10), torch.zeros(10), torch.zeros(10), torch.empty(10)
    before = [t._version for t in (w, grad, m, v, out)]
    ops.nadam_step(w, grad, m, v, out=out, **_nadam_kw())
    after = [t._version for t in (w, grad, m, v, out)]
    assert after[:2] == before[:2] and all(a == b + 1 for a, b in zip(after[2:], before[2:]))


def test_nadam_on_other_devices_uses_the_reference():
    meta = [torch.empty(10, device="meta") for _ in range(4)]
    assert ops.nadam_step(*meta, **_nadam_kw()).device.type == "meta"


# -- bad input: ValueError naming the argument, nothing written ------------------------------------------------

@pytest.mark.parametrize("change, message", [
    (dict(step=0), "nadam_step: argument 'step' must be an integer >= 1"),
    (dict(step=2.0), "argument 'step' must be an integer >= 1"),
    (dict(mu_product=1.0), "invalid mu_product=1.0; expected 0 <= mu_product < 1 (the product of NAdam's momentum "
                           "coefficients mu_1 * ... * mu_step, this step's included)"),
    (dict(mu_product=-0.5), "invalid mu_product=-0.5"),
    (dict(mu_product=float("nan")), "invalid mu_product=nan"),
    (dict(mu_product=None), "argument 'mu_product' must be a real number, got NoneType"),
    (dict(lr=-0.1), "invalid learning rate lr=-0.1"),
    (dict(beta1=1.0), "invalid beta1=1.0; expected 0 <= beta1 < 1"),
    (dict(beta2=-0.1), "invalid beta2=-0.1"),
    (dict(eps=-1.0), "invalid eps=-1.0"),
    (dict(weight_decay=-0.1), "invalid weight_decay=-0.1"),
    (dict(momentum_decay=-0.004), "invalid momentum_decay=-0.004; expected a finite value >= 0"),
    (dict(momentum_decay=float("inf")), "invalid momentum_decay=inf"),
    (dict(decoupled_weight_decay=1), "argument 'decoupled_weight_decay' must be True or False, got int"),
    (dict(exp_avg=torch.zeros(8, dtype=torch.float64)), "argument 'exp_avg' has dtype torch.float64; optimizer "
                                                        "state for torch.float32 weights must be torch.float32"),
    (dict(exp_avg_sq="x"), "argument 'exp_avg_sq' must be a torch.Tensor, got str"),
    (dict(exp_avg_sq=torch.zeros(9)), "argument 'exp_avg_sq' has shape (9,) but 'w' has shape (8,)"),
    (dict(out="alias exp_avg"), "argument 'out' overlaps argument 'exp_avg' in memory; 'out' may only be exactly 'w'"),
    (dict(grad=torch.zeros(8, dtype=torch.float16)), "argument 'grad' has dtype torch.float16 but 'w' has dtype "
                                                     "torch.float32"),
    (dict(grad=torch.zeros(16)[::2]), "argument 'grad' must be contiguous"),
])
def test_nadam_bad_input_raises_and_writes_nothing(change, message):
    a = dict(w=torch.ones(8), grad=torch.ones(8), exp_avg=torch.zeros(8), exp_avg_sq=torch.zeros(8),
             out=torch.zeros(8), **_nadam_kw())
    a.update(change)
    if isinstance(a["out"], str):
        a["out"] = a["exp_avg"]
    snapshot = {k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor)}
    w, grad, m, v = a.pop("w"), a.pop("grad"), a.pop("exp_avg"), a.pop("exp_avg_sq")
    with pytest.raises(ValueError, match=re.escape(message)):
        ops.nadam_step(w, grad, m, v, **a)
    current = {"w": w, "grad": grad, "exp_avg": m, "exp_avg_sq": v, "out": a["out"]}
    for k, t in snapshot.items():
        assert torch.equal(current[k], t), f"{k} was modified"


def test_nadam_reference_checks_its_arguments_too():
    with pytest.raises(ValueError, match=re.escape("invalid mu_product=1.0")):
        ref.nadam_step(torch.ones(4), torch.ones(4), torch.zeros(4), torch.zeros(4), **_nadam_kw(mu_product=1.0))


def test_the_extensions_nadam_checks_its_arguments():
    """Direct callers of pipecore._C get a ValueError instead of memory errors, and nothing is written."""
    out, grad = torch.zeros(10), torch.ones(10)
    scalars = (0.0, 1.0, 0.9, 0.99, 1e-8, 0.01, -0.01, -0.09)
    with pytest.raises(ValueError, match="argument 'exp_avg' has dtype Double, expected Float"):
        _C.nadam_step(out, torch.ones(10), grad, torch.zeros(10, dtype=torch.float64), torch.zeros(10), *scalars)
    with pytest.raises(ValueError, match="argument 'exp_avg_sq' has 9 elements, expected 10"):
        _C.nadam_step(out, torch.ones(10), grad, torch.zeros(10), torch.zeros(9), *scalars)
    with pytest.raises(ValueError, match="argument 'exp_avg' is written and overlaps argument 'grad'"):
        _C.nadam_step(out, torch.ones(10), grad, grad, torch.zeros(10), *scalars)
    assert torch.count_nonzero(out) == 0 and torch.equal(grad, torch.ones(10))


# -- CUDA: Triton through the dispatch (runs on GPU machines) ---------------------------------------------------

@CUDA
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 4099, 1 << 20])
@pytest.mark.parametrize("decoupled", [False, True])
def test_cuda_nadam_matches_reference(dtype, n, decoupled):
    torch.manual_seed(0)
    w, grad = rand(n, dtype, "cuda"), rand(n, dtype, "cuda")
    m, v = rand(n, sdt(dtype), "cuda"), rand(n, sdt(dtype), "cuda", positive=True)
    rm, rv = m.clone(), v.clone()
    kw = dict(step=2, mu_product=mu_products(2, 0.9, 0.004)[-1], lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.01, momentum_decay=0.004, decoupled_weight_decay=decoupled)
    out = ops.nadam_step(w, grad, m, v, out=torch.empty_like(w), **kw)
    rout = ref.nadam_step(w, grad, rm, rv, out=torch.empty_like(w), **kw)
    for a, b in ((out, rout), (m, rm), (v, rv)):
        assert_matches(a.cpu(), b.cpu())


@CUDA
@pytest.mark.parametrize("decoupled", [False, True])
def test_cuda_nadam_equals_torch_optim_float64(decoupled, float64_default):
    torch.manual_seed(0)
    init = rand(10_000, torch.float64, "cuda")
    param = torch.nn.Parameter(init.clone())
    opt = torch.optim.NAdam([param], lr=1e-2, weight_decay=1e-2, decoupled_weight_decay=decoupled, foreach=False)
    w, m, v = init.clone(), torch.zeros_like(init), torch.zeros_like(init)
    for step, mu_product in enumerate(mu_products(4, 0.9, 0.004), start=1):
        grad = rand(10_000, torch.float64, "cuda")
        param.grad = grad.clone()
        opt.step()
        ops.nadam_step(w, grad, m, v, step=step, mu_product=mu_product, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                       weight_decay=1e-2, momentum_decay=0.004, decoupled_weight_decay=decoupled)
        torch.testing.assert_close(w, param.detach(), rtol=1e-13, atol=1e-14)
