"""A training loop that survives a dead worker: run it under torchrun with restarts, kill a worker, and it
continues from its last checkpoint.

    torchrun --nproc-per-node 2 --max-restarts 3 examples/train_elastic.py   # one process per stage
    python examples/train_elastic.py                                          # both stages in this process

Every ``--save-every`` steps the pipeline is flushed and saved to ``--checkpoint`` (a directory) with the step
reached; at start, ``pipecore.checkpoint.resume`` loads the last checkpoint if there is one and says which
step it reached. The batch of step ``k`` is a function of ``k`` alone, so a run that was killed and resumed
ends with exactly the weights of a run that never was (the flushes happen at the same steps in both).
"""

import argparse

import torch
from torch import nn

import pipecore
from pipecore import checkpoint


def batch(step: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mini-batch of ``step``: drawn from a generator seeded by the step, so it never depends on the past."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(64, 32, generator=g)
    return x, (x @ w).argmax(dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a small MLP as a 2-stage pipeline that resumes.")
    parser.add_argument("--steps", type=int, default=300, help="total training steps (default 300)")
    parser.add_argument("--save-every", type=int, default=20, help="save after every N steps (default 20)")
    parser.add_argument("--checkpoint", default="checkpoints/train_elastic", help="the checkpoint directory")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    w = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    with pipecore.Pipeline(model, 2, "2bw", 4, optimizer=pipecore.SGD(lr=0.05, momentum=0.9),
                           loss_fn=nn.CrossEntropyLoss()) as pipe:
        leader = pipe.process_rank in (None, 0)
        done = checkpoint.resume(pipe, args.checkpoint)  # None: nothing saved yet
        start = 0 if done is None else done["step"]
        if leader:
            print(f"resumed from {args.checkpoint} at step {start}" if done is not None else "starting at step 0",
                  flush=True)
        for step in range(start, args.steps):
            loss = pipe.step(*batch(step, w))
            if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
                pipe.flush()  # one consistent weight version per stage
                checkpoint.save(pipe, args.checkpoint, extra={"step": step + 1})
                if leader:
                    print(f"step {step + 1}: loss {loss:.4f}, saved", flush=True)


if __name__ == "__main__":
    main()
