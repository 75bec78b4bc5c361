"""Tiny Hugging Face transformers models built from configs (random weights, no downloads) for the tests,
with a mini-batch and a loss for each; shared by tests/test_hf_models.py and tests/hf_dist_run.py."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

transformers = __import__("pytest").importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB = 64
NAMES = ("gpt2", "llama", "bert", "bart", "t5", "vit")


def lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    logits = out.logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def class_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits, y)


def make(name: str, layers: int = 4, dropout: float = 0.0) -> nn.Module:
    """A tiny model, float64, from a config (seeded, so two calls give the same weights)."""
    T = transformers
    torch.manual_seed(0)
    if name == "gpt2":
        config = T.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=layers, n_head=2, use_cache=False,
                              resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0,
                              eos_token_id=0)
        model = T.GPT2LMHeadModel(config)
    elif name == "llama":
        config = T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                               use_cache=False, bos_token_id=0, eos_token_id=0)
        model = T.LlamaForCausalLM(config)
    elif name == "bert":
        config = T.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                              intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=dropout,
                              attention_probs_dropout_prob=dropout, num_labels=3)
        model = T.BertForSequenceClassification(config)
    elif name == "bart":
        config = T.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=layers // 2, decoder_layers=layers // 2,
                              encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                              decoder_ffn_dim=64, max_position_embeddings=32, dropout=dropout, attention_dropout=0.0,
                              activation_dropout=0.0, use_cache=False, pad_token_id=1, bos_token_id=0,
                              eos_token_id=2, decoder_start_token_id=2)
        model = T.BartForConditionalGeneration(config)
    elif name == "t5":
        config = T.T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=layers // 2,
                            num_decoder_layers=layers // 2, num_heads=2, dropout_rate=dropout, use_cache=False,
                            decoder_start_token_id=0, pad_token_id=0)
        model = T.T5ForConditionalGeneration(config)
    elif name == "vit":
        config = T.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=layers,
                             num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=dropout,
                             attention_probs_dropout_prob=dropout, num_labels=5)
        model = T.ViTForImageClassification(config)
    else:
        raise ValueError(name)
    return model.double()


def batch(name: str, n: int = 8, length: int = 8, seed: int = 1) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(x, y)``: x the model's inputs by name, y the target of :func:`loss_of`."""
    g = torch.Generator().manual_seed(seed)
    if name in ("gpt2", "llama"):
        ids = torch.randint(0, VOCAB, (n, length + 1), generator=g)
        return {"input_ids": ids[:, :-1]}, ids[:, 1:]
    if name == "bert":  # padded sequences: the attention mask has zeros at the end of some rows
        ids = torch.randint(0, VOCAB, (n, length), generator=g)
        mask = torch.ones(n, length, dtype=torch.long)
        for row in range(0, n, 3):
            mask[row, length // 2 + row % 3:] = 0
        return {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 3, (n,), generator=g)
    if name in ("bart", "t5"):
        ids = torch.randint(3, VOCAB, (n, length), generator=g)
        decoder = torch.randint(3, VOCAB, (n, length + 1), generator=g)
        return {"input_ids": ids, "decoder_input_ids": decoder[:, :-1]}, decoder[:, 1:]
    if name == "vit":
        return ({"pixel_values": torch.randn(n, 3, 16, 16, generator=g, dtype=torch.float64)},
                torch.randint(0, 5, (n,), generator=g))
    raise ValueError(name)


def loss_of(name: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    return class_loss if name in ("bert", "vit") else lm_loss


def sequential_step(model: nn.Module, x: dict[str, torch.Tensor], y: torch.Tensor, loss_fn: Callable, m: int,
                    lr: float) -> float:
    """One SGD step of the plain model on the mini-batch as ``m`` micro-batches (mean of their losses)."""
    model.zero_grad()
    total = 0.0
    for u in range(m):
        xs = {k: v.tensor_split(m)[u] for k, v in x.items()}
        loss = loss_fn(model(**xs), y.tensor_split(m)[u]) / m
        loss.backward()
        total += float(loss.detach())
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return total


def lm_loss_logits(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
