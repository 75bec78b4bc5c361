"""The ``pipecore`` command line, and the runnable examples of the docs.

The console examples in ``docs/*.md`` (lines ``$ pipecore ...`` followed by their output) are run and
compared exactly; ``PIPECORE_UPDATE_GOLDEN=1`` rewrites their outputs in place.
"""

from __future__ import annotations

import doctest
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest

import pipecore
from pipecore import algorithm_names, simulate
from pipecore import cli
from pipecore.cli import main
from pipecore.cli._args import parse_option_value

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "docs" / "simulator.md", ROOT / "docs" / "algorithms.md"]
UPDATE = os.environ.get("PIPECORE_UPDATE_GOLDEN") == "1"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --------------------------------------------------------------------------- simulate


def test_prints_grid_and_summary(capsys):
    code, out, err = run(capsys, "simulate", "--algorithm", "pipedream", "--stages", "3", "--microbatches", "2")
    assert code == 0 and err == ""
    t = simulate("pipedream", 3, 2, 4)
    assert out == t.grid() + "\n\n" + t.summary() + "\n"
    assert "bubble fraction" in out and "staleness(mean/max)" in out


def test_no_grid_prints_only_the_summary(capsys):
    code, out, _ = run(capsys, "simulate", "-a", "gpipe", "-p", "2", "-m", "2", "-n", "1", "--no-grid")
    assert code == 0 and out == simulate("gpipe", 2, 2, 1).summary() + "\n"


def test_options_are_parsed_and_passed(capsys):
    code, out, _ = run(capsys, "simulate", "-a", "i-timeprest", "-p", "3", "-m", "2", "-n", "3",
                       "--option", "alpha=inverse", "--option", "lam=0.5")
    assert code == 0
    assert out.startswith(simulate("i-timeprest", 3, 2, 3, alpha="inverse", lam=0.5).grid())
    assert "0B4-5@v2~interp(v0,a=0.5)" in out  # 1 / (1 + 0.5 * 2)
    code, out, _ = run(capsys, "simulate", "-a", "spectrain", "-p", "3", "-m", "1", "-n", "1",
                       "-o", "lookahead=4,0,1")
    assert code == 0 and "0F0@v0~pred(s=4)" in out and "1F0@v0 " in out


@pytest.mark.parametrize("text, value", [
    ("3", 3), ("0.5", 0.5), ("1e-3", 1e-3), ("inverse", "inverse"), ("true", True), ("False", False),
    ("none", None), ("3,2,1", [3, 2, 1]), ("1,0.5", [1, 0.5]),
])
def test_option_values(text, value):
    assert parse_option_value(text) == value
    assert type(parse_option_value(text)) is type(value)


def test_costs_flags(capsys):
    code, out, _ = run(capsys, "simulate", "-a", "gpipe", "-p", "4", "-m", "1", "-n", "2", "--no-grid",
                       "--forward-costs", "1,2,0.5,1.5", "--backward-costs", "2,3,1,4", "--send-cost", "0.25",
                       "--update-costs", "0.5")
    assert code == 0
    t = simulate("gpipe", 4, 1, 2, costs={"forward": [1, 2, 0.5, 1.5], "backward": [2, 3, 1, 4], "send": 0.25,
                                          "update": 0.5})
    assert out == t.summary() + "\n"
    assert f"makespan {2 * (5 + 10 + 1.5 + 0.5):g}" in out
    # --costs sets both; a per-stage flag overrides its part.
    code, out, _ = run(capsys, "simulate", "-a", "1f1b", "-p", "2", "-m", "2", "-n", "1", "--no-grid",
                       "--costs", "2,3", "--backward-costs", "1")
    assert out == simulate("1f1b", 2, 2, 1, costs={"forward": 2, "backward": 1}).summary() + "\n"


def test_png_and_chrome_outputs(capsys, tmp_path):
    png, chrome = tmp_path / "t.png", tmp_path / "t.json"
    code, out, _ = run(capsys, "simulate", "-a", "2bw", "-p", "3", "-m", "3", "-n", "2",
                       "--png", str(png), "--chrome", str(chrome))
    assert code == 0
    assert f"wrote timeline to {png}" in out and f"wrote Chrome trace to {chrome}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    events = json.loads(chrome.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == len(simulate("2bw", 3, 3, 2).events)


def test_compare_lists_every_algorithm(capsys):
    code, out, err = run(capsys, "simulate", "--compare", "--stages", "4", "--microbatches", "2")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "4 stages, 2 micro-batches x 4 mini-batches, costs F=1 B=1 W=1 (staleness and delay: mean/max)"
    assert lines[1].split() == ["algorithm", "bubble", "makespan", "ranks", "act/rank", "versions/stage", "staleness",
                                "delay", "derived"]
    rows = {line.split()[0]: line for line in lines[2:-1]}
    assert list(rows) == algorithm_names()
    # The V-shaped schedules place two stages on each rank: the table says they ran on fewer ranks.
    assert lines[-1] == ("note: zb-v places 2 stages on each rank: it runs these 4 stages on 2 ranks, the others on "
                         "4, so its makespan is that of 2 workers, not 4 (on 4 ranks: --stages 8)")
    # Constraints that reject P=4, m=2 are shown with their reason.
    assert "rejected: needs n_microbatches >= num_stages (got 2 < 4)" in rows["2bw"]
    assert "rejected: n_microbatches (2) must be >= num_stages (4" in rows["dualpipe-v"]
    assert all("rejected" not in rows[name] for name in algorithm_names() if name not in ("2bw", "dualpipe-v"))
    pipedream = simulate("pipedream", 4, 2, 4)
    cells = rows["pipedream"].split()
    assert cells[1] == f"{pipedream.bubble_fraction:.3f}" and cells[2] == f"{pipedream.makespan:g}"
    assert cells[3:5] == ["4", str(max(pipedream.peak_activations(s) for s in range(4)))]
    assert cells[5:9] == [str(pipedream.weight_versions(s)) for s in range(4)]
    assert cells[10] == f"{sum(pipedream.stage_summary(s).mean_delay for s in range(4)) / 4:.2f}/3"
    assert rows["spectrain"].split()[-1] == "0,1,2,3" and rows["gpipe"].split()[-1] == "-"
    zbv = simulate("zb-v", 4, 2, 4)
    assert rows["zb-v"].split()[1:5] == [f"{zbv.bubble_fraction:.3f}", f"{zbv.makespan:g}", "2",
                                        str(max(zbv.rank_peak_activations(r) for r in range(2)))]


def test_compare_with_costs(capsys):
    code, out, _ = run(capsys, "simulate", "--compare", "-p", "2", "-m", "2", "-n", "1", "--forward-costs", "1,3")
    assert code == 0 and "costs F=1,3 B=1 W=1" in out.splitlines()[0]
    gpipe_row = next(line for line in out.splitlines() if line.startswith("gpipe"))
    assert gpipe_row.split()[2] == f"{simulate('gpipe', 2, 2, 1, costs={'forward': [1, 3]}).makespan:g}"


@pytest.mark.parametrize("argv, message", [
    (["-a", "pipedraem", "-p", "4", "-m", "2"], "unknown algorithm 'pipedraem'; valid names: gpipe, 1f1b,"),
    (["-a", "2bw", "-p", "4", "-m", "2"], "2bw: needs n_microbatches >= num_stages (got 2 < 4)"),
    (["-a", "spectrain", "-p", "4", "-m", "2", "-o", "update_every=2"], "spectrain: update_every must be 1, got 2"),
    (["-a", "i-timeprest", "-p", "4", "-m", "2", "-o", "lam=-1"], "i-timeprest: lam must be >= 0"),
    (["-a", "gpipe", "-p", "0", "-m", "2"], "argument -p/--stages: must be an integer >= 1, got '0'"),
    (["-a", "gpipe", "-p", "2", "-m", "x"], "argument -m/--microbatches: must be an integer >= 1, got 'x'"),
    (["-a", "gpipe", "-p", "2", "-m", "2", "-n", "0"], "argument -n/--minibatches: must be an integer >= 1"),
    (["-a", "gpipe", "-p", "2"], "the following arguments are required: -m/--microbatches"),
    (["-p", "2", "-m", "2"], "--algorithm is required (or use --compare to run every algorithm)"),
    (["-a", "gpipe", "-p", "2", "-m", "2", "--option", "lam=1"], "unknown option(s) ['lam'] for algorithm 'gpipe'"),
    (["-a", "i-timeprest", "-p", "2", "-m", "2", "--option", "lam"], "expected KEY=VALUE (e.g. lam=0.5), got 'lam'"),
    (["-a", "i-timeprest", "-p", "2", "-m", "2", "-o", "lam=fast"], "option lam='fast': must be a number or inf"),
    (["-a", "i-timeprest", "-p", "2", "-m", "2", "-o", "alpha=cos"], "alpha must be one of ['constant', 'exp',"),
    (["-a", "gpipe", "-p", "2", "-m", "2", "--costs", "1,x"], "argument --costs: 'x' is not a number"),
    (["-a", "gpipe", "-p", "2", "-m", "2", "--costs", "1,-2"], "'-2' is not a finite non-negative number"),
    (["-a", "gpipe", "-p", "2", "-m", "2", "--costs", "1,2,3,4"], "--costs takes F,B or F,B,W (two or three numbers), got 4 values"),
    (["-a", "gpipe", "-p", "2", "-m", "2", "--forward-costs", "1,2,3"],
     "--forward-costs takes one value or one per stage (2), got 3"),
    (["-a", "gpipe", "-p", "2", "-m", "2", "--send-cost", "1,2"], "--send-cost takes one number, got 2"),
    (["--compare", "-a", "gpipe", "-p", "2", "-m", "2"], "--algorithm applies to one algorithm; --compare runs"),
    (["--compare", "-p", "2", "-m", "2", "--png", "x.png"], "--png applies to one algorithm"),
    (["-a", "gpipe", "-p", "2", "-m", "2", "--png", "/nonexistent-dir/x.png"],
     "cannot write /nonexistent-dir/x.png: No such file or directory"),
    (["-a", "gpipe", "-p", "2", "-m", "2", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_input_exits_2_with_one_clear_line(capsys, argv, message):
    code, out, err = run(capsys, "simulate", *argv)
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert lines[0].startswith("pipecore simulate: error: ")


@pytest.mark.parametrize("argv, line", [
    (["simulate", "-a", "gpipe", "-p", "0", "-m", "2"],
     "pipecore simulate: error: argument -p/--stages: must be an integer >= 1, got '0' (see pipecore simulate --help)"),
    (["simulate", "-a", "gpipe", "-p", "2"],
     "pipecore simulate: error: the following arguments are required: -m/--microbatches (see pipecore simulate "
     "--help)"),
    (["train", "--epochs", "x"],
     "pipecore train: error: argument -e/--epochs: must be an integer >= 1, got 'x' (see pipecore train --help)"),
    (["plan", "--bogus"], "pipecore plan: error: unrecognized arguments: --bogus (see pipecore plan --help)"),
    (["simulat"], "pipecore: error: argument COMMAND: invalid choice: 'simulat' (choose from 'plan', 'simulate', "
                  "'train') (see pipecore --help)"),
])
def test_argument_errors_are_one_line_that_points_at_help(capsys, argv, line):
    """Without argparse's usage block, which would put ten lines of flags before the error."""
    code, out, err = run(capsys, *argv)
    assert (code, out, err) == (2, "", line + "\n")


def test_the_help_states_the_costs_the_simulation_uses(capsys):
    """The defaults --help gives for the costs are those the header of a run prints."""
    code, out, _ = run(capsys, "simulate", "--help")
    assert code == 0
    described = " ".join(out.split())
    assert "--costs F,B[,W] sets every stage (default 1,1,1:" in described and "default 1,2" not in described
    _, default, _ = run(capsys, "simulate", "--compare", "-p", "4", "-m", "4", "-n", "1")
    assert "costs F=1 B=1 W=1 " in default.splitlines()[0]
    assert run(capsys, "simulate", "--compare", "-p", "4", "-m", "4", "-n", "1", "--costs", "1,1,1")[1] == default
    assert run(capsys, "simulate", "--compare", "-p", "4", "-m", "4", "-n", "1", "--costs", "1,2")[1] != default


def test_top_level(capsys):
    code, _, err = run(capsys)
    assert code == 2 and "simulate" in err
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"pipecore {pipecore.__version__}"
    code, out, _ = run(capsys, "simulate", "--help")
    assert code == 0 and "--forward-costs" in out and "examples:" in out
    code, _, err = run(capsys, "simulat")
    assert code == 2 and "invalid choice: 'simulat'" in err and "usage:" not in err


def test_a_command_is_one_registry_line(capsys, monkeypatch):
    module = types.ModuleType("pipecore_test_hello")
    module.HELP = "say hello"
    module.add_arguments = lambda parser: parser.add_argument("--name", default="world")

    def run_hello(args):
        if args.name == "nobody":
            raise ValueError("nobody to greet")
        print(f"hello {args.name}")
        return 0

    module.run = run_hello
    monkeypatch.setitem(sys.modules, "pipecore_test_hello", module)
    monkeypatch.setitem(cli.COMMANDS, "hello", "pipecore_test_hello")
    assert run(capsys, "hello", "--name", "pipe")[:2] == (0, "hello pipe\n")
    code, _, err = run(capsys, "hello", "--name", "nobody")
    assert code == 2 and err == "pipecore hello: error: nobody to greet\n"
    assert "say hello" in run(capsys, "--help")[1]


def test_python_dash_m():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "pipecore", "simulate", "-a", "gpipe", "-p", "2", "-m", "1", "-n", "1"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("stage 0: 0F0@v0 0B0@v0 0U1\nstage 1: 1F0@v0 1B0@v0 1U1\n")


def test_python_dash_m_exit_code(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pipecore", "simulate", "-a", "nope", "-p", "2", "-m", "1"])
    with pytest.raises(SystemExit) as info:
        runpy.run_module("pipecore", run_name="__main__")
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("pipecore simulate: error: unknown algorithm 'nope'")


# --------------------------------------------------------------------------- docs examples


_BLOCK = re.compile(r"```console\n(.*?)```", re.S)


def console_examples(text: str) -> list[tuple[str, str, tuple[int, int]]]:
    """``(command, expected output, span of the output in text)`` for every ``$ pipecore`` line."""
    out = []
    for block in _BLOCK.finditer(text):
        body, start = block.group(1), block.start(1)
        commands = [m for m in re.finditer(r"^\$ (.*)\n", body, re.M)]
        for i, command in enumerate(commands):
            end = commands[i + 1].start() if i + 1 < len(commands) else len(body)
            out.append((command.group(1), body[command.end():end], (start + command.end(), start + end)))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_console_examples_are_real(doc, capsys, tmp_path, monkeypatch):
    text = doc.read_text()
    examples = console_examples(text)
    assert examples, f"{doc.name} has no console examples"
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    replaced = text
    for command, expected, (start, end) in reversed(examples):
        argv = shlex.split(command)
        assert argv[0] == "pipecore", command
        code, out, err = run(capsys, *argv[1:])
        assert code == 0 and err == "", (command, err)
        if UPDATE:
            replaced = replaced[:start] + out + replaced[end:]
        else:
            assert out == expected, f"output of `{command}` in {doc.name} is stale"
    if UPDATE and replaced != text:
        doc.write_text(replaced)


def test_docs_python_examples_run(tmp_path, monkeypatch):
    """The ``pycon`` blocks of the simulator docs, run as one doctest session."""
    monkeypatch.chdir(tmp_path)
    doc = ROOT / "docs" / "simulator.md"
    source = "\n".join(re.findall(r"```pycon\n(.*?)```", doc.read_text(), re.S))
    test = doctest.DocTestParser().get_doctest(source, {}, doc.name, str(doc), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    failures = []
    runner.run(test, out=failures.append)
    assert runner.summarize(verbose=False).attempted > 10
    assert runner.failures == 0, "".join(failures)
