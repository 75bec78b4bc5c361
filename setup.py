"""Build script for pipecore and its C++/CUDA extension ``pipecore._C``.

Install with ``pip install --no-build-isolation .`` (or ``-e .``): the extension must be compiled
against the torch that is already installed, and an isolated build environment would download a
second copy of torch. CUDA sources are compiled only when the installed torch was built with CUDA
and ``nvcc`` is available; otherwise the extension is CPU-only and CUDA tensors use Triton kernels.
"""

from __future__ import annotations

import glob
import os

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise SystemExit(
        "pipecore's build needs torch installed first: pip install torch, then "
        "pip install --no-build-isolation ."
    ) from exc

HERE = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", pattern)))


def _extension():
    cxx_flags = ["-O3", "-std=c++17"]
    cpp = _sources("*.cpp")
    cuda = _sources("*.cu")
    with_cuda = bool(cuda) and torch.version.cuda is not None and CUDA_HOME is not None
    if os.environ.get("PIPECORE_NO_CUDA") == "1":
        with_cuda = False
    if with_cuda:
        return CUDAExtension(
            "pipecore._C",
            cpp + cuda,
            define_macros=[("PIPECORE_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "--use_fast_math"]},
        )
    return CppExtension("pipecore._C", cpp, extra_compile_args={"cxx": cxx_flags})


setup(
    packages=find_packages(include=["pipecore", "pipecore.*"]) + ["pipecore.kernels"],
    # The Triton kernels live at the top of the repository (kernels/) and install as pipecore.kernels.
    package_dir={"pipecore.kernels": "kernels"},
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
