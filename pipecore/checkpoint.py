"""Checkpoints as one file per stage plus a small manifest.

A checkpoint written by P ranks (each rank saves its stage) can be read by the one-process pipeline and
the reverse: files are per stage, not per process. Call ``pipe.flush()`` first for asynchronous
algorithms (no micro-batch may be in flight). It also loads into a pipeline with another number of stages,
another partition, another number of micro-batches or another algorithm (weights and optimizer state by
parameter name, see :meth:`Pipeline.load_state_dict`), and :func:`load_model_weights` fills the plain model.

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

A training loop that must survive a dead worker (``torchrun --max-restarts``) passes its progress as ``extra``
(``save(pipe, directory, extra={"step": 120})``: committed with the stages, in the manifest) and starts with
:func:`resume`, which loads the checkpoint if one was committed and returns that ``extra``, or None to start from
the beginning.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Mapping

import torch

from .engine.pipeline import Pipeline
from .engine.state_io import merge_state_dicts

MANIFEST = "manifest.json"
FORMAT = 1
# Files a save writes: stage files (also the unsuffixed names of earlier versions) and the staged manifest.
_GARBAGE = re.compile(r"stage\d{3}(-[0-9a-f]+)?\.pt|manifest\.json\.[0-9a-f]+\.tmp")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (nothing was committed; the previous one, if any, is intact)."""


def _stage_file(stage: int, token: str) -> str:
    return f"stage{stage:03d}-{token}.pt"


def save(pipe: Pipeline, directory: str | os.PathLike, extra: Mapping[str, Any] | None = None) -> None:
    """Write the pipeline's stages to ``directory``: this process's stage files, then (from the process
    that owns stage 0) the manifest that commits them. Collective with one process per stage (see the
    module docstring). Raises :class:`CheckpointError` if nothing was committed.

    ``extra``: what the caller needs to resume (where its loop is, e.g. ``{"epoch": 3, "step": 120}``), plain
    JSON values, stored in the manifest so that it commits with the stages; :func:`load` and :func:`resume`
    return it. Rank 0's is the one kept.

    With several replicas of the pipeline (``data_parallel``), which hold the same weights, replica 0 writes;
    every process returns once the save is committed, or raises if it was not."""
    extra = dict(extra or {})
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as error:
        raise TypeError(f"checkpoint.save(): extra must hold plain JSON values (numbers, strings, lists, dicts): "
                        f"{error}") from None
    if pipe.data_parallel > 1:
        _save_replicated(pipe, directory, extra)
        return
    _save(pipe, directory, extra)


def _save_replicated(pipe: Pipeline, directory: str | os.PathLike, extra: dict[str, Any]) -> None:
    from .engine.data_parallel import sum_over

    error: CheckpointError | None = None
    if pipe.replica == 0:
        try:
            _save(pipe, directory, extra)
        except CheckpointError as exc:
            error = exc
    # Every replica of this pipeline rank learns whether replica 0 committed (a sum over its "dp" group).
    failed = sum_over(pipe._parts.dp_group, [1.0 if error is not None else 0.0], pipe.devices[min(pipe.stages)])[0]
    if error is not None:
        raise error
    if failed:
        raise CheckpointError("checkpoint not saved: replica 0, which writes it, failed (its error says why)")


def _save(pipe: Pipeline, directory: str | os.PathLike, extra: dict[str, Any]) -> None:
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
            _commit(directory, pipe, token, meta, extra)
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


def _commit(directory: str, pipe: Pipeline, token: str, meta: dict[str, Any], extra: dict[str, Any]) -> None:
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
        "extra": extra,
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
    from .runtime.link import PeerError

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


def load(pipe: Pipeline, directory: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save` (by any number of processes) into ``pipe``: this process's
    stages when ``pipe`` has the checkpoint's stages and partition, else every stage file, mapped by parameter
    name into ``pipe``'s stages (another number of stages, partition, micro-batches or algorithm; see
    :meth:`Pipeline.load_state_dict`). Returns the ``extra`` the save was given (``{}`` without one)."""
    manifest = _read_manifest(directory, pipe.rank is not None)
    # Before a first step that captures the model, its stages are not known: every stage file is read, and the
    # state is held until the capture (see Pipeline.load_state_dict).
    same = (pipe._built() and manifest["num_stages"] == pipe.num_stages
            and manifest["stage_layers"] == pipe.stage_layers and manifest["algorithm"] == pipe.algorithm.name)
    stages = list(pipe.stages) if same else range(manifest["num_stages"])
    pipe.load_state_dict(merge_state_dicts(_read_stages(directory, manifest, stages)))
    return dict(manifest.get("extra", {}))


def resume(pipe: Pipeline, directory: str | os.PathLike) -> dict[str, Any] | None:
    """Load the checkpoint committed in ``directory`` into ``pipe`` if there is one, and return its ``extra``
    (see :func:`save`); None if nothing was committed there yet (also no directory): start from the beginning.
    A save that was killed part way left the previous checkpoint, which is the one loaded.

    With one process per stage it is collective: every rank calls it, and a rank that finds a checkpoint where
    another finds none (a directory that is not on a file system every rank sees) is a
    :class:`CheckpointError` on every rank, rather than ranks that train from different points.

    Example, a loop that survives ``torchrun --max-restarts``::

        done = checkpoint.resume(pipe, "ckpt")
        for step in range(0 if done is None else done["step"], steps):
            pipe.step(*batch(step))
            if (step + 1) % 50 == 0:
                pipe.flush()
                checkpoint.save(pipe, "ckpt", extra={"step": step + 1})
    """
    manifest = os.path.join(os.fspath(directory), MANIFEST)
    found = os.path.exists(manifest)
    if pipe.rank is not None:
        seen = pipe._gather(found)
        if len(set(seen)) > 1:
            ranks = [r for r, s in enumerate(seen) if s]
            raise CheckpointError(f"rank(s) {ranks} find a checkpoint in {os.fspath(directory)} and the others do "
                                  "not: the directory must be on a file system that every rank sees")
    return load(pipe, directory) if found else None


def load_state(path: str | os.PathLike) -> dict[str, Any]:
    """The whole pipeline state a checkpoint holds, tensors on the CPU, as :meth:`Pipeline.full_state_dict`
    gives it: from a :func:`save` directory, a ``pipecore train --save`` file, or a file holding a
    :meth:`Pipeline.state_dict` (``torch.save(pipe.state_dict(), path)``)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        manifest = _read_manifest(path, False)
        return merge_state_dicts(_read_stages(path, manifest, range(manifest["num_stages"])))
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise FileNotFoundError(f"no such checkpoint: {path}") from None
    except Exception as error:  # unpickling problems: not a checkpoint
        raise ValueError(f"cannot read {path} as a checkpoint: {error}") from None
    if isinstance(state, dict) and "pipeline" in state and "pipecore" not in state:
        state = state["pipeline"]  # a `pipecore train --save` file: the pipeline's state and the run's
    if not isinstance(state, dict) or "pipecore" not in state:
        raise ValueError(f"{path} is not a pipecore checkpoint (a checkpoint.save directory, a `pipecore train "
                         "--save` file or a saved Pipeline.state_dict())")
    return state


def model_state_dict(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The plain model's ``state_dict`` in a pipeline state (:meth:`Pipeline.full_state_dict`, :func:`load_state`):
    the live weights and buffers by the model's names."""
    return {k: v for k, v in state.items() if k != "pipecore"}


def load_model_weights(path: str | os.PathLike, model: torch.nn.Module, strict: bool = True) -> torch.nn.Module:
    """Fill a plain ``model`` (the model the pipeline was built from, not split) with a checkpoint's live
    weights and buffers, by name; ``path`` is what :func:`load_state` reads. With ``strict`` (the default), a
    name of the model that the checkpoint lacks, or the reverse, is an error that lists them; without it, only
    the names both have are loaded. Returns ``model``.

    Example: ``load_model_weights("ckpt.pt", GPT(vocab, 64))`` then evaluate the model without a pipeline."""
    weights = model_state_dict(load_state(path))
    wanted = model.state_dict()
    missing = [k for k in wanted if k not in weights]
    unexpected = [k for k in weights if k not in wanted]
    if strict and (missing or unexpected):
        raise ValueError(f"{os.fspath(path)} does not fit {type(model).__name__}: missing from the checkpoint "
                         f"{missing}, not in the model {unexpected} (pass strict=False to load the names both have)")
    shapes = [f"{k} {tuple(weights[k].shape)} vs {tuple(v.shape)}" for k, v in wanted.items()
              if k in weights and weights[k].shape != v.shape]
    if shapes:
        raise ValueError(f"{os.fspath(path)} does not fit {type(model).__name__}: shapes differ (checkpoint vs "
                         f"model) for {', '.join(shapes)}")
    model.load_state_dict({k: v for k, v in weights.items() if k in wanted}, strict=False)
    return model


def _read_manifest(directory: str | os.PathLike, several_processes: bool) -> dict[str, Any]:
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        hint = "" if not several_processes else (
            "; with one process per stage on several machines, the directory must be on a file system that every "
            "rank sees")
        raise FileNotFoundError(
            f"{directory} holds no pipecore checkpoint ({MANIFEST} is missing: nothing was saved there, or the "
            f"first save did not complete){hint}")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"checkpoint format {manifest.get('format')} is not supported (expected {FORMAT})")
    return manifest


def _read_stages(directory: str | os.PathLike, manifest: dict[str, Any], stages: Iterable[int]) -> list[dict[str, Any]]:
    parts = []
    for s in stages:
        part = torch.load(os.path.join(directory, manifest["files"][s]), map_location="cpu", weights_only=False)
        parts.append({**part["tensors"], "pipecore": part["pipecore"]})
    return parts
