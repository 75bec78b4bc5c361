"""The built-in models of ``pipecore train`` and ``pipecore plan`` (``--model``): their flags and defaults,
their data, how they are built and cut into stages, and how they are evaluated.

* ``--model mlp`` and ``--model resnet``: scikit-learn's digits (:func:`load_data`), an MLP
  (:func:`build_mlp`, cut by :func:`stage_partition`) or :class:`pipecore.models.ResNet`; test accuracy
  (:func:`evaluate`). :class:`DigitsTask`.
* ``--model gpt``: :class:`pipecore.models.GPT` on :func:`pipecore.models.load_char_data`; held-out loss
  (:func:`held_out_loss` on :func:`held_out_windows`) and perplexity. :class:`TextTask`.

:func:`task_for` gives the task of parsed arguments (after :func:`resolve_defaults`). The benchmarks
(``bench/convergence.py``) use the same data, models and evaluation through these names. Heavy imports stay
inside the functions, so that ``pipecore --help`` is fast.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from ._args import positive_int
from .report import plural

if TYPE_CHECKING:
    import torch
    from torch import nn

    import pipecore

#: The models ``--model`` chooses from.
MODELS = ("mlp", "gpt", "resnet")
#: Default learning rate per optimizer (see ``_args.OPTIMIZERS``).
DEFAULT_LR = {"sgd": 0.05, "adamw": 1e-3, "nadam": 1e-3}
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
#: The length of an algorithm's learning-rate warm-up (PipeMare's T1), in epochs of updates (the spec's proposal).
WARMUP_EPOCHS = 5


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


# -- data, models and evaluation ------------------------------------------------------------------------


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

    from ..planning.cut_search import balanced_by_parameters

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


class DigitsTask:
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
        return f"ResNet width {a.width}, {plural(a.layers, 'block')}, {_parameters(model):,} parameters"

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


class TextTask:
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
        return (f"GPT {plural(a.layers, 'layer')}, {plural(a.heads, 'head')}, embd {a.embd}, block {a.block_size}, "
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


def task_for(args: argparse.Namespace) -> DigitsTask | TextTask:
    """The task of ``--model`` (``args`` with their defaults resolved by :func:`resolve_defaults`)."""
    return TextTask(args) if args.model == "gpt" else DigitsTask(args)


def _parameters(model: "nn.Module") -> int:
    return sum(p.numel() for p in model.parameters())  # a tied parameter counts once


# -- defaults -------------------------------------------------------------------------------------------


def resolve_defaults(args: argparse.Namespace) -> None:
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
        per_rank = stages_per_rank(args)
        replicas = args.data_parallel or 1
        if world > 1 and world % replicas:
            raise ValueError(f"--data-parallel {replicas} does not divide the {world} processes torchrun started")
        args.stages = world // replicas * per_rank if world > 1 else max(DEFAULT_STAGES, per_rank)
    args.optimizer = args.optimizer or DEFAULT_OPTIMIZER[args.model]
    args.batch_size = args.batch_size or DEFAULT_BATCH_SIZE[args.model]
    args.epochs = args.epochs or DEFAULT_EPOCHS[args.model]


def stages_per_rank(args: argparse.Namespace) -> int:
    """The stages each rank runs: --stages-per-rank, --option stages_per_rank, or 2 for the V-shaped schedules."""
    given = dict(args.option).get("stages_per_rank", args.stages_per_rank)
    if given == 1:
        try:
            from ..algorithms import get_spec

            return int(get_spec(args.algorithm).defaults.get("stages_per_rank", 1))
        except ValueError:
            return 1  # an unknown algorithm: reported with the list of names when the pipeline is built
    return int(given)

