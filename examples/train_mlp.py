"""One script, one process or one process per stage.

    python examples/train_mlp.py                          # every stage in this process
    torchrun --nproc-per-node 4 examples/train_mlp.py     # one process per stage (gloo on CPU, NCCL on GPU)

Under torchrun each rank builds only its own stage; only the first stage reads ``x`` and only the last
reads ``y``, and every rank gets the mini-batch loss.
"""

import os

import torch
from torch import nn

import pipecore

STAGES, MICROBATCHES = 4, 4


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(STAGES) for m in (nn.Linear(32, 32), nn.ReLU())], nn.Linear(32, 4))
    pipe = pipecore.Pipeline(model, STAGES, "2bw", MICROBATCHES, optimizer=pipecore.SGD(lr=0.05, momentum=0.9),
                             loss_fn=nn.CrossEntropyLoss())
    rank = pipe.rank or 0
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 4, generator=g)
    for step in range(300):
        x = torch.randn(64, 32, generator=g)
        y = (x @ w).argmax(dim=1)  # a learnable target
        loss = pipe.step(x, y)
        if step % 60 == 59 and rank == 0:
            print(f"step {step + 1}: loss {loss:.4f}")
    pipe.close()  # flush; with one process per stage, also release the pipeline's process groups
    os.makedirs("checkpoints", exist_ok=True)
    pipecore.checkpoint.save(pipe, "checkpoints/train_mlp")
    if rank == 0:
        print("saved checkpoints/train_mlp (one file per stage + manifest.json)")


if __name__ == "__main__":
    main()
