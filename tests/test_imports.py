"""Every pipecore module imports on its own, first, in a fresh interpreter (no import cycle depends on order).

``import pipecore.planning`` once failed with a circular import (planning -> engine -> planner -> planning)
while the test suite, which imports ``pipecore.engine`` first, passed; bench/offload.py hit it on a GPU.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pipecore

PACKAGE = Path(pipecore.__file__).resolve().parent


def _modules() -> list[str]:
    names = []
    # The subpackages and top-level modules: a cycle between two packages shows when either is imported first.
    for info in pkgutil.iter_modules([str(PACKAGE)], prefix="pipecore."):
        if info.name.split(".")[-1].startswith("_") or info.name == "pipecore.__main__":
            continue
        names.append(info.name)
    return sorted(names)


def test_each_module_imports_first_in_a_fresh_interpreter():
    modules = _modules()
    assert "pipecore.planning" in modules and "pipecore.engine" in modules
    # One interpreter per module keeps each import first; a small script runs them all to save start-up time.
    script = (
        "import subprocess, sys\n"
        "failed = []\n"
        "for name in sys.argv[1:]:\n"
        "    p = subprocess.run([sys.executable, '-c', f'import {name}'], capture_output=True, text=True)\n"
        "    if p.returncode:\n"
        "        failed.append(f'{name}: {p.stderr.strip().splitlines()[-1]}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, *modules], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"modules that cannot be imported first:\n{proc.stdout}{proc.stderr}"
