"""Stage threads take the process's share of intra-op threads (or ``threads_per_stage``), set on each thread."""

import pytest
import torch
from torch import nn

import pipecore
from pipecore.engine import threads as stage_threads


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(8, 8), nn.ReLU())])


class _Probe(nn.Module):
    """Records torch.get_num_threads() on the thread that runs its forward."""

    seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Probe.seen.append(torch.get_num_threads())
        return x


def _threads_seen(stages: int, **kwargs) -> set[int]:
    _Probe.seen = []
    model = nn.Sequential(*[m for _ in range(stages) for m in (nn.Linear(8, 8), _Probe())])
    pipe = pipecore.Pipeline(model, stages, "1f1b", 2, loss_fn=nn.MSELoss(), concurrent=True,
                             leaf_modules=(_Probe,), **kwargs)
    try:
        pipe.step(torch.randn(4, 8), torch.randn(4, 8))
    finally:
        pipe.close()
    return set(_Probe.seen)


def test_default_is_the_process_share(monkeypatch):
    monkeypatch.setattr(stage_threads, "available_cores", lambda: 8)
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        assert stage_threads.default_threads_per_stage(2) == 4
        assert stage_threads.default_threads_per_stage(3) == 2
        assert stage_threads.default_threads_per_stage(16) == 1  # at least one
        torch.set_num_threads(2)
        assert stage_threads.default_threads_per_stage(2) == 2  # never more than the caller asked torch for
    finally:
        torch.set_num_threads(before)


def test_stage_threads_use_the_default_share(monkeypatch):
    monkeypatch.setattr(stage_threads, "available_cores", lambda: 4)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        assert _threads_seen(2) == {2}
        assert torch.get_num_threads() == 4  # the caller's own setting is untouched
    finally:
        torch.set_num_threads(before)


def test_threads_per_stage_overrides_the_default():
    before = torch.get_num_threads()
    try:
        assert _threads_seen(2, threads_per_stage=3) == {3}
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_pipeline_reports_its_setting(monkeypatch):
    monkeypatch.setattr(stage_threads, "available_cores", lambda: 2)
    pipe = pipecore.Pipeline(_model(), 4, "1f1b", 2, loss_fn=nn.MSELoss(), concurrent=True)
    try:
        assert pipe.threads_per_stage == 1
    finally:
        pipe.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_bad_threads_per_stage(bad):
    with pytest.raises(ValueError, match="threads_per_stage"):
        pipecore.Pipeline(_model(), 2, "1f1b", 2, loss_fn=nn.MSELoss(), threads_per_stage=bad)


def test_the_planner_profiles_with_the_stage_threads_setting(monkeypatch):
    """plan() times the nodes with threads_per_stage (default: the share for num_stages), and gives the calling
    thread its own count back."""
    import pipecore.planning.api as api

    seen = []
    real = api.profile

    def profile(*args, threads=None, **kwargs):
        seen.append(threads)
        return real(*args, threads=threads, **kwargs)

    monkeypatch.setattr(api, "profile", profile)
    monkeypatch.setattr(stage_threads, "available_cores", lambda: 8)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(8)
        x = torch.randn(4, 8)
        pipecore.plan(_model(), x, 2, "1f1b", objective="parameters")
        pipecore.plan(_model(), x, 2, "1f1b", objective="parameters", threads_per_stage=3)
        assert seen == [4, 3] and torch.get_num_threads() == 8
    finally:
        torch.set_num_threads(before)


def test_profile_runs_with_the_given_threads_and_restores_the_callers(monkeypatch):
    import pipecore.planning.profiler as profiler

    counts = []
    real = profiler._profile
    monkeypatch.setattr(profiler, "_profile", lambda *a: (counts.append(torch.get_num_threads()), real(*a))[1])
    before = torch.get_num_threads()
    pipecore.profile(_model(), torch.randn(4, 8), threads=1)
    assert counts == [1] and torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads_per_stage"):
        pipecore.profile(_model(), torch.randn(4, 8), threads=0)


def test_pipecore_plan_takes_threads(monkeypatch, capsys):
    from pipecore.cli import main
    import pipecore.planning as planning

    seen = {}
    real = planning.plan

    def plan(*args, **kwargs):
        seen["threads_per_stage"] = kwargs.get("threads_per_stage")
        return real(*args, **kwargs)

    monkeypatch.setattr(planning, "plan", plan)
    before = torch.get_num_threads()
    assert main(["plan", "--objective", "parameters", "--threads", "1"]) == 0
    assert seen == {"threads_per_stage": 1} and torch.get_num_threads() == before


def test_in_turn_runs_compute_with_the_stage_setting_and_restore_the_callers(monkeypatch):
    before = torch.get_num_threads()
    _Probe.seen = []
    model = nn.Sequential(nn.Linear(8, 8), _Probe(), nn.Linear(8, 8), _Probe())
    pipe = pipecore.Pipeline(model, 2, "1f1b", 2, loss_fn=nn.MSELoss(), concurrent=False, leaf_modules=(_Probe,),
                             threads_per_stage=1)
    pipe.step(torch.randn(4, 8), torch.randn(4, 8))
    assert set(_Probe.seen) == {1} and torch.get_num_threads() == before
