"""A character-level GPT with its head tied to its token embedding, pipelined as an ordinary module.

    python examples/train_gpt.py                          # every stage in this process
    python examples/train_gpt.py --threads 2              # torch intra-op threads per stage thread
    torchrun --nproc-per-node 4 examples/train_gpt.py     # one process per stage (gloo on CPU, NCCL on GPU)

The model is written without any pipeline in mind (``pipecore.models.GPT``). The pipeline captures its
forward, cuts it before blocks 1, 2 and 3, and keeps the tied embedding/head identical on the first and last
stage. The text is Python's own help topics (``pydoc_data``).
"""

import argparse

import torch
from torch import nn

import pipecore
from pipecore.models import GPT
from pipecore.models.text import batches, load_char_data

STAGES, MICROBATCHES, BLOCK = 4, 4, 32


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a character-level GPT as a 4-stage pipeline.")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads per stage thread (default: cores // stages, at least 1)")
    args = parser.parse_args()
    data = load_char_data(BLOCK)
    torch.manual_seed(0)
    model = GPT(data.vocab_size, BLOCK, n_layer=4, n_head=4, n_embd=64)
    pipe = pipecore.Pipeline(model, STAGES, "1f1b", MICROBATCHES, optimizer=pipecore.AdamW(lr=1e-3),
                             loss_fn=lm_loss, partition=["blocks.1", "blocks.2", "blocks.3"],
                             threads_per_stage=args.threads)
    rank = pipe.process_rank or 0
    if rank == 0:
        print(pipe)
    g = torch.Generator().manual_seed(1)
    for step in range(150):
        x, y = batches(data.train, BLOCK, 32, g)
        loss = pipe.step(x, y)
        if step % 50 == 49 and rank == 0:
            print(f"step {step + 1}: loss {loss:.4f}")
    pipe.close()


if __name__ == "__main__":
    main()
