"""WeightRing: layout, state machine, misuse errors, zero-copy parameter views."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import pipecore.ops as ops
from pipecore.ring import WeightRing

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def filled(ring: WeightRing, i: int, version: int) -> None:
    ring.slot(i).fill_(float(version))


def test_layout_single_allocation_and_views():
    ring = WeightRing(1000, 3, torch.float32, "cpu")
    assert ring.numel == 1000 and ring.num_slots == 3 and len(ring) == 3
    assert ring.dtype == torch.float32 and ring.device == torch.device("cpu")
    assert ring.slot_stride == 1024  # numel rounded up to 64 elements
    assert ring.buffer.numel() == 3 * 1024
    assert ring.nbytes == 3 * 1024 * 4
    base = ring.buffer.data_ptr()
    for i in range(3):
        s = ring.slot(i)
        assert s.dim() == 1 and s.numel() == 1000 and s.is_contiguous()
        assert s.untyped_storage().data_ptr() == ring.buffer.untyped_storage().data_ptr()
        assert s.data_ptr() == base + i * 1024 * 4
        assert s.data_ptr() % 64 == 0  # as aligned as the allocation (64 B on CPU)
        assert ring.slot(i) is s
    assert torch.count_nonzero(ring.buffer) == 0  # zero-filled
    ring.slot(1).fill_(7.0)
    assert torch.all(ring.buffer[1024:2024] == 7.0)
    assert torch.count_nonzero(ring.buffer) == 1000  # slots do not overlap


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_any_float_dtype(dtype):
    ring = WeightRing(10, 2, dtype)
    assert ring.slot(0).dtype == dtype
    assert ring.nbytes == 2 * 64 * torch.empty((), dtype=dtype).element_size()
    assert f"dtype={dtype}" in repr(ring)


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match="numel must be positive, got 0"):
        WeightRing(0, 2)
    with pytest.raises(ValueError, match="num_slots must be positive, got 0"):
        WeightRing(10, 0)
    with pytest.raises(ValueError, match="dtype must be a floating type"):
        WeightRing(10, 2, torch.int32)
    with pytest.raises(ValueError, match="dtype must be a torch.dtype"):
        WeightRing(10, 2, "float32")  # type: ignore[arg-type]


def test_initial_state():
    ring = WeightRing(4, 3)
    assert ring.live_slot is None and ring.live_version is None and ring.live is None
    for i in range(3):
        assert ring.version_of(i) is None
        assert ring.pin_count(i) == 0
        assert ring.state(i) == "free"
    assert ring.find(0) is None


def test_acquire_publish_cycle_and_versions():
    ring = WeightRing(4, 3)
    a = ring.acquire()
    assert ring.state(a) == "acquired" and ring.version_of(a) is None
    filled(ring, a, 0)
    ring.publish(a, 0)
    assert ring.live_slot == a and ring.live_version == 0 and ring.state(a) == "live"
    assert torch.equal(ring.live, ring.slot(a))
    b = ring.acquire()
    assert b != a
    ring.publish(b, 1)
    assert ring.live_slot == b and ring.live_version == 1
    # the old live slot is free (nobody pinned it) but still holds its version until reused
    assert ring.state(a) == "free" and ring.version_of(a) == 0 and ring.find(0) == a
    assert ring.find(1) == b and ring.find(7) is None


def test_acquire_prefers_empty_then_oldest_and_drops_the_version():
    ring = WeightRing(4, 4)
    for v in range(4):
        i = ring.acquire()
        assert i == v  # never-used slots first, lowest index first
        ring.publish(i, v)
    # slots 0..2 are free and hold v0..v2; slot 3 is live
    i = ring.acquire()
    assert i == 0 and ring.version_of(0) is None and ring.find(0) is None
    ring.publish(i, 10)
    assert ring.acquire() == 1  # v1 is now the oldest


def test_pins_keep_stale_slots_and_live_slot_is_never_acquired():
    ring = WeightRing(4, 3)
    a = ring.acquire()
    ring.publish(a, 0)
    ring.pin(a)
    ring.pin(a)
    assert ring.pin_count(a) == 2
    b = ring.acquire()
    ring.publish(b, 1)
    assert ring.state(a) == "stale"
    c = ring.acquire()
    assert c not in (a, b)
    ring.release(c)
    assert ring.state(c) == "free" and ring.version_of(c) is None
    ring.unpin(a)
    assert ring.state(a) == "stale" and ring.pin_count(a) == 1
    ring.unpin(a)
    assert ring.state(a) == "free" and ring.version_of(a) == 0
    # a pinned live slot stays live; pinning a free slot that still holds a version protects it
    ring.pin(b)
    assert ring.state(b) == "live" and ring.pin_count(b) == 1
    ring.pin(a)
    assert ring.acquire() == c


def test_acquire_with_all_slots_in_use_names_k_and_the_pins():
    ring = WeightRing(4, 3)
    for v, pins in ((3, 2), (4, 1), (5, 0)):
        i = ring.acquire()
        ring.publish(i, v)
        for _ in range(pins):
            ring.pin(i)
    # slots: 0 holds v3 pinned twice, 1 holds v4 pinned once, 2 is live v5
    with pytest.raises(RuntimeError) as exc:
        ring.acquire()
    assert str(exc.value) == ("WeightRing.acquire: all 3 slots are in use "
                              "(live: slot 2 v5; pinned: slot 0 v3 x2, slot 1 v4 x1)")
    ring.unpin(1)
    assert ring.acquire() == 1


def test_acquire_error_lists_unpublished_acquisitions():
    ring = WeightRing(4, 2)
    i = ring.acquire()
    ring.publish(i, 0)
    ring.acquire()
    with pytest.raises(RuntimeError, match=re.escape(
            "all 2 slots are in use (live: slot 0 v0; acquired, not yet published: slot 1)")):
        ring.acquire()


def test_publishing_an_unpinned_stale_slot_is_an_error():
    ring = WeightRing(4, 3)
    a = ring.acquire()
    ring.publish(a, 0)
    b = ring.acquire()
    ring.publish(b, 1)
    before = repr(ring)
    with pytest.raises(RuntimeError, match=re.escape(
            f"WeightRing.publish: slot {a} was not acquired (it is free, still holds v0)")):
        ring.publish(a, 2)
    with pytest.raises(RuntimeError, match="was not acquired \\(it is live, v1\\)"):
        ring.publish(b, 2)
    ring.pin(a)
    with pytest.raises(RuntimeError, match="was not acquired \\(it is stale, v0, 1 pin\\)"):
        ring.publish(a, 2)
    ring.unpin(a)
    assert repr(ring) == before  # failed calls change nothing


def test_publish_version_must_increase():
    ring = WeightRing(4, 3)
    a = ring.acquire()
    ring.publish(a, 5)
    b = ring.acquire()
    with pytest.raises(ValueError, match=re.escape("version 5 is not newer than the live version 5 (slot 0)")):
        ring.publish(b, 5)
    with pytest.raises(ValueError, match="version 4 is not newer"):
        ring.publish(b, 4)
    assert ring.state(b) == "acquired"  # still acquired after the failed publish
    ring.publish(b, 6)
    c = ring.acquire()
    with pytest.raises(ValueError, match="version must be non-negative, got -1"):
        ring.publish(c, -1)


def test_advance_updates_the_live_slot_in_place():
    ring = WeightRing(4, 2)
    with pytest.raises(RuntimeError, match="WeightRing.advance: no live slot yet"):
        ring.advance(0)
    a = ring.acquire()
    ring.publish(a, 0)
    ring.advance(1)  # e.g. synchronous training updates the single live copy in place
    assert ring.live_slot == a and ring.live_version == 1 and ring.find(0) is None and ring.find(1) == a
    with pytest.raises(ValueError, match=re.escape("WeightRing.advance: version 1 is not newer than the live "
                                                   "version 1 (slot 0)")):
        ring.advance(1)
    ring.pin(a)
    with pytest.raises(RuntimeError, match=re.escape("WeightRing.advance: the live slot 0 is pinned (slot 0 v1 x1)")):
        ring.advance(2)
    assert ring.live_version == 1
    ring.unpin(a)
    ring.advance(2)
    assert ring.live_version == 2


def test_unpinning_twice_is_an_error():
    ring = WeightRing(4, 2)
    a = ring.acquire()
    ring.publish(a, 3)
    ring.pin(a)
    ring.unpin(a)
    with pytest.raises(RuntimeError, match=re.escape(
            "WeightRing.unpin: slot 0 is not pinned (it is live, v3); every unpin must match an earlier pin")):
        ring.unpin(a)
    assert ring.pin_count(a) == 0


def test_pin_and_release_misuse():
    ring = WeightRing(4, 2)
    with pytest.raises(RuntimeError, match="WeightRing.pin: slot 1 holds no version \\(it is free, empty\\)"):
        ring.pin(1)
    a = ring.acquire()
    with pytest.raises(RuntimeError, match="holds no version \\(it is acquired, not yet published\\)"):
        ring.pin(a)
    ring.publish(a, 0)
    with pytest.raises(RuntimeError, match="WeightRing.release: slot 0 is not acquired \\(it is live, v0\\)"):
        ring.release(a)
    with pytest.raises(RuntimeError, match="WeightRing.release: slot 1 is not acquired \\(it is free, empty\\)"):
        ring.release(1)


@pytest.mark.parametrize("call", ["slot", "version_of", "pin_count", "state", "publish", "release", "pin", "unpin"])
def test_slot_index_out_of_range(call):
    ring = WeightRing(4, 2)
    args = (5, 1) if call == "publish" else (5,)
    with pytest.raises(ValueError, match=f"WeightRing.{call}: slot index 5 is out of range for a ring of 2 slots"):
        getattr(ring, call)(*args)
    with pytest.raises(ValueError, match="slot index -1 is out of range"):
        getattr(ring, call)(-1, *args[1:])


def test_repr_shows_slots_versions_pins_and_live():
    ring = WeightRing(8, 4, torch.float32)
    a = ring.acquire()
    ring.publish(a, 3)
    ring.pin(a)
    ring.pin(a)
    b = ring.acquire()
    ring.publish(b, 4)
    ring.acquire()
    assert repr(ring) == (
        "WeightRing(numel=8, num_slots=4, dtype=torch.float32, device=cpu, live=slot 1 v4)\n"
        "  slot 0: stale, v3, 2 pins\n"
        "  slot 1: live, v4\n"
        "  slot 2: acquired, not yet published\n"
        "  slot 3: free, empty")


def test_from_flat_copies_and_publishes():
    flat = torch.arange(10, dtype=torch.float64)
    ring = WeightRing.from_flat(flat, 2, version=7)
    assert ring.live_version == 7 and ring.dtype == torch.float64
    assert torch.equal(ring.live, flat)
    flat.zero_()
    assert ring.live[3] == 3  # a copy, not a view of the source


def test_views_make_module_parameters_live_in_a_slot():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    shapes = [p.shape for p in lin.parameters()]
    numel = sum(p.numel() for p in lin.parameters())
    ring = WeightRing(numel, 2, torch.float32)
    i = ring.acquire()
    views = ring.views(i, shapes)
    for v, p in zip(views, lin.parameters()):
        v.copy_(p.detach())
    ring.publish(i, 0)
    lin.weight = torch.nn.Parameter(views[0])
    lin.bias = torch.nn.Parameter(views[1])
    assert lin.weight.data_ptr() == ring.slot(i).data_ptr()
    x = torch.randn(4, 3)
    y0 = lin(x)
    with torch.no_grad():
        ring.slot(i).mul_(2.0)  # writing the slot changes the module: no copy in between
    assert torch.allclose(lin(x), 2 * y0)
    with pytest.raises(ValueError, match="need more than the 8 elements"):
        ring.views(i, [(3, 3)])


def _linear_in_slot(ring: WeightRing, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    w, b = ring.views(i, [(2, 3), (2,)])
    return torch.nn.Parameter(w), torch.nn.Parameter(b)


def test_zero_copy_stash_survives_an_update_into_another_slot():
    """A micro-batch pins the slot its forward read; the update writes the next slot in place and
    the pinned micro-batch's backward still sees (and differentiates) the weights it read."""
    torch.manual_seed(0)
    ring = WeightRing(8, 2, torch.float64)
    i = ring.acquire()
    ring.slot(i).copy_(torch.randn(8, dtype=torch.float64))
    ring.publish(i, 0)
    w, b = _linear_in_slot(ring, i)
    x = torch.randn(5, 3, dtype=torch.float64)
    ring.pin(i)
    loss = torch.nn.functional.linear(x, w, b).square().sum()
    old = ring.slot(i).clone()
    # the update for another micro-batch writes a new version into the free slot
    j = ring.acquire()
    grad = torch.randn(8, dtype=torch.float64)
    ops.sgd_step(ring.slot(i), grad, None, lr=0.1, out=ring.slot(j))
    ring.publish(j, 1)
    assert ring.state(i) == "stale"
    loss.backward()  # would raise if writing slot j had bumped slot i's version counter
    expected_w = 2 * (x @ old[:6].view(2, 3).T + old[6:]).T @ x
    assert torch.allclose(w.grad, expected_w)
    ring.unpin(i)
    assert ring.state(i) == "free"


def test_overwriting_a_slot_a_graph_saved_is_detected():
    ring = WeightRing(8, 2, torch.float64)
    i = ring.acquire()
    ring.slot(i).normal_()
    ring.publish(i, 0)
    w, b = _linear_in_slot(ring, i)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)  # so that the graph saves w
    loss = torch.nn.functional.linear(x, w, b).square().sum()
    stale = torch.randn(8, dtype=torch.float64)
    ops.interpolate(ring.slot(i), stale, 0.5, out=ring.slot(i))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@CUDA
def test_cuda_ring():
    ring = WeightRing(1000, 3, torch.bfloat16, "cuda")
    assert ring.device.type == "cuda" and ring.slot(2).is_cuda
    i = ring.acquire()
    ring.slot(i).fill_(1.5)
    ring.publish(i, 0)
    assert ring.live.float().sum().item() == 1500.0


class RingModel(RuleBasedStateMachine):
    """Random operation sequences against a plain-Python model of the state machine."""

    K = 4

    def __init__(self) -> None:
        super().__init__()
        self.ring = WeightRing(3, self.K)
        self.version = [None] * self.K
        self.pins = [0] * self.K
        self.acquired = [False] * self.K
        self.live = None
        self.next_version = 0

    def free(self, i: int) -> bool:
        return i != self.live and self.pins[i] == 0 and not self.acquired[i]

    @rule()
    def acquire(self):
        candidates = [i for i in range(self.K) if self.free(i)]
        if not candidates:
            with pytest.raises(RuntimeError, match=f"all {self.K} slots are in use"):
                self.ring.acquire()
            return
        expected = min(candidates, key=lambda i: (-1 if self.version[i] is None else self.version[i], i))
        assert self.ring.acquire() == expected
        self.acquired[expected] = True
        self.version[expected] = None

    @rule(i=st.integers(0, K - 1), skip=st.integers(0, 2))
    def publish(self, i, skip):
        version = self.next_version + skip
        if not self.acquired[i]:
            with pytest.raises(RuntimeError, match="was not acquired"):
                self.ring.publish(i, version)
            return
        self.ring.publish(i, version)
        self.acquired[i] = False
        self.version[i] = version
        self.live = i
        self.next_version = version + 1

    @rule(skip=st.integers(0, 2))
    def advance(self, skip):
        version = self.next_version + skip
        if self.live is None:
            with pytest.raises(RuntimeError, match="no live slot yet"):
                self.ring.advance(version)
        elif self.pins[self.live]:
            with pytest.raises(RuntimeError, match="is pinned"):
                self.ring.advance(version)
        else:
            self.ring.advance(version)
            self.version[self.live] = version
            self.next_version = version + 1

    @rule(i=st.integers(0, K - 1))
    def release(self, i):
        if not self.acquired[i]:
            with pytest.raises(RuntimeError, match="is not acquired"):
                self.ring.release(i)
            return
        self.ring.release(i)
        self.acquired[i] = False

    @rule(i=st.integers(0, K - 1))
    def pin(self, i):
        if self.acquired[i] or self.version[i] is None:
            with pytest.raises(RuntimeError, match="holds no version"):
                self.ring.pin(i)
            return
        self.ring.pin(i)
        self.pins[i] += 1

    @precondition(lambda self: self.live is not None)
    @rule()
    def pin_live(self):
        self.ring.pin(self.live)
        self.pins[self.live] += 1

    @rule(i=st.integers(0, K - 1))
    def unpin(self, i):
        if self.pins[i] == 0:
            with pytest.raises(RuntimeError, match="is not pinned"):
                self.ring.unpin(i)
            return
        self.ring.unpin(i)
        self.pins[i] -= 1

    @invariant()
    def matches_model(self):
        assert self.ring.live_slot == self.live
        assert self.ring.live_version == (None if self.live is None else self.version[self.live])
        for i in range(self.K):
            assert self.ring.version_of(i) == self.version[i]
            assert self.ring.pin_count(i) == self.pins[i]
            expected = ("live" if i == self.live else "acquired" if self.acquired[i]
                        else "stale" if self.pins[i] else "free")
            assert self.ring.state(i) == expected
            if self.version[i] is not None:
                assert self.ring.find(self.version[i]) == i


TestRingStateMachine = RingModel.TestCase
TestRingStateMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_rewind_makes_an_older_version_live_again_and_forgets_the_newer():
    ring = WeightRing(4, 3)
    first = ring.acquire()
    ring.slot(first).fill_(1.0)
    ring.publish(first, 0)
    ring.pin(first)  # an in-flight micro-batch read v0
    second = ring.acquire()
    ring.slot(second).fill_(2.0)
    ring.publish(second, 1)
    ring.advance(2)  # updated in place: v1 is gone
    assert ring.rewind(0) is True
    assert (ring.live_slot, ring.live_version, ring.pin_count(first)) == (first, 0, 1)
    assert ring.find(2) is None and ring.find(1) is None
    assert torch.equal(ring.live, torch.ones(4))
    ring.unpin(first)
    assert ring.rewind(0) is True  # rewinding to the live version changes nothing


def test_rewind_to_an_overwritten_version_leaves_no_live_slot_to_publish_into():
    ring = WeightRing.from_flat(torch.zeros(4), 2, version=0)
    ring.advance(1)
    assert ring.rewind(0) is False and ring.live_slot is None and ring.find(1) is None
    slot = ring.acquire()
    ring.slot(slot).fill_(7.0)
    ring.publish(slot, 0)
    assert ring.live_version == 0 and torch.equal(ring.live, torch.full((4,), 7.0))


def test_rewind_refuses_while_a_newer_version_is_pinned_or_a_slot_acquired():
    ring = WeightRing.from_flat(torch.zeros(4), 3, version=0)
    newer = ring.acquire()
    ring.publish(newer, 1)
    ring.pin(newer)
    with pytest.raises(RuntimeError, match="slot .* holds v1, newer than v0, and is pinned"):
        ring.rewind(0)
    ring.unpin(newer)
    ring.acquire()
    with pytest.raises(RuntimeError, match="is acquired and not yet published"):
        ring.rewind(0)
    with pytest.raises(ValueError, match="must be non-negative"):
        ring.rewind(-1)
