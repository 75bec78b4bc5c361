"""``pipecore train``: train a model with a pipeline, end to end: an MLP or a small ResNet on scikit-learn's
digits, or a character-level GPT on the help texts that ship with Python.

* ``--model mlp`` (default) and ``--model resnet``: the digits data set ships with scikit-learn (no download):
  1,797 8x8 images, 64 features, 10 classes. Features are standardised with the training split's statistics;
  the 80/20 split is stratified and fixed by ``--seed``. Each epoch shuffles with a generator seeded by
  ``(seed, epoch)``. Reported: test accuracy.
* ``--model gpt``: :class:`pipecore.models.GPT` on :func:`pipecore.models.load_char_data` (Python's
  ``pydoc_data`` help topics, the last 10% held out). An epoch is ``--steps-per-epoch`` batches of random
  windows drawn with a generator seeded by ``(seed, epoch)``. Reported: held-out loss and perplexity (the
  exponential of the mean loss per character over at most ``--eval-windows`` non-overlapping windows of the
  held-out text, spread evenly over it).

Either way, the batches of an epoch are a function of ``(seed, epoch)`` alone, so a run resumed from a
checkpoint sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from ._args import algorithm_option, positive_int
from .profile import DEFAULT_PROFILE_STEPS, Profile, check_profile_args, option_text, rank_path

if TYPE_CHECKING:  # heavy imports stay inside run() so that ``pipecore --help`` is fast
    import torch
    from torch import nn

    import pipecore

HELP = ("train an MLP or ResNet on scikit-learn's digits, or a character-level GPT, with a pipeline "
        "(progress, accuracy or perplexity, staleness, checkpoints)")

DESCRIPTION = """\
Train a model as a pipeline of --stages stages, with any pipecore algorithm:

  --model mlp     (the default) a small MLP (64-H-...-H-10, ReLU) on scikit-learn's bundled digits data set
                  (8x8 images, 10 classes, 80/20 stratified split); reports test accuracy
  --model resnet  a small residual CNN (BatchNorm, one downsampling block) on the same digits split;
                  reports test accuracy
  --model gpt     a character-level GPT (head tied to the token embedding) on the help topics that ship
                  with Python (pydoc_data; the last 10% held out); an epoch is --steps-per-epoch batches of
                  random windows; reports held-out loss and perplexity, measured on at most --eval-windows
                  non-overlapping windows spread evenly over the held-out text

Prints a progress bar per epoch, the loss and the test metric after every epoch, and a summary: test
accuracy (or held-out perplexity), weight-version bytes, staleness and delay per stage, and time.

defaults per model (flags for another model are an error):
  mlp     SGD lr 0.05 (momentum 0.9), batch 64, 20 epochs; --hidden 128, --depth 3 (4 Linear layers: at most
          4 stages; raise --depth for more)
  resnet  SGD lr 0.05 (momentum 0.9), batch 64, 10 epochs; --width 16, --layers 3 residual blocks
  gpt     AdamW lr 0.001, batch 32, 10 epochs of --steps-per-epoch 50; --block-size 64, --layers 4,
          --heads 4, --embd 64, --eval-windows 64

Asynchronous algorithms are flushed at the end of every epoch, so evaluation and checkpoints see one
consistent weight version per stage. --resume continues from a --save checkpoint; --epochs is the total,
and the result equals an uninterrupted run. A checkpoint also resumes with another --stages, --microbatches
or --algorithm: weights and optimizer state are mapped by parameter name. --save-every N also saves after
every N epochs.

Ctrl-C (SIGINT) or SIGTERM stops training after the current step: with --save the checkpoint is saved there
(mid-epoch; --resume continues from that step), and one line says where it is and the command that resumes;
the exit code is 130 (SIGINT) or 143 (SIGTERM). A second Ctrl-C undoes the step in progress instead of
waiting for it.

Under torchrun, --stages defaults to the number of processes.

--profile PATH records the first --profile-steps (default 20) training steps with torch.profiler and writes a
Chrome trace (open it in chrome://tracing or https://ui.perfetto.dev): every action of every stage is a range
named as `pipecore simulate` names it (2F5@v3, 1B4-7@v2, 0U3), with the aten ops it ran inside it, so
`pipecore simulate ... --chrome` gives the simulator's view of the same actions.

examples:
  pipecore train
  pipecore train --algorithm pipedream --epochs 10 --plot curve.png
  pipecore train -a pipemare --option warmup_steps=200 --option D=0.2
  pipecore train --epochs 5 --save ckpt.pt && pipecore train --epochs 10 --resume ckpt.pt
  pipecore train --epochs 20 --save ckpt.pt --save-every 5
  pipecore train --epochs 10 --resume ckpt.pt --stages 2 --save ckpt2.pt
  pipecore train --model resnet --stages 2 --epochs 5
  pipecore train --model gpt --epochs 3
  pipecore train --model gpt --layers 6 --embd 96 --heads 6 --block-size 128 --steps-per-epoch 100
  pipecore train -a pipedream --epochs 1 --profile trace.json --profile-steps 10
  torchrun --nproc-per-node 4 -m pipecore train    # one process per stage (--stages 4); rank 0 reports
  torchrun --nproc-per-node 4 -m pipecore train --model gpt
"""

#: The models ``--model`` chooses from.
MODELS = ("mlp", "gpt", "resnet")
#: Default learning rate per optimizer.
DEFAULT_LR = {"sgd": 0.05, "adamw": 1e-3}
#: Default optimizer, mini-batch size and epochs per model.
DEFAULT_OPTIMIZER = {"mlp": "sgd", "resnet": "sgd", "gpt": "adamw"}
DEFAULT_BATCH_SIZE = {"mlp": 64, "resnet": 64, "gpt": 32}
DEFAULT_EPOCHS = {"mlp": 20, "resnet": 10, "gpt": 10}
#: Stages when --stages is not given (and not under torchrun, where it is the number of processes).
DEFAULT_STAGES = 4
#: Model-specific flags: their default per model; a model absent from a flag's entry does not take it.
MODEL_FLAGS: dict[str, dict[str, int | None]] = {
    "hidden": {"mlp": 128},
    "depth": {"mlp": 3},
    "width": {"resnet": 16},
    "layers": {"resnet": 3, "gpt": 4},
    "heads": {"gpt": 4},
    "embd": {"gpt": 64},
    "block_size": {"gpt": 64},
    "steps_per_epoch": {"gpt": 50},
    "eval_windows": {"gpt": 64},
}
#: Settings a checkpoint fixes: resuming with different values cannot load it.
_STRUCTURAL = ("model", "hidden", "depth", "width", "layers", "heads", "embd", "block_size", "optimizer")
#: Settings that merely change the trajectory (or what is measured): resuming with other values is noted. The
#: pipeline's shape is among them: a checkpoint maps by parameter name into any stages, micro-batches, algorithm.
_TRAJECTORY = ("algorithm", "stages", "microbatches", "batch_size", "lr", "lr_schedule", "clip", "bf16", "seed",
               "option", "steps_per_epoch", "eval_windows")
#: The length of an algorithm's learning-rate warm-up (PipeMare's T1), in epochs of updates (the spec's proposal).
WARMUP_EPOCHS = 5


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
    parser.add_argument("--model", choices=MODELS, default="mlp",
                        help="mlp or resnet on digits, gpt on text (default mlp; defaults per model below)")
    parser.add_argument("-a", "--algorithm", default="1f1b", metavar="NAME",
                        help="algorithm name or alias (default 1f1b; see `pipecore simulate --compare`)")
    parser.add_argument("-p", "--stages", type=positive_int, metavar="P",
                        help="pipeline stages (default 4, under torchrun the number of processes times "
                             "--stages-per-rank over --data-parallel; at most the "
                             "number of modules the model can be cut between: an error says how many)")
    parser.add_argument("--stages-per-rank", type=positive_int, default=1, metavar="V",
                        help="stages (model chunks) per rank, for interleaved-1f1b, looped-bfs and zb-h1 (default 1; "
                             "zb-v and dualpipe-v always run 2): a rank is a worker thread, or a process under "
                             "torchrun, where --stages defaults to V x the number of processes")
    parser.add_argument("--data-parallel", type=positive_int, metavar="W",
                        help="under torchrun: W replicas of the pipeline, each reading 1/W of every mini-batch "
                             "(default: the processes over the pipeline's ranks, when --stages is given; 1 otherwise)")
    parser.add_argument("-m", "--microbatches", type=positive_int, default=4, metavar="M",
                        help="micro-batches per mini-batch (default 4)")
    parser.add_argument("-b", "--batch-size", type=positive_int, metavar="N",
                        help="mini-batch size, at least --microbatches; micro-batch sizes differ by at most one when "
                             "it does not divide (default 64 for mlp and resnet, the last partial batch of an epoch "
                             "is dropped; 32 windows for gpt)")
    parser.add_argument("-e", "--epochs", type=positive_int, metavar="E",
                        help="total epochs, counting those of a resumed checkpoint (default 20 for mlp, 10 for "
                             "resnet and gpt)")
    parser.add_argument("--lr", type=_positive_float, metavar="LR",
                        help=f"learning rate (default {DEFAULT_LR['sgd']} for sgd, {DEFAULT_LR['adamw']} for adamw, "
                             "per update of a whole mini-batch; algorithms that update every k of the M "
                             "micro-batches default to that times k/M)")
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                        help="the learning rate over the run: constant, or cosine from --lr down to 0 over the "
                             "updates of --epochs (each stage by its own update count; default constant)")
    parser.add_argument("--clip", type=_positive_float, metavar="NORM",
                        help="clip each update's gradient to this norm (the global norm over all stages for gpipe "
                             "and 1f1b, each stage's own for the asynchronous algorithms)")
    parser.add_argument("--bf16", action="store_true",
                        help="run the forwards under torch.autocast in bfloat16 (weights and optimizer state stay "
                             "float32)")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"),
                        help="sgd (momentum 0.9) or adamw (default sgd for mlp and resnet, adamw for gpt)")
    _add_run_arguments(parser, add_model_arguments(parser)["gpt"])
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the split, the weights and the shuffling or sampling (default 0)")
    parser.add_argument("-o", "--option", type=algorithm_option, action="append", default=[], metavar="KEY=VALUE",
                        help="algorithm option, repeatable (e.g. warmup_steps=200, update_every=2)")
    parser.add_argument("--threads", type=positive_int, default=1, metavar="T",
                        help="torch threads (default 1: these models' matrices are too small to gain from more, "
                             "and spare threads slow it down when the cores are busy)")
    parser.add_argument("--plot", metavar="PNG",
                        help="plot loss and test accuracy (gpt: held-out perplexity) per epoch to a PNG file")


def add_model_arguments(parser: argparse.ArgumentParser) -> dict[str, "argparse._ArgumentGroup"]:
    """The flags that size ``--model`` (shared with ``pipecore plan``); returns the argument groups by model,
    for flags of one command to join."""
    mlp = parser.add_argument_group("mlp")
    mlp.add_argument("--hidden", type=positive_int, metavar="H",
                     help="width of the hidden layers (default 128)")
    mlp.add_argument("--depth", type=positive_int, metavar="L",
                     help="hidden layers (default 3; the MLP has L + 1 Linear layers and every stage needs one)")
    sized = parser.add_argument_group("resnet and gpt")
    sized.add_argument("--layers", type=positive_int, metavar="L",
                       help="residual blocks of the resnet (default 3; the second one downsamples) or transformer "
                            "blocks of the gpt (default 4)")
    sized.add_argument("--width", type=positive_int, metavar="C",
                       help="resnet: channels of the stem and first block (doubled by the downsampling block; "
                            "default 16)")
    gpt = parser.add_argument_group("gpt")
    gpt.add_argument("--block-size", type=positive_int, metavar="T",
                     help="characters of context per window (default 64)")
    gpt.add_argument("--heads", type=positive_int, metavar="H",
                     help="attention heads; must divide --embd (default 4)")
    gpt.add_argument("--embd", type=positive_int, metavar="D",
                     help="embedding width (default 64)")
    return {"mlp": mlp, "resnet and gpt": sized, "gpt": gpt}


def _add_run_arguments(parser: argparse.ArgumentParser, gpt: "argparse._ArgumentGroup") -> None:
    """The flags of a training run (``train`` only): epochs of the text task, checkpoints, progress, profiling."""
    gpt.add_argument("--steps-per-epoch", type=positive_int, metavar="S",
                     help="mini-batches of random windows per epoch (default 50)")
    gpt.add_argument("--eval-windows", type=positive_int, metavar="N",
                     help="held-out loss and perplexity are measured on at most N non-overlapping windows of "
                          "the held-out text, spread evenly over it, to keep evaluation fast (default 64)")
    parser.add_argument("--save", metavar="PATH",
                        help="save a checkpoint at the end (pipeline state, epoch, args), and where Ctrl-C or "
                             "SIGTERM stops training")
    parser.add_argument("--save-every", type=positive_int, metavar="N",
                        help="with --save: also save after every N epochs")
    parser.add_argument("--resume", metavar="PATH",
                        help="continue from a --save checkpoint (also with another --stages, --microbatches or "
                             "--algorithm: the checkpoint maps by parameter name)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (it is also off when stderr is not a terminal)")
    parser.add_argument("--device", metavar="DEV",
                        help="where the stages run: cuda, cuda:N or cpu (default: cuda when available, else cpu); "
                             "under torchrun with NCCL, --device cuda gives each rank its LOCAL_RANK GPU")
    profiling = parser.add_argument_group("profiling")
    profiling.add_argument("--profile", metavar="PATH",
                           help="record the first --profile-steps training steps (pipe.step, and the end-of-epoch "
                                "flush that follows a recorded step; evaluations between recorded steps are "
                                "recorded too, as 'evaluate' ranges) with torch.profiler (CPU, and CUDA when "
                                "available) and write a Chrome trace to PATH; every action is a range named as "
                                "the simulator names it (2F5@v3, 1B4-7@v2, 0U3); under torchrun each rank writes "
                                "its own file, PATH with .rank<R> before the suffix (trace.rank1.json); printed "
                                "timings include the profiler's overhead")
    profiling.add_argument("--profile-steps", type=positive_int, metavar="N",
                           help=f"with --profile: how many training steps to record, from the first step of "
                                f"this run (default {DEFAULT_PROFILE_STEPS}; long runs make huge traces)")


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
            f"--stages {num_stages} needs at least {num_stages} Linear layers, the MLP has {len(starts)} "
            f"(--depth {len(starts) - 1}); raise --depth to {num_stages - 1} or more, or lower --stages"
        )
    ends = starts[1:] + [len(model)]
    sizes = [sum(p.numel() for p in model[a:b].parameters()) for a, b in zip(starts, ends)]
    return [starts[i] for i in balanced_by_parameters(sizes, num_stages)]


def mlp_shape(features: int, hidden: int, depth: int, classes: int) -> str:
    return "-".join(str(n) for n in [features] + [hidden] * depth + [classes])


def outputs_in_eval_mode(model: "nn.Module | pipecore.Pipeline", x: "torch.Tensor") -> "torch.Tensor":
    """``model``'s output on ``x`` in evaluation mode, without gradients; its mode is restored afterwards.

    ``model`` is a plain module, or a :class:`pipecore.Pipeline`: then the output comes through
    ``pipe.predict`` (the stages' live weights; with one process per stage, collective: every rank calls it
    and gets the output, on the CPU)."""
    import torch

    import pipecore

    was_training = model.training
    model.eval()
    try:
        if isinstance(model, pipecore.Pipeline):
            return model.predict(x, broadcast=True).cpu()
        with torch.no_grad():
            return model(x)
    finally:
        model.train(was_training)


def evaluate(model: "nn.Module | pipecore.Pipeline", x: "torch.Tensor", y: "torch.Tensor") -> tuple[float, int]:
    """Accuracy and number correct of ``model`` (a module or a pipeline: the live weights) on ``(x, y)``."""
    correct = int((outputs_in_eval_mode(model, x).argmax(dim=1) == y).sum())
    return correct / len(y), correct


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int) -> list["torch.Tensor"]:
    """The shuffled index batches of ``epoch`` (full batches only), a function of ``(seed, epoch)`` alone."""
    import torch

    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n, generator=generator)
    return [order[i: i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]


def sequence_loss(logits: "torch.Tensor", targets: "torch.Tensor") -> "torch.Tensor":
    """Mean cross entropy over every position: ``logits[B, T, V]`` against ``targets[B, T]``."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def held_out_windows(data: "torch.Tensor", block_size: int, limit: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    """At most ``limit`` of the non-overlapping windows of ``data`` (:func:`pipecore.models.windows`), spread
    evenly over it (the first and the last included), in order."""
    import torch

    from ..models import windows

    x, y = windows(data, block_size)
    if len(x) > limit:
        keep = torch.linspace(0, len(x) - 1, limit).round().long() if limit > 1 else torch.zeros(1, dtype=torch.long)
        x, y = x[keep], y[keep]
    return x, y


def held_out_loss(model: "nn.Module | pipecore.Pipeline", x: "torch.Tensor", y: "torch.Tensor",
                  chunk: int = 64) -> float:
    """Mean cross entropy per position of ``model`` (a language model or a pipeline of one: the live weights)
    on windows ``(x, y)``, ``chunk`` windows per forward (or per ``predict``), so that the logits of one chunk
    at a time are held."""
    import torch.nn.functional as F

    total = 0.0
    for a in range(0, len(x), chunk):
        logits = outputs_in_eval_mode(model, x[a: a + chunk])
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[a: a + chunk].reshape(-1),
                                       reduction="sum"))
    return total / y.numel()


# -- the models' tasks: data, model, batches, evaluation and report lines -------------------------------


class _DigitsTask:
    """``--model mlp`` or ``--model resnet`` on the digits split: epochs of shuffled batches, test accuracy."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.data = data = load_data(args.seed)
        self.n_train = n_train = len(data.y_train)
        if args.batch_size > n_train:
            raise ValueError(f"--batch-size {args.batch_size} is larger than the training set ({n_train} samples)")
        self.steps_per_epoch = n_train // args.batch_size
        self.loss_fn = torch.nn.CrossEntropyLoss()

    def build(self) -> "nn.Module":
        a, d = self.args, self.data
        if a.model == "mlp":
            return build_mlp(d.features, a.hidden, a.depth, d.classes)
        from ..models import ResNet

        return ResNet(in_channels=1, num_classes=d.classes, width=a.width, blocks=a.layers)

    def partition(self, model: "nn.Module") -> list[int] | None:
        """The MLP cuts only before a Linear layer; the ResNet takes the pipeline's default (between modules)."""
        return stage_partition(model, self.args.stages) if self.args.model == "mlp" else None

    def name(self, model: "nn.Module") -> str:
        a, d = self.args, self.data
        if a.model == "mlp":
            return f"MLP {mlp_shape(d.features, a.hidden, a.depth, d.classes)}"
        return f"ResNet width {a.width}, {_plural(a.layers, 'block')}, {_parameters(model):,} parameters"

    def describe_data(self) -> str:
        d = self.data
        return f"digits: {self.n_train} train / {len(d.y_test)} test samples, {d.features} features, {d.classes} classes"

    def batches(self, epoch: int) -> Iterator[tuple["torch.Tensor", "torch.Tensor"]]:
        d = self.data
        for idx in epoch_batches(self.n_train, self.args.batch_size, self.args.seed, epoch):
            yield d.x_train[idx], d.y_train[idx]

    def evaluate(self, model: "nn.Module | pipecore.Pipeline") -> dict[str, float]:
        accuracy, correct = evaluate(model, self.data.x_test, self.data.y_test)
        return {"accuracy": accuracy, "correct": correct}

    header = f"{'epoch':>5}  {'loss':>8}  {'test acc':>8}  {'time':>6}"

    def line(self, record: dict[str, float], seconds: str) -> str:
        return f"{record['epoch']:>5}  {record['loss']:>8.4f}  {100 * record['accuracy']:>7.2f}%  {seconds:>6}"

    def summary(self, result: dict[str, float]) -> str:
        return f"test accuracy {100 * result['accuracy']:.2f}% ({result['correct']}/{len(self.data.y_test)})"

    def rate(self, trained: int, elapsed: float) -> str:
        return f"{trained / elapsed:,.0f} samples/s"


class _TextTask:
    """``--model gpt`` on the character corpus: epochs of ``--steps-per-epoch`` random windows, held-out
    loss and perplexity."""

    def __init__(self, args: argparse.Namespace) -> None:
        from ..models import load_char_data

        self.args = args
        if args.embd % args.heads:
            raise ValueError(f"--embd {args.embd} is not divisible by --heads {args.heads}")
        try:
            self.data = load_char_data(args.block_size)
        except ValueError:
            from ..models import load_text_corpus

            longest = int(len(load_text_corpus()) * 0.1) - 1  # the held-out tenth needs a window plus a target
            raise ValueError(f"--block-size {args.block_size} is longer than the held-out text allows; "
                             f"use at most {longest}") from None
        self.steps_per_epoch = args.steps_per_epoch
        self.x_test, self.y_test = held_out_windows(self.data.test, args.block_size, args.eval_windows)
        self.loss_fn = sequence_loss

    def build(self) -> "nn.Module":
        from ..models import GPT

        a = self.args
        return GPT(self.data.vocab_size, a.block_size, n_layer=a.layers, n_head=a.heads, n_embd=a.embd)

    def partition(self, model: "nn.Module") -> None:
        return None  # the pipeline's default: between modules (each block is one), balanced by parameters

    def name(self, model: "nn.Module") -> str:
        a = self.args
        return (f"GPT {_plural(a.layers, 'layer')}, {_plural(a.heads, 'head')}, embd {a.embd}, block {a.block_size}, "
                f"{_parameters(model):,} parameters")

    def describe_data(self) -> str:
        d = self.data
        return (f"text: Python's help topics, {len(d.train):,} train / {len(d.test):,} held-out characters, "
                f"vocabulary {d.vocab_size}")

    def batches(self, epoch: int) -> Iterator[tuple["torch.Tensor", "torch.Tensor"]]:
        import torch

        from ..models import batches

        a = self.args
        generator = torch.Generator().manual_seed(a.seed * 1_000_003 + epoch)
        for _ in range(a.steps_per_epoch):
            yield batches(self.data.train, a.block_size, a.batch_size, generator)

    def evaluate(self, model: "nn.Module | pipecore.Pipeline") -> dict[str, float]:
        loss = held_out_loss(model, self.x_test, self.y_test)
        return {"test_loss": loss, "perplexity": math.exp(loss)}

    header = f"{'epoch':>5}  {'loss':>8}  {'test loss':>9}  {'test ppl':>8}  {'time':>6}"

    def line(self, record: dict[str, float], seconds: str) -> str:
        return (f"{record['epoch']:>5}  {record['loss']:>8.4f}  {record['test_loss']:>9.4f}  "
                f"{record['perplexity']:>8.2f}  {seconds:>6}")

    def summary(self, result: dict[str, float]) -> str:
        return (f"held-out perplexity {result['perplexity']:.2f} (loss {result['test_loss']:.4f} per character, "
                f"{len(self.x_test)} windows of {self.args.block_size})")

    def rate(self, trained: int, elapsed: float) -> str:
        return f"{trained / elapsed:,.0f} windows/s, {trained * self.args.block_size / elapsed:,.0f} characters/s"


def _parameters(model: "nn.Module") -> int:
    return sum(p.numel() for p in model.parameters())  # a tied parameter counts once


# -- setup --------------------------------------------------------------------------------------------


def _resolve_defaults(args: argparse.Namespace) -> None:
    """Fill in the defaults that depend on ``--model``; a model-specific flag given for another model is an error."""
    for flag, per_model in MODEL_FLAGS.items():
        given = getattr(args, flag)
        if given is not None and args.model not in per_model:
            takers = " and ".join(f"--model {m}" for m in per_model)
            raise ValueError(f"--{flag.replace('_', '-')} applies to {takers}, not --model {args.model}")
        setattr(args, flag, given if given is not None else per_model.get(args.model))
    if args.stages is None:
        # Under torchrun one process runs each rank of each replica: the processes over the replicas, times the
        # stages each runs.
        world = int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1
        per_rank = _stages_per_rank(args)
        replicas = args.data_parallel or 1
        if world > 1 and world % replicas:
            raise ValueError(f"--data-parallel {replicas} does not divide the {world} processes torchrun started")
        args.stages = world // replicas * per_rank if world > 1 else max(DEFAULT_STAGES, per_rank)
    args.optimizer = args.optimizer or DEFAULT_OPTIMIZER[args.model]
    args.batch_size = args.batch_size or DEFAULT_BATCH_SIZE[args.model]
    args.epochs = args.epochs or DEFAULT_EPOCHS[args.model]


def train_device(spec: str | None) -> "torch.device":
    """``--device``: cuda when available, else cpu, by default; a bad or unavailable device is a ValueError."""
    import torch

    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {spec!r} is not a device: give cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {spec!r}: pipecore train runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {spec!r}, but CUDA is not available on this machine (torch {torch.__version__}); "
                         "use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {spec!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def _stages_per_rank(args: argparse.Namespace) -> int:
    """The stages each rank runs: --stages-per-rank, --option stages_per_rank, or 2 for the V-shaped schedules."""
    given = dict(args.option).get("stages_per_rank", args.stages_per_rank)
    if given == 1:
        try:
            from ..algorithms import get_spec

            return int(get_spec(args.algorithm).defaults.get("stages_per_rank", 1))
        except ValueError:
            return 1  # an unknown algorithm: reported with the list of names when the pipeline is built
    return int(given)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings as plain values (stored in checkpoints); flags of other models are None."""
    return {
        "model": args.model, "algorithm": args.algorithm, "stages": args.stages, "microbatches": args.microbatches,
        "batch_size": args.batch_size, "epochs": args.epochs, "lr": args.lr, "lr_schedule": args.lr_schedule,
        "clip": args.clip, "bf16": args.bf16,
        "optimizer": args.optimizer,
        **{flag: getattr(args, flag) for flag in MODEL_FLAGS},
        "seed": args.seed, "option": [list(o) for o in args.option],
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
    # Checkpoints from before --model trained the MLP; from before --lr-schedule, --clip and --bf16, at a
    # constant rate, without clipping, in float32.
    saved = {"model": "mlp", "lr_schedule": "constant", "clip": None, "bf16": False, **saved}
    keys = ("model",) if settings["model"] != saved["model"] else _STRUCTURAL
    mismatched = [k for k in keys if settings[k] != saved.get(k)]
    if mismatched:
        given = ", ".join(f"--{k.replace('_', '-')} {saved.get(k)}" for k in mismatched)
        raise ValueError(f"the checkpoint was trained with {given}; resume with the same settings")
    if epoch >= epochs:
        raise ValueError(f"the checkpoint has already trained {_plural(epoch, 'epoch')}; --epochs is the total, "
                         f"pass more than {epoch}")
    return [
        f"note: --{k.replace('_', '-')} {settings[k]} differs from the checkpoint's {saved.get(k)}"
        for k in _TRAJECTORY if settings[k] != saved.get(k)
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


def layers_cell(names: Sequence[str], width: int = 32) -> str:
    """A stage's module names for the table: names inside a listed module are left out (``blocks.0`` stands
    for ``blocks.0.attn``, ...); a list still longer than ``width`` characters shows its first and last
    module and their count (``tok_emb..blocks.1 (5)``)."""
    names = list(names)
    listed = set(names)
    top = [n for n in names if not any(".".join(n.split(".")[:i]) in listed for i in range(1, n.count(".") + 1))]
    cell = ",".join(top)
    if len(cell) <= width or len(top) < 3:
        return cell or "-"
    return f"{top[0]}..{top[-1]} ({len(top)})"


def stage_table(stats: list[dict[str, Any]]) -> str:
    """Per-stage summary: layers, parameters, weight versions and their bytes, staleness, delay, time."""
    rows = []
    for st in stats:
        per = st["seconds_per_action"]
        times = "/".join(f"{per[k] * 1e3:.2f}" if k in per else "-" for k in ("F", "B", "U"))
        rows.append((
            str(st["stage"]), layers_cell(st["layers"]), f"{st['parameters']:,}", str(st["weight_versions"]),
            f"{st['weight_version_bytes']:,}", f"{st['staleness_mean']:.2f}/{st['staleness_max']}",
            f"{st['delay_mean']:.2f}/{st['delay_max']}", times,
        ))
    header = ("stage", "layers", "params", "versions", "weight bytes", "staleness", "delay", "ms F/B/U")
    return format_table(header, rows, right=(2, 3, 4, 5, 6, 7))


def plot_curves(path: str, history: list[dict[str, float]], title: str) -> None:
    """Loss and test accuracy per epoch, side by side, to a PNG; for a language model (records with
    ``perplexity``), training and held-out loss, and held-out perplexity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = [h["epoch"] for h in history]
    text = bool(history) and "perplexity" in history[0]
    fig, (ax_loss, ax_metric) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [h["loss"] for h in history], marker="o", label="training")
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
    if text:  # cross entropy per character spans a narrow range: linear axes read better
        ax_loss.plot(epochs, [h["test_loss"] for h in history], marker="o", label="held-out")
        ax_loss.legend()
        ax_metric.plot(epochs, [h["perplexity"] for h in history], marker="o", color="tab:green")
        ax_metric.set(xlabel="epoch", ylabel="held-out perplexity", title="held-out perplexity")
    else:
        ax_loss.set(ylabel="training loss", yscale="log")
        ax_metric.plot(epochs, [100 * h["accuracy"] for h in history], marker="o", color="tab:green")
        ax_metric.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
    for ax in (ax_loss, ax_metric):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as error:
        raise ValueError(f"cannot write {path}: {error.strerror or error}") from None
    finally:
        plt.close(fig)


# -- the command ------------------------------------------------------------------------------------------


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped ``pipecore train`` where it could not wait for the step to end (before
    training, or a second signal during a step, which the pipeline then undoes as it undoes any failed step)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Interrupts:
    """What SIGINT (Ctrl-C) and SIGTERM do while ``pipecore train`` runs, by phase (``mode``):

    * ``"now"`` (setting up): raise :class:`Interrupted` at once; there is nothing to save yet.
    * ``"after step"`` (training): remember the signal; the loop stops after the current step, saves and
      exits. A second signal in one process raises :class:`Interrupted` inside the step, which the pipeline
      undoes (``KeyboardInterrupt`` semantics of :meth:`pipecore.Pipeline.step`).
    * ``"hold"`` (the end of an epoch: flush, evaluation, saves; stopping): remember it only, so that what
      is under way (a checkpoint being written) is finished; training stops after it.

    Handlers are installed only from the main thread (Python delivers signals there) and restored on exit;
    a signal the process ignores (started in the background, or under ``nohup``) is left ignored.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.mode = "now"
        self.one_process = True
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "Interrupts":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                # A signal the process was started ignoring stays ignored: `nohup pipecore train &` (a
                # background job ignores SIGINT) must not be stopped by a Ctrl-C meant for the shell.
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        again = self.received is not None
        if not again:
            self.received = signum
        if self.mode == "now" or (self.mode == "after step" and again and self.one_process):
            raise Interrupted(signum)

    def stop(self, pipe: Any) -> int | None:
        """The signal that stops training after this step, if any: with one process per stage, any rank's
        (every rank calls this after every step, so that all stop after the same one), else this process's."""
        if pipe.rank is None:
            return self.received
        return next((r for r in pipe._gather(self.received) if r is not None), None)


def exit_code(signum: int) -> int:
    """The shell's exit status of a process ended by ``signum``: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


def run(args: argparse.Namespace) -> int:
    """Execute ``pipecore train`` (with ``--threads`` torch threads, restored afterwards). SIGINT and SIGTERM
    stop it as :class:`Interrupts` describes, with exit code 130 or 143 and one line on stderr."""
    given = dict(vars(args))  # the flags as given, before the defaults are filled in: for the resume command
    interrupts = Interrupts()
    try:
        with interrupts:
            import torch

            threads = torch.get_num_threads()
            torch.set_num_threads(args.threads)
            try:
                return _train(args, interrupts, given)
            finally:
                torch.set_num_threads(threads)
    except Interrupted as stop:
        print(f"pipecore train: stopped by {signal.Signals(stop.signum).name} before training started; nothing "
              "was saved", file=sys.stderr)
        return exit_code(stop.signum)


def _train(args: argparse.Namespace, interrupts: Interrupts | None = None, given: dict[str, Any] | None = None) -> int:
    import torch

    import pipecore

    _resolve_defaults(args)
    if args.save_every is not None and not args.save:
        raise ValueError(f"--save-every {args.save_every} needs --save PATH (where to save the checkpoint)")
    check_profile_args(args)  # fail before loading data and training, not after
    if args.batch_size < args.microbatches:
        raise ValueError(
            f"--batch-size {args.batch_size} is smaller than --microbatches {args.microbatches}: every micro-batch "
            f"needs at least one sample; use a batch of at least {args.microbatches}"
        )
    options = dict(args.option)
    per_rank = _stages_per_rank(args)
    if args.stages_per_rank != 1 or "stages_per_rank" in options:
        if "stages_per_rank" in options and options["stages_per_rank"] != args.stages_per_rank != 1:
            raise ValueError(f"--stages-per-rank {args.stages_per_rank} and --option stages_per_rank="
                             f"{options['stages_per_rank']} disagree; give one of them")
        options["stages_per_rank"] = per_rank
    processes = int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1
    ranks = max(1, args.stages // per_rank)  # processes per replica of the pipeline
    if processes > 1 and args.data_parallel is None:
        if processes % ranks:
            what = "stage" if per_rank == 1 else f"rank ({per_rank} stages each)"
            raise ValueError(f"--stages {args.stages} but torchrun started {processes} processes: pipecore runs one "
                             f"process per {what} of each replica of the pipeline, so the processes must be a "
                             f"multiple of {ranks}; pass --nproc-per-node {ranks} (or a multiple, with "
                             "--data-parallel)")
        args.data_parallel = processes // ranks
    replicas = args.data_parallel or 1
    if processes == 1 and replicas > 1:
        raise ValueError(f"--data-parallel {replicas} runs {replicas} replicas of the pipeline, one process per rank "
                         f"of each: launch with torchrun --nproc-per-node {replicas * ranks}")
    if processes > 1 and processes != replicas * ranks:
        what = "stage" if per_rank == 1 else f"rank ({per_rank} stages each)"
        raise ValueError(f"--stages {args.stages} and --data-parallel {replicas} need {replicas * ranks} processes but "
                         f"torchrun started {processes}: pipecore runs one process per {what} of each replica; pass "
                         f"--nproc-per-node {replicas * ranks}")
    device = train_device(args.device)

    task = _TextTask(args) if args.model == "gpt" else _DigitsTask(args)
    steps_per_epoch = task.steps_per_epoch

    # Validates the name, sizes and options (ValueError -> one-line error) before any training.
    algorithm = pipecore.get_algorithm(args.algorithm, args.stages, args.microbatches, **options)
    notes = []
    if args.lr is None:
        # Linear scaling: an update over k of the M micro-batches takes k/M of the mini-batch step.
        args.lr = DEFAULT_LR[args.optimizer] * algorithm.update_every / args.microbatches
    if "warmup_steps" in algorithm.spec.defaults and "warmup_steps" not in options:
        # A learning-rate warm-up counted in updates (PipeMare's T1) lasts the first epochs of this run.
        updates_per_step = args.microbatches // algorithm.update_every
        options["warmup_steps"] = WARMUP_EPOCHS * steps_per_epoch * updates_per_step
        notes.append(f"{algorithm.name} warmup_steps={options['warmup_steps']} ({WARMUP_EPOCHS} epochs of updates)")

    if args.clip is not None:
        options["clip_grad_norm"] = args.clip
        notes.append(f"gradients clipped to norm {args.clip:g}")
    if args.bf16:
        options["autocast"] = torch.bfloat16
        notes.append("forwards under bfloat16 autocast")
    if device.type == "cuda":
        # Under torchrun, plain cuda leaves each rank its LOCAL_RANK GPU (the pipeline's default with NCCL).
        if processes == 1 or device.index is not None:
            options["devices"] = str(device)
        notes.append(f"stages on {device if processes == 1 or device.index is not None else 'cuda (LOCAL_RANK)'}")
    if args.lr_schedule == "cosine":
        total_updates = args.epochs * steps_per_epoch * (args.microbatches // algorithm.update_every)
        options["lr_scheduler"] = functools.partial(cosine_decay, total_updates)
        notes.append(f"cosine learning rate over {total_updates} updates per stage")

    settings = _settings(args)
    ckpt = _load_checkpoint(args.resume) if args.resume else None
    start_epoch, history = 0, []
    if ckpt is not None:
        start_epoch = int(ckpt["epoch"])
        notes += _check_resume(settings, ckpt["args"], args.epochs, start_epoch)
        history = list(ckpt.get("history", []))

    torch.manual_seed(args.seed)
    model = task.build()
    name = task.name(model)
    joined_here = not _process_group_initialized()
    if processes > 1 and device.type == "cpu" and joined_here and torch.cuda.is_available():
        torch.distributed.init_process_group("gloo")  # the pipeline would pick NCCL, which needs GPU stages
    try:
        pipe = pipecore.Pipeline(
            model, args.stages, algorithm=args.algorithm, n_microbatches=args.microbatches,
            optimizer=_optimizer(args.optimizer, args.lr), loss_fn=task.loss_fn,
            partition=task.partition(model), data_parallel=replicas if replicas > 1 else None, **options,
        )
    except ValueError as error:
        if "larger than the number of modules" in str(error):
            raise ValueError(_too_many_stages(args, str(error))) from None
        raise
    try:
        with pipe:  # closes it at the end: with one process per stage, that releases its process groups
            return _run_pipeline(args, pipe, task, name, algorithm, settings, ckpt, start_epoch, history, notes,
                                 interrupts or Interrupts(), given or {})
    finally:
        if joined_here and _process_group_initialized():
            torch.distributed.destroy_process_group()  # under torchrun the pipeline joined it; leave it too


def write_checkpoint(path: str, ckpt: dict[str, Any]) -> None:
    """Write a ``pipecore train`` checkpoint atomically: a run killed while saving leaves the previous file whole,
    never a truncated one. A failed write is a ValueError (one line)."""
    import torch

    from ..checkpoint import write_atomically

    try:
        write_atomically(path, lambda f: torch.save(ckpt, f))
    except (OSError, RuntimeError) as error:  # torch.save reports a failed write as a RuntimeError
        raise ValueError(f"cannot write {path}: {getattr(error, 'strerror', None) or error}") from None


def _stop(args: argparse.Namespace, pipe: Any, stopped: tuple[int, int, int, list[float]], save: Any,
          given: dict[str, Any], leader: bool, steps_per_epoch: int) -> int:
    """After a signal stopped training at ``(signal, epoch, step, losses)``: drain the pipeline, save the
    checkpoint there with --save, say so in one line (with the command that resumes) and return 130 or 143."""
    signum, epoch, step, losses = stopped
    name = signal.Signals(signum).name
    where = f"epoch {epoch + 1}, step {step} of {steps_per_epoch}" if step else f"the end of epoch {epoch}"
    if not args.save:
        if leader:
            print(f"pipecore train: stopped by {name} at {where}; nothing was saved (pass --save PATH to keep a "
                  "checkpoint)", file=sys.stderr, flush=True)
        return exit_code(signum)
    try:
        pipe.flush()  # one consistent version per stage (asynchronous algorithms have backwards in flight)
        save(epoch, step, losses)
    except Exception as error:  # the line must still come, and no traceback
        if leader:
            print(f"pipecore train: stopped by {name} at {where}; the checkpoint could not be saved ({error}); "
                  f"{args.save} holds what was saved before, if anything", file=sys.stderr, flush=True)
        return exit_code(signum)
    if leader:
        print(f"pipecore train: stopped by {name} at {where}; checkpoint saved to {args.save}; resume with: "
              f"{resume_command(given, args, pipe.rank is not None)}", file=sys.stderr, flush=True)
    return exit_code(signum)


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


def cosine_decay(total_updates: int, update: int) -> float:
    """The multiplier of the learning rate at ``update`` of ``total_updates``: from 1 down to 0 on a half cosine
    (0 from then on)."""
    return 0.5 * (1.0 + math.cos(math.pi * min(update, total_updates) / total_updates))


def _too_many_stages(args: argparse.Namespace, message: str) -> str:
    """The pipeline's "more stages than modules" error in the command line's terms."""
    import re

    found = re.search(r"\((\d+)\)", message)
    units = f"at most {found.group(1)} stages" if found else "fewer stages"
    more = "raise --layers" if args.model in ("gpt", "resnet") else "raise --depth"
    return (f"--stages {args.stages}: the {args.model} can be cut into {units} (the pipeline cuts only between "
            f"modules); lower --stages or {more}")


def _quiet(*args: Any, **kwargs: Any) -> None:
    """``print`` on the ranks that do not report."""


def _process_group_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _run_pipeline(args: argparse.Namespace, pipe: Any, task: Any, name: str, algorithm: Any,
                  settings: dict[str, Any], ckpt: dict[str, Any] | None, start_epoch: int,
                  history: list[dict[str, float]], notes: list[str], interrupts: Interrupts,
                  given: dict[str, Any]) -> int:
    import warnings

    import torch
    from tqdm import tqdm

    import pipecore
    from ..engine.state_io import CheckpointNote

    # With one process per stage (under torchrun) every rank trains its stage and takes part in the evaluation
    # (pipe.predict); rank 0 alone prints and writes.
    leader = pipe.process_rank in (None, 0)
    say = print if leader else _quiet
    for flag, path in (("--save", args.save), ("--plot", args.plot)):
        # Fail before training, not after it.
        if leader and path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{flag}: the directory of {path} does not exist")
    start_step, start_losses = 0, []
    if ckpt is not None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CheckpointNote)
            pipe.load_state_dict(ckpt["pipeline"])
        notes += [f"note: {w.message}" for w in caught if issubclass(w.category, CheckpointNote)]
        if pipe.lr_scheduler is None:
            # The run's --lr (or its default for this algorithm and --microbatches), not the rate the checkpoint
            # restores (the same when the settings are; a resume with other settings is noted above).
            pipe.set_lr(args.lr)
        # A checkpoint saved where a signal stopped training is part way through its epoch.
        start_step, start_losses = int(ckpt.get("step", 0)), list(ckpt.get("losses", []))
    steps_per_epoch = task.steps_per_epoch

    def test_metrics() -> dict[str, float]:
        # Through the pipeline (pipe.predict, the stages' live weights, in evaluation mode): nothing is gathered.
        # Collective with one process per stage: every rank takes part, and every rank gets the metrics.
        return task.evaluate(pipe)

    def save(epoch: int, step: int = 0, losses: Sequence[float] = ()) -> None:
        """Save the checkpoint (collective with one process per stage; rank 0 writes): ``epoch`` epochs
        complete and ``step`` steps of the next, whose losses are ``losses``."""
        state = pipe.full_state_dict()
        if leader:
            write_checkpoint(args.save, {"pipeline": state, "epoch": epoch, "step": step, "losses": list(losses),
                                         "args": settings, "history": history})

    optimizer = f"SGD lr {args.lr:g} momentum 0.9" if args.optimizer == "sgd" else f"AdamW lr {args.lr:g}"
    say(f"{task.describe_data()}; {name}")
    smallest, largest = args.batch_size // args.microbatches, -(-args.batch_size // args.microbatches)
    sizes = f"{smallest}" if smallest == largest else f"{smallest}-{largest}"  # as torch.tensor_split splits
    say(f"{algorithm.name}: {args.stages} stages, {args.microbatches} micro-batches of "
        f"{sizes} (batch {args.batch_size}, {steps_per_epoch} steps/epoch), "
        f"{optimizer}, seed {args.seed}, {_plural(torch.get_num_threads(), 'thread')}")
    for note in notes:
        say(note)
    if ckpt is not None:
        if start_step:  # saved where a signal stopped training, part way through the next epoch
            say(f"resumed from {args.resume} in epoch {start_epoch + 1}, after step {start_step} of {steps_per_epoch}")
        else:
            say(f"resumed from {args.resume} at epoch {start_epoch}")
    if pipe.rank is not None:
        replicas = f" x {pipe.data_parallel} replicas" if pipe.data_parallel > 1 else ""
        say(f"one process per rank: {pipe.num_ranks} ranks{replicas} ({torch.distributed.get_backend()}); rank 0 "
            "reports")
    say()
    say(task.header)
    for h in history:
        say(task.line(h, "-"))

    hide_bar = True if args.no_progress or not leader else None  # None: tqdm shows the bar only on a terminal
    # With one process per stage every rank records its own stage's actions into its own file.
    profile = Profile(args.profile, args.profile_steps)
    trace_path = rank_path(args.profile, pipe.process_rank) if args.profile else None
    profile.start()  # after data loading and setup: the trace starts at the first training step
    started = time.perf_counter()
    trained = 0
    stopped: tuple[int, int, int, list[float]] | None = None  # (signal, epoch, step, losses) where a signal stopped it
    interrupts.one_process = pipe.rank is None
    interrupts.mode = "after step"
    try:
        for epoch in range(start_epoch, args.epochs):
            t0 = time.perf_counter()
            skip = start_step if epoch == start_epoch else 0
            losses = list(start_losses) if epoch == start_epoch else []
            bar = tqdm(task.batches(epoch), total=steps_per_epoch, desc=f"epoch {epoch + 1}/{args.epochs}",
                       unit="batch", leave=False, disable=hide_bar, file=sys.stderr, dynamic_ncols=True,
                       initial=skip)
            before = pipe.minibatches
            signum = None
            try:
                for i, (x, y) in enumerate(bar):
                    if i < skip:  # given before the checkpoint was saved (drawn all the same: the batches
                        continue  # of an epoch depend on the seed and the epoch alone)
                    try:
                        with profile.range(f"step {profile.recorded + 1}"):
                            loss = pipe.step(x, y)
                    except pipecore.NonFiniteLoss as error:
                        raise ValueError(f"epoch {epoch + 1}: {error}; try a lower --lr") from None
                    profile.step_done(ends_epoch=i + 1 == steps_per_epoch)
                    losses.append(loss)
                    bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
                    signum = interrupts.stop(pipe)
                    if signum is not None:
                        break
            except Interrupted as stop:  # a second signal: the pipeline undid the step in progress
                signum = stop.signum
            # The end of the epoch (flush, evaluation, saves) is not undone by a second signal: it runs to the end,
            # and a signal that came meanwhile stops training after it.
            interrupts.mode = "hold"
            bar.close()
            if signum is not None:
                done = skip + pipe.minibatches - before  # the steps the pipeline kept (an undone one is not)
                stopped = (signum, epoch, done, losses[:done])
                break
            with profile.range("flush"):
                pipe.flush()  # drain asynchronous algorithms: evaluate and checkpoint one consistent version
            profile.flushed(last=epoch + 1 == args.epochs)
            trained += (len(losses) - skip) * args.batch_size
            with profile.range("evaluate"):  # recorded only between recorded steps
                metrics = test_metrics()
            record = {"epoch": epoch + 1, "loss": sum(losses) / len(losses),
                      **{k: v for k, v in metrics.items() if k != "correct"}}
            history.append(record)
            if leader:  # the other ranks print nothing
                print(task.line(record, f"{time.perf_counter() - t0:.2f}s"), flush=True)
            if args.save_every and (epoch + 1) % args.save_every == 0 and epoch + 1 < args.epochs:
                save(epoch + 1)
                say(f"saved checkpoint (epoch {epoch + 1}) to {args.save}", flush=True)
            signum = interrupts.stop(pipe)
            if signum is not None and epoch + 1 < args.epochs:
                stopped = (signum, epoch + 1, 0, [])
                break
            interrupts.mode = "after step"
        elapsed = time.perf_counter() - started
    finally:
        interrupts.mode = "hold"
        profile.close()
    if trace_path is not None:
        profile.export(trace_path)
    if stopped is not None:
        return _stop(args, pipe, stopped, save, given, leader, steps_per_epoch)

    result = test_metrics()
    # Collective with one process per stage: every rank takes part, rank 0 prints and writes.
    stats = pipe.stats(all_stages=True)
    if args.save:
        save(args.epochs)
    say()
    if leader:
        print(f"{task.summary(result)} after {_plural(args.epochs, 'epoch')}")
    say(f"time {elapsed:.2f}s for {_plural(args.epochs - start_epoch, 'epoch')} ({task.rate(trained, elapsed)})")
    say()
    say("per stage (staleness: versions behind live per weight read; delay: updates between a micro-batch's "
        "F and B; mean/max)")
    say(stage_table(stats))
    if not leader:
        return 0
    if args.save or args.plot or args.profile:
        print()
    if args.save:
        print(f"saved checkpoint (epoch {args.epochs}) to {args.save}")
    if args.plot:
        plot_curves(args.plot, history, f"pipecore train: {algorithm.name}, {args.stages} stages, {name}")
        metric = "perplexity" if args.model == "gpt" else "accuracy"
        print(f"wrote loss and {metric} curves to {args.plot}")
    if args.profile:
        written = trace_path if pipe.rank is None else f"{rank_path(args.profile, '<R>')} (one per rank)"
        options = "".join(f" -o {k}={option_text(v)}" for k, v in args.option)
        # A flush ends the pipeline's schedule: the next step starts a new one (micro-batches from 0 again), so
        # the simulation to compare with is the recorded steps of one epoch.
        simulated = min(profile.recorded, steps_per_epoch)
        print(f"wrote the profile of {_plural(profile.recorded, 'training step')} to {written}: open it in "
              f"chrome://tracing or https://ui.perfetto.dev; `pipecore simulate -a {args.algorithm} -p {args.stages} "
              f"-m {args.microbatches} -n {simulated}{options} --chrome sim.json` gives the simulator's view, "
              f"with the same action names")
    if interrupts.received is not None:  # a signal after the last step: the run completed, saved and reported
        return exit_code(interrupts.received)
    return 0
