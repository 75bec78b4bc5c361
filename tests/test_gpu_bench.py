"""bench/gpu.py, the one command for a GPU machine: what can be checked without a GPU.

The command line, the exit without a GPU, the JUnit parsing, the targets, the summary and the JSON
(on FABRICATED inputs, marked as such: no number here is a measurement), the hand-written GPT stages,
and one dry run of the GPT part on the CPU (the script's own code, tiny sizes).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pipecore

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import gpu  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the command would run")
def test_without_a_gpu_it_prints_one_line_and_exits_2(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench/gpu.py: no CUDA GPU here"), proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--parts", "kernels,foo"],
     "unknown part(s) foo in --parts; choose from build,load,tests,kernels,plan,train,offload,gpt"),
    (["--parts", ","], "--parts is empty; choose from build,load,tests,kernels,plan,train,offload,gpt"),
    (["--budget", "0"], "--budget must be a positive number of seconds, got 0.0"),
    (["--device", "cpu"], "--device must be cuda or cuda:N, got 'cpu'"),
    (["--device", "cuda:x"], "--device must be cuda or cuda:N, got 'cuda:x'"),
])
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python bench/gpu.py: error: {message} (see --help)"]


def test_parts_keep_their_order_and_build_joins():
    assert gpu.parse_args([]).part_list == ["load", "tests", "kernels", "plan", "train", "offload", "gpt"]
    args = gpu.parse_args(["--parts", "gpt,load,gpt", "--build", "--quick"])
    assert args.part_list == ["build", "load", "gpt"] and args.quick
    assert gpu.parse_args(["--dry-run-cpu"]).device == "cpu"
    assert gpu.slug("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"


def test_gpt_configurations_run_what_the_targets_need_first():
    order = gpu.gpt_configs(["small", "large"], None)
    first = [c for s, c in order[:12]]
    assert first == ["torch", "hand", "1f1b", "torch-bf16", "hand-bf16", "1f1b-bf16"] * 2
    assert [s for s, _ in order[:12]] == ["small"] * 6 + ["large"] * 6
    names = {c for _, c in order}
    for alg in gpu.PIPE_ALGORITHMS:
        for variant in ("", "-inturn"):
            for prec in ("", "-bf16"):
                assert f"{alg}{variant}{prec}" in names
    assert len(order) == 2 * (4 + 16)
    assert gpu.gpt_configs(["tiny"], {"hand", "2bw-inturn"}) == [("tiny", "hand"), ("tiny", "2bw-inturn")]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_ops" name="test_cuda_ops_match_reference[1-dtype0]" time="0.5"/>
<testcase classname="tests.test_ops" name="test_cuda_ops_match_reference[1-dtype2]" time="0.7">
<failure message="AssertionError: Tensor-likes are not close!">long traceback</failure></testcase>
<testcase classname="tests.test_ring" name="test_cuda_ring" time="0.1">
<error message="fixture broke">tb</error></testcase>
<testcase classname="tests.test_concurrent" name="test_a_cuda_device_without_cuda_is_refused" time="0">
<skipped type="pytest.skip" message="checks the message on a machine without CUDA">skip</skipped></testcase>
</testsuite></testsuites>"""


def test_junit_reports_give_each_tests_outcome(tmp_path):
    path = tmp_path / "j.xml"
    path.write_text(JUNIT)  # FABRICATED report: the format pytest writes, outcomes made up
    parsed = gpu.parse_junit(path)
    assert parsed["counts"] == {"passed": 1, "failed": 1, "error": 1, "skipped": 1}
    by_id = {t["id"]: t for t in parsed["tests"]}
    fail = by_id["tests.test_ops::test_cuda_ops_match_reference[1-dtype2]"]
    assert fail["outcome"] == "failed" and fail["message"].startswith("AssertionError: Tensor-likes")
    assert "long traceback" in fail["message"]
    assert by_id["tests.test_concurrent::test_a_cuda_device_without_cuda_is_refused"]["message"] == \
        "checks the message on a machine without CUDA"


def _fabricated_report(tmp_path: Path) -> dict:
    """A report as bench/gpu.py assembles it, every number FABRICATED for this test (no measurement)."""
    (tmp_path / "j.xml").write_text(JUNIT)
    kernels = {"copy_gbps": 2000.0, "results": [
        {"op": "interpolate", "numel": 64 << 20, "size": "64M", "ratio": 1.2, "fused_gbps": 1800.0},
        {"op": "predict", "numel": 64 << 20, "size": "64M", "ratio": 0.9, "fused_gbps": 1600.0},
        {"op": "sgd", "numel": 64 << 20, "size": "64M", "ratio": 1.5, "fused_gbps": 1900.0},
        {"op": "adamw", "numel": 64 << 20, "size": "64M", "ratio": 1.1, "fused_gbps": 1900.0},
        {"op": "sgd", "numel": 16 << 20, "size": "16M", "ratio": 0.1, "fused_gbps": 1.0},  # below 64M: no target
    ]}
    runs = [{"size": "small", "config": "hand", "ms": 100.0}, {"size": "small", "config": "1f1b", "ms": 105.0},
            {"size": "small", "config": "hand-bf16", "ms": 90.0}, {"size": "small", "config": "1f1b-bf16", "ms": 120.0},
            {"size": "large", "config": "hand", "ms": 200.0}, {"size": "large", "config": "1f1b", "ms": 230.0},
            {"size": "large", "config": "2bw", "ms": None, "status": "not run", "note": "no time left in the budget"}]
    gpu._ratios(runs)
    offload = {"results": {"plain": {"predicted_peak_bytes": 90, "measured_peak_bytes": 100},
                           "offload": {"predicted_peak_bytes": 50, "measured_peak_bytes": 100}}}
    load = {"dispatch": [{"op": "sgd delta", "dtype": "bfloat16", "bit_identical": False},
                         {"op": "predict", "dtype": "float32", "bit_identical": True}],
            "fma_in_ptx": {"sgd bfloat16": 0, "adamw float32": 0, "predict float64": None}}
    return {"schema": gpu.SCHEMA, "device": {"name": "FABRICATED GPU"}, "versions": {"python": "3.x"},
            "commit": "abc", "out": str(tmp_path / "gpu-FABRICATED.json"), "parts": {
                "load": {"status": "ok", "seconds": 0.5, "errors": [], "result": load},
                "tests": {"status": "failed", "seconds": 1.0, "errors": [],
                          "result": gpu.parse_junit(tmp_path / "j.xml")},
                "kernels": {"status": "ok", "seconds": 2.0, "errors": [], "result": {"reports": {"bfloat16": kernels}}},
                "offload": {"status": "ok", "seconds": 3.0, "errors": [], "result": {"report": offload}},
                "gpt": {"status": "failed", "seconds": 4.0, "result": {"runs": runs},
                        "errors": [{"where": "gpt large 2bw", "error": "RuntimeError: boom", "traceback": "tb"}]},
            }}


def test_targets_summary_and_json_on_fabricated_results(tmp_path):
    report = _fabricated_report(tmp_path)
    targets = {t["what"]: t for t in gpu.collect_targets(report)}
    bits = targets["fused ops on CUDA vs pipecore.ops.reference: results not bit-identical"]
    assert bits["value"] == 1 and not bits["met"] and bits["detail"] == ["sgd delta bfloat16"]
    fma = targets["fma.rn instructions in the PTX of 2 of 3 Triton kernel variants"]
    assert fma["value"] == 0 and fma["met"]
    k = "interpolate bfloat16 64M: "
    assert targets[k + "fused vs torch op"]["met"] and targets[k + "fraction of copy bandwidth"]["value"] == 0.9
    assert not targets["predict bfloat16 64M: fused vs torch op"]["met"]
    assert not targets["predict bfloat16 64M: fraction of copy bandwidth"]["met"]  # 0.8 < 0.85
    assert targets["sgd bfloat16 64M: fused vs torch optimizer + copy"]["met"]      # 1.5 >= 1.4
    assert not targets["adamw bfloat16 64M: fused vs torch optimizer + copy"]["met"]  # 1.1 < 1.2
    assert not any("16M" in w for w in targets)
    small = targets["small GPT 1f1b float32 vs hand-written loop (speed ratio)"]
    assert small["value"] == round(100 / 105, 3) and small["met"]                   # 0.952 >= 0.9
    assert not targets["large GPT 1f1b float32 vs hand-written loop (speed ratio)"]["met"]  # 0.87 < 0.95
    assert not targets["small GPT 1f1b-bf16 vs hand-written loop (speed ratio)"]["met"]     # 0.75
    assert not targets["small GPT 1f1b: bf16 autocast ms / float32 ms"]["met"]             # 120 > 105
    assert targets["offload plain: predicted peak vs measured (relative error)"]["met"]    # -10%
    assert not targets["offload offload: predicted peak vs measured (relative error)"]["met"]  # -50%
    report["targets"] = gpu.collect_targets(report)
    text = gpu.summary(report)
    assert "FABRICATED GPU" in text
    assert "FAILED tests.test_ops::test_cuda_ops_match_reference[1-dtype2]: AssertionError" in text
    assert "ERROR tests.test_ring::test_cuda_ring" in text
    assert "large  2bw" in text and "not run: no time left in the budget" in text
    assert f"targets: {sum(t['met'] for t in report['targets'])} of {len(report['targets'])} met" in text
    assert "gpt      failed         4.0  1 error(s): RuntimeError: boom" in text
    path = gpu.write_json(report, report["out"])
    assert json.loads(path.read_text())["targets"] == report["targets"]


def test_hand_written_stages_are_the_gpt_cut_where_pipecore_cuts_it():
    from pipecore.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=16, n_layer=6, n_head=2, n_embd=16)
    assert gpu.gpt_partition(6) == ["blocks.2", "blocks.4", "blocks.5"]
    assert gpu.gpt_partition(8) == ["blocks.2", "blocks.4", "blocks.6"]
    stages = gpu.gpt_stage_modules(model)
    assert stages[0].tok_emb is model.tok_emb and stages[3].head.weight is model.tok_emb.weight  # tied
    idx = torch.randint(0, 32, (4, 16))
    h = idx
    for st in stages:
        h = st(h)
    assert torch.equal(h, model(idx))
    # One step of the hand-written loop (8 micro-batches, 1F1B order, AdamW) against plain torch on the batch:
    # the same update up to float32 round-off (the loss is summed over micro-batches in another order).
    hand_model, plain_model = copy.deepcopy(model), copy.deepcopy(model)
    x, y = torch.randint(0, 32, (16, 16)), torch.randint(0, 32, (16, 16))
    hand_loss = gpu.hand_written_step(hand_model, False, "cpu")(x, y)
    plain_loss = gpu.torch_step(plain_model, False, "cpu")(x, y)
    torch.testing.assert_close(hand_loss, plain_loss, rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(hand_model.named_parameters(), plain_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_a_cpu_dry_run_of_the_gpt_part_writes_its_json(tmp_path):
    out = tmp_path / "dry.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--dry-run-cpu", "--parts", "gpt",
                           "--gpt-configs", "torch,hand,1f1b", "--profile-gpt", "tiny/1f1b", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["dry_run_cpu"] and report["schema"] == gpu.SCHEMA
    assert report["versions"]["torch"] == torch.__version__
    runs = report["parts"]["gpt"]["result"]["runs"]
    assert [r["config"] for r in runs] == ["torch", "hand", "1f1b"] and all(r["ms"] > 0 for r in runs)
    assert runs[2]["vs_hand"] == pytest.approx(runs[1]["ms"] / runs[2]["ms"])
    assert abs(runs[0]["loss"] - runs[1]["loss"]) < 1e-3  # the same model, data and step count
    assert "DRY RUN ON CPU (no GPU figures)" in proc.stdout
    assert report["versions"]["pipecore"] == pipecore.__version__
    # --profile-gpt profiles the configuration named, and only it: the pipeline's step is among its functions
    assert "profile" not in runs[0] and "profile" not in runs[1]
    profile = runs[2]["profile"]
    assert profile["steps"] == report["parts"]["gpt"]["result"]["timed_steps"] and profile["calls_per_step"] > 0
    functions = [f["function"] for f in profile["top_own_time"]]
    assert len(functions) == gpu.PROFILE_TOP
    assert any(f.startswith("pipecore/") for f in functions), functions  # paths relative to the checkout


def test_host_profile_counts_the_calls_of_each_step():
    def leaf(n: int) -> int:
        return sum(range(n))

    def step(i: int) -> None:
        for _ in range(3):
            leaf(1000)

    profile = gpu.host_profile(step, 4, lambda: None)
    assert profile["steps"] == 4
    row = next(f for f in profile["top_own_time"] if f["function"].endswith("(leaf)"))
    assert row["calls_per_step"] == 3 and row["own_ms_per_step"] > 0
    assert row["cumulative_ms_per_step"] >= row["own_ms_per_step"]


def test_the_tests_part_survives_a_crashing_test_file(tmp_path, monkeypatch):
    """A test file whose test kills pytest (SIGSEGV, as the H100 run saw in pipecore._C) loses only its own results:
    the run over every file is repeated per file, and the other file's GPU test is recorded."""
    import argparse
    import signal
    import time

    crash = tmp_path / "test_crash.py"
    crash.write_text("import os, signal\n\ndef test_cuda_crashes():\n"
                     f"    os.kill(os.getpid(), signal.{signal.SIGSEGV.name})\n")
    fine = tmp_path / "test_fine.py"
    fine.write_text("def test_cuda_fine():\n    pass\n\ndef test_not_for_the_gpu():\n    pass\n")
    monkeypatch.setattr(gpu, "_select_test_files", lambda: [str(crash), str(fine)])
    rec = gpu.Recorder(None)
    gpu.part_tests(argparse.Namespace(deadline=time.time() + 400), rec)
    res = rec.data["result"]
    assert res["counts"] == {"passed": 1}
    assert [t["id"].rsplit("::", 1)[1] for t in res["tests"]] == ["test_cuda_fine"]  # the plugin dropped the other
    assert [r["returncode"] for r in res["runs"]] == [-signal.SIGSEGV, -signal.SIGSEGV, 0]
    assert [r["files"] for r in res["runs"]] == [[str(crash), str(fine)], [str(crash)], [str(fine)]]
    assert [e["error"] for e in rec.data["errors"]] == [
        f"RuntimeError: pytest exited with {-signal.SIGSEGV} (a crash or a usage error; see output_tail)"] * 2
