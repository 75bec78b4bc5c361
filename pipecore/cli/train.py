"""``pipecore train``: train a small MLP on scikit-learn's digits with a pipeline, end to end.

The data set ships with scikit-learn (no download): 1,797 8x8 images, 64 features, 10 classes. Features are
standardised with the training split's statistics; the 80/20 split is stratified and fixed by ``--seed``.
Each epoch shuffles with a generator seeded by ``(seed, epoch)``, so a run resumed from a checkpoint sees
exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ._args import algorithm_option, positive_int

if TYPE_CHECKING:  # heavy imports stay inside run() so that ``pipecore --help`` is fast
    import torch
    from torch import nn

HELP = "train an MLP on scikit-learn's digits with a pipeline (progress, accuracy, staleness, checkpoints)"

DESCRIPTION = """\
Train a small MLP (64-H-...-H-10, ReLU) on scikit-learn's bundled digits data set (8x8 images, 10 classes,
80/20 stratified split) as a pipeline of --stages stages, with any pipecore algorithm. Prints a progress
bar per epoch, the loss and test accuracy after every epoch, and a summary: test accuracy, weight-version
bytes, staleness and delay per stage, and time.

Asynchronous algorithms are flushed at the end of every epoch, so evaluation and checkpoints see one
consistent weight version per stage. --resume continues from a --save checkpoint; --epochs is the total,
and the result equals an uninterrupted run.

examples:
  pipecore train
  pipecore train --algorithm pipedream --epochs 10 --plot curve.png
  pipecore train -a pipemare --option warmup_steps=200 --option D=0.2
  pipecore train --epochs 5 --save ckpt.pt && pipecore train --epochs 10 --resume ckpt.pt
  torchrun --nproc-per-node 4 -m pipecore train    # one process per stage; rank 0 reports
"""

#: Default learning rate per optimizer.
DEFAULT_LR = {"sgd": 0.05, "adamw": 1e-3}
#: Settings a checkpoint fixes: resuming with different values cannot load it.
_STRUCTURAL = ("algorithm", "stages", "microbatches", "hidden", "depth", "optimizer")
#: PipeMare's default learning-rate warm-up, in epochs of updates (the spec's proposal).
PIPEMARE_WARMUP_EPOCHS = 5


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``train`` arguments."""
    parser.add_argument("-a", "--algorithm", default="1f1b", metavar="NAME",
                        help="algorithm name or alias (default 1f1b; see `pipecore simulate --compare`)")
    parser.add_argument("-p", "--stages", type=positive_int, default=4, metavar="P",
                        help="pipeline stages (default 4)")
    parser.add_argument("-m", "--microbatches", type=positive_int, default=4, metavar="M",
                        help="micro-batches per mini-batch (default 4)")
    parser.add_argument("-b", "--batch-size", type=positive_int, default=64, metavar="N",
                        help="mini-batch size, divisible by --microbatches (default 64; the last partial "
                             "batch of an epoch is dropped)")
    parser.add_argument("-e", "--epochs", type=positive_int, default=20, metavar="E",
                        help="total epochs, counting those of a resumed checkpoint (default 20)")
    parser.add_argument("--lr", type=_positive_float, metavar="LR",
                        help=f"learning rate (default {DEFAULT_LR['sgd']} for sgd, {DEFAULT_LR['adamw']} for adamw, "
                             "per update of a whole mini-batch; algorithms that update every k of the M "
                             "micro-batches default to that times k/M)")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                        help="sgd (momentum 0.9) or adamw (default sgd)")
    parser.add_argument("--hidden", type=positive_int, default=128, metavar="H",
                        help="width of the hidden layers (default 128)")
    parser.add_argument("--depth", type=positive_int, metavar="L",
                        help="hidden layers (default max(3, stages - 1), so every stage gets a Linear layer)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the split, the weights and the shuffling (default 0)")
    parser.add_argument("-o", "--option", type=algorithm_option, action="append", default=[], metavar="KEY=VALUE",
                        help="algorithm option, repeatable (e.g. warmup_steps=200, update_every=2)")
    parser.add_argument("--threads", type=positive_int, default=1, metavar="T",
                        help="torch threads (default 1: the MLP's matrices are too small to gain from more, "
                             "and spare threads slow it down when the cores are busy)")
    parser.add_argument("--plot", metavar="PNG", help="plot loss and test accuracy per epoch to a PNG file")
    parser.add_argument("--save", metavar="PATH", help="save a checkpoint at the end (pipeline state, epoch, args)")
    parser.add_argument("--resume", metavar="PATH", help="continue from a --save checkpoint")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (it is also off when stderr is not a terminal)")


# -- data and model ---------------------------------------------------------------------------------


@dataclass
class Digits:
    """The standardised digits split as tensors."""

    x_train: "torch.Tensor"
    y_train: "torch.Tensor"
    x_test: "torch.Tensor"
    y_test: "torch.Tensor"

    @property
    def features(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def load_data(seed: int, test_fraction: float = 0.2) -> Digits:
    """scikit-learn's digits, split (stratified, fixed by ``seed``) and standardised by the training split."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    mean, std = x_tr.mean(axis=0), x_tr.std(axis=0)
    std[std == 0] = 1.0  # constant pixels (always-blank corners)
    as_x = lambda a: torch.from_numpy(((a - mean) / std).astype(np.float32))  # noqa: E731
    as_y = lambda a: torch.from_numpy(a.astype(np.int64))  # noqa: E731
    return Digits(as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te))


def build_mlp(features: int, hidden: int, depth: int, classes: int) -> "nn.Sequential":
    """``features -> hidden (x depth, ReLU) -> classes`` as a flat ``nn.Sequential`` (layers are pipeline units)."""
    from torch import nn

    layers: list[nn.Module] = []
    width = features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def stage_partition(model: "nn.Sequential", num_stages: int) -> list[int]:
    """Split points that cut only before a Linear layer, balanced by parameter count.

    A block is a Linear layer with its ReLU; cutting between blocks gives every stage parameters (a plain
    parameter balance could give a stage only a ReLU).
    """
    from torch import nn

    from ..engine.partition import balanced_by_parameters

    starts = [i for i, layer in enumerate(model) if isinstance(layer, nn.Linear)]
    if num_stages > len(starts):
        raise ValueError(
            f"--stages {num_stages} needs at least {num_stages} Linear layers, the MLP has {len(starts)}; "
            f"raise --depth to {num_stages - 1} or more"
        )
    ends = starts[1:] + [len(model)]
    sizes = [sum(p.numel() for p in model[a:b].parameters()) for a, b in zip(starts, ends)]
    return [starts[i] for i in balanced_by_parameters(sizes, num_stages)]


def mlp_shape(features: int, hidden: int, depth: int, classes: int) -> str:
    return "-".join(str(n) for n in [features] + [hidden] * depth + [classes])


def evaluate(model: "nn.Module", x: "torch.Tensor", y: "torch.Tensor") -> tuple[float, int]:
    """Accuracy and number correct of ``model`` (the live weights) on ``(x, y)``."""
    import torch

    was_training = model.training
    model.eval()
    with torch.no_grad():
        correct = int((model(x).argmax(dim=1) == y).sum())
    model.train(was_training)
    return correct / len(y), correct


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int) -> list["torch.Tensor"]:
    """The shuffled index batches of ``epoch`` (full batches only), a function of ``(seed, epoch)`` alone."""
    import torch

    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n, generator=generator)
    return [order[i: i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]


# -- setup --------------------------------------------------------------------------------------------


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings as plain values (stored in checkpoints)."""
    return {
        "algorithm": args.algorithm, "stages": args.stages, "microbatches": args.microbatches,
        "batch_size": args.batch_size, "epochs": args.epochs, "lr": args.lr, "optimizer": args.optimizer,
        "hidden": args.hidden, "depth": args.depth, "seed": args.seed, "option": [list(o) for o in args.option],
    }


def _load_checkpoint(path: str) -> dict[str, Any]:
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


def _check_resume(settings: dict[str, Any], saved: dict[str, Any], epochs: int, epoch: int) -> list[str]:
    """Errors for settings a checkpoint fixes; notes for the ones that merely change the trajectory."""
    mismatched = [k for k in _STRUCTURAL if settings[k] != saved.get(k)]
    if mismatched:
        given = ", ".join(f"--{k.replace('_', '-')} {saved.get(k)}" for k in mismatched)
        raise ValueError(f"the checkpoint was trained with {given}; resume with the same settings")
    if epoch >= epochs:
        raise ValueError(f"the checkpoint has already trained {_plural(epoch, 'epoch')}; --epochs is the total, "
                         f"pass more than {epoch}")
    return [
        f"note: --{k.replace('_', '-')} {settings[k]} differs from the checkpoint's {saved.get(k)}"
        for k in ("batch_size", "lr", "seed", "option") if settings[k] != saved.get(k)
    ]


def _optimizer(name: str, lr: float) -> Any:
    import pipecore

    return pipecore.SGD(lr=lr, momentum=0.9) if name == "sgd" else pipecore.AdamW(lr=lr)


# -- output ---------------------------------------------------------------------------------------------


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    """Columns separated by two spaces; columns in ``right`` are right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(header)] + [line(r) for r in rows])


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def stage_table(stats: list[dict[str, Any]]) -> str:
    """Per-stage summary: layers, parameters, weight versions and their bytes, staleness, delay, time."""
    rows = []
    for st in stats:
        per = st["seconds_per_action"]
        times = "/".join(f"{per[k] * 1e3:.2f}" if k in per else "-" for k in ("F", "B", "U"))
        rows.append((
            str(st["stage"]), ",".join(st["layers"]), f"{st['parameters']:,}", str(st["weight_versions"]),
            f"{st['weight_version_bytes']:,}", f"{st['staleness_mean']:.2f}/{st['staleness_max']}",
            f"{st['delay_mean']:.2f}/{st['delay_max']}", times,
        ))
    header = ("stage", "layers", "params", "versions", "weight bytes", "staleness", "delay", "ms F/B/U")
    return format_table(header, rows, right=(2, 3, 4, 5, 6, 7))


def plot_curves(path: str, history: list[dict[str, float]], title: str) -> None:
    """Loss and test accuracy per epoch, side by side, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [h["loss"] for h in history], marker="o")
    ax_loss.set(xlabel="epoch", ylabel="training loss", yscale="log", title="loss")
    ax_acc.plot(epochs, [100 * h["accuracy"] for h in history], marker="o", color="tab:green")
    ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as error:
        raise ValueError(f"cannot write {path}: {error.strerror or error}") from None
    finally:
        plt.close(fig)


# -- the command ------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Execute ``pipecore train`` (with ``--threads`` torch threads, restored afterwards)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _train(args)
    finally:
        torch.set_num_threads(threads)


def _train(args: argparse.Namespace) -> int:
    import torch

    import pipecore

    if args.batch_size % args.microbatches:
        raise ValueError(
            f"--batch-size {args.batch_size} is not divisible by --microbatches {args.microbatches}; "
            f"use a multiple of {args.microbatches}"
        )
    processes = int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1
    if processes > 1 and processes != args.stages:
        raise ValueError(f"--stages {args.stages} but torchrun started {processes} processes: pipecore runs one process "
                         f"per stage; pass --stages {processes} or --nproc-per-node {args.stages}")
    args.depth = args.depth if args.depth is not None else max(3, args.stages - 1)
    options = dict(args.option)

    data = load_data(args.seed)
    n_train = len(data.y_train)
    if args.batch_size > n_train:
        raise ValueError(f"--batch-size {args.batch_size} is larger than the training set ({n_train} samples)")
    steps_per_epoch = n_train // args.batch_size

    # Validates the name, sizes and options (ValueError -> one-line error) before any training.
    algorithm = pipecore.get_algorithm(args.algorithm, args.stages, args.microbatches, **options)
    notes = []
    if args.lr is None:
        # Linear scaling: an update over k of the M micro-batches takes k/M of the mini-batch step.
        args.lr = DEFAULT_LR[args.optimizer] * algorithm.update_every / args.microbatches
    if algorithm.name == "pipemare" and "warmup_steps" not in options:
        updates_per_step = args.microbatches // algorithm.update_every
        options["warmup_steps"] = PIPEMARE_WARMUP_EPOCHS * steps_per_epoch * updates_per_step
        notes.append(f"pipemare warmup_steps={options['warmup_steps']} ({PIPEMARE_WARMUP_EPOCHS} epochs of updates)")

    settings = _settings(args)
    ckpt = _load_checkpoint(args.resume) if args.resume else None
    start_epoch, history = 0, []
    if ckpt is not None:
        start_epoch = int(ckpt["epoch"])
        notes += _check_resume(settings, ckpt["args"], args.epochs, start_epoch)
        history = list(ckpt.get("history", []))

    torch.manual_seed(args.seed)
    model = build_mlp(data.features, args.hidden, args.depth, data.classes)
    joined_here = not _process_group_initialized()
    pipe = pipecore.Pipeline(
        model, args.stages, algorithm=args.algorithm, n_microbatches=args.microbatches,
        optimizer=_optimizer(args.optimizer, args.lr), loss_fn=torch.nn.CrossEntropyLoss(),
        partition=stage_partition(model, args.stages), **options,
    )
    try:
        with pipe:  # closes it at the end: with one process per stage, that releases its process groups
            return _run_pipeline(args, pipe, data, algorithm, settings, ckpt, start_epoch, history, notes)
    finally:
        if joined_here and _process_group_initialized():
            torch.distributed.destroy_process_group()  # under torchrun the pipeline joined it; leave it too


def _quiet(*args: Any, **kwargs: Any) -> None:
    """``print`` on the ranks that do not report."""


def _process_group_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _run_pipeline(args: argparse.Namespace, pipe: Any, data: Digits, algorithm: Any, settings: dict[str, Any],
                  ckpt: dict[str, Any] | None, start_epoch: int, history: list[dict[str, float]],
                  notes: list[str]) -> int:
    import torch
    from tqdm import tqdm

    import pipecore
    from ..checkpoint import write_atomically

    # With one process per stage (under torchrun) every rank trains its stage; rank 0 alone prints and writes.
    leader = pipe.rank in (None, 0)
    say = print if leader else _quiet
    for flag, path in (("--save", args.save), ("--plot", args.plot)):
        # Fail before training, not after it.
        if leader and path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{flag}: the directory of {path} does not exist")
    if ckpt is not None:
        pipe.load_state_dict(ckpt["pipeline"])
    n_train = len(data.y_train)
    steps_per_epoch = n_train // args.batch_size
    # The whole model, for evaluation: with one process per stage, this rank's copy of the other stages is
    # stale, so every evaluation loads the stages' live weights (full_state_dict) into it.
    scorer = build_mlp(data.features, args.hidden, args.depth, data.classes)

    def test_accuracy() -> tuple[float, int]:
        full = pipe.full_state_dict()
        scorer.load_state_dict({k: v for k, v in full.items() if k != "pipecore"})
        return evaluate(scorer, data.x_test, data.y_test)

    shape = mlp_shape(data.features, args.hidden, args.depth, data.classes)
    optimizer = f"SGD lr {args.lr:g} momentum 0.9" if args.optimizer == "sgd" else f"AdamW lr {args.lr:g}"
    say(f"digits: {n_train} train / {len(data.y_test)} test samples, {data.features} features, "
        f"{data.classes} classes; MLP {shape}")
    say(f"{algorithm.name}: {args.stages} stages, {args.microbatches} micro-batches of "
        f"{args.batch_size // args.microbatches} (batch {args.batch_size}, {steps_per_epoch} steps/epoch), "
        f"{optimizer}, seed {args.seed}, {_plural(torch.get_num_threads(), 'thread')}")
    for note in notes:
        say(note)
    if ckpt is not None:
        say(f"resumed from {args.resume} at epoch {start_epoch}")
    if pipe.rank is not None:
        say(f"one process per stage: {args.stages} ranks ({torch.distributed.get_backend()}); rank 0 reports")
    say()
    header = f"{'epoch':>5}  {'loss':>8}  {'test acc':>8}  {'time':>6}"
    say(header)
    for h in history:
        say(f"{h['epoch']:>5}  {h['loss']:>8.4f}  {100 * h['accuracy']:>7.2f}%  {'-':>6}")

    hide_bar = True if args.no_progress or not leader else None  # None: tqdm shows the bar only on a terminal
    started = time.perf_counter()
    trained = 0
    for epoch in range(start_epoch, args.epochs):
        t0 = time.perf_counter()
        batches = epoch_batches(n_train, args.batch_size, args.seed, epoch)
        losses = []
        bar = tqdm(batches, desc=f"epoch {epoch + 1}/{args.epochs}", unit="batch", leave=False,
                   disable=hide_bar, file=sys.stderr, dynamic_ncols=True)
        for idx in bar:
            try:
                loss = pipe.step(data.x_train[idx], data.y_train[idx])
            except pipecore.NonFiniteLoss as error:
                raise ValueError(f"epoch {epoch + 1}: {error}; try a lower --lr") from None
            losses.append(loss)
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        bar.close()
        pipe.flush()  # drain asynchronous algorithms: evaluate and checkpoint one consistent version
        trained += len(batches) * args.batch_size
        accuracy, _ = test_accuracy()
        record = {"epoch": epoch + 1, "loss": sum(losses) / len(losses), "accuracy": accuracy}
        history.append(record)
        say(f"{epoch + 1:>5}  {record['loss']:>8.4f}  {100 * accuracy:>7.2f}%  {time.perf_counter() - t0:>5.2f}s",
            flush=True)
    elapsed = time.perf_counter() - started

    accuracy, correct = test_accuracy()
    # Collective with one process per stage: every rank takes part, rank 0 prints and writes.
    stats = pipe.stats(all_stages=True)
    state = pipe.full_state_dict() if args.save else None
    say()
    say(f"test accuracy {100 * accuracy:.2f}% ({correct}/{len(data.y_test)}) after {_plural(args.epochs, 'epoch')}")
    say(f"time {elapsed:.2f}s for {_plural(args.epochs - start_epoch, 'epoch')} "
        f"({trained / elapsed:,.0f} samples/s)")
    say()
    say("per stage (staleness: versions behind live per weight read; delay: updates between a micro-batch's "
        "F and B; mean/max)")
    say(stage_table(stats))
    if not leader:
        return 0
    if args.save or args.plot:
        print()
    if args.save:
        ckpt_state = {"pipeline": state, "epoch": args.epochs, "args": settings, "history": history}
        try:
            # A run killed while saving leaves the previous checkpoint, not a truncated file.
            write_atomically(args.save, lambda f: torch.save(ckpt_state, f))
        except (OSError, RuntimeError) as error:  # torch.save reports a failed write as a RuntimeError
            raise ValueError(f"cannot write {args.save}: {getattr(error, 'strerror', None) or error}") from None
        print(f"saved checkpoint (epoch {args.epochs}) to {args.save}")
    if args.plot:
        plot_curves(args.plot, history, f"pipecore train: {algorithm.name}, {args.stages} stages, MLP {shape}")
        print(f"wrote loss and accuracy curves to {args.plot}")
    return 0
