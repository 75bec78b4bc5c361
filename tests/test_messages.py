"""Messages of several tensors between ranks, and the exchange of tied parameters' gradients.

Multi-process tests run real ranks over gloo on loopback (``msg_run.py``), launched as in
``test_distributed.py``.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pipecore.runtime.distributed import DistributedTransport
from pipecore.runtime.ties import LocalTiedGradients
from pipecore.runtime.transport import LocalTransport, Transport

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import launch_ranks  # noqa: E402
import msg_run  # noqa: E402

SCRIPT = str(Path(__file__).parent / "msg_run.py")


def launch(world: int, *args: str, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Start ``world`` ranks of the test script and wait for all of them."""
    return launch_ranks(SCRIPT, world, *args, timeout=timeout)


def _check_ok(results: list[subprocess.CompletedProcess]) -> None:
    for r in results:
        assert r.returncode == 0, r.stdout


def assert_identical(got: Any, sent: Any, where: str) -> None:
    """Same structure (None, tensor, tuple of the same length with None at the same places), and each tensor
    with the same dtype, shape and values."""
    if sent is None:
        assert got is None, where
    elif isinstance(sent, torch.Tensor):
        assert isinstance(got, torch.Tensor), (where, type(got))
        assert (got.dtype, got.shape) == (sent.dtype, sent.shape), (where, got.dtype, got.shape, sent.dtype, sent.shape)
        assert torch.equal(got, sent), where
    else:
        assert isinstance(got, tuple) and len(got) == len(sent), (where, got)
        for i, (g, s) in enumerate(zip(got, sent)):
            assert not isinstance(s, tuple)
            assert_identical(g, s, f"{where}[{i}]")


def _all_contiguous(flags: Any) -> bool:
    if isinstance(flags, tuple):
        return all(_all_contiguous(f) for f in flags)
    return flags in (None, True)


# The transports' protocol ------------------------------------------------------------------------------

PROTOCOL = {name for name, value in vars(Transport).items() if callable(value) and not name.startswith("_")}


def test_both_transports_implement_every_method_of_the_protocol():
    """Same names, same parameters: the executor and the pipeline can hold either behind ``Transport``."""
    assert {"send", "receive", "abort", "publish_loss", "share", "notify_failure", "resync"} <= PROTOCOL
    for transport in (LocalTransport, DistributedTransport):
        for name in sorted(PROTOCOL):
            method = getattr(transport, name, None)
            assert callable(method), f"{transport.__name__} has no {name}()"
            assert (list(inspect.signature(method).parameters)
                    == list(inspect.signature(getattr(Transport, name)).parameters)), (transport.__name__, name)


def test_the_executor_and_the_pipeline_call_only_the_protocol_on_a_transport():
    """Every method the executor and the pipeline use on their transport is in ``Transport`` (but the local
    mailbox, which the executor's hot path uses directly once it knows the transport is a ``LocalTransport``)."""
    root = Path(__file__).parent.parent / "pipecore"
    # The executor, and the pipeline's modules (building, stepping, recovery, prediction, the localities).
    for paths in ([root / "runtime" / "executor.py"], sorted((root / "engine").glob("*.py"))):
        methods = {method for path in paths
                   for method in re.findall(r"(?<![A-Za-z])_?transport\.(\w+)", path.read_text())}
        assert methods, paths
        assert methods - {"mailbox"} <= PROTOCOL, sorted(methods - {"mailbox"} - PROTOCOL)


# Several tensors per message --------------------------------------------------------------------------


@pytest.mark.parametrize("world,ahead,order", [(2, 1, "lockstep"), (3, 1, "lockstep"), (3, 3, "lockstep"),
                                               (3, 1, "bursts"), (3, 3, "bursts"), (2, 64, "bursts")])
def test_messages_arrive_with_the_structure_dtypes_and_shapes_they_were_sent_with(world, ahead, order, tmp_path):
    """Both directions, on F and B links: single tensors, tuples mixing float64, float32, int64, bool and None,
    1-tuples, empty tuples, None, tensors without elements, with 11 dimensions or none, non-contiguous ones,
    every supported dtype, and layouts that change at every message. With 3 ranks the middle rank resends
    what it received (views into its receive buffer) onwards. With ``ahead`` receives posted per link, a
    size change fills every buffer posted at the old size with an announcement; in bursts a sender sends its
    whole list before its receiver takes any (more messages than receives posted, with 64 fewer)."""
    _check_ok(launch(world, "messages", str(tmp_path), str(ahead), order))
    first = torch.load(tmp_path / "messages-0.pt", weights_only=False)
    last = torch.load(tmp_path / f"messages-{world - 1}.pt", weights_only=False)
    for direction, record in (("F", last), ("B", first)):
        sent = msg_run.payloads(direction)
        got = record["got"][direction]
        assert len(got) == len(sent)
        for i, (g, s) in enumerate(zip(got, sent)):
            assert_identical(g["payload"], s, f"{direction} message {i}")
            assert _all_contiguous(g["contiguous"]), (direction, i, g["contiguous"])
            assert g["tag"] == msg_run.tag_of(i if direction == "F" else i + 1)
            assert g["poisoned"] == (i % 4 == 1 if direction == "F" else i % 5 == 2)
    # Refused on the sender, before anything went out (the run above went on over the same link).
    errors = first["errors"]
    assert len(errors) == 4, errors
    assert errors[0].startswith("ValueError: rank 0: cannot send a tensor of dtype torch.complex64"), errors[0]
    assert "torch.complex128" in errors[1] and errors[1].startswith("ValueError"), errors[1]
    assert errors[2].startswith("TypeError") and "not list" in errors[2], errors[2]
    assert errors[3].startswith("TypeError") and "not int" in errors[3], errors[3]


def test_the_payload_lists_cover_what_the_wire_format_must_handle():
    """Guard for the test above: its payloads do contain the cases it claims."""
    payloads = msg_run.payloads("F") + msg_run.payloads("B")
    tensors = [p for p in payloads if isinstance(p, torch.Tensor)]
    tuples = [p for p in payloads if isinstance(p, tuple)]
    assert any(p is None for p in payloads)
    assert () in tuples and any(len(t) == 1 and t[0] is not None for t in tuples) and (None,) in tuples
    entries = [e for t in tuples for e in t if e is not None] + tensors
    assert {e.dtype for e in entries} >= {torch.float64, torch.float32, torch.int64, torch.bool, torch.bfloat16}
    assert any(e.numel() == 0 for e in entries) and any(e.dim() >= 9 for e in entries)
    assert any(not e.is_contiguous() for e in entries)
    assert any(len(t) > 20 for t in tuples)  # a description longer than one read of the message's end
    lengths = [len(p) if isinstance(p, tuple) else -1 for p in msg_run.alternating_payloads(0)]
    assert len(lengths) == 20 and len(set(lengths)) >= 4


# Tied gradients, one process ---------------------------------------------------------------------------


def _g(stage: int, group: int, shape: tuple[int, ...] = (5, 3), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * stage + group)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 10 ** (stage % 3)).to(dtype)


def test_local_ties_sum_every_owners_gradient_in_stage_order_bit_for_bit():
    ties = LocalTiedGradients({"emb": (0, 3), "ln": (1, 2, 3)})
    grads = {0: {"emb": _g(0, 0)}, 1: {"ln": _g(1, 0, (4,))}, 2: {"ln": _g(2, 0, (4,))},
             3: {"emb": _g(3, 0), "ln": _g(3, 0, (4,))}}
    # Values whose float32 sum depends on the order: (1 + 1e8) - 1e8 == 0, (-1e8 + 1e8) + 1 == 1.
    grads[1]["ln"][0], grads[2]["ln"][0], grads[3]["ln"][0] = 1.0, 1e8, -1e8
    for stage in (3, 1, 0, 2):  # posting order does not matter
        ties.post(stage, 0, {k: v.clone() for k, v in grads[stage].items()})
    emb = grads[0]["emb"] + grads[3]["emb"]
    ln = (grads[1]["ln"] + grads[2]["ln"]) + grads[3]["ln"]
    sums = {stage: ties.reduce(stage, 0) for stage in (2, 0, 3, 1)}
    assert set(sums[0]) == {"emb"} and set(sums[1]) == {"ln"} and set(sums[3]) == {"emb", "ln"}
    for stage, got in sums.items():
        for name, value in got.items():
            expected = emb if name == "emb" else ln
            assert value.dtype == expected.dtype and torch.equal(value, expected), (stage, name)
    # Another order gives another sum here, so the order is really checked.
    assert not torch.equal(ln, (grads[3]["ln"] + grads[2]["ln"]) + grads[1]["ln"])
    assert ties._posted == {} and ties._reduced == {}  # every owner reduced: nothing kept


def test_local_ties_keep_a_copy_and_wait_for_every_owner():
    ties = LocalTiedGradients({"w": (0, 1, 2)})
    for group in range(3):  # stage 2 runs ahead: groups 0, 1, 2 before stage 0 posts group 0
        grad = _g(2, group)
        ties.post(2, group, {"w": grad})
        grad.zero_()  # the caller zeroes its buffer after posting
        assert not ties.ready(2, group)
    with pytest.raises(RuntimeError, match="not posted by"):
        ties.reduce(2, 0)
    ties.post(0, 0, {"w": _g(0, 0)})
    assert not ties.ready(0, 0) and not ties.ready(2, 0)
    ties.post(1, 0, {"w": _g(1, 0)})
    assert ties.ready(0, 0) and ties.ready(1, 0) and ties.ready(2, 0) and not ties.ready(2, 1)
    expected = (_g(0, 0) + _g(1, 0)) + _g(2, 0)
    for stage in (2, 0, 1):
        assert torch.equal(ties.reduce(stage, 0)["w"], expected)
    assert set(ties._posted) == {("w", 1), ("w", 2)}
    with pytest.raises(ValueError, match="increasing order"):
        ties.post(2, 1, {"w": _g(2, 1)})
    with pytest.raises(ValueError, match="owns the ties"):
        ties.post(0, 1, {"v": _g(0, 1)})


def test_local_ties_refuse_a_tie_with_fewer_than_two_owners():
    with pytest.raises(ValueError, match="at least two"):
        LocalTiedGradients({"w": (1,)})
    with pytest.raises(ValueError, match="increasing order"):
        LocalTiedGradients({"w": (2, 0)})


# Tied gradients, one process per stage -----------------------------------------------------------------


@pytest.mark.parametrize("order", ["interleaved", "early", "lazy", "three"])
def test_distributed_ties_sum_the_owners_gradients(order, tmp_path):
    """Ranks 0 and 2 own ``w`` (float64), rank 1 owns nothing; 5 update groups. ``early``: rank 0 posts every
    group before rank 2 posts any. ``lazy``: no shapes given, the receives are posted at the first post.
    ``three``: also ``v`` (float32), owned by all three ranks, its shape learned from the first post."""
    _check_ok(launch(3, "ties", str(tmp_path), order))
    records = [torch.load(tmp_path / f"ties-{rank}.pt", weights_only=False) for rank in range(3)]
    ties = {"w": (0, 2), **({"v": (0, 1, 2)} if order == "three" else {})}
    for rank, record in enumerate(records):
        sums = record["sums"]
        assert sorted(sums) == list(range(msg_run.TIES_GROUPS))
        for group, got in sums.items():
            owned = {name for name, owners in ties.items() if rank in owners}
            assert set(got) == owned, (rank, group)
            for name in owned:
                expected = msg_run.expected_sum(ties[name], group, name)
                assert got[name].dtype == expected.dtype and torch.equal(got[name], expected), (rank, group, name)
        # Acknowledgements let an owner complete its sends on gloo as it goes, not only at close(): at the end
        # one send per other owner and tie is held. Rank 0 posting everything first acknowledges nothing of
        # rank 2's, whose sends are then completed by close().
        pairs = sum(len(owners) - 1 for owners in ties.values() if rank in owners)
        assert record["held"] == (msg_run.TIES_GROUPS if order == "early" and rank == 2 else pairs), (rank, record)
    for group in range(msg_run.TIES_GROUPS):
        assert torch.equal(records[0]["sums"][group]["w"], records[2]["sums"][group]["w"])


@pytest.mark.parametrize("how", ["exit", "stall"])
def test_a_dead_or_silent_owner_is_reported_by_name_within_the_timeout(how, tmp_path):
    timeout = 4.0
    start = time.monotonic()
    results = launch(3, "ties-dead", str(tmp_path), str(timeout), how, timeout=90)
    path = tmp_path / "tie-error-0.txt"
    assert path.exists(), "rank 0 did not report the dead owner:\n" + "\n".join(r.stdout for r in results)
    elapsed, message = path.read_text().split("\n", 1)
    assert message.startswith("rank 0:") and "rank 2" in message and "'w'" in message, message
    assert float(elapsed) < timeout + 10, elapsed
    if how == "stall":  # nothing breaks: only the timeout can tell
        assert float(elapsed) > 0.9 * timeout, elapsed
    assert time.monotonic() - start < 90


def test_the_last_message_is_taken_after_its_sender_has_left(tmp_path):
    """Taking a message posts the receive of the next one ahead; a sender that has finished and closed its
    connection makes that post fail, which is no error until a next message is waited for
    (msg_run._last_message)."""
    results = launch(2, "last-message", str(tmp_path), timeout=90)
    for r in results:
        assert r.returncode == 0, r.stdout
    record = torch.load(tmp_path / "last-message-1.pt", weights_only=False)
    assert torch.equal(record["payload"], msg_run._t(7, (5, 3), torch.float64)) and record["tag"] == 3
    assert "rank 0" in record["error"], record["error"]
