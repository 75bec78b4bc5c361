"""The vocabulary algorithms are written in: weight-read rules, update rules, and the algorithm spec.

An algorithm is a schedule family + a version policy (which weights each F and each B reads) + an update
rule (how many micro-batches' gradients one update accumulates, and any per-stage learning-rate scale).
The runtime evaluates these objects; it never looks at an algorithm's name.
"""

from __future__ import annotations

import math
import numbers
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any, Callable, Mapping, Sequence

from ..schedule.generators import ScheduleFamily
from ..schedule.ir import B, F
from ..schedule.periodic import PeriodicForm, periodic_form
from ..schedule.schedule import Schedule
from .state import BufferUpdate, GradientTransform, StateBuffer, WeightSource

Options = Mapping[str, Any]

# Frozen dataclasses built once per action (reads, contexts) define their __init__ as one write of the
# instance dictionary, which the dataclass keeps (it never replaces a class's own __init__); equality, hashing,
# repr, replace() and pickling work on the fields as usual (tests/test_simulate_speed.py checks that each
# such __init__ takes and sets exactly the fields, with their defaults).
_set = object.__setattr__


@dataclass(frozen=True)
class WeightRead:
    """The weights one F or B reads.

    ``version`` is the version read, or the version a derived weight is computed from; ``derivation`` names
    how (one of the algorithm's ``derivations``, see :mod:`pipecore.algorithms.state`), with ``other`` and
    ``coef`` as that derivation takes them. The built-in ones: ``"interpolate"`` (I-TiMePReSt),
    ``W[version] + coef*(W[other] - W[version])``; ``"predict"`` (SpecTrain), ``W[version] - coef*lr*v``;
    ``"correct"`` (PipeMare), ``W[version] - coef*delta``.
    """

    version: int
    derivation: str | None = None
    other: int | None = None
    coef: float | None = None

    def __init__(self, version: int, derivation: str | None = None, other: int | None = None,
                 coef: float | None = None):
        # The dataclass's own __init__, in one write instead of one frozen-bypassing setattr per field: every
        # F and B makes a read.
        _set(self, "__dict__", {"version": version, "derivation": derivation, "other": other, "coef": coef})

    def __str__(self) -> str:
        if self.derivation is None:
            return f"v{self.version}"
        if self.derivation == "interpolate":
            return f"v{self.version}~interp(v{self.other},a={self.coef:.3g})"
        if self.derivation == "predict":
            return f"v{self.version}~pred(s={self.coef:g})"
        if self.derivation == "correct":
            return f"v{self.version}~corr(tau={self.coef:g})"
        other = "" if self.other is None else f"v{self.other},"
        coef = "" if self.coef is None else f"{self.coef:g}"
        return f"v{self.version}~{self.derivation}({other}{coef})"


_PLAIN_READS: dict[int, WeightRead] = {}
_PLAIN_READS_KEPT = 64  # the versions in use at once are a few around the live ones


def plain_read(version: int) -> WeightRead:
    """``WeightRead(version)``, one object per version shared by every read of it (reads are immutable): the
    read rules return one per F and B, most of them plain."""
    read = _PLAIN_READS.get(version)
    if read is None:
        if len(_PLAIN_READS) >= _PLAIN_READS_KEPT:  # versions only grow: start again (a bounded table)
            _PLAIN_READS.clear()
        read = _PLAIN_READS[version] = WeightRead(version)
    return read


@dataclass(frozen=True)
class ReadContext:
    """What a read rule may look at when an F or B runs at one stage."""

    stage: int
    num_stages: int
    microbatch: int            # first micro-batch of the action
    n_microbatches: int
    live: int                  # the stage's live version now
    tag: int | None            # version assigned at stage 0 (vertical sync), carried with the data
    forward_version: int | None  # for B: the version this micro-batch's F read at this stage
    base: int = 0              # the stage's live version when the current schedule started (after a flush)

    def __init__(self, stage: int, num_stages: int, microbatch: int, n_microbatches: int, live: int,
                 tag: int | None, forward_version: int | None, base: int = 0):
        # The dataclass's own __init__ in one write (see WeightRead.__init__): one context per F and B.
        _set(self, "__dict__", {"stage": stage, "num_stages": num_stages, "microbatch": microbatch,
                                "n_microbatches": n_microbatches, "live": live, "tag": tag,
                                "forward_version": forward_version, "base": base})


#: ``derive(source, read, base, out)``: the weights ``read`` names, computed from ``base`` (the flat weights of
#: ``read.version``) and whatever else of ``source`` the derivation reads (another version, a declared buffer, the
#: optimizer), written into ``out`` (the stage's scratch buffer) and returned.
#: (``base``, ``out`` and the result are tensors; this module does not import torch.)
Derive = Callable[[WeightSource, WeightRead, Any, Any], Any]


class ReadRule(ABC):
    """Base class of weight-read rules. Subclasses define :meth:`resolve` and may set the flags."""

    #: B rules that need the F's weights kept alive until the B (weight stashing) set this.
    pins_forward_weights: bool = False

    @abstractmethod
    def resolve(self, ctx: ReadContext, options: Options) -> WeightRead:
        """The weights an action reads in context ``ctx``."""

    def oldest_needed(self, stage: int, live: int, latest_tag: int | None) -> int:
        """Lowest version a future read of this rule may still name (older unpinned ones can be freed)."""
        return live


@dataclass(frozen=True)
class Live(ReadRule):
    """The stage's current weights."""

    def resolve(self, ctx: ReadContext, options: Options) -> WeightRead:
        return plain_read(ctx.live)


@dataclass(frozen=True)
class SameAsForward(ReadRule):
    """Weight stashing: the backward reads exactly the version its forward read."""

    pins_forward_weights = True

    def resolve(self, ctx: ReadContext, options: Options) -> WeightRead:
        assert ctx.forward_version is not None, "SameAsForward is a backward rule"
        return plain_read(ctx.forward_version)


@dataclass(frozen=True)
class StageZeroTag(ReadRule):
    """Vertical sync: the version the micro-batch was assigned when it entered stage 0."""

    def resolve(self, ctx: ReadContext, options: Options) -> WeightRead:
        assert ctx.tag is not None
        return plain_read(ctx.tag)

    def oldest_needed(self, stage: int, live: int, latest_tag: int | None) -> int:
        # Stage 0 hands out its live version as the tag. Later stages receive tags in non-decreasing order,
        # so nothing older than the newest tag seen is named again.
        return live if stage == 0 or latest_tag is None else min(live, latest_tag)


@dataclass(frozen=True)
class MinibatchDelay(ReadRule):
    """2BW: micro-batch ``k`` reads version ``max(k // m - delay, 0)`` (counted from the schedule's start)."""

    delay: int = 1

    def resolve(self, ctx: ReadContext, options: Options) -> WeightRead:
        return plain_read(ctx.base + max(ctx.microbatch // ctx.n_microbatches - self.delay, 0))

    def oldest_needed(self, stage: int, live: int, latest_tag: int | None) -> int:
        return max(live - self.delay, 0)


ALPHA_FUNCTIONS: dict[str, Callable[[float, float], float]] = {
    "exp": lambda d, lam: math.exp(-lam * d),
    "inverse": lambda d, lam: 1.0 / (1.0 + lam * d),
    "constant": lambda d, lam: lam if d > 0 else 1.0,
}


def timeprest_version_difference(num_stages: int, n_microbatches: int) -> int:
    """TiMePReSt's version difference ``v = floor((P + N - 2) / N)`` as the paper states it (read
    second-hand). It is not the number of updates between a micro-batch's forward and its backward, which
    the simulator measures (see the algorithm docs); it is offered as I-TiMePReSt's ``degree="timeprest"``."""
    return (num_stages + n_microbatches - 2) // n_microbatches


DEGREES = ("versions", "timeprest")


@dataclass(frozen=True)
class Interpolated(ReadRule):
    """I-TiMePReSt: ``W_live + alpha(d)*(W_stash - W_live)`` when the stashed version is not the live one.

    Options: ``alpha`` (``"exp"``: ``exp(-lambda*d)``, ``"inverse"``: ``1/(1+lambda*d)``, ``"constant"``:
    ``lambda`` for every ``d > 0``; or any callable ``d -> alpha``), ``lam`` (lambda), and ``degree``, the
    degree of staleness ``d``: ``"versions"`` (live minus forward version at the stage) or ``"timeprest"``
    (TiMePReSt's version difference, :func:`timeprest_version_difference`). ``alpha`` must lie in [0, 1]:
    the read lies between the stashed and the live weights.
    """

    pins_forward_weights = True

    def resolve(self, ctx: ReadContext, options: Options) -> WeightRead:
        assert ctx.forward_version is not None
        if ctx.live == ctx.forward_version:
            return plain_read(ctx.live)
        if options["degree"] == "timeprest":
            d = timeprest_version_difference(ctx.num_stages, ctx.n_microbatches)
        else:
            d = ctx.live - ctx.forward_version
        fn = options["alpha"]
        alpha = float(fn(d) if callable(fn) else ALPHA_FUNCTIONS[fn](d, options["lam"]))
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha({d}) = {alpha}: the interpolation weight of the stashed weights must lie in "
                             "[0, 1] (outside it the backward would extrapolate past the stashed or the live weights)")
        # The end points are plain reads, exactly the live or the stashed weights (no rounding, no scratch).
        if alpha == 0.0:
            return plain_read(ctx.live)
        if alpha == 1.0:
            return plain_read(ctx.forward_version)
        return WeightRead(ctx.live, "interpolate", ctx.forward_version, alpha)


@dataclass(frozen=True)
class Predicted(ReadRule):
    """SpecTrain: predict the weights ``s`` updates ahead, ``W - s*lr*v``.

    ``horizon(stage, num_stages)`` gives ``s``; the option ``lookahead`` (a list, one ``s`` per stage)
    overrides it.
    """

    horizon: Callable[[int, int], int]

    def resolve(self, ctx: ReadContext, options: Options) -> WeightRead:
        override = options.get("lookahead")
        s = override[ctx.stage] if override is not None else self.horizon(ctx.stage, ctx.num_stages)
        if s == 0:
            return plain_read(ctx.live)
        return WeightRead(ctx.live, "predict", coef=float(s))


@dataclass(frozen=True)
class Corrected(ReadRule):
    """PipeMare T2: ``W_live - tau*delta`` with ``tau`` = updates since this micro-batch's forward."""

    def resolve(self, ctx: ReadContext, options: Options) -> WeightRead:
        assert ctx.forward_version is not None
        tau = ctx.live - ctx.forward_version
        if tau == 0:
            return plain_read(ctx.live)
        return WeightRead(ctx.live, "correct", coef=float(tau))


BACKWARD_RULES = ("swap", "recompute", "stash")


def _option_type_problem(key: str, value: Any, default: Any) -> str | None:
    """What is wrong with the type of an option value (None if nothing), judged by its default's type.

    Options whose default is None are checked by name; string options and ranges are checked against
    their allowed values elsewhere.
    """
    def is_int(v: Any) -> bool:
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)

    if value is None:
        return None
    if key == "update_every" and not is_int(value):
        return "must be an integer number of micro-batches"
    if key == "slack" and not (is_int(value) and value >= 0):
        return "must be a non-negative integer number of micro-batches"
    if key == "lookahead" and (
        isinstance(value, (str, bytes)) or not isinstance(value, Sequence)
        or not all(is_int(v) and v >= 0 for v in value)
    ):
        return "must be a list of non-negative integer horizons, one per stage"
    if default is None:
        return None
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "must be true or false"
    if is_int(default):
        return None if is_int(value) else f"must be an integer (default {default})"
    if key == "lam":
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and (math.isfinite(value) or value == math.inf):
            return None
        return f"must be a number or inf (default {default})"
    if isinstance(default, float):
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
            return None
        return f"must be a finite number (default {default})"
    return None  # string options are checked against their allowed values


_CONSTRAINT_ANSWERS: dict[tuple[Any, ...], str | None] = {}
_CONSTRAINT_ANSWERS_KEPT = 1024


def _constraint_answer(check: Callable[[int, int, Options], str | None], num_stages: int, n_microbatches: int,
                       options: Options) -> str | None:
    """``check(num_stages, n_microbatches, options)``, kept for hashable options (values keyed with their types,
    so that ``1`` and ``1.0`` or ``True`` are told apart)."""
    key = (check, num_stages, n_microbatches, tuple((k, type(v), v) for k, v in sorted(options.items())))
    try:
        return _CONSTRAINT_ANSWERS[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable option value (a list): asked every time
        return check(num_stages, n_microbatches, options)
    answer = check(num_stages, n_microbatches, options)
    if len(_CONSTRAINT_ANSWERS) >= _CONSTRAINT_ANSWERS_KEPT:
        _CONSTRAINT_ANSWERS.clear()
    _CONSTRAINT_ANSWERS[key] = answer
    return answer


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm, declared. See the modules next to this one for examples.

    ``update_every(n_microbatches, options)`` is the number of micro-batches whose gradients one update
    accumulates. ``defaults`` lists every option the algorithm accepts (anything else is rejected).
    ``constraints`` are ``(num_stages, n_microbatches, options) -> error message or None``, functions of those
    alone (their answers are kept: a check may build a schedule, and simulations configure algorithms often).
    ``lr_scale(stage, update_index, algorithm)`` scales the learning rate per stage (update_index from 0).
    ``buffers`` declares the weight-sized state the algorithm keeps per stage and how each buffer changes after
    an update (PipeMare's velocity, SpecTrain's next-step direction); ``derivations`` says how the derived weights
    its read rules name are computed (see :mod:`pipecore.algorithms.state`).
    ``gradient_transform(stage, algorithm)`` gives the :class:`~pipecore.algorithms.state.GradientTransform` a stage
    applies to each update's gradient before the optimizer's step (None: the stage applies it unchanged), such as
    delay compensation.
    ``schedule_options`` names the options that are passed on to the schedule family as keywords
    (e.g. ``slack`` of the asynchronous 1F1B family).
    """

    name: str
    schedule: ScheduleFamily
    forward: ReadRule
    backward: ReadRule
    summary: str
    update_every: Callable[[int, Options], int] = lambda m, options: m
    defaults: Mapping[str, Any] = field(default_factory=dict)
    constraints: tuple[Callable[[int, int, Options], str | None], ...] = ()
    lr_scale: Callable[[int, int, "Algorithm"], float] | None = None
    buffers: tuple[StateBuffer, ...] = ()
    derivations: Mapping[str, Derive] = field(default_factory=dict)
    gradient_transform: Callable[[int, "Algorithm"], GradientTransform | None] | None = None
    aliases: tuple[str, ...] = ()
    schedule_options: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = [b.name for b in self.buffers]
        if len(set(names)) != len(names):
            raise ValueError(f"algorithm {self.name!r} declares the state buffers {names}: each name once")

    @property
    def option_names(self) -> tuple[str, ...]:
        return tuple(sorted(self.defaults))

    def configure(self, num_stages: int, n_microbatches: int, **options: Any) -> "Algorithm":
        """Check sizes and options against this algorithm and return a configured :class:`Algorithm`."""
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
        unknown = sorted(set(options) - set(self.defaults))
        if "stages_per_rank" in unknown and options["stages_per_rank"] not in (None, 1):
            raise ValueError(f"algorithm '{self.name}' runs one stage per rank; stages_per_rank > 1 is for "
                             "interleaved-1f1b, looped-bfs, zb-h1, zb-v and dualpipe-v")
        if "stages_per_rank" in unknown:  # 1 (or None) is what every algorithm does
            options = {k: v for k, v in options.items() if k != "stages_per_rank"}
            unknown.remove("stages_per_rank")
        if unknown:
            valid = ", ".join(self.option_names) or "none"
            raise ValueError(f"unknown option(s) {unknown} for algorithm '{self.name}'; valid options: {valid}")
        merged = {**self.defaults, **{k: v for k, v in options.items() if v is not None}}
        for key, value in options.items():
            problem = _option_type_problem(key, value, self.defaults[key])
            if problem:
                raise ValueError(f"{self.name}: option {key}={value!r}: {problem}")
        rule = merged.get("backward_rule")
        if rule is not None and rule not in BACKWARD_RULES:
            raise ValueError(f"backward_rule must be one of {BACKWARD_RULES}, got {rule!r}")
        alpha = merged.get("alpha")
        if alpha is not None and not callable(alpha) and alpha not in ALPHA_FUNCTIONS:
            raise ValueError(f"alpha must be one of {sorted(ALPHA_FUNCTIONS)} or a callable, got {alpha!r}")
        lookahead = merged.get("lookahead")
        if lookahead is not None and len(lookahead) != num_stages:
            raise ValueError(f"lookahead needs one horizon per stage ({num_stages}), got {len(lookahead)}")
        for check in self.constraints:
            message = _constraint_answer(check, num_stages, n_microbatches, merged)
            if message:
                raise ValueError(f"{self.name}: {message}")
        every = self.update_every(n_microbatches, merged)
        if every < 1:
            raise ValueError(f"{self.name}: update_every must be >= 1 micro-batch, got {every}")
        return Algorithm(self, num_stages, n_microbatches, merged, every)


@dataclass(frozen=True)
class _Family:
    """Everything an algorithm's schedules depend on, as a hashable value (the key of the caches below).

    Schedule option values are keyed with their types, so that e.g. ``1`` and ``1.0`` (equal, same hash)
    are never taken for one another.
    """

    generator: ScheduleFamily
    num_stages: int
    n_microbatches: int
    keywords: tuple[tuple[str, type, Any], ...]  # (option, type, value) passed on to the generator
    update_every: int

    def generate(self, n_minibatches: int) -> Schedule:
        """The generated schedule for ``n_minibatches``, updates included."""
        keywords = {key: value for key, _, value in self.keywords}
        base = self.generator(self.num_stages, self.n_microbatches, n_minibatches, **keywords)
        return base.with_updates(self.update_every)

    @property
    def shortest_warmup(self) -> int:
        """A lower bound of :func:`_find_warmup`, known without generating anything."""
        return 2 * self.num_stages + 2


# Algorithm objects are cheap and made often (each simulate() by name makes one), while their warm-up and
# periodic form take up to seconds to find at large sizes; both depend only on the _Family, so they are
# cached by it. A form holds about one long schedule (some 20 MB at 16 stages x 64 micro-batches), hence
# the small bound; a warm-up is an int. Forms are immutable, safe to share between algorithms.
_FORM_CACHE_SIZE = 8
_WARMUP_CACHE_SIZE = 256
# Schedules shorter than their warm-up, by their actions (16 stages x 64 micro-batches x 4 mini-batches: 8256
# to 12352 actions, 2 to 3 MB with their positions).
_SCHEDULE_CACHE_ACTIONS = 200_000


@lru_cache(maxsize=_WARMUP_CACHE_SIZE)
def _find_warmup(family: _Family) -> int:
    """See :attr:`Algorithm.warmup_minibatches`."""
    n = family.shortest_warmup
    while True:
        row = family.generate(n).stages[0]
        first_backward = next((i for i, a in enumerate(row) if a.kind is B), len(row))
        lead = sum(1 for a in row[:first_backward] if a.kind is F)
        if lead < n * family.n_microbatches:
            break
        n *= 2  # every forward comes before the first backward: the fill is longer than this schedule
    return family.shortest_warmup + 2 * -(-lead // family.n_microbatches)


@lru_cache(maxsize=_FORM_CACHE_SIZE)
def _find_periodic_form(family: _Family) -> PeriodicForm | None:
    """See :attr:`Algorithm._periodic_form`."""
    return periodic_form(family.generate, family.n_microbatches, family.update_every,
                         warmup=_cached(_find_warmup, family))


class _ScheduleCache:
    """Schedules shorter than their family's warm-up, generated in full (see :meth:`Algorithm.schedule`),
    least recently used first out, holding at most ``actions`` actions in all.

    Simulations and a pipeline's first steps ask for the same few of these again and again, and generating
    one costs about as much as simulating it. A schedule is immutable, so one object can serve every caller;
    it also keeps what is derived from it (positions, validity; see ``Schedule``), so a cached schedule is
    validated and indexed once. Some 200 bytes per action with those.
    """

    def __init__(self, actions: int):
        self.actions = actions
        self._held = 0
        self._entries: OrderedDict[tuple[_Family, int], Schedule] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, family: _Family, n_minibatches: int) -> Schedule:
        key = (family, n_minibatches)
        with self._lock:
            schedule = self._entries.get(key)
            if schedule is not None:
                self._entries.move_to_end(key)
                return schedule
        schedule = family.generate(n_minibatches)
        size = len(schedule)
        if size <= self.actions:
            with self._lock:
                if key not in self._entries:
                    self._entries[key] = schedule
                    self._held += size
                    while self._held > self.actions:
                        _, dropped = self._entries.popitem(last=False)
                        self._held -= len(dropped)
        return schedule

    def __wrapped__(self, family: _Family, n_minibatches: int) -> Schedule:
        return family.generate(n_minibatches)

    def cache_clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._held = 0


_short_schedule = _ScheduleCache(_SCHEDULE_CACHE_ACTIONS)


def _cached(function: Callable[..., Any], family: _Family, *args: Any) -> Any:
    """``function(family, *args)`` through its cache, or uncached when a schedule option's value is
    unhashable."""
    try:
        hash(family)
    except TypeError:
        return function.__wrapped__(family, *args)  # type: ignore[attr-defined]
    return function(family, *args)


@dataclass(frozen=True)
class Algorithm:
    """An algorithm configured for a pipeline shape: what the runtime consumes."""

    spec: AlgorithmSpec
    num_stages: int
    n_microbatches: int
    options: Mapping[str, Any]
    update_every: int

    @property
    def name(self) -> str:
        return self.spec.name

    def schedule(self, n_minibatches: int) -> Schedule:
        """The full per-stage action list for ``n_minibatches`` mini-batches, updates included.

        Past a few mini-batches the rows are periodic (:mod:`pipecore.schedule.periodic`): built in
        constant time and memory, however many mini-batches, with the same actions as the generated list.
        """
        # The form's bases are all at least warmup_minibatches long, so it has nothing shorter: generate
        # such schedules directly rather than find the form (which generates four longer schedules).
        family = self._family
        if n_minibatches >= family.shortest_warmup and n_minibatches >= self.warmup_minibatches:
            form = self._periodic_form
            if form is not None:
                periodic = form.schedule(n_minibatches)
                if periodic is not None:
                    return periodic
            return family.generate(n_minibatches)
        # Shorter than the warm-up: generated in full, and kept (see _short_schedule).
        return _cached(_short_schedule, family, n_minibatches)

    def _generate(self, n_minibatches: int) -> Schedule:
        return self._family.generate(n_minibatches)

    @cached_property
    def _family(self) -> _Family:
        keywords = tuple((key, type(self.options[key]), self.options[key]) for key in self.spec.schedule_options)
        return _Family(self.spec.schedule, self.num_stages, self.n_microbatches, keywords, self.update_every)

    @cached_property
    def _periodic_form(self) -> PeriodicForm | None:
        # None for a family whose steady state does not repeat; its schedules are then generated in full.
        return _cached(_find_periodic_form, self._family)

    @cached_property
    def warmup_minibatches(self) -> int:
        """Mini-batches after which every stage's schedule is in its steady state: enough to find the
        periodic rows, and to simulate the most weight versions a stage ever holds (ring sizing).

        Read off the schedule rather than the options: the fill is as long as the forwards stage 0 runs
        before its first backward (a schedule option such as ``slack`` lengthens it), and the steady
        state needs twice that many micro-batches behind it.
        """
        return _cached(_find_warmup, self._family)

    def forward_read(self, ctx: ReadContext) -> WeightRead:
        return self.spec.forward.resolve(ctx, self.options)

    def backward_read(self, ctx: ReadContext, forward_read: WeightRead) -> WeightRead:
        """The weights a backward uses. Under the ``stash`` rule that is whatever its forward read."""
        if self.backward_rule == "stash":
            return forward_read
        return self.spec.backward.resolve(ctx, self.options)

    @cached_property
    def oldest_needed_is_live(self) -> bool:
        """Whether :meth:`oldest_needed` is always the live version (neither read rule names older unpinned
        versions), so that a version book need not ask it after every action."""
        return type(self).oldest_needed is Algorithm.oldest_needed and all(
            type(rule).oldest_needed is ReadRule.oldest_needed for rule in (self.spec.forward, self.spec.backward))

    def oldest_needed(self, stage: int, live: int, latest_tag: int | None) -> int:
        """Lowest version a future read at ``stage`` may name; older versions are kept only while pinned."""
        return min(
            self.spec.forward.oldest_needed(stage, live, latest_tag),
            self.spec.backward.oldest_needed(stage, live, latest_tag),
        )

    @property
    def backward_rule(self) -> str:
        """How a backward reads weights other than its forward's: ``swap``, ``recompute`` or ``stash``."""
        return self.options.get("backward_rule", "stash")

    @property
    def pins_forward_weights(self) -> bool:
        """Whether each forward's weights must stay alive until its backward."""
        return self.spec.backward.pins_forward_weights or self.backward_rule == "stash"

    def buffer_updates(self, stage: int) -> dict[str, BufferUpdate]:
        """The declared buffers ``stage`` keeps, by name, with how each changes after an update."""
        kept = {}
        for declared in self.spec.buffers:
            update = declared.update(stage, self)
            if update is not None:
                kept[declared.name] = update
        return kept

    def gradient_transform(self, stage: int) -> GradientTransform | None:
        """What ``stage`` does to each update's gradient before the optimizer's step (None: nothing)."""
        declared = self.spec.gradient_transform
        return None if declared is None else declared(stage, self)

    def buffer_label(self, name: str) -> str:
        """How messages name declared buffer ``name``."""
        return next((b.label for b in self.spec.buffers if b.name == name), repr(name))

    def derivation(self, name: str) -> Derive:
        """How the derived weights named ``name`` are computed."""
        derive = self.spec.derivations.get(name)
        if derive is None:
            known = ", ".join(self.spec.derivations) or "none"
            raise ValueError(f"algorithm {self.name!r} reads weights derived by {name!r}, which it does not declare "
                             f"(its derivations: {known})")
        return derive

    def lr_scale(self, stage: int, update_index: int) -> float:
        if self.spec.lr_scale is None:
            return 1.0
        return self.spec.lr_scale(stage, update_index, self)
