"""Time on the device being measured (the CPU's clock, or CUDA events), and the bandwidth between that device
and pinned host memory."""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Iterator

import torch


def clock(device: torch.device) -> tuple[Callable[[], Any], Callable[[Any, Any], float]]:
    """A function that marks a moment, and one that gives the seconds between two marks (on CUDA, after
    a synchronisation: the marks are events on the current stream)."""
    if device.type == "cuda":
        def mark() -> Any:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event

        return mark, lambda start, end: start.elapsed_time(end) / 1000.0
    return time.perf_counter, lambda start, end: end - start


_LINK_PROBE_BYTES = 64 * 2 ** 20


def host_bandwidth(device: torch.device, warmup: int, repeats: int) -> float:
    """Bytes per second between ``device`` and pinned host memory, the slower direction (median of ``repeats``
    copies of 64 MiB each way); 0 on the CPU, where activation offload does not apply."""
    if device.type != "cuda":
        return 0.0
    with on_device(device):
        host = torch.empty(_LINK_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
        data = torch.empty(_LINK_PROBE_BYTES, dtype=torch.uint8, device=device)
        mark, seconds = clock(device)
        directions = []
        for destination, source in ((host, data), (data, host)):
            times = []
            for i in range(warmup + repeats):
                start = mark()
                destination.copy_(source, non_blocking=True)
                end = mark()
                synchronize(device)
                if i >= warmup:
                    times.append(seconds(start, end))
            directions.append(_LINK_PROBE_BYTES / max(statistics.median(times), 1e-12))
    return min(directions)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """CUDA events and allocations on ``device`` inside the block."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield
