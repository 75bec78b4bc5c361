"""Triton kernels (pipecore.kernels) under the Triton interpreter, against the torch reference.

TRITON_INTERPRET must be set before Triton is imported, and other tests may import it first, so
each test runs this file as a script in a fresh Python with TRITON_INTERPRET=1. The script calls
the Triton launchers directly on CPU tensors (the dispatch would pick the C++ kernels for those)
and exits non-zero on any mismatch; one test sabotages a kernel to show that a wrong kernel fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, str(HERE), *args], cwd=HERE.parent.parent, env=env,
                          capture_output=True, text=True, timeout=600)


def check(*groups: str) -> None:
    proc = run_script(*groups)
    assert proc.returncode == 0, f"interpreter checks failed:\n{proc.stdout}\n{proc.stderr}"
    for group in groups:
        assert f"ok {group}" in proc.stdout, proc.stdout


def test_triton_interpolate_and_predict():
    check("interpolate", "predict")


def test_triton_sgd_step():
    check("sgd")


def test_triton_adamw_step():
    check("adamw")


def test_a_wrong_kernel_fails_the_check():
    proc = run_script("interpolate", "--sabotage")
    assert proc.returncode != 0
    assert "MISMATCH" in proc.stdout, proc.stdout + proc.stderr


# -- script mode: runs in the subprocess ---------------------------------------------------------------

def _main(argv: list[str]) -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    import pipecore.kernels as K
    from pipecore.kernels import fused
    from pipecore.ops import reference as ref

    sys.path.insert(0, str(HERE.parent))
    from test_ops import assert_matches, rand, sdt

    assert isinstance(fused._interpolate_kernel, InterpretedFunction), "kernels are not interpreted"
    if "--sabotage" in argv:
        real = fused._scalars
        fused._scalars = lambda values, dtype, device: real([values[0] + 1e-3, *values[1:]], dtype, device)
    groups = [a for a in argv if not a.startswith("--")]
    failures = 0

    def compare(label: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        nonlocal failures
        try:
            assert_matches(actual, expected)
        except AssertionError as exc:
            failures += 1
            print(f"MISMATCH {label}: {exc}")

    dtypes = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
    for group in groups:
        for dtype in dtypes:
            block = K.block_size(dtype)
            assert block * dtype.itemsize == 16 * 32 * 4 * 4  # 16-byte vectors, 4 per thread, 4 warps
            for n in (1, 2 * block + 3):  # several programs and a masked tail
                torch.manual_seed(n)
                w, v = rand(n, dtype), rand(n, dtype)
                tag = f"{group} {dtype} n={n}"
                if group == "interpolate":
                    out = torch.empty_like(w)
                    K.interpolate(out, w, v, 0.3)
                    compare(tag, out, ref.interpolate(w, v, 0.3))
                    x = w.clone()
                    K.interpolate(x, x, v, 0.6)  # out aliasing live
                    compare(tag + " in place", x, ref.interpolate(w, v, 0.6))
                elif group == "predict":
                    out = torch.empty_like(w)
                    K.predict(out, w, v, 0.05)
                    compare(tag, out, ref.predict(w, v, 0.05))
                elif group == "sgd":
                    configs = [dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, first_step=False),
                               dict(momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=False, first_step=False),
                               dict(momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True, first_step=False),
                               dict(momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True, first_step=True)]
                    for cfg in configs:
                        for with_delta in (False, True):
                            buf = rand(n, sdt(dtype)) if cfg["momentum"] else None
                            delta = rand(n, sdt(dtype), scale=0.01) if with_delta else None
                            rbuf = None if buf is None else buf.clone()
                            rdelta = None if delta is None else delta.clone()
                            d0 = None if delta is None else delta.clone()
                            out = torch.empty_like(w)
                            K.sgd_step(out, w, v, buf, delta, lr=0.1, delta_decay=0.7, **cfg)
                            rout = ref.sgd_step(w, v, rbuf, lr=0.1, out=torch.empty_like(w), delta=rdelta,
                                                delta_decay=0.7 if with_delta else None, **cfg)
                            label = f"{tag} {cfg} delta={with_delta}"
                            compare(label + " out", out, rout)
                            if buf is not None:
                                compare(label + " momentum_buf", buf, rbuf)
                            if delta is not None:
                                s = sdt(dtype)
                                compare(label + " delta", delta, 0.7 * d0 + 0.3 * (out.to(s) - w.to(s)))
                    x, b1 = w.clone(), rand(n, sdt(dtype))
                    b2 = b1.clone()
                    K.sgd_step(x, x, v, b1, None, lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0,
                               nesterov=False, first_step=False, delta_decay=0.0)  # out aliasing w
                    compare(tag + " in place", x, ref.sgd_step(w, v, b2, lr=0.1, momentum=0.9,
                                                               out=torch.empty_like(w)))
                elif group == "adamw":
                    for beta1, wd, step in ((0.9, 0.01, 1), (0.3, 0.0, 4)):
                        m, s2 = rand(n, sdt(dtype)), rand(n, sdt(dtype), positive=True)
                        rm, rs = m.clone(), s2.clone()
                        lr, beta2, eps = 1e-2, 0.999, 1e-8
                        out = torch.empty_like(w)
                        K.adamw_step(out, w, v, m, s2, wd_factor=1 - lr * wd, beta1=beta1, beta2=beta2, eps=eps,
                                     step_size=lr / (1 - beta1**step),
                                     bias_correction2_sqrt=(1 - beta2**step) ** 0.5)
                        rout = ref.adamw_step(w, v, rm, rs, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                              weight_decay=wd, out=torch.empty_like(w))
                        label = f"{tag} beta1={beta1} step={step}"
                        compare(label + " out", out, rout)
                        compare(label + " exp_avg", m, rm)
                        compare(label + " exp_avg_sq", s2, rs)
                else:
                    raise SystemExit(f"unknown group {group!r}")
        print(f"ok {group}" if not failures else f"failed {group}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
