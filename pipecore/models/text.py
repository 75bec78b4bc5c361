"""A character-level text corpus from text that ships with Python: the help topics in ``pydoc_data.topics``.

``pydoc_data`` is part of the standard library (it backs ``help("topics")``), so no download is needed.
Its text differs between Python versions, so the corpus (and numbers measured on it) are deterministic for
one Python version, not across versions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

UNKNOWN = "\ufffd"
"""The vocabulary's entry 0: every character not seen in the training split maps to index 0."""


def load_text_corpus(max_chars: int | None = None) -> str:
    """The ``pydoc_data.topics`` help texts joined in sorted-key order with blank lines (deterministic).

    ``max_chars`` keeps only the first ``max_chars`` characters.
    """
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return text if max_chars is None else text[:max_chars]


@dataclass
class CharData:
    """A character-level corpus split into a training part and a held-out tail.

    ``vocab[0]`` is :data:`UNKNOWN`, standing for every character absent from the training split; the other
    entries are the training split's characters in sorted order. ``train`` and ``test`` are 1-D int64 index
    tensors into ``vocab``.
    """

    vocab: list[str]
    train: torch.Tensor
    test: torch.Tensor

    @property
    def vocab_size(self) -> int:
        """Number of token ids (including the unknown id 0)."""
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        """``text`` as int64 indices; unknown characters become 0."""
        index = {ch: i for i, ch in enumerate(self.vocab)}
        return torch.tensor([index.get(ch, 0) for ch in text], dtype=torch.int64)

    def decode(self, ids: torch.Tensor) -> str:
        """Indices back to text (unknown ids come back as :data:`UNKNOWN`)."""
        return "".join(self.vocab[i] for i in ids.tolist())


def load_char_data(block_size: int, max_chars: int | None = None, test_fraction: float = 0.1) -> CharData:
    """The corpus of :func:`load_text_corpus`, encoded by character; the last ``test_fraction`` is held out.

    The held-out part is the tail of the text (not random windows), so no training window overlaps it.
    Both parts must be longer than ``block_size`` so that :func:`batches` and :func:`windows` can make at
    least one ``(x, y)`` pair.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    text = load_text_corpus(max_chars)
    n_test = int(len(text) * test_fraction)
    train_text, test_text = text[: len(text) - n_test], text[len(text) - n_test:]
    if min(len(train_text), len(test_text)) <= block_size:
        raise ValueError(
            f"a split of {len(text)} characters into {len(train_text)} + {len(test_text)} is too short for "
            f"block_size={block_size}; raise max_chars or lower block_size"
        )
    vocab = [UNKNOWN] + sorted(set(train_text) - {UNKNOWN})
    data = CharData(vocab, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    data.train, data.test = data.encode(train_text), data.encode(test_text)
    return data


def batches(
    data: torch.Tensor, block_size: int, batch_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows ``x[B, block_size]`` of ``data`` and their next characters ``y``.

    ``y[:, t] == x[:, t + 1]`` for ``t < block_size - 1`` (``y`` is ``x`` shifted by one). Start positions are
    drawn uniformly with ``generator``, so a seeded generator gives the same batches.
    """
    if len(data) <= block_size:
        raise ValueError(f"data of length {len(data)} has no window of block_size={block_size} plus a target")
    starts = torch.randint(0, len(data) - block_size, (batch_size,), generator=generator)
    idx = starts.unsqueeze(1) + torch.arange(block_size)
    return data[idx], data[idx + 1]


def windows(data: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All non-overlapping windows of ``data`` in order, for evaluation: ``x[N, block_size]`` and ``y`` (shifted by one).

    ``N = (len(data) - 1) // block_size``; the last few characters that do not fill a window are dropped.
    """
    n = (len(data) - 1) // block_size
    if n < 1:
        raise ValueError(f"data of length {len(data)} has no window of block_size={block_size} plus a target")
    return data[: n * block_size].view(n, block_size), data[1: n * block_size + 1].view(n, block_size)
