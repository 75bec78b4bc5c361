"""Mixed precision and the backward rules' edge cases: autocast forwards with float32 weights, bfloat16
weights with float32 optimizer state, the swap rule refusing weights it cannot swap, and the recompute rule
replaying random state without counting BatchNorm statistics twice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipecore
from pipecore import AdamW, Pipeline, SGD

from _same import assert_same

M = 4
ALGORITHMS = pipecore.algorithm_names()
SWAP_ALGORITHMS = ["spectrain", "pipemare", "timeprest", "v-timeprest", "i-timeprest"]  # swap by default


def mlp(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3)).to(dtype)


def data(steps: int = 3, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 5, generator=g).to(dtype), torch.randint(0, 3, (8,), generator=g)) for _ in range(steps)]


def stages(algorithm: str) -> int:
    """3 stages, or 4 for the V placements (two stages on each rank)."""
    return 4 if algorithm in ("zb-v", "dualpipe-v") else 3


def train(model: nn.Module, algorithm: str, batches, **kw) -> tuple[list[float], dict]:
    pipe = Pipeline(model, stages(algorithm), algorithm, M, loss_fn=nn.CrossEntropyLoss(), **kw)
    losses = [pipe.step(x, y) for x, y in batches]
    pipe.flush()
    return losses, pipe.state_dict()


# -- autocast -----------------------------------------------------------------------------------------------


class Probe(nn.Module):
    """Identity that records the dtype of what it sees (a leaf module: recorded at every call)."""

    def __init__(self):
        super().__init__()
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        return x


def test_gpipe_under_autocast_equals_plain_training_under_autocast():
    batches = data()
    pipe = Pipeline(mlp(), 3, "gpipe", M, optimizer=SGD(lr=0.1, momentum=0.9), loss_fn=nn.CrossEntropyLoss(),
                    autocast=torch.bfloat16)
    losses = [pipe.step(x, y) for x, y in batches]
    ref = mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_losses = []
    for x, y in batches:
        total = 0.0
        for xs, ys in zip(x.chunk(M), y.chunk(M)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(ref(xs), ys)
            (loss / M).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        ref_losses.append(total / M)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    state = pipe.state_dict()
    for key, value in ref.state_dict().items():
        assert state[key].dtype == torch.float32  # the weights stay float32
        torch.testing.assert_close(state[key], value, rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_trains_under_autocast(algorithm):
    probe = Probe()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), probe, nn.Tanh(), nn.Linear(16, 3))
    losses, state = train(model, algorithm, data(), autocast=torch.bfloat16, leaf_modules=[Probe])
    assert all(torch.isfinite(torch.tensor(losses)))
    assert probe.seen and set(probe.seen) == {torch.bfloat16}  # the Linear before it ran in bfloat16
    assert all(v.dtype == torch.float32 for k, v in state.items() if k != "pipecore")
    plain = train(mlp(), algorithm, data())
    assert plain[0] != losses  # autocast changed the arithmetic


@pytest.mark.parametrize("algorithm", SWAP_ALGORITHMS)
def test_under_autocast_the_swap_rule_recomputes(algorithm):
    """autocast's weight casts are copies a swap cannot replace: the swap rule recomputes instead, bit for bit."""
    swapped = train(mlp(), algorithm, data(), autocast=torch.bfloat16)
    recomputed = train(mlp(), algorithm, data(), autocast=torch.bfloat16, backward_rule="recompute")
    assert_same(swapped, recomputed, algorithm)


@pytest.mark.parametrize("rule", ["stash", "recompute", "swap"])
def test_every_backward_rule_trains_under_autocast(rule):
    losses, _ = train(mlp(), "pipemare", data(), autocast=torch.bfloat16, backward_rule=rule)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_autocast_must_be_a_floating_dtype():
    for bad in ("bf16", torch.int8, True):
        with pytest.raises(TypeError, match="autocast must be a floating torch dtype"):
            Pipeline(mlp(), 2, "1f1b", M, loss_fn=nn.CrossEntropyLoss(), autocast=bad)


# -- bfloat16 weights -------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_bfloat16_weights_train_with_float32_optimizer_state(algorithm, opt):
    if algorithm == "nesterov-async" and opt == "adamw":
        pytest.skip("nesterov-async refuses AdamW (no look-ahead); its adaptive optimizer is NAdam")
    optimizer = SGD(lr=0.05, momentum=0.9) if opt == "sgd" else AdamW(lr=1e-3)
    pipe = Pipeline(mlp(torch.bfloat16), stages(algorithm), algorithm, M, optimizer=optimizer,
                    loss_fn=nn.CrossEntropyLoss())
    before = {k: v.clone() for k, v in pipe.state_dict().items() if k != "pipecore"}
    losses = [pipe.step(x, y) for x, y in data(dtype=torch.bfloat16)]
    pipe.flush()
    assert all(torch.isfinite(torch.tensor(losses)))
    state = pipe.state_dict()
    assert all(state[k].dtype == torch.bfloat16 for k in before)
    assert any(not torch.equal(state[k], before[k]) for k in before)
    for stage in state["pipecore"]["stages"].values():
        tensors = [v for v in stage["optimizer"].values() if isinstance(v, torch.Tensor)]
        assert tensors and all(t.dtype == torch.float32 for t in tensors)


def test_gpipe_bfloat16_update_is_float32_math_rounded_once():
    """SGD with momentum on bfloat16 weights: the step is computed in float32 from float32 momentum, and the
    new weights are rounded to bfloat16 once."""
    x, y = data(1, torch.bfloat16)[0]
    pipe = Pipeline(mlp(torch.bfloat16), 3, "gpipe", M, optimizer=SGD(lr=0.05, momentum=0.9),
                    loss_fn=nn.CrossEntropyLoss())
    pipe.step(x, y)
    pipe.step(x, y)
    ref = mlp(torch.bfloat16)
    buffers = [torch.zeros_like(p, dtype=torch.float32) for p in ref.parameters()]
    for _ in range(2):
        for xs, ys in zip(x.chunk(M), y.chunk(M)):
            (nn.functional.cross_entropy(ref(xs), ys) / M).backward()
        with torch.no_grad():
            for p, buf in zip(ref.parameters(), buffers):
                buf.mul_(0.9).add_(p.grad.float())
                p.copy_((p.float() - 0.05 * buf).to(torch.bfloat16))
                p.grad = None
    state = pipe.state_dict()
    for key, value in ref.state_dict().items():
        diff = (state[key].float() - value.float()).abs()
        ulp = value.float().abs().clamp_min(1e-3) * 2 ** -7
        assert (diff <= ulp).all(), key


# -- swap rule: weights it cannot swap ---------------------------------------------------------------------


class ScaledLinear(nn.Linear):
    """A Linear whose forward uses a transformed weight (as a parametrization does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight * 0.5, self.bias)


def transformed_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), ScaledLinear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3)).double()


def test_the_swap_rule_refuses_weights_transformed_before_they_are_saved():
    with pytest.raises(ValueError, match=r"stage 0: module\(s\) 2 transform their weights.*parameters 2.weight.*"
                                         r"backward_rule='recompute'"):
        train(transformed_model(), "spectrain", [(x.double(), y) for x, y in data()], partition=[4, 6])
    # The recompute rule handles such modules.
    losses, _ = train(transformed_model(), "spectrain", [(x.double(), y) for x, y in data()], partition=[4, 6],
                      backward_rule="recompute")
    assert all(torch.isfinite(torch.tensor(losses)))


def test_the_swap_rule_accepts_plain_modules_on_every_stage():
    """No false alarm: activations (from the input data on stage 0, from the received values later) are not
    weights, even when their shape is a weight's."""
    torch.manual_seed(0)
    square = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)).double()
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(64, 16, generator=g, dtype=torch.float64), torch.randint(0, 16, (64,), generator=g))
               for _ in range(2)]  # micro-batches of 16 x 16: the shape of every weight
    losses, _ = train(square, "i-timeprest", batches)
    assert all(torch.isfinite(torch.tensor(losses)))


# -- recompute rule: BatchNorm and random state -----------------------------------------------------------


def batchnorm_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16), nn.BatchNorm1d(16),
                         nn.Tanh(), nn.Linear(16, 3)).double()


@pytest.mark.parametrize("algorithm", ["timeprest", "pipemare"])
def test_the_recompute_rule_counts_each_micro_batch_once_in_batchnorm_statistics(algorithm):
    batches = [(x.double(), y) for x, y in data()]
    _, recomputed = train(batchnorm_model(), algorithm, batches, backward_rule="recompute")
    # One running-statistics update per micro-batch's forward; the recomputation in the backward adds none.
    for key in ("1.num_batches_tracked", "4.num_batches_tracked"):
        assert int(recomputed[key]) == len(batches) * M, key


def test_recomputation_leaves_batchnorm_statistics_as_the_forward_left_them():
    """timeprest's first steps on 3 stages read the same weights in every backward under both rules, so the
    running statistics, which only forwards should write, are equal bit for bit."""
    batches = [(x.double(), y) for x, y in data()]
    _, recomputed = train(batchnorm_model(), "timeprest", batches, backward_rule="recompute")
    _, stashed = train(batchnorm_model(), "timeprest", batches, backward_rule="stash")
    for key in recomputed:
        if "running_" in key:
            assert torch.equal(recomputed[key], stashed[key]), key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_recompute_rule_replays_cuda_dropout():
    """On CUDA, dropout draws from the device's generator: the recomputation restores it as well."""
    def run(rule: str):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 3)).double()
        torch.manual_seed(5)
        # 3 stages, so 2 cut points (node indices): the first Linear and the dropout in stage 0 (a stage with
        # weights and a dropout mask for the recomputed forward to replay), the Tanh in stage 1, the last Linear
        # in stage 2.
        return train(model, "pipemare", [(x.double(), y) for x, y in data()], backward_rule=rule,
                     devices="cuda:0", concurrent=False, partition=[2, 3])

    recomputed, stashed = run("recompute"), run("stash")
    assert recomputed[0] == stashed[0]  # the same masks in every forward
