"""Multi-process pipelines (gloo on loopback) against the one-process executor."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch

import pipecore
from pipecore import checkpoint
from pipecore.algorithms import get_algorithm
from pipecore.schedule import B, F
from pipecore.schedule.links import messages_ahead

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import free_port, launch_ranks  # noqa: E402
import dist_run  # noqa: E402
from _same import assert_same  # noqa: E402

SCRIPT = str(Path(__file__).parent / "dist_run.py")
EXAMPLE = str(Path(__file__).parent.parent / "examples" / "train_mlp.py")


def launch(world: int, *args: str, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Start ``world`` ranks of the test script and wait for all of them."""
    return launch_ranks(SCRIPT, world, *args, timeout=timeout)


def local_run(world: int, algorithm: str):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run with one thread each; keep reductions identical
    try:
        pipe = dist_run.make_pipeline(world, algorithm)
        losses = dist_run.train(pipe, dist_run.batches(dist_run.STEPS), True, True)
        return losses, pipe.state_dict(), pipe
    finally:
        torch.set_num_threads(threads)


def _check_ok(results):
    for r in results:
        assert r.returncode == 0, r.stdout


@pytest.mark.parametrize("world,algorithms", [
    (2, ["gpipe", "1f1b", "pipedream", "2bw", "i-timeprest"]),
    (4, ["1f1b", "pipedream", "2bw"]),
])
def test_gpt_with_a_tied_head_is_bit_identical_across_processes(world, algorithms, tmp_path):
    """A captured GPT (tied embedding and head on the first and last rank, sequence length changing between
    steps) trains bit for bit as in one process; the owners' copies of the tied weight agree."""
    _check_ok(launch(world, "gpt", str(tmp_path), ",".join(algorithms)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for algorithm in algorithms:
            pipe = dist_run.make_gpt_pipeline(world, algorithm)
            losses = dist_run.train(pipe, dist_run.gpt_batches(dist_run.STEPS), True, True)
            state = pipe.state_dict()
            parts = [torch.load(tmp_path / f"{algorithm}-{rank}.pt") for rank in range(world)]
            for rank, part in enumerate(parts):
                assert part["losses"] == losses, (algorithm, rank)
                for key, value in part["state"].items():
                    if key != "pipecore":
                        assert torch.equal(value, state[key]), (algorithm, rank, key)
            assert torch.equal(parts[0]["state"]["tok_emb.weight"], parts[-1]["state"]["head.weight"]), algorithm
    finally:
        torch.set_num_threads(threads)


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """The ranks run with one thread each: so does the one-process reference (identical reductions)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def assert_rank_matches(part: dict, losses: list[float], state: dict, where: tuple) -> None:
    """A rank's saved losses and stage state equal the one-process run's, bit for bit."""
    assert part["losses"] == losses, where
    for key, value in part["state"].items():
        if key != "pipecore":
            assert torch.equal(value, state[key]), (*where, key)


def test_gradient_clipping_is_bit_identical_across_processes(tmp_path):
    """The ranks gather their squared norms and add them in stage order, as one process adds its stages'."""
    algorithms = ["gpipe", "1f1b", "pipedream"]
    _check_ok(launch(2, "clip", str(tmp_path), ",".join(algorithms)))
    with one_torch_thread():
        for algorithm in algorithms:
            pipe = dist_run.make_pipeline(2, algorithm, clip_grad_norm=dist_run.CLIP)
            losses = dist_run.train(pipe, dist_run.batches(dist_run.STEPS), True, True)
            state, stats = pipe.state_dict(), pipe.stats()
            assert max(st["grad_norm"] for st in stats) > dist_run.CLIP
            for rank in range(2):
                part = torch.load(tmp_path / f"clip-{algorithm}-{rank}.pt")
                assert_rank_matches(part, losses, state, (algorithm, rank))
                assert part["stats"][0]["grad_norm"] == stats[rank]["grad_norm"], (algorithm, rank)
        pipe = dist_run.make_gpt_pipeline(2, "1f1b", clip_grad_norm=dist_run.CLIP)
        losses = dist_run.train(pipe, dist_run.gpt_batches(dist_run.STEPS), True, True)
        for rank in range(2):
            assert_rank_matches(torch.load(tmp_path / f"clip-gpt-{rank}.pt"), losses, pipe.state_dict(), ("gpt", rank))


def test_learning_rate_schedules_and_set_lr_are_bit_identical_across_processes(tmp_path):
    """Each rank steps its stage's scheduler on its own update count, as each stage does in one process."""
    algorithms = ["1f1b", "pipedream", "spectrain"]
    _check_ok(launch(2, "lr", str(tmp_path), ",".join(algorithms)))
    with one_torch_thread():
        for algorithm in algorithms:
            losses, pipe, fixed = dist_run.lr_runs(2, algorithm, True, True)
            state, fixed_state = pipe.state_dict(), fixed.state_dict()
            for rank in range(2):
                part = torch.load(tmp_path / f"lr-{algorithm}-{rank}.pt")
                assert_rank_matches(part, losses, state, (algorithm, rank))
                assert_rank_matches({"losses": losses, "state": part["fixed"]}, losses, fixed_state, (algorithm, rank))
                assert part["fixed"]["pipecore"]["stages"][rank]["lr"] == 0.03


@pytest.mark.parametrize("world,algorithms,split", [
    # (the V placements, zb-v and dualpipe-v, put two stages on each rank: test_modern_schedules_across_processes)
    (2, [a for a in pipecore.algorithm_names() if a not in ("zb-v", "dualpipe-v")], "unsplit"),
    (4, ["1f1b", "pipedream", "2bw", "i-timeprest"], "unsplit"),
    # split_backward sends the input gradient before computing weight gradients; the one-process
    # reference does not split, so this also checks that splitting changes no bit.
    (2, ["1f1b", "2bw", "pipemare", "spectrain", "i-timeprest"], "split"),
    (2, ["2bw+slack", "pipedream+slack"], "unsplit"),
])
def test_multiprocess_is_bit_identical_to_one_process(world, algorithms, split, tmp_path):
    _check_ok(launch(world, "compare", str(tmp_path), ",".join(algorithms), split))
    for algorithm in algorithms:
        losses, state, _ = local_run(world, algorithm)
        seen = set()
        for rank in range(world):
            got = torch.load(tmp_path / f"{algorithm}-{rank}.pt", weights_only=False)
            assert got["losses"] == losses, f"{algorithm}: rank {rank} reports other losses"
            for key, value in got["state"].items():
                if key == "pipecore":
                    assert set(value["stages"]) == {rank}
                    mine = state["pipecore"]["stages"][rank]
                    assert value["stages"][rank]["version"] == mine["version"]
                    continue
                assert torch.equal(value, state[key]), f"{algorithm}: {key} differs on rank {rank}"
                seen.add(key)
        assert seen == set(state) - {"pipecore"}, f"{algorithm}: the ranks together must hold the whole model"


def test_checkpoints_move_between_ranks_and_one_process(tmp_path):
    world, algorithm = 2, "pipedream"
    # one process writes a checkpoint the ranks will resume
    losses, _, pipe = local_run(world, algorithm)
    checkpoint.save(pipe, tmp_path / "local-ckpt")
    _check_ok(launch(world, "checkpoint", str(tmp_path), algorithm))
    # the ranks' checkpoint, resumed in one process, continues exactly like the uninterrupted run
    uninterrupted = dist_run.make_pipeline(world, algorithm)
    resumed = dist_run.make_pipeline(world, algorithm)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dist_run.train(uninterrupted, dist_run.batches(dist_run.STEPS), True, True)
        checkpoint.load(resumed, tmp_path / "ckpt")
        for pipe in (uninterrupted, resumed):
            dist_run.train(pipe, dist_run.batches(2, seed=5), True, True)
    finally:
        torch.set_num_threads(threads)
    a, b = uninterrupted.state_dict(), resumed.state_dict()
    for key in a:
        if key != "pipecore":
            assert torch.equal(a[key], b[key]), key
    # and the ranks that resumed the one-process checkpoint match it too
    for rank in range(world):
        got = torch.load(tmp_path / f"resumed-{rank}.pt", weights_only=False)
        for key, value in got["state"].items():
            if key != "pipecore":
                assert torch.equal(value, a[key]), key


def test_a_save_that_cannot_complete_fails_on_every_rank_and_commits_nothing(tmp_path):
    _check_ok(launch(2, "save", str(tmp_path)))
    errors = [torch.load(tmp_path / f"save-{rank}.pt") for rank in range(2)]
    elapsed, alone = errors[0].pop("alone")
    assert "rank 1" in alone and "(timeout 5 s)" in alone and "every rank must call" in alone, alone
    assert 4.5 < elapsed < 15, (elapsed, alone)
    assert not (tmp_path / "alone").exists()
    # The last rank has no backward in flight after a step; it still learns that rank 0 has.
    assert errors[0] == errors[1]
    assert "rank 0" in errors[0]["in-flight"] and "in flight" in errors[0]["in-flight"]
    assert not (tmp_path / "in-flight").exists()  # checked before anything is written
    assert "stage001-" in errors[0]["unshared"] and "every rank sees" in errors[0]["unshared"]
    for rank in range(2):  # nothing committed, and every rank removed the file it wrote
        assert not any((tmp_path / f"unshared-{rank}").iterdir())
    # The same pipeline then saves to one directory; that checkpoint is whole.
    resumed = dist_run.make_pipeline(2, "pipedream")
    checkpoint.load(resumed, tmp_path / "shared")
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == sorted(
        [checkpoint.MANIFEST] + json.loads((tmp_path / "shared" / checkpoint.MANIFEST).read_text())["files"])


@pytest.mark.parametrize("how", ["exit", "stall"])
def test_a_dead_or_silent_rank_is_reported_by_name_within_the_timeout(how, tmp_path):
    timeout = 5.0
    start = time.monotonic()
    launch(2, "die", str(tmp_path), str(timeout), how, timeout=120)
    elapsed, message = (tmp_path / "error-0.txt").read_text().split("\n", 1)
    assert "rank 1" in message
    assert float(elapsed) < timeout + 10
    if how == "stall":  # nothing breaks: the error comes from the timeout, not from a closed connection
        assert float(elapsed) > 0.9 * timeout
    assert time.monotonic() - start < 120


def test_messages_queued_at_exit_are_delivered(tmp_path):
    """A rank that exits right after its last step still delivers its last gradients and loss."""
    _check_ok(launch(2, "exit", str(tmp_path)))
    losses = [torch.load(tmp_path / f"losses-{rank}.pt") for rank in range(2)]
    assert losses[0] == losses[1] and len(losses[0]) == dist_run.STEPS


@pytest.mark.parametrize("algorithm", ["pipedream", "2bw+slack", "gpipe"])
def test_sends_held_for_acknowledgement_stay_bounded(algorithm, tmp_path):
    """Each message acknowledges what its sender received, so a long run without flush holds a bounded
    number of sends (about the micro-batches in flight), and a flush completes them all."""
    steps = 24
    _check_ok(launch(2, "held", str(tmp_path), algorithm, str(steps)))
    for rank in range(2):
        held = torch.load(tmp_path / f"held-{rank}.pt")
        assert len(held) == steps + 1 and held[-1] == 0
        # a step's messages: 4 micro-batches, plus an announcement per receive posted ahead (at most the
        # micro-batches) when the batch size changes
        assert max(held[:-1]) <= 2 * (2 * dist_run.MICROBATCHES), held
        assert max(held[steps // 2: -1]) <= max(held[: steps // 2]), held


def test_receives_stay_posted_on_every_incoming_link_between_steps(tmp_path):
    """The next messages on a link are received into buffers posted before they are sent, also across step()
    and flush() (gloo moves a message only once its receive is posted; a late post stalls): as many as the
    schedule lets the sender get ahead on that link (1F1B: P - b on boundary b)."""
    world = 4
    _check_ok(launch(world, "posted", str(tmp_path)))
    ahead = messages_ahead(get_algorithm("1f1b", world, dist_run.MICROBATCHES).schedule(2))
    assert ahead[F, 0] == min(world, dist_run.MICROBATCHES) and ahead[F, 2] == 2
    for rank in range(world):
        incoming = {}
        if rank > 0:
            incoming[f"FORWARD{rank - 1}"] = ahead[F, rank - 1]
        if rank < world - 1:
            incoming[f"BACKWARD{rank}"] = ahead[B, rank]
        assert torch.load(tmp_path / f"posted-{rank}.pt") == [incoming] * 3


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_close_releases_the_process_groups_and_their_threads(tmp_path):
    world = 2
    _check_ok(launch(world, "close", str(tmp_path)))
    for rank in range(world):
        record = torch.load(tmp_path / f"close-{rank}.pt")
        first, *others = record["losses"]
        assert all(losses == first for losses in others)
        # without close, every pipeline keeps its link groups' threads (several per group) until exit
        assert record["threads"][-1] <= record["threads"][0], record["threads"]
        assert "this pipeline was closed" in record["error"]


def test_every_link_is_its_own_two_rank_group(tmp_path):
    """Activations and gradients between each pair of neighbours travel in separate two-rank process
    groups (separate connections), so traffic on one link never holds a lock another link needs."""
    world = 4
    _check_ok(launch(world, "links", str(tmp_path)))
    for rank in range(world):
        record = torch.load(tmp_path / f"links-{rank}.pt")
        assert record.pop("distinct") is True
        expected = {}
        for neighbour in (rank - 1, rank + 1):
            if 0 <= neighbour < world:
                pair = sorted([rank, neighbour])
                for kind in ("FORWARD", "BACKWARD"):
                    expected[kind, neighbour] = (pair, pair.index(neighbour))
        assert record == expected


def test_destroying_the_process_groups_then_exiting_is_clean(tmp_path):
    """A script that calls destroy_process_group() while its pipeline still exists exits with status 0
    (the link groups are released at exit, not during interpreter teardown, where gloo could abort). The
    abort was intermittent, so the run is repeated."""
    for _ in range(3):
        _check_ok(launch(2, "destroy", str(tmp_path)))
        losses = [torch.load(tmp_path / f"losses-{rank}.pt") for rank in range(2)]
        assert losses[0] == losses[1] and len(losses[0]) == 2
    # Gathering the model or saving a checkpoint afterwards is a clear error on every rank, not a hang.
    for rank in range(2):
        full, save = (tmp_path / f"late-{rank}.txt").read_text().splitlines()
        assert full.startswith("RuntimeError: the process group was destroyed"), full
        assert save.startswith("CheckpointError: checkpoint not saved (checking that no backward is in flight): "
                               "the process group was destroyed"), save


def test_every_rank_gets_the_whole_model_and_can_resume_from_it(tmp_path):
    """Each rank keeps only its stage's layers in memory (the others move to the meta device), yet
    full_state_dict() on each rank equals the one-process state_dict (weights and optimizer state of every
    stage, bit for bit); load_state_dict takes that whole-model state on a rank and training continues like
    the one-process run."""
    world, algorithm = 2, "pipedream"
    _check_ok(launch(world, "full", str(tmp_path), algorithm))
    _, state, pipe = local_run(world, algorithm)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        losses = dist_run.train(pipe, dist_run.batches(2, seed=5), True, True)
    finally:
        torch.set_num_threads(threads)
    continued = pipe.state_dict()
    for rank in range(world):
        got = torch.load(tmp_path / f"full-{rank}.pt", weights_only=False)
        assert list(got["full"]) == list(state)
        assert_same(got["full"], state)
        assert got["stages"] == [0, 1]
        assert got["losses"] == losses
        # The rank's copy of the other stage's layers holds no memory (and cannot run by mistake).
        own = set(pipe.stages[rank].module.state_dict())
        assert got["devices"] == {k: "cpu" if k in own else "meta" for k in got["devices"]}
        assert set(got["devices"]) == set(state) - {"pipecore"}
        for key, value in got["state"].items():
            if key != "pipecore":
                assert torch.equal(value, continued[key]), key


def test_a_nonfinite_loss_is_skipped_on_every_rank_or_raised_and_reported(tmp_path):
    """on_nonfinite="skip": every rank skips the update group of a NaN loss, so weights and losses equal the
    one-process run's bit for bit (rank 0 never sees the loss; it learns of it from the gradient messages).
    on_nonfinite="raise": the last rank raises NonFiniteLoss, the other a PeerError that gives it as the cause."""
    algorithms = ["gpipe", "pipedream", "2bw"]
    _check_ok(launch(2, "nonfinite", str(tmp_path), ",".join(algorithms)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for algorithm in algorithms:
            pipe = dist_run.make_pipeline(2, algorithm, on_nonfinite="skip")
            losses = dist_run.train(pipe, dist_run.poisoned_batches(), True, True)
            state = pipe.state_dict()
            assert [math.isnan(x) for x in losses] == [False, True, False, False]
            for rank in range(2):
                got = torch.load(tmp_path / f"skip-{algorithm}-{rank}.pt", weights_only=False)
                assert repr(got["losses"]) == repr(losses), f"{algorithm}: rank {rank}"
                for key, value in got["state"].items():
                    if key != "pipecore":
                        assert torch.equal(value, state[key]), f"{algorithm}: {key} on rank {rank}"
                        assert torch.isfinite(value).all()
    finally:
        torch.set_num_threads(threads)
    last = (tmp_path / "raise-1.txt").read_text()
    assert last.startswith("NonFiniteLoss: non-finite loss nan at stage 1"), last
    other = (tmp_path / "raise-0.txt").read_text()
    assert other.startswith("PeerError: rank 0: rank 1 reports that NonFiniteLoss at stage 1 (rank 1)"), other


@pytest.mark.parametrize("failing,kind,at", [(0, "F", 6), (1, "B", 5)])
def test_every_rank_raises_with_the_cause_of_another_ranks_failure(tmp_path, failing, kind, at):
    """Three ranks; one action of one rank raises. That rank raises its own error; the others, wherever they
    wait (for an activation, a gradient or a loss), learn the cause from a failure notice passed along the
    links, instead of waiting for their timeout (120 s here) to name a silent neighbour."""
    _check_ok(launch(3, "cause", str(tmp_path), str(failing), kind, str(at)))
    for rank in range(3):
        text = (tmp_path / f"cause-{rank}.txt").read_text()
        action = f"{failing}{kind}{at - 1}"
        if rank == failing:
            assert text == f"RuntimeError: injected failure in {action}", text
        else:
            assert text.startswith(f"PeerError: rank {rank}: rank ") and text.endswith(
                f"reports that RuntimeError at stage {failing} (rank {failing}), action {action}: injected failure "
                f"in {action}"), text


def test_a_failed_step_is_taken_back_on_every_rank(tmp_path):
    """Two ranks; for gpipe, 1f1b, 2bw, pipedream and i-timeprest, one action (F, B or U) of either rank fails
    after its compute. Every rank undoes the same mini-batches and completes the earlier ones; the loop gives
    the undone ones again (data[pipe.minibatches]). Losses and every rank's weights, versions and optimizer
    state equal, bit for bit, a one-process run that called flush() in place of the first undone mini-batch."""
    _check_ok(launch(2, "recover", str(tmp_path)))
    with one_torch_thread():
        for algorithm, failing, kind in dist_run.RECOVER_CASES:
            assert_taken_back_like_a_flush(tmp_path / f"recover-{algorithm}-{failing}-{kind}",
                                           f"{algorithm}, rank {failing} fails at {kind}",
                                           dist_run.make_pipeline(2, algorithm), dist_run.batches(dist_run.STEPS + 2))


def assert_taken_back_like_a_flush(prefix: Path, where: str, pipe, data) -> list[dict]:
    """Both ranks' records (``<prefix>-<rank>.pt``) agree on the first undone mini-batch, and their losses and
    states equal ``pipe`` (one process) trained on ``data`` with a flush in its place. Returns the records."""
    got = [torch.load(f"{prefix}-{rank}.pt", weights_only=False) for rank in range(2)]
    failed_at = got[0]["failed_at"]
    assert failed_at is not None and got[1]["failed_at"] == failed_at, where
    losses = [pipe.step(x, y) for x, y in data[:failed_at]]
    pipe.flush()
    losses += [pipe.step(x, y) for x, y in data[failed_at:]]
    pipe.flush()
    state = pipe.state_dict()
    for rank in range(2):
        assert repr(got[rank]["losses"]) == repr(losses), f"{where}: losses on rank {rank}"
        for key, value in got[rank]["state"].items():
            if key == "pipecore":
                assert_same(value["stages"][rank], state["pipecore"]["stages"][rank], where)
            else:
                assert torch.equal(value, state[key]), f"{where}: {key} on rank {rank}"
    return got


def test_a_failed_step_with_global_norm_clipping_is_taken_back_on_every_rank(tmp_path):
    """gpipe and 1f1b with clip_grad_norm on 2 ranks, whose updates exchange their gradient norms: a failure
    of either rank at F, B or U is taken back on both (a rank waiting for the other's norm learns of it from a
    notice; a 20 s wait would be a dead rank). Equal, bit for bit, to the one-process run that flushed."""
    _check_ok(launch(2, "recover-clip", str(tmp_path)))
    with one_torch_thread():
        for algorithm, failing, kind in dist_run.RECOVER_CLIP_CASES:
            assert_taken_back_like_a_flush(tmp_path / f"recover-clip-{algorithm}-{failing}-{kind}",
                                           f"{algorithm} with clipping, rank {failing} fails at {kind}",
                                           dist_run.make_pipeline(2, algorithm, clip_grad_norm=dist_run.CLIP),
                                           dist_run.batches(dist_run.STEPS + 2))


def test_the_last_tied_gradient_is_taken_after_its_sender_has_left(tmp_path):
    """Taking a message posts the receive of the next one ahead; a peer that has finished and closed its
    connection makes that post fail, which is no error until a next message is waited for
    (dist_run.ties_last_message)."""
    _check_ok(launch(2, "ties-last", str(tmp_path)))
    records = [torch.load(tmp_path / f"ties-last-{rank}.pt", weights_only=False) for rank in range(2)]
    expected = dist_run.tie_gradient(0, 0, 0) + dist_run.tie_gradient(1, 0, 0)
    for rank, record in enumerate(records):
        assert_same(record["sum"], expected, f"rank {rank}")
    assert "error" not in records[0]
    assert "rank 0" in records[1]["error"], records[1]["error"]


def test_the_tied_gradient_exchange_is_taken_back_after_a_failure(tmp_path):
    """Two owners of a tie (dist_run.ties_undo): a failure notice ends the other owner's wait in reduce with the
    cause; after withdraw, unreduce and resync, the groups before the first undone one are reduced from what
    was kept (given back, or still on its way and taken by resync), and the groups posted again are matched with
    their new values, not the withdrawn ones still on their way. Sums in float64, bit for bit."""
    _check_ok(launch(2, "ties-undo", str(tmp_path)))
    records = [torch.load(tmp_path / f"ties-undo-{rank}.pt", weights_only=False) for rank in range(2)]

    def total(group: int, generation: int) -> torch.Tensor:
        return dist_run.tie_gradient(0, group, generation) + dist_run.tie_gradient(1, group, generation)

    expected = {(0, 0): total(0, 0), (1, 0): total(1, 0), (2, 0): total(2, 0), (1, 1): total(1, 0),
                (2, 1): total(2, 1), (3, 1): total(3, 1)}
    assert sorted(records[0]["sums"]) == sorted(expected)
    assert sorted(records[1]["sums"]) == [(0, 0), (1, 1), (2, 1), (3, 1)]
    for rank, record in enumerate(records):
        for key, value in record["sums"].items():
            assert_same(value, expected[key], f"rank {rank}, group {key[0]}, generation {key[1]}")
        assert record["errors"]["forgotten"] == f"rank {rank} did not reduce update groups [3], or they were forgotten"
    assert not torch.equal(total(2, 0), total(2, 1))  # a withdrawn group reduced by mistake would show
    assert records[0]["errors"]["reduce"] == ("rank 0: rank 1 reports that RuntimeError at stage 1: injected",
                                              "RuntimeError at stage 1: injected")


def test_a_failed_step_with_tied_weights_is_taken_back_on_every_rank(tmp_path):
    """A GPT whose head is tied to its embedding (one copy on each of 2 ranks); for 1f1b, pipedream and 2bw, one
    action (F, B or U) of either rank fails after its compute. Every rank also takes back its tied gradients'
    exchange (withdraws its undone posts, reduces again what its undone updates reduced, drops the withdrawn
    gradients still on their way); an owner waiting for the failed rank's tied gradient learns of the failure
    at once (a wait for the timeout, 20 s, would be a dead rank: unrecoverable). Losses and every rank's state
    equal, bit for bit, a one-process run that flushed in place of the first undone mini-batch."""
    _check_ok(launch(2, "recover-gpt", str(tmp_path)))
    with one_torch_thread():
        for algorithm, failing, kind in dist_run.RECOVER_GPT_CASES:
            where = f"{algorithm}, rank {failing} fails at {kind}"
            got = assert_taken_back_like_a_flush(tmp_path / f"recover-gpt-{algorithm}-{failing}-{kind}", where,
                                                 dist_run.make_gpt_pipeline(2, algorithm),
                                                 dist_run.gpt_batches(dist_run.STEPS + 2))
            assert torch.equal(got[0]["state"]["tok_emb.weight"], got[1]["state"]["head.weight"]), where


def test_world_size_must_equal_num_stages(tmp_path):
    _check_ok(launch(2, "mismatch", str(tmp_path)))
    message = (tmp_path / "error-0.txt").read_text()
    assert "has 2 ranks but num_stages=3" in message and "torchrun --nproc-per-node 3" in message


def _outside_any_rank() -> dict[str, str]:
    """This environment without a rank's variables, as a user's shell would be."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") and not k.startswith("TORCHELASTIC")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _torchrun(*args: str, cwd: Path, program: tuple[str, ...] = (EXAMPLE,)) -> subprocess.Popen:
    """``torchrun *args PROGRAM`` in ``cwd`` (default: examples/train_mlp.py)."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args, *program], cwd=cwd,
                            env=_outside_any_rank(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen], timeout: float = 240) -> str:
    outputs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, out
        outputs.append(out)
    return "\n".join(outputs)


def test_the_example_prints_the_same_losses_alone_under_torchrun_and_on_two_nodes(tmp_path):
    """examples/train_mlp.py, as the docs run it: alone; under ``torchrun --nproc-per-node 4``; and as two
    ``torchrun --nnodes 2 --nproc-per-node 2`` agents that meet at a c10d rendezvous (two machines, here on
    loopback). All print the same losses, which fall, and all write a complete checkpoint."""
    alone, one_node, two_nodes = tmp_path / "alone", tmp_path / "one_node", tmp_path / "two_nodes"
    for folder in (alone, one_node, two_nodes):
        folder.mkdir()
    one = subprocess.run([sys.executable, EXAMPLE], cwd=alone, env=_outside_any_rank(), capture_output=True,
                         text=True, timeout=240)
    assert one.returncode == 0, one.stdout + one.stderr
    standalone = _finish([_torchrun("--standalone", "--nproc-per-node", "4", cwd=one_node)])
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = _finish([_torchrun("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                               endpoint, "--rdzv-id", "example", cwd=two_nodes) for _ in range(2)])

    def losses(output: str) -> list[float]:
        return [float(line.rsplit(" ", 1)[1]) for line in output.splitlines() if line.startswith("step ")]

    expected = losses(one.stdout)
    assert len(expected) == 5 and expected[-1] < 0.5 * expected[0], one.stdout
    # Only rank 0 prints, so each run shows the five losses once.
    assert losses(standalone) == expected, standalone
    assert losses(nodes) == expected, nodes
    for folder in (alone, one_node, two_nodes):
        assert (folder / "checkpoints" / "train_mlp" / "manifest.json").is_file()


def test_pipecore_train_under_torchrun_matches_one_process_and_checkpoints_move_between_them(tmp_path):
    """``torchrun --nproc-per-node 2 -m pipecore train --stages 2``: rank 0 alone prints; the losses, test
    accuracies (through pipe.predict, every rank running its stage) and the checkpoint equal the one-process run's;
    each run resumes the other's checkpoint and both continue identically."""
    settings = ["train", "--stages", "2", "--algorithm", "pipedream", "--hidden", "32", "--batch-size", "32",
                "--no-progress"]

    def alone(*args: str) -> str:
        run = subprocess.run([sys.executable, "-m", "pipecore", *settings, *args], cwd=tmp_path,
                             env=_outside_any_rank(), capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, run.stdout + run.stderr
        return run.stdout

    def ranks(*args: str) -> str:
        return _finish([_torchrun("--standalone", "--nproc-per-node", "2", cwd=tmp_path,
                                  program=("-m", "pipecore", *settings, *args))])

    def report(output: str) -> list[str]:
        """Epoch, loss and test accuracy of every epoch line, and the final accuracy (times vary)."""
        return re.findall(r"^ *\d+ +\d+\.\d{4} +\d+\.\d\d%|^test accuracy .*$", output, re.MULTILINE)

    one = alone("--epochs", "2", "--save", "alone.pt")
    two = ranks("--epochs", "2", "--save", "ranks.pt")
    assert two.count("epoch      loss") == 1 and "one process per rank: 2 ranks (gloo)" in two, two
    assert len(report(one)) == 3 and report(two) == report(one), two
    stage_rows = [line.split()[0] for line in two[two.index("stage  layers"):].splitlines()[1:3]]
    assert stage_rows == ["0", "1"], two  # rank 0 reports both ranks' stages
    a = torch.load(tmp_path / "alone.pt", weights_only=False)
    b = torch.load(tmp_path / "ranks.pt", weights_only=False)
    assert_same(b["pipeline"], a["pipeline"])
    assert b["history"] == a["history"]

    resumed_alone = alone("--epochs", "3", "--resume", "ranks.pt", "--save", "alone3.pt")
    resumed_ranks = ranks("--epochs", "3", "--resume", "alone.pt", "--save", "ranks3.pt")
    assert report(resumed_ranks) == report(resumed_alone) and len(report(resumed_alone)) == 4
    assert_same(torch.load(tmp_path / "ranks3.pt", weights_only=False)["pipeline"],
                torch.load(tmp_path / "alone3.pt", weights_only=False)["pipeline"])


#: ``algorithm:chunks:stages_per_rank[:clip]`` on 4 ranks: every new schedule, one and two stages per rank where
#: allowed, a weight tied across the first and last stage (on one rank in the V placements, on two otherwise).
MODERN_CONFIGS = ["interleaved-1f1b:4:1", "interleaved-1f1b:8:2", "looped-bfs:4:1", "looped-bfs:8:2", "zb-h1:4:1",
                  "zb-h1:8:2", "zb-v:8:2", "dualpipe-v:8:2", "zb-v:8:2:clip"]


def test_modern_schedules_across_processes(tmp_path):
    """Interleaved, looped and zero-bubble schedules with one process per rank (several stages on each, the
    messages between two stages of one rank staying in the process) train bit for bit as in one process, and
    predict() goes round the ranks the same way."""
    world = 4
    _check_ok(launch(world, "modern", str(tmp_path), ",".join(MODERN_CONFIGS), timeout=400))
    with one_torch_thread():
        for config in MODERN_CONFIGS:
            algorithm, chunks, spr, *extra = config.split(":")
            kwargs = {"clip_grad_norm": dist_run.CLIP} if extra == ["clip"] else {}
            pipe = dist_run.make_modern_pipeline(algorithm, int(chunks), int(spr), **kwargs)
            losses = dist_run.train(pipe, dist_run.tied_batches(3), True, True)
            prediction = pipe.predict(dist_run.tied_batches(1, seed=7)[0][0])
            state = pipe.state_dict()
            held = []
            for rank in range(world):
                got = torch.load(tmp_path / f"{config.replace(':', '-')}-{rank}.pt", weights_only=False)
                assert got["stages"] == sorted(s for s in range(int(chunks)) if pipe.placement[s] == rank), config
                assert got["losses"] == losses, (config, rank)
                assert torch.equal(got["prediction"], prediction), (config, rank)
                for key, value in got["state"].items():
                    if key != "pipecore":
                        assert torch.equal(value, state[key]), (config, rank, key)
                        held.append(key)
            assert set(held) == set(state) - {"pipecore"}, config  # (a tied weight is held by two ranks)


def test_a_world_size_that_is_not_the_number_of_ranks_is_refused(tmp_path):
    results = launch(2, "modern", str(tmp_path), "zb-v:8:2", timeout=120)
    for r in results:
        assert r.returncode != 0
        assert "the process group has 2 ranks but num_stages=8 needs 4" in r.stdout, r.stdout
        assert "one process per rank (2 stages each)" in r.stdout, r.stdout


# --------------------------------------------------------------------------- data x pipeline parallelism

DP_ALGORITHMS = ["gpipe", "1f1b", "pipedream", "2bw", "pipemare", "spectrain", "timeprest", "v-timeprest",
                 "i-timeprest"]


def one_process_on_the_global_batch(stages: int, algorithm: str, replicas: int, **kwargs):
    """The reference: one process training the global mini-batches, each reordered so that its micro-batch k
    holds every replica's micro-batch k (what an algorithm that updates per micro-batch sees under data
    parallelism)."""
    if algorithm == "gpt":
        pipe = dist_run.make_gpt_pipeline(stages, "1f1b", **kwargs)
        data = dist_run.dp_gpt_batches(dist_run.STEPS)
    else:
        pipe = dist_run.make_pipeline(stages, algorithm, **kwargs)
        data = dist_run.dp_batches(dist_run.STEPS)
    m = pipe.n_microbatches
    data = [(dist_run.as_one_process(x, replicas, m), dist_run.as_one_process(y, replicas, m)) for x, y in data]
    return dist_run.train(pipe, data, True, True), pipe.state_dict()


def assert_close_to(got_losses, got_state, losses, state, where) -> None:
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), rtol=0, atol=1e-12, msg=str(where))
    for key, value in got_state.items():
        if key != "pipecore":
            torch.testing.assert_close(value, state[key], rtol=0, atol=1e-12, msg=f"{where}: {key}")


@pytest.mark.parametrize("world,stages,algorithms", [
    (4, 2, DP_ALGORITHMS + ["gpt"]),
    (8, 4, ["1f1b", "2bw", "gpt"]),
])
def test_data_parallel_replicas_equal_one_process_on_the_global_batch(world, stages, algorithms, tmp_path):
    """W = world / stages replicas of the pipeline, each reading its share of every mini-batch: every rank ends
    with the losses and weights of one process training the global mini-batches (within rounding: the
    replicas' gradients are summed in another order), the GPT's tied head included."""
    _check_ok(launch(world, "dp", str(tmp_path), ",".join(algorithms), str(stages), timeout=600))
    with one_torch_thread():
        for algorithm in algorithms:
            losses, state = one_process_on_the_global_batch(stages, algorithm, world // stages)
            replicas = set()
            for rank in range(world):
                got = torch.load(tmp_path / f"dp-{algorithm}-{rank}.pt", weights_only=False)
                replicas.add(got["replica"])
                assert_close_to(got["losses"], got["state"], losses, state, (algorithm, rank))
            assert replicas == set(range(world // stages))


def test_data_parallel_clipping_local_shards_mesh_and_checkpoints(tmp_path):
    _check_ok(launch(4, "dp-features", str(tmp_path), timeout=400))
    with one_torch_thread():
        clipped = one_process_on_the_global_batch(2, "1f1b", 2, clip_grad_norm=dist_run.CLIP)
        plain = one_process_on_the_global_batch(2, "1f1b", 2)
        for rank in range(4):
            record = torch.load(tmp_path / f"dp-features-{rank}.pt", weights_only=False)
            assert_close_to(*record["clip"], *clipped, ("clip", rank))       # the global norm over both dimensions
            assert_close_to(*record["local"], *plain, ("local", rank))      # step(shard, local=True)
            losses, state, replica, pipeline_rank = record["mesh"]
            assert (replica, pipeline_rank) == (rank // 2, rank % 2)        # the mesh's row-major layout
            assert_close_to(losses, state, *plain, ("mesh", rank))
        # Replica 0 wrote the checkpoint; it loads into one process (and so with any other number of replicas).
        one = dist_run.make_pipeline(2, "1f1b")
        pipecore.checkpoint.load(one, tmp_path / "ckpt")
        saved = {**torch.load(tmp_path / "dp-features-0.pt", weights_only=False)["saved"],
                 **torch.load(tmp_path / "dp-features-1.pt", weights_only=False)["saved"]}
        for key, value in one.state_dict().items():
            if key != "pipecore":
                assert torch.equal(value, saved[key]), key


def test_a_dead_replica_is_reported_within_the_timeout(tmp_path):
    timeout = 5.0
    start = time.monotonic()
    launch(4, "dp-die", str(tmp_path), str(timeout), timeout=120)
    for rank in (0, 1, 2):
        elapsed, message = (tmp_path / f"error-{rank}.txt").read_text().split("\n", 1)
        assert float(elapsed) < timeout + 15, (rank, elapsed)
        # Its pipeline neighbour names the rank that died; the other replica names the sum it waited for.
        assert "rank 1" in message or "replica" in message, message
    assert time.monotonic() - start < 120


def test_a_world_size_the_replicas_do_not_divide_is_refused(tmp_path):
    results = launch(3, "dp", str(tmp_path), "1f1b", "2", timeout=120)
    for r in results:
        assert r.returncode != 0
        assert "the process group has 3 ranks but num_stages=2 needs 2 x data_parallel=1" in r.stdout or \
            "the process group has 3 ranks but num_stages=2 needs 2" in r.stdout, r.stdout
