"""How long a stage's actions took: per kind of action, the total and the most recent durations."""

from __future__ import annotations

import statistics
import time
from array import array

#: Durations kept per kind of action (a long run's statistics take no more memory than a short one's).
KEPT = 1024


class ActionTimes:
    """The durations of one kind of action: their total, and the last :data:`KEPT` in a ring allocated once."""

    __slots__ = ("values", "count", "total")

    def __init__(self) -> None:
        self.values = array("d", bytes(8 * KEPT))
        self.count = 0
        self.total = 0.0

    def add_since(self, t0: float) -> None:
        """Count one action that started at ``time.perf_counter()`` ``t0`` and ends now."""
        seconds = time.perf_counter() - t0
        self.values[self.count % KEPT] = seconds
        self.count += 1
        self.total += seconds

    def extend_last(self, seconds: float) -> None:
        """Add ``seconds`` to the last action counted (work it left for later, such as deferred weight
        gradients)."""
        self.values[(self.count - 1) % KEPT] += seconds
        self.total += seconds

    def median(self) -> float:
        """The median of the kept durations."""
        return statistics.median(self.values[:min(self.count, KEPT)])
