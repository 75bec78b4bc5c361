"""The Triton launchers' choice of block size and num_warps (kernels/fused.py ``_config``), without a GPU.

The timing itself needs CUDA events; here it is replaced by FABRICATED times, to check what is chosen,
what is cached, and that a failed tuning falls back to the default with a warning. That a configuration
never changes a result is shown under the interpreter (test_kernels_triton.py) and by construction: every
element is computed alone."""

from __future__ import annotations

import pytest
import torch

from test_kernels_triton import NO_TRITON, triton_installed

if not triton_installed():
    pytest.skip(NO_TRITON, allow_module_level=True)

from pipecore.kernels import fused  # noqa: E402  (with Triton installed, a failing import is a failure)

CUDA0 = torch.device("cuda", 0)  # constructing a device needs no GPU; nothing is launched on it here


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(fused, "_tuned", {})
    monkeypatch.delenv("PIPECORE_TRITON_AUTOTUNE", raising=False)


def test_the_fastest_configuration_is_chosen_once_per_kernel_dtype_and_size_bucket(monkeypatch):
    fake_ms = {(4, 4): 3.0, (8, 4): 1.0, (4, 8): 2.0, (8, 2): 4.0}  # FABRICATED timings
    timed, scratches = [], []
    monkeypatch.setattr(fused, "_time_launch", lambda launch, w, v: timed.append((w, v)) or fake_ms[(w, v)])

    def scratch():
        scratches.append(1)
        return lambda warps, vectors: None

    n = 3 << 20
    assert fused._config("sgd", n, torch.bfloat16, CUDA0, scratch) == (8, 4)
    assert sorted(timed) == sorted(fake_ms) and len(scratches) == 1
    assert fused._config("sgd", n + 5, torch.bfloat16, CUDA0, scratch) == (8, 4)  # same bucket: cached
    assert len(scratches) == 1
    fused._config("sgd", n, torch.float32, CUDA0, scratch)        # another dtype
    fused._config("adamw", n, torch.bfloat16, CUDA0, scratch)     # another kernel
    fused._config("sgd", 8 << 20, torch.bfloat16, CUDA0, scratch)  # another power-of-two bucket
    assert len(scratches) == 4


def test_small_calls_cpu_tensors_and_the_switch_use_the_default(monkeypatch):
    monkeypatch.setattr(fused, "_time_launch", lambda *a: pytest.fail("timed"))
    default = (fused._NUM_WARPS, fused._VECTORS_PER_THREAD)
    assert fused._config("sgd", fused._TUNE_MIN_NUMEL - 1, torch.float32, CUDA0, None) == default
    assert fused._config("sgd", 1 << 26, torch.float32, torch.device("cpu"), None) == default
    monkeypatch.setenv("PIPECORE_TRITON_AUTOTUNE", "0")
    assert fused._config("sgd", 1 << 26, torch.float32, CUDA0, None) == default


def test_a_failed_tuning_warns_and_uses_the_default(monkeypatch):
    def boom(*args):
        raise RuntimeError("no kernel image")
    monkeypatch.setattr(fused, "_time_launch", boom)
    with pytest.warns(RuntimeWarning, match=r"timing sgd's launch configurations failed \(RuntimeError: no kernel "
                                            r"image\); using the default \(4 warps, 4 vectors per thread\)"):
        assert fused._config("sgd", 1 << 22, torch.float32, CUDA0, lambda: None) == (4, 4)

    def oom(*args):
        raise torch.cuda.OutOfMemoryError("scratch")
    monkeypatch.setattr(fused, "_time_launch", oom)
    assert fused._config("adamw", 1 << 22, torch.float32, CUDA0, lambda: None) == (4, 4)


def test_every_candidate_is_a_power_of_two_block_within_triton_limits():
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        assert fused.block_size(dtype) * dtype.itemsize == 16 * 32 * 4 * 4
        for warps, vectors in fused._CANDIDATES:
            block = fused.block_size(dtype, warps, vectors)
            assert block & (block - 1) == 0 and block <= 1 << 20
