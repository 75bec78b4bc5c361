"""Derived weights (each algorithm's ``derivations``) against their formulas, in float64."""

from __future__ import annotations

import pytest
import torch

from pipecore.algorithms import get_algorithm
from pipecore.algorithms.base import WeightRead
from pipecore.algorithms.i_timeprest import interpolate
from pipecore.algorithms.pipemare import correct
from pipecore.algorithms.spectrain import predict


class Source:
    """A stage's weight versions and declared buffers, as a derivation reads them."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.slots = {v: torch.randn(37, generator=g, dtype=torch.float64) for v in (3, 4)}
        self.buffers = {"direction": torch.randn(37, generator=g, dtype=torch.float64),
                        "velocity": torch.randn(37, generator=g, dtype=torch.float64)}
        self.optimizer = None
        self.lr = 0.05

    def slot_of(self, version: int) -> torch.Tensor:
        return self.slots[version]

    def buffer(self, name: str) -> torch.Tensor:
        if name not in self.buffers:
            raise ValueError(f"stage 0 keeps no buffer {name!r}")
        return self.buffers[name]

    def next_lr(self) -> float:
        return self.lr


@pytest.mark.parametrize("algorithm,derive,read,formula", [
    ("i-timeprest", interpolate, WeightRead(3, "interpolate", other=4, coef=0.25),
     lambda s: s.slots[3] + 0.25 * (s.slots[4] - s.slots[3])),
    ("spectrain", predict, WeightRead(3, "predict", coef=2.0),
     lambda s: s.slots[3] - 2.0 * s.lr * s.buffers["direction"]),
    ("pipemare", correct, WeightRead(3, "correct", coef=1.5),
     lambda s: s.slots[3] - 1.5 * s.buffers["velocity"]),
], ids=["interpolate", "predict", "correct"])
def test_each_derivation_computes_its_formula_into_the_given_buffer(algorithm, derive, read, formula):
    source = Source()
    before = {v: w.clone() for v, w in source.slots.items()}
    assert get_algorithm(algorithm, 3, 2).derivation(read.derivation) is derive  # what the algorithm declares
    out = torch.empty(37, dtype=torch.float64)
    got = derive(source, read, source.slots[read.version], out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, formula(source), rtol=1e-15, atol=1e-15)
    for v, w in before.items():  # the versions themselves are left alone
        assert torch.equal(source.slots[v], w)


def test_a_derivation_the_algorithm_does_not_declare_is_refused_with_the_ones_it_does():
    with pytest.raises(ValueError, match="derived by 'extrapolate', which it does not declare .*: correct"):
        get_algorithm("pipemare", 3, 2).derivation("extrapolate")
    with pytest.raises(ValueError, match="its derivations: none"):
        get_algorithm("pipedream", 3, 2).derivation("correct")


def test_a_derivation_reading_a_buffer_the_stage_does_not_keep_says_so():
    source = Source()
    del source.buffers["velocity"]
    with pytest.raises(ValueError, match="keeps no buffer 'velocity'"):
        correct(source, WeightRead(3, "correct", coef=1.0), source.slots[3], torch.empty(37, dtype=torch.float64))
