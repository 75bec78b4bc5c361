"""The checkpoint files of ``pipecore train --save``: what they hold (the pipeline's state, where training
stopped, the run's settings and its history so far), writing one, reading one for ``--resume`` (or finding it,
for ``--resume auto``) and checking it against the run's settings, and the command line that resumes a stopped
run.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from typing import Any

from .profile import option_text
from .report import plural
from .tasks import MODEL_FLAGS

#: Settings a checkpoint fixes: resuming with different values cannot load it.
_STRUCTURAL = ("model", "hidden", "depth", "width", "layers", "heads", "embd", "block_size", "optimizer")
#: Settings that merely change the trajectory (or what is measured): resuming with other values is noted. The
#: pipeline's shape is among them: a checkpoint maps by parameter name into any stages, micro-batches, algorithm.
_TRAJECTORY = ("algorithm", "stages", "microbatches", "batch_size", "lr", "lr_schedule", "clip", "bf16", "seed",
               "option", "steps_per_epoch", "eval_windows")


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings as plain values (stored in checkpoints); flags of other models are None."""
    return {
        "model": args.model, "algorithm": args.algorithm, "stages": args.stages, "microbatches": args.microbatches,
        "batch_size": args.batch_size, "epochs": args.epochs, "lr": args.lr, "lr_schedule": args.lr_schedule,
        "clip": args.clip, "bf16": args.bf16,
        "optimizer": args.optimizer,
        **{flag: getattr(args, flag) for flag in MODEL_FLAGS},
        "seed": args.seed, "option": [list(o) for o in args.option],
    }


def read_checkpoint(path: str) -> dict[str, Any]:
    """The ``--resume`` checkpoint at ``path``, on the CPU; a missing or unreadable file, or one that is not a
    ``pipecore train --save`` checkpoint, is a ValueError (one line)."""
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise ValueError(f"--resume: no such file {path}") from None
    except Exception as error:  # unpickling problems: not a checkpoint
        raise ValueError(f"--resume: cannot read {path} as a checkpoint: {error}") from None
    if not isinstance(ckpt, dict) or not {"pipeline", "epoch", "args"} <= set(ckpt):
        raise ValueError(f"--resume: {path} is not a `pipecore train --save` checkpoint")
    return ckpt


def find_checkpoint(args: argparse.Namespace) -> tuple[dict[str, Any] | None, str | None]:
    """The checkpoint ``--resume`` names, and with ``--resume auto`` the line that says there is none yet: then the
    ``--save`` file when it exists, else None, to start from the beginning."""
    if args.resume != AUTO:
        return (read_checkpoint(args.resume) if args.resume else None), None
    if not os.path.exists(args.save):
        return None, f"--resume auto: no checkpoint at {args.save} yet; training from the start"
    return read_checkpoint(args.save), None


#: ``--resume auto``: resume from the ``--save`` file when it holds a checkpoint, else start from the beginning.
AUTO = "auto"


def check_resume(settings: dict[str, Any], saved: dict[str, Any], epochs: int, epoch: int) -> list[str]:
    """Errors for settings a checkpoint fixes; notes for the ones that merely change the trajectory."""
    # Checkpoints from before --model trained the MLP; from before --lr-schedule, --clip and --bf16, at a
    # constant rate, without clipping, in float32.
    saved = {"model": "mlp", "lr_schedule": "constant", "clip": None, "bf16": False, **saved}
    keys = ("model",) if settings["model"] != saved["model"] else _STRUCTURAL
    mismatched = [k for k in keys if settings[k] != saved.get(k)]
    if mismatched:
        given = ", ".join(f"--{k.replace('_', '-')} {saved.get(k)}" for k in mismatched)
        raise ValueError(f"the checkpoint was trained with {given}; resume with the same settings")
    if epoch >= epochs:
        raise ValueError(f"the checkpoint has already trained {plural(epoch, 'epoch')}; --epochs is the total, "
                         f"pass more than {epoch}")
    return [
        f"note: --{k.replace('_', '-')} {settings[k]} differs from the checkpoint's {saved.get(k)}"
        for k in _TRAJECTORY if settings[k] != saved.get(k)
    ]


def write_checkpoint(path: str, ckpt: dict[str, Any]) -> None:
    """Write a ``pipecore train`` checkpoint atomically: a run killed while saving leaves the previous file whole,
    never a truncated one. A failed write is a ValueError (one line)."""
    import torch

    from ..checkpoint import write_atomically

    try:
        write_atomically(path, lambda f: torch.save(ckpt, f))
    except (OSError, RuntimeError) as error:  # torch.save reports a failed write as a RuntimeError
        raise ValueError(f"cannot write {path}: {getattr(error, 'strerror', None) or error}") from None
    # A run killed while saving left its temporary file (write_atomically's PATH.<8 hex>.tmp) behind.
    directory, name = os.path.split(os.path.abspath(path))
    staged = re.compile(re.escape(name) + r"\.[0-9a-f]{8}\.tmp")
    for leftover in (n for n in os.listdir(directory) if staged.fullmatch(n)):
        try:
            os.remove(os.path.join(directory, leftover))
        except OSError:
            pass  # another process removed it, or cannot: the next save tries again


def resume_command(given: dict[str, Any], args: argparse.Namespace, torchrun: bool) -> str:
    """The command line that continues a stopped run from its --save checkpoint: the flags it was given (those
    that differ from their defaults, as parsed), ``--resume`` the checkpoint and ``--save`` it again."""
    parser = given.get("_parser")
    words: list[str] = []
    for action in getattr(parser, "_actions", ()):
        dest = action.dest
        if not action.option_strings or dest in ("help", "resume", "save") or dest not in given:
            continue
        value = given[dest]
        if value is None or value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for key, option in value:
                words += [flag, f"{key}={option_text(option)}"]
        else:
            words += [flag, str(value)]
    if parser is None:  # run() called without the command line's parser: the settings that shape the run
        words = ["--model", args.model, "--algorithm", args.algorithm, "--stages", str(args.stages),
                 "--microbatches", str(args.microbatches), "--batch-size", str(args.batch_size), "--epochs",
                 str(args.epochs)]
    words += ["--save", args.save, "--resume", args.save]
    launcher = f"torchrun --nproc-per-node {args.stages} -m pipecore train" if torchrun else "pipecore train"
    return " ".join([launcher, *(shlex.quote(w) for w in words)])
