"""Mini-batches as users have them: sizes that do not divide into the micro-batches (each micro-batch's loss
weighted by its size, so a step is the one of the plain mean loss), a forward that takes one dict or dataclass
of tensors, and what a wrong optimizer argument or an empty batch is told (CPU, float64)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import pipecore
from pipecore import AdamW, Pipeline, SGD
from pipecore.engine.inputs import loss_divisor, split_batch

sys.path.insert(0, str(Path(__file__).parent))
import dist_run  # noqa: E402
from _ranks import launch_ranks  # noqa: E402

M = 4
BATCH = 30  # 4 micro-batches of 8, 8, 7 and 7 samples
SIZES = [8, 8, 7, 7]


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(),
                         nn.Linear(6, 3)).double()


def data(steps: int, batch: int = BATCH, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(steps)]


def plain_training(model: nn.Module, optimizer: torch.optim.Optimizer, batches) -> list[float]:
    """One optimizer step per mini-batch on the mean loss over all its samples; returns the losses."""
    loss_fn, losses = nn.CrossEntropyLoss(), []
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def assert_weights(pipe: Pipeline, reference: nn.Module) -> None:
    got = pipe.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-12)


def test_split_batch_gives_tensor_split_micro_batches():
    x = torch.arange(30.0).view(30, 1)
    chunks = split_batch({"x": x, "y": x.view(30)}, M, "x")
    assert chunks.sizes == SIZES and chunks.samples == BATCH
    for u, (xs, ys) in enumerate(chunks.chunks):
        assert torch.equal(xs, x.tensor_split(M)[u]) and torch.equal(ys, x.view(30).tensor_split(M)[u])


def test_equal_micro_batches_divide_the_loss_by_the_micro_batches_per_update_as_before():
    # Exactly update_every (an int): batches that divide train bit for bit as before.
    assert loss_divisor(8, 32, 4, 4) == 4 and type(loss_divisor(8, 32, 4, 4)) is int
    assert loss_divisor(8, 32, 4, 1) == 1
    # Otherwise the loss weighs by size: with one update per mini-batch, size / samples.
    assert [1 / loss_divisor(n, BATCH, M, M) for n in SIZES] == pytest.approx([n / BATCH for n in SIZES], abs=1e-15)


@pytest.mark.parametrize("algorithm", ["gpipe", "1f1b"])
@pytest.mark.parametrize("concurrent", [False, True])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_a_batch_that_does_not_divide_trains_as_the_plain_mean_loss(algorithm, concurrent, opt):
    batches = data(4) + data(1, batch=5, seed=2)  # 30 samples as 8, 8, 7, 7; then 5 as 2, 1, 1, 1
    if opt == "sgd":
        ours = SGD(lr=0.1, momentum=0.9, weight_decay=1e-3)
        theirs = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3)  # noqa: E731
    else:
        ours = AdamW(lr=0.01, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1)
        theirs = lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1)  # noqa: E731
    pipe = Pipeline(mlp(), 3, algorithm, M, optimizer=ours, loss_fn=nn.CrossEntropyLoss(), concurrent=concurrent)
    losses = [pipe.step(x, y) for x, y in batches]
    reference = mlp()
    expected = plain_training(reference, theirs(reference.parameters()), batches)
    assert losses == pytest.approx(expected, rel=0, abs=1e-13)  # step() returns the mean over the samples
    assert_weights(pipe, reference)


@pytest.mark.parametrize("concurrent", [False, True])
def test_2bw_with_a_batch_that_does_not_divide_follows_the_delayed_update_rule_on_the_plain_mean(concurrent):
    """theta(t+1) = theta(t) - lr * grad(theta(t-1)) of the mean loss over mini-batch t (theta(-1) = theta(0)),
    as tests/test_engine.py checks with batches that divide."""
    batches, lr = data(5), 0.2
    pipe = Pipeline(mlp(), 2, "2bw", M, optimizer=SGD(lr=lr), loss_fn=nn.CrossEntropyLoss(), concurrent=concurrent)
    losses = [pipe.step(x, y) for x, y in batches]
    pipe.flush()
    loss_fn, model = nn.CrossEntropyLoss(), mlp()
    history = [[p.detach().clone() for p in model.parameters()]]
    expected = []
    for t, (x, y) in enumerate(batches):
        with torch.no_grad():
            for p, v in zip(model.parameters(), history[max(t - 1, 0)]):
                p.copy_(v)
        model.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        expected.append(loss.item())
        history.append([w - lr * p.grad for w, p in zip(history[-1], model.parameters())])
    assert losses == pytest.approx(expected, rel=0, abs=1e-13)
    got = pipe.state_dict()
    for (name, _), value in zip(model.named_parameters(), history[-1]):
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-12)


def test_an_update_per_micro_batch_weighs_each_by_its_share_of_the_mini_batch():
    """With an update per micro-batch (PipeDream; one stage, so no staleness), micro-batch u's update is the
    gradient of its mean loss times size_u * m / samples: the mini-batch's updates add up to m times its
    plain mean, as m equal micro-batches' do."""
    batches, lr = data(2), 0.1
    pipe = Pipeline(mlp(), 1, "pipedream", M, optimizer=SGD(lr=lr), loss_fn=nn.CrossEntropyLoss())
    for x, y in batches:
        pipe.step(x, y)
    reference, loss_fn = mlp(), nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    for x, y in batches:
        for xu, yu in zip(x.tensor_split(M), y.tensor_split(M)):
            optimizer.zero_grad()
            (loss_fn(reference(xu), yu) * (len(xu) * M / len(x))).backward()
            optimizer.step()
    assert_weights(pipe, reference)


def test_a_multiprocess_run_with_batches_that_do_not_divide_is_bit_identical_to_one_process(tmp_path):
    algorithms = ["gpipe", "1f1b", "2bw"]
    results = launch_ranks(str(Path(__file__).parent / "dist_run.py"), 2, "uneven", str(tmp_path), ",".join(algorithms),
                           timeout=240)
    for r in results:
        assert r.returncode == 0, r.stdout
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: identical reductions
    try:
        for algorithm in algorithms:
            pipe = dist_run.make_pipeline(2, algorithm)
            losses = dist_run.train(pipe, dist_run.uneven_batches(), True, True)
            state = pipe.state_dict()
            for rank in range(2):
                got = torch.load(tmp_path / f"uneven-{algorithm}-{rank}.pt", weights_only=False)
                assert got["losses"] == losses, (algorithm, rank)
                for key, value in got["state"].items():
                    if key != "pipecore":
                        assert torch.equal(value, state[key]), (algorithm, rank, key)
    finally:
        torch.set_num_threads(threads)


def test_an_empty_batch_or_one_smaller_than_the_micro_batches_is_refused_clearly():
    pipe = Pipeline(mlp(), 2, "gpipe", M, loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match=r"x holds no samples \(dimension 0 is empty\); a batch needs at least 4 "
                                         r"\(n_microbatches=4\)"):
        pipe.step(torch.randn(0, 5, dtype=torch.float64), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="batch of 3 samples is smaller than n_microbatches=4: every micro-batch "
                                         "needs at least one sample"):
        pipe.step(torch.randn(3, 5, dtype=torch.float64), torch.zeros(3, dtype=torch.long))
    x, y = data(1)[0]
    assert pipe.step(x, y) > 0  # nothing was half-done: the pipeline trains on


# -- a forward that takes one dict or dataclass --------------------------------------------------------


class DictModel(nn.Module):
    """A Lightning-style forward: one dict, whose mask is read by the first and the last stage."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, batch):
        h = torch.tanh(self.a(batch["x"])) * batch["mask"]
        h = torch.tanh(self.b(h))
        return self.c(h) + batch["mask"][:, :3]


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    mask: torch.Tensor


class DataclassModel(DictModel):
    def forward(self, batch: Batch):
        h = torch.tanh(self.a(batch.x)) * batch.mask
        h = torch.tanh(self.b(h))
        return self.c(h) + batch.mask[:, :3]


def masked_data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, 5, generator=g, dtype=torch.float64),
             (torch.rand(BATCH, 6, generator=g) > 0.3).double(), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(steps)]


@pytest.mark.parametrize("kind", ["dict", "dataclass"])
@pytest.mark.parametrize("concurrent", [False, True])
def test_a_forward_that_takes_one_dict_or_dataclass_trains_as_plain_training(kind, concurrent):
    build = DictModel if kind == "dict" else DataclassModel

    def given(x, mask):  # a dict may hold more than the forward reads, tensors or not
        return {"x": x, "mask": mask, "ids": ["a"] * len(x)} if kind == "dict" else Batch(x, mask)

    batches = masked_data(3)
    pipe = Pipeline(build().double(), 3, "1f1b", M, optimizer=SGD(lr=0.1, momentum=0.9),
                    loss_fn=nn.CrossEntropyLoss(), concurrent=concurrent)
    assert len(pipe.stages) == 3
    losses = [pipe.step(given(x, mask), y) for x, mask, y in batches]
    reference = build().double()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    expected = []
    for x, mask, y in batches:
        optimizer.zero_grad()
        loss = nn.CrossEntropyLoss()(reference(given(x, mask)), y)
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=0, abs=1e-13)
    assert_weights(pipe, reference)
    x, mask, _ = batches[0]
    with torch.no_grad():
        torch.testing.assert_close(pipe.predict(given(x[:5], mask[:5])), reference(given(x[:5], mask[:5])),
                                   rtol=0, atol=1e-12)


def test_a_dict_missing_what_the_forward_reads_is_named():
    pipe = Pipeline(DictModel().double(), 2, "gpipe", M, loss_fn=nn.CrossEntropyLoss())
    x, mask, y = masked_data(1)[0]
    with pytest.raises(KeyError, match=r"batch has no entry 'mask', which the model's forward reads; it has \['x'\]"):
        pipe.step({"x": x}, y)
    with pytest.raises(TypeError, match=r"input batch\['mask'\] must be a tensor, got list"):
        pipe.step({"x": x, "mask": mask.tolist()}, y)
    with pytest.raises(TypeError, match=r"the model's forward reads its argument 'batch' as a dict or dataclass "
                                        r"\(batch\['x'\], batch\['mask'\]\); give x as that dict or dataclass"):
        pipe.step(x, y)


class ReadsWithGet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 3), nn.Linear(3, 3)

    def forward(self, batch):
        return self.b(self.a(batch.get("x")))


def test_a_dict_the_forward_reads_otherwise_than_by_key_says_how_to_read_it():
    pipe = Pipeline(ReadsWithGet().double(), 2, "gpipe", M, loss_fn=nn.CrossEntropyLoss())
    x, _, y = masked_data(1)[0]
    with pytest.raises(KeyError, match=r"x has \['x'\] but the model's forward takes \['batch'\]; pipecore takes x "
                                       r"as the one dict this forward takes only if the forward reads its entries as "
                                       r"batch\['key'\]"):
        pipe.step({"x": x}, y)
    with pytest.raises(TypeError, match=r"input 'batch' must be a tensor, got dict; pipecore splits a dict or "
                                        r"dataclass argument into the tensors the forward reads from it by key"):
        pipe.step({"batch": {"x": x}}, y)


# -- the optimizer argument ----------------------------------------------------------------------------


def test_a_torch_optimizer_instance_gets_one_line_saying_what_to_pass():
    model = mlp()
    with pytest.raises(TypeError) as raised:
        Pipeline(model, 2, "gpipe", M, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                 loss_fn=nn.CrossEntropyLoss())
    message = str(raised.value)
    assert "\n" not in message
    assert message == ("optimizer is a torch.optim.SGD instance; each stage builds its own optimizer over its "
                       "weights: pass pipecore.SGD(...), pipecore.AdamW(...), pipecore.NAdam(...) or a factory such as "
                       "lambda params: torch.optim.SGD(params, lr=0.1)")
    with pytest.raises(TypeError, match=r"^optimizer must be pipecore.SGD\(...\), .*; got a str$"):
        Pipeline(model, 2, "gpipe", M, optimizer="sgd", loss_fn=nn.CrossEntropyLoss())


def test_the_factory_the_message_suggests_works():
    batches = data(2)
    pipe = Pipeline(mlp(), 2, "gpipe", M, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                    loss_fn=nn.CrossEntropyLoss())
    for x, y in batches:
        pipe.step(x, y)
    reference = mlp()
    plain_training(reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches)
    assert_weights(pipe, reference)


def test_pipecore_names_are_still_there():
    assert pipecore.simulate.__name__ == "simulate" and callable(pipecore.simulate)
    assert {"Pipeline", "SGD", "AdamW", "checkpoint", "simulate", "Trace"} <= set(dir(pipecore))


class ReadsAnUnusedEntry(DictModel):
    def forward(self, batch):
        batch["ids"]  # read and dropped: fx keeps the read, the graph gets no input for it
        return super().forward(batch)


def test_an_entry_read_but_not_used_is_no_input_and_example_inputs_are_checked():
    x, mask, y = masked_data(1)[0]
    pipe = Pipeline(ReadsAnUnusedEntry().double(), 3, "gpipe", M, optimizer=SGD(lr=0.1),
                    loss_fn=nn.CrossEntropyLoss(), example_input={"x": x[:8], "mask": mask[:8]})
    assert "inputs batch['x'], batch['mask']" in pipe.describe()
    reference = DictModel().double()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    plain_training(reference, optimizer, [({"x": x, "mask": mask}, y)])
    pipe.step({"x": x, "mask": mask}, y)
    assert_weights(pipe, reference)


@pytest.mark.parametrize("algorithm", ["1f1b", "2bw"])
def test_a_failed_step_with_a_batch_that_does_not_divide_is_undone_and_training_goes_on(algorithm):
    batches = data(3) + data(1, batch=32, seed=4)
    poisoned = (batches[1][0].clone(), batches[1][1])
    poisoned[0][29, 0] = float("nan")  # the last micro-batch's loss is NaN
    pipe = Pipeline(mlp(), 2, algorithm, M, optimizer=SGD(lr=0.1), loss_fn=nn.CrossEntropyLoss())
    losses = [pipe.step(*batches[0])]
    with pytest.raises(pipecore.NonFiniteLoss):
        pipe.step(*poisoned)
    losses += [pipe.step(*batch) for batch in batches[1:]]  # the undone mini-batch again, then the others
    pipe.flush()
    reference = Pipeline(mlp(), 2, algorithm, M, optimizer=SGD(lr=0.1), loss_fn=nn.CrossEntropyLoss())
    expected = [reference.step(*batches[0])]
    reference.flush()  # the failure completed mini-batch 0 as flush() does
    expected += [reference.step(*batch) for batch in batches[1:]]
    reference.flush()
    assert losses == expected
    for key, value in reference.state_dict().items():
        if key != "pipecore":
            assert torch.equal(pipe.state_dict()[key], value), key
