"""The interleaved, looped and zero-bubble schedules train exactly like sequential training (CPU, float64):
several stages per rank, the backward split into B and W, a weight tied across stages (on one rank in the V
placements), in turn and on threads; and what else a pipeline does (clipping, LR schedules, checkpoints,
predict) works with them."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F_

import pipecore
from pipecore import Pipeline, SGD
from pipecore.schedule.ir import W

from _same import assert_same

M = 8  # micro-batches per mini-batch: a multiple of the ranks of every configuration below
WIDTH = 6

# (algorithm, chunks, stages per rank): every new schedule, 4 and 8 chunks, one or two chunks per rank where allowed.
CONFIGS = [
    (name, chunks, spr)
    for name, allowed in [("interleaved-1f1b", (1, 2)), ("looped-bfs", (1, 2)), ("zb-h1", (1, 2)), ("zb-v", (2,)),
                          ("dualpipe-v", (2,))]
    for chunks in (4, 8)
    for spr in allowed
]


class TiedMLP(nn.Module):
    """An MLP whose output layer reuses the input layer's weight (transposed use, like a language model's head):
    the weight is tied across the first and the last stage."""

    def __init__(self, depth: int = 8, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(depth)])
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F_.linear(self.blocks(torch.tanh(self.embed(x))), self.embed.weight)


def cuts(chunks: int) -> list[str]:
    """Stage starts: chunks - 1 cuts among the blocks (the head stays with the last block)."""
    return [f"blocks.{i}" for i in range(chunks - 1)]


def data(steps: int, batch: int = 16, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, WIDTH, generator=g, dtype=torch.float64), torch.randint(0, WIDTH, (batch,), generator=g))
            for _ in range(steps)]


def sequential(batches, clip: float | None = None, lr_lambda=None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain training: m micro-batches of each mini-batch, loss / m each, one SGD step per mini-batch."""
    model = TiedMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = None if lr_lambda is None else torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for x, y in batches:
        total = 0.0
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            loss = loss_fn(model(xm), ym) / M
            loss.backward()
            total += float(loss)
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(total)
    return losses, model.state_dict()


def pipeline(algorithm: str, chunks: int, spr: int, **kwargs) -> Pipeline:
    return Pipeline(TiedMLP(), chunks, algorithm, M, loss_fn=nn.CrossEntropyLoss(), partition=cuts(chunks),
                    optimizer=SGD(lr=0.1, momentum=0.9), stages_per_rank=spr, **kwargs)


def model_state(pipe: Pipeline) -> dict[str, torch.Tensor]:
    state = pipe.state_dict()
    return {k: v for k, v in state.items() if k != "pipecore"}


@pytest.mark.parametrize("concurrent", [False, True], ids=["in-turn", "threads"])
@pytest.mark.parametrize("algorithm,chunks,spr", CONFIGS)
def test_equals_sequential_training(algorithm, chunks, spr, concurrent):
    batches = data(3)
    pipe = pipeline(algorithm, chunks, spr, concurrent=concurrent)
    assert pipe.num_ranks == chunks // spr
    assert pipe.ties, "the test model ties a weight across stages"
    losses = [pipe.step(x, y) for x, y in batches]
    pipe.flush()
    expected_losses, expected = sequential(batches)
    got = model_state(pipe)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-12, msg=lambda m: f"{key}: {m}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=0, atol=1e-12)


def test_v_placement_puts_the_tied_first_and_last_stage_on_one_rank():
    pipe = pipeline("zb-v", 4, 2)
    assert pipe.placement == (0, 1, 1, 0)
    assert sorted(s for s, _ in pipe.ties["embed.weight"]) == [0, 3]
    schedule = pipe.algorithm.schedule(1)
    assert all(schedule.splits_backward(s) for s in range(4))
    assert sum(1 for a in schedule.rank_rows[0] if a.kind is W) == 2 * M  # both chunks' weight gradients


def test_in_turn_and_threads_give_the_same_bits():
    batches = data(2)
    runs = []
    for concurrent in (False, True):
        pipe = pipeline("zb-v", 8, 2, concurrent=concurrent)
        runs.append(([pipe.step(x, y) for x, y in batches], model_state(pipe)))
        pipe.close()
    assert_same(runs[0], runs[1])


@pytest.mark.parametrize("algorithm,spr", [("zb-v", 2), ("interleaved-1f1b", 2)])
def test_global_clipping_and_lr_schedule_equal_plain_training(algorithm, spr):
    batches = data(3)
    lr_lambda = lambda u: 1.0 / (1 + u)  # noqa: E731
    pipe = pipeline(algorithm, 4, spr, clip_grad_norm=0.05, lr_scheduler=lr_lambda)
    losses = [pipe.step(x, y) for x, y in batches]
    pipe.flush()
    expected_losses, expected = sequential(batches, clip=0.05, lr_lambda=lr_lambda)
    got = model_state(pipe)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=0, atol=1e-12)


def test_checkpoint_loads_into_one_stage_per_rank_and_training_continues_alike():
    batches = data(4)
    pipe = pipeline("interleaved-1f1b", 4, 2)
    for x, y in batches[:2]:
        pipe.step(x, y)
    pipe.flush()
    state = pipe.state_dict()
    other = pipeline("1f1b", 4, 1)
    other.load_state_dict(state)
    assert_same(model_state(other), model_state(pipe))
    a = [pipe.step(x, y) for x, y in batches[2:]]
    b = [other.step(x, y) for x, y in batches[2:]]
    pipe.flush()
    other.flush()
    assert_same((a, model_state(pipe)), (b, model_state(other)))


def test_predict_and_autocast_run_on_a_v_schedule():
    x, y = data(1)[0]
    pipe = pipeline("dualpipe-v", 4, 2)
    plain = TiedMLP()
    # predict runs the micro-batches: the plain model on the same ones (a matmul's rounding may depend on its rows).
    expected = torch.cat([plain(chunk) for chunk in x.tensor_split(M)])
    torch.testing.assert_close(pipe.predict(x), expected, rtol=0, atol=0)
    cast = Pipeline(TiedMLP().float(), 4, "zb-v", M, loss_fn=nn.CrossEntropyLoss(), partition=cuts(4),
                    optimizer=SGD(lr=0.1), autocast=torch.bfloat16)
    loss = cast.step(x.float(), y)
    assert torch.isfinite(torch.tensor(loss))


def test_devices_take_one_entry_per_rank():
    pipe = pipeline("zb-v", 4, 2, devices=["cpu", "cpu"])
    assert [str(d) for d in pipe.devices] == ["cpu"] * 4
    with pytest.raises(ValueError, match=r"one per rank \(2\)"):
        pipeline("zb-v", 4, 2, devices=["cpu"] * 3)


@pytest.mark.parametrize("algorithm,options,message", [
    ("zb-v", dict(stages_per_rank=1), "stages_per_rank must be 2"),
    ("dualpipe-v", dict(stages_per_rank=4), "stages_per_rank must be 2"),
    ("interleaved-1f1b", dict(stages_per_rank=3), "must be a multiple of stages_per_rank"),
    ("1f1b", dict(stages_per_rank=2), "runs one stage per rank"),
])
def test_bad_stages_per_rank_is_refused(algorithm, options, message):
    with pytest.raises(ValueError, match=message):
        pipecore.get_algorithm(algorithm, 4, M, **options) if hasattr(pipecore, "get_algorithm") else \
            pipecore.algorithms.get_algorithm(algorithm, 4, M, **options)


def test_microbatches_not_a_multiple_of_the_ranks_is_refused():
    with pytest.raises(ValueError, match="n_microbatches .* must be a multiple"):
        Pipeline(TiedMLP(), 8, "interleaved-1f1b", 6, loss_fn=nn.CrossEntropyLoss(), partition=cuts(8),
                 stages_per_rank=2)


def test_a_weight_action_right_after_its_backward_is_computed_in_one_pass(monkeypatch):
    """Where a rank runs a B and then at once its own W (no earlier W pending), the stage computes both in one
    autograd pass: fewer split backwards than B actions, and the same training (test_equals_sequential_training)."""
    import pipecore.engine.stage as stage_module

    calls = []
    real = stage_module.input_gradient
    monkeypatch.setattr(stage_module, "input_gradient", lambda *a, **k: calls.append(1) or real(*a, **k))
    pipe = pipeline("dualpipe-v", 4, 2, concurrent=False)
    rows = pipe.algorithm.schedule(1).rank_rows
    adjacent = sum(1 for row in rows for a, b in zip(row, row[1:])
                   if a.kind.value == "B" and b.kind is W and (a.stage, a.index) == (b.stage, b.index) and a.stage > 0)
    splittable = sum(1 for row in rows for a in row if a.kind.value == "B" and a.stage > 0)  # stage 0 sends nothing
    assert adjacent > 0
    pipe.step(*data(1)[0])
    assert splittable - adjacent <= len(calls) < splittable
