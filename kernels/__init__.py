"""Triton kernels behind ``pipecore.ops`` for CUDA tensors (installed as ``pipecore.kernels``).

The launchers need Triton but no GPU. Use ``pipecore.ops`` rather than these launchers: they skip argument
checks. On a machine without a GPU the kernels can still be run on CPU tensors with ``TRITON_INTERPRET=1`` set
before Triton is first imported (this is how the tests run them).

Importing the package itself imports nothing (the launchers load from ``fused.py`` on first use): run from the
repository's root, where ``python -m`` puts this folder on the path as a top-level ``kernels``, a library that
probes for another package of that name (``transformers`` looks for Hugging Face's ``kernels``) imports it, and
must not fail for want of Triton.
"""

from __future__ import annotations

from typing import Any

__all__ = ["adamw_step", "block_size", "interpolate", "nadam_step", "predict", "sgd_step"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import fused

        return getattr(fused, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
