"""Every pipecore module imports on its own, first, in a fresh interpreter (no import cycle depends on order); no
module imports itself back through others, however it imports; no source file runs over 700 lines; the Pipeline class
stays under 400 and the shared modules name no algorithm's buffer.

``import pipecore.planning`` once failed with a circular import (planning -> engine -> planner -> planning)
while the test suite, which imports ``pipecore.engine`` first, passed; bench/offload.py hit it on a GPU.
"""

from __future__ import annotations

import ast
import pkgutil
import re
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


def _module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, from its ``__init__.py``)."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("pipecore", *path.relative_to(PACKAGE).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _imports(module: str, path: Path, files: dict[str, Path]) -> set[str]:
    """The package's modules ``module`` imports, wherever the import is (inside functions, under TYPE_CHECKING);
    a name taken from a package's ``__init__`` counts as the module it re-exports it from."""
    import ast

    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def reexported(pkg: str) -> dict[str, str]:
        init = files.get(pkg)
        if init is None or init.name != "__init__.py":
            return {}
        return {alias.asname or alias.name: f"{pkg}.{node.module}"
                for node in ast.walk(ast.parse(init.read_text())) if isinstance(node, ast.ImportFrom)
                and node.level == 1 and node.module for alias in node.names}

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            faces = reexported(base)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in files else faces.get(alias.name, base))
    return {m for m in found if m in files and files[m].name != "__init__.py" and m != module}


def test_no_module_of_the_package_imports_itself_back_through_others():
    """No import circle between the package's modules, counting every import: a lazy one or one under
    TYPE_CHECKING is still a dependency, and a package ``__init__`` that re-exports counts as the module it takes
    the name from."""
    files = _module_files()
    graph = {m: _imports(m, p, files) for m, p in files.items() if p.name != "__init__.py"}
    assert graph["pipecore.engine.stage"] >= {"pipecore.engine.state", "pipecore.engine.undo"}  # the parser sees
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(" <-> ".join(sorted(component)))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for module in graph:
        if module not in index:
            visit(module)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_source_file_of_the_package_runs_over_700_lines():
    """Small modules of one purpose each: a file that grows past 700 lines is split by purpose."""
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 700}
    assert not long, f"files over 700 lines: {long}"


def test_the_pipeline_class_only_composes_in_under_400_lines():
    """``Pipeline`` composes building, stepping, recovery, prediction and state I/O from their own modules; a
    class that grows past 400 lines is taking their work back."""
    tree = ast.parse((PACKAGE / "engine" / "pipeline.py").read_text())
    (cls,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Pipeline"]
    assert cls.end_lineno - cls.lineno + 1 < 400


def test_no_shared_module_names_an_algorithms_own_state():
    """An algorithm's buffers (PipeMare's velocity, SpecTrain's next direction) are declared by the algorithm and
    handled by the shared machinery without their names: the engine, the runtime and the planner name none."""
    named = [str(p.relative_to(PACKAGE)) for part in ("engine", "runtime", "planning")
             for p in (PACKAGE / part).rglob("*.py") if re.search(r"velocity|next_direction", p.read_text())]
    assert not named, f"modules that name an algorithm's buffer: {named}"


def test_the_kernels_folder_imports_without_triton_when_run_from_the_repository_root():
    """``python -m`` from the repository's root puts ``kernels/`` on the path as a top-level ``kernels``, and
    ``transformers`` imports whatever is named ``kernels`` when it probes for Hugging Face's package of that name:
    that import must not need Triton (the CPU install has none), or GPT-2 fails to import there."""
    probe = ("import sys, importlib.util\n"
             "import kernels\n"
             "assert kernels.__file__.startswith(sys.argv[1]), kernels.__file__\n"
             "assert 'triton' not in sys.modules, 'importing kernels imported triton'\n"
             "if importlib.util.find_spec('transformers') is not None:\n"
             "    from transformers import GPT2LMHeadModel\n")
    root = PACKAGE.parent
    proc = subprocess.run([sys.executable, "-c", probe, str(root / "kernels")], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
