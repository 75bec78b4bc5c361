"""What a message costs the host: pipecore's transport against bare gloo send and receive, on 2 ranks.

    python bench/message_cost.py [--messages 2000] [--rounds 7] [--out PATH]

Rank 0 sends a 32 x 512 float32 activation (64 KiB, one micro-batch of ``bench/pipeline.py``'s MLP) to
rank 1, which sends it back as the gradient: a ping-pong, so each round trip is two messages and nothing
else. ``pipecore``: ``DistributedTransport.send`` / ``receive`` over its two-rank link groups, with the
receives posted ahead that a pipeline uses (``receives_ahead=4``). ``gloo``: the same tensor through
``ProcessGroup.send`` / ``recv`` on two two-rank groups, the receive posted just before it is needed and
every send waited for, no packing. Per round trip and rank: process CPU time (every thread of the process,
gloo's I/O threads included) and wall time. The two run alternately in each of ``--rounds`` rounds;
ratios are medians of per-round ratios. The difference is what pipecore's wire format (packing the
payload and its description into one buffer, unpacking views), acknowledgements and Python cost per message.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch

from _machine import OUT_HELP, default_out, machine, write_report
from _ranks import spawn

SHAPE = (32, 512)
SYSTEMS = ("pipecore", "gloo")


def _pipecore(rank: int) -> Callable[[int], None]:
    from pipecore.runtime.distributed import DistributedTransport
    from pipecore.runtime.worker import Message
    from pipecore.schedule.ir import B, F

    transport = DistributedTransport(rank, 2, timeout=60, receives_ahead=4)
    x = torch.randn(SHAPE)
    counter = [0]

    def run(n: int) -> None:
        for _ in range(n):
            k = counter[0]
            counter[0] += 1
            if rank == 0:
                transport.send(1, F, k, Message(x))
                transport.receive(0, B, k)
            else:
                message = transport.receive(1, F, k)
                transport.send(0, B, k, Message(message.payload))

    return run


def _gloo(rank: int) -> Callable[[int], None]:
    import torch.distributed as dist

    forward, backward = dist.new_group([0, 1]), dist.new_group([0, 1])
    x = torch.randn(SHAPE)

    def run(n: int) -> None:
        for _ in range(n):
            if rank == 0:
                sent = forward.send([x], 1, 10)
                buffer = torch.empty(SHAPE)
                backward.recv([buffer], 1, 20).wait()
                sent.wait()
            else:
                buffer = torch.empty(SHAPE)
                forward.recv([buffer], 0, 10).wait()
                backward.send([buffer], 0, 20).wait()

    return run


def worker(messages: int, rounds: int) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    runs = {"pipecore": _pipecore(rank), "gloo": _gloo(rank)}
    for run in runs.values():
        run(100)  # warm up
    cpu: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    wall: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    for r in range(rounds):
        for j in range(len(SYSTEMS)):
            system = SYSTEMS[(j + r) % len(SYSTEMS)]
            dist.barrier()
            c, w = time.process_time(), time.perf_counter()
            runs[system](messages)
            cpu[system].append((time.process_time() - c) / messages * 1e6)
            wall[system].append((time.perf_counter() - w) / messages * 1e6)
    dist.barrier()
    dist.destroy_process_group()
    return {"cpu_us": cpu, "wall_us": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=2000, help="round trips per timed window")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=default_out("message-cost-cpu.json"), help=OUT_HELP)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.messages, args.rounds)))
        return
    if args.messages < 1 or args.rounds < 1:
        raise SystemExit("--messages and --rounds must be at least 1")
    print(f"2 ranks, {args.rounds} rounds of {args.messages} round trips per system ...", file=sys.stderr)
    outputs = spawn(__file__, ["--worker", "--messages", str(args.messages), "--rounds", str(args.rounds)], 2)
    measured = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    results = []
    print(f"{'rank':<6}{'system':<10}{'CPU us per round trip':>23}{'wall us':>10}{'CPU vs gloo':>13}")
    for rank, m in enumerate(measured):
        for system in SYSTEMS:
            ratio = statistics.median(p / g for p, g in zip(m["cpu_us"][system], m["cpu_us"]["gloo"]))
            row = {"rank": rank, "system": system, "cpu_us_median": statistics.median(m["cpu_us"][system]),
                   "wall_us_median": statistics.median(m["wall_us"][system]), "cpu_vs_gloo": ratio}
            results.append(row)
            print(f"{rank:<6}{system:<10}{row['cpu_us_median']:>23.0f}{row['wall_us_median']:>10.0f}{ratio:>12.2f}x")
    report = {
        "benchmark": "message-cost", "device": "cpu", "backend": "gloo", "dtype": "float32",
        "machine": machine(), "ranks": 2, "threads_per_rank": 1, "message_shape": list(SHAPE),
        "message_bytes": SHAPE[0] * SHAPE[1] * 4, "round_trips_per_window": args.messages, "rounds": args.rounds,
        "method": "a ping-pong of one activation and its gradient; systems alternate within each round; process "
                  "CPU and wall time per round trip; CPU ratios are medians of per-round ratios",
        "results": results, "samples": measured,
    }
    print(f"wrote {write_report(report, args.out)}", file=sys.stderr)


if __name__ == "__main__":
    main()
