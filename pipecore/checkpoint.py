"""Checkpoints as one file per stage plus a small manifest.

A checkpoint written by P ranks (each rank saves its stage) can be read by the one-process pipeline and
the reverse: files are per stage, not per process. Call ``pipe.flush()`` first for asynchronous
algorithms (no micro-batch may be in flight).

The manifest is the commit point. Each save writes its stage files under new names and flushes them to
the disk, then replaces the manifest in one atomic rename, then deletes the files of earlier saves. A save
that fails or is killed part way therefore leaves the previous checkpoint in the directory whole and
loadable (or, for a first save, no manifest at all), never a mix of old and new stages. When the processes
agree that a save failed, each removes the files it wrote; what a killed save left is removed by the next
save that commits.

With one process per stage, ``save`` is collective: every rank calls it with the same directory, which
must be on a file system that every rank sees. It returns on every rank once the checkpoint is complete,
or raises the same error on every rank (a rank with backwards in flight, a failed write, a stage file that
rank 0 cannot see), so no rank is left waiting for another.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from typing import Any, BinaryIO, Callable, Iterator

import torch

from .engine.pipeline import Pipeline, merge_state_dicts

MANIFEST = "manifest.json"
FORMAT = 1
# Files a save writes: stage files (also the unsuffixed names of earlier versions) and the staged manifest.
_GARBAGE = re.compile(r"stage\d{3}(-[0-9a-f]+)?\.pt|manifest\.json\.[0-9a-f]+\.tmp")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (nothing was committed; the previous one, if any, is intact)."""


def _stage_file(stage: int, token: str) -> str:
    return f"stage{stage:03d}-{token}.pt"


def save(pipe: Pipeline, directory: str | os.PathLike) -> None:
    """Write the pipeline's stages to ``directory``: this process's stage files, then (from the process
    that owns stage 0) the manifest that commits them. Collective with one process per stage (see the
    module docstring). Raises :class:`CheckpointError` if nothing was committed."""
    directory = os.fspath(directory)
    agree = _agreement(pipe)
    state, error = None, None
    try:
        state = pipe.state_dict()
    except RuntimeError as exc:
        error = str(exc)
    # One token per save names its files; every rank uses the one of the rank that owns stage 0.
    token = agree("checking that no backward is in flight", error, secrets.token_hex(4))
    assert state is not None
    meta = state["pipecore"]
    error, written = None, []
    try:
        os.makedirs(directory, exist_ok=True)
        for s, st in pipe.stages.items():
            keys = st.state_keys
            written.append(os.path.join(directory, _stage_file(s, token)))
            _write_durably(written[-1], lambda f: torch.save(
                {"tensors": {k: state[k] for k in keys}, "pipecore": {**meta, "stages": {s: meta["stages"][s]}}}, f))
    except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as a RuntimeError
        error = f"{directory}: {exc}"
    with _discarding_on_failure(written):
        agree("writing the stage files", error)
    error = None
    if 0 in pipe.stages:
        try:
            _commit(directory, pipe, token, meta)
        except (OSError, CheckpointError) as exc:
            error = str(exc)
    with _discarding_on_failure(written):
        agree("writing the manifest", error)


@contextlib.contextmanager
def _discarding_on_failure(written: list[str]) -> Iterator[None]:
    """Remove this process's stage files if the ranks agree that the save failed. Not when a rank did not
    answer: then the others may have gone on, and rank 0 may have committed files that are ours."""
    try:
        yield
    except _NoAnswer:
        raise
    except CheckpointError:
        _remove_quietly(written)
        raise


def _commit(directory: str, pipe: Pipeline, token: str, meta: dict[str, Any]) -> None:
    """Check that every stage file of this save is there, replace the manifest, delete older stage files."""
    files = [_stage_file(s, token) for s in range(pipe.num_stages)]
    present = set(os.listdir(directory))
    missing = [f for f in files if f not in present]
    if missing:
        raise CheckpointError(
            f"{', '.join(missing)} (written by rank(s) {', '.join(str(files.index(f)) for f in missing)}) "
            f"not found in {directory} as this process sees it: with one process per stage on several machines, "
            "the checkpoint directory must be on a file system that every rank sees"
        )
    manifest = {
        "format": FORMAT,
        "algorithm": meta["algorithm"],
        "num_stages": meta["num_stages"],
        "n_microbatches": meta["n_microbatches"],
        "stage_layers": meta["stage_layers"],
        "files": files,
    }
    write_atomically(os.path.join(directory, MANIFEST), lambda f: f.write(json.dumps(manifest, indent=2).encode()))
    # Committed: the files of earlier saves (and of saves killed part way) are garbage now.
    _remove_quietly([os.path.join(directory, n) for n in present - set(files) if _GARBAGE.fullmatch(n)])


def write_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> None:
    """Write a file so that readers, and a crash at any point, see either the previous file or the complete
    new one: ``write(f)`` fills a temporary file next to ``path``, which is flushed to the disk and renamed
    over ``path``. If ``write`` or the rename fails, the temporary file is removed and ``path`` is untouched.

    Example: ``write_atomically("ckpt.pt", lambda f: torch.save(state, f))``.
    """
    path = os.fspath(path)
    staging = f"{path}.{secrets.token_hex(4)}.tmp"
    try:
        _write_durably(staging, write)
        os.replace(staging, path)
    except BaseException:
        _remove_quietly([staging])
        raise
    _sync_directory(os.path.dirname(path) or ".")


def _write_durably(path: str, write: Callable[[Any], Any]) -> None:
    """Write a file and flush it to the disk, so that a manifest never commits data still in a cache."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _sync_directory(directory: str) -> None:
    try:  # makes the rename durable on POSIX; not possible (nor needed) everywhere
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_quietly(paths: list[str]) -> None:
    for path in paths:
        try:
            os.remove(path)
        except OSError:
            pass  # garbage; the next save that commits removes it


def _agreement(pipe: Pipeline) -> Callable[..., Any]:
    """``agree(what, error, value=None)``: every process learns whether any process reported an ``error``
    (then all raise the first one) and gets the ``value`` of the process that owns stage 0."""
    from .runtime.distributed import PeerError

    def agree(what: str, error: str | None, value: Any = None) -> Any:
        try:
            reports = pipe._gather((error, value))
        except PeerError as exc:
            raise _NoAnswer(f"checkpoint not saved ({what}): {exc}; every rank must call checkpoint.save") from None
        except RuntimeError as exc:  # the process group is gone
            raise CheckpointError(f"checkpoint not saved ({what}): {exc}") from None
        failed = [(rank, e) for rank, (e, _) in enumerate(reports) if e is not None]
        if failed:
            rank, e = failed[0]
            raise CheckpointError(f"checkpoint not saved ({what}): {'' if pipe.rank is None else f'rank {rank}: '}{e}")
        return reports[0][1]
    return agree


class _NoAnswer(CheckpointError):
    """A rank did not take part in the save: the ranks may disagree on how far it got."""


def load(pipe: Pipeline, directory: str | os.PathLike) -> None:
    """Read this process's stages from a checkpoint written by :func:`save` (by any number of processes)."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        hint = "" if pipe.rank is None else (
            "; with one process per stage on several machines, the directory must be on a file system that every "
            "rank sees")
        raise FileNotFoundError(
            f"{directory} holds no pipecore checkpoint ({MANIFEST} is missing: nothing was saved there, or the "
            f"first save did not complete){hint}")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"checkpoint format {manifest.get('format')} is not supported (expected {FORMAT})")
    if manifest["num_stages"] != pipe.num_stages:
        raise ValueError(f"checkpoint in {directory} has {manifest['num_stages']} stages, this pipeline has "
                         f"{pipe.num_stages}")
    parts = []
    for s in pipe.stages:
        part = torch.load(os.path.join(directory, manifest["files"][s]), weights_only=False)
        parts.append({**part["tensors"], "pipecore": part["pipecore"]})
    pipe.load_state_dict(merge_state_dicts(parts))
