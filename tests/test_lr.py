"""Learning-rate schedules and set_lr: equal to plain training with the same torch scheduler (float64), each
stage on its own update count, the current rate in weight prediction and per-stage scaling, checkpoints, and
bad input."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pipecore import Pipeline, SGD

M = 4


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(),
                         nn.Linear(6, 3)).double()


def data(steps: int, batch: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(steps)]


def plain_training(batches, scheduler=None, lr_changes=None) -> nn.Module:
    """Sequential training: m micro-batch losses / m, one SGD step per mini-batch, then ``scheduler.step()``;
    ``lr_changes[i]`` sets the rate before mini-batch ``i``."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = scheduler(optimizer) if scheduler is not None else None
    loss_fn = nn.CrossEntropyLoss()
    for i, (x, y) in enumerate(batches):
        if lr_changes and i in lr_changes:
            for group in optimizer.param_groups:
                group["lr"] = lr_changes[i]
        for xs, ys in zip(x.chunk(M), y.chunk(M)):
            (loss_fn(model(xs), ys) / M).backward()
        optimizer.step()
        optimizer.zero_grad()
        if sched is not None:
            sched.step()
    return model


def assert_weights_equal(pipe: Pipeline, model: nn.Module) -> None:
    pipe.flush()
    got = pipe.state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-12, msg=key)


SCHEDULERS = {
    "lambda": (lambda u: 0.5 ** u, lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 0.5 ** u)),
    "cosine": (lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4),) * 2,
    "step": (lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3),) * 2,
    "warmup": (lambda opt: torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3),) * 2,
}


@pytest.mark.parametrize("algorithm", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("kind", SCHEDULERS)
def test_a_schedule_equals_plain_training_with_the_same_torch_scheduler(algorithm, num_stages, kind):
    ours, theirs = SCHEDULERS[kind]
    batches = data(6)
    pipe = Pipeline(mlp(), num_stages, algorithm, M, optimizer=SGD(lr=0.1, momentum=0.9),
                    loss_fn=nn.CrossEntropyLoss(), lr_scheduler=ours)
    for x, y in batches:
        pipe.step(x, y)
    assert_weights_equal(pipe, plain_training(batches, theirs))


@pytest.mark.parametrize("algorithm", ["gpipe", "1f1b"])
def test_set_lr_equals_changing_the_optimizers_rate(algorithm):
    batches = data(5)
    pipe = Pipeline(mlp(), 3, algorithm, M, optimizer=SGD(lr=0.1, momentum=0.9), loss_fn=nn.CrossEntropyLoss())
    for i, (x, y) in enumerate(batches):
        if i == 2:
            pipe.set_lr(0.02)
        if i == 4:
            pipe.set_lr(0.0)
        pipe.step(x, y)
    assert all(st["lr"] == 0.0 for st in pipe.stats())
    assert_weights_equal(pipe, plain_training(batches, lr_changes={2: 0.02, 4: 0.0}))


def test_set_lr_applies_to_a_torch_optimizer_factory():
    from functools import partial

    batches = data(3)
    pipe = Pipeline(mlp(), 2, "gpipe", M, optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.9),
                    loss_fn=nn.CrossEntropyLoss())
    for i, (x, y) in enumerate(batches):
        if i == 1:
            pipe.set_lr(0.03)
        pipe.step(x, y)
    assert_weights_equal(pipe, plain_training(batches, lr_changes={1: 0.03}))


def test_each_stage_follows_its_own_update_count():
    """PipeDream updates after every micro-batch's backward, and stage s has had P-s fewer... updates at any
    time than the last stage: each stage's next rate is base * 0.5 ** (its own update count)."""
    pipe = Pipeline(mlp(), 4, "pipedream", M, optimizer=SGD(lr=0.1), loss_fn=nn.CrossEntropyLoss(),
                    lr_scheduler=lambda u: 0.5 ** u)
    for x, y in data(2):
        pipe.step(x, y)
    stats = pipe.stats()
    updates = [pipe.stages[s].book.updates for s in range(4)]
    assert len(set(updates)) > 1, updates  # the stages are at different update counts
    for s, st in enumerate(stats):
        assert st["lr"] == 0.1 * 0.5 ** updates[s]


@pytest.mark.parametrize("algorithm,options", [
    ("spectrain", {}),  # weight prediction reads W - s * lr * v with the rate of the next update
    ("pipemare", {}),  # per-stage scaling multiplies the scheduled rate
    ("2bw", {}),
    ("i-timeprest", {}),
])
def test_a_constant_schedule_equals_its_rate_as_the_base_rate(algorithm, options):
    """lr_scheduler = lambda u: c against the optimizer's rate times c: bit-identical only if every use of the
    rate (the update, SpecTrain's prediction, PipeMare's scaled rate) sees the scheduled one."""
    def run(lr: float, schedule=None):
        pipe = Pipeline(mlp(), 3, algorithm, M, optimizer=SGD(lr=lr, momentum=0.9), loss_fn=nn.CrossEntropyLoss(),
                        lr_scheduler=schedule, **options)
        losses = [pipe.step(x, y) for x, y in data(4)]
        pipe.flush()
        return losses, pipe.state_dict()

    (l1, s1), (l2, s2) = run(0.4, lambda u: 0.25), run(0.1)
    assert l1 == l2
    for key in s2:
        if key != "pipecore":
            assert torch.equal(s1[key], s2[key]), key


@pytest.mark.parametrize("set_rate", [False, True])
def test_weight_prediction_steps_with_the_rate_of_the_next_update(set_rate):
    """SpecTrain reads W - s * lr * v: lr is the scheduled rate of the stage's next update (or the one
    set_lr gave), not the optimizer's rate at construction."""
    from pipecore.algorithms.base import WeightRead

    schedule = None if set_rate else (lambda u: 0.5 ** u)
    pipe = Pipeline(mlp(), 3, "spectrain", M, optimizer=SGD(lr=0.4, momentum=0.9), loss_fn=nn.CrossEntropyLoss(),
                    lr_scheduler=schedule)
    for x, y in data(3):
        pipe.step(x, y)
    if set_rate:
        pipe.set_lr(0.07)
    stage = pipe.stages[0]
    rate = 0.07 if set_rate else 0.4 * 0.5 ** stage.book.updates
    assert pipe.stats()[0]["lr"] == rate
    live = stage.book.live
    predicted = stage.materialize(WeightRead(live, "predict", coef=2.0)).clone()
    base = stage.slot_of(live)
    direction = stage.buffer("direction")
    assert direction.abs().max() > 0  # the prediction moves the weights
    torch.testing.assert_close(predicted, base - 2.0 * rate * direction, rtol=0, atol=1e-15)


def test_set_lr_and_a_schedule_survive_a_checkpoint(tmp_path):
    batches = data(4)

    def build(**kw) -> Pipeline:
        return Pipeline(mlp(), 2, "1f1b", M, optimizer=SGD(lr=0.1, momentum=0.9), loss_fn=nn.CrossEntropyLoss(), **kw)

    pipe = build()
    pipe.step(*batches[0])
    pipe.set_lr(0.05)
    pipe.step(*batches[1])
    state = pipe.state_dict()
    resumed = build()
    resumed.load_state_dict(state)
    assert [st["lr"] for st in resumed.stats()] == [0.05, 0.05]

    # A schedule continues from the update count the checkpoint holds.
    def cosine(opt):
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)

    whole = build(lr_scheduler=cosine)
    for x, y in batches:
        whole.step(x, y)
    first = build(lr_scheduler=cosine)
    for x, y in batches[:2]:
        first.step(x, y)
    second = build(lr_scheduler=cosine)
    second.load_state_dict(first.state_dict())
    for x, y in batches[2:]:
        second.step(x, y)
    assert [st["lr"] for st in second.stats()] == [st["lr"] for st in whole.stats()]
    assert_weights_equal(second, plain_training(batches, cosine))


def test_bad_schedules_and_rates_are_refused():
    def build(**kw) -> Pipeline:
        return Pipeline(mlp(), 2, "1f1b", M, loss_fn=nn.CrossEntropyLoss(), **kw)

    with pytest.raises(TypeError, match="lr_scheduler must be a function of the update index"):
        build(lr_scheduler=0.5)
    with pytest.raises(TypeError, match=r"lr_scheduler\(0\) returned 'x'; it must return a number"):
        build(lr_scheduler=lambda u: "x")
    with pytest.raises(ValueError, match="learning rate -0.01 for update 0"):
        build(lr_scheduler=lambda u: -1.0)
    with pytest.raises(TypeError, match="ReduceLROnPlateau steps on a metric"):
        build(lr_scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    pipe = build(lr_scheduler=lambda u: 1.0 if u < 1 else math.nan)
    x, y = data(1)[0]
    pipe.step(x, y)
    with pytest.raises(ValueError, match="learning rate nan for update 1"):
        pipe.step(x, y)
    scheduled = build(lr_scheduler=lambda u: 1.0)
    with pytest.raises(RuntimeError, match="has an lr_scheduler"):
        scheduled.set_lr(0.1)
    plain = build()
    for bad in (-0.1, math.inf, "0.1", True):
        with pytest.raises(ValueError, match="must be a finite number >= 0"):
            plain.set_lr(bad)
