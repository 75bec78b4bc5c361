"""Capture at the first step: a pipeline built without ``example_input`` for a model that only ``torch.export``
can capture.

``torch.fx`` captures a forward without running it; ``torch.export`` runs it (on fake tensors) and so needs an
input, which a Hugging Face model built without ``example_input`` has first at :meth:`Pipeline.step` (or
:meth:`Pipeline.predict`). Until then the pipeline holds its :class:`~.parts.Settings` and a :class:`Lazy`:
the first call with an input captures the model from that mini-batch's first micro-batch exactly as
``example_input`` would have at construction (export runs on fake tensors, the check of the values crossing
the cuts puts back the buffers it updates, and the random state is put back: no parameter, buffer, mode, hook
or random number changes), builds the stages (:func:`~.build.assemble`) and applies what was asked of the
pipeline meanwhile (``load_state_dict``, ``set_lr``), in order. It all happens on the calling thread, before
any stage thread exists. What needs the graph before then (``stats()``, ``state_dict()``, ``pipe.stages``)
raises :class:`NotCaptured`, which says what to do; ``print(pipe)`` says the capture is still to come.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .build import assemble
from .graph import CapturedModel, NeedsExample
from .inputs import split_batch, to_device
from .parts import Parts, Settings
from .recovery import Recovery
from .stepping import Steps

#: Pipeline attributes that exist once the model is captured (set by ``Pipeline._adopt``).
GRAPH_ATTRIBUTES = frozenset({"captured", "stage_graphs", "stage_layers", "devices", "stages", "ties"})


class NotCaptured(RuntimeError):
    """Something was asked of a pipeline that captures its model at the first step, before that step."""


class Lazy:
    """A pipeline's model waiting to be captured from the first input it is given (see the module docstring)."""

    def __init__(self, settings: Settings, needs: NeedsExample):
        self.settings = settings
        #: Why the model needs an input to be captured, in a few words (``torch.fx cannot capture ...``).
        self.reason = needs.reason
        #: Whether the model is captured (the pipeline then has its parts; ``held`` may still wait).
        self.captured = False
        #: Calls made before the capture, applied after it in order (each taken off once it succeeded).
        self.held: list[tuple[str, Callable[[], None]]] = []

    def needs(self, what: str) -> NotCaptured:
        """The error for ``what``, asked before the capture: one line that says when the capture happens and
        how to have it earlier."""
        return NotCaptured(
            f"{what} needs the captured model, which this pipeline captures at its first step() ({self.reason}: "
            "torch.export captures it from an input): call step() first, or pass example_input=... (a mini-batch as "
            "step() takes it) to Pipeline(...) to capture it at construction")

    def hold(self, what: str, call: Callable[[], None]) -> None:
        """Apply ``call`` once the model is captured. A ``load_state_dict`` replaces everything held before it
        (a state sets the weights, the optimizer and the learning rate)."""
        if what == "load_state_dict":
            self.held.clear()
        self.held.append((what, call))

    def ready(self, what: str, x: Any, adopt: Callable[[Parts], None]) -> None:
        """Capture the model from ``x`` (the model's inputs as ``step()`` takes them) and hand the parts to
        ``adopt`` unless done, then apply the held calls; raises :class:`NotCaptured` if ``x`` is None before
        the capture. A held call that raises stays held, so the next step tries it again rather than training
        without it."""
        if not self.captured:
            if x is None:
                raise self.needs(what)
            adopt(self._assemble(x))
            self.captured = True
        while self.held:
            self.held[0][1]()
            self.held.pop(0)

    def _assemble(self, x: Any) -> Parts:
        s = self.settings
        example = first_microbatch(x, s.n_microbatches)
        # Where the model is (a CPU batch for a model on a GPU: the stages move it there, the capture must too).
        first = next(s.module.parameters(), None)
        example = example if first is None else to_device(example, first.device)
        # As at construction: with gradients (predict() may be called under no_grad), and no random number of
        # the caller's drawn (the check of the boundaries runs the graph once; dropout would draw).
        cuda = sorted({t.device.index or 0 for t in _tensors(example, s.module) if t.device.type == "cuda"})
        with torch.enable_grad(), torch.random.fork_rng(devices=cuda):
            captured = CapturedModel(s.module, s.leaf_modules, example, s.capture)
            return assemble(s, captured, example)

    def describe(self) -> str:
        """What ``print(pipe)`` says before the capture."""
        s = self.settings
        return (f"Pipeline: {type(s.module).__name__} as {s.num_stages} stages, {s.algorithm.name}, "
                f"{s.n_microbatches} micro-batches; not captured yet\n"
                f"  {self.reason}: captured with torch.export from the first micro-batch of the first step() (or "
                "predict()); stages, modules and boundary values need it (or pass example_input=... to capture at "
                "construction)")


def first_microbatch(x: Any, n_microbatches: int) -> Any:
    """The first micro-batch of ``x`` as ``step()`` or ``predict()`` would split it, in ``x``'s structure (a
    tensor, or a tuple or dict whose tensors are split and whose other values, options such as
    ``use_cache=False``, are kept). Fewer samples than micro-batches give one sample, as ``predict()`` takes them
    (a step says that such a batch is too small after the capture, as with ``example_input``)."""
    if isinstance(x, torch.Tensor):
        return split_batch(x, n_microbatches, "x", uneven=True).chunks[0][0]
    if isinstance(x, dict):
        keys = [k for k, v in x.items() if isinstance(v, torch.Tensor)]
        chunk = split_batch([x[k] for k in keys], n_microbatches, "x", uneven=True).chunks[0] if keys else ()
        return {**x, **dict(zip(keys, chunk))}
    if isinstance(x, (tuple, list)):
        where = [i for i, v in enumerate(x) if isinstance(v, torch.Tensor)]
        chunk = split_batch([x[i] for i in where], n_microbatches, "x", uneven=True).chunks[0] if where else ()
        out = list(x)
        for i, t in zip(where, chunk):
            out[i] = t
        return type(x)(out)
    return x  # the capture says what it takes


def _tensors(example: Any, module: torch.nn.Module) -> list[torch.Tensor]:
    values = list(example.values()) if isinstance(example, dict) else list(example) \
        if isinstance(example, (tuple, list)) else [example]
    return [v for v in values if isinstance(v, torch.Tensor)] + list(module.parameters())


class Assembly:
    """What :class:`~pipecore.Pipeline` is made of, and when: its settings as attributes (``placement``,
    ``rank``, ...) at construction, and its stages (``captured``, ``stages``, ``devices``, ...; the parts, the
    steps and the recovery they need) at construction too, or at the first step for a model captured then.
    The pipeline's methods ask :meth:`_ready` for the stages, or :meth:`_hold` a call until they exist."""

    _lazy: Lazy | None

    def _assemble(self, settings: Settings, captured: CapturedModel | NeedsExample, example_input: Any) -> None:
        s = self._settings = settings
        self.model, self.num_stages, self.n_microbatches = s.model, s.num_stages, s.n_microbatches
        self.algorithm, self.on_nonfinite, self.lr_scheduler = s.algorithm, s.on_nonfinite, s.lr_scheduler
        #: The rank (worker thread, or process) of every stage: several stages share one with ``stages_per_rank``.
        self.placement, self.num_ranks = s.placement, s.num_ranks
        #: Where this process is among the pipeline's replicas and ranks (None: everything in this process).
        self.topology = s.topology
        #: This process's pipeline rank (None: one process runs every stage); with ``data_parallel``, within its
        #: replica (``replica``).
        self.rank = s.rank
        self.data_parallel, self.replica, self.recover = s.data_parallel, s.replica, s.recover
        self.concurrent, self.autocast, self.clip_grad_norm = s.concurrent, s.autocast, s.clip_grad_norm
        self.threads_per_stage, self.overlap_steps = s.threads_per_stage, s.overlap_steps
        self._lazy = Lazy(settings, captured) if isinstance(captured, NeedsExample) else None
        if isinstance(captured, CapturedModel):
            self._adopt(assemble(settings, captured, example_input))

    def _adopt(self, parts: Parts) -> None:
        """Take the stages built from the captured graph."""
        self.captured, self.stage_graphs, self.stage_layers = parts.captured, parts.stage_graphs, parts.stage_layers
        self.devices, self.stages, self.ties, self._parts = parts.devices, parts.stages, parts.ties, parts
        self._steps = Steps(parts)
        self._recovery = Recovery(parts, self._steps)

    def _built(self) -> bool:
        """Whether the stages exist (before a first step that captures the model, they do not)."""
        return "_parts" in self.__dict__

    def _ready(self, what: str, x: Any = None) -> None:
        """Capture the model from ``x`` (a first input) if it waits for one, then apply the calls held until
        then; :class:`NotCaptured` for ``what`` if it waits and ``x`` is None."""
        if self._lazy is not None:
            self._lazy.ready(what, x, self._adopt)
            self._lazy = None

    def _hold(self, what: str, call: Callable[[], None]) -> bool:
        """Before the model is captured (or while calls held until then wait), hold ``call`` for after it and
        return True; else return False (the caller calls it now)."""
        if self._lazy is None:
            return False
        self._lazy.hold(what, call)
        return True

    def _waiting(self) -> Lazy:
        assert self._lazy is not None
        return self._lazy

    def __getattr__(self, name: str) -> Any:
        # Reached only for attributes not set: before the capture, those that come from the graph.
        lazy = self.__dict__.get("_lazy")
        if lazy is not None and not lazy.captured and name in GRAPH_ATTRIBUTES:
            raise AttributeError(str(lazy.needs(f"Pipeline.{name}")))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
