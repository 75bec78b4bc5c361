"""``pipecore train --profile``: recording the first training steps with ``torch.profiler``.

Every action of every stage is already a profiler range named as the simulator names it (see
:meth:`pipecore.engine.stage.TensorStage.action_range`); this module only decides which steps to record and
where the trace goes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

#: Training steps ``--profile`` records unless ``--profile-steps`` says otherwise.
DEFAULT_PROFILE_STEPS = 20


def check_profile_args(args: argparse.Namespace) -> None:
    """``--profile-steps`` needs ``--profile`` (and defaults to :data:`DEFAULT_PROFILE_STEPS`); the trace's
    directory must exist. (``--profile-steps`` below 1 is an argparse error.)"""
    if args.profile is None:
        if args.profile_steps is not None:
            raise ValueError("--profile-steps applies with --profile PATH (the trace file to write)")
        return
    if args.profile_steps is None:
        args.profile_steps = DEFAULT_PROFILE_STEPS
    path = Path(args.profile)
    if path.is_dir():
        raise ValueError(f"--profile: {args.profile} is a directory; give the trace file's path (e.g. trace.json)")
    if not path.resolve().parent.is_dir():
        raise ValueError(f"--profile: the directory of {args.profile} does not exist")


def rank_path(path: str, rank: int | str | None) -> str:
    """The trace file of ``rank`` (None: the only process): the rank goes before the suffix, so that every
    process of a torchrun run writes its own file: ``trace.json`` -> ``trace.rank1.json``."""
    if rank is None:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))


def option_text(value: Any) -> str:
    """An ``--option`` value as the command line writes it (the inverse of ``parse_option_value``)."""
    if isinstance(value, list):
        return ",".join(option_text(v) for v in value)
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    return str(value)


class Profile:
    """``--profile``: ``torch.profiler.profile`` from the first training step to the end of the
    ``limit``-th, or of the end-of-epoch flush that follows it (evaluations between recorded steps are
    recorded, the one after the last recorded flush is not); the Chrome trace is written by :meth:`export`.
    Without a path every method does nothing."""

    def __init__(self, path: str | None, limit: int | None) -> None:
        self.path, self.limit = path, limit or 0
        self.recorded = 0  # training steps recorded
        self._prof: Any = None
        self._running = False

    def start(self) -> None:
        if self.path is None:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=activities)
        self._prof.start()
        self._running = True

    def range(self, name: str) -> Any:
        """A range around the caller's work (a step, a flush, an evaluation) while recording."""
        from contextlib import nullcontext

        import torch

        return torch.profiler.record_function(name) if self._running else nullcontext()

    def step_done(self, ends_epoch: bool) -> None:
        """After a training step: the ``limit``-th stops the recording, unless the epoch's flush follows."""
        if not self._running:
            return
        self.recorded += 1
        if self.recorded >= self.limit and not ends_epoch:
            self._stop()

    def flushed(self, last: bool) -> None:
        """After an end-of-epoch flush: stop once ``limit`` steps are recorded, or after the run's last flush."""
        if self._running and (self.recorded >= self.limit or last):
            self._stop()

    def _stop(self) -> None:
        self._running = False
        self._prof.stop()

    def close(self) -> None:
        """Stop recording (also when training failed): a profiler left running would record the caller's work."""
        if self._running:
            self._stop()

    def export(self, path: str) -> None:
        self.close()
        try:
            self._prof.export_chrome_trace(path)
        except (OSError, RuntimeError) as error:
            raise ValueError(f"cannot write {path}: {getattr(error, 'strerror', None) or error}") from None
