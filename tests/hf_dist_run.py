"""A Hugging Face GPT-2 (from a config) as a multi-process pipeline for the tests:
``python hf_dist_run.py OUT_DIR ALGORITHMS``, launched once per rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
set as torchrun does). The same functions build the one-process reference in tests/test_hf_models.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _hf  # noqa: E402

import pipecore  # noqa: E402

MICROBATCHES = 4
LENGTHS = (8, 6, 7)  # the sequence length changes between steps


def make_pipeline(num_stages: int, algorithm: str, **kwargs) -> pipecore.Pipeline:
    x, _ = _hf.batch("gpt2")
    return pipecore.Pipeline(_hf.make("gpt2", layers=2), num_stages, algorithm, MICROBATCHES,
                             optimizer=pipecore.SGD(lr=0.1, momentum=0.9), loss_fn=_hf.lm_loss, example_input=x,
                             **kwargs)


def train(pipe: pipecore.Pipeline, first: bool, last: bool) -> list[float]:
    losses = []
    for i, length in enumerate(LENGTHS):
        x, y = _hf.batch("gpt2", length=length, seed=10 + i)
        losses.append(pipe.step(x if first else None, y if last else None))
    pipe.flush()
    return losses


def main() -> None:
    out, algorithms = sys.argv[1], sys.argv[2].split(",")
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for algorithm in algorithms:
        pipe = make_pipeline(world, algorithm, timeout=120)
        losses = train(pipe, rank == 0, rank == world - 1)
        torch.save({"losses": losses, "state": pipe.state_dict()}, os.path.join(out, f"{algorithm}-{rank}.pt"))
        pipe.close()


if __name__ == "__main__":
    main()
