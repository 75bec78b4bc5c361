"""Small reference models for pipelining, written as ordinary ``nn.Module`` s that ``torch.fx`` can trace.

* :class:`GPT` - a decoder-only transformer language model (nanoGPT style): token and position embeddings,
  pre-LayerNorm blocks with causal self-attention, and a head whose weight is tied to the token embedding.
  ``forward(idx[B, T]) -> logits[B, T, vocab_size]``.
* :class:`ResNet` - a small residual CNN for 8x8 digit images (BatchNorm, one downsampling block with a
  projected skip). ``forward(x[B, 64] or x[B, 1, 8, 8]) -> logits[B, num_classes]``.
* :class:`Encoder` - a transformer encoder classifier with two inputs, ``forward(tokens[B, T], mask[B, T])``;
  the padding mask is used by every block and by the pooling, so padded positions never affect the output.

None uses data-dependent Python control flow or ``scaled_dot_product_attention``. The transformers have no
buffers (masks are computed in ``forward`` from the input's shape or the padding mask); ResNet's BatchNorm
layers have running-statistics buffers. All run in float64 (``model.double()``), and a model traced with
``torch.fx.symbolic_trace`` computes exactly what the eager one does. :mod:`pipecore.models.text` provides a character-level corpus from the
help texts that ship with Python.
"""

from .encoder import Encoder
from .gpt import GPT
from .resnet import ResNet
from .text import CharData, batches, load_char_data, load_text_corpus, windows

__all__ = ["CharData", "Encoder", "GPT", "ResNet", "batches", "load_char_data", "load_text_corpus", "windows"]
