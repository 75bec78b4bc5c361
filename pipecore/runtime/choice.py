"""Stage threads or in turn: chosen by timing steps both ways.

On a GPU a stage thread issues its kernels while the others' run, so stage threads are what makes a pipeline
fast. On the CPU they only pay where a stage's ops take long enough: under CPython's GIL every torch op hands
the GIL to another runnable stage thread and back, so with small ops the hand-overs (each a sleep and a
wake-up) cost more than the compute they let overlap, while with large ops the stages compute on several
cores at once. Which one wins depends on the model, the batch and the machine, so a pipeline whose stages are
all on the CPU measures it: after a few warm-up steps it runs steps alternately on its stage threads and in
turn on the calling thread, then keeps the faster way, and probes again later (after 100 steps, then 200
more, ...) in case the load of the machine decided. Both give the same bits (each stage keeps its order).

Each way is judged by its fastest probe, not a mean or median: on a machine shared with other work the
slowdowns come in bursts that can cover several consecutive steps, while the fastest of a few alternating
probes is the one least disturbed by them (what ``timeit`` reports, for the same reason). The threads must
also win clearly, by :data:`THREADS_MARGIN` of a step's wall time: they always cost more CPU time (the
hand-overs), so where the two ways take about as long the stages run in turn.
"""

from __future__ import annotations

THREADS = "stage threads"
IN_TURN = "in turn"
MEASURING = "measuring"
THREADS_MARGIN = 0.1  # the share of a step's wall time the stage threads must save to be kept


class ThreadsOrInTurn:
    """Picks the way the next step runs, from the wall times of earlier steps.

    The first ``warmup`` steps run on the stage threads and are not timed (they pay one-time costs: schedule
    generation, lazy imports, caches). The next ``2 * probes`` alternate, in turn first; then the stage
    threads are kept if their fastest probe took at most ``1 - THREADS_MARGIN`` of the fastest in turn, else
    the stages run in turn. ``recheck`` steps after a choice the ways are probed again the same way and chosen
    afresh from the new probes, then again after twice as many steps, and so on (0: never): a choice that a
    burst of load decided does not stand for the whole run, and the probes of a long run stay a vanishing share
    of its steps. A step that raised is not timed (:meth:`record` is not called for it).
    """

    def __init__(self, warmup: int = 3, probes: int = 5, recheck: int = 100) -> None:
        if warmup < 0 or probes < 1 or recheck < 0:
            raise ValueError(f"warmup and recheck must be >= 0 and probes >= 1, got warmup={warmup}, "
                             f"probes={probes}, recheck={recheck}")
        self.warmup, self.probes, self.recheck = warmup, probes, recheck
        self._seen = 0  # steps recorded, warm-up included
        self.seconds: dict[str, list[float]] = {THREADS: [], IN_TURN: []}  # the latest round's probes' wall times
        self.chosen: str | None = None
        self._probing_from: int | None = warmup  # the step the current (or next) probes start at; None: no more
        self._gap = recheck  # steps from a choice to the next probes

    def next(self) -> str:
        """How the next step runs: :data:`THREADS` or :data:`IN_TURN`."""
        start = self._probing_from
        if start is None or self._seen < start:
            return THREADS if self.chosen is None else self.chosen  # warm-up, or between probes
        return IN_TURN if (self._seen - start) % 2 == 0 else THREADS

    def record(self, way: str, seconds: float) -> None:
        """A step that ran ``way`` took ``seconds``; after the last probe of a round, a way is chosen."""
        start = self._probing_from
        self._seen += 1
        if start is None or self._seen <= start:
            return
        if self._seen == start + 1:  # a round's first probe: the previous round's times go
            self.seconds = {THREADS: [], IN_TURN: []}
        self.seconds[way].append(seconds)
        if all(len(times) >= self.probes for times in self.seconds.values()):
            threads, in_turn = (min(self.seconds[w]) for w in (THREADS, IN_TURN))
            self.chosen = THREADS if threads <= (1 - THREADS_MARGIN) * in_turn else IN_TURN
            self._probing_from = None if self._gap == 0 else self._seen + self._gap
            self._gap *= 2

    @property
    def state(self) -> str:
        """:data:`MEASURING` before the first choice and while the ways are probed again, else the way chosen
        (:data:`THREADS` or :data:`IN_TURN`)."""
        start = self._probing_from
        if self.chosen is None or (start is not None and self._seen >= start):
            return MEASURING
        return self.chosen
