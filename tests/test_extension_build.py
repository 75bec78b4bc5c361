"""How pipecore._C is linked: against the shared C++ runtime that torch uses, never a copy of it.

On the first GPU machine the build compiler had only the static ``libstdc++.a``; the extension then carried
its own C++ runtime, and every error message with a number in it (``c10::str(..., key, ...)``) crashed the
interpreter in ``std::ostream::_M_insert<long>`` (bench/results/extension-probe-h100.txt). setup.py now links
the shared runtime by its full name when the compiler has no ``libstdc++.so``.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pipecore._C as _C

ROOT = Path(__file__).resolve().parent.parent


def test_the_extension_defines_no_cxx_runtime_symbols():
    nm = shutil.which("nm")
    assert nm is not None, "binutils' nm is needed to inspect pipecore._C (it comes with the compiler that built it)"
    out = subprocess.run([nm, "--defined-only", _C.__file__], capture_output=True, text=True, check=True).stdout
    # std::locale and the stream inserters live in libstdc++.so; a definition here means a static copy.
    copied = [line for line in out.splitlines() if "_ZNSt6locale" in line or "_ZNSo9_M_insert" in line]
    assert copied == [], f"pipecore._C carries a copy of the C++ runtime: {copied[:5]}"


def test_an_error_message_with_a_number_is_raised_not_crashed():
    m = _C.Mailbox()
    m.put(5, 1)
    with pytest.raises(KeyError, match="key 5 is already present"):
        m.put(5, 2)


def _fake_compiler(tmp_path: Path, has: dict[str, str]) -> Path:
    """A stand-in for $CXX that answers ``-print-file-name=NAME`` with a path for the names in ``has``."""
    script = tmp_path / "fake-cxx"
    cases = "\n".join(f'  "-print-file-name={name}") echo "{path}" ;;' for name, path in has.items())
    script.write_text(textwrap.dedent("""\
        #!/bin/sh
        case "$1" in
        {cases}
          -print-file-name=*) echo "${{1#-print-file-name=}}" ;;
        esac
        """).format(cases=cases))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def _link_args_with(cxx: Path) -> subprocess.CompletedProcess:
    """Run setup.py's configuration (not the build) with CXX=cxx and print the extension's link arguments."""
    code = textwrap.dedent(f"""\
        import runpy, setuptools
        captured = {{}}
        setuptools.setup = lambda **kw: captured.update(kw)
        runpy.run_path({str(ROOT / "setup.py")!r}, run_name="__main__")
        print(captured["ext_modules"][0].extra_link_args)
        """)
    env = dict(os.environ, CXX=str(cxx))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libstdc++ linking is a Linux matter")
def test_setup_links_the_shared_runtime_when_the_compiler_has_only_the_archive(tmp_path):
    runtime = tmp_path / "libstdc++.so.6"
    runtime.write_bytes(b"")
    cxx = _fake_compiler(tmp_path, {"libstdc++.so.6": str(runtime), "libstdc++.a": str(tmp_path / "libstdc++.a")})
    proc = _link_args_with(cxx)
    assert proc.returncode == 0, proc.stderr
    assert str(runtime) in proc.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libstdc++ linking is a Linux matter")
def test_setup_adds_nothing_when_the_compiler_links_the_shared_runtime(tmp_path):
    dev_link = tmp_path / "libstdc++.so"
    dev_link.write_bytes(b"")
    cxx = _fake_compiler(tmp_path, {"libstdc++.so": str(dev_link)})
    proc = _link_args_with(cxx)
    assert proc.returncode == 0, proc.stderr
    assert "libstdc++" not in proc.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libstdc++ linking is a Linux matter")
def test_setup_refuses_a_compiler_without_any_shared_runtime(tmp_path):
    cxx = _fake_compiler(tmp_path, {})
    proc = _link_args_with(cxx)
    assert proc.returncode != 0
    assert "would copy the static C++ runtime into pipecore._C" in proc.stderr
