"""Gradient clipping: the global norm for synchronous algorithms (equal to torch.nn.utils.clip_grad_norm_ on
the whole model, a tied weight counted once), per-stage norms for asynchronous ones, and bad input."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

import pipecore
from pipecore import AdamW, Pipeline, SGD
from pipecore.engine.clip import flushes_every_minibatch
from pipecore.models import GPT

from _same import assert_same

M = 4


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(),
                         nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def data(steps: int = 4, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(steps)]


def plain_training(model: nn.Module, optimizer: torch.optim.Optimizer, batches, max_norm: float, loss_fn
                   ) -> list[float]:
    """Per mini-batch: m micro-batch losses / m, clip_grad_norm_, step. Returns the norms torch reports."""
    norms = []
    for x, y in batches:
        for xs, ys in zip(x.chunk(M), y.chunk(M)):
            (loss_fn(model(xs), ys) / M).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad()
    return norms


@pytest.mark.parametrize("algorithm", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("concurrent", [False, True])
def test_synchronous_clipping_equals_clipping_the_whole_model(algorithm, num_stages, opt, concurrent):
    ours = SGD(lr=0.1, momentum=0.9) if opt == "sgd" else AdamW(lr=0.01)
    pipe = Pipeline(mlp(), num_stages, algorithm, M, optimizer=ours, loss_fn=nn.CrossEntropyLoss(),
                    clip_grad_norm=0.05, concurrent=concurrent)
    for x, y in data():
        pipe.step(x, y)
    ref = mlp()
    theirs = (torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9) if opt == "sgd"
              else torch.optim.AdamW(ref.parameters(), lr=0.01))
    norms = plain_training(ref, theirs, data(), 0.05, nn.CrossEntropyLoss())
    assert norms[-1] > 0.05  # the norm was clipped at every step, not left alone
    got = pipe.state_dict()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-12, msg=key)
    for st in pipe.stats():  # every stage saw the global norm of the last update group
        assert st["grad_norm"] == pytest.approx(norms[-1], rel=1e-12)


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16).double()


def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def token_batches(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 16, (8, 8), generator=g), torch.randint(0, 16, (8, 8), generator=g))
            for _ in range(steps)]


@pytest.mark.parametrize("concurrent", [False, True])
def test_a_tied_weight_counts_once_in_the_global_norm(concurrent):
    """The GPT's head is tied to its token embedding, on the first and the last stage: its gradient is the
    two owners' sum, counted once, as clip_grad_norm_ counts a shared parameter once."""
    pipe = Pipeline(gpt(), 3, "1f1b", M, optimizer=SGD(lr=0.1), loss_fn=lm_loss, partition=["blocks.0", "blocks.1"],
                    clip_grad_norm=0.1, concurrent=concurrent)
    assert pipe.ties
    for x, y in token_batches():
        pipe.step(x, y)
    ref = gpt()
    norms = plain_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), token_batches(), 0.1, lm_loss)
    assert norms[-1] > 0.1
    got = pipe.state_dict()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-12, msg=key)
    assert torch.equal(got["tok_emb.weight"], got["head.weight"])
    assert pipe.stats()[0]["grad_norm"] == pytest.approx(norms[-1], rel=1e-12)


class RecordingSGD(torch.optim.SGD):
    """SGD that records the norm of the gradients it is given at every step."""

    seen: list[float]

    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.seen.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        return super().step(closure)


def recording(seen: list[list[float]]):
    def factory(params):
        opt = RecordingSGD(params, lr=0.1)
        opt.seen = []
        seen.append(opt.seen)
        return opt

    return factory


@pytest.mark.parametrize("algorithm", ["pipedream", "2bw", "pipemare", "i-timeprest"])
def test_asynchronous_clipping_bounds_each_stages_own_gradient(algorithm):
    seen: list[list[float]] = []
    pipe = Pipeline(mlp(), 3, algorithm, M, optimizer=recording(seen), loss_fn=nn.CrossEntropyLoss(),
                    clip_grad_norm=0.02, **({"lr_rescheduling": False} if algorithm == "pipemare" else {}))
    for x, y in data():
        pipe.step(x, y)
    pipe.flush()
    assert len(seen) == 3 and all(seen)
    for s, norms in enumerate(seen):
        assert max(norms) <= 0.02 * (1 + 1e-9), (s, norms)
    stats = pipe.stats()
    assert all(st["grad_norm"] is not None for st in stats)
    assert max(st["grad_norm"] for st in stats) > 0.02  # clipping did scale some gradients down
    for s, st in enumerate(stats):  # the last update applied the stage's own gradient, scaled to at most 0.02
        assert seen[s][-1] == pytest.approx(min(st["grad_norm"], 0.02 * st["grad_norm"] / (st["grad_norm"] + 1e-6)),
                                            rel=1e-9)


def test_asynchronous_clipping_keeps_tied_copies_identical():
    pipe = Pipeline(gpt(), 3, "pipedream", M, optimizer=SGD(lr=0.1), loss_fn=lm_loss,
                    partition=["blocks.0", "blocks.1"], clip_grad_norm=0.01)
    for x, y in token_batches():
        pipe.step(x, y)
    pipe.flush()
    state = pipe.state_dict()
    assert torch.equal(state["tok_emb.weight"], state["head.weight"])
    assert max(st["grad_norm"] for st in pipe.stats()) > 0.01


@pytest.mark.parametrize("algorithm", ["1f1b", "pipedream", "2bw"])
def test_a_norm_never_reached_changes_nothing(algorithm):
    def run(**kw):
        pipe = Pipeline(mlp(), 3, algorithm, M, optimizer=SGD(lr=0.1, momentum=0.9), loss_fn=nn.CrossEntropyLoss(),
                        **kw)
        losses = [pipe.step(x, y) for x, y in data()]
        pipe.flush()
        return losses, pipe.state_dict()

    assert_same(run(clip_grad_norm=1e6), run())


def test_which_schedules_clip_by_the_global_norm():
    synchronous = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "zb-v", "dualpipe-v")
    for name in pipecore.algorithm_names():
        algorithm = pipecore.get_algorithm(name, 4, 4)
        assert flushes_every_minibatch(algorithm.schedule(2), 4, algorithm.update_every) == (name in synchronous), name


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "1", True])
def test_a_bad_norm_is_refused(bad):
    with pytest.raises(ValueError, match="clip_grad_norm must be a finite number > 0"):
        Pipeline(mlp(), 2, "1f1b", M, loss_fn=nn.CrossEntropyLoss(), clip_grad_norm=bad)


def test_without_clipping_stats_report_no_norm():
    pipe = Pipeline(mlp(), 2, "1f1b", M, loss_fn=nn.CrossEntropyLoss())
    pipe.step(*data(1)[0])
    assert [st["grad_norm"] for st in pipe.stats()] == [None, None]


def test_a_torch_optimizer_factory_is_clipped_too():
    pipe = Pipeline(mlp(), 2, "gpipe", M, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                    loss_fn=nn.CrossEntropyLoss(), clip_grad_norm=0.05)
    for x, y in data():
        pipe.step(x, y)
    ref = mlp()
    plain_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), data(), 0.05, nn.CrossEntropyLoss())
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[key], value, rtol=0, atol=1e-12, msg=key)
