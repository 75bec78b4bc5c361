"""What an algorithm makes each stage hold, as the simulator measures it (:class:`Sizing`): the per-stage figures
the stage cost model (:mod:`pipecore.planning.memory`) multiplies its byte counts by, and the copies a pipeline
keeps to undo a failed step."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Sequence

from ..algorithms import Algorithm, get_algorithm
from ..simulate import simulate
from .costs import GraphCosts


@dataclass(frozen=True)
class Sizing:
    """What an algorithm makes each stage hold, as measured by the simulator, and which rank holds each stage.

    Attributes:
        algorithm: the algorithm's name.
        num_stages, n_microbatches: the pipeline shape the figures are for.
        versions: weight versions each stage's ring holds (``Trace.weight_versions``).
        derived: whether the stage computes derived weights into a scratch buffer (``Trace.derived_weights``).
        buffers: how many weight-sized buffers the algorithm declares at the stage (``Algorithm.buffer_updates``).
        in_flight: peak micro-batches whose forward ran at the stage and whose backward has not finished
            (``Trace.peak_activations``; under a split backward, until its W): how many activation sets and
            boundary buffers it holds.
        recompute_all: the algorithm's backward rule recomputes every forward in its backward
            (``backward_rule="recompute"``): stages then keep only their inputs, and recomputed segments do
            not apply.
        placement: the rank (device) of every stage, from the algorithm's schedule (``Schedule.placement``):
            ``(0, 1, ..., P-1)`` for one stage per rank; with ``stages_per_rank`` a rank holds several (looped:
            rank ``r`` of ``R`` holds ``r, r+R, ...``; V-shaped: ``r`` and ``2R-1-r``). None (the default when
            constructing one by hand) means one stage per rank.
        undo_states, undo_weights, undo_gradients: per stage, the copies of its optimizer state and declared
            buffers, of its weights and of its gradient buffer that the pipeline keeps to undo a failed step
            (``Pipeline(recover=True)``, the default; :func:`pipecore.engine.undo.undo_copies`). None (the default
            when constructing one by hand) means none: a pipeline with ``recover=False``.
        held: per stage, the ``(pending, waiting)`` counts of micro-batches at which it may peak
            (``Trace.held_activations``): ``pending`` between their forward and their backward (B), ``waiting``
            past their B and waiting for their deferred W (under a split backward), which B has freed of all but
            what the weights' gradients still need. Every pair reached that no other exceeds in both; the
            largest sum is ``in_flight``. None (the default when constructing one by hand) means
            ``((in_flight, 0),)``: every micro-batch in flight held whole.
    """

    algorithm: str
    num_stages: int
    n_microbatches: int
    versions: tuple[int, ...]
    derived: tuple[bool, ...]
    buffers: tuple[int, ...]
    in_flight: tuple[int, ...]
    recompute_all: bool = False
    placement: tuple[int, ...] | None = None
    undo_states: tuple[int, ...] | None = None
    undo_weights: tuple[int, ...] | None = None
    undo_gradients: tuple[int, ...] | None = None
    held: tuple[tuple[tuple[int, int], ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.n_microbatches < 1:
            raise ValueError(f"Sizing needs num_stages >= 1 and n_microbatches >= 1, got {self.num_stages} and "
                             f"{self.n_microbatches}")
        if self.placement is None:
            object.__setattr__(self, "placement", tuple(range(self.num_stages)))
        else:
            object.__setattr__(self, "placement", tuple(int(r) for r in self.placement))
        for name in _UNDO:
            value = getattr(self, name)
            object.__setattr__(self, name, (0,) * self.num_stages if value is None else tuple(int(c) for c in value))
        if self.held is None:
            object.__setattr__(self, "held", tuple(((int(k), 0),) for k in self.in_flight))
        else:
            object.__setattr__(self, "held", tuple(tuple((int(p), int(w)) for p, w in pairs) for pairs in self.held))
        for name in ("versions", "derived", "buffers", "in_flight", "placement", "held", *_UNDO):
            values = getattr(self, name)
            if len(values) != self.num_stages:
                raise ValueError(f"Sizing.{name} has {len(values)} entries for {self.num_stages} stages")
        if any(v < 1 for v in self.versions) or any(k < 0 for k in self.in_flight):
            raise ValueError(f"Sizing needs versions >= 1 and in_flight >= 0, got {self.versions} and {self.in_flight}")
        if any(not pairs or min(min(p, w) for p, w in pairs) < 0 or max(p + w for p, w in pairs) != k
               for pairs, k in zip(self.held, self.in_flight)):
            raise ValueError(f"Sizing.held needs, per stage, pairs of counts >= 0 whose largest sum is in_flight, got "
                             f"{self.held} for in_flight {self.in_flight}")
        if any(c < 0 for name in _UNDO for c in getattr(self, name)):
            raise ValueError(f"Sizing's undo copies must be >= 0, got {[getattr(self, name) for name in _UNDO]}")
        if set(self.placement) != set(range(max(self.placement) + 1)):
            raise ValueError(f"Sizing.placement must give every rank 0..R-1 at least one stage, got {self.placement}")

    @property
    def num_ranks(self) -> int:
        """How many ranks (devices) the stages run on."""
        return max(self.placement) + 1

    @property
    def stages_per_rank(self) -> int:
        """The most stages one rank holds (1: one stage per rank)."""
        return max(self.placement.count(r) for r in range(self.num_ranks))

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` holds, in increasing order."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must lie in 0..{self.num_ranks - 1}, got {rank}")
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    @classmethod
    def of(cls, algorithm: str | Algorithm, num_stages: int | None = None, n_microbatches: int | None = None,
           *, recover: bool = True, ties: Sequence[Sequence[int]] = (), **options: Any) -> "Sizing":
        """Simulate ``algorithm`` (a name with ``num_stages``, ``n_microbatches`` and options, or a configured
        :class:`~pipecore.algorithms.Algorithm`) for as many mini-batches as the runtime does when it sizes
        its weight rings, and read the per-stage figures off the trace.

        ``recover`` is the pipeline's (``Pipeline(recover=...)``, default True): with it, the copies each stage
        keeps to undo a failed step are counted (:func:`pipecore.engine.undo.undo_copies`). ``ties`` lists, per tied
        weight, the stages that hold it (they change when a stage takes its undo copies; see
        :func:`tie_owners`)."""
        if isinstance(algorithm, str):
            if num_stages is None or n_microbatches is None:
                raise ValueError("Sizing.of(name, ...) needs num_stages and n_microbatches")
            algorithm = get_algorithm(algorithm, num_stages, n_microbatches, **options)
        elif options or num_stages not in (None, algorithm.num_stages) or \
                n_microbatches not in (None, algorithm.n_microbatches):
            raise ValueError("pass the shape and options when naming the algorithm, not with a configured Algorithm")
        if not isinstance(recover, bool):
            raise TypeError(f"recover must be True or False, got {recover!r}")
        p = algorithm.num_stages
        trace = simulate(algorithm, p, algorithm.n_microbatches, n_minibatches=algorithm.warmup_minibatches)
        ties = tuple(sorted({tuple(sorted({int(s) for s in owners})) for owners in ties if len(set(owners)) > 1}))
        if any(not 0 <= s < p for owners in ties for s in owners):
            raise ValueError(f"ties name stages outside 0..{p - 1}: {ties}")
        undo = _undo_copies(algorithm, ties) if recover else None
        held = tuple(trace.held_activations(s) for s in range(p))
        return cls(
            algorithm.name, p, algorithm.n_microbatches,
            tuple(trace.weight_versions(s) for s in range(p)),
            tuple(trace.derived_weights(s) for s in range(p)),
            tuple(len(algorithm.buffer_updates(s)) for s in range(p)),
            # Per stage, split backwards included: a stage holds a micro-batch's activations until its W (the
            # largest sum of its held pairs is Trace.peak_activations).
            tuple(max(pending + waiting for pending, waiting in pairs) for pairs in held),
            algorithm.backward_rule == "recompute",
            tuple(trace.schedule.placement),
            *((None,) * 3 if undo is None else (tuple(c.states for c in undo), tuple(c.weights for c in undo),
                                                  tuple(c.gradients for c in undo))),
            held,
        )


_UNDO = ("undo_states", "undo_weights", "undo_gradients")
_UNDO_CACHE: dict[Any, tuple] = {}


def tie_owners(costs: GraphCosts, starts: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Per tied weight of ``costs`` that more than one stage reads, the stages (cut at ``starts``) that hold it."""
    owners = []
    for tied in costs.tied:
        stages = tuple(sorted({bisect.bisect_right(starts, r) for r in tied.readers}))
        if len(stages) > 1:
            owners.append(stages)
    return tuple(owners)


def _undo_copies(algorithm: Algorithm, ties: tuple[tuple[int, ...], ...]) -> tuple:
    """:func:`pipecore.engine.undo.undo_copies`, kept per algorithm and configuration (it trains a stand-in
    pipeline: a tenth of a second that planners and tests would otherwise pay at every call)."""
    from ..engine.undo import undo_copies

    try:
        key = (algorithm.name, algorithm.num_stages, algorithm.n_microbatches,
               tuple(sorted(algorithm.options.items())), ties)
        hash(key)
    except TypeError:  # an unhashable option (a list, say): not kept
        return undo_copies(algorithm, ties)
    if key not in _UNDO_CACHE:
        _UNDO_CACHE[key] = undo_copies(algorithm, ties)
    return _UNDO_CACHE[key]
