"""pipecore.ops: C++ (CPU) kernels against the torch reference and torch.optim; argument checks.

The Triton kernels are tested under the interpreter in test_kernels_triton.py; the CUDA tests at
the end run them through the dispatch on a GPU machine.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pipecore._C as _C
import pipecore.ops as ops
from pipecore.ops import reference as ref
from pipecore.ring import WeightRing

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
# 0 and 1 (edge cases), tails of every vector width, and a size split across threads.
SIZES = [0, 1, 7, 33, 1000, 200_003]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def sdt(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rand(n: int, dtype: torch.dtype, device: str = "cpu", scale: float = 1.0, positive: bool = False
         ) -> torch.Tensor:
    t = torch.randn(n, dtype=torch.float64, device=device) * scale
    return (t.abs() if positive else t).to(dtype)


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Integers that order like the floats and step by one per representable value."""
    int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    bits = t.contiguous().view(int_dtype).to(torch.int64)
    magnitude = bits & ((1 << (8 * t.element_size() - 1)) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to round-off: float64 and float32 to a few ulps of the operands, bfloat16/float16
    within one unit in the last place (both sides compute in float32 and round once)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float64:
        torch.testing.assert_close(actual, expected, rtol=1e-13, atol=1e-14)
    elif actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    else:
        ulps = (_ordered(actual) - _ordered(expected)).abs()
        close = (actual.double() - expected.double()).abs() <= 1e-6
        bad = (ulps > 1) & ~close
        assert not bad.any(), f"{int(bad.sum())} elements differ by more than 1 ulp, e.g. " \
                              f"{actual[bad][:4].tolist()} vs {expected[bad][:4].tolist()}"


# -- element-wise ops against the reference ------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_interpolate_and_predict_match_reference(dtype, n):
    torch.manual_seed(n)
    a, b = rand(n, dtype), rand(n, dtype)
    for alpha in (0.0, 0.3, 1.0, 1.7):
        out = torch.empty_like(a)
        assert ops.interpolate(a, b, alpha, out=out) is out
        assert_matches(out, ref.interpolate(a, b, alpha))
    out = torch.empty_like(a)
    assert ops.predict(a, b, 0.05, out=out) is out
    assert_matches(out, ref.predict(a, b, 0.05))
    if n:
        assert torch.equal(ops.interpolate(a, b, 0.0), a)  # alpha=0 gives live exactly
        assert_matches(ops.interpolate(a, b, 1.0), b)


def test_interpolate_and_predict_exact_float64_formula():
    a, b = rand(999, torch.float64), rand(999, torch.float64)
    assert torch.equal(ops.interpolate(a, b, 0.25), a + 0.25 * (b - a))
    assert torch.equal(ops.predict(a, b, 0.125), a - 0.125 * b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_may_alias_inputs(dtype):
    a, b = rand(1000, dtype), rand(1000, dtype)
    expected = ref.interpolate(a, b, 0.4)
    x = a.clone()
    assert ops.interpolate(x, b, 0.4, out=x) is x
    assert torch.equal(x, expected)
    y = b.clone()
    ops.interpolate(a, y, 0.4, out=y)
    assert torch.equal(y, expected)
    v = b.clone()
    ops.predict(a, v, 0.1, out=v)
    assert torch.equal(v, ref.predict(a, b, 0.1))
    same = a.clone()
    assert_matches(ops.interpolate(same, same, 0.7), same)  # live and stale may be one tensor


def test_default_out():
    a, b = rand(100, torch.float32), rand(100, torch.float32)
    out = ops.interpolate(a, b, 0.5)
    assert out.data_ptr() not in (a.data_ptr(), b.data_ptr()) and out.shape == a.shape
    w = a.clone()
    grad = rand(100, torch.float32)
    assert ops.sgd_step(w, grad, None, lr=0.1) is w  # steps default to in place
    assert torch.equal(w, ref.predict(a, grad, 0.1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 33, 200_003])
@pytest.mark.parametrize("config", [
    dict(),
    dict(weight_decay=0.01),
    dict(momentum=0.9),
    dict(momentum=0.9, first_step=True),
    dict(momentum=0.9, dampening=0.1, weight_decay=0.02),
    dict(momentum=0.8, nesterov=True, weight_decay=0.01),
    dict(momentum=0.9, nesterov=True, first_step=True),
])
@pytest.mark.parametrize("with_delta", [False, True])
def test_sgd_step_matches_reference(dtype, n, config, with_delta):
    torch.manual_seed(n)
    w, grad = rand(n, dtype), rand(n, dtype)
    buf = rand(n, sdt(dtype)) if config.get("momentum") else None
    delta = rand(n, sdt(dtype), scale=0.01) if with_delta else None
    kw = dict(lr=0.1, delta_decay=0.7 if with_delta else None, **config)
    clones = lambda *ts: [None if t is None else t.clone() for t in ts]  # noqa: E731
    rbuf, rdelta, d0 = clones(buf, delta, delta)
    out, rout = torch.empty_like(w), torch.empty_like(w)
    w0 = w.clone()
    assert ops.sgd_step(w, grad, buf, out=out, delta=delta, **kw) is out
    ref.sgd_step(w, grad, rbuf, out=rout, delta=rdelta, **kw)
    assert torch.equal(w, w0)  # w is only read
    assert_matches(out, rout)
    if buf is not None:
        assert_matches(buf, rbuf)
    if delta is not None:
        if dtype in (torch.float64, torch.float32):
            assert_matches(delta, rdelta)
        else:
            # out may differ from the reference by one bf16/fp16 ulp, and delta follows the stored
            # out: check it against the formula on the values actually written.
            s = sdt(dtype)
            assert_matches(delta, 0.7 * d0 + (1 - 0.7) * (out.to(s) - w.to(s)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 33, 200_003])
@pytest.mark.parametrize("beta1, weight_decay", [(0.9, 0.01), (0.3, 0.0)])  # 0.3: lerp's other branch
def test_adamw_step_matches_reference(dtype, n, beta1, weight_decay):
    torch.manual_seed(n)
    w, grad = rand(n, dtype), rand(n, dtype)
    m, v = rand(n, sdt(dtype)), rand(n, sdt(dtype), positive=True)
    rm, rv = m.clone(), v.clone()
    out, rout = torch.empty_like(w), torch.empty_like(w)
    kw = dict(step=3, lr=1e-2, beta1=beta1, beta2=0.999, eps=1e-8, weight_decay=weight_decay)
    assert ops.adamw_step(w, grad, m, v, out=out, **kw) is out
    ref.adamw_step(w, grad, rm, rv, out=rout, **kw)
    assert_matches(out, rout)
    assert_matches(m, rm)
    assert_matches(v, rv)


def test_sgd_delta_formula_float64():
    w, grad = rand(500, torch.float64), rand(500, torch.float64)
    delta = rand(500, torch.float64)
    d0 = delta.clone()
    out = torch.empty_like(w)
    ops.sgd_step(w, grad, None, lr=0.5, out=out, delta=delta, delta_decay=0.9)
    assert torch.equal(out, w - 0.5 * grad)
    torch.testing.assert_close(delta, 0.9 * d0 + 0.1 * (out - w), rtol=1e-15, atol=1e-16)


def test_first_step_ignores_old_buffer_contents():
    w, grad = rand(64, torch.float32), rand(64, torch.float32)
    buf = torch.full((64,), float("nan"))
    out = ops.sgd_step(w, grad, buf, lr=0.1, momentum=0.9, dampening=0.5, first_step=True, out=torch.empty_like(w))
    assert torch.equal(buf, grad)  # buf = grad on the first step, no dampening (torch semantics)
    assert torch.equal(out, w - 0.1 * grad)


def test_zero_weight_decay_and_momentum_never_touch_nonfinite_values():
    w = torch.tensor([float("inf"), 1.0, -2.0])
    grad = torch.tensor([0.0, 1.0, 1.0])
    out = ops.sgd_step(w, grad, None, lr=0.5, out=torch.empty_like(w))
    assert out.tolist() == [float("inf"), 0.5, -2.5]


# -- equivalence with torch.optim over several steps (float64) --------------------------------------

SGD_CONFIGS = [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.3),
    dict(lr=0.05, momentum=0.9, nesterov=True),
    dict(lr=0.05, momentum=0.5, weight_decay=0.1),
    dict(lr=0.02, momentum=0.9, dampening=0.1, weight_decay=0.05),
    dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.05),
]


@pytest.mark.parametrize("config", SGD_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sgd_step_equals_torch_optim_sgd_over_steps(config, dtype):
    """Updates go from the live slot into the next ring slot, as the pipeline engine does."""
    torch.manual_seed(0)
    n, steps = 4099, 6
    init = rand(n, dtype)
    param = torch.nn.Parameter(init.clone())
    opt = torch.optim.SGD([param], foreach=False, **config)
    ring = WeightRing.from_flat(init, num_slots=2)
    momentum = config.get("momentum", 0.0)
    buf = torch.empty(n, dtype=dtype) if momentum else None
    for step in range(steps):
        grad = rand(n, dtype)
        param.grad = grad.clone()
        opt.step()
        slot = ring.acquire()
        ops.sgd_step(ring.live, grad, buf, first_step=step == 0, out=ring.slot(slot), **config)
        ring.publish(slot, step + 1)
        tol = dict(rtol=1e-13, atol=1e-14) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ring.live, param.detach(), **tol)
        if momentum:
            torch.testing.assert_close(buf, opt.state[param]["momentum_buffer"], **tol)


ADAMW_CONFIGS = [
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2),
    dict(lr=1e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0),
    dict(lr=5e-2, betas=(0.3, 0.9), eps=1e-8, weight_decay=0.1),
]


@pytest.mark.parametrize("config", ADAMW_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_adamw_step_equals_torch_optim_adamw_over_steps(config, dtype):
    torch.manual_seed(1)
    n, steps = 4099, 6
    init = rand(n, dtype)
    param = torch.nn.Parameter(init.clone())
    opt = torch.optim.AdamW([param], foreach=False, **config)
    ring = WeightRing.from_flat(init, num_slots=2)
    m, v = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
    (beta1, beta2) = config["betas"]
    for step in range(1, steps + 1):
        grad = rand(n, dtype)
        param.grad = grad.clone()
        opt.step()
        slot = ring.acquire()
        ops.adamw_step(ring.live, grad, m, v, step=step, lr=config["lr"], beta1=beta1, beta2=beta2,
                       eps=config["eps"], weight_decay=config["weight_decay"], out=ring.slot(slot))
        ring.publish(slot, step)
        tol = dict(rtol=1e-13, atol=1e-14) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ring.live, param.detach(), **tol)
        torch.testing.assert_close(m, opt.state[param]["exp_avg"], **tol)
        torch.testing.assert_close(v, opt.state[param]["exp_avg_sq"], **tol)


def test_in_place_steps_equal_out_of_place():
    w, grad = rand(777, torch.float32), rand(777, torch.float32)
    buf1 = rand(777, torch.float32)
    buf2 = buf1.clone()
    out = ops.sgd_step(w, grad, buf1, lr=0.1, momentum=0.9, out=torch.empty_like(w))
    w2 = w.clone()
    ops.sgd_step(w2, grad, buf2, lr=0.1, momentum=0.9, out=w2)
    assert torch.equal(out, w2) and torch.equal(buf1, buf2)
    m, v = torch.zeros(777), torch.zeros(777)
    out = ops.adamw_step(w, grad, m, v, step=1, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
                         out=torch.empty_like(w))
    m2, v2 = torch.zeros(777), torch.zeros(777)
    w3 = w.clone()
    ops.adamw_step(w3, grad, m2, v2, step=1, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    assert torch.equal(out, w3) and torch.equal(m, m2) and torch.equal(v, v2)


def test_results_do_not_depend_on_thread_count():
    w, grad, buf = rand(300_001, torch.bfloat16), rand(300_001, torch.bfloat16), rand(300_001, torch.float32)
    old = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            b = buf.clone()
            results.append((ops.sgd_step(w, grad, b, lr=0.1, momentum=0.9, out=torch.empty_like(w)), b))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def _all_ops(dtype: torch.dtype, n: int, offset: int, in_place: bool) -> list[torch.Tensor]:
    """Runs every op (and SGD variant) once on fixed data; returns everything written."""
    torch.manual_seed(0)
    w, v = rand(n, dtype), rand(n, dtype)
    results = []

    def out_buffer() -> torch.Tensor:
        if in_place:
            return w.clone()
        return torch.empty(n + offset, dtype=dtype)[offset:]  # misaligned start for offset > 0

    o = out_buffer()
    results.append(ops.interpolate(o if in_place else w, v, 0.3, out=o))
    o = out_buffer()
    results.append(ops.predict(o if in_place else w, v, 0.1, out=o))
    for cfg in (dict(), dict(momentum=0.9, weight_decay=0.1), dict(momentum=0.9, nesterov=True, first_step=True)):
        buf, delta = rand(n, sdt(dtype)), rand(n, sdt(dtype))
        o = out_buffer()
        results += [ops.sgd_step(o if in_place else w, v, buf, lr=0.1, out=o, delta=delta, delta_decay=0.5, **cfg),
                    buf, delta]
    m, s2 = rand(n, sdt(dtype)), rand(n, sdt(dtype), positive=True)
    o = out_buffer()
    results += [ops.adamw_step(o if in_place else w, v, m, s2, step=2, lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8,
                               weight_decay=0.1, out=o), m, s2]
    for decoupled in (False, True):
        m, s2 = rand(n, sdt(dtype)), rand(n, sdt(dtype), positive=True)
        o = out_buffer()
        results += [ops.nadam_step(o if in_place else w, v, m, s2, step=2, mu_product=0.8, lr=0.01, beta1=0.9,
                                   beta2=0.99, eps=1e-8, weight_decay=0.1, momentum_decay=0.004,
                                   decoupled_weight_decay=decoupled, out=o), m, s2]
    return results


def _store_widths() -> list[int]:
    """The streaming store widths this CPU can run: 16 bytes always (x86-64), 32 where it has AVX."""
    native = _C._streaming_store_bytes()
    return sorted({16, native}) if native else [0]


@pytest.mark.parametrize("width", _store_widths())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset, in_place", [(0, False), (1, False), (3, False), (0, True)])
def test_streaming_stores_give_identical_results(dtype, offset, in_place, width):
    """Large calls write `out` with non-temporal stores through a small tile buffer; force that path on
    small tensors (unaligned starts, many tiles and a tail shorter than a store) with each store width this
    CPU has, and compare with ordinary stores."""
    n = 3 * 8192 + 5
    old, old_width = _C._streaming_threshold(), _C._streaming_store_bytes()
    try:
        _C._set_streaming_threshold(-1)
        plain = _all_ops(dtype, n, offset, in_place)
        _C._set_streaming_threshold(0)
        if width:
            _C._set_streaming_store_bytes(width)
        assert _C._streaming_store_bytes() == width
        streamed = _all_ops(dtype, n, offset, in_place)
    finally:
        _C._set_streaming_threshold(old)
        if old_width:
            _C._set_streaming_store_bytes(old_width)
    for a, b in zip(plain, streamed):
        assert torch.equal(a, b)


def test_a_streaming_store_width_the_cpu_lacks_is_refused():
    if not _C._streaming_store_bytes():
        with pytest.raises(ValueError, match="one width, 0 bytes, got 16"):
            _C._set_streaming_store_bytes(16)
        return
    with pytest.raises(ValueError, match="width must be 16.* bytes, got 8"):
        _C._set_streaming_store_bytes(8)
    assert _C._streaming_store_bytes() in (16, 32)


def test_written_tensors_get_their_autograd_version_bumped():
    w, grad = rand(10, torch.float32), rand(10, torch.float32)
    buf, delta, out = torch.zeros(10), torch.zeros(10), torch.empty(10)
    before = [t._version for t in (w, grad, buf, delta, out)]
    ops.sgd_step(w, grad, buf, lr=0.1, momentum=0.9, out=out, delta=delta, delta_decay=0.5)
    after = [t._version for t in (w, grad, buf, delta, out)]
    assert after[:2] == before[:2] and all(a == b + 1 for a, b in zip(after[2:], before[2:]))


def test_dispatch():
    assert ops.backend_for(torch.empty(1)) == "cpp"
    assert ops.backend_for(torch.empty(1, device="meta")) == "reference"
    a, b = torch.empty(10, device="meta"), torch.empty(10, device="meta")
    assert ops.interpolate(a, b, 0.5).device.type == "meta"  # other devices use the reference


# -- bad input: ValueError naming the argument, nothing written ----------------------------------------

def _sgd_args(n: int = 16) -> dict:
    return dict(w=rand(n, torch.float32), grad=rand(n, torch.float32), momentum_buf=torch.zeros(n),
                out=torch.zeros(n), delta=torch.zeros(n))


def _call_sgd(a: dict, **kw) -> None:
    ops.sgd_step(a["w"], a["grad"], a["momentum_buf"], lr=0.1, momentum=0.9, out=a["out"], delta=a["delta"],
                 delta_decay=0.5, **kw)


BAD_SGD = [
    ("grad", lambda a: a["grad"].double(), "argument 'grad' has dtype torch.float64 but 'w' has dtype torch.float32"),
    ("grad", lambda a: torch.zeros(16, dtype=torch.int64), "argument 'grad' has dtype torch.int64"),
    ("w", lambda a: torch.zeros(16, dtype=torch.int32), "argument 'w' has dtype torch.int32; expected one of"),
    ("out", lambda a: torch.zeros(17), "argument 'out' has shape (17,) but 'w' has shape (16,)"),
    ("grad", lambda a: torch.zeros(32)[::2], "argument 'grad' must be contiguous"),
    ("momentum_buf", lambda a: torch.zeros(16, dtype=torch.bfloat16),
     "argument 'momentum_buf' has dtype torch.bfloat16; optimizer state for torch.float32 weights must be "
     "torch.float32"),
    ("delta", lambda a: torch.zeros(16, dtype=torch.float64), "argument 'delta' has dtype torch.float64"),
    ("grad", lambda a: torch.zeros(16, device="meta"), "argument 'grad' is on meta but 'w' is on cpu"),
    ("grad", lambda a: a["out"], "argument 'out' overlaps argument 'grad' in memory; 'out' may only be exactly 'w'"),
    ("delta", lambda a: a["momentum_buf"], "argument 'momentum_buf' overlaps argument 'delta' in memory"),
    ("grad", lambda a: [0.0] * 16, "argument 'grad' must be a torch.Tensor, got list"),
]


@pytest.mark.parametrize("name, make, message", BAD_SGD)
def test_sgd_bad_input_raises_and_writes_nothing(name, make, message):
    a = _sgd_args()
    a[name] = make(a)
    snapshot = {k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"}
    with pytest.raises(ValueError, match=re.escape(message)):
        _call_sgd(a)
    for k, v in snapshot.items():
        assert torch.equal(a[k], v), f"{k} was modified"


def test_partial_overlap_of_out_and_w_is_rejected():
    buf = torch.arange(20, dtype=torch.float32)
    before = buf.clone()
    with pytest.raises(ValueError, match="argument 'out' overlaps argument 'w'"):
        ops.sgd_step(buf[0:10], torch.ones(10), None, lr=0.1, out=buf[1:11])
    with pytest.raises(ValueError, match="argument 'out' overlaps argument 'live'"):
        ops.interpolate(buf[0:10], torch.ones(10), 0.5, out=buf[5:15])
    assert torch.equal(buf, before)


def test_slots_of_one_ring_do_not_count_as_overlapping():
    ring = WeightRing(100, 2)
    ops.predict(ring.slot(0), torch.ones(100), 1.0, out=ring.slot(1))
    assert torch.all(ring.slot(1) == -1.0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr="0.1"), "argument 'lr' must be a real number, got str"),
    (dict(lr=-1.0), "invalid learning rate lr=-1.0"),
    (dict(lr=0.1, momentum=0.9, nesterov=True, dampening=0.1), "nesterov momentum requires momentum > 0 and "
                                                                "dampening == 0"),
    (dict(lr=0.1, momentum=0.9), "argument 'momentum_buf' is required when momentum != 0"),
    (dict(lr=0.1, delta=torch.zeros(8)), "argument 'delta_decay' is required when 'delta' is given"),
    (dict(lr=0.1, weight_decay=True), "argument 'weight_decay' must be a real number, got bool"),
])
def test_sgd_bad_scalars(kwargs, message):
    w = torch.ones(8)
    with pytest.raises(ValueError, match=re.escape(message)):
        ops.sgd_step(w, torch.ones(8), None, **kwargs)
    assert torch.equal(w, torch.ones(8))


@pytest.mark.parametrize("change, message", [
    (dict(step=0), "argument 'step' must be an integer >= 1"),
    (dict(step=1.0), "argument 'step' must be an integer >= 1"),
    (dict(beta1=1.0), "invalid beta1=1.0"),
    (dict(eps=-1.0), "invalid eps=-1.0"),
    (dict(exp_avg=torch.zeros(8, dtype=torch.float64)), "argument 'exp_avg' has dtype torch.float64"),
    (dict(exp_avg_sq="x"), "argument 'exp_avg_sq' must be a torch.Tensor"),
    (dict(out="alias m"), "argument 'out' overlaps argument 'exp_avg' in memory"),
    (dict(grad=torch.zeros(8, dtype=torch.float16)), "argument 'grad' has dtype torch.float16"),
])
def test_adamw_bad_input(change, message):
    a = dict(w=torch.ones(8), grad=torch.ones(8), exp_avg=torch.zeros(8), exp_avg_sq=torch.zeros(8),
             step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, out=torch.zeros(8))
    a.update(change)
    if isinstance(a["out"], str):
        a["out"] = a["exp_avg"]
    snapshot = {k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor)}
    w, grad, m, v = a.pop("w"), a.pop("grad"), a.pop("exp_avg"), a.pop("exp_avg_sq")
    with pytest.raises(ValueError, match=re.escape(message)):
        ops.adamw_step(w, grad, m, v, **a)
    for k, t in snapshot.items():
        current = {"w": w, "grad": grad, "exp_avg": m, "exp_avg_sq": v, "out": a["out"]}[k]
        assert torch.equal(current, t), f"{k} was modified"


@pytest.mark.parametrize("call, message", [
    (lambda: ops.interpolate(torch.ones(4), torch.ones(4), "a"), "argument 'alpha' must be a real number"),
    (lambda: ops.interpolate(torch.ones(4), torch.ones(5), 0.5), "argument 'stale' has shape (5,)"),
    (lambda: ops.interpolate(torch.ones(4), torch.ones(4), 0.5, out=torch.ones(4, dtype=torch.float64)),
     "argument 'out' has dtype torch.float64 but 'live' has dtype torch.float32"),
    (lambda: ops.predict(torch.ones(4, dtype=torch.int64), torch.ones(4), 0.5), "argument 'w' has dtype torch.int64"),
    (lambda: ops.predict(torch.ones(4, 2).t(), torch.ones(2, 4), 0.5), "argument 'w' must be contiguous"),
])
def test_interpolate_predict_bad_input(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_extension_checks_arguments_too():
    """Direct callers of pipecore._C get a ValueError instead of memory errors."""
    out = torch.zeros(10)
    with pytest.raises(ValueError, match="argument 'stale' has 9 elements, expected 10"):
        _C.interpolate(out, torch.ones(10), torch.ones(9), 0.5)
    with pytest.raises(ValueError, match="argument 'momentum_buf' is required"):
        _C.sgd_step(out, torch.ones(10), torch.ones(10), None, None, 0.1, 0.9, 0.0, 0.0, False, False, 0.0)
    with pytest.raises(ValueError, match="argument 'exp_avg' has dtype Double, expected Float"):
        _C.adamw_step(out, torch.ones(10), torch.ones(10), torch.zeros(10, dtype=torch.float64), torch.zeros(10),
                      1.0, 0.9, 0.99, 1e-8, 0.1, 1.0)
    assert torch.count_nonzero(out) == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["fresh", "alias", "shifted", "strided", "long"]),
                          st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int32]),
                          st.integers(0, 2)), min_size=3, max_size=5))
def test_native_fast_check_agrees_with_detailed_checks(specs):
    """The extension's one-call check (used first on every op call) says yes exactly when the
    detailed Python checks accept the arguments."""
    from pipecore.ops import _checks

    pool = torch.zeros(64, dtype=torch.float64)
    tensors = []
    for kind, dtype, index in specs:
        if kind == "alias" and tensors:
            t = tensors[index % len(tensors)]
        elif kind == "shifted" and tensors and tensors[index % len(tensors)].dtype == torch.float64:
            t = pool[1:9]
        elif kind == "strided":
            t = torch.zeros(16, dtype=dtype)[::2]
        elif kind == "long":
            t = torch.zeros(9, dtype=dtype)
        else:
            t = pool[:8] if dtype == torch.float64 and index == 0 else torch.zeros(8, dtype=dtype)
        tensors.append(t)
    n_weights = 3
    names = ("w", "grad", "out", "momentum_buf", "delta")[:len(tensors)]
    sig = _checks.Signature("sgd_step", names[:n_weights], names[n_weights:], written=("out", *names[n_weights:]),
                            out_may_alias=("w",))
    try:
        _checks.check(sig.op, list(zip(sig.weights, tensors[:n_weights])), list(zip(sig.states, tensors[n_weights:])),
                      sig.written, sig.out_may_alias)
        valid = True
    except ValueError:
        valid = False
    fast = _C._args_ok(tensors, n_weights, sig._written_mask, sig._out_index, sig._alias_mask)
    assert fast == valid


# -- CUDA: Triton through the dispatch (runs on GPU machines) -----------------------------------------

@CUDA
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 4099, 1 << 20])
def test_cuda_ops_match_reference(dtype, n):
    torch.manual_seed(0)
    w, v = rand(n, dtype, "cuda"), rand(n, dtype, "cuda")
    assert ops.backend_for(w) == "triton"
    assert_matches(ops.interpolate(w, v, 0.3).cpu(), ref.interpolate(w, v, 0.3).cpu())
    assert_matches(ops.predict(w, v, 0.01).cpu(), ref.predict(w, v, 0.01).cpu())
    buf, delta = rand(n, sdt(dtype), "cuda"), rand(n, sdt(dtype), "cuda")
    rbuf, rdelta = buf.clone(), delta.clone()
    kw = dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True, delta_decay=0.5)
    out = ops.sgd_step(w, v, buf, out=torch.empty_like(w), delta=delta, **kw)
    rout = ref.sgd_step(w, v, rbuf, out=torch.empty_like(w), delta=rdelta, **kw)
    for a, b in ((out, rout), (buf, rbuf), (delta, rdelta)):
        assert_matches(a.cpu(), b.cpu())
    m, s = rand(n, sdt(dtype), "cuda"), rand(n, sdt(dtype), "cuda", positive=True)
    rm, rs = m.clone(), s.clone()
    kw = dict(step=2, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    out = ops.adamw_step(w, v, m, s, out=torch.empty_like(w), **kw)
    rout = ref.adamw_step(w, v, rm, rs, out=torch.empty_like(w), **kw)
    for a, b in ((out, rout), (m, rm), (s, rs)):
        assert_matches(a.cpu(), b.cpu())


@CUDA
def test_cuda_adamw_equals_torch_optim_float64():
    torch.manual_seed(0)
    init = rand(10_000, torch.float64, "cuda")
    param = torch.nn.Parameter(init.clone())
    opt = torch.optim.AdamW([param], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, foreach=False)
    w, m, v = init.clone(), torch.zeros_like(init), torch.zeros_like(init)
    for step in range(1, 5):
        grad = rand(10_000, torch.float64, "cuda")
        param.grad = grad.clone()
        opt.step()
        ops.adamw_step(w, grad, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
        torch.testing.assert_close(w, param.detach(), rtol=1e-13, atol=1e-14)
