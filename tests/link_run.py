"""The link layer between two real ranks, for the tests: ``python link_run.py MODE OUT_DIR``.

Launched once per rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (as torchrun does). Each rank
holds one stream to the other rank and one from it, paired, on two two-rank groups (one per direction); the
frames' bodies come from :func:`body`, which the test imports too.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent.parent))
from pipecore.runtime.link import Incoming, Links, Outgoing, PeerError  # noqa: E402

ROUND_TRIPS = 12
CAUSE = "RuntimeError at stage 0 (rank 0), action 0F3: injected"
AT_EXIT = 6  # frames rank 0 leaves unsent at exit


def body(i: int) -> torch.Tensor:
    """The body of frame ``i``: float64 values, 0 to 9 of them, so that the size changes from frame to frame."""
    return torch.arange(i * 10, i * 10 + (i * 7) % 10, dtype=torch.float64)


def _streams(rank: int, timeout: float, ahead: int) -> tuple[Links, Outgoing, Incoming]:
    """This rank's links: a stream to the other rank on the group of its own direction, one back, paired."""
    links = Links(rank, datetime.timedelta(seconds=timeout), torch.device("cpu"))
    groups = [dist.new_group([0, 1]), dist.new_group([0, 1])]  # groups[r]: what rank r sends
    other = 1 - rank
    outgoing = links.send_to("test", groups[rank], other, other, 7, "test frames", ahead=ahead)
    incoming = links.receive_from("test", groups[other], other, other, 7, "the next test frame", ahead=ahead)
    links.pair(outgoing, incoming)
    return links, outgoing, incoming


def _send(outgoing: Outgoing, i: int) -> None:
    b = body(i)
    outgoing.send(b, [i, b.numel()])


def _take(incoming: Incoming, what: str) -> tuple[int, list[float]]:
    """The number and the values of the next frame."""
    buffer, _, tail = incoming.take(what)
    return _decode(buffer, tail)


def _decode(buffer: torch.Tensor, tail: list[int]) -> tuple[int, list[float]]:
    i, n = tail[-5], tail[-4]  # the frame's words, before the 3-word trailer
    return i, buffer[: 8 * n].view(torch.float64).tolist()


def _round_trip(rank: int, out: str) -> None:
    """Rank 0 sends frame ``i``, rank 1 takes it and sends frame ``i + 100`` back, ``ROUND_TRIPS`` times, with
    two receives posted ahead each way (every size change costs two announcements). Records what each rank
    took, the sends it held after each round, and the counts."""
    links, outgoing, incoming = _streams(rank, 60, ahead=2)
    got, held = [], []
    for i in range(ROUND_TRIPS):
        if rank == 0:
            _send(outgoing, i)
            got.append(_take(incoming, f"answer {i}"))
        else:
            got.append(_take(incoming, f"frame {i}"))
            _send(outgoing, i + 100)
        held.append(links.held())
    record: dict[str, Any] = {"got": got, "held": held, "sent": links.sent_counts(),
                              "received": incoming.received}
    links.close()
    record["held after close"] = links.held()
    torch.save(record, os.path.join(out, f"round-trip-{rank}.pt"))


def _notice(rank: int, out: str) -> None:
    """Rank 0 sends frame 0, stops at an error (a failure notice) and sends frame 1; rank 1 takes frame 0, then
    waits for the next one and gets the notice: a PeerError with the cause, long before the timeout. It passes
    the cause on (a notice back). Both resync: rank 1 keeps frame 1 (sent before the counts were shared), rank 0
    drops the notice. The streams then go on: frame 2 one way, frame 3 the other."""
    timeout = 60
    links, outgoing, incoming = _streams(rank, timeout, ahead=1)
    record: dict[str, Any] = {"kept": []}
    if rank == 0:
        _send(outgoing, 0)
        links.notify_failure(CAUSE)
        links.notify_failure("a second failure")  # once until resync: not sent
        _send(outgoing, 1)
    else:
        record["first"] = _take(incoming, "frame 0")
        start = time.monotonic()
        try:
            _take(incoming, "frame 1")
        except PeerError as exc:
            record["elapsed"], record["error"], record["cause"] = time.monotonic() - start, str(exc), exc.cause
            links.notify_failure(f"{exc.cause}")
    counts: list[Any] = [None, None]
    dist.all_gather_object(counts, links.sent_counts())
    record["counts"] = counts
    links.resync(counts, lambda stream, buffer, array, tail: record["kept"].append(_decode(buffer, tail)))
    if rank == 0:
        _send(outgoing, 2)
        record["after"] = _take(incoming, "frame 3")
    else:
        record["after"] = _take(incoming, "frame 2")
        _send(outgoing, 3)
    links.close()
    torch.save(record, os.path.join(out, f"notice-{rank}.pt"))


def _exit(rank: int, out: str) -> None:
    """Rank 0 sends ``AT_EXIT`` frames with one receive posted ahead (so most wait on rank 0 for theirs) and
    ends without closing anything; rank 1 starts taking them only after rank 0 is done. Delivery at exit
    completes the sends before rank 0's process ends: every frame arrives."""
    links, outgoing, incoming = _streams(rank, 60, ahead=1)
    if rank == 0:
        for i in range(AT_EXIT):
            _send(outgoing, i)
        with open(os.path.join(out, "exit-0.txt"), "w") as f:
            f.write(str(links.held()))
        return  # the script ends here: the sends are completed at exit
    time.sleep(3)  # rank 0 has reached its exit meanwhile
    got = [_take(incoming, f"frame {i}") for i in range(AT_EXIT)]
    links.close()
    torch.save(got, os.path.join(out, "exit-1.pt"))
    dist.destroy_process_group()


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    if mode == "round-trip":
        _round_trip(rank, out)
    elif mode == "notice":
        _notice(rank, out)
    elif mode == "exit":
        _exit(rank, out)
        return
    else:
        raise SystemExit(f"unknown mode {mode}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
