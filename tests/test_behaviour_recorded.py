"""Every algorithm traces and trains exactly as recorded in ``tests/golden/behaviour.json``.

The file was written by ``python tests/test_behaviour_recorded.py`` before the algorithm state, the stage
state and the pipeline were redesigned: a redesign may move code, never change a version read or a bit of a
result. Per configuration it holds the simulator's version trace and, from float64 training in one process,
every step's loss and the bits of every tensor of the flushed ``state_dict`` (model weights by name; the
pipeline's own state, such as optimizer moments and an algorithm's buffers, as a sorted list of tensor digests,
so that renaming an entry of the checkpoint's metadata does not count as a change of behaviour).

One change of kept state is intended: SpecTrain under AdamW keeps its update direction as a buffer estimated
after each update (as under SGD) instead of computing it from the moments at every predicted read, which reads
the same moments and weights, so its reads and results are unchanged (``KEPT_SINCE``).

Float64 results are compared bit for bit on a machine with the recording's CPU capability (the vector
instruction set torch dispatches to, which decides how a matmul rounds); elsewhere to 1e-12, relative.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pipecore
from pipecore import SGD, AdamW, Pipeline

GOLDEN = Path(__file__).parent / "golden" / "behaviour.json"

# name -> (algorithm, options, optimizer, stages, micro-batches). Every algorithm, and the options that select
# another read or another kept state (PipeMare's corrections off, SpecTrain under AdamW, I-TiMePReSt's alpha).
CONFIGS: dict[str, tuple[str, dict[str, Any], str, int, int]] = {
    "gpipe": ("gpipe", {}, "sgd", 4, 4),
    "1f1b": ("1f1b", {}, "adamw", 4, 4),
    "pipedream": ("pipedream", {}, "sgd", 4, 4),
    "pipedream-slack": ("pipedream", {"slack": 1}, "sgd", 4, 4),
    "2bw": ("2bw", {}, "adamw", 4, 4),
    "pipemare": ("pipemare", {"warmup_steps": 6}, "sgd", 4, 4),
    "pipemare-linear-stash": ("pipemare", {"warmup_steps": 6, "lr_warmup": "linear", "backward_rule": "recompute"},
                              "adamw", 4, 4),
    "pipemare-no-t2": ("pipemare", {"discrepancy_correction": False}, "sgd", 4, 4),
    "pipemare-every-2": ("pipemare", {"update_every": 2, "delta_decay": 0.5}, "sgd", 4, 4),
    "spectrain": ("spectrain", {}, "sgd", 4, 4),
    "spectrain-adamw": ("spectrain", {"lookahead": [2, 1, 1, 0]}, "adamw", 4, 4),
    "timeprest": ("timeprest", {}, "sgd", 4, 2),
    "v-timeprest": ("v-timeprest", {}, "sgd", 4, 2),
    "i-timeprest": ("i-timeprest", {}, "sgd", 4, 2),
    "i-timeprest-inverse": ("i-timeprest", {"alpha": "inverse", "lam": 0.5, "backward_rule": "recompute"},
                            "adamw", 4, 2),
    "interleaved-1f1b": ("interleaved-1f1b", {"stages_per_rank": 2}, "sgd", 4, 4),
    "looped-bfs": ("looped-bfs", {"stages_per_rank": 2}, "sgd", 4, 4),
    "zb-h1": ("zb-h1", {}, "sgd", 4, 4),
    "zb-v": ("zb-v", {}, "adamw", 4, 4),
    "dualpipe-v": ("dualpipe-v", {}, "sgd", 4, 4),
    # Recorded after the others (their entries unchanged): the staleness corrections on PipeDream's stash.
    "pipedream-dc": ("pipedream-dc", {"lam": 0.5}, "sgd", 4, 4),
    "pipedream-dc-adaptive": ("pipedream-dc", {"adaptive": True}, "adamw", 4, 4),
    "nesterov-async": ("nesterov-async", {}, "sgd", 4, 4),
}
#: Configurations that keep more tensors than when the file was recorded: how many more, per stage in all.
KEPT_SINCE = {"spectrain-adamw": 4}  # the direction buffer of each of the 4 stages
STEPS = 5
WIDTH = 6
LAYERS = 8


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(LAYERS):
        layers.append(nn.Linear(WIDTH, WIDTH, dtype=torch.float64))
        if i < LAYERS - 1:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, WIDTH, dtype=torch.float64, generator=generator),
             torch.randn(8, WIDTH, dtype=torch.float64, generator=generator)) for _ in range(STEPS)]


def _bits(t: torch.Tensor) -> list[str]:
    return [float(v).hex() for v in t.detach().reshape(-1).tolist()]


def _digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return f"{t.dtype}:{tuple(t.shape)}:" + hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:24]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def run(name: str) -> dict[str, Any]:
    """The trace and the float64 training results of configuration ``name``."""
    algorithm, options, optimizer, stages, microbatches = CONFIGS[name]
    trace = pipecore.simulate(algorithm, stages // options.get("stages_per_rank", 1), microbatches, 3, **options)
    opt = SGD(lr=0.05, momentum=0.9) if optimizer == "sgd" else AdamW(lr=0.01, weight_decay=0.01)
    pipe = Pipeline(_model(), stages, algorithm, microbatches, optimizer=opt, loss_fn=nn.MSELoss(),
                    partition=[4, 8, 12][:stages - 1], concurrent=False, threads_per_stage=1, **options)
    losses = [pipe.step(x, y).hex() for x, y in _batches()]
    pipe.flush()
    state = pipe.state_dict()
    meta = state.pop("pipecore")
    return {
        "trace": trace.grid() + "\n" + trace.summary(),
        "losses": losses,
        "weights": {key: _bits(value) for key, value in state.items()},
        "pipecore_state": sorted(_digest(t) for t in _tensors(meta["stages"])),
    }


def _capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_algorithm_traces_and_trains_as_recorded(name, golden):
    recorded = golden["configs"][name]
    got = run(name)
    assert got["trace"] == recorded["trace"]
    exact = golden["cpu_capability"] == _capability()
    if exact:
        assert got["losses"] == recorded["losses"]
        assert got["weights"] == recorded["weights"]
        extra = list(got["pipecore_state"])
        for digest in recorded["pipecore_state"]:
            extra.remove(digest)  # every tensor kept then is kept now, bit for bit
        assert len(extra) == KEPT_SINCE.get(name, 0)
    else:  # another vector instruction set rounds matmuls otherwise: equal to round-off
        assert [float.fromhex(v) for v in got["losses"]] == pytest.approx(
            [float.fromhex(v) for v in recorded["losses"]], rel=1e-12)
        assert list(got["weights"]) == list(recorded["weights"])
        for key, bits in recorded["weights"].items():
            assert [float.fromhex(v) for v in got["weights"][key]] == pytest.approx(
                [float.fromhex(v) for v in bits], rel=1e-12, abs=1e-14), key
        assert len(got["pipecore_state"]) == len(recorded["pipecore_state"]) + KEPT_SINCE.get(name, 0)


if __name__ == "__main__":
    configs = {}
    for name in CONFIGS:
        print(name, file=sys.stderr)
        configs[name] = run(name)
    GOLDEN.write_text(json.dumps({"torch": torch.__version__, "cpu_capability": _capability(),
                                  "configs": configs}, indent=1) + "\n")
    print(f"wrote {GOLDEN} ({os.path.getsize(GOLDEN)} bytes)", file=sys.stderr)
