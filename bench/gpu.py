"""pipecore on one GPU: every check and benchmark in one command that fits in 8 minutes.

``python bench/gpu.py [--build] [--quick] [--parts load,tests,kernels,plan,train,offload,gpt] [--budget 470]
[--device cuda:0] [--out PATH] [--gpt-configs a,b] [--profile-gpt size/config,...]``

Parts, run in this order, each in its own Python process under a time limit (a part that fails, crashes or
runs out of time is recorded with its error and traceback, and the next part still runs):

* ``build`` (only with ``--build``): ``pip install --no-build-isolation --no-deps -e .`` (builds ``pipecore._C``).
* ``load``: ``pipecore._C`` and the Triton kernels import; every fused op runs through the dispatch on CUDA
  tensors of each dtype and is compared with the torch reference (bit for bit is expected); the PTX of each
  compiled Triton kernel is searched for fused multiply-add instructions (none expected: contraction is off).
* ``tests``: pytest over the tests that need a GPU (those a ``skipif`` marks with a CUDA/GPU reason, or with
  ``cuda`` in their name), with a JUnit XML report parsed so that each test's outcome is recorded.
* ``kernels``: ``bench/kernels.py`` in float32 and bfloat16 at 16M and 64M elements, and the targets of
  issue 37 (interpolate/predict >= 1.0x the torch op and >= 0.85 of copy bandwidth; fused SGD >= 1.4x and
  fused AdamW >= 1.2x torch's optimizer plus the copy).
* ``plan``: ``pipecore plan --model gpt --stages 4 -a pipedream --device cuda --memory-limit 2GiB``.
* ``train``: ``pipecore train --device cuda --epochs 1 --no-progress`` (the MLP on the digits, one epoch).
* ``offload``: ``bench/offload.py``: the memory model's predicted peaks against the measured ones (target:
  within 15%).
* ``gpt``: the small and large GPT of the first GPU probe, trained with plain torch, with a hand-written loop
  over the same 4 stage modules and 8 micro-batches in 1F1B order, and with pipecore gpipe, 1f1b, 2bw and
  pipedream (a thread per stage and in turn), float32 and bf16 autocast: ms/step and peak memory; targets:
  1f1b >= 0.9x (small) / 0.95x (large) of the hand-written loop, bf16 no slower than float32. With
  ``--profile-gpt small/1f1b-inturn,small/hand``, those configurations' host time is also profiled (cProfile
  of the calling thread over as many steps again): the functions with the most own time, per step.

The whole run stays within ``--budget`` seconds (default 470); the ``gpt`` part comes last and gets what the
others left, running its most important configurations first and recording those it had no time for.
Results: ``bench/out/gpu-<device name>.json`` (``--out`` overrides; the committed results in bench/results/ are
written only by naming them there) and a summary table on stdout.
Without a CUDA device the command prints one line and exits with status 2. ``--dry-run-cpu`` runs the
script's own code on the CPU with tiny sizes (to check the script, not the GPU; nothing it measures is a
GPU result, and its JSON goes to a temporary file unless ``--out`` is given).

See docs/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
PARTS = ("load", "tests", "kernels", "plan", "train", "offload", "gpt")
ALL_PARTS = ("build",) + PARTS
# Seconds each part may take at most (the gpt part gets whatever is left of the total budget).
# Triton compiles each kernel variant once per machine (cached on disk, shared by the parts): load and kernels
# include those compiles (kernels also the block-size tuning's, see kernels/fused.py).
BUDGET_S = {"build": 110, "load": 60, "tests": 100, "kernels": 120, "plan": 40, "train": 30, "offload": 40, "gpt": 470}
QUICK_BUDGET_S = {"build": 110, "load": 60, "tests": 100, "kernels": 60, "plan": 40, "train": 30, "offload": 30,
                  "gpt": 120}
TOTAL_BUDGET_S = 470.0
SCHEMA = "pipecore-gpu-bench/1"

# Issue 37's targets.
KERNEL_TARGETS = {"interpolate": 1.0, "predict": 1.0, "sgd": 1.4, "sgd_delta": 1.4, "adamw": 1.2}
COPY_FRACTION_TARGET = 0.85
HAND_TARGETS = {"small": 0.9, "large": 0.95}
OFFLOAD_TOLERANCE = 0.15

GPT_SIZES = {
    "small": dict(n_layer=8, n_embd=512, n_head=8, T=256, V=256, B=32),
    "large": dict(n_layer=16, n_embd=1024, n_head=16, T=512, V=256, B=32),
}
GPT_QUICK = {"tiny": dict(n_layer=4, n_embd=64, n_head=4, T=32, V=64, B=16)}
STAGES, MICROBATCHES = 4, 8
PIPE_ALGORITHMS = ("gpipe", "1f1b", "2bw", "pipedream")


class UsageError(Exception):
    """Bad command-line input: reported in one line."""


# -- small helpers (no torch) --------------------------------------------------------------------------------

def slug(name: str) -> str:
    """A file-name-safe form of a device name: ``NVIDIA H100 80GB HBM3`` -> ``NVIDIA-H100-80GB-HBM3``."""
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")
    return s or "unknown"


def parse_parts(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise UsageError("--parts is empty; choose from " + ",".join(ALL_PARTS))
    bad = [p for p in names if p not in ALL_PARTS]
    if bad:
        raise UsageError(f"unknown part(s) {','.join(bad)} in --parts; choose from {','.join(ALL_PARTS)}")
    # Keep the canonical order (build first, gpt last), without duplicates.
    return [p for p in ALL_PARTS if p in names]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not the usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog="python bench/gpu.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated parts to run, from {','.join(ALL_PARTS)} (default: all but build)")
    p.add_argument("--build", action="store_true", help="build pipecore._C first (adds the build part)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that every part runs, measures little")
    p.add_argument("--budget", type=float, default=TOTAL_BUDGET_S, help="total seconds for the run (default 470)")
    p.add_argument("--device", default="cuda:0", help="the CUDA device (default cuda:0)")
    p.add_argument("--out", default=None, help="JSON path (default bench/out/gpu-<device name>.json, which git "
                                                "ignores; the committed results are bench/results/gpu-*.json, "
                                                "replaced only by naming them here)")
    p.add_argument("--gpt-configs", default=None,
                   help="only these gpt configurations (comma-separated, e.g. torch,hand,1f1b,1f1b-inturn-bf16)")
    p.add_argument("--profile-gpt", default=None,
                   help="also profile these gpt configurations' host time with cProfile (comma-separated "
                        "size/config, e.g. small/1f1b-inturn,small/hand): the top functions per step in the JSON")
    p.add_argument("--dry-run-cpu", action="store_true",
                   help="run the script's own code on the CPU with tiny sizes (checks the script; no GPU figures)")
    # Internal: one part in this process.
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        parts = parse_parts(args.parts)
    except UsageError as exc:
        p.error(str(exc))
    if args.build and "build" not in parts:
        parts.insert(0, "build")
    args.part_list = parts
    if not (args.budget > 0):
        p.error(f"--budget must be a positive number of seconds, got {args.budget}")
    if not re.fullmatch(r"cuda(:\d+)?", args.device) and not args.dry_run_cpu:
        p.error(f"--device must be cuda or cuda:N, got {args.device!r}")
    if args.dry_run_cpu:
        args.device = "cpu"
        args.quick = True
    return args


def kernel_targets(report: dict[str, Any], dtype: str) -> list[dict[str, Any]]:
    """Issue 37's kernel targets on one ``bench/kernels.py`` report (CUDA, 64M elements and up)."""
    out = []
    copy = report.get("copy_gbps")
    for r in report.get("results", []):
        if r["numel"] < 64 << 20 or r["op"] not in KERNEL_TARGETS:
            continue
        goal = KERNEL_TARGETS[r["op"]]
        what = "torch op" if r["op"] in ("interpolate", "predict") else "torch optimizer + copy"
        out.append({"part": "kernels", "what": f"{r['op']} {dtype} {r['size']}: fused vs {what}",
                    "target": f">= {goal}x", "value": round(r["ratio"], 3), "met": r["ratio"] >= goal})
        if r["op"] in ("interpolate", "predict") and copy:
            frac = r["fused_gbps"] / copy
            out.append({"part": "kernels", "what": f"{r['op']} {dtype} {r['size']}: fraction of copy bandwidth",
                        "target": f">= {COPY_FRACTION_TARGET}", "value": round(frac, 3),
                        "met": frac >= COPY_FRACTION_TARGET})
    return out


def gpt_targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 37's one-GPU GPT targets: 1f1b (threads) against the hand-written loop, bf16 against float32."""
    ms = {(r["size"], r["config"]): r["ms"] for r in runs if r.get("ms") is not None}
    out = []
    for size in sorted({r["size"] for r in runs}):
        goal = HAND_TARGETS.get(size)
        for prec in ("", "-bf16"):
            hand, pipe = ms.get((size, f"hand{prec}")), ms.get((size, f"1f1b{prec}"))
            if goal is not None and hand and pipe:
                v = hand / pipe
                out.append({"part": "gpt", "what": f"{size} GPT 1f1b{prec or ' float32'} vs hand-written loop "
                            "(speed ratio)", "target": f">= {goal}x", "value": round(v, 3), "met": v >= goal})
        f32, bf16 = ms.get((size, "1f1b")), ms.get((size, "1f1b-bf16"))
        if f32 and bf16:
            out.append({"part": "gpt", "what": f"{size} GPT 1f1b: bf16 autocast ms / float32 ms",
                        "target": "<= 1.0", "value": round(bf16 / f32, 3), "met": bf16 <= f32})
    return out


def offload_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name, r in report.get("results", {}).items():
        pred, meas = r.get("predicted_peak_bytes"), r.get("measured_peak_bytes")
        if pred and meas:
            err = (pred - meas) / meas
            out.append({"part": "offload", "what": f"offload {name}: predicted peak vs measured (relative error)",
                        "target": f"within {OFFLOAD_TOLERANCE:.0%}", "value": round(err, 3),
                        "met": abs(err) <= OFFLOAD_TOLERANCE})
    return out


def parse_junit(path: str | os.PathLike) -> dict[str, Any]:
    """Each test's outcome from a pytest JUnit XML file: counts and a list of {id, outcome, seconds, message}."""
    tree = ET.parse(path)
    tests = []
    for case in tree.iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or "")[:500]
                if tag != "skipped" and el.text:
                    message = (message + "\n" + el.text[-2000:]).strip()
                break
        tests.append({"id": f"{cls}::{name}" if cls else name, "outcome": outcome,
                      "seconds": float(case.get("time") or 0.0), "message": message})
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return {"counts": counts, "tests": tests}


def _fmt(v: Any, spec: str = ".2f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def summary(report: dict[str, Any]) -> str:
    """The printed summary: parts, tests, targets, the GPT table."""
    lines = []
    dev = report.get("device", {})
    ver = report.get("versions", {})
    lines.append(f"pipecore GPU run on {dev.get('name', '?')} | python {ver.get('python', '?')} | "
                 f"torch {ver.get('torch', '?')} | triton {ver.get('triton', '?')} | commit {report.get('commit', '?')}"
                 + (" | DRY RUN ON CPU (no GPU figures)" if report.get("dry_run_cpu") else ""))
    lines.append(f"{'part':<9}{'status':<10}{'seconds':>8}  note")
    for name, part in report.get("parts", {}).items():
        note = part.get("note", "")
        if part.get("errors"):
            note = (note + "; " if note else "") + f"{len(part['errors'])} error(s): " + \
                part["errors"][0].get("error", "")[:90]
        lines.append(f"{name:<9}{part.get('status', '?'):<10}{_fmt(part.get('seconds'), '.1f'):>8}  {note}")
    tests = report.get("parts", {}).get("tests", {}).get("result", {})
    if tests.get("tests"):
        c = tests["counts"]
        lines.append("tests: " + ", ".join(f"{c[k]} {k}" for k in sorted(c)))
        for t in tests["tests"]:
            if t["outcome"] in ("failed", "error"):
                first = t["message"].splitlines()[0][:110] if t["message"] else ""
                lines.append(f"  {t['outcome'].upper()} {t['id']}: {first}")
            elif t["outcome"] == "skipped":
                lines.append(f"  skipped {t['id']}: {t['message'][:100]}")
    gpt = report.get("parts", {}).get("gpt", {}).get("result", {})
    runs = gpt.get("runs", [])
    if runs:
        lines.append(f"{'size':<7}{'config':<24}{'ms/step':>9}{'peak GiB':>10}{'vs hand':>9}{'vs torch':>9}  loss")
        for r in runs:
            if r.get("ms") is None:
                lines.append(f"{r['size']:<7}{r['config']:<24}  {r.get('status', 'error')}: {r.get('note', '')[:80]}")
                continue
            lines.append(f"{r['size']:<7}{r['config']:<24}{r['ms']:>9.1f}{_fmt(r.get('peak_gib')):>10}"
                         f"{_fmt(r.get('vs_hand'), '.3f'):>9}{_fmt(r.get('vs_torch'), '.3f'):>9}"
                         f"  {_fmt(r.get('loss'), '.4f')}")
    targets = report.get("targets", [])
    if targets:
        lines.append(f"targets: {sum(t['met'] for t in targets)} of {len(targets)} met")
        for t in targets:
            lines.append(f"  {'met ' if t['met'] else 'MISS'} {t['what']}: {t['value']} (target {t['target']})")
    if report.get("out"):
        lines.append(f"wrote {report['out']}")
    return "\n".join(lines)


def load_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The load part's checks as targets: dispatch == reference bit for bit, no fused multiply-add in the PTX."""
    out = []
    checks = result.get("dispatch", [])
    if checks:
        bad = [f"{c['op']} {c['dtype']}" for c in checks if not c["bit_identical"]]
        out.append({"part": "load", "what": "fused ops on CUDA vs pipecore.ops.reference: results not bit-identical",
                    "target": "0", "value": len(bad), "met": not bad, "detail": bad})
    fma = result.get("fma_in_ptx")
    if fma:
        counted = {k: v for k, v in fma.items() if v is not None}
        total = sum(counted.values())
        out.append({"part": "load", "what": f"fma.rn instructions in the PTX of {len(counted)} of {len(fma)} "
                    "Triton kernel variants", "target": "0", "value": total, "met": bool(counted) and total == 0})
    return out


def collect_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    parts = report.get("parts", {})
    out: list[dict[str, Any]] = load_targets(parts.get("load", {}).get("result", {}))
    for dtype, rep in parts.get("kernels", {}).get("result", {}).get("reports", {}).items():
        out += kernel_targets(rep, dtype)
    out += gpt_targets(parts.get("gpt", {}).get("result", {}).get("runs", []))
    off = parts.get("offload", {}).get("result", {}).get("report")
    if off:
        out += offload_targets(off)
    return out


def write_json(report: dict[str, Any], path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return path


# -- worker side: one part in this process -------------------------------------------------------------------

class Recorder:
    """A part's result and errors, written to the result file after every change (so a killed part keeps
    what it had)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.data: dict[str, Any] = {"result": {}, "errors": [], "note": ""}

    def save(self) -> None:
        if self.path:
            write_json(self.data, self.path)

    def error(self, where: str, exc: BaseException) -> None:
        self.data["errors"].append({"where": where, "error": f"{type(exc).__name__}: {exc}"[:2000],
                                    "traceback": traceback.format_exc()[-8000:]})
        print(f"  ERROR in {where}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        self.save()

    def guard(self, where: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - every failure is recorded, and the part goes on
            self.error(where, exc)
            return None


def _device(args: argparse.Namespace):
    import torch

    return torch.device(args.device)


def part_load(args: argparse.Namespace, rec: Recorder) -> None:
    import torch

    res = rec.data["result"]
    res["torch_cuda"] = torch.version.cuda

    def c_ext():
        from pipecore import _C
        res["pipecore_C"] = {"file": _C.__file__, "with_cuda": getattr(_C, "with_cuda", None)}
    rec.guard("import pipecore._C", c_ext)
    rec.save()

    def triton_import():
        import triton
        import pipecore.kernels  # noqa: F401
        res["triton"] = triton.__version__
    rec.guard("import triton and pipecore.kernels", triton_import)
    rec.save()
    if args.dry_run_cpu:
        rec.data["note"] = "dry run on CPU: no CUDA launch"
        return
    dev = _device(args)
    import pipecore.ops as ops
    from pipecore.ops import reference as ref

    checks = res.setdefault("dispatch", [])
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        def one(dtype=dtype):
            torch.manual_seed(0)
            n = (1 << 20) - 3  # a masked tail; below the block-size tuning's threshold (no extra compiles)
            sd = ops.state_dtype(dtype)
            w = torch.randn(n, device=dev, dtype=torch.float64).to(dtype)
            v = torch.randn(n, device=dev, dtype=torch.float64).to(dtype)
            pairs = {"interpolate": (ops.interpolate(w, v, 0.3), ref.interpolate(w, v, 0.3)),
                     "predict": (ops.predict(w, v, 0.01), ref.predict(w, v, 0.01))}
            buf, delta = torch.randn(n, device=dev, dtype=sd), torch.randn(n, device=dev, dtype=sd)
            rbuf, rdelta = buf.clone(), delta.clone()
            kw = dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True, delta_decay=0.5)
            out = ops.sgd_step(w, v, buf, out=torch.empty_like(w), delta=delta, **kw)
            rout = ref.sgd_step(w, v, rbuf, out=torch.empty_like(w), delta=rdelta, **kw)
            pairs.update({"sgd out": (out, rout), "sgd momentum_buf": (buf, rbuf), "sgd delta": (delta, rdelta)})
            m, s = torch.randn(n, device=dev, dtype=sd), torch.randn(n, device=dev, dtype=sd).abs()
            rm, rs = m.clone(), s.clone()
            kw = dict(step=2, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
            out = ops.adamw_step(w, v, m, s, out=torch.empty_like(w), **kw)
            rout = ref.adamw_step(w, v, rm, rs, out=torch.empty_like(w), **kw)
            pairs.update({"adamw out": (out, rout), "adamw exp_avg": (m, rm), "adamw exp_avg_sq": (s, rs)})
            for name, (a, b) in pairs.items():
                a, b = a.cpu(), b.cpu()
                diff = int((a != b).sum())
                checks.append({"op": name, "dtype": str(dtype).replace("torch.", ""), "numel": n,
                               "bit_identical": diff == 0, "elements_differing": diff,
                               "max_abs_diff": float((a.double() - b.double()).abs().max())})
            rec.save()
        rec.guard(f"dispatch {dtype}", one)
    res["dispatch_all_bit_identical"] = bool(checks) and all(c["bit_identical"] for c in checks)

    def ptx():
        from pipecore.kernels import fused
        res["fma_in_ptx"] = fused.ptx_fma_counts(dev)
    rec.guard("PTX fused multiply-add count", ptx)


_GPU_TEST = re.compile(r"def test_\w*cuda\w*\(|skipif\([^)]*(?:cuda|gpu)", re.IGNORECASE)


def _select_test_files() -> list[str]:
    """The test files with a test named for CUDA or a skipif that mentions CUDA or a GPU (the plugin below then
    keeps those tests)."""
    return [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").glob("test_*.py"))
            if _GPU_TEST.search(p.read_text(errors="replace"))]


def part_tests(args: argparse.Namespace, rec: Recorder) -> None:
    """pytest over the test files that have GPU tests, with the plugin below keeping those tests, in one process;
    if that process crashes (e.g. a segmentation fault) or leaves no report, once more per file for the files
    it has no results for, so that a crash loses only its own file's results."""
    res = rec.data["result"]
    files = _select_test_files()
    res.update({"files": files, "tests": [], "counts": {}, "runs": []})
    tmp = Path(tempfile.mkdtemp(prefix="pipecore-gpu-tests-"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BENCH), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    rec.save()

    def pytest(group: list[str], xml: Path) -> bool:
        """Run pytest on ``group``; record its tests; True when it ran to the end (exit 0, 1 or 5)."""
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "gpu", "-q", "-rA",
               f"--junitxml={xml}", *group]
        run: dict[str, Any] = {"files": group, "command": " ".join(cmd[1:])}
        res["runs"].append(run)
        left = None if args.deadline is None else args.deadline - time.time() - 3.0
        if left is not None and left < 5:
            run["returncode"] = None
            rec.error(f"pytest {' '.join(group)}", RuntimeError("not run: no time left in the budget"))
            return False
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=left)
            run["returncode"] = proc.returncode
            run["output_tail"] = (proc.stdout + proc.stderr)[-4000:]
        except subprocess.TimeoutExpired as exc:
            run["returncode"] = None
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            run["output_tail"] = out[-4000:]
            rec.error(f"pytest {' '.join(group)}", RuntimeError("ran out of time"))
        # 0: passed, 1: some failed (recorded per test), 5: nothing selected; anything else is a crash or misuse.
        ok = run["returncode"] in (0, 1, 5) and xml.exists()
        if run["returncode"] is not None and not ok:
            rec.error(f"pytest {' '.join(group)}", RuntimeError(
                f"pytest exited with {run['returncode']} (a crash or a usage error; see output_tail)"))
        if xml.exists():
            parsed = parse_junit(xml)
            res["tests"] += parsed["tests"]
            for k, v in parsed["counts"].items():
                res["counts"][k] = res["counts"].get(k, 0) + v
        c = res["counts"]
        rec.data["note"] = ", ".join(f"{c[k]} {k}" for k in sorted(c))
        rec.save()
        return ok

    if pytest(files, tmp / "all.xml"):
        return
    seen = {t["id"].split("::")[0] for t in res["tests"]}  # JUnit class names: tests.test_ops[.SomeClass]
    for f in files:
        module = f[:-3].replace("/", ".")
        if not any(c == module or c.startswith(module + ".") for c in seen):
            pytest([f], tmp / (Path(f).stem + ".xml"))


# The pytest plugin (loaded with -p gpu from bench/): keep only the tests that need a GPU.
def _needs_gpu(item: Any) -> bool:
    if "cuda" in item.name.lower():
        return True
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        if re.search(r"cuda|gpu", reason, re.IGNORECASE):
            return True
    return False


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    keep = [i for i in items if _needs_gpu(i)]
    drop = [i for i in items if not _needs_gpu(i)]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def part_kernels(args: argparse.Namespace, rec: Recorder) -> None:
    sys.path.insert(0, str(BENCH))
    import kernels as kb

    res = rec.data["result"]
    res["reports"] = {}
    sizes = "1M" if args.quick else "16M,64M"
    extra = ["--reps", "3", "--min-time", "0.02", "--warmup", "1"] if args.quick else []
    device = "cpu" if args.dry_run_cpu else args.device
    for dtype in ("float32", "bfloat16"):
        def one(dtype=dtype):
            out = Path(tempfile.mkdtemp(prefix="pipecore-gpu-kernels-")) / f"kernels-{dtype}.json"
            argv = ["--device", device, "--sizes", sizes, "--dtype", dtype, "--out", str(out), *extra]
            res.setdefault("commands", []).append("python bench/kernels.py " + " ".join(argv))
            rc = kb.main(argv)
            if rc != 0:
                raise RuntimeError(f"bench/kernels.py exited with {rc}")
            res["reports"][dtype] = json.loads(out.read_text())
            rec.save()
        rec.guard(f"kernels {dtype}", one)


def _run_command(args: argparse.Namespace, rec: Recorder, cmd: list[str]) -> subprocess.CompletedProcess:
    """Run a pipecore command line within the part's deadline, recording the command, its exit code and output."""
    res = rec.data["result"]
    res["command"] = " ".join(cmd[1:])
    timeout = None if args.deadline is None else max(5.0, args.deadline - time.time() - 3.0)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    res["returncode"] = proc.returncode
    res["output"] = (proc.stdout + proc.stderr)[-6000:]
    if proc.returncode != 0:
        raise RuntimeError(f"{res['command']} exited with {proc.returncode}: {(proc.stderr or proc.stdout)[-500:]}")
    return proc


def part_plan(args: argparse.Namespace, rec: Recorder) -> None:
    device = "cpu" if args.dry_run_cpu else args.device
    _run_command(args, rec, [sys.executable, "-m", "pipecore", "plan", "--model", "gpt", "--stages", "4", "-a",
                             "pipedream", "--device", device, "--memory-limit", "2GiB"])


def part_train(args: argparse.Namespace, rec: Recorder) -> None:
    device = "cpu" if args.dry_run_cpu else args.device
    proc = _run_command(args, rec, [sys.executable, "-m", "pipecore", "train", "--device", device, "--epochs", "1",
                                    "--no-progress"])
    acc = re.search(r"^test accuracy .*$", proc.stdout, re.MULTILINE)
    rec.data["note"] = acc.group(0) if acc else ""


def part_offload(args: argparse.Namespace, rec: Recorder) -> None:
    if args.dry_run_cpu:
        rec.data["note"] = "dry run on CPU: bench/offload.py needs CUDA, not run"
        return
    sys.path.insert(0, str(BENCH))
    import offload

    res = rec.data["result"]
    out = Path(tempfile.mkdtemp(prefix="pipecore-gpu-offload-")) / "offload.json"
    argv = (["--layers", "2", "--width", "128", "--block", "64", "--batch", "16", "--steps", "2"]
            if args.quick else ["--steps", "3"]) + ["--out", str(out)]
    res["command"] = "python bench/offload.py " + " ".join(argv)
    rc = offload.main(argv)
    if rc not in (0, None):
        raise RuntimeError(f"bench/offload.py exited with {rc}")
    res["report"] = json.loads(out.read_text())


# -- the GPT part --------------------------------------------------------------------------------------------

def _lm_loss(logits: Any, target: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _stage_bounds(n_layer: int) -> list[tuple[int, int]]:
    per, extra = divmod(n_layer, STAGES)
    bounds, lo = [], 0
    for s in range(STAGES):
        hi = lo + per + (1 if s < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def gpt_stage_modules(gpt: Any) -> list[Any]:
    """The GPT as ``STAGES`` plain modules, cut where pipecore is told to cut it (:func:`gpt_partition`):
    the embeddings and the first blocks, blocks, ..., the last blocks with the final LayerNorm and the head.
    The head's weight is the token embedding's Parameter itself (tied), so autograd adds both gradients."""
    from torch import nn

    import torch

    class Stage(nn.Module):
        def __init__(self, lo: int, hi: int, first: bool, last: bool) -> None:
            super().__init__()
            self.first, self.last = first, last
            self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
            if first:
                self.tok_emb, self.pos_emb, self.drop = gpt.tok_emb, gpt.pos_emb, gpt.drop
            if last:
                self.ln_f, self.head = gpt.ln_f, gpt.head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.first:  # as GPT.forward
                pos = torch.arange(x.shape[1], device=x.device)
                x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x)) if self.last else x

    bounds = _stage_bounds(len(gpt.blocks))
    return [Stage(lo, hi, s == 0, s == STAGES - 1) for s, (lo, hi) in enumerate(bounds)]


def gpt_partition(n_layer: int) -> list[str]:
    """Where pipecore's stages 1..3 start: the same cut as :func:`gpt_stage_modules`."""
    return [f"blocks.{lo}" for lo, _ in _stage_bounds(n_layer)[1:]]


def hand_written_step(gpt: Any, bf16: bool, device_type: str) -> Callable[[Any, Any], Any]:
    """A step of the 4 stage modules over 8 micro-batches in pipecore's in-turn 1F1B order (bench/hand_written.py's
    order), the hand-over detached and its gradient passed back, then one fused AdamW step: the fair one-GPU
    reference for a pipeline (same cut, same micro-batches, no pipecore)."""
    import torch

    sys.path.insert(0, str(BENCH))
    from hand_written import in_turn_order, run_in_order

    parts = gpt_stage_modules(gpt)
    order = in_turn_order("1f1b", STAGES, MICROBATCHES)
    opt = torch.optim.AdamW(gpt.parameters(), lr=1e-4, fused=device_type == "cuda")

    def autocast() -> Any:
        return torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # One AdamW step over the whole model after the flush, as plain torch does: the stages' update
        # actions in the order are no-ops here.
        loss = run_in_order(parts, order, x, y, MICROBATCHES, _lm_loss, lambda s: None, autocast)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def torch_step(model: Any, bf16: bool, device_type: str) -> Callable[[Any, Any], Any]:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device_type == "cuda")

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
            loss = _lm_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def gpt_configs(sizes: list[str], only: set[str] | None) -> list[tuple[str, str]]:
    """(size, config) in the order they run: what the targets need first, for every size, then the rest."""
    first = ["torch", "hand", "1f1b", "torch-bf16", "hand-bf16", "1f1b-bf16"]
    rest = [f"{a}{t}{p}" for p in ("", "-bf16") for t in ("", "-inturn") for a in PIPE_ALGORITHMS]
    rest = [c for c in rest if c not in first]
    out = [(s, c) for group in (first, rest) for s in sizes for c in group]
    if only is not None:
        out = [(s, c) for s, c in out if c in only]
    return out


def part_gpt(args: argparse.Namespace, rec: Recorder) -> None:
    import copy
    import gc

    import torch

    import pipecore
    from pipecore.models import GPT

    dev = _device(args)
    cuda = dev.type == "cuda"
    sizes = GPT_QUICK if args.quick else GPT_SIZES
    warmup, reps = (1, 2) if args.quick else (3, 8)
    res = rec.data["result"]
    res.update({"warmup_steps": warmup, "timed_steps": reps, "stages": STAGES, "microbatches": MICROBATCHES,
                "optimizer": "AdamW lr=1e-4 (torch fused for torch and hand; pipecore.AdamW for pipecore)",
                "tf32": True, "sizes": sizes, "runs": []})
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    only = None if not args.gpt_configs else {c.strip() for c in args.gpt_configs.split(",") if c.strip()}
    configs = gpt_configs(list(sizes), only)
    bases: dict[str, Any] = {}
    data: dict[str, Any] = {}
    spent: dict[str, float] = {}

    def base_of(size: str) -> Any:
        if size not in bases:
            cfg = sizes[size]
            torch.manual_seed(0)
            bases[size] = GPT(vocab_size=cfg["V"], block_size=cfg["T"], n_layer=cfg["n_layer"], n_head=cfg["n_head"],
                              n_embd=cfg["n_embd"])
            g = torch.Generator().manual_seed(0)
            batches = []
            for _ in range(4):
                idx = torch.randint(0, cfg["V"], (cfg["B"], cfg["T"] + 1), generator=g)
                batches.append((idx[:, :-1].to(dev), idx[:, 1:].to(dev)))
            data[size] = batches
        return bases[size]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    profiled = set() if not args.profile_gpt else {c.strip() for c in args.profile_gpt.split(",") if c.strip()}

    def timed(step: Callable[[Any, Any], Any], size: str, profile: bool = False) -> dict[str, Any]:
        batches = data[size]
        for i in range(warmup):
            step(*batches[i % len(batches)])
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        loss = None
        for i in range(reps):
            loss = step(*batches[i % len(batches)])
        sync()
        dt = (time.perf_counter() - t0) / reps
        out = {"ms": dt * 1e3, "loss": float(loss),
               "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None}
        if profile:
            out["profile"] = host_profile(lambda i: step(*batches[i % len(batches)]), reps, sync)
        return out

    for size, config in configs:
        estimate = 2.0 * spent.get(size, 0.0) / max(1, sum(1 for r in res["runs"] if r["size"] == size)) \
            if spent.get(size) else 0.0
        if args.deadline is not None and time.time() + estimate > args.deadline - 2.0:
            res["runs"].append({"size": size, "config": config, "ms": None, "status": "not run",
                                "note": "no time left in the budget"})
            rec.save()
            continue
        bf16 = config.endswith("-bf16")
        name = config[:-5] if bf16 else config
        t_start = time.time()
        row: dict[str, Any] = {"size": size, "config": config, "bf16_autocast": bf16}
        held: dict[str, Any] = {}  # this configuration's model, optimizer, pipeline: all freed before the next
        try:
            base = base_of(size)
            if cuda:
                # What the device holds before this configuration (the data only, if the last one was freed):
                # it is part of the peak below.
                row["allocated_before_gib"] = torch.cuda.memory_allocated(dev) / 2**30
            profile = f"{size}/{config}" in profiled
            if name in ("torch", "hand"):
                held["model"] = copy.deepcopy(base).to(dev)
                make = torch_step if name == "torch" else hand_written_step
                held["step"] = make(held["model"], bf16, dev.type)
                row.update(timed(held["step"], size, profile))
            else:
                alg, _, inturn = name.partition("-")
                pipe = held["pipe"] = pipecore.Pipeline(
                    copy.deepcopy(base), num_stages=STAGES, algorithm=alg, n_microbatches=MICROBATCHES,
                    optimizer=pipecore.AdamW(lr=1e-4), loss_fn=_lm_loss, devices=str(dev), concurrent=not inturn,
                    partition=gpt_partition(sizes[size]["n_layer"]), autocast=torch.bfloat16 if bf16 else None)
                try:
                    row.update(timed(pipe.step, size, profile))
                    row["concurrent"] = pipe.concurrent
                    pipe.flush()
                finally:
                    pipe.close()
                    del pipe
            row["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - recorded; the next configuration still runs
            row.update({"ms": None, "status": "error", "note": f"{type(exc).__name__}: {exc}"[:300]})
            rec.error(f"gpt {size} {config}", exc)
        finally:
            held.clear()
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        spent[size] = spent.get(size, 0.0) + time.time() - t_start
        row["seconds"] = round(time.time() - t_start, 2)
        res["runs"].append(row)
        _ratios(res["runs"])
        print(f"  gpt {size:<6}{config:<24}" + (f"{row['ms']:9.2f} ms  peak {_fmt(row.get('peak_gib'))} GiB"
                                               if row.get("ms") is not None else f"  {row['status']}"), flush=True)
        rec.save()


PROFILE_TOP = 40


def host_profile(step: Callable[[int], Any], steps: int, sync: Callable[[], None]) -> dict[str, Any]:
    """cProfile over ``steps`` more steps (the device synchronised before and after): the calling thread's
    functions with the most own time, per step (a stage thread's work is not seen: profile in-turn runs)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    sync()
    t0 = time.perf_counter()
    profiler.enable()
    for i in range(steps):
        step(i)
    sync()
    profiler.disable()
    wall = (time.perf_counter() - t0) / steps
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:PROFILE_TOP]

    def where(key: tuple[str, int, str]) -> str:
        file, line, name = key
        for prefix in (str(ROOT) + os.sep, "site-packages" + os.sep):
            if prefix in file:
                file = file.split(prefix, 1)[1]
        return f"{file}:{line}({name})" if line else name

    return {"steps": steps, "ms_per_step_profiled": wall * 1e3,
            "calls_per_step": sum(v[1] for v in stats.values()) / steps,
            "top_own_time": [{"function": where(k), "calls_per_step": v[1] / steps, "own_ms_per_step": v[2] / steps * 1e3,
                              "cumulative_ms_per_step": v[3] / steps * 1e3} for k, v in rows]}


def _ratios(runs: list[dict[str, Any]]) -> None:
    """vs_hand, vs_torch: the reference's ms / this run's ms at the same size and precision (>1: faster)."""
    ms = {(r["size"], r["config"]): r["ms"] for r in runs if r.get("ms")}
    for r in runs:
        if not r.get("ms"):
            continue
        prec = "-bf16" if r["config"].endswith("-bf16") else ""
        for ref, key in (("hand", "vs_hand"), ("torch", "vs_torch")):
            t = ms.get((r["size"], ref + prec))
            r[key] = t / r["ms"] if t else None


WORKERS: dict[str, Callable[[argparse.Namespace, Recorder], None]] = {
    "load": part_load, "tests": part_tests, "kernels": part_kernels, "plan": part_plan, "train": part_train,
    "offload": part_offload,
    "gpt": part_gpt,
}


def run_worker(args: argparse.Namespace) -> int:
    rec = Recorder(args.result)
    rec.save()
    rec.guard(args.worker, lambda: WORKERS[args.worker](args, rec))
    rec.save()
    return 1 if rec.data["errors"] else 0


# -- the parent: every part in its own process ---------------------------------------------------------------

def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_part(name: str, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    start = time.time()
    part: dict[str, Any] = {"status": "ok", "budget_s": round(timeout, 1), "errors": [], "note": "", "result": {}}
    if name == "build":
        cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", "."]
        env = dict(os.environ, MAX_JOBS=str(os.cpu_count() or 4))
        part["result"]["command"] = " ".join(cmd[1:])
        result_file = None
    else:
        result_file = Path(tempfile.mkdtemp(prefix=f"pipecore-gpu-{name}-")) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--result", str(result_file),
               "--deadline", str(start + timeout), "--device", args.device]
        cmd += ["--quick"] if args.quick else []
        cmd += ["--dry-run-cpu"] if args.dry_run_cpu else []
        cmd += ["--gpt-configs", args.gpt_configs] if args.gpt_configs else []
        cmd += ["--profile-gpt", args.profile_gpt] if args.profile_gpt else []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    print(f"== {name} (up to {timeout:.0f} s)", flush=True)
    output: list[str] = []
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            output.append(out or "")
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, _ = proc.communicate()
            output.append(out or "")
            rc = None
            part["status"] = "timeout"
            part["errors"].append({"where": name, "error": f"ran out of its {timeout:.0f} s and was stopped",
                                   "traceback": ""})
        part["returncode"] = rc
        if rc is not None and rc < 0:
            part["status"] = "crashed"
            part["errors"].append({"where": name, "error": f"the part's process died of signal {-rc}",
                                   "traceback": "".join(output)[-4000:]})
    except Exception as exc:  # noqa: BLE001
        part["status"] = "error"
        part["errors"].append({"where": name, "error": f"{type(exc).__name__}: {exc}",
                               "traceback": traceback.format_exc()})
        rc = None
    text = "".join(output)
    sys.stdout.write(text[-3000:] if name in ("build", "tests") else text)
    part["output_tail"] = text[-4000:]
    if result_file is not None:
        if result_file.exists():
            try:
                worker = json.loads(result_file.read_text())
                part["result"] = worker.get("result", {})
                part["errors"] = worker.get("errors", []) + part["errors"]
                part["note"] = worker.get("note", "")
            except (OSError, ValueError) as exc:
                part["errors"].append({"where": name, "error": f"unreadable result file: {exc}", "traceback": ""})
        else:
            part["errors"].append({"where": name, "error": "the part wrote no result", "traceback": text[-4000:]})
    elif rc not in (0, None):
        part["errors"].append({"where": name, "error": f"exited with {rc}", "traceback": text[-4000:]})
    if part["status"] == "ok" and part["errors"]:
        part["status"] = "failed"
    if name == "tests" and part["status"] == "ok":
        counts = part["result"].get("counts", {})
        if counts.get("failed") or counts.get("error"):
            part["status"] = "failed"
    part["seconds"] = round(time.time() - start, 1)
    return part


def versions() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "platform": platform.platform()}
    try:
        import triton
        out["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        out["triton"] = f"not importable: {type(exc).__name__}: {exc}"
    try:
        if str(ROOT) not in sys.path:  # the checkout's pipecore (as the parts import it), built or not
            sys.path.insert(0, str(ROOT))
        import pipecore
        out["pipecore"] = pipecore.__version__
    except Exception as exc:  # noqa: BLE001
        out["pipecore"] = f"not importable: {type(exc).__name__}: {exc}"
    return out


def device_info(device: str) -> dict[str, Any]:
    import torch

    if device == "cpu":
        sys.path.insert(0, str(BENCH))
        from _machine import cpu_name
        return {"name": "CPU (dry run) " + cpu_name(), "type": "cpu"}
    d = torch.device(device)
    props = torch.cuda.get_device_properties(d)
    return {"name": props.name, "type": "cuda", "index": d.index or 0, "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1), "count": torch.cuda.device_count(),
            "driver": _driver()}


def _driver() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _commit() -> str:
    """The commit (+uncommitted for a dirty tree) from git; $PIPECORE_COMMIT where the tree has no git history."""
    if os.environ.get("PIPECORE_COMMIT"):
        return os.environ["PIPECORE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (head + ("+uncommitted" if dirty else "")) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    import torch

    if not args.dry_run_cpu:
        if not torch.cuda.is_available():
            print(f"bench/gpu.py: no CUDA GPU here (torch {torch.__version__}: torch.cuda.is_available() is False); "
                  "run it on a GPU machine", file=sys.stderr)
            return 2
        index = int(args.device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            print(f"bench/gpu.py: --device {args.device} but this machine has {torch.cuda.device_count()} CUDA "
                  "device(s)", file=sys.stderr)
            return 2
    t0 = time.time()
    deadline = t0 + args.budget
    budgets = QUICK_BUDGET_S if args.quick else BUDGET_S
    report: dict[str, Any] = {"schema": SCHEMA, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
                              "command": "python bench/gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                              "commit": _commit(), "quick": args.quick, "dry_run_cpu": args.dry_run_cpu,
                              "budget_s": args.budget, "parts": {}}
    try:
        report["versions"] = versions()
        report["device"] = device_info(args.device)
    except Exception as exc:  # noqa: BLE001
        report.setdefault("errors", []).append({"where": "versions/device", "error": f"{type(exc).__name__}: {exc}",
                                                "traceback": traceback.format_exc()})
        report.setdefault("device", {"name": args.device})
    if args.out:
        out = Path(args.out)
    elif args.dry_run_cpu:
        out = Path(tempfile.gettempdir()) / "pipecore-gpu-dryrun-cpu.json"
    else:
        out = BENCH / "out" / f"gpu-{slug(report['device'].get('name', args.device))}.json"
    report["out"] = str(out)
    for name in args.part_list:
        left = deadline - time.time()
        if left < 5:
            report["parts"][name] = {"status": "not run", "note": "no time left in the budget", "errors": [],
                                     "result": {}, "seconds": 0.0}
            continue
        timeout = left if name == "gpt" else min(budgets[name], left)
        try:
            report["parts"][name] = run_part(name, args, timeout)
            if name == "build":  # pipecore's version can be read once it is built
                report["versions"] = versions()
        except Exception as exc:  # noqa: BLE001
            report["parts"][name] = {"status": "error", "result": {}, "seconds": None,
                                     "errors": [{"where": name, "error": f"{type(exc).__name__}: {exc}",
                                                 "traceback": traceback.format_exc()}]}
        report["targets"] = collect_targets(report)
        report["seconds"] = round(time.time() - t0, 1)
        write_json(report, out)  # after every part: a run stopped from outside keeps what it measured
    report["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report["targets"] = collect_targets(report)
    report["seconds"] = round(time.time() - t0, 1)
    write_json(report, out)
    print()
    print(summary(report))
    bad = [n for n, p in report["parts"].items() if p.get("status") != "ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
