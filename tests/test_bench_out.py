"""Where the benchmarks write: a command run as the docs give it must not overwrite the committed result it is
compared with. By default every ``bench/*.py`` writes under ``bench/out/`` (ignored by git); the committed
results in ``bench/results/`` are replaced only by naming them with ``--out``.

Each script's parser is read without running the benchmark: ``parse_args`` is intercepted, in a fresh Python."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"

READ_PARSERS = """
    import argparse, json, runpy, sys
    from pathlib import Path

    class Parsed(Exception):
        pass

    seen = {}

    def intercept(self, args=None, namespace=None):
        seen['parser'] = self
        raise Parsed

    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = intercept
    found = {}
    for path in sorted(Path('bench').glob('*.py')):
        if path.name.startswith('_') or '__main__' not in path.read_text():
            continue  # a module the benchmarks import (bench/convergence_tasks.py), not a benchmark
        seen.clear()
        sys.argv = [str(path)]
        try:
            runpy.run_path(str(path), run_name='__main__')
        except Parsed:
            pass
        parser = seen.get('parser')
        outs = [a for a in (parser._actions if parser else []) if '--out' in a.option_strings]
        found[path.name] = {'parsed': parser is not None,
                            'out': {'default': outs[0].default, 'help': outs[0].help} if outs else None}
    print(json.dumps(found))
"""


def parsers() -> dict[str, dict]:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(READ_PARSERS)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_no_benchmark_writes_into_the_committed_results_by_default():
    found = parsers()
    writers = {name: info["out"] for name, info in found.items() if info["out"] is not None}
    assert len(writers) >= 15, sorted(writers)  # every benchmark that writes a JSON result has --out
    for name, out in writers.items():
        if out["default"] is None:  # computed after parsing (from the device, the parts run, ...)
            assert "bench/out/" in out["help"], (name, out["help"])
        else:
            assert Path(out["default"]).parent == BENCH / "out", (name, out["default"])
    # The scripts without --out write nothing, or only where they are told (venv_size.py prints).
    assert {name for name, info in found.items() if info["out"] is None} <= {"venv_size.py"}, found


def test_the_default_output_folder_is_ignored_by_git():
    assert "bench/out/" in (ROOT / ".gitignore").read_text().splitlines()
