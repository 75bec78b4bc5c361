"""Stage threads or in turn: chosen by timing steps both ways.

On a GPU a stage thread issues its kernels while the others' run, so stage threads are what makes a pipeline
fast. On the CPU they only pay where a stage's ops take long enough: under CPython's GIL every torch op hands
the GIL to another runnable stage thread and back, so with small ops the hand-overs (each a sleep and a
wake-up) cost more than the compute they let overlap, while with large ops the stages compute on several
cores at once. Which one wins depends on the model, the batch and the machine, so a pipeline whose stages are
all on the CPU measures it: after a few warm-up steps it runs steps alternately on its stage threads and in
turn on the calling thread, then keeps the faster way. Both give the same bits (each stage keeps its order).

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
    threads are kept for good if their fastest probe took at most ``1 - THREADS_MARGIN`` of the fastest in
    turn, else the stages run in turn for good. A step that raised is not timed (:meth:`record` is not called
    for it).
    """

    def __init__(self, warmup: int = 3, probes: int = 5) -> None:
        if warmup < 0 or probes < 1:
            raise ValueError(f"warmup must be >= 0 and probes >= 1, got warmup={warmup}, probes={probes}")
        self.warmup, self.probes = warmup, probes
        self._seen = 0  # steps recorded, warm-up included
        self.seconds: dict[str, list[float]] = {THREADS: [], IN_TURN: []}
        self.chosen: str | None = None

    def next(self) -> str:
        """How the next step runs: :data:`THREADS` or :data:`IN_TURN`."""
        if self.chosen is not None:
            return self.chosen
        if self._seen < self.warmup:
            return THREADS
        return IN_TURN if (self._seen - self.warmup) % 2 == 0 else THREADS

    def record(self, way: str, seconds: float) -> None:
        """A step that ran ``way`` took ``seconds``; after the last probe, the faster way is chosen."""
        if self.chosen is not None:
            return
        if self._seen >= self.warmup:
            self.seconds[way].append(seconds)
        self._seen += 1
        if all(len(times) >= self.probes for times in self.seconds.values()):
            threads, in_turn = (min(self.seconds[w]) for w in (THREADS, IN_TURN))
            self.chosen = THREADS if threads <= (1 - THREADS_MARGIN) * in_turn else IN_TURN

    @property
    def state(self) -> str:
        """:data:`THREADS` or :data:`IN_TURN` once chosen, :data:`MEASURING` before."""
        return MEASURING if self.chosen is None else self.chosen
