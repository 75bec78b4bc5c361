"""The disk size of the running Python environment and of its largest installed distributions.

    python bench/venv_size.py            # the environment of this interpreter (a virtual environment's root)
    python bench/venv_size.py --top 12

What the README's install section quotes: run it in a fresh virtual environment after one of the install
commands. A distribution's size is the sum of the files its RECORD lists (torch, triton, the nvidia-*
packages, ...); the environment's is every file under ``sys.prefix`` (``du -sh .venv`` agrees up to block
rounding). An editable install of pipecore adds only a few small files here: its extension is built in the
source tree.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path


def tree_bytes(root: Path) -> int:
    """Bytes of every regular file under ``root`` (links not followed)."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                total += os.path.getsize(path)
    return total


def distribution_bytes(dist: importlib.metadata.Distribution) -> int:
    """Bytes of the files a distribution's RECORD lists (0 where it lists none)."""
    total = 0
    for file in dist.files or []:
        path = Path(str(dist.locate_file(file)))
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=8, help="how many of the largest distributions to list")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    sizes = sorted(((distribution_bytes(d), d.metadata["Name"], d.version) for d in importlib.metadata.distributions()),
                   reverse=True)
    total = tree_bytes(Path(sys.prefix))
    print(f"environment {sys.prefix}: {total / 2**30:.2f} GiB ({total / 1e9:.2f} GB); Python {platform.python_version()}, "
          f"{platform.system()} {platform.machine()}")
    for size, name, version in sizes[: args.top]:
        print(f"  {size / 2**20:8.0f} MiB  {name} {version}")
    nvidia = sum(size for size, name, _ in sizes if name.lower().startswith("nvidia"))
    print(f"  nvidia-* distributions together: {nvidia / 2**20:.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps({
            "prefix": sys.prefix, "bytes": total, "python": platform.python_version(), "machine": platform.machine(),
            "distributions": [{"name": n, "version": v, "bytes": s} for s, n, v in sizes]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
