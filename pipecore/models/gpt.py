"""A small decoder-only transformer (nanoGPT style) written as an ordinary module that ``torch.fx`` can trace."""

from __future__ import annotations

import math

import torch
from torch import nn


class SelfAttention(nn.Module):
    """Multi-head self-attention whose scores are masked by a boolean tensor the subclass builds.

    Scores where the mask is True are set to ``-inf`` before the softmax, so those keys get weight exactly
    0. An explicit masked softmax (not ``scaled_dot_product_attention``) keeps the same kernels in float32
    and float64 and in eager and traced runs, so results compare bit for bit.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_embd = n_embd
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def attend(self, x: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        """Attention over ``x[B, T, C]``; ``blocked`` broadcasts to ``[B, H, T(query), T(key)]``."""
        B, T, _ = x.shape  # local: under fx these are nodes of this block, never values crossing a stage boundary
        q, k, v = self.qkv(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * self.scale  # [B, H, T, T]
        att = att.masked_fill(blocked, float("-inf")).softmax(dim=-1)
        att = self.attn_drop(att)
        y = (att @ v).transpose(1, 2).reshape(B, T, self.n_embd)
        return self.resid_drop(self.proj(y))


class CausalSelfAttention(SelfAttention):
    """Multi-head self-attention in which position ``t`` attends to positions ``<= t`` only.

    The causal mask is built from ``x``'s own sequence length with tensor operations (``arange`` and a
    comparison), so there is no buffer, no data-dependent Python control flow, and no shape value has to
    be passed in from outside the block.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)
        future = pos.unsqueeze(0) > pos.unsqueeze(1)  # [T(query), T(key)]: True where key comes after query
        return self.attend(x, future)


class MLP(nn.Module):
    """The transformer's position-wise feed-forward layer: ``fc`` (4x wider), GELU, ``proj``."""

    def __init__(self, n_embd: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """Decoder-only transformer language model: ``forward(idx[B, T]) -> logits[B, T, vocab_size]``.

    Token embedding ``tok_emb`` plus learned position embedding ``pos_emb``, ``n_layer`` pre-LN
    :class:`Block` s in ``blocks``, a final LayerNorm ``ln_f`` and a bias-free ``head`` whose weight *is*
    ``tok_emb.weight`` (weight tying: one Parameter, gradients from both uses add up). ``T`` may be any
    length up to ``block_size``. Weights are initialised as in nanoGPT (normal, std 0.02; the residual
    output projections scaled by ``1/sqrt(2 * n_layer)``), so construction is deterministic under
    ``torch.manual_seed``.
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: the same Parameter object
        self.apply(init_weights)
        # Residual projections: keep the residual stream's variance from growing with depth (GPT-2).
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def init_weights(module: nn.Module) -> None:
    """nanoGPT's initialisation: Linear and Embedding weights ~ N(0, 0.02), biases zero."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
