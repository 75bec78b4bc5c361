"""Host overhead of two commits of pipecore, measured in one run: ``bench/overhead.py`` against each.

``python bench/overhead_ab.py BASE [--head REV] [--rounds 7] [--widths 16] [--algorithms 1f1b,2bw,pipedream]
[--window 10] [--steps 3] [--out PATH]``

Both commits run this checkout's ``bench/overhead.py`` (the same measuring code), each importing its own
``pipecore`` from a detached git worktree in a temporary folder (``PYTHONPATH``); ``--head`` defaults to this
checkout as it is, uncommitted changes included. A commit whose ``csrc/`` and ``setup.py`` equal this checkout's
takes this checkout's compiled extension; another is built in its worktree (``setup.py build_ext --inplace``).

Two measures:

* **bytecode per action** (``overhead.py --profile``): the Python bytecode instructions and Python calls each
  configuration executes per action, counted over ``--steps`` steps. Counts, not seconds: the same on a loaded
  machine, so a difference is a difference in the code.
* **process CPU time over the hand-written loop** (``overhead.py --rounds 1 --no-torch``, one window per process):
  the commits alternate, in an order that flips every round, ``--rounds`` times; per round and configuration the
  ratio of the configuration's step to the hand-written loop's, measured in the same process, so that load on the
  machine divides out; reported as the median over rounds per commit and the median of the per-round ratios
  head / base.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import OUT_HELP, default_out, machine, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OVERHEAD = ROOT / "bench" / "overhead.py"


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def checkout(rev: str, into: Path) -> Path:
    """A detached worktree of ``rev`` under ``into``, with a compiled extension."""
    path = into / rev.replace("/", "_")
    git("worktree", "add", "--detach", str(path), rev)
    same_sources = subprocess.run(["git", "diff", "--quiet", rev, "--", "csrc", "setup.py"], cwd=ROOT).returncode == 0
    built = sorted((ROOT / "pipecore").glob("_C*.so"))
    if same_sources and built:
        for so in built:
            shutil.copy2(so, path / "pipecore" / so.name)
    else:
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=path, check=True,
                       stdout=subprocess.DEVNULL)
    return path


def run_overhead(tree: Path, args: list[str]) -> str:
    """``bench/overhead.py args`` (this checkout's) with ``tree``'s pipecore; its standard output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(OVERHEAD), *args], cwd=tree, env=env, check=True,
                          capture_output=True, text=True)
    return done.stdout


_PROFILE_ROW = re.compile(r"^\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s*$")


def profile(tree: Path, width: int, algorithms: str, steps: int) -> dict[str, dict[str, float]]:
    """Per configuration: Python calls, all calls and bytecode instructions per action."""
    out = run_overhead(tree, ["--profile", "--no-torch", "--width", str(width), "--algorithms", algorithms,
                              "--steps", str(steps)])
    rows = {}
    for line in out.splitlines():
        match = _PROFILE_ROW.match(line)
        if match:
            name, python, calls, opcodes = match.groups()
            rows[name] = {"python_calls": float(python), "all_calls": float(calls), "bytecode": int(opcodes)}
    if not rows:
        raise RuntimeError(f"bench/overhead.py --profile printed no rows:\n{out}")
    return rows


def timed_round(tree: Path, widths: str, algorithms: str, window: int, scratch: Path) -> dict[str, dict[str, float]]:
    """One window per configuration: per width and configuration, the step's process CPU time over the hand loop."""
    out = scratch / "round.json"
    run_overhead(tree, ["--widths", widths, "--algorithms", algorithms, "--rounds", "1", "--window", str(window),
                        "--no-torch", "--out", str(out)])
    report = json.loads(out.read_text())
    ratios: dict[str, dict[str, float]] = {}
    for result in report["results"]:
        cpu = result["cpu"]
        hand = cpu["hand"]["ms_per_step"]
        ratios[str(result["width"])] = {name: row["ms_per_step"] / hand for name, row in cpu.items()
                                        if name.startswith("pipecore/")}
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the commit to compare against (any git revision)")
    parser.add_argument("--head", default=None, help="the other commit (default: this checkout, as it is)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--widths", default="16")
    parser.add_argument("--algorithms", default="1f1b,2bw,pipedream")
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3, help="steps counted by --profile")
    parser.add_argument("--out", default=default_out("overhead-ab-cpu.json"), help=OUT_HELP)
    args = parser.parse_args(argv)
    base_rev = git("rev-parse", "--short", args.base)
    head_rev = "working tree" if args.head is None else git("rev-parse", "--short", args.head)
    scratch = Path(tempfile.mkdtemp(prefix="pipecore-ab-"))
    trees: dict[str, Path] = {}
    try:
        trees["base"] = checkout(base_rev, scratch)
        trees["head"] = ROOT if args.head is None else checkout(head_rev, scratch)
        width = int(args.widths.split(",")[0])
        counts = {side: profile(tree, width, args.algorithms, args.steps) for side, tree in trees.items()}
        rounds: dict[str, list[dict[str, dict[str, float]]]] = {"base": [], "head": []}
        for r in range(args.rounds):
            for side in (("base", "head") if r % 2 == 0 else ("head", "base")):
                rounds[side].append(timed_round(trees[side], args.widths, args.algorithms, args.window, scratch))
                print(f"round {r + 1}/{args.rounds} {side}: " + ", ".join(
                    f"{name} {ratio:.3f}" for name, ratio in rounds[side][-1][str(width)].items()), flush=True)
    finally:
        for side, tree in trees.items():
            if tree != ROOT:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
        shutil.rmtree(scratch, ignore_errors=True)
    timed = {}
    for w in args.widths.split(","):
        timed[w] = {}
        for name in rounds["head"][0][w]:
            base = [r[w][name] for r in rounds["base"]]
            head = [r[w][name] for r in rounds["head"]]
            per_round = [h / b for h, b in zip(head, base)]
            timed[w][name] = {"base_over_hand": round(statistics.median(base), 3),
                              "head_over_hand": round(statistics.median(head), 3),
                              "head_over_base": {"median": round(statistics.median(per_round), 3),
                                                 "range": [round(min(per_round), 3), round(max(per_round), 3)]}}
    print(f"\nbytecode instructions per action (width {width}): base {base_rev}, head {head_rev}")
    for name, row in counts["head"].items():
        before = counts["base"].get(name)
        print(f"  {name:<34} {before['bytecode'] if before else '-':>8} {row['bytecode']:>8}")
    print("\nprocess CPU time per step over the hand-written loop (median over rounds): base, head, head/base")
    for w, rows in timed.items():
        for name, row in rows.items():
            print(f"  width {w:<4} {name:<34} {row['base_over_hand']:6.3f} {row['head_over_hand']:6.3f} "
                  f"{row['head_over_base']['median']:6.3f} {row['head_over_base']['range']}")
    report = {
        "benchmark": "overhead-ab",
        "command": "python bench/overhead_ab.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(), "device": "cpu", "dtype": "float32",
        "base": base_rev, "head": head_rev,
        "sizes": {"widths": args.widths, "algorithms": args.algorithms, "window_steps": args.window,
                  "rounds": args.rounds, "profile_steps": args.steps},
        "statistic": "per_action: bench/overhead.py --profile's counts per action at each commit; over_hand: median "
                     "over rounds of a window's process CPU time per step over the hand-written loop's in the same "
                     "process; head_over_base: median and range of the per-round ratios of those",
        "per_action": counts,
        "over_hand": timed,
    }
    print(f"wrote {write_report(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
