"""The README's Python examples run as written, in one fresh Python, and print no warning: a new user's first
run of them should show nothing to worry about (a GPT-2 config whose token ids lie outside the vocabulary made
transformers warn). And what the README says beside the GPT-2 example about dropout."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import pipecore

ROOT = Path(__file__).resolve().parent.parent


def readme_python() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_readme_examples_run_without_a_warning(tmp_path):
    blocks = readme_python()
    assert len(blocks) >= 4 and any("GPT2Config" in block for block in blocks)
    script = tmp_path / "readme_examples.py"
    script.write_text("\n".join(blocks))
    proc = subprocess.run([sys.executable, "-W", "default", str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == "", proc.stderr


def test_a_model_with_dropout_does_not_match_plain_training_step_for_step():
    """As the README says beside the GPT-2 example: the pipeline draws dropout masks per micro-batch, so even 1f1b
    differs from the plain model's step; without dropout the two agree (to float32 round-off)."""
    transformers = pytest.importorskip("transformers")

    def losses(dropout: float) -> tuple[float, float]:
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                         use_cache=False, bos_token_id=0, eos_token_id=0, resid_pdrop=dropout,
                                         embd_pdrop=dropout, attn_pdrop=dropout)
        model = transformers.GPT2LMHeadModel(config)
        ids = torch.randint(0, 96, (8, 17), generator=torch.Generator().manual_seed(1))
        x, y = {"input_ids": ids[:, :-1]}, ids[:, 1:]

        def loss_fn(out, t):
            return nn.functional.cross_entropy(out.logits.flatten(0, 1), t.flatten())

        torch.manual_seed(2)
        plain = loss_fn(model(**x), y).item()
        pipe = pipecore.Pipeline(model, num_stages=2, algorithm="1f1b", n_microbatches=2, example_input=x,
                                 loss_fn=loss_fn, concurrent=False)
        torch.manual_seed(2)
        return plain, float(pipe.step(x, y))

    plain, piped = losses(0.1)
    assert abs(plain - piped) > 1e-4, (plain, piped)
    plain, piped = losses(0.0)
    assert piped == pytest.approx(plain, rel=1e-5), (plain, piped)
