"""What an installation needs: ``pipecore --help`` without importing torch, and CPU training without Triton
(the optional extra ``[gpu]``). Each check runs in a fresh Python, where nothing else was imported first.

And the README's two commands from a fresh clone, one that installs and trains, one that installs and tests:
CI runs the test command as written (``.ci/run``); the main command's install is checked against it, and its
training step is run here (no network needed)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_the_command_line_help_does_not_import_torch():
    proc = run_python("""
        import contextlib, io, runpy, sys
        import pipecore.cli
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            codes = [pipecore.cli.main(['--help']), pipecore.cli.main(['--version']),
                     pipecore.cli.main(['train', '--help'])]
            sys.argv = ['pipecore', '--help']
            try:
                runpy.run_module('pipecore', run_name='__main__')  # python -m pipecore --help
            except SystemExit as done:
                codes.append(done.code)
        assert codes == [0, 0, 0, 0], codes
        assert 'usage: pipecore' in out.getvalue() and 'pipecore 0.1.0' in out.getvalue(), out.getvalue()
        loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))
        assert 'torch' not in sys.modules, loaded[:5]
        print('ok')
    """)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


BLOCK_TRITON = """
    import sys

    class NoTriton:
        \"\"\"An environment without Triton: importing it fails as if it were not installed.\"\"\"

        def find_spec(self, name, path=None, target=None):
            if name == 'triton' or name.startswith('triton.'):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTriton())
"""


def test_cpu_training_needs_no_triton_and_a_cuda_op_without_it_says_what_to_install():
    proc = run_python(BLOCK_TRITON + """
    import torch
    from torch import nn
    import pipecore

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(32, 5), torch.randint(0, 3, (32,))
    for algorithm, optimizer in [("1f1b", pipecore.SGD(lr=0.1, momentum=0.9)), ("pipedream", pipecore.AdamW(lr=0.01)),
                                 ("i-timeprest", pipecore.SGD(lr=0.1))]:
        pipe = pipecore.Pipeline(model, 2, algorithm, 4, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss())
        losses = [pipe.step(x, y) for _ in range(4)]
        pipe.flush()
        assert losses[-1] < losses[0], (algorithm, losses)
    assert 'triton' not in sys.modules

    from pipecore import ops
    try:
        ops._triton()  # what a CUDA tensor's fused op loads first
    except ModuleNotFoundError as exc:
        print(exc)
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == (
        "pipecore's fused ops on CUDA tensors are Triton kernels, and Triton is not installed: install pipecore "
        "with its GPU extra (pip install --no-build-isolation -e \".[gpu]\") or pip install triton; CPU training "
        "does not need it"), proc.stdout + proc.stderr


# -- the README's two commands ----------------------------------------------------------------------------

CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def readme_command(marker: str) -> str:
    """The command under ``<!-- marker -->`` in the README: the first line of the bash block after it, as
    ``.ci/run`` reads the test command."""
    lines = (ROOT / "README.md").read_text().splitlines()
    at = lines.index(f"<!-- {marker} -->")
    opening = next(i for i in range(at + 1, len(lines)) if lines[i].startswith("```bash"))
    return lines[opening + 1]


def gpu_commands() -> list[str]:
    """The bash block that follows the test command: the same two commands for a machine with a GPU."""
    text = (ROOT / "README.md").read_text()
    after = text[text.index("<!-- test-command -->"):]
    blocks = after.split("```bash\n")
    return blocks[2].split("```")[0].strip().splitlines()


def test_the_two_commands_install_the_same_cpu_setup_then_train_or_test():
    main, tests = readme_command("main-command").split(" && "), readme_command("test-command").split(" && ")
    setup = ["python3 -m venv .venv", ". .venv/bin/activate", CPU_TORCH, "pip install setuptools wheel pybind11 ninja"]
    assert main == [*setup, "pip install --no-build-isolation -e .", "pipecore train"], main
    assert tests == [*setup, 'pip install --no-build-isolation -e ".[test]"', "python -m pytest -q"], tests
    # CI runs the test command (.ci/run), so the main command's install steps are run there; its last step is
    # run by the test below.


def test_the_gpu_variants_are_the_same_commands_with_the_cuda_build_and_triton():
    main, tests = readme_command("main-command"), readme_command("test-command")
    cuda = [main.replace(CPU_TORCH, "pip install torch").replace("-e . ", '-e ".[gpu]" '),
            tests.replace(CPU_TORCH, "pip install torch").replace('".[test]"', '".[test,gpu]"')]
    assert gpu_commands() == cuda, gpu_commands()


def test_the_main_command_trains_the_quickstart_job():
    """The main command's step after the install, as an installed ``pipecore`` runs it (``python -m pipecore``
    is the same entry point): the default job trains the digits MLP to a test accuracy above 90%."""
    step = readme_command("main-command").split(" && ")[-1].split()
    assert step[0] == "pipecore", step
    proc = subprocess.run([sys.executable, "-m", "pipecore", *step[1:]], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.search(r"^test accuracy (\d+\.\d\d)% \(\d+/360\) after 20 epochs$", proc.stdout, re.MULTILINE)
    assert found and float(found.group(1)) > 90, proc.stdout


def test_the_test_extra_brings_no_triton_and_the_gpu_extra_does():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not [r for r in extras["test"] if r.lower().startswith("triton")], extras["test"]
    assert [r for r in extras["gpu"] if r.lower().startswith("triton")], extras["gpu"]


def test_ci_runs_the_triton_tests_where_it_installs_the_gpu_extra():
    """The README's CPU test command skips the Triton interpreter tests; CI's second run installs the gpu extra
    and runs them, so that they run somewhere in CI."""
    ci = (ROOT / ".ci" / "run").read_text()
    second = ci[ci.index("extension_tests=("):]
    assert "tests/test_kernels_triton.py" in second.split(")")[0]
    assert '.venv312/bin/pip install --quiet --no-build-isolation -e ".[test,gpu]"' in second


def test_without_triton_its_tests_are_skipped_saying_why():
    proc = run_python(BLOCK_TRITON + """
    import pytest
    sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', 'tests/test_kernels_triton.py',
                          'tests/test_kernels_tuning.py']))
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^\d+ skipped", proc.stdout.splitlines()[-1]) and "passed" not in proc.stdout, proc.stdout
    assert proc.stdout.count("Triton is not installed: it comes with pipecore's gpu extra") >= 2, proc.stdout
