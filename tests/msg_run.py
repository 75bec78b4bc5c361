"""Multi-process message and tied-gradient exchanges for the tests: ``python msg_run.py MODE OUT_DIR [ARGS]``.

Launched once per rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (as torchrun does). The
payloads and gradients come from functions that the test imports too, so it checks what arrived against
what was sent without any exchange of its own.
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
from pipecore.runtime.distributed import DistributedTransport  # noqa: E402
from pipecore.runtime.link import PeerError  # noqa: E402
from pipecore.runtime.ties import DistributedTiedGradients  # noqa: E402
from pipecore.runtime.worker import Message  # noqa: E402
from pipecore.schedule.ir import B, F  # noqa: E402

TIES_GROUPS = 5


def _t(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g, dtype=dtype)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def fixed_payloads(seed: int) -> list[Any]:
    """Every structure the transport must carry, one per message."""
    transposed = _t(seed + 1, (4, 3), torch.float64).t()  # not contiguous; arrives contiguous, same values
    many = tuple(_t(seed + 100 + i, (2, 1, i % 3 + 1), torch.float32) if i % 4 else None for i in range(30))
    return [
        _t(seed, (3, 4), torch.float64),
        (_t(seed + 2, (2, 3), torch.float64), None, _t(seed + 3, (5,), torch.int64), _t(seed + 4, (2, 2), torch.bool),
         _t(seed + 5, (4,), torch.float32), None),
        (_t(seed + 6, (3,), torch.float32),),  # a 1-tuple stays a tuple
        (),
        None,
        (None,),
        (None, None, _t(seed + 7, (1,), torch.int64)),
        _t(seed + 8, (0, 3), torch.float32),  # no elements
        (_t(seed + 9, (2, 0), torch.float64), _t(seed + 10, (0,), torch.bool)),
        _t(seed + 11, (1, 2, 1, 2, 1, 2, 1, 1, 2, 1, 3), torch.float64),  # 11 dimensions
        _t(seed + 12, (), torch.float64),  # 0-dimensional
        transposed,
        tuple(_t(seed + 20 + i, (3, 1), dtype) for i, dtype in enumerate(
            [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
             torch.int8, torch.uint8, torch.bool])),
        _t(seed + 13, (5,), torch.bool),  # 5 bytes: padded
        many,  # a description longer than the words read at once from the end
        _t(seed + 14, (3, 4), torch.float64),
    ]


def alternating_payloads(seed: int, count: int = 20) -> list[Any]:
    """Layouts that change at every message: sizes, tuple lengths, and one shape of the same byte size."""
    out: list[Any] = []
    for i in range(count):
        which = i % 5
        if which == 0:
            out.append(_t(seed + i, (4, 6), torch.float64))
        elif which == 1:
            out.append(_t(seed + i, (6, 4), torch.float64))  # same bytes as before, another shape: no announcement
        elif which == 2:
            out.append((_t(seed + i, (4 + i, 2), torch.float32), None, _t(seed + 50 + i, (i,), torch.int64)))
        elif which == 3:
            out.append((_t(seed + i, (2, 2), torch.bool),))
        else:
            out.append(None if i % 10 == 4 else
                       tuple(_t(seed + 70 * i + k, (k + 1,), torch.float64) for k in range(i % 7)))
    return out


def payloads(direction: str) -> list[Any]:
    """What goes forward (rank 0 to the last rank) or backward, in order."""
    if direction == "F":
        return fixed_payloads(0) + alternating_payloads(1000)
    return alternating_payloads(2000, 25) + fixed_payloads(3000)[::-1]


def tag_of(i: int) -> int | None:
    return None if i % 3 == 0 else i


def _describe(payload: Any) -> Any:
    """Contiguity of every received tensor, for the test (lost by torch.save of a view otherwise)."""
    if isinstance(payload, torch.Tensor):
        return payload.is_contiguous()
    if isinstance(payload, tuple):
        return tuple(_describe(p) for p in payload)
    return None


def _received(message: Message) -> dict[str, Any]:
    payload = message.payload
    copy = payload.clone() if isinstance(payload, torch.Tensor) else (
        tuple(None if p is None else p.clone() for p in payload) if isinstance(payload, tuple) else payload)
    return {"payload": copy, "contiguous": _describe(payload), "tag": message.tag, "poisoned": message.poisoned}


def _grad(stage: int, group: int, name: str = "w") -> torch.Tensor:
    dtype, shape = (torch.float64, (3, 4)) if name == "w" else (torch.float32, (7,))
    return _t(10_000 + 100 * stage + group + (50 if name != "w" else 0), shape, dtype)


def expected_sum(owners: tuple[int, ...], group: int, name: str = "w") -> torch.Tensor:
    parts = [_grad(o, group, name) for o in owners]
    total = parts[0] + parts[1]
    for p in parts[2:]:
        total = total + p
    return total


def _messages(rank: int, world: int, out: str, ahead: int = 1, order: str = "lockstep") -> None:
    """``order``: "lockstep" interleaves the two directions message by message; "bursts" sends every forward
    message before any backward one, so a sender runs up to the whole list ahead of its receiver."""
    transport = DistributedTransport(rank, world, timeout=60, receives_ahead=ahead)
    forward, backward = payloads("F"), payloads("B")
    got: dict[str, list] = {"F": [], "B": []}
    errors: list[str] = []
    if rank == 0:
        # Refused before anything is sent: the link stays usable.
        for bad in (torch.zeros(2, dtype=torch.complex64), (torch.ones(2), torch.zeros(1, dtype=torch.complex128)),
                    [torch.ones(1)], (torch.ones(1), 3)):
            try:
                transport.send(1, F, 0, Message(bad))
            except (TypeError, ValueError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
    steps = max(len(forward), len(backward))
    rounds = [(i, i) for i in range(steps)] if order == "lockstep" else (
        [(i, None) for i in range(len(forward))] + [(None, i) for i in range(len(backward))])
    for f, b in rounds:
        # Forward: rank 0 sends, middle ranks relay (what they received, resent as is), the last rank keeps it.
        if f is not None and f < len(forward):
            i = f
            if rank == 0:
                message = Message(forward[i], tag_of(i), poisoned=i % 4 == 1)
            else:
                message = transport.receive(rank, F, i)
                if rank == world - 1:
                    got["F"].append(_received(message))
            if rank < world - 1:
                transport.send(rank + 1, F, i, message)
        if b is not None and b < len(backward):
            i = b
            if rank == world - 1:
                message = Message(backward[i], tag_of(i + 1), poisoned=i % 5 == 2)
            else:
                message = transport.receive(rank, B, i)
                if rank == 0:
                    got["B"].append(_received(message))
            if rank > 0:
                transport.send(rank - 1, B, i, message)
    transport.close()
    torch.save({"got": got, "errors": errors}, os.path.join(out, f"messages-{rank}.pt"))


def _ties(rank: int, world: int, out: str, order: str) -> None:
    """Ranks 0 and 2 own ``w`` (float64); with ``three``, every rank also owns ``v`` (float32)."""
    ties: dict[str, tuple[int, ...]] = {"w": (0, 2)}
    if order == "three":
        ties["v"] = (0, 1, 2)
    owned = [name for name, owners in ties.items() if rank in owners]
    shapes = {"w": (torch.Size([3, 4]), torch.float64)} if order != "lazy" else None
    exchange = DistributedTiedGradients(ties, rank, timeout=60, shapes=shapes)
    sums: dict[int, dict[str, torch.Tensor]] = {}
    if order == "early" and rank == 0:  # every group posted before rank 2 posts any
        for group in range(TIES_GROUPS):
            exchange.post(rank, group, {name: _grad(rank, group, name) for name in owned})
        for group in range(TIES_GROUPS):
            assert exchange.ready(rank, group)
            sums[group] = exchange.reduce(rank, group)
    else:
        if order == "early":
            time.sleep(1.0)
        for group in range(TIES_GROUPS):
            grads = {name: _grad(rank, group, name) for name in owned}
            exchange.post(rank, group, grads)
            for g in grads.values():
                g.zero_()  # as the caller does: the exchange must have its own copy
            sums[group] = exchange.reduce(rank, group)
    held = exchange.links.held()
    exchange.close()
    torch.save({"sums": sums, "held": held}, os.path.join(out, f"ties-{rank}.pt"))


def _ties_dead(rank: int, world: int, out: str, timeout: float, how: str) -> None:
    exchange = DistributedTiedGradients({"w": (0, 2)}, rank, timeout=timeout,
                                        shapes={"w": (torch.Size([3, 4]), torch.float64)})
    owned = ["w"] if rank in (0, 2) else []
    exchange.post(rank, 0, {name: _grad(rank, 0, name) for name in owned})
    exchange.reduce(rank, 0)
    if rank == 2:
        exchange.wait_sends()  # group 0 reaches rank 0 before this rank dies (an exit would drop the send)
        if how == "stall":
            time.sleep(timeout + 3)  # alive, connections open, but silent past the timeout
        os._exit(0)
    if rank == 1:
        exchange.close()
        return
    start = time.monotonic()
    try:
        # Sending to a rank that already exited may fail at once; either way the error names it.
        exchange.post(rank, 1, {"w": _grad(rank, 1)})
        exchange.reduce(rank, 1)
    except PeerError as exc:
        with open(os.path.join(out, f"tie-error-{rank}.txt"), "w") as f:
            f.write(f"{time.monotonic() - start:.3f}\n{exc}")
    exchange.close(deliver=False)
    os._exit(0)  # a gloo group with a dead member can hang in teardown; the record is written


def _last_message(rank: int, world: int, out: str) -> None:
    """Rank 0 sends one activation, closes and leaves; rank 1 takes it only once rank 0 has closed its
    connection (taking a message posts the receive of the next one ahead, which then cannot be posted), then
    waits for a second one that never comes. Saves what rank 1 received and the error of the second wait."""
    transport = DistributedTransport(rank, world, timeout=20)
    if rank == 0:
        transport.send(1, F, 0, Message(_t(7, (5, 3), torch.float64), 3))
        transport.close()
        dist.destroy_process_group()
        return
    time.sleep(3)  # rank 0 sends, closes and leaves meanwhile
    message = transport.receive(1, F, 0)
    record: dict[str, Any] = {"payload": message.payload, "tag": message.tag}
    try:
        transport.receive(1, F, 1)
    except PeerError as exc:
        record["error"] = str(exc)
    transport.close(deliver=False)
    torch.save(record, os.path.join(out, "last-message-1.pt"))
    dist.destroy_process_group()


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    if mode == "messages":
        _messages(rank, world, out, *(int(sys.argv[3]), sys.argv[4]) if len(sys.argv) > 3 else ())
    elif mode == "ties":
        _ties(rank, world, out, sys.argv[3])
    elif mode == "ties-dead":
        _ties_dead(rank, world, out, float(sys.argv[3]), sys.argv[4])
        return
    elif mode == "last-message":
        _last_message(rank, world, out)
        return
    else:
        raise SystemExit(f"unknown mode {mode}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
