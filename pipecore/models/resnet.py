"""A small ResNet-style CNN for 8x8 digit images, written as an ordinary module that ``torch.fx`` can trace."""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """``relu(bn2(conv2(relu(bn1(conv1(x))))) + skip(x))``.

    ``skip`` is the identity, or a 1x1 convolution plus BatchNorm when the block changes the channel count
    or downsamples (``stride`` 2). Which one is fixed at construction, so tracing sees no branch.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.skip: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.skip = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.skip is None else self.skip(x)  # structural (decided at construction), not data-dependent
        return self.relu(out + shortcut)


class ResNet(nn.Module):
    """Residual CNN classifier for 8x8 images: ``forward(x) -> logits[B, num_classes]``.

    ``x`` is ``[B, in_channels * 64]`` (flattened pixels, e.g. the digits features of
    ``pipecore.cli.tasks.load_data``) or ``[B, in_channels, 8, 8]``; it is reshaped inside ``forward``.
    A stem (3x3 conv, BatchNorm, ReLU) then ``blocks`` :class:`BasicBlock` s in the ModuleList ``blocks``
    (``blocks.1`` doubles the width and halves the resolution to 4x4 with a projected skip), global average
    pooling and a Linear ``head``.
    """

    image_size = 8

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 16, blocks: int = 3) -> None:
        super().__init__()
        if blocks < 1:
            raise ValueError(f"blocks must be >= 1, got {blocks}")
        self.in_channels = in_channels
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        layers, channels = [], width
        for i in range(blocks):
            if i == 1:  # one downsampling block: 8x8 -> 4x4, width -> 2 * width
                layers.append(BasicBlock(channels, 2 * width, stride=2))
                channels = 2 * width
            else:
                layers.append(BasicBlock(channels, channels))
        self.blocks = nn.ModuleList(layers)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # reshape(-1, ...) accepts flat features and images alike without reading the batch size.
        x = x.reshape(-1, self.in_channels, self.image_size, self.image_size)
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))  # global average pool
