"""``pipecore train --device``: cuda, cuda:N or cpu (default: cuda when available, else cpu).

What runs without a GPU: training on the CPU, and the one-line errors for a bad device string and for
CUDA on a machine without it. Training on a GPU is exercised by bench/gpu.py on a GPU machine."""

from __future__ import annotations

import re

import pytest
import torch

from pipecore.cli import main
from pipecore.cli.train import train_device

SMALL = ["--hidden", "32", "--batch-size", "32", "--epochs", "1", "--no-progress"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["train", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_device_cpu_trains_like_the_default_on_a_machine_without_cuda(capsys):
    code, out, err = run(capsys, *SMALL, "--device", "cpu")
    assert code == 0, err
    assert re.search(r"^test accuracy \d+\.\d\d% \(\d+/360\)", out, re.MULTILINE), out
    assert "stages on" not in out  # CPU runs print what they printed before the option existed
    if not torch.cuda.is_available():
        code, default_out, err = run(capsys, *SMALL)
        assert code == 0, err
        # The same training (epoch losses and accuracy, test accuracy); timings and rates differ.
        results = lambda text: re.findall(r"^\s*\d+\s+\d+\.\d{4}\s+\d+\.\d\d%|^test accuracy .*$",  # noqa: E731
                                          text, re.MULTILINE)
        assert results(out) and results(default_out) == results(out)
    assert train_device("cpu") == torch.device("cpu")
    assert train_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("spec, message", [
    ("gpu0", "--device 'gpu0' is not a device: give cpu, cuda or cuda:N"),
    ("cuda:-1", "--device 'cuda:-1' is not a device: give cpu, cuda or cuda:N"),
    ("meta", "--device 'meta': pipecore train runs on cpu or cuda"),
])
def test_a_bad_device_is_one_line_and_status_2(capsys, spec, message):
    code, out, err = run(capsys, *SMALL, "--device", spec)
    assert code == 2
    assert err.strip().splitlines() == [f"pipecore train: error: {message}"], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu_is_one_line_and_status_2(capsys, spec):
    code, out, err = run(capsys, *SMALL, "--device", spec)
    assert code == 2
    assert err.strip().splitlines() == [
        f"pipecore train: error: --device {spec!r}, but CUDA is not available on this machine "
        f"(torch {torch.__version__}); use --device cpu"], err
