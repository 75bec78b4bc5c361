"""What ``pipecore train`` prints and draws: the run's description, the progress bar of an epoch, a line per
epoch, the summary (the test metric, time, the table per stage) and the files written, and the plot of the
curves. With one process per stage, rank 0 alone reports (:class:`Report` ``leader``).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from .profile import option_text, rank_path
from ._args import OPTIMIZERS

if TYPE_CHECKING:  # heavy imports stay inside the functions so that ``pipecore --help`` is fast
    from tqdm import tqdm


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    """Columns separated by two spaces; columns in ``right`` are right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(header)] + [line(r) for r in rows])


def plural(n: int, word: str) -> str:
    """``1 epoch``, ``2 epochs``."""
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


# -- a run's report ---------------------------------------------------------------------------------------


class Report:
    """What a run of ``pipecore train`` prints, on the leader (rank 0, or the only process): the other ranks of
    a run with one process per stage print nothing."""

    def __init__(self, args: argparse.Namespace, task: Any, leader: bool) -> None:
        self.args, self.task, self.leader = args, task, leader

    def say(self, *values: Any, **kwargs: Any) -> None:
        """``print`` on the leader."""
        if self.leader:
            print(*values, **kwargs)

    def setup(self, pipe: Any, name: str, algorithm: Any, notes: Sequence[str], resumed: tuple[int, int] | None,
              history: Sequence[dict[str, float]]) -> None:
        """The data, the model, the pipeline and the notes, then the table's header and the epochs of
        ``history`` (a checkpoint's); ``resumed`` is where a checkpoint left off, ``(epoch, step)``."""
        import torch

        args, task, say = self.args, self.task, self.say
        steps_per_epoch = task.steps_per_epoch
        optimizer = OPTIMIZERS[args.optimizer].format(lr=args.lr)
        say(f"{task.describe_data()}; {name}")
        smallest, largest = args.batch_size // args.microbatches, -(-args.batch_size // args.microbatches)
        sizes = f"{smallest}" if smallest == largest else f"{smallest}-{largest}"  # as torch.tensor_split splits
        say(f"{algorithm.name}: {args.stages} stages, {args.microbatches} micro-batches of "
            f"{sizes} (batch {args.batch_size}, {steps_per_epoch} steps/epoch), "
            f"{optimizer}, seed {args.seed}, {plural(torch.get_num_threads(), 'thread')}")
        for note in notes:
            say(note)
        if resumed is not None:
            epoch, step = resumed
            if step:  # saved where a signal stopped training, part way through the next epoch
                say(f"resumed from {args.resume} in epoch {epoch + 1}, after step {step} of {steps_per_epoch}")
            else:
                say(f"resumed from {args.resume} at epoch {epoch}")
        if pipe.rank is not None:
            replicas = f" x {pipe.data_parallel} replicas" if pipe.data_parallel > 1 else ""
            say(f"one process per rank: {pipe.num_ranks} ranks{replicas} ({torch.distributed.get_backend()}); "
                "rank 0 reports")
        say()
        say(task.header)
        for h in history:
            say(task.line(h, "-"))

    def progress(self, batches: Iterable[Any], epoch: int, skip: int) -> "tqdm":
        """The progress bar over the batches of ``epoch`` (0-based), ``skip`` of them done already: on stderr,
        where it is a terminal (never with --no-progress, nor on the other ranks)."""
        from tqdm import tqdm

        hide_bar = True if self.args.no_progress or not self.leader else None  # None: only on a terminal
        return tqdm(batches, total=self.task.steps_per_epoch, desc=f"epoch {epoch + 1}/{self.args.epochs}",
                    unit="batch", leave=False, disable=hide_bar, file=sys.stderr, dynamic_ncols=True, initial=skip)

    def epoch(self, record: dict[str, float], seconds: float) -> None:
        """The line of an epoch: its mean loss, the test metric and how long it took."""
        if self.leader:
            print(self.task.line(record, f"{seconds:.2f}s"), flush=True)

    def saved(self, epoch: int) -> None:
        """A --save-every checkpoint was saved."""
        self.say(f"saved checkpoint (epoch {epoch}) to {self.args.save}", flush=True)

    def results(self, result: dict[str, float], stats: list[dict[str, Any]], elapsed: float, trained: int,
                start_epoch: int) -> None:
        """The summary at the end: the test metric, the time and the table per stage."""
        args, say = self.args, self.say
        say()
        say(f"{self.task.summary(result)} after {plural(args.epochs, 'epoch')}")
        say(f"time {elapsed:.2f}s for {plural(args.epochs - start_epoch, 'epoch')} "
            f"({self.task.rate(trained, elapsed)})")
        say()
        say("per stage (staleness: versions behind live per weight read; delay: updates between a micro-batch's "
            "F and B; mean/max)")
        say(stage_table(stats))

    def files(self, history: list[dict[str, float]], title: str, profiled: int, trace: str | None) -> None:
        """What was written at the end (on the leader): the checkpoint, the plot (drawn here) and the profile of
        ``profiled`` steps (``trace``: the file, or None with one per rank)."""
        args = self.args
        if not self.leader:
            return
        if args.save or args.plot or args.profile:
            print()
        if args.save:
            print(f"saved checkpoint (epoch {args.epochs}) to {args.save}")
        if args.plot:
            plot_curves(args.plot, history, title)
            metric = "perplexity" if args.model == "gpt" else "accuracy"
            print(f"wrote loss and {metric} curves to {args.plot}")
        if args.profile:
            written = trace if trace is not None else f"{rank_path(args.profile, '<R>')} (one per rank)"
            options = "".join(f" -o {k}={option_text(v)}" for k, v in args.option)
            # A flush ends the pipeline's schedule: the next step starts a new one (micro-batches from 0 again),
            # so the simulation to compare with is the recorded steps of one epoch.
            simulated = min(profiled, self.task.steps_per_epoch)
            print(f"wrote the profile of {plural(profiled, 'training step')} to {written}: open it in "
                  f"chrome://tracing or https://ui.perfetto.dev; `pipecore simulate -a {args.algorithm} -p "
                  f"{args.stages} -m {args.microbatches} -n {simulated}{options} --chrome sim.json` gives the "
                  "simulator's view, with the same action names")
