"""This rank's stages under ``torchrun``: the :class:`~.locality.Locality` of a pipeline with one process per rank.

Each rank builds only its own stages; messages, tied gradients and gradient norms travel between processes.
A rank cannot see the others' progress, so it keeps undo points for as many mini-batches as may be in
flight on some rank, and after a failure every rank agrees on what to undo and brings its exchanges back in
step with the others before the pipeline goes on.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..algorithms.base import Algorithm
from ..runtime.distributed import DistributedTransport
from ..runtime.link import PeerError
from ..runtime.executor import Executor
from ..runtime.ties import DistributedTiedGradients, LocalTiedGradients, StagesAsRanks, TiedGradients
from ..schedule.links import messages_ahead
from .clip import DistributedGlobalNorm, GlobalNorm, RankGlobalNorm
from .data_parallel import Topology
from .locality import Needs
from .prediction import forward_across_ranks
from .stage import TensorStage
from .state import Unrecoverable
from .undo import minibatches_in_flight

# The most receives a process keeps posted on one link: each is a buffer the size of a message, held between
# steps too, so a schedule that sends m activations back to back (GPipe, looped BFS) gets at most this many.
_MOST_RECEIVES_AHEAD = 8


class RankOfGroup:
    """Pipeline rank ``topology.rank`` of a process group: it runs the stages ``placement`` gives that rank."""

    input_note = " (the ranks that run other stages may pass None)"

    def __init__(self, topology: Topology, placement: tuple[int, ...], timeout: float):
        self.topology, self.placement, self.timeout = topology, placement, timeout
        self.rank: int | None = topology.rank
        self.num_ranks = topology.num_ranks
        self.nccl_rank = topology.rank if dist.get_backend() == "nccl" else None
        # The exchanges between processes, as the builder makes them (the transport always): a failure goes
        # through them.
        self.transport: DistributedTransport
        self.tie_exchange: Any = None
        self.global_norm: GlobalNorm | None = None
        self._shared_failure: list[dict[str, Any]] | None = None  # see end_flush

    @property
    def process_rank(self) -> int | None:
        return self.topology.grid[self.topology.replica][self.topology.rank]

    def _grid(self) -> tuple[Any, ...]:
        """``(grid, replica)`` for the exchanges between processes with several replicas; nothing with one."""
        if self.topology.data_parallel == 1:
            return ()
        return self.topology.grid, self.topology.replica

    def stages_here(self, num_stages: int, placement: Sequence[int]) -> list[int]:
        return [s for s in range(num_stages) if placement[s] == self.topology.rank]

    def concurrent_by_default(self, num_stages: int) -> bool:
        return False

    def release_other_stages(self, model: nn.Module, own: Sequence[nn.Module]) -> None:
        """Move the parameters and buffers of the other ranks' stages to the meta device: each rank then holds
        only its stages' weights, and running the other modules by mistake fails loudly instead of computing
        with weights that never train. Tensors this rank's stages hold stay."""
        mine = {id(t) for module in own for t in (*module.parameters(), *module.buffers())}
        moved: dict[int, torch.Tensor] = {}
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in list(table.items()):
                    if t is None or id(t) in mine or t.device.type == "meta":
                        continue
                    if id(t) not in moved:
                        meta = t.detach().to("meta")
                        moved[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
                    table[name] = moved[id(t)]

    def build_transport(self, algorithm: Algorithm, devices: Sequence[torch.device],
                        stages: Sequence[int]) -> DistributedTransport:
        # Receives posted ahead on each link: as many messages as the schedule lets its sender get ahead
        # (two mini-batches show the lead across a step's end), at most _MOST_RECEIVES_AHEAD buffers.
        ahead = {link: min(lead, _MOST_RECEIVES_AHEAD) for link, lead in messages_ahead(algorithm.schedule(2)).items()}
        self.transport = DistributedTransport(self.topology.rank, len(self.placement), self.timeout, devices[stages[0]],
                                              self.placement, *self._grid(), receives_ahead=ahead)
        return self.transport

    def build_tie_exchange(self, owners: Mapping[str, tuple[int, ...]],
                           views: Mapping[int, Mapping[str, torch.Tensor]],
                           devices: Sequence[torch.device]) -> TiedGradients:
        placement = self.placement
        exchange: Any
        if all(len({placement[o] for o in group}) == 1 for group in owners.values()):
            exchange = LocalTiedGradients(owners)  # every tie's owners are on this rank
        elif all(len({placement[o] for o in group}) == len(group) for group in owners.values()):
            # Each owner on a rank of its own: the exchange between ranks, its owners named by their ranks.
            mine = [s for s in views if views[s]]
            shapes = {name: (view.shape, view.dtype) for s in mine for name, view in views[s].items()}
            exchange = DistributedTiedGradients(
                {name: tuple(placement[o] for o in group) for name, group in owners.items()}, self.topology.rank,
                self.timeout,
                devices[mine[0]] if mine else devices[next(iter(views))], shapes, *self._grid())
            if self.num_ranks != len(placement):
                exchange = StagesAsRanks(exchange, placement)
        else:
            raise ValueError(
                "with several stages per rank, each tied weight must have its owners all on one rank or each on a "
                f"rank of its own; here {', '.join(f'{n!r} is held by stages {g}' for n, g in owners.items())} on "
                f"ranks {[placement[o] for g in owners.values() for o in g]} (move the cuts, or use a V "
                "placement, zb-v or dualpipe-v, which puts the first and last stage on one rank)")
        self.tie_exchange = exchange
        return exchange

    def build_global_norm(self, stages: Mapping[int, TensorStage]) -> GlobalNorm:
        rank = self.topology.rank
        if len(stages) == 1:
            self.global_norm = DistributedGlobalNorm(rank, self.num_ranks, self.timeout, *self._grid())
        else:
            self.global_norm = RankGlobalNorm(stages, rank, self.num_ranks, self.timeout, *self._grid())
        return self.global_norm

    def completion_test(self, algorithm: Algorithm, stages: Mapping[int, TensorStage],
                        needs: Needs | None) -> Callable[[int, int], bool]:
        # This rank cannot see the others' progress: keep the mini-batches that may still be in flight.
        depth = minibatches_in_flight(algorithm, needs)

        def complete(j: int, newest: int) -> bool:
            return j < newest - depth

        return complete

    def gather(self, obj: Any) -> list[Any]:
        if not dist.is_initialized():
            raise RuntimeError("the process group was destroyed; with one process per stage, gather state and "
                               "statistics or save checkpoints before torch.distributed.destroy_process_group()")
        return self.transport.share(obj)

    def publish_loss(self, minibatch: int, loss: float) -> None:
        self.transport.publish_loss(minibatch, loss)

    def predict(self, stages: Mapping[int, TensorStage], chunks: list[Any], broadcast: bool) -> Any:
        return forward_across_ranks(self.transport, self.topology.rank, self.placement, stages, chunks, broadcast)

    def _side_exchanges(self) -> dict[str, Any]:
        """The exchanges besides the links that a failure must bring back in step: the tied gradients' and the
        global gradient norm's."""
        side: dict[str, Any] = {}
        if self.tie_exchange is not None and not isinstance(self.tie_exchange, LocalTiedGradients):
            side["ties"] = self.tie_exchange  # (a rank's own ties, all owners here, need no bringing back)
        if isinstance(self.global_norm, DistributedGlobalNorm):
            side["norms"] = self.global_norm
        return side

    def report_failure(self, exc: BaseException, executor: Executor, stages: Mapping[int, TensorStage]) -> None:
        self._report(exc, executor, stages)

    def _report(self, exc: BaseException, executor: Executor, stages: Mapping[int, TensorStage]) -> str:
        """Tell the other ranks what stopped this one (or pass on what a neighbour reported), so that each
        raises with the cause rather than waiting for its timeout; return the cause."""
        cause = getattr(exc, "cause", None)
        if cause is None:
            actions = [a for a, _ in executor.failed_actions if a.stage in stages]
            stage = actions[0].stage if actions else min(stages)
            where = f"stage {stage} (rank {self.rank})" + (f", action {actions[0]}" if actions else "")
            detail = str(exc).splitlines()[0] if str(exc) else ""
            cause = f"{type(exc).__name__} at {where}" + (f": {detail}" if detail else "")
        self.transport.notify_failure(cause)
        for exchange in self._side_exchanges().values():
            exchange.notify_failure(cause)  # a rank waiting for a tied gradient or a norm learns it at once too
        return cause

    def agree_on_failure(self, exc: BaseException, failed: int, executor: Executor,
                         stages: Mapping[int, TensorStage]) -> tuple[int, Callable[[int], None]]:
        """Report the failure to the other ranks, then agree with them (every rank gets here, having raised) on
        the first mini-batch to undo, and learn what each rank has sent on its links and on the other exchanges
        (:meth:`_side_exchanges`), in rank order, for bringing them back in step."""
        transport = self.transport
        side = self._side_exchanges()
        shared, self._shared_failure = self._shared_failure, None
        if shared is None:  # (else this rank learnt of the failure from the exchange that ends a flush: all know)
            # Notices first: the counts shared next include them, so that every rank takes them off its streams.
            cause = self._report(exc, executor, stages)
            if isinstance(exc, PeerError) and exc.cause is None:
                raise Unrecoverable("a rank died or stopped answering")
            entry = {"failed": failed, "cause": cause, "sent": transport.sent_counts(),
                     **{key: exchange.sent_counts() for key, exchange in side.items()}}
            shared = transport.share(entry)
        counts = {"sent": [e["sent"] for e in shared]}
        for key, exchange in side.items():
            got = [e.get(key) for e in shared]
            if None in got:
                # The exchange that ends a flush does not carry them: every rank sees the same entries, so every
                # rank shares them now.
                got = transport.share(exchange.sent_counts())
            counts[key] = got

        def resync(first: int) -> None:
            """Bring the links and the side exchanges back in step with the other ranks (``counts``: what every
            rank sent), keeping what belongs to micro-batches before ``first``."""
            transport.resync(counts["sent"], keep=lambda kind, k: k < first)
            if "ties" in counts:
                # The tied gradients' streams likewise: groups before micro-batch `first` wait for their reduce,
                # later ones were withdrawn (every owner numbers the groups alike; a rank owning no tie has none).
                ties = next((st.ties for st in stages.values() if st.ties is not None), None)
                side["ties"].resync(counts["ties"], 0 if ties is None else ties.group_of(first))
            if "norms" in counts:
                side["norms"].resync(counts["norms"])  # all of a synchronous schedule's undone updates

        return min(e["failed"] for e in shared if e["failed"] is not None), resync

    def end_flush(self, executor: Executor) -> None:
        """Complete the sends, then tell the other ranks whether this one got here. A rank may fail after the
        others have finished their share of the flush; then they take the pipeline back with it (each learns
        here what failed, and keeps the shared counts for :meth:`agree_on_failure`)."""
        transport = self.transport
        transport.wait_sends()
        if self.tie_exchange is not None:
            self.tie_exchange.wait_sends()
        shared = transport.share({"failed": None, "cause": None, "sent": transport.sent_counts()})
        failures = [(r, e) for r, e in enumerate(shared) if e["failed"] is not None]
        if failures:
            r, entry = failures[0]
            self._shared_failure = shared
            exc = PeerError.reported(self.topology.rank, r, entry["cause"])
            executor.failure = exc
            raise exc
