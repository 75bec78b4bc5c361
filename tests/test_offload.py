"""Offloaded segments (pipecore.engine.offload): what moves, when, and that gradients do not change.

The runtime's link is CUDA's pinned host memory; on the CPU these tests give the segment a link that copies
within the CPU and records what it is asked, so that the segment's own logic (what it packs, when it lets go
of the device copy, when it brings it back, how it nests in the stage's hooks) is checked on any machine.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn

from _same import assert_same
from pipecore.engine.offload import HostLink, Offloaded, offload_segments
from pipecore.engine.saved import outer_hooks, saving


class RecordingLink:
    """A link within the CPU that records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __call__(self, device: torch.device) -> "RecordingLink":
        return self

    def to_host(self, data: torch.Tensor) -> torch.Tensor:
        self.calls.append(("to_host", data.numel()))
        return data.clone()

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        self.calls.append(("to_device", host.numel()))
        return host.clone(), "ready"

    def wait(self, ready: Any, data: torch.Tensor) -> None:
        assert ready == "ready"
        self.calls.append(("wait", data.numel()))


class Watched(nn.Module):
    """tanh, remembering (weakly) the storage of its output."""

    def __init__(self) -> None:
        super().__init__()
        self.storage: weakref.ref | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x)
        self.storage = weakref.ref(y.untyped_storage())
        return y


class Block(nn.Module):
    """``y`` (a tanh's output) is saved by tanh itself and by both products: one storage, saved three times."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 6, dtype=torch.float64)
        self.watched = Watched()
        self.w1 = nn.Parameter(torch.randn(6, dtype=torch.float64))
        self.w2 = nn.Parameter(torch.randn(6, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.watched(self.inner(x))
        return y * self.w1, (y * self.w2).exp()


class _KeepWatched(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, name: str) -> bool:
        return isinstance(m, Watched) or super().is_leaf_module(m, name)


def trace(block: nn.Module) -> fx.GraphModule:
    return fx.GraphModule(block, _KeepWatched().trace(block))


def segment() -> fx.GraphModule:
    torch.manual_seed(0)
    return trace(Block())


def gradients(module: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    x = x.clone().requires_grad_(True)
    a, b = module(x)
    (a.sum() + (b * b).sum()).backward()
    grads = [p.grad.clone() for p in module.parameters()]
    return grads, x.grad


def test_an_offloaded_segment_gives_the_plain_gradients_bit_for_bit() -> None:
    x = torch.randn(5, 6, dtype=torch.float64)
    plain = segment()
    offloaded = Offloaded(segment(), RecordingLink())
    expected, expected_dx = gradients(plain, x)
    got, got_dx = gradients(offloaded, x)
    assert all(torch.equal(g, e) for g, e in zip(got, expected)) and torch.equal(got_dx, expected_dx)


def test_each_saved_storage_moves_once_weights_stay_and_the_device_copy_is_let_go() -> None:
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    link = RecordingLink()
    module = Offloaded(segment(), link)
    a, b = module(x)
    watched = module.segment.watched
    # Saved: x (by the linear: an input the caller still holds), the tanh output (by tanh and both products),
    # and the exp's output; never the weights. Each storage moves once, whole (bytes: 5 x 6 x 8).
    moved = sorted(n for kind, n in link.calls if kind == "to_host")
    assert moved == [240, 240, 240] and all(kind == "to_host" for kind, _ in link.calls)
    # Nothing but the host copies keeps the tanh's output once the forward has ended.
    assert watched.storage() is None
    plain = segment()
    kept = plain(x)
    assert plain.watched.storage() is not None  # without offload the graph of ``kept`` keeps it
    del kept
    # The gradient reaching the outputs brings every storage back at once, before any node waits for one.
    (a.sum() + (b * b).sum()).backward()
    kinds = [kind for kind, _ in link.calls[3:]]
    assert kinds[:3] == ["to_device"] * 3 and kinds.count("wait") == 3 and len(kinds) == 6


def test_offload_wraps_the_hooks_around_it() -> None:
    """Saved weights the stage's hooks turn into references stay references; the rest reaches the stage's
    unpack hook restored."""
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    module = Offloaded(segment(), link := RecordingLink())
    weight = module.segment.w1
    swapped = torch.full_like(weight, 2.0)
    seen: list[Any] = []

    def pack(t: torch.Tensor) -> Any:
        seen.append(t)
        return "w1" if t is weight else t

    def unpack(packed: Any) -> torch.Tensor:
        return swapped if isinstance(packed, str) else packed

    with saving(pack, unpack):
        assert outer_hooks() == (pack, unpack)
        a, _ = module(x)
    assert outer_hooks()[0](x) is x  # outside: the identity
    assert any(t is weight for t in seen)
    a.sum().backward()
    # y * w1 differentiated with respect to y reads the substituted weight.
    y = torch.tanh(module.segment.inner(x.detach()))
    expected = torch.autograd.grad(y, module.segment.inner.weight, torch.ones_like(y) * swapped)[0]
    assert torch.equal(module.segment.inner.weight.grad, expected)
    assert [n for kind, n in link.calls if kind == "to_host"] == [240] * 3  # x, y, exp(...): not the weights


def test_offload_segments_rewrites_a_stage_module() -> None:
    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4, dtype=torch.float64)
            self.b = nn.Linear(4, 4, dtype=torch.float64)
            self.c = nn.Linear(4, 4, dtype=torch.float64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(torch.relu(self.b(torch.relu(self.a(x)))))

    torch.manual_seed(1)
    gm = fx.symbolic_trace(Chain())
    x = torch.randn(3, 4, dtype=torch.float64)
    expected = gm(x)
    names = [n.name for n in gm.graph.nodes if n.op in ("call_module", "call_function")]
    link = RecordingLink()
    offload_segments(gm, [names[1:4]], link)
    assert isinstance(gm.get_submodule("offloaded_0"), Offloaded)
    assert [n.name for n in gm.offloaded_0.segment.graph.nodes if n.op == "call_module"] == ["b"]
    assert torch.equal(gm(x), expected)
    with pytest.raises(ValueError, match="not a run"):
        offload_segments(fx.symbolic_trace(Chain()), [[names[0], names[2]]], link)


def test_the_host_link_is_for_cuda_devices_only() -> None:
    with pytest.raises(ValueError, match="not a CUDA device"):
        HostLink(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_host_link_moves_and_frees_on_cuda() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    block = Block().to(device)
    x = torch.randn(512, 6, dtype=torch.float64, device=device)
    plain = trace(block)
    expected, expected_dx = gradients(plain, x)
    for p in plain.parameters():
        p.grad = None
    module = Offloaded(plain)
    got, got_dx = gradients(module, x)
    assert all(torch.equal(g, e) for g, e in zip(got, expected)) and torch.equal(got_dx, expected_dx)


# -- a plan's offloaded segments in a pipeline ---------------------------------------------------------------


def gpt(dtype: torch.dtype = torch.float32) -> nn.Module:
    from pipecore.models import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=32, block_size=16, n_layer=4, n_head=2, n_embd=32).to(dtype)


def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def offloading_plan(model: nn.Module, algorithm: str, device: str) -> Any:
    """The parameter-balanced plan of ``model`` with the middle third of every stage's nodes offloaded (on a
    CPU profile the bandwidth is set by hand: the plan is then only for the checks that refuse it)."""
    import dataclasses

    import pipecore

    tokens = torch.randint(0, 32, (4, 16), device=device)
    plan = pipecore.plan(model, tokens, 4, algorithm, batch_size=16, n_microbatches=4, objective="parameters")
    if plan.costs.host_bytes_per_s == 0:
        plan = dataclasses.replace(plan, costs=dataclasses.replace(plan.costs, host_bytes_per_s=1e9))
    segments = tuple(((a + (b - a) // 3, a + 2 * (b - a) // 3),) for a, b in plan.bounds())
    return dataclasses.replace(plan, offloaded=segments)


def train_with_and_without(plan: Any, algorithm: str, device: str) -> None:
    """Four steps of ``plan`` (float64) and of the same cuts without its offloaded segments: losses and weights
    are equal, bit for bit."""
    import dataclasses

    import pipecore

    def train(p: Any) -> tuple[list[float], dict]:
        pipe = pipecore.Pipeline(gpt(torch.float64).to(device), 4, algorithm, 4, loss_fn=lm_loss, partition=p,
                                 recover=False, optimizer=pipecore.SGD(lr=0.1, momentum=0.9))
        g = torch.Generator().manual_seed(7)
        losses = [pipe.step(torch.randint(0, 32, (16, 16), generator=g).to(device),
                            torch.randint(0, 32, (16, 16), generator=g).to(device)) for _ in range(4)]
        pipe.flush()
        state = pipe.state_dict()
        pipe.close()
        return losses, state

    assert any(plan.offloaded)
    assert_same(train(plan), train(dataclasses.replace(plan, offloaded=tuple(() for _ in plan.offloaded))))


def test_a_pipeline_refuses_offload_on_cpu_stages() -> None:
    import pipecore

    plan = offloading_plan(gpt(), "1f1b", "cpu")
    with pytest.raises(ValueError, match="stage 0, which runs on cpu.*does not apply on the CPU"):
        pipecore.Pipeline(gpt(), 4, "1f1b", 4, loss_fn=lm_loss, partition=plan)
    with pytest.raises(ValueError, match="offloads segments.*'recompute' backward rule"):
        pipecore.Pipeline(gpt(), 4, "i-timeprest", 4, loss_fn=lm_loss, partition=plan, backward_rule="recompute")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("algorithm", ["1f1b", "pipedream", "2bw", "i-timeprest"])
def test_offloaded_segments_leave_training_unchanged_on_cuda(algorithm: str) -> None:
    """Offloading moves saved tensors and back, bit for bit (float64): losses and weights equal those of the
    same cuts without offload, under the stash rule and (i-timeprest) the swap rule."""
    device = f"cuda:{torch.cuda.current_device()}"
    plan = offloading_plan(gpt(torch.float64).to(device), algorithm, device)
    assert plan.costs.host_bytes_per_s > 0  # measured on the device
    train_with_and_without(plan, algorithm, device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offloaded_segments_lower_the_device_peak_on_cuda() -> None:
    """One stage holding four micro-batches (gpipe): offloading most of its nodes lowers the device's peak."""
    import dataclasses

    import pipecore

    device = f"cuda:{torch.cuda.current_device()}"
    tokens = torch.randint(0, 32, (64, 16), device=device)
    plan = pipecore.plan(gpt().to(device), tokens[:16], 1, "gpipe", batch_size=64, n_microbatches=4,
                         objective="parameters")
    n = len(plan.costs)
    offloaded = dataclasses.replace(plan, offloaded=(((1, n - 1),),))

    def peak(p: Any) -> int:
        pipe = pipecore.Pipeline(gpt().to(device), 1, "gpipe", 4, loss_fn=lm_loss, partition=p, recover=False)
        pipe.step(tokens, tokens)  # warm up (allocator, kernels)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        pipe.step(tokens, tokens)
        torch.cuda.synchronize()
        pipe.close()
        return torch.cuda.max_memory_allocated()

    assert peak(offloaded) < peak(plan)


@pytest.mark.parametrize("algorithm", ["1f1b", "pipedream", "2bw", "i-timeprest"])
def test_offloaded_segments_run_through_the_stage_hooks(algorithm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline path of offload on the CPU, with the link that copies within the CPU in place of CUDA's
    (the device check lifted): losses and weights equal those of the same cuts without offload, bit for bit
    (float64), under the stash rule and (i-timeprest) the swap rule, whose saved weights stay references."""
    from pipecore.engine import build

    link = RecordingLink()
    monkeypatch.setattr(HostLink, "of", classmethod(lambda cls, device: link))
    monkeypatch.setattr(build, "check_offload_devices", lambda plan, devices, owned: None)
    train_with_and_without(offloading_plan(gpt(torch.float64), algorithm, "cpu"), algorithm, "cpu")
    moved = sum(1 for kind, _ in link.calls if kind == "to_host")
    assert moved > 0 and moved == sum(1 for kind, _ in link.calls if kind == "to_device")


def test_an_in_place_change_of_a_saved_tensor_raises_as_without_offload() -> None:
    """Autograd checks a saved tensor's version when the backward unpacks it, but not for tensors hooks packed:
    the segment checks them itself when its forward ends, so that the change raises instead of giving a
    gradient of the changed values."""
    class InPlace(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = torch.tanh(x)  # saves its output
            b = a * 3
            a.mul_(2)
            return b + a

    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        fx.symbolic_trace(InPlace())(x).sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation inside an offloaded segment"):
        Offloaded(fx.symbolic_trace(InPlace()), RecordingLink())(x)
