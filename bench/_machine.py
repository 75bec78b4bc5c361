"""The machine description every benchmark writes into its JSON result."""

from __future__ import annotations

import os
import platform


def machine() -> dict[str, object]:
    """Platform, CPU model, core count, load, and library versions (torch threads when torch is loaded)."""
    import torch

    import pipecore

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "pipecore": pipecore.__version__,
    }
