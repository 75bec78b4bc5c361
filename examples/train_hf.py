"""A Hugging Face GPT-2, built from a config (random weights, nothing downloaded), pipelined as it comes.

    python examples/train_hf.py                          # every stage in this process
    torchrun --nproc-per-node 4 examples/train_hf.py     # one process per stage

torch.fx cannot capture a transformers model (its masks are built with Python that symbolic tracing cannot
run), so the pipeline captures it with torch.export (capture="auto", given example_input), cuts it at its
layers (transformer.h.1, ...), and keeps the head tied to the token embedding. The text is the character
corpus that ``pipecore train --model gpt`` trains on (Python's own help topics). Needs ``pip install transformers``.
"""

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import pipecore
from pipecore.models.text import batches, load_char_data

STAGES, MICROBATCHES, BLOCK = 4, 4, 32


def lm_loss(output, target: torch.Tensor) -> torch.Tensor:
    logits = output.logits  # the model's own output, a CausalLMOutputWithCrossAttentions
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def main(steps: int = 150) -> float:
    data = load_char_data(BLOCK)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=data.vocab_size, n_positions=BLOCK, n_embd=64, n_layer=4, n_head=4,
                        use_cache=False, bos_token_id=0, eos_token_id=0)  # a pipeline trains without a cache
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    x, y = batches(data.train, BLOCK, 32, g)
    pipe = pipecore.Pipeline(model, STAGES, "1f1b", MICROBATCHES, optimizer=pipecore.AdamW(lr=1e-3),
                             loss_fn=lm_loss, example_input={"input_ids": x})
    rank = pipe.process_rank or 0
    if rank == 0:
        print(pipe)
    loss = float("nan")
    for step in range(steps):
        loss = pipe.step({"input_ids": x}, y)
        if step % 50 == 49 and rank == 0:
            print(f"step {step + 1}: loss {loss:.4f}")
        x, y = batches(data.train, BLOCK, 32, g)
    pipe.close()
    return loss


if __name__ == "__main__":
    main()
