"""Bit-for-bit comparison of nested state (dicts, lists, tuples, tensors) for the tests."""

from __future__ import annotations

import torch


def assert_same(a: object, b: object, where: str = "") -> None:
    """``a`` and ``b`` are equal, tensors bit for bit (nested dicts, lists and tuples; dict keys in order)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where
