"""Start a benchmark's worker processes the way ``torchrun`` does (environment variables, one port)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def spawn(script: str, args: list[str], ranks: int) -> list[str]:
    """Run ``python script *args`` as ``ranks`` ranks on loopback with one thread each; returns every rank's
    standard output, rank order. Exits with the failing rank's output if one fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(ranks):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env, stdout=subprocess.PIPE, text=True))
    outputs = [p.communicate()[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        if p.returncode:
            raise SystemExit(f"rank {rank} failed (exit {p.returncode}):\n{out}")
    return outputs
