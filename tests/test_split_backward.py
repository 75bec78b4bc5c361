"""The two-pass backward (input gradient first, weight gradients after) equals one autograd.grad call."""

import pytest
import torch
from torch import nn

from pipecore.engine.split_backward import input_gradient, weight_gradients


class _Tied(nn.Module):
    """One weight used by two layers, the second one's junction above the first's."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


class _SideBranch(nn.Module):
    """A parameter that joins the input path only at the final addition."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.offset = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return self.lin(x) + torch.sin(self.offset)


class _Unused(nn.Module):
    """A parameter that takes no part in the output."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.spare = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return self.lin(x).relu()


MODULES = {
    "mlp": lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 6)),
    "layernorm": lambda: nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.GELU(), nn.Linear(6, 6)),
    "conv": lambda: nn.Sequential(nn.Unflatten(1, (1, 6)), nn.Conv1d(1, 2, 3, padding=1), nn.Flatten(), nn.Linear(12, 6)),
    "tied": _Tied,
    "side_branch": _SideBranch,
    "unused": _Unused,
}


def _leaves(module):
    return [p.detach().clone().requires_grad_(True) for p in module.parameters()]


def _run(module, leaves, x):
    params = dict(zip([n for n, _ in module.named_parameters()], leaves))
    return torch.func.functional_call(module, params, (x,))


@pytest.mark.parametrize("name", sorted(MODULES))
@pytest.mark.parametrize("last_stage", [False, True])
def test_two_passes_equal_one_backward(name, last_stage):
    torch.manual_seed(0)
    module = MODULES[name]().double()
    x0 = torch.randn(5, 6, dtype=torch.float64)
    grad_out = None if last_stage else torch.randn(5, 6, dtype=torch.float64)

    def forward():
        leaves = _leaves(module)
        x = x0.clone().requires_grad_(True)
        y = _run(module, leaves, x)
        return leaves, x, (y.square().mean() if last_stage else y)

    leaves, x, out = forward()
    expected = torch.autograd.grad(out, [x] + leaves, grad_outputs=grad_out, allow_unused=True)

    leaves, x, out = forward()
    dx, pending = input_gradient(out, grad_out, x, leaves)
    assert torch.equal(dx, expected[0])
    got = weight_gradients(pending, len(leaves))
    assert len(got) == len(leaves)
    for g, e in zip(got, expected[1:]):
        if e is None:
            assert g is None
        else:
            assert torch.equal(g, e)


def test_weight_pass_runs_after_the_input_pass_only():
    """The first pass computes no weight gradient work that the second pass repeats: it records the
    gradients at the junctions, and the graph is freed after the second pass."""
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).double()
    leaves = _leaves(module)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = _run(module, leaves, x)
    _, pending = input_gradient(y, torch.ones_like(y), x, leaves)
    assert all(len(group.grads) == len(group.junctions) for group in pending.groups)
    weight_gradients(pending, len(leaves))
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(y, x, torch.ones_like(y))
