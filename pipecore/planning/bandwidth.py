"""The all-reduce bandwidth the data x pipeline planner assumes: given, or measured on this machine.

:func:`measure_allreduce` starts two local processes (``torch.distributed`` on gloo, a file store in a
temporary directory), all-reduces a float32 tensor of a few MiB between them a few times, and takes the median
time. With two processes a ring all-reduce moves ``2 (W-1)/W = 1`` times the tensor's bytes per process, so the
bus bandwidth (what :func:`ring_allreduce_seconds` divides by) is ``bytes / time``. It measures this host's
loopback between two processes, the link that matters when the replicas share this machine: for replicas on
other machines (NCCL over NVLink or InfiniBand), pass the bandwidth (``allreduce_gbps``, ``--allreduce-gbps``).

If the two processes cannot be started or do not finish within the timeout, the fallback is a proxy, labelled
as such: the bandwidth of a ``Tensor.copy_`` of 64 MiB in this process (a memcpy, not an all-reduce).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

#: Bytes all-reduced per repeat by :func:`measure_allreduce`.
MEASURE_BYTES = 4 * 2 ** 20

# The worker: only torch, so that each process starts quickly. argv: rank, store file, bytes, repeats.
_WORKER = r"""
import json, statistics, sys, time
import torch
import torch.distributed as dist
rank, store, nbytes, repeats = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
x = torch.ones(nbytes // 4, dtype=torch.float32)
for _ in range(2):
    dist.all_reduce(x)
times = []
for _ in range(repeats):
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(x)
    times.append(time.perf_counter() - t0)
dist.barrier()
dist.destroy_process_group()
if rank == 0:
    print(json.dumps({"seconds": statistics.median(times), "bytes": (nbytes // 4) * 4}))
"""


@dataclass(frozen=True)
class Bandwidth:
    """The all-reduce bus bandwidth the planner uses, and where it came from.

    Attributes:
        bytes_per_s: bus bandwidth in bytes per second: a ring all-reduce of ``n`` bytes over ``W`` replicas
            takes ``2 (W-1)/W x n / bytes_per_s`` seconds.
        source: ``"given"`` (``allreduce_gbps``), ``"measured"`` (two local gloo processes) or ``"proxy"``
            (a memcpy's bandwidth, when the measurement failed).
        detail: how it was obtained, in words.
    """

    bytes_per_s: float
    source: str
    detail: str

    @property
    def gbps(self) -> float:
        """GB/s (10^9 bytes per second)."""
        return self.bytes_per_s / 1e9

    def describe(self) -> str:
        return f"all-reduce bandwidth {self.gbps:.3g} GB/s ({self.source}: {self.detail})"


def check_gbps(value: object) -> float:
    """``allreduce_gbps`` as the planner takes it: a positive, finite number of GB/s."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"allreduce_gbps must be a positive, finite number of GB/s (10^9 bytes per second), "
                         f"got {value!r}")
    return float(value)


def given(gbps: float) -> Bandwidth:
    gbps = check_gbps(gbps)
    return Bandwidth(gbps * 1e9, "given", f"allreduce_gbps={gbps:g}")


def ring_allreduce_seconds(nbytes: float, replicas: int, bytes_per_s: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``replicas``: ``2 (W-1)/W x nbytes / bandwidth``."""
    if replicas <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (replicas - 1) / replicas * nbytes / bytes_per_s


def measure_allreduce(nbytes: int = MEASURE_BYTES, repeats: int = 5, timeout: float = 120.0) -> Bandwidth:
    """All-reduce ``nbytes`` between two local gloo processes ``repeats`` times (after 2 warm-ups) and return
    ``nbytes / median seconds`` (the bus bandwidth of 2 processes). Falls back to :func:`memcpy_proxy`, labelled
    ``"proxy"`` and saying why, if the processes fail or take longer than ``timeout`` seconds."""
    try:
        return _measure(nbytes, repeats, timeout)
    except Exception as exc:  # noqa: BLE001 - any failure of the measurement falls back to the labelled proxy
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        return memcpy_proxy(f"the gloo all-reduce measurement failed: {reason[:200]}")


def _measure(nbytes: int, repeats: int, timeout: float) -> Bandwidth:
    with tempfile.TemporaryDirectory(prefix="pipecore-allreduce-") as tmp:
        store = os.path.join(tmp, "store")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(rank), store, str(nbytes), str(repeats)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for rank in range(2)]
        deadline = time.monotonic() + timeout
        outputs = []
        try:
            for proc in procs:
                outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for proc, (_, err) in zip(procs, outputs):
            if proc.returncode != 0:
                raise RuntimeError(f"exit status {proc.returncode}: {err.strip()[-300:]}")
        result = json.loads(outputs[0][0].strip().splitlines()[-1])
    seconds, moved = float(result["seconds"]), int(result["bytes"])
    if seconds <= 0:
        raise RuntimeError("the all-reduce took no measurable time")
    return Bandwidth(moved / seconds, "measured",
                     f"torch.distributed.all_reduce of {moved / 2 ** 20:.0f} MiB between 2 local gloo processes, "
                     f"median of {repeats}; this host's loopback, not a link between machines")


def memcpy_proxy(why: str = "", nbytes: int = 64 * 2 ** 20, repeats: int = 5) -> Bandwidth:
    """A proxy, not an all-reduce: bytes per second of ``Tensor.copy_`` of ``nbytes`` in this process (median of
    ``repeats``)."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    times.sort()
    seconds = max(times[len(times) // 2], 1e-9)
    return Bandwidth(nbytes / seconds, "proxy",
                     f"memcpy bandwidth of this host (Tensor.copy_ of {nbytes / 2 ** 20:.0f} MiB), NOT an all-reduce"
                     + (f"; {why}" if why else "") + "; pass allreduce_gbps for a real figure")
