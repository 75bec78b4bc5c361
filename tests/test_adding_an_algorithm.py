"""An algorithm defined outside the package: the guide's example runs, and ``register_algorithm`` guards names."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import pipecore
from pipecore.algorithms import ALIASES, SPECS, AlgorithmSpec, get_spec, register_algorithm
from pipecore.algorithms.base import Live
from pipecore.schedule import gpipe

GUIDE = Path(__file__).parent.parent / "docs" / "adding-an-algorithm.md"


def test_the_guides_first_python_block_defines_registers_trains_and_checks_an_algorithm():
    """The guide's example, as a user runs it (its own process: registering changes the process's algorithms)."""
    block = re.search(r"```python\n(.*?)```", GUIDE.read_text(), re.S).group(1)
    assert "pipecore.register_algorithm" in block and "num_stages=4" in block and "buffers=" in block
    done = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "look-ahead on 4 stages equals the hand-computed reference"


@pytest.fixture
def registry():
    """The registry as it was, put back after the test."""
    specs, aliases = dict(SPECS), dict(ALIASES)
    yield
    SPECS.clear()
    SPECS.update(specs)
    ALIASES.clear()
    ALIASES.update(aliases)


def _spec(name: str, aliases: tuple[str, ...] = ()) -> AlgorithmSpec:
    return AlgorithmSpec(name=name, summary="GPipe again", schedule=gpipe, forward=Live(), backward=Live(),
                         aliases=aliases)


def test_a_registered_algorithm_is_found_by_name_and_alias_and_simulates(registry):
    spec = _spec("gpipe-again", aliases=("Again",))
    assert pipecore.register_algorithm(spec) is spec
    assert get_spec("GPIPE-AGAIN") is spec and get_spec("again") is spec
    assert pipecore.algorithm_names()[-1] == "gpipe-again"
    assert pipecore.simulate("again", 2, 2, 1).grid() == pipecore.simulate("gpipe", 2, 2, 1).grid()


def test_a_taken_name_or_alias_is_refused_unless_replacing_the_same_algorithm(registry):
    with pytest.raises(ValueError, match="'pipedream' is registered already; pass replace=True"):
        register_algorithm(_spec("pipedream"))
    with pytest.raises(ValueError, match="'pipedream-flush' already names the algorithm '1f1b'"):
        register_algorithm(_spec("mine", aliases=("pipedream-flush",)))
    with pytest.raises(ValueError, match="'1f1b' already names the algorithm '1f1b'"):
        register_algorithm(_spec("mine", aliases=("1f1b",)))
    register_algorithm(_spec("mine", aliases=("first",)))
    replacement = _spec("mine", aliases=("second",))
    register_algorithm(replacement, replace=True)
    assert get_spec("mine") is replacement and get_spec("second") is replacement
    with pytest.raises(ValueError, match="unknown algorithm 'first'"):
        get_spec("first")  # the replaced definition's alias is gone with it


@pytest.mark.parametrize("bad,error", [
    ("not a spec", "takes a pipecore.algorithms.AlgorithmSpec, got a str"),
    (_spec("Upper"), "must be non-empty and lower-case, got 'Upper'"),
])
def test_what_is_not_an_algorithm_is_refused_with_what_is_allowed(registry, bad, error):
    with pytest.raises((TypeError, ValueError), match=re.escape(error)):
        register_algorithm(bad)
