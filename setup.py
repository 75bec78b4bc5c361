"""Build script for pipecore and its C++/CUDA extension ``pipecore._C``.

Install with ``pip install --no-build-isolation .`` (or ``-e .``): the extension must be compiled
against the torch that is already installed, and an isolated build environment would download a
second copy of torch. CUDA sources are compiled only when the installed torch was built with CUDA
and ``nvcc`` is available; otherwise the extension is CPU-only and CUDA tensors use Triton kernels.
"""

from __future__ import annotations

import glob
import os
import platform
import subprocess
import sys
import sysconfig

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


SANITIZERS = ("address", "undefined", "thread")


def _sanitize_flags() -> tuple[list[str], list[str]]:
    """Compile and link flags for ``PIPECORE_SANITIZE`` (e.g. ``address,undefined`` or ``thread``).

    A sanitized build also asserts at every raise site that the GIL is held (csrc/README.md). Running it
    needs the sanitizer runtime preloaded into Python: see docs/kernels.md.
    """
    value = os.environ.get("PIPECORE_SANITIZE", "").strip()
    if not value:
        return [], []
    chosen = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SANITIZERS]
    if unknown or not chosen:
        raise SystemExit(f"PIPECORE_SANITIZE={value!r}: unknown sanitizer {unknown}; allowed: "
                         f"{', '.join(SANITIZERS)} (address and undefined together, thread on its own)")
    if "thread" in chosen and len(chosen) > 1:
        raise SystemExit(f"PIPECORE_SANITIZE={value!r}: 'thread' cannot be combined with another sanitizer")
    sanitize = "-fsanitize=" + ",".join(chosen)
    # -O1 and frame pointers for readable reports; UBSan stops at its first finding so that tests fail on it.
    compile_flags = [sanitize, "-g", "-O1", "-fno-omit-frame-pointer", "-DPIPECORE_CHECK_GIL=1"]
    if "undefined" in chosen:
        compile_flags.append("-fno-sanitize-recover=undefined")
    return compile_flags, [sanitize]


def _compiler_file(name: str) -> str | None:
    """The path the C++ compiler would link for ``name`` (``-print-file-name``), or None if it has none."""
    cxx = os.environ.get("CXX") or (sysconfig.get_config_var("CXX") or "c++").split()[0]
    try:
        found = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True,
                               timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    # Without the file, the compiler echoes the bare name back.
    return found if os.path.isabs(found) and os.path.exists(found) else None


def _shared_cxx_runtime() -> list[str]:
    """Link arguments that keep the C++ runtime out of ``pipecore._C`` (Linux with libstdc++).

    Some toolchains have only the static ``libstdc++.a`` for linking (the unversioned ``libstdc++.so``
    development link is not installed). The compiler then copies the C++ runtime into the extension,
    beside the shared one that torch and Python already loaded, and the two copies' locales disagree:
    formatting a number into a message (``c10::str(..., key, ...)``) reads the other copy's facet
    table and crashes the interpreter. On the first GPU machine every error raised by ``pipecore._C``
    with a number in its message was a segmentation fault. Linking the shared runtime by its full
    name resolves every C++ runtime symbol there before the compiler's own ``-lstdc++`` can pull in
    the archive.
    """
    if not sys.platform.startswith("linux") or _compiler_file("libstdc++.so") is not None:
        return []
    shared = _compiler_file("libstdc++.so.6")
    if shared is None:
        raise SystemExit(
            "pipecore's build: the C++ compiler has neither libstdc++.so nor libstdc++.so.6 to link, so it "
            "would copy the static C++ runtime into pipecore._C, which crashes next to torch's. Install the "
            "C++ runtime's development files (e.g. libstdc++-<version>-dev) or set CXX to another compiler.")
    return [shared]


def _extension():
    # No -std flag: BuildExtension adds the standard the installed torch's headers need.
    # -fno-math-errno lets sqrt vectorize; -ffp-contract=off keeps a*b+c unfused so results do not
    # depend on which instruction set the loader picks for the multi-versioned kernels.
    cxx_flags = ["-O3", "-fvisibility=hidden", "-fno-math-errno", "-ffp-contract=off"]
    # 256-bit vectors in the AVX-512 clones too: the kernels are bound by memory bandwidth, and on an Intel
    # Xeon their 512-bit loads and stores were 10-18% slower than AVX2 once the data left the cache, while
    # AVX2 was never slower (docs/kernels.md, implementation notes).
    if platform.machine().lower() in ("x86_64", "amd64") and sys.platform != "win32":
        cxx_flags.append("-mprefer-vector-width=256")
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
    link_flags += _shared_cxx_runtime()
    sanitize_compile, sanitize_link = _sanitize_flags()
    cxx_flags += sanitize_compile  # after -O3: the sanitizers' -O1 wins
    link_flags += sanitize_link
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
