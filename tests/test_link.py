"""The link layer (``pipecore.runtime.link``) between two real ranks over gloo on loopback (``link_run.py``):
frames and their acknowledgements, a failure notice and the resync after it, delivery at exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import launch_ranks  # noqa: E402
import link_run  # noqa: E402

SCRIPT = str(Path(__file__).parent / "link_run.py")


def launch(*args: str, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Start the two ranks of the test script and wait for both."""
    results = launch_ranks(SCRIPT, 2, *args, timeout=timeout)
    for r in results:
        assert r.returncode == 0, r.stdout
    return results


def frame(i: int) -> tuple[int, list[float]]:
    return i, link_run.body(i).tolist()


def test_frames_make_the_round_trip_and_acknowledge_each_other(tmp_path):
    """Frames whose size changes every time, two receives posted ahead each way: each arrives whole and in
    order, the announcements count as frames on both ends, and each answer acknowledges the frames taken, so
    rank 0 holds no send after a round and rank 1 only its last answer (with its announcements)."""
    launch("round-trip", str(tmp_path))
    records = [torch.load(tmp_path / f"round-trip-{rank}.pt", weights_only=False) for rank in range(2)]
    assert records[1]["got"] == [frame(i) for i in range(link_run.ROUND_TRIPS)]
    assert records[0]["got"] == [frame(i + 100) for i in range(link_run.ROUND_TRIPS)]
    for rank in range(2):
        sent = records[rank]["sent"][("test", 1 - rank)]
        assert sent == records[1 - rank]["received"] and sent > link_run.ROUND_TRIPS, (rank, sent)
        assert records[rank]["held after close"] == 0
    assert records[0]["held"] == [0] * link_run.ROUND_TRIPS
    assert max(records[1]["held"]) <= 3, records[1]["held"]  # an answer and the 2 announcements of its size


def test_a_failure_notice_reaches_the_peer_and_the_streams_go_on_after_resync(tmp_path):
    """The notice ends the peer's wait at once (its timeout is 60 s) with a PeerError that carries the cause; a
    second notice before the resync is not sent. The resync keeps the frame sent after the notice and drops the
    notices; afterwards both streams carry frames again."""
    launch("notice", str(tmp_path))
    sender, receiver = (torch.load(tmp_path / f"notice-{rank}.pt", weights_only=False) for rank in range(2))
    assert receiver["first"] == frame(0)
    assert receiver["cause"] == link_run.CAUSE
    assert receiver["error"] == f"rank 1: rank 0 reports that {link_run.CAUSE}", receiver["error"]
    assert receiver["elapsed"] < 10, receiver["elapsed"]
    # Rank 0 sent three frames of three sizes, each after an announcement: frame 0, one notice, frame 1.
    assert sender["counts"][0] == {("test", 1): 6}
    assert sender["counts"][1] == {("test", 0): 2}  # the cause passed back: an announcement and the notice
    assert receiver["kept"] == [frame(1)] and sender["kept"] == []
    assert receiver["after"] == frame(2) and sender["after"] == frame(3)


def test_sends_still_held_at_exit_are_delivered(tmp_path):
    """A rank that ends its script with frames still waiting for their receives (only one is posted at a time)
    delivers them all before its process exits."""
    launch("exit", str(tmp_path))
    assert int((tmp_path / "exit-0.txt").read_text()) >= link_run.AT_EXIT
    assert torch.load(tmp_path / "exit-1.pt") == [frame(i) for i in range(link_run.AT_EXIT)]
