"""The machine description every benchmark writes into its JSON result, and the writing of that result."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo where there is one, else what ``platform`` knows."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return name


def write_report(report: dict, out: str | os.PathLike) -> Path:
    """Write a benchmark's JSON result (creating its folder); returns the path written."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def machine() -> dict[str, object]:
    """Platform, CPU model, core count, load, and library versions (torch threads when torch is loaded)."""
    import torch

    import pipecore

    return {
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "pipecore": pipecore.__version__,
    }


BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"  # the committed results, which the docs cite: written only when --out names them
OUT = BENCH / "out"  # where a run writes by default: ignored by git

OUT_HELP = ("where to write the JSON result (default: bench/out/, which git ignores; the committed results that "
            "the docs cite are in bench/results/, replaced only by naming them here)")


def default_out(name: str) -> str:
    """The default ``--out`` of a benchmark: ``bench/out/NAME``. Running a command as the docs give it must not
    overwrite the committed result it is compared with (``bench/results/NAME``); replacing that result takes
    ``--out bench/results/NAME``."""
    return str(OUT / name)
