"""The user-facing :class:`Pipeline`: a model split into stages, trained by one algorithm."""

from __future__ import annotations

import statistics
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..algorithms import get_algorithm
from ..runtime.executor import Costs, Event, Executor
from ..schedule.ir import B
from ..schedule.validate import validate
from ..simulate import simulate
from .flat import FlatLayout
from .optim import SGD, build_optimizer
from .partition import as_layers, split_points
from .stage import TensorStage

_NONFINITE = ("raise", "skip")


class Pipeline:
    """Train ``model`` as ``num_stages`` pipeline stages with a staleness-aware algorithm.

    Args:
        model: an ``nn.Sequential`` or a list of modules; stages are contiguous slices.
        num_stages: number of stages ``P``.
        algorithm: one of :func:`pipecore.algorithm_names` (or an alias such as ``"pipedream-flush"``).
        n_microbatches: micro-batches per mini-batch ``m``; ``step()`` needs a batch divisible by it.
        optimizer: ``pipecore.SGD(...)``, ``pipecore.AdamW(...)`` (fused), or a torch optimizer factory.
        loss_fn: ``loss_fn(output, target)`` returning the mean loss of a micro-batch.
        partition: None (balanced by parameter count) or the first layer index of stages ``1..P-1``.
        on_nonfinite: ``"raise"`` (default) or ``"skip"`` (drop the update a NaN/inf loss belongs to).
        **options: algorithm options (``backward_rule``, ``update_every``, ``lam``, ``alpha``, ...).

    Each micro-batch loss is divided by the number of micro-batches one update accumulates (``m`` for the
    synchronous algorithms), so the accumulated gradient is the mean over the mini-batch, as in plain
    training with ``loss.mean()``.
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        num_stages: int,
        algorithm: str = "1f1b",
        n_microbatches: int = 4,
        optimizer: Any = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        partition: Sequence[int] | None = None,
        on_nonfinite: str = "raise",
        **options: Any,
    ):
        if on_nonfinite not in _NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {_NONFINITE}, got {on_nonfinite!r}")
        if loss_fn is None:
            raise ValueError("loss_fn is required, e.g. torch.nn.CrossEntropyLoss()")
        self.algorithm = get_algorithm(algorithm, num_stages, n_microbatches, **options)
        self.model = model
        layers = as_layers(model)
        points = split_points(layers, num_stages, partition)
        bounds = list(zip([0] + points, points + [len(layers)]))
        self.stage_modules = [nn.Sequential(OrderedDict(layers[a:b])) for a, b in bounds]
        self.stage_layers = [[name for name, _ in layers[a:b]] for a, b in bounds]
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        optimizer = optimizer if optimizer is not None else SGD(lr=0.01)
        self._optimizer_spec = optimizer
        # The ring of each stage holds exactly the versions the algorithm needs; the simulator says how many.
        sizing = simulate(self.algorithm, num_stages, n_microbatches, n_minibatches=2 * num_stages + 2)
        self._targets: dict[int, torch.Tensor] = {}
        self._inputs: dict[int, torch.Tensor] = {}
        self.stages: list[TensorStage] = []
        for s, module in enumerate(self.stage_modules):
            layout = FlatLayout.of(module, s)
            device = next((p.device for p in module.parameters()), torch.device("cpu"))
            self.stages.append(TensorStage(
                self.algorithm, s, module, build_optimizer(optimizer, layout, device),
                sizing.weight_versions(s), sizing.derived_weights(s), loss_fn,
                self._targets.pop, on_nonfinite,
            ))
        self._staleness = [_Tally() for _ in self.stages]
        self._delays = [_Tally() for _ in self.stages]
        self._restart()

    # -- running ---------------------------------------------------------------------------------

    def _restart(self) -> None:
        """Begin a fresh schedule (at construction and after every flush)."""
        for st in self.stages:
            st.restart()
        self._fed = 0  # mini-batches given since the schedule started
        self._horizon = 2
        schedule = validate(self.algorithm.schedule(self._horizon))
        self._executor = Executor(
            schedule, self.stages, Costs.uniform(len(self.stages)), source=self._inputs.pop,
            keep_events=False, on_event=self._observe,
        )

    def _observe(self, event: Event) -> None:
        rec, s = event.record, event.action.stage
        for read in rec.reads.values():
            self._staleness[s].add(rec.live - read.version)
        if event.action.kind is B:
            for r in rec.forward_reads.values():
                self._delays[s].add(rec.live - r.version)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Train on one mini-batch; returns its mean loss (the mean of its micro-batch losses).

        Asynchronous algorithms leave later micro-batches' backwards in flight; :meth:`flush` drains them.
        """
        m = self.n_microbatches
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise TypeError("step(x, y) takes tensors (input batch, target batch)")
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"input batch has {x.shape[0]} samples but target batch has {y.shape[0]}")
        if x.shape[0] % m:
            raise ValueError(
                f"batch of {x.shape[0]} samples is not divisible by n_microbatches={m}; pipecore does not re-chunk "
                f"silently: use a batch size that is a multiple of {m} (e.g. drop_last=True in the DataLoader)"
            )
        size = x.shape[0] // m
        first = self._fed * m
        for u, (xs, ys) in enumerate(zip(x.split(size), y.split(size))):
            self._inputs[first + u] = xs
            self._targets[first + u] = ys
        self._fed += 1
        if self._fed + 1 > self._horizon:
            # Regenerate further ahead, doubling, so regeneration costs stay linear in the number of steps.
            self._horizon = max(2 * self._horizon, self._fed + 1)
            self._executor.extend(self.algorithm.schedule(self._horizon))
        self._executor.run(available=self._fed * m)
        last = self.stages[-1]
        try:
            losses = [last.losses.pop(first + u) for u in range(m)]
        except KeyError:  # pragma: no cover - guarded by the schedule families' structure
            raise RuntimeError("the schedule did not run every forward of the mini-batch; this is a bug") from None
        return statistics.fmean(losses)

    def flush(self) -> None:
        """Run every in-flight backward and update; afterwards no micro-batch is in flight."""
        if self._fed == 0:
            return
        self._executor.extend(self.algorithm.schedule(self._fed))
        self._executor.run()
        self._restart()

    @property
    def in_flight(self) -> int:
        """Micro-batches whose backward has not run yet, summed over stages."""
        return sum(st.book.in_flight() for st in self.stages)

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The model's ``state_dict`` keys (live weights, buffers) plus ``"pipecore"`` (versions, optimizer)."""
        if self.in_flight:
            raise RuntimeError(
                f"{self.in_flight} micro-batch backwards are in flight; call flush() before state_dict() so the "
                "checkpoint holds one consistent version per stage"
            )
        state: dict[str, Any] = OrderedDict()
        for st in self.stages:
            params = st.live_parameters()
            for key, value in st.module.state_dict().items():
                state[key] = params[key].clone() if key in params else value.detach().clone()
        state["pipecore"] = {
            "algorithm": self.algorithm.name,
            "num_stages": len(self.stages),
            "n_microbatches": self.n_microbatches,
            "stages": [
                {
                    "version": st.book.live,
                    "updates": st.book.updates,
                    "optimizer": _clone(st.optimizer.state_dict()),
                    "velocity": None if st.velocity is None else st.velocity.clone(),
                }
                for st in self.stages
            ],
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`. Keys must match exactly; in-flight work must be flushed first."""
        expected = {k for st in self.stages for k in st.module.state_dict()} | {"pipecore"}
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or extra:
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {extra}")
        meta = state["pipecore"]
        mine = (self.algorithm.name, len(self.stages), self.n_microbatches)
        theirs = (meta["algorithm"], meta["num_stages"], meta["n_microbatches"])
        if mine != theirs:
            raise ValueError(f"checkpoint is for (algorithm, stages, micro-batches) {theirs}, this pipeline is {mine}")
        if self.in_flight:
            raise RuntimeError("call flush() before load_state_dict()")
        for st, sm in zip(self.stages, meta["stages"]):
            names = st.layout.names
            st.load({n: state[n] for n in names}, sm["version"], sm["updates"], sm["optimizer"], sm["velocity"])
            buffers = {k: v for k, v in state.items() if k in dict(st.module.named_buffers())}
            for name, buf in st.module.named_buffers():
                buf.copy_(buffers[name])
        self._restart()

    # -- introspection ---------------------------------------------------------------------------

    def stats(self) -> list[dict[str, Any]]:
        """Per stage: layers, versions held, bytes of weight versions, staleness seen, time per action."""
        out = []
        for s, st in enumerate(self.stages):
            stale, delay = self._staleness[s], self._delays[s]
            itemsize = st.grad.element_size()
            out.append({
                "stage": s,
                "layers": self.stage_layers[s],
                "parameters": st.layout.numel,
                "weight_versions": st.ring.num_slots,
                "versions_held": len(st.book.held),
                "weight_version_bytes": st.ring.num_slots * st.layout.numel * itemsize,
                "scratch_bytes": 0 if st.scratch is None else st.scratch.numel() * itemsize,
                "live_version": st.book.live,
                "staleness_mean": stale.mean,
                "staleness_max": stale.max,
                "delay_mean": delay.mean,
                "delay_max": delay.max,
                "seconds_per_action": {k: st.seconds[k] / st.counts[k] for k in st.counts},
            })
        return out


class _Tally:
    """Running count, mean and maximum of integer observations."""

    __slots__ = ("count", "total", "max")

    def __init__(self) -> None:
        self.count, self.total, self.max = 0, 0, 0

    def add(self, value: int) -> None:
        self.count += 1
        self.total += value
        self.max = max(self.max, value)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


def _clone(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
