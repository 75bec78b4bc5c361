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

This module holds the command's flags, its handling of SIGINT and SIGTERM (:class:`Interrupts`) and the
training loop; the models, their data and evaluation are :mod:`pipecore.cli.tasks`, what it prints and plots
:mod:`pipecore.cli.report`, and its checkpoint files :mod:`pipecore.cli.checkpoints`.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ._args import OPTIMIZERS, ConfigurationError, algorithm_option, positive_int
from .checkpoints import check_resume, read_checkpoint, resume_command, run_settings, write_checkpoint
from .profile import DEFAULT_PROFILE_STEPS, Profile, check_profile_args, rank_path
from .report import Report
from .tasks import (DEFAULT_LR, MODELS, WARMUP_EPOCHS, add_model_arguments, resolve_defaults,
                    stages_per_rank, task_for)

if TYPE_CHECKING:  # heavy imports stay inside run() so that ``pipecore --help`` is fast
    import torch

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
                        help=f"learning rate (default {DEFAULT_LR['sgd']} for sgd, {DEFAULT_LR['adamw']} for adamw "
                             f"and nadam, "
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
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS),
                        help="sgd (momentum 0.9), adamw or nadam (torch.optim.NAdam's defaults; default sgd for mlp "
                             "and resnet, adamw for gpt)")
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


# -- setup -----------------------------------------------------------------------------------------------


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


def _optimizer(name: str, lr: float) -> Any:
    import pipecore

    if name == "sgd":
        return pipecore.SGD(lr=lr, momentum=0.9)
    return pipecore.NAdam(lr=lr) if name == "nadam" else pipecore.AdamW(lr=lr)


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


def _check_flags(args: argparse.Namespace) -> tuple[dict[str, Any], int, int, "torch.device", Any, Any]:
    """Fill in the defaults and check the flags against each other and the launch, before anything is loaded
    or joined: ``(algorithm options, processes, replicas, device, task, algorithm)``. Raises ``ValueError``
    for bad input; what it checks is the same on every rank of a torchrun launch."""
    import pipecore

    resolve_defaults(args)
    if args.save_every is not None and not args.save:
        raise ValueError(f"--save-every {args.save_every} needs --save PATH (where to save the checkpoint)")
    check_profile_args(args)  # fail before loading data and training, not after
    if args.batch_size < args.microbatches:
        raise ValueError(
            f"--batch-size {args.batch_size} is smaller than --microbatches {args.microbatches}: every micro-batch "
            f"needs at least one sample; use a batch of at least {args.microbatches}"
        )
    options = dict(args.option)
    per_rank = stages_per_rank(args)
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

    task = task_for(args)

    # Validates the name, sizes and options (ValueError -> one-line error) before any training.
    algorithm = pipecore.get_algorithm(args.algorithm, args.stages, args.microbatches, **options)
    return options, processes, replicas, device, task, algorithm


def _train(args: argparse.Namespace, interrupts: Interrupts | None = None, given: dict[str, Any] | None = None) -> int:
    import torch

    import pipecore

    try:
        options, processes, replicas, device, task, algorithm = _check_flags(args)
    except ValueError as error:
        # Every rank of a torchrun launch finds these alike: rank 0 alone reports them (pipecore.cli.main).
        raise ConfigurationError(str(error)) from None
    steps_per_epoch = task.steps_per_epoch
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

    settings = run_settings(args)
    ckpt = read_checkpoint(args.resume) if args.resume else None
    start_epoch, history = 0, []
    if ckpt is not None:
        start_epoch = int(ckpt["epoch"])
        notes += check_resume(settings, ckpt["args"], args.epochs, start_epoch)
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
        if "larger than the number of modules" in str(error):  # the same model on every rank
            raise ConfigurationError(_too_many_stages(args, str(error))) from None
        raise
    try:
        with pipe:  # closes it at the end: with one process per stage, that releases its process groups
            return _run_pipeline(args, pipe, task, name, algorithm, settings, ckpt, start_epoch, history, notes,
                                 interrupts or Interrupts(), given or {})
    finally:
        if joined_here and _process_group_initialized():
            torch.distributed.destroy_process_group()  # under torchrun the pipeline joined it; leave it too


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


def _process_group_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _run_pipeline(args: argparse.Namespace, pipe: Any, task: Any, name: str, algorithm: Any,
                  settings: dict[str, Any], ckpt: dict[str, Any] | None, start_epoch: int,
                  history: list[dict[str, float]], notes: list[str], interrupts: Interrupts,
                  given: dict[str, Any]) -> int:
    import warnings

    import pipecore
    from ..engine.state_io import CheckpointNote

    # With one process per stage (under torchrun) every rank trains its stage and takes part in the evaluation
    # (pipe.predict); rank 0 alone prints and writes.
    leader = pipe.process_rank in (None, 0)
    report = Report(args, task, leader)
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

    report.setup(pipe, name, algorithm, notes, None if ckpt is None else (start_epoch, start_step), history)

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
            bar = report.progress(task.batches(epoch), epoch, skip)
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
            report.epoch(record, time.perf_counter() - t0)
            if args.save_every and (epoch + 1) % args.save_every == 0 and epoch + 1 < args.epochs:
                save(epoch + 1)
                report.saved(epoch + 1)
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
    report.results(result, stats, elapsed, trained, start_epoch)
    if not leader:
        return 0
    report.files(history, f"pipecore train: {algorithm.name}, {args.stages} stages, {name}", profile.recorded,
                 trace_path if pipe.rank is None else None)
    if interrupts.received is not None:  # a signal after the last step: the run completed, saved and reported
        return exit_code(interrupts.received)
    return 0
