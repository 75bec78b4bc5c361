"""What an installation needs: ``pipecore --help`` without importing torch, and CPU training without Triton
(the optional extra ``[gpu]``). Each check runs in a fresh Python, where nothing else was imported first."""

from __future__ import annotations

import subprocess
import sys
import textwrap
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
