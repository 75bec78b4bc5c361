"""Derived weights (pipecore.algorithms.derivations) against their formulas, in float64."""

from __future__ import annotations

import pytest
import torch

from pipecore.algorithms.base import WeightRead
from pipecore.algorithms.derivations import DERIVATIONS, derive


class Source:
    """A stage's weight versions and state, as a derivation reads them."""

    def __init__(self, velocity: bool = True, scratch: bool = True):
        g = torch.Generator().manual_seed(0)
        self.slots = {v: torch.randn(37, generator=g, dtype=torch.float64) for v in (3, 4)}
        self.direction = torch.randn(37, generator=g, dtype=torch.float64)
        self.velocity = torch.randn(37, generator=g, dtype=torch.float64) if velocity else None
        self.scratch = torch.empty(37, dtype=torch.float64) if scratch else None
        self.lr = 0.05
        self.directions_asked: list[torch.Tensor] = []

    def slot_of(self, version: int) -> torch.Tensor:
        return self.slots[version]

    def update_direction(self, weights: torch.Tensor) -> torch.Tensor:
        self.directions_asked.append(weights)
        return self.direction

    def next_lr(self) -> float:
        return self.lr


def test_every_derivation_computes_its_formula_into_the_scratch_buffer():
    source = Source()
    w3, w4 = source.slots[3], source.slots[4]
    expected = {
        "interpolate": (WeightRead(3, "interpolate", other=4, coef=0.25), w3 + 0.25 * (w4 - w3)),
        "predict": (WeightRead(3, "predict", coef=2.0), w3 - 2.0 * source.lr * source.direction),
        "correct": (WeightRead(3, "correct", coef=1.5), w3 - 1.5 * source.velocity),
    }
    assert set(expected) == set(DERIVATIONS)
    for name, (read, value) in expected.items():
        out = derive(source, read)
        assert out.data_ptr() == source.scratch.data_ptr(), name
        torch.testing.assert_close(out, value, rtol=1e-15, atol=1e-15)
    # The prediction extrapolates along the direction of the version it starts from.
    assert len(source.directions_asked) == 1 and source.directions_asked[0] is w3
    # The versions themselves are left alone.
    assert torch.equal(source.slots[3], w3) and torch.equal(source.slots[4], w4)


@pytest.mark.parametrize("read,source,error", [
    (WeightRead(3, "extrapolate", coef=1.0), Source(), "unknown weight derivation 'extrapolate'; known: interpolate"),
    (WeightRead(3, "correct", coef=1.0), Source(velocity=False), "needs the weight velocity"),
    (WeightRead(3, "predict", coef=1.0), Source(scratch=False), "need the scratch buffer"),
])
def test_derivation_errors(read, source, error):
    with pytest.raises(ValueError, match=error):
        derive(source, read)
