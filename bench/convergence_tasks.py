"""The convergence study's tasks (``bench/convergence.py``): what a task is, its data, model, batches, test
metric and optimizer.

A task fixes everything a run does except the method (an algorithm, or sequential training), the seed and the
hyper-parameters a grid may vary. Its optimizer is named as pipecore names it (``"SGD"``, ``"AdamW"``, and any
other that ``pipecore`` exports, e.g. ``"NAdam"``) and looked up on ``pipecore`` when a run starts, so that a
newer pipecore's optimizer needs no change here.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch
from torch import nn

import pipecore
from pipecore.cli.tasks import (
    build_mlp, epoch_batches, evaluate, held_out_loss, held_out_windows, load_data, mlp_shape, sequence_loss,
)

#: The digits split is the same for every run; seeds change the initial weights and the batch order.
SPLIT_SEED = 0

Options = tuple[tuple[str, Any], ...]  # keyword options, sorted by name: hashable, so a run's key can hold them


def options_tuple(options: dict[str, Any] | Options | None) -> Options:
    return tuple(sorted(dict(options or {}).items()))


@dataclass(frozen=True)
class Task:
    """One task: data, model, pipeline shape and the fixed hyper-parameters (tuned for sequential training).

    ``epochs`` counts evaluations: a pass over the training split for the digits tasks, ``steps_per_epoch``
    batches of random windows for the GPT tasks. ``target`` is a fixed test accuracy, or None for a target
    derived from sequential training (``target_rule``: ``"halfway"``, the mean held-out loss sequential training
    reaches after half its epochs; ``"final"``, its mean final held-out loss times ``1 + target_margin``).
    ``cosine_to``: the learning rate decays along a cosine, by the fraction of the training's mini-batches done,
    to this fraction of ``lr`` at the end (the same for every method: an algorithm that updates after every
    micro-batch moves along it m times per mini-batch); None keeps it constant.
    ``exact_seeds``: how many of the evaluation seeds run the algorithms that compute exactly what their matched
    sequential baseline computes (no staleness, no delay, no derived weights in the simulator: the synchronous
    schedules); None runs them on every seed. Their results are their baseline's up to float rounding, which the
    seeds they do run show; a task where runs are expensive spends its seeds on the algorithms that differ.
    """

    name: str
    model: str  # "mlp", "resnet" or "gpt"
    sizes: dict[str, int]
    stages: int
    microbatches: int
    batch_size: int
    epochs: int
    optimizer: str  # a pipecore optimizer's name: getattr(pipecore, optimizer)
    lr: float  # per mini-batch (see the study's learning-rate rule)
    optimizer_options: Options = ()  # e.g. (("momentum", 0.9),): the optimizer's keyword arguments besides lr
    init: str = "default"  # "default" (PyTorch's) or "he" (Kaiming normal, zero biases; MLP only)
    steps_per_epoch: int | None = None  # gpt: batches of random windows per evaluation
    target: float | None = None  # digits: test accuracy; gpt: None = derived from sequential (target_rule)
    target_rule: str = "halfway"
    target_margin: float = 0.0
    grid: tuple[tuple[float, Options], ...] = ()  # (lr, optimizer options) points
    exact_seeds: int | None = None
    cosine_to: float | None = None  # None: a constant lr; else cosine decay to this fraction of it by the end

    @property
    def metric(self) -> str:
        """The record key of the test metric."""
        return "test_loss" if self.model == "gpt" else "accuracy"

    @property
    def higher_is_better(self) -> bool:
        return self.model != "gpt"

    def training_identity(self) -> tuple:
        """What sequential training on this task depends on: everything but the task's name and pipeline
        depth. Two tasks that differ only in ``stages`` (``gpt-large-p4``, ``gpt-large-p8``) share their
        sequential runs and so their derived target."""
        return (self.model, tuple(sorted(self.sizes.items())), self.microbatches, self.batch_size, self.epochs,
                self.steps_per_epoch, self.optimizer, self.init, self.cosine_to)

    def describe_optimizer(self, lr: float | None = None, options: Options | None = None) -> str:
        opts = dict(self.optimizer_options if options is None else options)
        extra = "".join(f", {k.replace('_', ' ')} {v:g}" if isinstance(v, (int, float)) else f", {k} {v}"
                        for k, v in sorted(opts.items()))
        decay = "" if self.cosine_to is None else f" (cosine decay to {self.cosine_to:g}x)"
        return f"{self.optimizer} lr {self.lr if lr is None else lr:g}{decay}{extra}"

    def describe(self) -> str:
        """One line: model, shape, hyper-parameters."""
        if self.model == "mlp":
            what = f"MLP {mlp_shape(64, self.sizes['hidden'], self.sizes['depth'], 10)} ({self.init} init) on digits"
        elif self.model == "resnet":
            what = f"ResNet width {self.sizes['width']}, {self.sizes['blocks']} blocks on digits"
        else:
            s = self.sizes
            what = (f"GPT {s['layers']} layers, {s['heads']} heads, embd {s['embd']}, context {s['block_size']} on "
                    f"Python's help texts ({self.steps_per_epoch} batches per epoch)")
        return (f"{what}; P={self.stages}, m={self.microbatches}, batch {self.batch_size}, "
                f"{self.describe_optimizer()}, {self.epochs} epochs")


def sgd_grid(lrs: tuple[float, ...], momenta: tuple[float, ...]) -> tuple[tuple[float, Options], ...]:
    return tuple((lr, (("momentum", mom),)) for lr in lrs for mom in momenta)


#: The grid of the MLP tasks: learning rate per mini-batch x momentum.
GRID = sgd_grid((0.0125, 0.025, 0.05, 0.1), (0.0, 0.9))

_GPT_SMALL = {"layers": 4, "heads": 4, "embd": 64, "block_size": 64, "eval_windows": 64}
_GPT_LARGE = {"layers": 6, "heads": 4, "embd": 128, "block_size": 64, "eval_windows": 64}
_LARGE = dict(model="gpt", sizes=_GPT_LARGE, microbatches=8, batch_size=32, epochs=30, optimizer="AdamW", lr=1e-3,
              optimizer_options=(("weight_decay", 0.01),), steps_per_epoch=50, target_rule="final",
              target_margin=0.02, exact_seeds=1, cosine_to=0.1)

#: The Nesterov method's recipe (Ajanthan et al.'s code): NAdam with beta1 0.99 and decoupled weight decay.
NADAM_OPTIONS: Options = (("betas", (0.99, 0.999)), ("momentum_decay", 0.004), ("weight_decay", 0.01),
                          ("decoupled_weight_decay", True))


def _gpt_variants(gpt: Task) -> dict[str, Task]:
    """The small GPT at P=8 (m=8: one more stage than the model has blocks and embeddings and head can fill
    evenly, the deepest cut), and both depths with NAdam as the Nesterov method's paper trains (the optimizer
    whose momentum nesterov-async makes a look-ahead; AdamW has none). """
    p8 = {"stages": 8, "microbatches": 8}
    return {
        "gpt-p8": replace(gpt, name="gpt-p8", **p8),
        "gpt-nadam": replace(gpt, name="gpt-nadam", optimizer="NAdam", optimizer_options=NADAM_OPTIONS),
        "gpt-nadam-p8": replace(gpt, name="gpt-nadam-p8", optimizer="NAdam", optimizer_options=NADAM_OPTIONS, **p8),
    }


TASKS: dict[str, Task] = {
    "mlp4": Task("mlp4", "mlp", {"hidden": 96, "depth": 3}, 4, 4, 64, 15, "SGD", 0.05, (("momentum", 0.9),),
                 target=0.9, grid=GRID),
    "mlp8": Task("mlp8", "mlp", {"hidden": 96, "depth": 7}, 8, 8, 64, 12, "SGD", 0.025, (("momentum", 0.9),),
                 init="he", target=0.9, grid=GRID),
    "resnet": Task("resnet", "resnet", {"width": 16, "blocks": 3}, 4, 4, 64, 8, "SGD", 0.05, (("momentum", 0.9),),
                   target=0.95),
    "gpt": Task("gpt", "gpt", _GPT_SMALL, 4, 4, 32, 6, "AdamW", 1e-3, (("weight_decay", 0.01),),
                steps_per_epoch=20, exact_seeds=1),
}
TASKS.update(_gpt_variants(TASKS["gpt"]))
TASKS.update({"gpt-large-p4": Task("gpt-large-p4", stages=4, **_LARGE),
              "gpt-large-p8": Task("gpt-large-p8", stages=8, **_LARGE)})

#: Names that select several tasks on the command line.
TASK_FAMILIES = {"gpt-large": ("gpt-large-p4", "gpt-large-p8"), "gpt-small": ("gpt", "gpt-p8", "gpt-nadam",
                                                                           "gpt-nadam-p8")}


def quick_tasks() -> dict[str, Task]:
    """``--quick``: fewer epochs, a 2-point grid on mlp4 only, a GPT-large of width 32 for a few steps (4 layers:
    8 stages need 7 cuts between modules)."""
    tiny_large = {**_GPT_LARGE, "layers": 4, "embd": 32, "eval_windows": 16}
    return {
        "mlp4": replace(TASKS["mlp4"], epochs=5, grid=sgd_grid((0.025, 0.05), (0.9,))),
        "mlp8": replace(TASKS["mlp8"], epochs=3, grid=()),
        "resnet": replace(TASKS["resnet"], epochs=2),
        **{name: replace(TASKS[name], epochs=2, steps_per_epoch=10) for name in TASK_FAMILIES["gpt-small"]},
        "gpt-large-p4": replace(TASKS["gpt-large-p4"], sizes=tiny_large, epochs=3, steps_per_epoch=5),
        "gpt-large-p8": replace(TASKS["gpt-large-p8"], sizes=tiny_large, epochs=3, steps_per_epoch=5),
    }


# -- optimizers -------------------------------------------------------------------------------------------


def pipecore_optimizers() -> list[str]:
    """The optimizer classes this pipecore exports (those that take ``lr``)."""
    names = []
    for name in dir(pipecore):
        obj = getattr(pipecore, name, None)
        if isinstance(obj, type) and not name.startswith("_"):
            try:
                if "lr" in inspect.signature(obj).parameters:
                    names.append(name)
            except (TypeError, ValueError):
                continue
    return names


def optimizer_class(task: Task) -> type:
    """``pipecore.<task.optimizer>``, or a ``ValueError`` that says this pipecore lacks it and what it has."""
    cls = getattr(pipecore, task.optimizer, None)
    if not isinstance(cls, type):
        raise ValueError(f"task {task.name}: this pipecore has no optimizer {task.optimizer!r} (pipecore."
                         f"{task.optimizer}); it has {', '.join(pipecore_optimizers())}")
    return cls


def check_optimizer(task: Task, options: Options | None = None) -> None:
    """Raise ``ValueError`` now, not in a worker, if the optimizer is missing or refuses its options."""
    cls = optimizer_class(task)
    accepted = inspect.signature(cls).parameters
    unknown = [k for k, _ in (task.optimizer_options if options is None else options) if k not in accepted]
    if unknown:
        raise ValueError(f"task {task.name}: pipecore.{task.optimizer} takes no option(s) {unknown}; it takes "
                         f"{', '.join(p for p in accepted)}")


class CosineDecay:
    """The multiplier of a stage's ``u``-th update (``Pipeline(lr_scheduler=...)``, counted from 0): a cosine from
    1 to ``floor`` over the training's mini-batches, read at the mini-batch the update belongs to in the data
    (``u / updates_per_minibatch``), so that every method follows the same schedule in data seen."""

    def __init__(self, minibatches: int, updates_per_minibatch: float, floor: float) -> None:
        self.minibatches, self.updates_per_minibatch, self.floor = minibatches, updates_per_minibatch, floor

    def __call__(self, update: int) -> float:
        done = min(update / self.updates_per_minibatch / self.minibatches, 1.0)
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * done))


def lr_schedule(task: Task, every: int) -> CosineDecay | None:
    """The task's schedule for a method that updates after every ``every`` micro-batches (None: constant)."""
    if task.cosine_to is None:
        return None
    return CosineDecay(task.epochs * steps_per_epoch(task), task.microbatches / every, task.cosine_to)


def make_optimizer(task: Task, lr: float, options: Options) -> Any:
    """The task's pipecore optimizer at ``lr`` (per update) with ``options``."""
    return optimizer_class(task)(lr=lr, **dict(options))


def with_optimizer(task: Task, name: str) -> Task:
    """``task`` with another pipecore optimizer (``--optimizer TASK=NAME``), keeping the options it accepts
    (e.g. AdamW's weight decay for NAdam; SGD's momentum for none of the adaptive ones) and dropping the grid,
    whose points are the old optimizer's."""
    changed = replace(task, optimizer=name, grid=())
    accepted = inspect.signature(optimizer_class(changed)).parameters
    return replace(changed, optimizer_options=tuple((k, v) for k, v in task.optimizer_options if k in accepted))


# -- data, model, batches, metric (cached per worker process) ----------------------------------------------

_DATA: dict[Any, Any] = {}


def _digits() -> Any:
    if "digits" not in _DATA:
        _DATA["digits"] = load_data(SPLIT_SEED)
    return _DATA["digits"]


def _text(task: Task) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The character corpus and its held-out evaluation windows."""
    from pipecore.models import load_char_data

    key = ("text", task.sizes["block_size"], task.sizes["eval_windows"])
    if key not in _DATA:
        data = load_char_data(task.sizes["block_size"])
        x, y = held_out_windows(data.test, task.sizes["block_size"], task.sizes["eval_windows"])
        _DATA[key] = (data, x, y)
    return _DATA[key]


def build_model(task: Task) -> nn.Module:
    """The task's model, initialised from torch's current random state."""
    s = task.sizes
    if task.model == "mlp":
        model = build_mlp(64, s["hidden"], s["depth"], 10)
        if task.init == "he":
            for layer in model:
                if isinstance(layer, nn.Linear):
                    nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
                    nn.init.zeros_(layer.bias)
        return model
    if task.model == "resnet":
        from pipecore.models import ResNet

        return ResNet(in_channels=1, num_classes=10, width=s["width"], blocks=s["blocks"])
    from pipecore.models import GPT

    return GPT(_text(task)[0].vocab_size, s["block_size"], n_layer=s["layers"], n_head=s["heads"], n_embd=s["embd"])


def steps_per_epoch(task: Task) -> int:
    """Mini-batches per epoch (digits: full batches of the training split)."""
    if task.model == "gpt":
        return int(task.steps_per_epoch or 0)
    return len(_digits().y_train) // task.batch_size


def train_batches(task: Task, seed: int, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of ``epoch``, a function of ``(seed, epoch)`` alone (as ``pipecore train`` draws them)."""
    if task.model == "gpt":
        from pipecore.models import batches

        data = _text(task)[0]
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        for _ in range(steps_per_epoch(task)):
            yield batches(data.train, task.sizes["block_size"], task.batch_size, generator)
        return
    d = _digits()
    for idx in epoch_batches(len(d.y_train), task.batch_size, seed, epoch):
        yield d.x_train[idx], d.y_train[idx]


class Diverged(FloatingPointError):
    """The training loss or the test metric became NaN or infinite."""


def test_metrics(task: Task, model: nn.Module) -> dict[str, float]:
    """Test accuracy (digits) or held-out loss and perplexity (gpt) of the live weights."""
    if task.model == "gpt":
        _, x, y = _text(task)
        loss = held_out_loss(model, x, y)
        if not math.isfinite(loss):
            raise Diverged(f"held-out loss {loss}")
        return {"test_loss": loss, "perplexity": math.exp(min(loss, 700.0))}
    d = _digits()
    return {"accuracy": evaluate(model, d.x_test, d.y_test)[0]}


def loss_function(task: Task) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return sequence_loss if task.model == "gpt" else nn.CrossEntropyLoss()
