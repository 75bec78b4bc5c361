"""Universal checkpoints: a pipeline's state loads into another number of stages, another partition, another
number of micro-batches, another algorithm and a plain model, weights and optimizer state by parameter name
(CPU, float64: synchronous continuations equal plain training to round-off)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import pipecore
from pipecore import AdamW, Pipeline, SGD, checkpoint
from pipecore.engine.state_io import CheckpointNote
from pipecore.engine.reshard import canonical_names, parameter_states
from pipecore.models import GPT

from _same import assert_same

SGD_ARGS = dict(lr=0.1, momentum=0.9, weight_decay=1e-3)
ADAMW_ARGS = dict(lr=0.01, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1)


def mlp(seed: int = 0) -> nn.Sequential:
    """Six Linear layers (indices 0, 2, ..., 10), Tanh between them."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(6):
        layers.append(nn.Linear(5 if i == 0 else 6, 3 if i == 5 else 6))
        if i < 5:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers).double()


def data(steps: int, batch: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(steps)]


def ours(opt: str) -> SGD | AdamW:
    return SGD(**SGD_ARGS) if opt == "sgd" else AdamW(**ADAMW_ARGS)


def trained_source(opt: str, algorithm: str = "1f1b", model: nn.Module | None = None, stages: int = 4,
                   batches: list | None = None) -> Pipeline:
    """A pipeline of 4 stages trained a few steps and flushed: the checkpoint's source."""
    pipe = Pipeline(mlp() if model is None else model, stages, algorithm, 4, optimizer=ours(opt),
                    loss_fn=nn.CrossEntropyLoss())
    for x, y in data(3) if batches is None else batches:
        pipe.step(x, y)
    pipe.flush()
    return pipe


def weights(state: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k != "pipecore"}


def per_name(state: dict, model: nn.Module) -> dict:
    """The optimizer state and declared buffers of every parameter, by canonical name."""
    pieces = parameter_states(state["pipecore"], canonical_names(model))
    return {name: (p.optimizer, p.buffers) for name, p in sorted(pieces.items())}


def assert_same_by_name(a: dict, b: dict, model: nn.Module) -> None:
    """Weights and per-parameter optimizer state equal bit for bit (step counts too)."""
    assert_same(dict(sorted(weights(a).items())), dict(sorted(weights(b).items())))
    pa, pb = per_name(a, model), per_name(b, model)
    assert pa.keys() == pb.keys()
    for name in pa:
        (oa, _), (ob, _) = pa[name], pb[name]
        assert oa.keys() == ob.keys(), name
        for key in oa:
            assert torch.equal(oa[key], ob[key]), (name, key)
    steps = {sm["optimizer"]["steps"] for sm in b["pipecore"]["stages"].values()}
    assert steps == {sm["optimizer"]["steps"] for sm in a["pipecore"]["stages"].values()}


def plain_copy(state: dict, model: nn.Module, opt: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``model`` with the checkpoint's weights and a torch optimizer holding its optimizer state per parameter."""
    model.load_state_dict(checkpoint.model_state_dict(state))
    pieces = parameter_states(state["pipecore"], canonical_names(model))
    steps = next(iter(state["pipecore"]["stages"].values()))["optimizer"]["steps"]
    if opt == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), **SGD_ARGS)
        for name, p in model.named_parameters():
            optimizer.state[p] = {"momentum_buffer": pieces[name].optimizer["momentum_buf"].clone()}
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW_ARGS)
        for name, p in model.named_parameters():
            o = pieces[name].optimizer
            optimizer.state[p] = {"step": torch.tensor(float(steps)), "exp_avg": o["exp_avg"].clone(),
                                  "exp_avg_sq": o["exp_avg_sq"].clone()}
    return model, optimizer


def train_plain(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list, m: int, loss_fn) -> None:
    """Plain training with gradient accumulation over ``m`` micro-batches, one step per mini-batch."""
    for x, y in batches:
        optimizer.zero_grad()
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            (loss_fn(model(xm), ym) / m).backward()
        optimizer.step()


def assert_close_to(pipe: Pipeline, model: nn.Module) -> None:
    got = pipe.state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-12)


# (stages, partition, algorithm, micro-batches) of the pipelines a 4-stage 1f1b checkpoint loads into.
SYNCHRONOUS_TARGETS = [
    (2, None, "1f1b", 4),
    (3, [2, 8], "1f1b", 2),      # another partition: layers 0 | 2, 4, 6 | 8, 10
    (3, [4, 6], "gpipe", 4),     # another partition and algorithm
    (1, None, "gpipe", 8),
]


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("stages, partition, algorithm, m", SYNCHRONOUS_TARGETS)
def test_a_checkpoint_continues_in_another_layout_as_plain_training(opt, stages, partition, algorithm, m):
    source = trained_source(opt)
    state = source.state_dict()
    target = Pipeline(mlp(seed=7), stages, algorithm, m, optimizer=ours(opt), loss_fn=nn.CrossEntropyLoss(),
                      partition=partition)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is dropped between synchronous algorithms
        target.load_state_dict(state)
    assert target.stage_layers != source.stage_layers or stages == 1
    loaded = target.state_dict()
    assert_same_by_name(loaded, state, mlp())
    assert [sm["updates"] for sm in loaded["pipecore"]["stages"].values()] == [3] * stages

    more = data(4, seed=2)
    for x, y in more:
        target.step(x, y)
    model, optimizer = plain_copy(state, mlp(seed=9), opt)
    train_plain(model, optimizer, more, m, nn.CrossEntropyLoss())
    assert_close_to(target, model)
    # The continuation moved the weights: the comparison is not between two copies of the checkpoint.
    assert not torch.equal(target.state_dict()["0.weight"], state["0.weight"])


@pytest.mark.parametrize("algorithm, stages, m", [("pipedream", 2, 4), ("2bw", 3, 4), ("pipedream", 3, 2)])
def test_a_synchronous_checkpoint_loads_into_an_asynchronous_algorithm(algorithm, stages, m):
    """The target continues exactly as the same pipeline built on a model holding the checkpoint's weights and
    given the checkpoint's momentum in its own layout."""
    state = trained_source("sgd").state_dict()
    target = Pipeline(mlp(seed=7), stages, algorithm, m, optimizer=ours("sgd"), loss_fn=nn.CrossEntropyLoss())
    target.load_state_dict(state)
    assert_same_by_name(target.state_dict(), state, mlp())

    model = mlp(seed=9)
    model.load_state_dict(checkpoint.model_state_dict(state))
    reference = Pipeline(model, stages, algorithm, m, optimizer=ours("sgd"), loss_fn=nn.CrossEntropyLoss())
    own = reference.state_dict()
    pieces = parameter_states(state["pipecore"], canonical_names(mlp()))
    for s, st in reference.stages.items():
        sm = own["pipecore"]["stages"][s]
        sm["optimizer"]["momentum_buf"] = torch.cat([pieces[n].optimizer["momentum_buf"].reshape(-1)
                                                     for n in st.layout.names])
        sm["optimizer"]["steps"] = 3 * 4  # 1f1b updated once per mini-batch; the count only marks "not the first"
        sm["version"] = sm["updates"] = 3
    reference.load_state_dict(own)
    for x, y in data(4, seed=2):
        assert target.step(x, y) == reference.step(x, y)
    target.flush()
    reference.flush()
    got, want = target.state_dict(), reference.state_dict()
    assert_same(weights(got), weights(want))
    assert not torch.equal(got["0.weight"], state["0.weight"])


def test_asynchronous_state_is_mapped_or_dropped_with_a_note():
    """PipeMare keeps a weight velocity: a 1f1b checkpoint gives none (it starts at zero, noted); PipeMare's
    checkpoint loaded into 1f1b drops it (noted); between PipeMare pipelines it maps by name."""
    batches = data(3)
    pipemare = trained_source("sgd", "pipemare", batches=batches)
    saved = pipemare.state_dict()
    velocities = [sm["buffers"]["velocity"] for sm in saved["pipecore"]["stages"].values()]
    assert any(v.abs().sum() > 0 for v in velocities)

    into_1f1b = Pipeline(mlp(seed=7), 2, "1f1b", 4, optimizer=ours("sgd"), loss_fn=nn.CrossEntropyLoss())
    with pytest.warns(CheckpointNote, match="weight velocity is dropped"):
        into_1f1b.load_state_dict(saved)
    assert_same_by_name(into_1f1b.state_dict(), saved, mlp())

    into_pipemare = Pipeline(mlp(seed=7), 2, "pipemare", 4, optimizer=ours("sgd"), loss_fn=nn.CrossEntropyLoss())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        into_pipemare.load_state_dict(saved)
    got = into_pipemare.state_dict()
    model = mlp()
    velocities = {n: b["velocity"] for n, (_, b) in per_name(got, model).items()}
    assert all(torch.equal(velocities[n], b["velocity"]) for n, (_, b) in per_name(saved, model).items())

    with pytest.warns(CheckpointNote, match="holds no weight velocity; it starts at zero"):
        Pipeline(mlp(seed=7), 3, "pipemare", 4, optimizer=ours("sgd"),
                 loss_fn=nn.CrossEntropyLoss()).load_state_dict(trained_source("sgd").state_dict())


def test_weight_prediction_state_starts_at_zero_or_is_dropped_with_a_note():
    """SpecTrain predicts weights from the optimizer's update direction, which 1f1b does not keep."""
    plain = trained_source("sgd").state_dict()
    spectrain = Pipeline(mlp(seed=7), 2, "spectrain", 4, optimizer=ours("sgd"), loss_fn=nn.CrossEntropyLoss())
    with pytest.warns(CheckpointNote, match=r"holds no update direction \(of weight prediction\); it starts at zero"):
        spectrain.load_state_dict(plain)
    loaded = per_name(spectrain.state_dict(), mlp())
    for name, (opt, _) in per_name(plain, mlp()).items():  # the momentum maps; the direction starts at zero
        assert torch.equal(loaded[name][0]["momentum_buf"], opt["momentum_buf"])
        assert not loaded[name][1]["direction"].any()
    assert_same(dict(sorted(weights(spectrain.state_dict()).items())), dict(sorted(weights(plain).items())))
    for x, y in data(2, seed=4):
        spectrain.step(x, y)
    spectrain.flush()
    saved = spectrain.state_dict()
    back = Pipeline(mlp(seed=7), 3, "1f1b", 4, optimizer=ours("sgd"), loss_fn=nn.CrossEntropyLoss())
    with pytest.warns(CheckpointNote, match=r"update direction \(of weight prediction\) is dropped"):
        back.load_state_dict(saved)
    assert_same(dict(sorted(weights(back.state_dict()).items())), dict(sorted(weights(saved).items())))


def test_tied_weights_load_into_another_stage_count_and_continue_as_plain_training():
    """GPT's head is its token embedding: one parameter under two names, held by the first and last stages."""
    def gpt(seed: int) -> GPT:
        torch.manual_seed(seed)
        return GPT(vocab_size=11, block_size=6, n_layer=3, n_head=2, n_embd=8).double()

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 11, (8, 6), generator=g), torch.randint(0, 11, (8, 6), generator=g))
               for _ in range(5)]

    def loss_fn(logits, target):
        return nn.functional.cross_entropy(logits.reshape(-1, 11), target.reshape(-1))

    source = Pipeline(gpt(0), 4, "1f1b", 4, optimizer=ours("adamw"), loss_fn=loss_fn)
    for x, y in batches[:2]:
        source.step(x, y)
    state = source.state_dict()
    assert source.ties  # the head is tied to the embedding across stages
    target = Pipeline(gpt(5), 2, "1f1b", 2, optimizer=ours("adamw"), loss_fn=loss_fn)
    target.load_state_dict(state)
    assert_same_by_name(target.state_dict(), state, gpt(0))
    for x, y in batches[2:]:
        target.step(x, y)
    model, optimizer = plain_copy(state, gpt(9), "adamw")
    assert model.head.weight is model.tok_emb.weight
    train_plain(model, optimizer, batches[2:], 2, loss_fn)
    assert_close_to(target, model)


def test_load_model_weights_fills_a_plain_module(tmp_path):
    source = trained_source("sgd", "pipedream")
    state = source.state_dict()
    checkpoint.save(source, tmp_path / "dir")
    torch.save(state, tmp_path / "state.pt")
    torch.save({"pipeline": state, "epoch": 1, "args": {}}, tmp_path / "train.pt")  # as `pipecore train --save`
    for path in (tmp_path / "dir", tmp_path / "state.pt", tmp_path / "train.pt"):
        model = checkpoint.load_model_weights(path, mlp(seed=5))
        assert_same(dict(model.state_dict()), weights(state))

    with pytest.raises(ValueError, match=r"missing from the checkpoint \['12.weight', '12.bias'\], not in the model "
                                         r"\[\]"):
        checkpoint.load_model_weights(tmp_path / "state.pt", nn.Sequential(*mlp(), nn.Tanh(), nn.Linear(3, 2)))
    smaller = nn.Sequential(*list(mlp())[:9]).double()
    with pytest.raises(ValueError, match=r"not in the model \['10.weight', '10.bias'\]"):
        checkpoint.load_model_weights(tmp_path / "state.pt", smaller)
    checkpoint.load_model_weights(tmp_path / "state.pt", smaller, strict=False)
    assert torch.equal(smaller[8].weight, state["8.weight"])
    with pytest.raises(ValueError, match="is not a pipecore checkpoint"):
        torch.save({"0.weight": torch.zeros(1)}, tmp_path / "plain.pt")
        checkpoint.load_model_weights(tmp_path / "plain.pt", mlp())


def test_checkpoint_directories_load_into_another_stage_count(tmp_path):
    source = trained_source("adamw", "pipedream")
    checkpoint.save(source, tmp_path)
    target = Pipeline(mlp(seed=3), 2, "1f1b", 2, optimizer=ours("adamw"), loss_fn=nn.CrossEntropyLoss())
    checkpoint.load(target, tmp_path)
    assert_same_by_name(target.state_dict(), source.state_dict(), mlp())


def test_format_1_states_load_into_the_same_layout_and_name_their_version_otherwise():
    source = trained_source("sgd")
    old = source.state_dict()
    del old["pipecore"]["format"]
    for sm in old["pipecore"]["stages"].values():
        del sm["params"]
    same = Pipeline(mlp(seed=3), 4, "1f1b", 4, optimizer=ours("sgd"), loss_fn=nn.CrossEntropyLoss())
    same.load_state_dict(old)
    assert_same(weights(same.state_dict()), weights(source.state_dict()))
    other = Pipeline(mlp(seed=3), 2, "1f1b", 4, optimizer=ours("sgd"), loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="state format 1, which does not name the parameters"):
        other.load_state_dict(old)


def test_mismatches_are_clear_errors():
    state = trained_source("sgd").state_dict()
    adamw = Pipeline(mlp(), 2, "1f1b", 4, optimizer=ours("adamw"), loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(KeyError, match="has no 'exp_avg'.*saved with another optimizer"):
        adamw.load_state_dict(state)
    plain = Pipeline(mlp(), 2, "1f1b", 4, optimizer=ours("sgd"), loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(KeyError, match="plain model's state_dict"):
        plain.load_state_dict(mlp().state_dict())
    wider = nn.Sequential(*list(mlp())[:10], nn.Linear(6, 4)).double()
    with pytest.raises(ValueError, match=r"10.weight .*\(3, 6\).*\(4, 6\)"):
        Pipeline(wider, 2, "1f1b", 4, optimizer=ours("sgd"), loss_fn=nn.CrossEntropyLoss()).load_state_dict(state)
    # A failed load changed nothing.
    before = adamw.state_dict()
    assert_same(weights(before), weights(Pipeline(mlp(), 2, "1f1b", 4, optimizer=ours("adamw"),
                                                  loss_fn=nn.CrossEntropyLoss()).state_dict()))


@pytest.mark.parametrize("same_layout", [True, False], ids=["same-layout", "by-name"])
def test_a_checkpoint_refused_at_a_later_stage_leaves_every_stage_as_it_was(same_layout):
    """Every stage's state is checked before any stage loads: a checkpoint whose last stage's optimizer state is
    wrong (a moment of another size) changes no stage, weights, versions and optimizer state included."""
    saved = trained_source("adamw").state_dict()
    last = max(saved["pipecore"]["stages"])
    entry = saved["pipecore"]["stages"][last]
    entry["optimizer"]["exp_avg_sq"] = entry["optimizer"]["exp_avg_sq"][:-1].clone()
    if not same_layout:
        saved["pipecore"]["algorithm"] = "gpipe"  # another algorithm: loaded by parameter name
    target = Pipeline(mlp(seed=7), 4, "1f1b", 4, optimizer=ours("adamw"), loss_fn=nn.CrossEntropyLoss())
    for x, y in data(2, seed=3):
        target.step(x, y)
    target.flush()
    before = target.state_dict()
    with pytest.raises((ValueError, KeyError), match="exp_avg_sq"):
        target.load_state_dict(saved)
    assert_same(target.state_dict(), before)


def test_optimizer_state_this_optimizer_does_not_keep_is_dropped_with_a_note():
    """NAdam's running product of momentum coefficients has no place in AdamW: loaded by name, the moments map
    and the product is dropped, with a note that names it."""
    source = Pipeline(mlp(), 4, "1f1b", 4, optimizer=pipecore.NAdam(lr=0.01), loss_fn=nn.CrossEntropyLoss())
    for x, y in data(2):
        source.step(x, y)
    source.flush()
    target = Pipeline(mlp(seed=7), 2, "1f1b", 4, optimizer=ours("adamw"), loss_fn=nn.CrossEntropyLoss())
    with pytest.warns(CheckpointNote, match="optimizer state 'mu_product' is dropped"):
        target.load_state_dict(source.state_dict())
    for name, (opt, _) in per_name(source.state_dict(), mlp()).items():
        loaded = per_name(target.state_dict(), mlp())[name][0]
        assert torch.equal(loaded["exp_avg"], opt["exp_avg"]) and torch.equal(loaded["exp_avg_sq"], opt["exp_avg_sq"])
