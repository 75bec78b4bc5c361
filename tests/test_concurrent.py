"""Stages on their own threads (``concurrent=True``): the same bits as running them in turn, errors that
name their stage, no thread left behind, per-stage devices, and profiler ranges named like the simulator's
actions."""

from __future__ import annotations

import gc
import json
import math
import os
import re
import signal
import sys
import threading
import time

import pytest
import torch
from torch import nn

import pipecore
from _same import assert_same
from pipecore.models import GPT

ALGORITHMS = pipecore.algorithm_names()


def mlp(seed: int = 0, width: int = 8, layers: int = 8) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*blocks, nn.Linear(width, 3)).double()


def data(steps: int, batch: int = 8, width: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, width, generator=g, dtype=torch.float64), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(steps)]


def train(concurrent: bool, algorithm: str, steps: int = 5, model: nn.Module | None = None, batches=None,
          loss_fn=None, **options) -> tuple[list[float], dict]:
    model = mlp() if model is None else model
    pipe = pipecore.Pipeline(model, 4, algorithm, n_microbatches=4, optimizer=pipecore.SGD(lr=0.05, momentum=0.9),
                             loss_fn=loss_fn or nn.CrossEntropyLoss(), concurrent=concurrent, **options)
    losses = [pipe.step(x, y) for x, y in (batches or data(steps))]
    pipe.close()
    return losses, pipe.state_dict()


def closed(pipe: pipecore.Pipeline) -> None:
    """Close ``pipe`` after a failed step (closing flushes, which fails on the same error; it still ends
    the stage threads)."""
    try:
        pipe.close()
    except Exception:
        pass
    assert pipe._closed


def test_concurrent_is_the_default_with_several_stages_in_one_process():
    assert pipecore.Pipeline(mlp(), 4, "1f1b", loss_fn=nn.CrossEntropyLoss()).concurrent is True
    assert pipecore.Pipeline(mlp(), 1, "1f1b", loss_fn=nn.CrossEntropyLoss()).concurrent is False
    with pytest.raises(TypeError, match="concurrent must be True, False or None"):
        pipecore.Pipeline(mlp(), 2, "1f1b", loss_fn=nn.CrossEntropyLoss(), concurrent="yes")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_is_bit_identical_concurrent_or_not(algorithm):
    ref = train(False, algorithm)
    got = train(True, algorithm)
    assert_same(got, ref, algorithm)


@pytest.mark.parametrize("algorithm,options", [
    ("spectrain", {"backward_rule": "swap"}),
    ("pipemare", {"backward_rule": "recompute"}),
    ("1f1b", {"split_backward": True}),
    ("i-timeprest", {"backward_rule": "recompute"}),
    ("timeprest", {"backward_rule": "stash"}),
])
def test_backward_rules_and_split_backward_are_bit_identical_concurrent_or_not(algorithm, options):
    assert_same(train(True, algorithm, **options), train(False, algorithm, **options), str(options))


@pytest.mark.parametrize("algorithm", ["1f1b", "pipedream", "pipemare"])
def test_a_tied_head_across_stage_threads_is_bit_identical(algorithm):
    def run(concurrent: bool):
        torch.manual_seed(0)
        model = GPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16).double()
        g = torch.Generator().manual_seed(3)
        batches = [(torch.randint(0, 16, (8, 8), generator=g), torch.randint(0, 16, (8, 8), generator=g))
                   for _ in range(4)]
        pipe = pipecore.Pipeline(model, 3, algorithm, n_microbatches=4, optimizer=pipecore.SGD(lr=0.05),
                                 loss_fn=lambda out, t: nn.functional.cross_entropy(out.flatten(0, 1), t.flatten()),
                                 partition=["blocks.0", "blocks.1"], concurrent=concurrent)
        assert pipe.ties, "the GPT's head is tied to its embedding"
        losses = [pipe.step(x, y) for x, y in batches]
        pipe.flush()
        return losses, pipe.state_dict()

    assert_same(run(True), run(False), algorithm)


# -- overlap_steps: the stage threads go on after step() returns ------------------------------------------


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_overlapping_steps_is_bit_identical_for_every_algorithm(algorithm):
    assert_same(train(True, algorithm, overlap_steps=True), train(False, algorithm), algorithm)


@pytest.mark.parametrize("algorithm", ["gpipe", "2bw", "pipedream", "i-timeprest"])
def test_synchronize_leaves_the_weights_a_step_without_overlap_leaves(algorithm):
    """Between steps, without flushing: after synchronize() the live parameters are those of a pipeline whose
    step() returns settled, whatever is still in flight."""
    def params_after_each_step(**options) -> list[list[torch.Tensor]]:
        pipe = pipecore.Pipeline(mlp(), 4, algorithm, n_microbatches=4, optimizer=pipecore.SGD(lr=0.05, momentum=0.9),
                                 loss_fn=nn.CrossEntropyLoss(), **options)
        seen = []
        for x, y in data(4):
            pipe.step(x, y)
            pipe.synchronize()
            seen.append([p.detach().clone() for p in pipe.model.parameters()])
        pipe.close()
        return seen

    assert_same(params_after_each_step(overlap_steps=True), params_after_each_step(concurrent=False), algorithm)


@pytest.mark.parametrize("algorithm", ["1f1b", "pipedream"])
def test_overlapping_steps_with_a_tied_head_is_bit_identical(algorithm):
    def run(**options):
        torch.manual_seed(0)
        model = GPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16).double()
        g = torch.Generator().manual_seed(3)
        pipe = pipecore.Pipeline(model, 3, algorithm, n_microbatches=4, optimizer=pipecore.SGD(lr=0.05),
                                 loss_fn=lambda out, t: nn.functional.cross_entropy(out.flatten(0, 1), t.flatten()),
                                 partition=["blocks.0", "blocks.1"], **options)
        losses = [pipe.step(torch.randint(0, 16, (8, 8), generator=g), torch.randint(0, 16, (8, 8), generator=g))
                  for _ in range(4)]
        pipe.flush()
        return losses, pipe.state_dict()

    assert_same(run(overlap_steps=True), run(concurrent=False), algorithm)


class _Gate(torch.autograd.Function):
    """Identity whose backward waits for ``opened`` (bounded, so a broken test fails instead of hanging),
    after setting ``reached``; it then raises ``error`` if given."""

    @staticmethod
    def forward(ctx, x, reached, opened, error):
        ctx.reached, ctx.opened, ctx.error = reached, opened, error
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.reached.set()
        assert ctx.opened.wait(timeout=20), "the test never opened the gate"
        if ctx.error is not None:
            raise ctx.error("injected failure in backward")
        return grad, None, None, None


class Gated(nn.Module):
    def __init__(self, error: type[BaseException] | None = None):
        super().__init__()
        self.reached, self.opened, self.error = threading.Event(), threading.Event(), error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Gate.apply(x, self.reached, self.opened, self.error)


def gated_pipeline(error: type[BaseException] | None = None) -> tuple[pipecore.Pipeline, Gated]:
    """gpipe over 2 stages with a gate in stage 0: every forward of a mini-batch runs before its first
    backward, so its loss is known while stage 0's backwards wait at the gate."""
    torch.manual_seed(0)
    gate = Gated(error)
    model = nn.Sequential(nn.Linear(8, 8), gate, nn.Tanh(), nn.Linear(8, 3)).double()
    pipe = pipecore.Pipeline(model, 2, "gpipe", n_microbatches=2, optimizer=pipecore.SGD(lr=0.1),
                             loss_fn=nn.CrossEntropyLoss(), partition=[3], leaf_modules=[Gated], overlap_steps=True)
    return pipe, gate


def test_step_returns_its_loss_while_the_backwards_still_run():
    pipe, gate = gated_pipeline()
    before = pipe.model[0].weight.detach().clone()
    x, y = data(1)[0]
    loss = pipe.step(x, y)
    assert math.isfinite(loss)
    assert gate.reached.wait(timeout=20)  # stage 0's first backward is running, after step() returned
    assert torch.equal(pipe.model[0].weight, before)  # its update has not been applied yet
    gate.opened.set()
    pipe.synchronize()
    assert not torch.equal(pipe.model[0].weight, before)
    assert pipe.in_flight == 0
    pipe.close()


def test_an_error_after_step_returned_is_raised_by_the_next_call():
    pipe, gate = gated_pipeline(error=Injected)
    x, y = data(1)[0]
    pipe.step(x, y)  # returns before stage 0's backward fails
    assert gate.reached.wait(timeout=20)
    gate.opened.set()
    with pytest.raises(Injected, match="injected failure in backward") as info:
        pipe.state_dict()
    assert any("stage 0's worker thread, running 0B0" in note for note in info.value.__notes__), info.value.__notes__
    # The failed mini-batch was undone (tests/test_recovery.py checks how): training goes on.
    assert "mini-batch 0 since the last flush was dropped" in info.value.__notes__[-1]
    # The gate would fail the next backward too, and whether that happens before or after step() returns is a
    # race between the stage threads and this one: training goes on once the failure's cause is gone.
    gate.error = None
    assert pipe.in_flight == 0 and math.isfinite(pipe.step(x, y))
    closed(pipe)
    assert not pipe._parts.threads.alive()


def test_a_nonfinite_loss_is_raised_by_its_own_step_with_overlap():
    pipe = pipecore.Pipeline(mlp(), 4, "2bw", n_microbatches=4, loss_fn=nn.CrossEntropyLoss(), overlap_steps=True)
    x, y = data(1)[0]
    pipe.step(x, y)
    x = x.clone()
    x[5, 0] = math.nan
    with pytest.raises(pipecore.NonFiniteLoss, match="stage 3, micro-batch 6"):
        pipe.step(x, y)
    closed(pipe)


def test_overlap_steps_needs_stage_threads():
    with pytest.raises(ValueError, match="overlap_steps=True needs a worker thread per stage.*concurrent=False"):
        pipecore.Pipeline(mlp(), 4, "1f1b", loss_fn=nn.CrossEntropyLoss(), concurrent=False, overlap_steps=True)
    with pytest.raises(ValueError, match=r"runs 1 stage\(s\)"):
        pipecore.Pipeline(mlp(), 1, "1f1b", loss_fn=nn.CrossEntropyLoss(), overlap_steps=True)
    with pytest.raises(TypeError, match="overlap_steps must be True or False"):
        pipecore.Pipeline(mlp(), 4, "1f1b", loss_fn=nn.CrossEntropyLoss(), overlap_steps=1)


class Injected(Exception):
    """The failure the tests inject."""


class Fails(nn.Module):
    """Identity that raises on its ``at``-th call (forward, or backward with ``in_backward``); a leaf
    module, so that the check runs at every call rather than once while the graph is captured."""

    def __init__(self, at: int, error: type[BaseException] = Injected, in_backward: bool = False):
        super().__init__()
        self.at, self.error, self.in_backward, self.calls = at, error, in_backward, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            if not self.in_backward:
                raise self.error("injected failure")
            return _RaiseInBackward.apply(x, self.error)
        return x


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, error):
        ctx.error = error
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ctx.error("injected failure in backward")


def failing_model(stage_of_failure: int, **kwargs) -> tuple[nn.Sequential, list[int]]:
    """Four stages of Linear+Tanh; the stage ``stage_of_failure`` has a ``Fails`` module."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    starts = []
    for s in range(4):
        if s:
            starts.append(len(layers))
        layers.append(nn.Linear(8, 8))
        if s == stage_of_failure:
            layers.append(Fails(**kwargs))  # after the Linear: its backward runs even on stage 0
        layers.append(nn.Tanh())
    layers.append(nn.Linear(8, 3))
    return nn.Sequential(*layers).double(), starts


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("in_backward", [False, True])
@pytest.mark.parametrize("overlap_steps", [False, True])
def test_an_error_in_any_stage_thread_reaches_step_naming_the_stage(stage, in_backward, overlap_steps):
    model, starts = failing_model(stage, at=6, in_backward=in_backward)
    pipe = pipecore.Pipeline(model, 4, "pipedream", n_microbatches=4, loss_fn=nn.CrossEntropyLoss(),
                             partition=starts, concurrent=True, leaf_modules=[Fails], overlap_steps=overlap_steps)
    batches = data(4)
    with pytest.raises(Injected, match="injected failure") as info:
        for x, y in batches:
            pipe.step(x, y)
        pipe.synchronize()  # with overlap_steps, an error after the last step returned is raised here
    assert any(f"stage {stage}'s worker thread" in note for note in getattr(info.value, "__notes__", []))
    closed(pipe)
    assert not pipe._parts.threads.alive()


def test_a_keyboard_interrupt_in_a_stage_thread_stops_every_thread_and_reaches_step():
    model, starts = failing_model(2, at=3, error=KeyboardInterrupt)
    pipe = pipecore.Pipeline(model, 4, "1f1b", n_microbatches=4, loss_fn=nn.CrossEntropyLoss(), partition=starts,
                             leaf_modules=[Fails])
    with pytest.raises(KeyboardInterrupt):
        pipe.step(*data(1)[0])
    closed(pipe)
    assert not pipe._parts.threads.alive()


class InterruptsMain(nn.Module):
    """Identity that interrupts the main thread (as Ctrl-C would) on its ``at``-th call, then waits for the
    pipeline to stop the stage threads."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does: the main thread gets KeyboardInterrupt
        return x


@pytest.mark.parametrize("overlap_steps", [False, True])
def test_ctrl_c_while_stages_run_stops_every_thread(overlap_steps):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), InterruptsMain(at=2), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3))
    pipe = pipecore.Pipeline(model.double(), 4, "1f1b", n_microbatches=4, loss_fn=nn.CrossEntropyLoss(),
                             partition=[2, 3, 4], leaf_modules=[InterruptsMain], timeout=5,
                             overlap_steps=overlap_steps)
    with pytest.raises(KeyboardInterrupt):
        for x, y in data(50, batch=64):
            pipe.step(x, y)
        pipe.synchronize()
    closed(pipe)
    assert not pipe._parts.threads.alive()


def test_one_thread_per_stage_lives_from_step_to_step_and_ends_with_close():
    pipe = pipecore.Pipeline(mlp(), 4, "2bw", n_microbatches=4, loss_fn=nn.CrossEntropyLoss())
    seen = []
    for x, y in data(3):
        pipe.step(x, y)
        seen.append(sorted(t.ident for t in pipe._parts.threads.alive()))
    assert len(seen[0]) == 4 and seen[0] == seen[1] == seen[2]
    threads = pipe._parts.threads.alive()
    pipe.close()
    assert not any(t.is_alive() for t in threads)


def test_the_stage_threads_end_when_the_pipeline_is_garbage_collected():
    pipe = pipecore.Pipeline(mlp(), 4, "1f1b", n_microbatches=4, loss_fn=nn.CrossEntropyLoss())
    pipe.step(*data(1)[0])
    threads = pipe._parts.threads.alive()
    assert len(threads) == 4
    del pipe
    gc.collect()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)


def test_a_failed_step_leaves_no_thread_waiting():
    model, starts = failing_model(1, at=2)
    pipe = pipecore.Pipeline(model, 4, "pipedream", n_microbatches=4, loss_fn=nn.CrossEntropyLoss(),
                             partition=starts, leaf_modules=[Fails])
    with pytest.raises(Injected):
        pipe.step(*data(1)[0])
    # Every stage thread is back in its idle loop, waiting for the next job: none is stuck in a mailbox.
    threads = pipe._parts.threads.alive()
    assert len(threads) == 4
    frames = sys._current_frames()
    assert all(frames[t.ident].f_code.co_name == "_serve" for t in threads), [
        frames[t.ident].f_code.co_name for t in threads]
    closed(pipe)
    assert not pipe._parts.threads.alive()


def test_devices_place_each_stage_and_match_the_default():
    ref = train(True, "1f1b")
    got = train(True, "1f1b", devices=["cpu"] * 4)
    assert_same(got, ref)
    assert_same(train(True, "1f1b", devices="cpu"), ref)
    pipe = pipecore.Pipeline(mlp(), 4, "1f1b", loss_fn=nn.CrossEntropyLoss(), devices="cpu")
    assert pipe.devices == [torch.device("cpu")] * 4


@pytest.mark.parametrize("devices,message", [
    (["cpu"] * 3, "devices has 3 entries but there are 4 stages"),
    (["cpu", "cpu", "gpu", "cpu"], r"devices\[2\] = 'gpu' is not a device"),
    (["cpu", "meta", "cpu", "cpu"], r"devices\[1\] = 'meta': stages run on 'cpu' or 'cuda' devices"),
])
def test_bad_devices_are_refused_with_what_is_allowed(devices, message):
    with pytest.raises(ValueError, match=message):
        pipecore.Pipeline(mlp(), 4, "1f1b", loss_fn=nn.CrossEntropyLoss(), devices=devices)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_a_cuda_device_without_cuda_is_refused():
    with pytest.raises(ValueError, match="CUDA is not available"):
        pipecore.Pipeline(mlp(), 2, "1f1b", loss_fn=nn.CrossEntropyLoss(), devices=["cpu", "cuda:0"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("algorithm", ["1f1b", "pipedream", "2bw", "spectrain", "i-timeprest"])
def test_cuda_stages_on_their_own_streams_are_bit_identical_to_one_thread(algorithm):
    def run(concurrent: bool, devices):
        model = mlp().cuda()
        batches = [(x.cuda(), y.cuda()) for x, y in data(5)]
        return train(concurrent, algorithm, model=model, batches=batches, devices=devices)

    ref = run(False, ["cuda:0"] * 4)
    assert_same(run(True, ["cuda:0"] * 4), ref, algorithm)
    # Stages on the CPU and the GPU, activations moving between them: a thread (and a stream) per stage is
    # bit-identical to the same placement run in turn. Compared on the CPU: torch.equal needs one device.
    mixed = ["cpu", "cuda:0", "cpu", "cuda:0"]
    mixed_in_turn = _on_cpu(run(False, mixed))
    assert_same(_on_cpu(run(True, mixed)), mixed_in_turn, algorithm)
    # Against the all-CUDA stages only within float64 rounding: a stage on the CPU runs other kernels (CPU
    # matmuls sum in another order, the fused update is C++ instead of Triton), so values differ in the last
    # bits (the H100 run: losses 1.1217890228180463 vs 1.1217890228180465, one ulp) and the differences grow
    # a little over 5 steps x 4 micro-batches of 17 layers. A float64 unit roundoff is 1.1e-16; rtol 1e-10
    # leaves a margin of about a million for that growth, while a real error (another micro-batch, a stale
    # or missed update) changes losses and weights from the third digit on.
    _assert_close_nested(mixed_in_turn, _on_cpu(ref), algorithm, rtol=1e-10, atol=1e-12)


def _on_cpu(obj: object) -> object:
    """``obj`` (nested lists, tuples, dicts) with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_cpu(v) for v in obj)
    return obj


def _assert_close_nested(a: object, b: object, where: str, rtol: float, atol: float) -> None:
    """Like ``assert_same``, but tensors and floats equal within ``rtol``/``atol`` (same dtype, same structure)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, where
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{where}: {m}")
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            _assert_close_nested(a[key], b[key], f"{where}/{key}", rtol, atol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close_nested(x, y, f"{where}[{i}]", rtol, atol)
    elif isinstance(a, float):
        assert math.isclose(a, b, rel_tol=rtol, abs_tol=atol), f"{where}: {a} vs {b}"
    else:
        assert a == b, where


@pytest.mark.parametrize("concurrent", [True, False])
def test_every_action_is_a_profiler_range_named_like_the_simulator_with_its_kernels_inside(tmp_path, concurrent):
    # Stages on the CPU of one process skip their per-action hooks while nothing profiles: under a profiler
    # every action still opens its range, on stage threads and in turn.
    pipe = pipecore.Pipeline(mlp(), 4, "pipedream", n_microbatches=4, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=pipecore.SGD(lr=0.05), concurrent=concurrent)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for x, y in data(3):
            pipe.step(x, y)
        pipe.flush()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    actions = sorted(e["name"] for e in events if re.fullmatch(r"\d[FBU]\d+(-\d+)?(@\S+)?", e["name"]))
    # Exactly the simulator's actions, named the same way (the version each read included).
    trace = pipecore.simulate("pipedream", 4, 4, n_minibatches=3)
    assert actions == sorted(trace._label(e) for e in trace.events)
    # A forward's matrix products run inside its range, on its stage's thread.
    forward = next(e for e in events if e["name"].startswith("1F5@"))
    inside = [e for e in events if e["tid"] == forward["tid"] and e["name"] == "aten::addmm"
              and forward["ts"] <= e["ts"] and e["ts"] + e["dur"] <= forward["ts"] + forward["dur"]]
    assert inside


def test_overlapping_steps_return_settled_under_a_profiler():
    """A profiler session must not end while stage threads still record into it: under one, step() waits for
    its work even with overlap_steps."""
    pipe = pipecore.Pipeline(mlp(), 4, "2bw", n_microbatches=4, loss_fn=nn.CrossEntropyLoss(), overlap_steps=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        for x, y in data(3):
            pipe.step(x, y)
            assert pipe._steps.executor.cursor == pipe._steps.executor.planned
    pipe.close()


class Probe(nn.Module):
    """Scales its input and records whether autocast was on when it ran (a leaf module: recorded per call)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.autocast_seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.autocast_seen.append(torch.is_autocast_enabled("cpu"))
        return x * self.scale  # elementwise: autocast leaves it in float32


def test_the_callers_thread_local_state_applies_on_every_stage_thread():
    """An ``autocast`` (like a ``no_grad`` or a profiler) around ``step()`` is thread-local: the stage
    threads run under the caller's state, as the stages do when they run in turn on the caller's thread."""
    probes = [Probe() for _ in range(4)]
    model = nn.Sequential(*[m for p in probes for m in (p, nn.Tanh())], nn.Linear(8, 3))
    pipe = pipecore.Pipeline(model, 4, "1f1b", n_microbatches=4, loss_fn=nn.CrossEntropyLoss(),
                             partition=[2, 4, 6], leaf_modules=[Probe])
    x, y = data(1)[0]
    pipe.step(x.float(), y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe.step(x.float(), y)
    assert [p.autocast_seen for p in probes] == [[False] * 4 + [True] * 4] * 4


class Slow(nn.Module):
    """Identity that sleeps on its ``at``-th call."""

    def __init__(self, at: int, seconds: float):
        super().__init__()
        self.at, self.seconds, self.calls = at, seconds, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            time.sleep(self.seconds)
        return x


def test_a_stage_waiting_longer_than_the_timeout_raises_naming_both_stages():
    torch.manual_seed(0)
    # Two stages: only stage 1 waits (with a third, stage 2's wait for stage 1 could time out first).
    model = nn.Sequential(nn.Linear(8, 8), Slow(at=1, seconds=2.0), nn.Linear(8, 8), nn.Linear(8, 3)).double()
    pipe = pipecore.Pipeline(model, 2, "1f1b", n_microbatches=4, loss_fn=nn.CrossEntropyLoss(),
                             partition=[2], leaf_modules=[Slow], timeout=0.3)
    with pytest.raises(TimeoutError, match="stage 1 waited 0.3 s for stage 0's activations of micro-batch 0"):
        pipe.step(*data(1)[0])
    # The interrupted mini-batch was undone: the next step trains.
    assert math.isfinite(pipe.step(*data(1)[0]))
    closed(pipe)
    assert not pipe._parts.threads.alive()


class RecordingDropout(nn.Module):
    """Dropout that records each mask it draws, and whether autograd was recording (the recompute rule's
    forward runs without, its recomputation with)."""

    def __init__(self):
        super().__init__()
        self.forward_masks: list[torch.Tensor] = []
        self.recomputed_masks: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.rand_like(x) > 0.5
        (self.recomputed_masks if torch.is_grad_enabled() else self.forward_masks).append(mask)
        return x * mask


def test_the_recompute_rule_replays_each_forwards_dropout_while_other_stages_draw():
    torch.manual_seed(0)
    drops = [RecordingDropout() for _ in range(4)]
    model = nn.Sequential(*[m for d in drops for m in (nn.Linear(8, 8), d)], nn.Linear(8, 3)).double()
    pipe = pipecore.Pipeline(model, 4, "pipemare", n_microbatches=4, loss_fn=nn.CrossEntropyLoss(),
                             partition=[2, 4, 6], leaf_modules=[RecordingDropout], backward_rule="recompute")
    for x, y in data(6, batch=64):
        pipe.step(x, y)
    pipe.close()
    for s, d in enumerate(drops):
        assert len(d.forward_masks) == len(d.recomputed_masks) == 24, s
        for k, (f, r) in enumerate(zip(d.forward_masks, d.recomputed_masks)):
            assert torch.equal(f, r), f"stage {s}, micro-batch {k}: the recomputation drew another mask"
