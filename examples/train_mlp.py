"""One script, one process or one process per stage.

    python examples/train_mlp.py                          # every stage in this process
    python examples/train_mlp.py --threads 2              # torch intra-op threads per stage thread
    torchrun --nproc-per-node 4 examples/train_mlp.py     # one process per stage (gloo on CPU, NCCL on GPU)

Under torchrun each rank builds only its own stage; only the first stage reads ``x`` and only the last
reads ``y``, and every rank gets the mini-batch loss.
"""

import argparse
import os

import torch
from torch import nn

import pipecore

STAGES, MICROBATCHES = 4, 4


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a small MLP as a 4-stage pipeline.")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads per stage thread (default: cores // stages, at least 1)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(STAGES) for m in (nn.Linear(32, 32), nn.ReLU())], nn.Linear(32, 4))
    pipe = pipecore.Pipeline(model, STAGES, "2bw", MICROBATCHES, optimizer=pipecore.SGD(lr=0.05, momentum=0.9),
                             loss_fn=nn.CrossEntropyLoss(), threads_per_stage=args.threads)
    # The stages compute on their own threads (``threads_per_stage`` intra-op threads each). This thread only
    # makes the data: torch's default team of intra-op threads for it would spin between its tiny ops on
    # the very cores the stage threads compute on.
    torch.set_num_threads(1)
    rank = pipe.process_rank or 0
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
