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



def _zero_bubble_pipeline(algorithm: str):
    import pipecore

    torch.manual_seed(0)
    # Tanh saves its own output: the node a saved-tensor hook returning the tensor itself holds in a cycle.
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    return pipecore.Pipeline(model, 2, algorithm, 4, loss_fn=nn.CrossEntropyLoss(), track_memory=True)


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (16,), generator=g)


def _live_cpu_bytes() -> int:
    """The bytes of every CPU tensor storage Python can reach, each storage once."""
    import gc

    gc.collect()
    storages = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            storage = o.untyped_storage()
            try:
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # a fake tensor another test's export left for the collector: it has no data
                continue
    return sum(storages.values())


def test_deferred_weight_passes_free_their_graphs_under_the_memory_account():
    """The account's pack hook hands autograd detached aliases: with the tensors themselves, a node's saved output
    held its node in a cycle that a W, which runs only the nodes under the weights, never broke, and every
    micro-batch whose W was deferred outlived its step (7 MB a step on the tests' GPT)."""
    pipe = _zero_bubble_pipeline("zb-h1")
    for seed in range(3):
        pipe.step(*_batch(seed))
    before = _live_cpu_bytes()
    for seed in range(3, 6):
        pipe.step(*_batch(seed))
    assert _live_cpu_bytes() == before
    assert all(not st.memory.waiting and not st.memory.in_flight and st.memory.live == 0 for st in (pipe.stages[s] for s in range(pipe.num_stages)))
    pipe.close()


def test_the_account_counts_what_a_deferred_weight_pass_keeps_until_it_runs(monkeypatch):
    """zb-h1's last stage leaves each micro-batch's W for the cool-down: its graph under the weights' junctions
    (every layer's saved input) stays allocated until that W, while what only the loss saved, and the stage's
    kept input no node saved, go at the B. The account counts, at each W, exactly the bytes of the micro-batch's
    kept ranges some saved alias of which is still alive."""
    from pipecore.engine.memory import MemoryAccount

    pipe = _zero_bubble_pipeline("zb-h1")
    seen = []
    original = MemoryAccount.weighted

    def weighted(self, microbatch):
        self._settle()
        ranges = self.waiting.get(microbatch, {})
        saved = self._saved.get(microbatch, {})
        alive = {key for key in ranges if any(ref() is not None for ref in saved.get(key[0], ()))}
        seen.append((sum(ranges.values()), sum(ranges[key] for key in alive), self.live))
        original(self, microbatch)

    monkeypatch.setattr(MemoryAccount, "weighted", weighted)
    for seed in range(2):
        pipe.step(*_batch(seed))
    last = pipe.stages[1].memory
    pipe.close()
    deferred = [s for s in seen if s[0]]
    assert deferred, "the last stage defers its Ws"
    # Still counted at the W: what the graph under the junctions holds, nothing more.
    assert all(counted == alive for counted, alive, _ in deferred)
    # The last stage is Tanh, Linear, Tanh, Linear and the loss on micro-batches of 4: the two Tanhs' outputs, the
    # Linears' saved inputs (4 x 16 float64 each), stay; its received input (Tanh saves its output, not its input),
    # the log-probabilities and the target went at the B.
    assert all(counted == 2 * 4 * 16 * 8 for counted, _, _ in deferred)
    assert last.peak > 0
