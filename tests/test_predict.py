"""Evaluation through the pipeline: ``pipe.predict(x)``, ``pipe.eval()``, ``pipe.train()`` (CPU, float64 where
exactness is the point). The multi-process cases launch ranks with ``tests/dist_run.py`` (mode ``predict``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pipecore
from pipecore.models import GPT, Encoder, ResNet

sys.path.insert(0, str(Path(__file__).parent))
import dist_run  # noqa: E402
from _ranks import launch_ranks  # noqa: E402
from _same import assert_same  # noqa: E402

M = 4


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3)).double()


def regularised() -> nn.Sequential:
    """BatchNorm (running statistics in buffers) and dropout (random draws) in every stage."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3)).double()


def batch_norm_only() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8),
                         nn.Tanh(), nn.Linear(8, 3)).double()


def data(steps: int, seed: int = 1, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))
            for _ in range(steps)]


def probe(n: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(n, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def pipeline(model: nn.Module, stages: int, algorithm: str, **kwargs: Any) -> pipecore.Pipeline:
    return pipecore.Pipeline(model, stages, algorithm, M, optimizer=pipecore.SGD(lr=0.1, momentum=0.9),
                             loss_fn=nn.CrossEntropyLoss(), **kwargs)


def model_state(pipe: pipecore.Pipeline) -> dict[str, torch.Tensor]:
    return {k: v for k, v in pipe.state_dict().items() if k != "pipecore"}


def reference(build: Any, state: dict[str, torch.Tensor], training: bool = False) -> nn.Module:
    model = build()
    model.load_state_dict(state)
    return model.train(training)


def chunked(module: nn.Module, x: Any) -> Any:
    """``module`` on ``x`` (a tensor or a dict of tensors) split as predict splits it (``min(M, samples)``
    micro-batches, ``torch.tensor_split``), its outputs concatenated, under no_grad. Row for row, the same
    arithmetic as predict's: a full-batch forward can differ in the last bit (a matrix product of a few rows,
    or of one, takes other kernels), so exactness is checked against this, closeness against the full batch."""
    samples = len(next(iter(x.values())) if isinstance(x, dict) else x)
    with torch.no_grad():
        if isinstance(x, dict):
            parts = {k: v.tensor_split(min(M, samples)) for k, v in x.items()}
            outs = [module(**{k: p[u] for k, p in parts.items()}) for u in range(min(M, samples))]
        else:
            outs = [module(part) for part in x.tensor_split(min(M, samples))]
        if isinstance(outs[0], dict):
            return {k: torch.cat([o[k] for o in outs]) for k in outs[0]}
        return torch.cat(outs)


def full_batch(module: nn.Module, x: Any) -> torch.Tensor:
    with torch.no_grad():
        return module(**x) if isinstance(x, dict) else module(x)


def check(got: torch.Tensor, module: nn.Module, x: Any) -> None:
    """``got`` is ``module``'s output on ``x``: bit for bit as predict splits ``x``, and to rounding on the whole."""
    assert torch.equal(got, chunked(module, x))
    torch.testing.assert_close(got, full_batch(module, x), rtol=0, atol=1e-12)


def live_state(pipe: pipecore.Pipeline) -> dict[str, torch.Tensor]:
    """Every stage's newest weights (and buffers), without a flush."""
    state: dict[str, torch.Tensor] = {}
    for st in pipe.stages.values():
        state.update(st.module_state())
    return state


# -- the output -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["gpipe", "1f1b", "pipedream", "2bw"])
def test_predict_equals_the_model_on_the_pipelines_weights(algorithm: str) -> None:
    pipe = pipeline(mlp(), 3, algorithm)
    for x, y in data(3):
        pipe.step(x, y)
    pipe.flush()
    ref = reference(mlp, model_state(pipe))
    assert not torch.equal(ref[0].weight, mlp()[0].weight)  # it trained
    # Divisible, uneven (37 = 10 + 9 + 9 + 9) and fewer samples than micro-batches (one micro-batch each).
    for n in (8, 37, 3, 1):
        x = probe(n)
        got = pipe.predict(x)
        assert got.shape == (n, 3) and got.dtype == torch.float64 and not got.requires_grad
        check(got, ref, x)


@pytest.mark.parametrize("algorithm", ["pipedream", "2bw"])
def test_predict_reads_the_live_weights_with_microbatches_in_flight(algorithm: str) -> None:
    pipe = pipeline(mlp(), 3, algorithm)
    for x, y in data(3):
        pipe.step(x, y)
    assert pipe.in_flight > 0
    x = probe(13)
    got = pipe.predict(x)
    check(got, reference(mlp, live_state(pipe)), x)
    # What the first stage's oldest weights still held (a stale version a forward may read) would give.
    stage0 = pipe.stages[0]
    oldest = min(stage0.book.held)
    assert oldest < stage0.book.live
    stale = {**live_state(pipe), **{k: v.clone() for k, v in stage0.layout.views(stage0.slot_of(oldest)).items()}}
    assert not torch.allclose(got, chunked(reference(mlp, stale), x))


def test_stages_on_listed_devices_and_without_stage_threads() -> None:
    for kwargs in ({"devices": ["cpu", "cpu"]}, {"devices": "cpu", "concurrent": False}):
        pipe = pipeline(mlp(), 2, "1f1b", **kwargs)
        for x, y in data(2):
            pipe.step(x, y)
        x = probe(10)
        check(pipe.predict(x), reference(mlp, model_state(pipe)), x)


def test_a_gpt_with_a_tied_head() -> None:
    def gpt() -> GPT:
        torch.manual_seed(0)
        return GPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16).double()

    def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    pipe = pipecore.Pipeline(gpt(), 2, "1f1b", M, optimizer=pipecore.SGD(lr=0.1), loss_fn=lm_loss)
    assert pipe.ties  # the head (last stage) and the token embedding (first stage) share a weight
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        idx = torch.randint(0, 16, (8, 9), generator=g)
        pipe.step(idx[:, :-1], idx[:, 1:])
    state = model_state(pipe)
    assert torch.equal(state["tok_emb.weight"], state["head.weight"])
    x = torch.randint(0, 16, (6, 8), generator=g)
    got = pipe.predict(x)
    assert got.shape == (6, 8, 16)
    check(got, reference(gpt, state), x)
    assert torch.equal(pipe.predict((x,)), got) and torch.equal(pipe.predict({"idx": x}), got)


def test_a_model_with_two_inputs_given_as_a_dict_or_a_tuple() -> None:
    def encoder() -> Encoder:
        torch.manual_seed(0)
        return Encoder(13, 6, 3, n_layer=2, n_head=2, n_embd=8).double()

    pipe = pipeline(encoder(), 2, "pipedream")
    g = torch.Generator().manual_seed(2)

    def inputs(n: int) -> dict[str, torch.Tensor]:
        lengths = torch.randint(1, 7, (n,), generator=g)
        tokens = torch.randint(0, 13, (n, 6), generator=g)
        return {"tokens": tokens, "mask": torch.arange(6)[None, :] < lengths[:, None]}

    for _ in range(2):
        pipe.step(inputs(8), torch.randint(0, 3, (8,), generator=g))
    x = inputs(11)
    got = pipe.predict(x)
    check(got, reference(encoder, live_state(pipe)), x)
    assert torch.equal(pipe.predict((x["tokens"], x["mask"])), got)


class _TwoHeads(nn.Module):
    """A model whose output is a structure: a dict holding a tensor and a tuple of a tensor and None."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.classes = nn.Linear(8, 3)
        self.score = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = self.body(x)
        return {"logits": self.classes(h), "extra": (self.score(h), None)}


def test_structured_outputs_are_concatenated_entry_by_entry() -> None:
    def two_heads() -> _TwoHeads:
        torch.manual_seed(0)
        return _TwoHeads().double()

    pipe = pipecore.Pipeline(two_heads(), 2, "gpipe", M, optimizer=pipecore.SGD(lr=0.1),
                             loss_fn=lambda out, y: nn.functional.cross_entropy(out["logits"], y))
    for x, y in data(2):
        pipe.step(x, y)
    x = probe(9)
    got = pipe.predict(x)
    assert list(got) == ["logits", "extra"] and isinstance(got["extra"], tuple) and got["extra"][1] is None
    ref = reference(two_heads, model_state(pipe))
    with torch.no_grad():
        outs = [ref(part) for part in x.tensor_split(M)]
    assert torch.equal(got["logits"], torch.cat([o["logits"] for o in outs]))
    assert torch.equal(got["extra"][0], torch.cat([o["extra"][0] for o in outs]))


# -- no side effects ------------------------------------------------------------------------------------


def _train(build: Any, algorithm: str, with_predict: bool, **kwargs: Any) -> tuple[list[float], dict, list]:
    """Six steps (micro-batches in flight between them for asynchronous algorithms), then a flush; with
    ``with_predict``, predictions in training mode and in evaluation mode between the steps."""
    torch.manual_seed(123)  # dropout's draws
    pipe = pipeline(build(), 2, algorithm, **kwargs)
    losses, predictions = [], []
    for i, (x, y) in enumerate(data(6)):
        losses.append(pipe.step(x, y))
        if with_predict:
            in_flight, stats = pipe.in_flight, pipe.stats()  # (these wait for overlapped steps' stage threads)
            rng = torch.get_rng_state()
            buffers = {k: v.clone() for k, v in live_state(pipe).items()}
            # Training mode (batch statistics: at least 2 samples per micro-batch), then evaluation mode.
            predictions.append(pipe.predict(probe(8 + 2 * i)))
            predictions.append(pipe.eval().predict(probe(8 + 2 * i)))
            pipe.train()
            assert torch.equal(torch.get_rng_state(), rng)
            assert_same(live_state(pipe), buffers, "weights and buffers after predict")
            assert pipe.in_flight == in_flight
            assert_same(pipe.stats(), stats, "stats after predict")
    pipe.flush()
    return losses, pipe.state_dict(), predictions


@pytest.mark.parametrize("algorithm", ["gpipe", "pipedream"])
def test_predict_leaves_training_bit_identical(algorithm: str) -> None:
    """BatchNorm's running statistics and dropout's random draws in training mode, the schedule's micro-batches
    in flight: training with predictions in between equals training without them, bit for bit."""
    plain_losses, plain_state, _ = _train(regularised, algorithm, False, concurrent=False)
    losses, state, predictions = _train(regularised, algorithm, True, concurrent=False)
    assert losses == plain_losses
    assert_same(state, plain_state)
    # Training mode and evaluation mode differ (dropout, batch statistics), so both were exercised.
    assert all(not torch.equal(a, b) for a, b in zip(predictions[::2], predictions[1::2]))


def test_predict_leaves_overlapped_steps_bit_identical() -> None:
    plain_losses, plain_state, _ = _train(batch_norm_only, "pipedream", False, overlap_steps=True)
    losses, state, _ = _train(batch_norm_only, "pipedream", True, overlap_steps=True)
    assert losses == plain_losses
    assert_same(state, plain_state)


def test_predict_with_overlapped_steps_waits_for_the_stage_threads() -> None:
    """Right after step() returns, the stage threads may still be updating; predict sees their results."""
    pipe = pipeline(mlp(), 3, "gpipe", overlap_steps=True)
    x = probe(8)
    for xb, yb in data(3):
        pipe.step(xb, yb)
        check(pipe.predict(x), reference(mlp, model_state(pipe)), x)


# -- modes ---------------------------------------------------------------------------------------------------


def test_eval_and_train_switch_every_stage_module() -> None:
    pipe = pipeline(regularised(), 3, "1f1b", concurrent=False)
    for x, y in data(3):
        pipe.step(x, y)

    def modes() -> set[bool]:
        return {m.training for st in pipe.stages.values() for m in st.module.modules()} | {pipe.model.training}

    assert pipe.training is True and modes() == {True}
    assert pipe.eval() is pipe
    assert pipe.training is False and modes() == {False}
    x = probe(12)
    got = pipe.predict(x)
    assert torch.equal(pipe.predict(x), got)  # deterministic: no dropout, running statistics
    check(got, reference(regularised, model_state(pipe)), x)
    # Training in evaluation mode works (BatchNorm with running statistics, as in torch) and changes no mode.
    pipe.step(*data(1, seed=9)[0])
    assert pipe.training is False and modes() == {False}
    assert pipe.train() is pipe
    assert pipe.training is True and modes() == {True}
    assert not torch.equal(pipe.predict(x), pipe.eval().predict(x))
    assert pipe.train(False) is pipe and pipe.training is False
    with pytest.raises(TypeError, match="mode must be True or False, got 1"):
        pipe.train(1)  # type: ignore[arg-type]


def test_a_resnet_in_eval_mode_equals_the_module_in_eval_mode() -> None:
    def resnet() -> ResNet:
        torch.manual_seed(0)
        return ResNet(width=4, blocks=3).double()

    pipe = pipeline(resnet(), 3, "2bw")
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        pipe.step(torch.randn(8, 64, generator=g, dtype=torch.float64), torch.randint(0, 10, (8,), generator=g))
    pipe.flush()
    x = torch.randn(10, 64, generator=g, dtype=torch.float64)
    check(pipe.eval().predict(x), reference(resnet, model_state(pipe)), x)


# -- errors -----------------------------------------------------------------------------------------------


def test_bad_calls_say_what_was_wrong() -> None:
    pipe = pipeline(mlp(), 2, "1f1b")
    with pytest.raises(TypeError, match="x is required on the rank that runs the first stage, got None"):
        pipe.predict(None)
    with pytest.raises(TypeError, match="x has 2 values but the model's forward takes 1 argument"):
        pipe.predict((probe(4), probe(4)))
    with pytest.raises(KeyError, match="x has \\['inputs'\\] but the model's forward takes \\['input'\\]"):
        pipe.predict({"inputs": probe(4)})
    with pytest.raises(TypeError, match="x must be a tensor, a tuple or a dict of tensors, got str"):
        pipe.predict("x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="input 'input' must be a tensor, got list"):
        pipe.predict([[1.0] * 6])
    with pytest.raises(ValueError, match="x holds no samples"):
        pipe.predict(probe(0))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
        pipe.predict(torch.zeros(4, 5, dtype=torch.float64))
    assert "raised by stage 0's forward, given the input micro-batch of shape (1, 5)" in info.value.__notes__[0]
    with pytest.raises(TypeError, match="broadcast must be True or False, got 'yes'"):
        pipe.predict(probe(4), broadcast="yes")  # type: ignore[arg-type]
    pipe.close()
    with pytest.raises(RuntimeError, match="predict\\(\\): this pipeline was closed"):
        pipe.predict(probe(4))


class _Mean(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean()


def test_an_output_without_samples_cannot_be_concatenated() -> None:
    pipe = pipecore.Pipeline(nn.Sequential(nn.Linear(6, 3), nn.Linear(3, 3), _Mean()).double(), 2, "gpipe", M,
                             loss_fn=lambda out, y: out)
    with pytest.raises(ValueError, match="0-dimensional tensor, which has no samples to concatenate"):
        pipe.predict(probe(8))


# -- one process per stage -----------------------------------------------------------------------------


def test_two_ranks_predict_like_one_process_and_train_on_unchanged(tmp_path: Path) -> None:
    """Rank 1 (the last) returns the prediction, rank 0 None; with broadcast=True both get it. Predictions
    between steps (micro-batches in flight for pipedream and 2bw) equal the one-process pipeline's and the
    module's, and the training around them equals one-process training without any prediction, bit for bit."""
    results = launch_ranks(str(Path(__file__).parent / "dist_run.py"), 2, "predict", str(tmp_path), timeout=240)
    for r in results:
        assert r.returncode == 0, r.stdout
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks
    try:
        for case in dist_run.PREDICT_CASES:
            parts = [torch.load(tmp_path / f"predict-{case}-{rank}.pt") for rank in range(2)]
            # One process: the same steps with predictions at the same points ...
            pipe, batches, inputs = dist_run.predict_case(2, case)
            expected = []
            for i, (x, y) in enumerate(batches):
                pipe.step(x, y)
                expected.append(pipe.predict(inputs(i)))
                if case != "gpt":  # (the GPT's tied copies may differ in flight: no one module holds both)
                    check(expected[-1], reference(lambda: dist_run.make_model(2), live_state(pipe)), inputs(i))
            pipe.flush()
            # ... and without any prediction.
            plain, batches, _ = dist_run.predict_case(2, case)
            losses = dist_run.train(plain, batches, True, True)
            state = plain.state_dict()
            assert parts[0]["last"] == [None] * dist_run.STEPS
            for rank, part in enumerate(parts):
                assert part["losses"] == losses, (case, rank)
                for key, value in part["state"].items():
                    if key != "pipecore":
                        assert torch.equal(value, state[key]), (case, rank, key)
                assert len(part["broadcast"]) == dist_run.STEPS
                for got, want in zip(part["broadcast"], expected):
                    assert torch.equal(got, want), (case, rank)
            assert len(parts[1]["last"]) == dist_run.STEPS
            for got, want in zip(parts[1]["last"], expected):
                assert torch.equal(got, want), case
        # Ranks that disagree on broadcast (rank 0 True, rank 1 False): both follow rank 0's, rank 1 says so
        # afterwards, and training goes on (`pipe` is the last case's, flushed, as on the ranks).
        mismatch = [torch.load(tmp_path / f"predict-mismatch-{rank}.pt") for rank in range(2)]
        assert mismatch[1]["mismatch"] == ("predict(): rank 1 passed broadcast=False but rank 0 passed broadcast=True; "
                                           "every rank must pass the same (this rank followed rank 0's)")
        assert mismatch[0]["mismatch"] is None
        assert torch.equal(mismatch[0]["mismatched"], pipe.predict(inputs(dist_run.STEPS)))
        losses = dist_run.train(pipe, batches[:1], True, True)
        assert mismatch[0]["losses"] == mismatch[1]["losses"] == losses
    finally:
        torch.set_num_threads(threads)
