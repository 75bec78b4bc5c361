"""When gloo moves a message: a receive posted before its message is sent, against one posted after.

    python bench/post_latency.py [--repeats 200] [--out PATH]

gloo sends a point-to-point message only once the receiver has posted its receive (the receiver's
"ready" notice reaches the sender's I/O thread, which then writes the data). This measures it on 2 ranks
over loopback, one thread each, with a 64 KiB message (one activation of ``bench/pipeline.py``'s
micro-batch) in a two-rank group of its own, as pipecore's links are. Rank 1 posts the receive either
before rank 0 sends (``early``) or 3 ms after (``late``); meanwhile rank 0 either waits for its send
(``sender idle``) or computes matrix products for 5 ms (``sender busy``), as a pipeline's upstream rank
does. Reported per case, median and 90th percentile over the repeats (cases interleaved): the time rank
1's receive call takes to return (posting only), and the delivery time, from the later of the send and the
post to the message's arrival (both ranks read the same monotonic clock; the send time travels in the
message).
This is why pipecore keeps a receive posted on every incoming link, also between steps
(docs/distributed.md, "Receives posted ahead, across steps").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from _machine import OUT_HELP, default_out, machine, write_report
from _ranks import spawn

NUMEL = 8192  # float64 (the send time must survive in it): 64 KiB, like 32 x 512 float32
CASES = [(post, sender) for post in ("early", "late") for sender in ("idle", "busy")]
DELAY_MS, BUSY_MS = 3.0, 5.0


def compute_for(ms: float, a: torch.Tensor) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        a @ a


def worker(repeats: int) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    link = dist.new_group([0, 1])
    a = torch.randn(256, 256)
    message, buffer = torch.randn(NUMEL, dtype=torch.float64), torch.empty(NUMEL, dtype=torch.float64)
    posting: dict[str, list[float]] = {f"{p}, sender {s}": [] for p, s in CASES}
    delivery: dict[str, list[float]] = {k: [] for k in posting}
    for i in range(repeats + 2):  # the first two rounds warm up
        for post, sender in CASES:
            dist.barrier()
            if rank == 0:
                if post == "early":
                    compute_for(DELAY_MS, a)  # rank 1 posts first
                message[0] = time.perf_counter()  # the machine-wide monotonic clock rank 1 reads too
                work = link.send([message], 1, 0)
                if sender == "busy":
                    compute_for(BUSY_MS, a)
                work.wait()
            else:
                if post == "late":
                    compute_for(DELAY_MS, a)  # rank 0 has sent by now
                start = time.perf_counter()
                work = link.recv([buffer], 0, 0)
                posted = time.perf_counter()
                work.wait()
                done = time.perf_counter()
                if i >= 2:
                    posting[f"{post}, sender {sender}"].append((posted - start) * 1e6)
                    delivery[f"{post}, sender {sender}"].append((done - max(start, buffer[0].item())) * 1e6)
    dist.destroy_process_group()
    return {"posting_us": posting, "delivery_us": delivery}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200, help="messages per case")
    parser.add_argument("--out", default=default_out("post-latency-cpu.json"), help=OUT_HELP)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.repeats)))
        return
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    print(f"2 ranks, {args.repeats} messages per case ...", file=sys.stderr)
    measured = json.loads(spawn(__file__, ["--worker", "--repeats", str(args.repeats)], 2)[1].strip().splitlines()[-1])
    results = []
    print(f"{'case':<26}{'posting: median':>16}{'p90':>9}{'delivery: median':>18}{'p90':>9}  (us)")
    for case, posting in measured["posting_us"].items():
        delivery = measured["delivery_us"][case]
        row = {"case": case, "posting_median_us": statistics.median(posting), "posting_p90_us": percentile(posting, 0.9),
               "delivery_median_us": statistics.median(delivery), "delivery_p90_us": percentile(delivery, 0.9)}
        results.append(row)
        print(f"{case:<26}{row['posting_median_us']:>16.0f}{row['posting_p90_us']:>9.0f}"
              f"{row['delivery_median_us']:>18.0f}{row['delivery_p90_us']:>9.0f}")
    report = {
        "benchmark": "post-latency", "device": "cpu", "backend": "gloo", "dtype": "float64",
        "machine": machine(), "ranks": 2, "threads_per_rank": 1, "message_bytes": NUMEL * 8,
        "repeats": args.repeats, "late_post_delay_ms": DELAY_MS, "sender_busy_ms": BUSY_MS,
        "method": "cases interleaved; rank 1's receive call timed to its return (posting), and the message "
                  "from the later of send and post to its arrival (delivery); the first two rounds are not counted",
        "results": results, "samples_us": measured,
    }
    print(f"wrote {write_report(report, args.out)}", file=sys.stderr)


if __name__ == "__main__":
    main()
