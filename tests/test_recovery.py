"""A failed step leaves the pipeline whole: the newest mini-batch is undone everywhere, the earlier ones
complete as ``flush()`` would have completed them in its place, and training goes on. Every test compares
bit for bit (float64) with a run that called ``flush()`` instead of the failed step."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from torch import nn

import pipecore
from _same import assert_same
from pipecore.models import GPT

ALGORITHMS = ["gpipe", "1f1b", "2bw", "pipedream", "i-timeprest"]
ARM_AT = 2  # the step before which a fault is armed


class Injected(Exception):
    """The error a test injects."""


class Fault:
    """Makes one action of ``kind`` at ``stage`` raise, once: the first after arming (``target="first"``, which
    may belong to an earlier mini-batch still in flight), the first of the newest mini-batch (``"newest"``) or
    the last of the mini-batch fed next after arming (``"next-last"``);
    ``when="start"`` raises before the action does anything, ``"end"`` after its compute is done (the worst
    case: gradients added, weights written)."""

    HOOKS = {"F": "compute_forward", "B": "compute_backward", "W": "compute_weight", "U": "compute_update"}

    def __init__(self, stage: int, kind: str, when: str = "end", target: str = "newest",
                 error: type[BaseException] = Injected, gate: threading.Event | None = None):
        self.stage, self.kind, self.when, self.target, self.error = stage, kind, when, target, error
        self.gate = gate  # if given, the action waits for it before it fails
        self.fired = False
        self.next_minibatch = 0

    def arm(self, pipe: pipecore.Pipeline) -> None:
        # Read now, not when an action runs: with overlap_steps the previous mini-batch's last actions may run
        # after arming, before the next step() counts its mini-batch.
        self.next_minibatch = pipe._steps.fed
        st = pipe.stages[self.stage]
        name = self.HOOKS[self.kind]
        original = getattr(st, name)

        def hook(action, *args):
            if self.fired or not self._matches(pipe, action):
                return original(action, *args)
            self.fired = True
            if self.when == "end":
                original(action, *args)
            if self.gate is not None:
                assert self.gate.wait(30)
            raise self.error(f"injected at {action}")

        setattr(st, name, hook)

    def _matches(self, pipe: pipecore.Pipeline, action) -> bool:
        if self.target == "first":
            return True
        every, m = pipe.algorithm.update_every, pipe.n_microbatches
        first = action.index if self.kind != "U" else (action.index - 1) * every
        if self.target == "next-last":  # that mini-batch's last backward or update
            return first == (self.next_minibatch + 1) * m - (every if self.kind == "U" else 1)
        return first >= (pipe._steps.fed - 1) * m


def mlp(seed: int = 0, width: int = 8, extra: tuple[nn.Module, ...] = ()) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(5):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, *extra, nn.Linear(width, 3)).double()


def data(steps: int, batch: int = 8, width: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, width, generator=g, dtype=torch.float64), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(steps)]


def train(algorithm: str, fault: Fault | None = None, flush_at: int | None = None, steps: int = 6, model=None,
          batches=None, arm_at: int = ARM_AT, **options):
    """Losses (None for the failed or flushed step), the final state, and the step that failed."""
    pipe = pipecore.Pipeline(mlp() if model is None else model, options.pop("num_stages", 3), algorithm, n_microbatches=4,
                             optimizer=options.pop("optimizer", pipecore.SGD(lr=0.05, momentum=0.9)),
                             loss_fn=options.pop("loss_fn", nn.CrossEntropyLoss()), **options)
    batches = batches or data(steps)
    losses: list[float | None] = []
    failed = None
    for j, (x, y) in enumerate(batches):
        if j == flush_at:
            pipe.flush()
            losses.append(None)
            continue
        if fault is not None and j == arm_at:
            fault.arm(pipe)
        try:
            losses.append(pipe.step(x, y))
        except (Injected, KeyboardInterrupt, pipecore.NonFiniteLoss) as exc:
            assert "training can continue" in exc.__notes__[-1], exc.__notes__
            failed = j
            losses.append(None)
    try:
        pipe.flush()
    except Injected as exc:  # the last mini-batch's remaining update failed in the flush: it is the one dropped
        assert "training can continue" in exc.__notes__[-1], exc.__notes__
        failed, losses[-1] = len(batches) - 1, None
    return losses, pipe.state_dict(), failed


def check_like_a_flush(algorithm: str, fault: Fault, **options) -> int:
    """Train with ``fault``; it must fire, and the run must equal one that flushed instead of the failed step."""
    losses, state, failed = train(algorithm, fault, **options)
    assert fault.fired and failed is not None
    expected = train(algorithm, flush_at=failed, **options)
    assert_same((losses, state), expected[:2], f"{algorithm}: failed at step {failed}")
    return failed


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("kind", ["F", "B", "U"])
def test_a_failed_action_of_the_newest_minibatch_is_undone(algorithm, stage, kind):
    """The action fails after its compute (gradients added, weights written, nothing sent); the stage threads
    stop the other stages wherever they are."""
    check_like_a_flush(algorithm, Fault(stage, kind, when="end", target="newest"), concurrent=True)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("kind", ["F", "B", "U"])
def test_an_action_that_fails_before_it_starts_runs_again(algorithm, stage, kind):
    """The first action of the kind after arming, which under the asynchronous schedules belongs to an earlier
    mini-batch still in flight: it left no trace, so the drain runs it again. Stages in turn, one thread."""
    check_like_a_flush(algorithm, Fault(stage, kind, when="start", target="first"), concurrent=False)


@pytest.mark.parametrize("algorithm,stages_per_rank,kind", [
    (algorithm, spr, kind) for algorithm, spr, kinds in [("zb-h1", 1, "FBWU"), ("zb-v", 2, "FBWU"),
                                                         ("interleaved-1f1b", 2, "FBU")] for kind in kinds])
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("when", ["start", "end"])
def test_a_failed_action_of_a_split_or_interleaved_schedule_is_undone(algorithm, stages_per_rank, stage, kind, when):
    """Several stages per rank, the backward split into B and W: a failure (in any kind, W included, on a rank
    holding two stages) is taken back like a flush; weight gradients still waiting for their W when it struck
    are kept for the drain (or dropped with their mini-batch)."""
    check_like_a_flush(algorithm, Fault(stage, kind, when=when, target="newest"), concurrent=True, num_stages=4,
                       stages_per_rank=stages_per_rank)


@pytest.mark.parametrize("concurrent", [False, True])
def test_an_earlier_minibatch_that_fails_midway_is_dropped_with_the_later_ones(concurrent):
    """pipedream's stage 0 runs the previous mini-batch's backwards during a step: one that fails after adding
    its gradients cannot run again, so that mini-batch is undone too, as if flush() had been called in its
    place and the next one never given."""
    batches = data(6)
    pipe = pipecore.Pipeline(mlp(), 3, "pipedream", 4, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=pipecore.SGD(lr=0.05, momentum=0.9), concurrent=concurrent)
    losses: list = [pipe.step(x, y) for x, y in batches[:3]]
    Fault(0, "B", when="end", target="first").arm(pipe)
    with pytest.raises(Injected) as info:
        pipe.step(*batches[3])
    assert "mini-batches 2..3 since the last flush were dropped" in info.value.__notes__[-1]
    losses[2:] = [None, None]
    losses += [pipe.step(x, y) for x, y in batches[4:]]
    pipe.flush()
    reference = pipecore.Pipeline(mlp(), 3, "pipedream", 4, loss_fn=nn.CrossEntropyLoss(),
                                  optimizer=pipecore.SGD(lr=0.05, momentum=0.9))
    expected: list = [reference.step(x, y) for x, y in batches[:2]]
    reference.flush()
    expected += [None, None] + [reference.step(x, y) for x, y in batches[4:]]
    reference.flush()
    assert_same((losses, pipe.state_dict()), (expected, reference.state_dict()))


@pytest.mark.parametrize("algorithm", ["1f1b", "pipedream"])
def test_the_first_step_failing_leaves_a_fresh_pipeline(algorithm):
    losses, state, failed = train(algorithm, Fault(1, "B"), steps=4, arm_at=0)
    assert failed == 0 and losses[0] is None
    assert_same((losses, state), train(algorithm, flush_at=0, steps=4)[:2])


@pytest.mark.parametrize("algorithm,most_copied", [("1f1b", 1.0), ("2bw", 0.5), ("i-timeprest", 0.75)])
def test_undo_snapshots_copy_the_weights_only_before_the_ring_loses_them(algorithm, most_copied, monkeypatch):
    """A step's snapshot copies the stage's weights only when their ring slot is about to be written: 1f1b
    updates in place (a copy at every snapshot), 2bw and i-timeprest write the next version into another slot,
    so most snapshots are dropped before their version's slot is reused (at most half of 2bw's copy, three in
    four of i-timeprest's, whose last stage keeps one version). A step that fails after stage 0's
    update is undone exactly as with snapshots that copy at once: from the copies (1f1b), from the ring (2bw),
    or both (i-timeprest's last stage keeps one version)."""
    from pipecore.engine.stage import TensorStage
    from pipecore.engine.state import StageState, StateSnapshot

    def run(copy_at_once: bool) -> tuple:
        taken, copied, undone_from = [], [], []
        with monkeypatch.context() as patch:
            original_snapshot, original_keep = StageState.snapshot, StateSnapshot.keep_weights

            def snapshot(state, *args, **kwargs):
                taken_now = original_snapshot(state, *args, **kwargs)
                if copy_at_once:
                    taken_now.keep_weights(state.ring.live)
                taken.append(taken_now)
                return taken_now

            def keep_weights(self, slot):
                if self.weights is None:
                    copied.append(self)
                original_keep(self, slot)

            original_undo = TensorStage.undo

            def undo(stage, point):
                if point.snapshot is not None:  # whether the weights come back from a copy (or the ring)
                    undone_from.append(point.snapshot.weights is not None)
                original_undo(stage, point)

            patch.setattr(StageState, "snapshot", snapshot)
            patch.setattr(StateSnapshot, "keep_weights", keep_weights)
            patch.setattr(TensorStage, "undo", undo)
            # In turn: with stage threads, when a snapshot is dropped against its stage's next update varies.
            losses, state, failed = train(algorithm, Fault(0, "U", when="end", target="first"), steps=6,
                                          concurrent=False)
        return (losses, state, failed), len({id(s) for s in taken}), len(copied), undone_from

    result, snapshots, copies, undone_from = run(copy_at_once=False)
    reference, _, _, _ = run(copy_at_once=True)
    assert result[2] is not None and undone_from
    if most_copied == 1.0:  # in place: every snapshot copies, and the undo takes the copies
        assert copies == snapshots and all(undone_from)
    else:  # i-timeprest's last stage keeps one version: its snapshots all copy, the other stages' few
        assert 0 < copies <= most_copied * snapshots and not all(undone_from)
    assert_same(result, reference)


@pytest.mark.parametrize("algorithm", ["1f1b", "2bw", "pipedream"])
def test_a_nonfinite_loss_drops_its_minibatch(algorithm):
    batches = data(6)
    x, y = batches[3]
    batches[3] = (torch.full_like(x, math.nan), y)
    losses, state, failed = train(algorithm, batches=batches, concurrent=True)
    assert failed == 3
    assert_same((losses, state), train(algorithm, flush_at=3, batches=batches)[:2])


def test_a_loss_function_error_drops_its_minibatch():
    calls = {"n": 0}

    def loss_fn(out, target):
        calls["n"] += 1
        if calls["n"] == 14:  # in step 3 (4 micro-batches a step)
            raise Injected("the loss function's own error")
        return nn.functional.cross_entropy(out, target)

    losses, state, failed = train("pipedream", loss_fn=loss_fn, concurrent=True)
    assert failed == 3
    calls["n"] = -10 ** 9  # the reference never fails
    assert_same((losses, state), train("pipedream", flush_at=3, loss_fn=loss_fn)[:2])


@pytest.mark.parametrize("concurrent", [False, True])
def test_ctrl_c_during_a_step_drops_its_minibatch(concurrent):
    fault = Fault(1, "B", when="start", target="newest", error=KeyboardInterrupt)
    check_like_a_flush("pipedream", fault, concurrent=concurrent)


@pytest.mark.parametrize("algorithm,stage", [("1f1b", 0), ("pipedream", 2)])
def test_overlapping_steps_raise_the_error_from_the_next_call(algorithm, stage):
    """With overlap_steps the newest mini-batch's last backward fails after step() returned its loss (it runs
    without the next mini-batch's input); the next call into the pipeline raises it, and that mini-batch is
    dropped."""
    batches = data(6)
    pipe = pipecore.Pipeline(mlp(), 3, algorithm, 4, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=pipecore.SGD(lr=0.05, momentum=0.9), overlap_steps=True)
    losses = [pipe.step(x, y) for x, y in batches[:3]]
    returned = threading.Event()
    fault = Fault(stage, "B", when="end", target="next-last", gate=returned)
    fault.arm(pipe)
    losses.append(pipe.step(*batches[3]))  # returns once the last stage has the loss
    returned.set()
    with pytest.raises(Injected) as info:
        pipe.synchronize()
    assert fault.fired and "mini-batch 3 since the last flush was dropped" in info.value.__notes__[-1]
    losses[3] = None
    losses += [pipe.step(x, y) for x, y in batches[4:]]
    pipe.flush()
    assert_same((losses, pipe.state_dict()), train(algorithm, flush_at=3, batches=batches)[:2])


@pytest.mark.parametrize("algorithm", ["1f1b", "pipedream"])
@pytest.mark.parametrize("stage,kind", [(0, "B"), (2, "U"), (0, "U")])
def test_tied_weights_are_undone_with_their_exchange(algorithm, stage, kind):
    """The GPT's head is tied to its embedding (stages 0 and 2): undoing the newest mini-batch withdraws its
    posted tied gradients and gives back the groups its updates reduced."""
    def gpt():
        torch.manual_seed(0)
        return GPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16).double()

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 16, (8, 8), generator=g), torch.randint(0, 16, (8, 8), generator=g)) for _ in range(6)]
    options = dict(loss_fn=lambda out, t: nn.functional.cross_entropy(out.flatten(0, 1), t.flatten()),
                   partition=["blocks.0", "blocks.1"], batches=batches, model_factory=gpt)
    check_like_a_flush_model(algorithm, Fault(stage, kind), **options)


def check_like_a_flush_model(algorithm: str, fault: Fault, model_factory, **options) -> None:
    losses, state, failed = train(algorithm, fault, model=model_factory(), concurrent=True, **options)
    assert fault.fired and failed is not None
    expected = train(algorithm, flush_at=failed, model=model_factory(), **options)
    assert_same((losses, state), expected[:2], f"{algorithm}: failed at step {failed}")


@pytest.mark.parametrize("kind", ["B", "U"])
def test_global_norm_clipping_forgets_the_undone_update(kind):
    check_like_a_flush("1f1b", Fault(0, kind), clip_grad_norm=0.05, concurrent=True)


def test_a_torch_lr_scheduler_counts_back():
    factory = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # noqa: E731
    check_like_a_flush("pipedream", Fault(1, "U"), lr_scheduler=factory, optimizer=pipecore.AdamW(lr=0.01))


def test_batchnorm_statistics_and_dropout_masks_are_taken_back():
    def model():
        return mlp(extra=(nn.BatchNorm1d(8), nn.Dropout(0.3)))

    check_like_a_flush_model("2bw", Fault(2, "F"), model_factory=model)
    check_like_a_flush_model("pipedream", Fault(2, "B"), model_factory=model)


def test_checkpoints_work_after_a_failed_step():
    pipe = pipecore.Pipeline(mlp(), 3, "pipedream", 4, loss_fn=nn.CrossEntropyLoss())
    batches = data(4)
    pipe.step(*batches[0])
    Fault(2, "F").arm(pipe)
    with pytest.raises(Injected):
        pipe.step(*batches[1])
    assert pipe.in_flight == 0  # the earlier mini-batch completed, as by a flush
    state = pipe.state_dict()
    other = pipecore.Pipeline(mlp(seed=5), 3, "pipedream", 4, loss_fn=nn.CrossEntropyLoss())
    other.load_state_dict(state)
    assert_same(pipe.step(*batches[2]), other.step(*batches[2]))


def test_recover_false_keeps_no_copies_and_stops_at_an_error():
    pipe = pipecore.Pipeline(mlp(), 3, "pipedream", 4, loss_fn=nn.CrossEntropyLoss(), recover=False)
    batches = data(4)
    pipe.step(*batches[0])
    assert all(not st.undo_points for st in pipe.stages.values())
    Fault(2, "F").arm(pipe)
    with pytest.raises(Injected) as info:
        pipe.step(*batches[1])
    assert "recover=False" in info.value.__notes__[-1] and "cannot continue" in info.value.__notes__[-1]
    with pytest.raises(RuntimeError, match="an earlier run stopped at an error"):
        pipe.step(*batches[2])
    with pytest.raises(TypeError, match="recover must be True or False"):
        pipecore.Pipeline(mlp(), 3, "pipedream", 4, loss_fn=nn.CrossEntropyLoss(), recover=1)
