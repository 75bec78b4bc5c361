"""Triton kernels behind ``pipecore.ops`` for CUDA tensors (installed as ``pipecore.kernels``).

Importing this package needs Triton but no GPU. Use ``pipecore.ops`` rather than these launchers:
they skip argument checks. On a machine without a GPU the kernels can still be run on CPU tensors
with ``TRITON_INTERPRET=1`` set before Triton is first imported (this is how the tests run them).
"""

from .fused import adamw_step, block_size, interpolate, nadam_step, predict, sgd_step

__all__ = ["adamw_step", "block_size", "interpolate", "nadam_step", "predict", "sgd_step"]
