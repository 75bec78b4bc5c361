"""Fused pipecore ops vs the best torch composite doing the same work.

For each op and size: median time of the fused op (``pipecore.ops``: C++ on CPU, Triton on CUDA),
median time of the torch composite, their ratio (composite / fused, >1 means fused is faster) and
the fused op's effective bandwidth (the bytes the op must move at least: every input read once,
every output written once). On CUDA the run also measures device-to-device copy bandwidth with
CUDA events, the practical ceiling for these memory-bound kernels.

Composites (the update ops write the next ring slot ``S`` from the live slot ``L``, as the engine
does without fused kernels):

=============  ========================================================================================
interpolate    ``torch.lerp(live, stale, alpha, out=out)``
predict        ``torch.add(w, v, alpha=-scale, out=out)``
sgd            ``S.copy_(L)`` + ``torch.optim.SGD([S], momentum=0.9, foreach=True).step()``
sgd_delta      the above + ``torch.sub(S, L, out=tmp)`` + ``delta.lerp_(tmp, 1 - delta_decay)``
adamw          ``S.copy_(L)`` + the faster of ``torch.optim.AdamW(foreach=True)`` and ``(fused=True)``
nadam          ``S.copy_(L)`` + the faster of ``torch.optim.NAdam(foreach=True)`` and ``(foreach=False)``
               (torch has no ``fused=True`` NAdam)
=============  ========================================================================================

Usage::

    python bench/kernels.py                       # CPU, float32, 1M,4M,16M,64M elements
    python bench/kernels.py --threads 1,2 --runs 3  # each thread count, three times over
    python bench/kernels.py --streaming off       # CPU: ordinary stores only (or `on`; --store-bytes 16)
    python bench/kernels.py --device cuda --sizes 16M,64M --dtype bfloat16

Results go to ``bench/out/kernels-<device>[-<dtype>].json`` (``--out`` overrides; the committed results are in
bench/results/).
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import pipecore.ops as ops
from _machine import OUT_HELP, cpu_name, default_out, write_report

OPS = ("interpolate", "predict", "sgd", "sgd_delta", "adamw", "nadam")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def size_label(n: int) -> str:
    for suffix, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)


class Timer:
    """Median wall time of callables: perf_counter on CPU, CUDA events on GPU.

    :meth:`pair` alternates the two callables rep by rep, so background load or clock changes
    affect both sides of a comparison alike.
    """

    def __init__(self, device: torch.device, warmup: int, reps: int, min_time: float = 0.2, max_reps: int = 200
                 ) -> None:
        self.device, self.warmup, self.reps = device, warmup, reps
        self.min_time, self.max_reps = min_time, max_reps

    def _once(self, fn: Callable[[], Any]) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def pair(self, a: Callable[[], Any], b: Callable[[], Any]) -> tuple[float, float]:
        est = 0.0
        for _ in range(max(self.warmup, 1)):
            est = self._once(a) + self._once(b)
        # At least `reps` pairs, more for fast ops: about min_time per side, at most max_reps.
        reps = max(self.reps, min(self.max_reps, math.ceil(2 * self.min_time / max(est, 1e-9))))
        ta, tb = [], []
        for _ in range(reps):
            ta.append(self._once(a))
            tb.append(self._once(b))
        return statistics.median(ta), statistics.median(tb)

    def __call__(self, fn: Callable[[], Any]) -> float:
        return self.pair(fn, lambda: None)[0]


def _rand(n: int, dtype: torch.dtype, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(n, device=device, dtype=torch.float32) * scale).to(dtype)


def bench_op(name: str, n: int, dtype: torch.dtype, device: torch.device, timer: Timer) -> dict[str, Any]:
    es = torch.empty((), dtype=dtype).element_size()
    sd = ops.state_dtype(dtype)
    ss = torch.empty((), dtype=sd).element_size()
    result: dict[str, Any] = {"op": name, "numel": n, "size": size_label(n)}
    if name in ("interpolate", "predict"):
        a, b = _rand(n, dtype, device), _rand(n, dtype, device)
        out = torch.empty_like(a)
        if name == "interpolate":
            fused = lambda: ops.interpolate(a, b, 0.25, out=out)  # noqa: E731
            composite = lambda: torch.lerp(a, b, 0.25, out=out)  # noqa: E731
            result["composite"] = "torch.lerp(out=)"
        else:
            fused = lambda: ops.predict(a, b, 0.01, out=out)  # noqa: E731
            composite = lambda: torch.add(a, b, alpha=-0.01, out=out)  # noqa: E731
            result["composite"] = "torch.add(alpha=, out=)"
        nbytes = 3 * n * es
        result["fused_s"], result["composite_s"] = timer.pair(fused, composite)
    elif name in ("sgd", "sgd_delta"):
        with_delta = name == "sgd_delta"
        live = _rand(n, dtype, device)
        grad = _rand(n, dtype, device, 1e-3)
        slot = torch.empty_like(live)
        buf = torch.zeros(n, dtype=sd, device=device)
        delta = torch.zeros(n, dtype=sd, device=device) if with_delta else None
        hp = dict(lr=1e-3, momentum=0.9)

        def fused() -> None:
            ops.sgd_step(live, grad, buf, out=slot, delta=delta, delta_decay=0.5 if with_delta else None, **hp)

        param = torch.nn.Parameter(live.clone())
        param.grad = grad.clone()
        opt = torch.optim.SGD([param], foreach=True, **hp)
        cdelta = torch.zeros(n, dtype=sd, device=device)
        tmp = torch.empty(n, dtype=sd, device=device)

        def composite() -> None:
            with torch.no_grad():
                param.copy_(live)
            opt.step()
            if with_delta:
                torch.sub(param.detach(), live, out=tmp)
                cdelta.lerp_(tmp, 0.5)

        nbytes = n * (3 * es + 2 * ss + (2 * ss if with_delta else 0))
        result["fused_s"], result["composite_s"] = timer.pair(fused, composite)
        result["composite"] = "copy + SGD(foreach=True)" + (" + sub + lerp" if with_delta else "")
    elif name in ("adamw", "nadam"):
        live = _rand(n, dtype, device)
        grad = _rand(n, dtype, device, 1e-3)
        slot = torch.empty_like(live)
        m = torch.zeros(n, dtype=sd, device=device)
        v = torch.zeros(n, dtype=sd, device=device)
        hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
        step = [0]
        mu_product = [1.0]

        def fused() -> None:
            step[0] += 1
            if name == "adamw":
                ops.adamw_step(live, grad, m, v, step=step[0], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=1e-2, out=slot)
                return
            mu_product[0] *= ops.nadam_mu(step[0], 0.9, 4e-3)
            ops.nadam_step(live, grad, m, v, step=step[0], mu_product=mu_product[0], lr=1e-3, beta1=0.9,
                           beta2=0.999, eps=1e-8, weight_decay=1e-2, momentum_decay=4e-3, out=slot)

        nbytes = n * (3 * es + 4 * ss)
        best = None
        # torch's AdamW has a foreach and a fused implementation; its NAdam a foreach and a per-tensor loop.
        torch_opt, variants = ((torch.optim.AdamW, (("foreach", True), ("fused", True))) if name == "adamw"
                               else (torch.optim.NAdam, (("foreach", True), ("foreach", False))))
        label = "AdamW" if name == "adamw" else "NAdam"
        for variant, flag in variants:
            param = torch.nn.Parameter(live.clone())
            param.grad = grad.clone()
            try:
                opt = torch_opt([param], **hp, **{variant: flag})

                def composite() -> None:
                    with torch.no_grad():
                        param.copy_(live)
                    opt.step()

                tf, t = timer.pair(fused, composite)
            except (RuntimeError, ValueError) as exc:  # fused=True is not available for every device/dtype
                print(f"  ({label} {variant}={flag} unavailable: {exc})", file=sys.stderr)
                continue
            key = variant if flag else "single_tensor"
            result[f"composite_{key}_s"] = t
            if best is None or t < best[1]:
                best = (f"{variant}={flag}", t, tf)
            del opt, param
        assert best is not None
        # The fused time measured alongside the faster composite.
        result["fused_s"] = best[2]
        result["composite_s"] = best[1]
        result["composite"] = f"copy + {label}({best[0]})"
    else:
        raise ValueError(f"unknown op {name!r}; choose from {', '.join(OPS)}")
    result["bytes"] = nbytes
    result["ratio"] = result["composite_s"] / result["fused_s"]
    result["fused_gbps"] = nbytes / result["fused_s"] / 1e9
    result["composite_gbps"] = nbytes / result["composite_s"] / 1e9
    return result


def copy_bandwidth(n: int, dtype: torch.dtype, device: torch.device, timer: Timer) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second) for ``n`` elements."""
    src = _rand(n, dtype, device)
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src))
    return 2 * n * src.element_size() / t / 1e9


def _streaming_threshold() -> int:
    from pipecore import _C

    return _C._streaming_threshold()


def _streaming_store_bytes() -> int:
    from pipecore import _C

    return _C._streaming_store_bytes()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


# Issue 37's targets on CUDA at 64M elements: fused / torch composite speed ratio (NAdam came later and has none).
CUDA_TARGETS = {"interpolate": 1.0, "predict": 1.0, "sgd": 1.4, "sgd_delta": 1.4, "adamw": 1.2}


def targets(results: list[dict[str, Any]], device: torch.device, copy_gbps: float | None) -> list[dict[str, Any]]:
    """The performance targets, evaluated on these results: on CUDA issue 37's (64M elements: interpolate and
    predict >= 1.0x the torch op and >= 85% of copy bandwidth, SGD >= 1.4x and AdamW >= 1.2x torch's
    optimizer + copy), on the CPU the kernels spec's. Each target names the thread count and run it was
    measured in."""
    out = []
    for r in results:
        def check(target: str, value: float, met: bool) -> None:
            out.append({"op": r["op"], "size": r["size"], "threads": r.get("threads"), "run": r.get("run"),
                        "target": target, "value": round(value, 3), "met": met})

        if device.type == "cuda":
            if r["numel"] >= 64 << 20 and r["op"] in CUDA_TARGETS:
                goal = CUDA_TARGETS[r["op"]]
                check(f"fused >= {goal}x composite", r["ratio"], r["ratio"] >= goal)
                if r["op"] in ("interpolate", "predict") and copy_gbps:
                    frac = r["fused_gbps"] / copy_gbps
                    check(">= 85% of copy bandwidth", frac, frac >= 0.85)
            continue
        if r["op"] in ("sgd", "sgd_delta", "adamw", "nadam"):
            if r["numel"] >= 4 << 20:
                check("fused >= 1.5x composite", r["ratio"], r["ratio"] >= 1.5)
        elif r["numel"] >= 1 << 20:
            check("fused no slower than torch's best single op", r["ratio"], r["ratio"] >= 1.0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1M,4M,16M,64M", help="comma-separated element counts (K/M/G suffixes)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weight storage dtype")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--reps", type=int, default=10, help="minimum timed repetitions (median reported)")
    p.add_argument("--min-time", type=float, default=0.2,
                   help="repeat fast ops until each side ran about this many seconds (up to 200 repetitions)")
    p.add_argument("--warmup", type=int, default=3, help="untimed repetitions first")
    p.add_argument("--threads", default=None,
                   help="torch intra-op threads (CPU), or a comma-separated list to measure each in turn (1,2); "
                        "default: torch's")
    p.add_argument("--runs", type=int, default=1,
                   help="repeat the whole measurement this many times; every run's results are kept and checked")
    p.add_argument("--streaming", choices=("auto", "on", "off"), default="auto",
                   help="CPU: when the C++ kernels write `out` with streaming stores: from the last-level cache's "
                        "size (auto), on every call, or never (for comparing the two)")
    p.add_argument("--store-bytes", type=int, choices=(16, 32), default=None,
                   help="CPU: width of each streaming store (default: 32 where the CPU has AVX)")
    p.add_argument("--out", default=None, help=f"{OUT_HELP}; the default file is kernels-<device>[-<dtype>].json")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False")
    try:
        thread_counts = [int(t) for t in args.threads.split(",") if t.strip()] if args.threads else []
    except ValueError:
        p.error(f"--threads takes a number or a comma-separated list of numbers, got {args.threads!r}")
    if any(t < 1 for t in thread_counts):
        p.error(f"--threads must be at least 1, got {args.threads!r}")
    if args.runs < 1:
        p.error(f"--runs must be at least 1, got {args.runs}")
    thread_counts = thread_counts or [torch.get_num_threads()]
    if device.type == "cpu":
        from pipecore import _C

        if args.streaming != "auto":
            _C._set_streaming_threshold(0 if args.streaming == "on" else -1)
        if args.store_bytes is not None:
            try:
                _C._set_streaming_store_bytes(args.store_bytes)
            except ValueError as e:
                p.error(f"--store-bytes {args.store_bytes}: {e}")
    dtype = DTYPES[args.dtype]
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    names = [s.strip() for s in args.ops.split(",") if s.strip()]
    timer = Timer(device, args.warmup, args.reps, args.min_time)

    copy_gbps = None
    if device.type == "cuda":
        copy_gbps = copy_bandwidth(max(sizes), dtype, device, timer)
        print(f"device-to-device copy: {copy_gbps:.1f} GB/s at {size_label(max(sizes))} elements")

    header = f"{'op':<12}{'size':>6}{'fused ms':>11}{'composite ms':>14}{'ratio':>8}{'fused GB/s':>12}  composite"
    results = []
    for run in range(1, args.runs + 1):
        for threads in thread_counts:
            torch.set_num_threads(threads)
            runs = f" | run {run} of {args.runs}" if args.runs > 1 else ""
            print(f"{device_name(device)} | torch {torch.__version__} | {args.dtype} | threads {threads}{runs}")
            print(header)
            for name in names:
                for n in sizes:
                    r = bench_op(name, n, dtype, device, timer)
                    r.update(threads=threads, run=run)
                    results.append(r)
                    print(f"{r['op']:<12}{r['size']:>6}{r['fused_s'] * 1e3:>11.3f}{r['composite_s'] * 1e3:>14.3f}"
                          f"{r['ratio']:>7.2f}x{r['fused_gbps']:>12.1f}  {r['composite']}", flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()

    report = {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": args.dtype,
        "sizes": sizes,
        "threads": thread_counts if len(thread_counts) > 1 else thread_counts[0],
        "runs": args.runs,
        "reps": args.reps,
        "min_time_s": args.min_time,
        "warmup": args.warmup,
        "timing": ("median of alternating fused/composite runs; "
                   + ("CUDA events" if device.type == "cuda" else "time.perf_counter")),
        "copy_gbps": copy_gbps,
        # CPU only: the vector ISA torch dispatches to, and the call size (bytes moved) from which the
        # C++ kernels write `out` with streaming stores.
        "cpu_capability": torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else None,
        "streaming_threshold_bytes": _streaming_threshold() if device.type == "cpu" else None,
        "streaming": args.streaming if device.type == "cpu" else None,
        "streaming_store_bytes": _streaming_store_bytes() if device.type == "cpu" else None,
        "results": results,
        "targets": targets(results, device, copy_gbps),
    }
    out = args.out
    if out is None:
        suffix = "" if args.dtype == "float32" else f"-{args.dtype}"
        out = default_out(f"kernels-{device.type}{suffix}.json")
    write_report(report, out)
    missed = [t for t in report["targets"] if not t["met"]]
    for t in missed:
        where = f" ({t['threads']} threads, run {t['run']})" if len(thread_counts) > 1 or args.runs > 1 else ""
        print(f"target missed: {t['op']} {t['size']}{where}: {t['target']} (got {t['value']})")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
