"""Build script for pipecore and its C++/CUDA extension ``pipecore._C``.

Install with ``pip install --no-build-isolation .`` (or ``-e .``): the extension must be compiled
against the torch that is already installed, and an isolated build environment would download a
second copy of torch. CUDA sources are compiled only when the installed torch was built with CUDA
and ``nvcc`` is available; otherwise the extension is CPU-only and CUDA tensors use Triton kernels.
"""

from __future__ import annotations

import glob
import os
import sys

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
    # No -std flag: BuildExtension adds the standard the installed torch's headers need.
    # -fno-math-errno lets sqrt vectorize; -ffp-contract=off keeps a*b+c unfused so results do not
    # depend on which instruction set the loader picks for the multi-versioned kernels.
    cxx_flags = ["-O3", "-fvisibility=hidden", "-fno-math-errno", "-ffp-contract=off"]
    # Let the loader find libc10/libtorch even when pipecore._C is imported before torch: next to
    # an installed torch ($ORIGIN/../torch/lib), or the torch this was built against (editable
    # installs, where _C sits in the source tree).
    torch_lib = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "lib")
    origin = "$ORIGIN" if sys.platform.startswith("linux") else "@loader_path"
    link_flags = [] if sys.platform == "win32" else [
        f"-Wl,-rpath,{origin}/../torch/lib",
        f"-Wl,-rpath,{torch_lib}",
    ]
    # at::parallel_for is a header template: with torch's OpenMP backend the extension itself must
    # be compiled with OpenMP, or every kernel silently runs on one thread.
    if sys.platform.startswith("linux") and torch.backends.openmp.is_available():
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
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
            extra_link_args=link_flags,
        )
    return CppExtension("pipecore._C", cpp, extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags)


setup(
    packages=find_packages(include=["pipecore", "pipecore.*"]) + ["pipecore.kernels"],
    # The Triton kernels live at the top of the repository (kernels/) and install as pipecore.kernels.
    # This also holds for editable installs run from the repository root: the source tree's
    # pipecore/ is imported first, then setuptools' editable finder resolves pipecore.kernels to
    # kernels/, and build_ext puts _C*.so in place inside pipecore/.
    package_dir={"pipecore.kernels": "kernels"},
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
