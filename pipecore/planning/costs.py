"""What the planner knows about each compute node of a captured graph (see :class:`GraphCosts`)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ValueCost:
    """One value of the graph as the memory model sees it: a storage, with every view of it.

    Attributes:
        producer: the compute node that makes it (-1: one of the graph's inputs).
        nbytes: its bytes.
        savers: the compute nodes that save it (or a view of it) for their backward, in order (its producer
            among them if that saves its own output).
        users: the compute nodes that read it (or a view of it), in order; ``N`` (the node count) if the
            graph returns it.
    """

    producer: int
    nbytes: int
    savers: tuple[int, ...] = ()
    users: tuple[int, ...] = ()


@dataclass(frozen=True)
class TiedParameter:
    """A parameter that several nodes read (a tied embedding): charged in ``GraphCosts.param_bytes`` to its
    first reader, and held again by every other stage that has a reader.

    Attributes:
        param_bytes: its bytes.
        optimizer_bytes: its optimizer state's bytes.
        readers: the compute nodes that read it, in order.
    """

    param_bytes: int
    optimizer_bytes: int
    readers: tuple[int, ...]


@dataclass(frozen=True)
class GraphCosts:
    """Measured (or synthetic) costs of the compute nodes of a captured graph, in graph order.

    Time and activation figures are for one micro-batch of ``microbatch_size`` samples; activation bytes are
    taken to grow in proportion to the samples (:meth:`at_microbatch_size`). Parameter and optimizer-state
    bytes do not depend on the batch.

    Attributes:
        names: the compute nodes' names (``CapturedModel.nodes``).
        forward_s: seconds of each node's forward.
        backward_s: seconds of each node's backward (input and weight gradients).
        output_bytes: bytes of each node's output.
        saved_bytes: bytes autograd keeps for the node's backward, parameters excluded (what recomputing the
            node would free).
        param_bytes: bytes of the parameters the node reads first (a parameter counts once, at its first
            reader; a tied parameter held by several stages is charged again to every later stage that holds
            it by the memory model, not here).
        optimizer_bytes: bytes of optimizer state for those parameters (e.g. 2x parameters for Adam).
        crossing_bytes: entry ``c - 1`` for ``c`` in ``1..N-1``: bytes of the values that cross a cut placed
            before node ``c`` (produced before it and used at or after it), which the stage before sends and
            the stage after receives.
        microbatch_size: samples per micro-batch the figures were taken at.
        device: where they were measured (``"cpu"``, ``"cuda:0"``, or ``"synthetic"``).
        input_bytes: bytes of the graph's own inputs (what the first stage receives per micro-batch); 0 when
            not measured.
        crossing_saved_before, crossing_saved_after: entry ``c`` for ``c`` in ``0..N-1`` (position 0: the
            graph's inputs): bytes of the values crossing a cut before node ``c`` that a node saves for its
            backward, first before ``c`` (the sending stage keeps the value anyway, so the bytes it sends cost
            it nothing more) or first at or after ``c`` (likewise for the receiving stage). Empty when not
            measured (taken as zeros).
        values: every value of the graph (:class:`ValueCost`), in order of production; with them the memory
            model tells exactly what a recomputed segment frees and holds. Empty when not measured (the
            model then takes a segment to free all it saves but its input).
        tied: the parameters several nodes read (:class:`TiedParameter`).
        loss_saved_bytes: what the loss saves for its backward per micro-batch (the last stage keeps it for
            every micro-batch in flight); 0 when not measured.
        loss_s: seconds of the loss's forward and backward per micro-batch (the last stage's); 0 when not
            measured.
        uncuttable: cut positions (``1..N-1``) where a value that is not a tensor (a size, an int) would
            cross: stages send only tensors, so the partitioners start no stage there.
        host_bytes_per_s: bytes per second the device copies to pinned host memory, and likewise back (the
            link taken as full duplex): what activation offload costs. 0 when offload is not available (a
            CPU profile, synthetic costs without it); the planner then never offloads. It does not depend
            on the micro-batch.
    """

    names: tuple[str, ...]
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    output_bytes: tuple[int, ...]
    saved_bytes: tuple[int, ...]
    param_bytes: tuple[int, ...]
    optimizer_bytes: tuple[int, ...]
    crossing_bytes: tuple[int, ...]
    microbatch_size: int = 1
    device: str = "synthetic"
    input_bytes: int = 0
    crossing_saved_before: tuple[int, ...] = ()
    crossing_saved_after: tuple[int, ...] = ()
    values: tuple[ValueCost, ...] = ()
    tied: tuple[TiedParameter, ...] = ()
    loss_saved_bytes: int = 0
    loss_s: float = 0.0
    uncuttable: tuple[int, ...] = ()
    host_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.names)
        if n == 0:
            raise ValueError("GraphCosts needs at least one node")
        for field in ("forward_s", "backward_s", "output_bytes", "saved_bytes", "param_bytes", "optimizer_bytes"):
            values = getattr(self, field)
            if len(values) != n:
                raise ValueError(f"GraphCosts.{field} has {len(values)} entries for {n} nodes")
            if any(v < 0 for v in values):
                raise ValueError(f"GraphCosts.{field} holds a negative entry: {list(values)}")
        if len(self.crossing_bytes) != n - 1:
            raise ValueError(f"GraphCosts.crossing_bytes has {len(self.crossing_bytes)} entries; {n} nodes have "
                             f"{n - 1} cut positions")
        if not isinstance(self.microbatch_size, int) or self.microbatch_size < 1:
            raise ValueError(f"GraphCosts.microbatch_size must be a positive int, got {self.microbatch_size!r}")
        if any(v < 0 for v in self.crossing_bytes):
            raise ValueError(f"GraphCosts.crossing_bytes holds a negative entry: {list(self.crossing_bytes)}")
        if self.input_bytes < 0:
            raise ValueError(f"GraphCosts.input_bytes must be >= 0, got {self.input_bytes}")
        for field in ("crossing_saved_before", "crossing_saved_after"):
            values = getattr(self, field)
            if values and len(values) != n:
                raise ValueError(f"GraphCosts.{field} has {len(values)} entries; it has one per cut position "
                                 f"0..{n - 1} ({n}), or none")
            if any(v < 0 for v in values):
                raise ValueError(f"GraphCosts.{field} holds a negative entry: {list(values)}")

        for v in self.values:
            if not (-1 <= v.producer < n and v.nbytes >= 0 and all(v.producer <= x < n for x in v.savers)
                    and all(v.producer < x <= n for x in v.users)):
                raise ValueError(f"GraphCosts.values holds {v}: a value is made by a node in -1..{n - 1} (-1: an "
                                 f"input), has bytes >= 0, is saved by its maker or later nodes and used by later "
                                 f"nodes (up to {n}: the graph's output)")

        for t in self.tied:
            if not (t.param_bytes >= 0 and t.optimizer_bytes >= 0 and t.readers
                    and all(0 <= r < n for r in t.readers) and list(t.readers) == sorted(set(t.readers))):
                raise ValueError(f"GraphCosts.tied holds {t}: bytes >= 0 and readers among nodes 0..{n - 1}, "
                                 "increasing")
        if any(not 0 < c < n for c in self.uncuttable):
            raise ValueError(f"GraphCosts.uncuttable holds positions outside 1..{n - 1}: {list(self.uncuttable)}")
        if self.loss_saved_bytes < 0 or self.loss_s < 0:
            raise ValueError(f"GraphCosts.loss_saved_bytes and loss_s must be >= 0, got {self.loss_saved_bytes} "
                             f"and {self.loss_s}")
        bandwidth = self.host_bytes_per_s
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, numbers.Real) or not math.isfinite(bandwidth) \
                or bandwidth < 0:
            raise ValueError(f"GraphCosts.host_bytes_per_s must be a finite number of bytes per second >= 0 (0: no "
                             f"offload to host memory), got {bandwidth!r}")

    def __len__(self) -> int:
        return len(self.names)

    def at_microbatch_size(self, samples: int) -> "GraphCosts":
        """The same graph at ``samples`` per micro-batch: activation bytes (inputs, outputs, saved, crossing) and
        times scaled in proportion (a first-order model: per-sample work and memory); parameters and optimizer
        state unchanged."""
        if not isinstance(samples, int) or samples < 1:
            raise ValueError(f"samples must be a positive int, got {samples!r}")
        r = samples / self.microbatch_size

        def scaled(values: Sequence[int]) -> tuple[int, ...]:
            return tuple(int(round(v * r)) for v in values)

        return GraphCosts(
            self.names, tuple(t * r for t in self.forward_s), tuple(t * r for t in self.backward_s),
            scaled(self.output_bytes), scaled(self.saved_bytes), self.param_bytes, self.optimizer_bytes,
            scaled(self.crossing_bytes), samples, self.device, int(round(self.input_bytes * r)),
            scaled(self.crossing_saved_before), scaled(self.crossing_saved_after),
            tuple(ValueCost(v.producer, int(round(v.nbytes * r)), v.savers, v.users) for v in self.values),
            self.tied, int(round(self.loss_saved_bytes * r)), self.loss_s * r, self.uncuttable,
            self.host_bytes_per_s,
        )
