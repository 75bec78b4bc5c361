"""A small transformer encoder classifier with a padding mask, written as an ordinary module that ``torch.fx``
can trace."""

from __future__ import annotations

import torch
from torch import nn

from .gpt import MLP, SelfAttention, init_weights


class MaskedSelfAttention(SelfAttention):
    """Bidirectional multi-head self-attention that ignores padded keys.

    ``mask[B, T]`` is True for real tokens. Scores for padded keys are set to ``-inf`` with ``masked_fill``
    before the softmax, so they get weight exactly 0. A sequence must have at least one real token (a row
    of all ``-inf`` would give NaN).
    """

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.attend(x, (~mask).view(mask.shape[0], 1, 1, mask.shape[1]))  # padded keys


class EncoderBlock(nn.Module):
    """Pre-LayerNorm encoder block: ``x + attn(ln1(x), mask)`` then ``x + mlp(ln2(x))``."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = MaskedSelfAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        x = x + self.mlp(self.ln2(x))
        return x


class Encoder(nn.Module):
    """Transformer encoder classifier: ``forward(tokens[B, T], mask[B, T]) -> logits[B, num_classes]``.

    ``mask`` (bool) is True for real tokens and False for padding. Every block uses it in attention (so a
    pipeline that cuts between blocks must deliver it to every stage), and the classifier averages the final
    LayerNorm's output over real tokens only before the Linear ``head``. Padded positions therefore have no
    effect on the output. ``T`` may be any length up to ``max_len``; weights are initialised as in
    :class:`~pipecore.models.GPT`.
    """

    def __init__(
        self, vocab_size: int, max_len: int, num_classes: int, n_layer: int = 2, n_head: int = 4, n_embd: int = 64
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(max_len, n_embd)
        self.blocks = nn.ModuleList(EncoderBlock(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, num_classes)
        self.apply(init_weights)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        pos = torch.arange(T, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x, mask)
        x = self.ln_f(x)
        weight = mask.to(x.dtype).unsqueeze(-1)  # [B, T, 1]: 1 for real tokens, 0 for padding
        # Multiplying by 0 (rather than indexing the real tokens) keeps every shape independent of the data.
        pooled = (x * weight).sum(dim=1) / weight.sum(dim=1)
        return self.head(pooled)
