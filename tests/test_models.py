"""The reference models (GPT, ResNet, Encoder) and the character-level corpus of ``pipecore.models``."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from pipecore.models import GPT, CharData, Encoder, ResNet, batches, load_char_data, load_text_corpus, windows
from pipecore.models.text import UNKNOWN

VOCAB, BLOCK = 13, 8


def tiny_gpt(seed: int = 0, **kwargs) -> GPT:
    torch.manual_seed(seed)
    return GPT(VOCAB, BLOCK, **{"n_layer": 2, "n_head": 2, "n_embd": 16, **kwargs}).double()


def tiny_encoder(seed: int = 0) -> Encoder:
    torch.manual_seed(seed)
    return Encoder(VOCAB, BLOCK, num_classes=3, n_layer=3, n_head=2, n_embd=16).double()


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (3, BLOCK), generator=g)
    lengths = torch.tensor([BLOCK, 5, 1])  # full, partly padded, a single real token
    mask = torch.arange(BLOCK).unsqueeze(0) < lengths.unsqueeze(1)
    return tokens, mask


# --- GPT ---------------------------------------------------------------------------------------------------


def test_gpt_shape_shorter_sequences_and_deterministic_init():
    model = tiny_gpt()
    for T in (BLOCK, 3):
        assert model(torch.randint(0, VOCAB, (2, T))).shape == (2, T, VOCAB)
    again = tiny_gpt()
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    assert not any(True for _ in model.buffers())  # no buffers: parameters are the whole state


def test_gpt_is_causal_float64():
    model = tiny_gpt().eval()
    idx = torch.randint(0, VOCAB, (2, BLOCK), generator=torch.Generator().manual_seed(0))
    base = model(idx)
    for t in range(BLOCK):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % VOCAB
        out = model(changed)
        assert torch.equal(out[:, :t], base[:, :t]), f"changing token {t} changed an earlier position"
        assert not torch.allclose(out[:, t], base[:, t]), f"changing token {t} did not change position {t}"


def test_gpt_head_is_tied_to_token_embedding_and_both_gradients_add():
    model = tiny_gpt()
    assert model.head.weight is model.tok_emb.weight
    names = [name for name, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "head.weight" not in names  # one Parameter, listed once
    idx = torch.randint(0, VOCAB, (2, BLOCK), generator=torch.Generator().manual_seed(0))
    model(idx).square().sum().backward()
    tied_grad = model.tok_emb.weight.grad

    # The same forward with the two uses given separate copies: the tied gradient is their sum.
    w_emb = model.tok_emb.weight.detach().clone().requires_grad_()
    w_head = model.tok_emb.weight.detach().clone().requires_grad_()
    out = torch.func.functional_call(model, {"tok_emb.weight": w_emb, "head.weight": w_head}, (idx,), tie_weights=False)
    out.square().sum().backward()
    assert w_emb.grad.abs().sum() > 0 and w_head.grad.abs().sum() > 0
    torch.testing.assert_close(tied_grad, w_emb.grad + w_head.grad, rtol=1e-12, atol=1e-14)


def test_gpt_float64_backward_reaches_every_parameter():
    model = tiny_gpt()
    model(torch.randint(0, VOCAB, (2, BLOCK))).logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float64 and p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_gpt_traced_graph_calls_the_named_submodules():
    traced = fx.symbolic_trace(tiny_gpt())
    called = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    assert called[:2] == ["tok_emb", "pos_emb"] and called[-2:] == ["ln_f", "head"]
    assert {"blocks.0.attn.qkv", "blocks.1.mlp.fc"} <= set(called)
    assert not [n for n in traced.graph.nodes if n.op == "get_attr"]  # no buffers or bare tensors in the graph


# --- fx tracing, all three models --------------------------------------------------------------------------


def _gpt_case():
    return tiny_gpt(), (torch.randint(0, VOCAB, (2, BLOCK), generator=torch.Generator().manual_seed(0)),)


def _resnet_case():
    torch.manual_seed(0)
    return ResNet(width=4).double(), (torch.randn(5, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64),)


def _encoder_case():
    return tiny_encoder(), padded_batch()


@pytest.mark.parametrize("case", [_gpt_case, _resnet_case, _encoder_case], ids=["gpt", "resnet", "encoder"])
def test_fx_traced_model_equals_eager_in_float64(case):
    model, inputs = case()
    model.eval()  # ResNet: eval-mode BatchNorm, so the two runs do not update shared running statistics
    traced = fx.symbolic_trace(model)
    eager_out = model(*inputs)
    traced_out = traced(*inputs)
    assert eager_out.dtype == torch.float64 and torch.equal(traced_out, eager_out)

    eager_grads = torch.autograd.grad(eager_out.square().sum(), list(model.parameters()))
    traced_grads = torch.autograd.grad(traced_out.square().sum(), list(traced.parameters()))
    for a, b in zip(eager_grads, traced_grads):
        assert torch.equal(a, b)


# --- ResNet -----------------------------------------------------------------------------------------------


def test_resnet_takes_flat_digits_features_and_images():
    from pipecore.cli.tasks import load_data

    torch.manual_seed(0)
    model = ResNet().eval()
    x = load_data(seed=0).x_test[:6]
    assert x.shape == (6, 64)
    logits = model(x)
    assert logits.shape == (6, 10)
    assert torch.equal(model(x.view(6, 1, 8, 8)), logits)
    assert isinstance(model.blocks[1].skip, nn.Sequential) and model.blocks[0].skip is None  # one downsampling block


def test_resnet_batchnorm_running_stats_update_in_train_mode_only():
    torch.manual_seed(0)
    model = ResNet(width=4)
    bn = model.blocks[1].bn1
    before = (bn.running_mean.clone(), bn.running_var.clone())
    x = torch.randn(8, 64) * 3 + 1
    model.eval()
    model(x)
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])
    model.train()
    model(x)
    assert not torch.equal(bn.running_mean, before[0]) and not torch.equal(bn.running_var, before[1])
    assert int(bn.num_batches_tracked) == 1


# --- Encoder ----------------------------------------------------------------------------------------------


def test_encoder_ignores_padded_tokens_but_not_real_ones():
    model = tiny_encoder().eval()
    tokens, mask = padded_batch()
    base = model(tokens, mask)
    assert base.shape == (3, 3) and torch.isfinite(base).all()

    other_padding = torch.where(mask, tokens, (tokens + 1 + torch.arange(BLOCK)) % VOCAB)
    assert not torch.equal(other_padding, tokens)
    assert torch.equal(model(other_padding, mask), base)

    # Changing the first real token of each row changes each row's output.
    changed = tokens.clone()
    changed[:, 0] = (changed[:, 0] + 1) % VOCAB
    out = model(changed, mask)
    for row in range(3):
        assert not torch.allclose(out[row], base[row]), row

    # The mask is not just ignored: reading padding as real tokens changes the padded rows.
    unmasked = model(tokens, torch.ones_like(mask))
    assert torch.equal(unmasked[0], base[0]) and not torch.allclose(unmasked[1:], base[1:])


def test_encoder_mask_reaches_every_block():
    model = tiny_encoder()
    traced = fx.symbolic_trace(model)
    (mask,) = [n for n in traced.graph.nodes if n.op == "placeholder" and n.target == "mask"]

    def reads_mask(node: fx.Node) -> bool:
        seen, todo = set(), [node]
        while todo:
            n = todo.pop()
            if n is mask:
                return True
            if n not in seen:
                seen.add(n)
                todo.extend(n.all_input_nodes)
        return False

    masked = [n for n in traced.graph.nodes if n.op == "call_method" and n.target == "masked_fill"]
    assert len(masked) == len(model.blocks) and all(reads_mask(n) for n in masked)
    # Each masked_fill sits between that block's qkv projection and its output projection.
    order = {n: i for i, n in enumerate(traced.graph.nodes)}
    for b, node in enumerate(masked):
        (qkv,) = [n for n in traced.graph.nodes if n.target == f"blocks.{b}.attn.qkv"]
        (proj,) = [n for n in traced.graph.nodes if n.target == f"blocks.{b}.attn.proj"]
        assert order[qkv] < order[node] < order[proj]
    assert any(n.op == "call_method" and n.target == "to" for n in mask.users)  # and the pooling reads it


# --- character data -----------------------------------------------------------------------------------------


def test_corpus_is_deterministic_and_large():
    text = load_text_corpus()
    assert text == load_text_corpus() and len(text) > 100_000
    assert load_text_corpus(max_chars=1000) == text[:1000]


@pytest.fixture(scope="module")
def char_data() -> CharData:
    return load_char_data(block_size=16)


def test_char_data_split_is_90_10_and_round_trips(char_data):
    text = load_text_corpus()
    n_test = int(len(text) * 0.1)
    assert len(char_data.test) == n_test and len(char_data.train) == len(text) - n_test
    assert char_data.train.dtype == torch.int64 and char_data.test.dtype == torch.int64
    assert char_data.vocab[0] == UNKNOWN and len(set(char_data.vocab)) == char_data.vocab_size
    assert char_data.decode(char_data.train) == text[: len(text) - n_test]
    # The held-out tail decodes to its text, characters unseen in training read back as UNKNOWN.
    expected_test = "".join(ch if ch in char_data.vocab else UNKNOWN for ch in text[len(text) - n_test:])
    assert char_data.decode(char_data.test) == expected_test
    assert char_data.encode("\u2603").tolist() == [0]  # unseen character -> the reserved index 0


def test_unseen_test_characters_map_to_unknown():
    data = load_char_data(block_size=4, max_chars=200)  # small: the tail has characters the head lacks
    text = load_text_corpus(200)
    unseen = [i for i, ch in enumerate(text[len(data.train):]) if ch not in data.vocab]
    assert unseen and all(data.test[i] == 0 for i in unseen)
    assert (data.train != 0).all()


def test_batches_are_random_windows_shifted_by_one(char_data):
    data = char_data.train
    x, y = batches(data, 16, 5, torch.Generator().manual_seed(3))
    assert x.shape == y.shape == (5, 16) and x.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])
    x2, y2 = batches(data, 16, 5, torch.Generator().manual_seed(3))
    assert torch.equal(x, x2) and torch.equal(y, y2)
    # Each row pair is a contiguous slice of data: x, then y one character further.
    flat = data.unfold(0, 17, 1)  # every run of 17 consecutive characters
    for row_x, row_y in zip(x, y):
        window = torch.cat([row_x, row_y[-1:]])
        assert (flat == window).all(dim=1).any()


def test_windows_tile_the_held_out_text(char_data):
    data = char_data.test
    x, y = windows(data, 16)
    n = (len(data) - 1) // 16
    assert x.shape == y.shape == (n, 16)
    assert torch.equal(x.flatten(), data[: n * 16]) and torch.equal(y.flatten(), data[1: n * 16 + 1])
