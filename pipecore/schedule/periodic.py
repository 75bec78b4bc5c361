"""Long schedules in constant memory: the steady state of a schedule family repeats, shifted.

An asynchronous pipeline keeps one schedule from one flush to the next, so after ``n`` steps its action
lists hold ``O(n)`` actions, and regenerating them costs ``O(n)``. The families repeat instead: after a
warm-up, adding ``p`` mini-batches to a schedule inserts one more copy of a fixed block of actions, with
micro-batch indices shifted by ``p*m`` and update versions by ``p*m/update_every``. Stage ``s``'s list
for ``b + t*p`` mini-batches is then::

    head + body + shift(body, 1) + ... + shift(body, t) + shift(tail, t)

where ``head + body + tail`` is the list for ``b`` mini-batches. :class:`PeriodicRow` is such a list as an
immutable sequence: indexing and position lookups are arithmetic, and nothing grows with ``t``.

:func:`periodic_form` finds ``head``, ``body`` and ``tail`` by comparing the generated schedules for
``b``, ``b+p``, ``b+2p`` and ``b+3p`` mini-batches, and accepts them only if the formula reproduces all
four; a family that does not repeat this way gets ``None`` and is generated in full.
"""

from __future__ import annotations

from copy import copy as shallow_copy
from dataclasses import dataclass
from math import gcd
from types import MappingProxyType
from typing import Callable, Iterator, Mapping, Sequence, overload

from .ir import Action, Kind, U
from .schedule import ImmutableRow, Schedule

_Key = tuple[Kind, int]
_new_action = object.__new__
_set_field = object.__setattr__  # what Action's frozen dataclass __init__ calls for each field
_BLOCKS_KEPT = 8  # shifted copies of the body a row keeps (see PeriodicRow.__getitem__): a step's worth, not a run's


@dataclass(frozen=True)
class Shift:
    """How one period moves actions: micro-batch indices by ``microbatches``, update versions by ``updates``."""

    microbatches: int
    updates: int

    def apply(self, action: Action, times: int) -> Action:
        if times == 0:
            return action
        step = self.updates if action.kind is U else self.microbatches
        return Action(action.stage, action.kind, action.index + times * step, action.count)

    def apply_all(self, actions: Sequence[Action], times: int) -> tuple[Action, ...]:
        """:meth:`apply` to each of ``actions``: a shifted copy of a period, built once per period of a run.
        A valid action moved forward is valid, so each copy is made without ``Action``'s checks (its frozen
        dataclass ``__init__`` and ``__post_init__``, most of the cost)."""
        if times == 0:
            return tuple(actions)
        moved, updates = times * self.microbatches, times * self.updates
        out = []
        for a in actions:
            b = _new_action(Action)
            _set_field(b, "stage", a.stage)
            _set_field(b, "kind", a.kind)
            _set_field(b, "index", a.index + (updates if a.kind is U else moved))
            _set_field(b, "count", a.count)
            out.append(b)
        return tuple(out)


def microbatch_positions(row: Sequence[Action]) -> dict[_Key, int]:
    """(kind, micro-batch) -> position, for every micro-batch an action covers (updates cover none)."""
    table: dict[_Key, int] = {}
    for i, a in enumerate(row):  # a.microbatches, unrolled: this indexes every action of a schedule
        kind = a.kind
        if kind is U:
            continue
        if a.count == 1:
            table[(kind, a.index)] = i
        else:
            for k in range(a.index, a.index + a.count):
                table[(kind, k)] = i
    return table


class PeriodicRow(ImmutableRow):
    """One stage's action list, ``head + body x (copies) + tail``, each copy shifted by one more period.
    Immutable: :meth:`with_copies` makes a new row rather than changing this one."""

    def __init__(self, head: tuple[Action, ...], body: tuple[Action, ...], tail: tuple[Action, ...], copies: int,
                 shift: Shift):
        if not body or copies < 1:
            raise ValueError("a periodic row needs a non-empty body and at least one copy of it")
        self.head, self.body, self.tail, self.copies, self.shift = head, body, tail, copies, shift
        self._head_keys, self._body_keys, self._tail_keys = microbatch_positions(head), microbatch_positions(body), microbatch_positions(tail)
        body_microbatches = [k for _, k in self._body_keys]
        self._body_span = (min(body_microbatches), max(body_microbatches)) if body_microbatches else None
        self._length = len(head) + copies * len(body) + len(tail)
        self._head_length, self._body_length = len(head), len(body)
        # Executors look up each action at least once per run (how far a step can run, then to run it), so
        # shifted copies of the body are built a whole copy at a time and the recent ones kept (bounded: a long
        # run's row is long). A copy depends only on body and shift: rows made by with_copies share the table.
        self._blocks: dict[int, tuple[Action, ...]] = {}
        self._tail_block: tuple[Action, ...] | None = None  # the tail, shifted by copies - 1

    def with_copies(self, copies: int) -> "PeriodicRow":
        """The same row with ``copies`` copies of the body (the list for a different number of periods)."""
        if copies < 1:
            raise ValueError("a periodic row needs a non-empty body and at least one copy of it")
        # A shallow copy shares head, body, tail and their position tables (never modified): rebuilding the
        # tables would cost O(len(head) + len(tail)), most of the row, every time the engine extends it.
        row = shallow_copy(self)
        row.copies = copies
        row._length = len(self.head) + copies * len(self.body) + len(self.tail)
        row._tail_block = None
        return row

    def __len__(self) -> int:
        return self._length

    def shares_prefix(self, other: object, n: int) -> bool:
        """Whether the first ``n`` actions are known to equal ``other``'s without comparing them: both rows are
        copies of one form (the same head, body, tail and shift), and the first ``n`` lie before either's tail."""
        return (isinstance(other, PeriodicRow) and other.body is self.body and other.head is self.head
                and other.tail is self.tail and other.shift == self.shift
                and n <= self._head_length + min(self.copies, other.copies) * self._body_length)

    @overload
    def __getitem__(self, i: int) -> Action: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[Action, ...]: ...

    def __getitem__(self, i: int | slice) -> Action | tuple[Action, ...]:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(self._length)))
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError(f"position {i} is outside this stage's {self._length} actions")
        # One method, no helper calls: executors index rows once or twice per action.
        i -= self._head_length
        if i < 0:
            return self.head[i]
        copy, r = divmod(i, self._body_length)
        if copy < self.copies:
            block = self._blocks.get(copy)
            if block is None:
                block = self._shifted(copy)
            return block[r]
        tail = self._tail_block
        if tail is None:
            tail = self._tail_block = self.shift.apply_all(self.tail, self.copies - 1)
        return tail[i - self.copies * self._body_length]

    def block(self, i: int) -> tuple[int, tuple[Action, ...]]:
        """The run of actions that holds position ``i`` (``0 <= i < len(self)``), as ``(start, actions)``: the
        head, one shifted copy of the body, or the tail. An executor walking the row reads it a block at a
        time: one call per period, not one per action."""
        h = self._head_length
        if i < h:
            return 0, self.head
        copy = (i - h) // self._body_length
        if copy < self.copies:
            block = self._blocks.get(copy)
            return h + copy * self._body_length, self._shifted(copy) if block is None else block
        self[i]  # builds the shifted tail, or raises IndexError past the end
        return h + self.copies * self._body_length, self._tail_block  # type: ignore[return-value]

    def _shifted(self, copy: int) -> tuple[Action, ...]:
        """Copy ``copy`` of the body, kept among the recent ones."""
        blocks = self._blocks
        if len(blocks) >= _BLOCKS_KEPT:
            blocks.clear()
        block = blocks[copy] = self.shift.apply_all(self.body, copy)
        return block

    def __iter__(self) -> Iterator[Action]:
        return (self[i] for i in range(self._length))

    def position(self, kind: Kind, microbatch: int) -> int | None:
        """Where the action of ``kind`` covering ``microbatch`` is, or None if the row has none."""
        key = (kind, microbatch)
        if key in self._head_keys:
            return self._head_keys[key]
        h, d, step = len(self.head), len(self.body), self.shift.microbatches
        if self._body_span is not None:
            low, high = self._body_span
            # Copy c holds body micro-batches shifted by c*step; only copies whose range covers it can.
            first = max(0, -((high - microbatch) // step))
            last = min(self.copies - 1, (microbatch - low) // step)
            for copy in range(first, last + 1):
                r = self._body_keys.get((kind, microbatch - copy * step))
                if r is not None:
                    return h + copy * d + r
        r = self._tail_keys.get((kind, microbatch - (self.copies - 1) * step))
        return None if r is None else h + self.copies * d + r

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        if isinstance(other, PeriodicRow) and (other.head, other.body, other.tail, other.shift) == (
                self.head, self.body, self.tail, self.shift):
            return other.copies == self.copies
        return len(other) == len(self) and all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        return hash(tuple(self))  # equal to a tuple of the same actions, so it must hash like one

    def __repr__(self) -> str:
        return (f"PeriodicRow({len(self.head)} head + {self.copies} x {len(self.body)} body + "
                f"{len(self.tail)} tail actions)")


@dataclass(frozen=True)
class PeriodicForm:
    """A family's schedules for many mini-batches, as periodic rows. See :func:`periodic_form`."""

    period: int                           # mini-batches per body copy
    bases: Mapping[int, Schedule]         # residue (n mod period) -> the periodic schedule for its base
    base_minibatches: Mapping[int, int]   # residue -> base mini-batch count b (one body copy)

    def schedule(self, n_minibatches: int) -> Schedule | None:
        """The schedule for ``n_minibatches``, or None if that is shorter than this form's base."""
        r = n_minibatches % self.period
        b = self.base_minibatches[r]
        if n_minibatches < b:
            return None
        copies = 1 + (n_minibatches - b) // self.period
        base = self.bases[r]
        rows = tuple(row.with_copies(copies) for row in base.stages)  # type: ignore[attr-defined]
        ranks = (None if base.ranks is None
                 else tuple(row.with_copies(copies) for row in base.ranks))  # type: ignore[attr-defined]
        return Schedule(base.num_stages, base.n_microbatches, n_minibatches, rows, ranks)


def periodic_form(generate: Callable[[int], Schedule], n_microbatches: int, update_every: int,
                  warmup: int) -> PeriodicForm | None:
    """Find the periodic structure of ``generate`` (mini-batches -> schedule with updates), or None.

    ``warmup`` is a mini-batch count after which the steady state is expected to have begun; every base is
    at least that long, so the form gives no schedule for fewer mini-batches. The form is accepted only if,
    for each residue, it reproduces the generated schedules for four consecutive periods. Its mappings are
    read-only, so that one form can be shared between callers (see ``Algorithm``'s cache).
    """
    m = n_microbatches
    period = update_every // gcd(update_every, m)  # whole updates per period, so versions shift uniformly
    shift = Shift(period * m, period * m // update_every)
    bases: dict[int, Schedule] = {}
    counts: dict[int, int] = {}
    for b in range(warmup, warmup + period):
        generated = [generate(b + t * period) for t in range(4)]
        rows = []
        for s in range(generated[0].num_stages):
            row = _split_row([g.stages[s] for g in generated], shift)
            if row is None:
                return None
            rows.append(row)
        ranks = None
        if generated[0].ranks is not None:  # several stages per rank: the ranks' lists repeat as well
            ranks = []
            for r in range(generated[0].num_ranks):
                row = _split_row([g.ranks[r] for g in generated], shift)  # type: ignore[index]
                if row is None:
                    return None
                ranks.append(row)
            ranks = tuple(ranks)
        bases[b % period] = Schedule(generated[0].num_stages, m, b, tuple(rows), ranks)
        counts[b % period] = b
    return PeriodicForm(period, MappingProxyType(bases), MappingProxyType(counts))


def _split_row(lists: Sequence[Sequence[Action]], shift: Shift) -> PeriodicRow | None:
    """``head``/``body``/``tail`` of one stage's lists for ``b, b+p, b+2p, ...`` mini-batches, if they repeat."""
    first, second = lists[0], lists[1]
    d = len(second) - len(first)
    if d <= 0:
        return None
    # The tail of the longer list is the shorter list's tail moved by one period; find where that starts.
    matched = _moved_prefix(tuple(reversed(second)), tuple(reversed(first)), shift, 1)
    h = len(first) - matched
    if h + d > len(first):
        return None
    head, body, tail = tuple(first[:h]), tuple(first[h:h + d]), tuple(first[h + d:])
    # List t must be head + body moved by 0..t periods + tail moved by t, checked slice by slice.
    for t, lst in enumerate(lists):
        if len(lst) != h + (t + 1) * d + len(tail) or tuple(lst[:h]) != head:
            return None
        if not all(_moved(lst[h + c * d:h + (c + 1) * d], body, shift, c) for c in range(t + 1)):
            return None
        if not _moved(lst[h + (t + 1) * d:], tail, shift, t):
            return None
    return PeriodicRow(head, body, tail, 1, shift)


def _moved(actual: Sequence[Action], base: Sequence[Action], shift: Shift, times: int) -> bool:
    """Whether ``actual`` is ``base`` with each action moved by ``shift`` ``times`` times."""
    return len(actual) == len(base) and _moved_prefix(actual, base, shift, times) == len(base)


def _moved_prefix(actual: Sequence[Action], base: Sequence[Action], shift: Shift, times: int) -> int:
    """How many leading actions of ``actual`` are those of ``base`` moved by ``shift`` ``times`` times.

    Compares fields instead of building the moved actions: finding a form checks every action of four
    long schedules, and constructing (and validating) an Action for each cost most of the time.
    """
    microbatches, updates = times * shift.microbatches, times * shift.updates
    for i, (x, y) in enumerate(zip(actual, base)):
        if not (x.index == y.index + (updates if y.kind is U else microbatches)
                and x.kind == y.kind and x.stage == y.stage and x.count == y.count):
            return i
    return min(len(actual), len(base))
