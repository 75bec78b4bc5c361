"""Data x pipeline parallelism: ``W`` replicas of the pipeline, each reading ``1/W`` of every mini-batch.

The processes form a ``W x R`` grid (``R`` pipeline ranks, ``num_stages // stages_per_rank``): process ``(i, r)``
runs pipeline rank ``r`` of replica ``i``, in the layout ``init_device_mesh(device, (W, R),
mesh_dim_names=("dp", "pp"))`` gives, so global rank ``i * R + r`` unless a ``DeviceMesh`` says otherwise.
Within a replica everything is as with one pipeline (its links, tied-weight exchange and gradient norm are
groups of its own ranks). Across replicas, each stage's gradients are summed over its ``"dp"`` group before
every update: each replica divides its micro-batch losses by the *global* mini-batch's sample count, so the
sum is the gradient of the mean loss over the global mini-batch, also when the shards differ in size.

The sum is all-reduced in buckets (contiguous slices of the stage's flat gradient buffer), started as soon as a
stage's backward completes an update group and waited for just before the update, so that the transfer
overlaps what the rank does in between (other stages' actions, the next mini-batch's forwards). A tied
weight's gradient is summed over its owners within the replica at the update, then over the replicas.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch

#: Bytes per all-reduce bucket of a stage's gradient buffer (DDP's default bucket size).
BUCKET_BYTES = 25 * 2 ** 20


@dataclass(frozen=True)
class Topology:
    """Where this process is in the ``W x R`` grid, and the global rank of every process.

    ``grid[i][r]`` is the global rank of pipeline rank ``r`` of replica ``i``."""

    replica: int
    rank: int  # this process's pipeline rank within its replica
    grid: tuple[tuple[int, ...], ...]

    @property
    def data_parallel(self) -> int:
        return len(self.grid)

    @property
    def num_ranks(self) -> int:
        return len(self.grid[0])

    @property
    def replica_ranks(self) -> tuple[int, ...]:
        """The global ranks of this replica's pipeline ranks, in pipeline order."""
        return self.grid[self.replica]

    def dp_ranks(self, rank: int) -> tuple[int, ...]:
        """The global ranks that run pipeline rank ``rank`` in every replica (its ``"dp"`` group)."""
        return tuple(row[rank] for row in self.grid)

    def describe(self, rank: int | None = None) -> str:
        r = self.rank if rank is None else rank
        return f"rank {self.grid[self.replica][r]} (replica {self.replica}, pipeline rank {r})"


def join(num_stages: int, num_ranks: int, timeout: float, data_parallel: int | None,
         mesh: Any = None) -> Topology | None:
    """This process's place when running one process per (replica, pipeline rank), else None (everything in
    this process). Joins the default process group from torchrun's environment if it is not initialised."""
    import torch.distributed as dist

    if data_parallel is not None and (isinstance(data_parallel, bool) or not isinstance(data_parallel, int)
                                      or data_parallel < 1):
        raise ValueError(f"data_parallel must be a positive int (the number of pipeline replicas), got "
                         f"{data_parallel!r}")
    if mesh is not None:
        return _from_mesh(mesh, num_stages, num_ranks, data_parallel)
    if not dist.is_available():
        return _single(data_parallel)
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "RANK" not in os.environ:
            return _single(data_parallel)
        from ..runtime.elastic import init_process_group

        # Not torch's env:// as such: under torchrun --max-restarts its keys would outlive a dead round.
        init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout)
    world = dist.get_world_size()
    if world == 1:
        return _single(data_parallel)
    width = data_parallel if data_parallel is not None else 1
    if world != width * num_ranks:
        per_rank = "stage" if num_ranks == num_stages else f"rank ({num_stages // num_ranks} stages each)"
        if data_parallel is None and world % num_ranks == 0:
            hint = f"; for {world // num_ranks} replicas of the pipeline pass data_parallel={world // num_ranks}"
        else:
            hint = ""
        raise ValueError(
            f"the process group has {world} ranks but num_stages={num_stages} needs {num_ranks}"
            + (f" x data_parallel={width} = {width * num_ranks}" if width > 1 else "")
            + f": pipecore runs one process per {per_rank}" + (" and replica" if width > 1 else "")
            + f"; launch with torchrun --nproc-per-node {width * num_ranks}"
            + (f" (or set num_stages={world})" if num_ranks == num_stages and width == 1 else "") + hint
        )
    rank = dist.get_rank()
    grid = tuple(tuple(i * num_ranks + r for r in range(num_ranks)) for i in range(width))
    return Topology(rank // num_ranks, rank % num_ranks, grid)


def _single(data_parallel: int | None) -> None:
    if data_parallel not in (None, 1):
        raise ValueError(f"data_parallel={data_parallel} needs {data_parallel} x the pipeline's ranks processes under "
                         "torchrun (or a DeviceMesh); this process runs alone")
    return None


def _from_mesh(mesh: Any, num_stages: int, num_ranks: int, data_parallel: int | None) -> Topology:
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if set(names) != {"dp", "pp"} or getattr(mesh, "ndim", len(names)) != 2:
        raise ValueError(f"mesh must be a 2-D DeviceMesh with dimensions named 'dp' and 'pp' (init_device_mesh(device, "
                         f"(W, P), mesh_dim_names=('dp', 'pp'))), got dimensions {names or 'without names'}")
    layout = mesh.mesh if names == ("dp", "pp") else mesh.mesh.t()
    width, ranks = layout.shape
    if ranks != num_ranks:
        raise ValueError(f"the mesh's 'pp' dimension has {ranks} ranks but num_stages={num_stages} needs {num_ranks}")
    if data_parallel is not None and data_parallel != width:
        raise ValueError(f"data_parallel={data_parallel} but the mesh's 'dp' dimension has {width} replicas")
    import torch.distributed as dist

    grid = tuple(tuple(int(g) for g in row) for row in layout.tolist())
    me = dist.get_rank()
    for i, row in enumerate(grid):
        if me in row:
            return Topology(i, row.index(me), grid)
    raise ValueError(f"this process (rank {me}) is not in the mesh {grid}")


class GradientSum:
    """One stage's gradients summed over its ``"dp"`` group: :meth:`start` when a backward completes an update
    group (bucketed, asynchronous), :meth:`finish` before the update."""

    def __init__(self, group: Any, update_every: int, who: str = "this process", bucket_bytes: int = BUCKET_BYTES):
        self.group, self.update_every, self.who, self.bucket_bytes = group, update_every, who, bucket_bytes
        self._backwarded = 0
        self._pending: list[Any] = []

    def after_backward(self, grad: torch.Tensor, microbatches: int) -> None:
        """``microbatches`` more have their gradients in ``grad``: start the sum when they complete a group."""
        before = self._backwarded // self.update_every
        self._backwarded += microbatches
        if self._backwarded // self.update_every > before:
            self.start(grad)

    def start(self, grad: torch.Tensor) -> None:
        import torch.distributed as dist

        per_bucket = max(1, self.bucket_bytes // max(1, grad.element_size()))
        for bucket in grad.split(per_bucket):
            self._pending.append(dist.all_reduce(bucket, group=self.group, async_op=True))

    def finish(self, grad: torch.Tensor) -> None:
        """Wait for the sum started for this update (started here now if none was: a flush's last update)."""
        if not self._pending:
            self.start(grad)
        pending, self._pending = self._pending, []
        try:
            for work in pending:
                work.wait()
        except RuntimeError as exc:
            from ..runtime.link import PeerError

            raise PeerError(f"{self.who}: summing the gradients over the replicas failed ({str(exc).splitlines()[0]}); "
                            "a replica of this stage died or stopped answering within the timeout") from exc

    def reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group now (a tied weight's owners' sum, after the exchange)."""
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self.group)

    def restart(self) -> None:
        self._backwarded = 0
        self._pending = []


def dp_groups(topology: Topology, timeout: float) -> Any:
    """Every pipeline rank's ``"dp"`` group (created by every process, in the same order); this process's."""
    from ..runtime.elastic import new_group

    mine = None
    for r in range(topology.num_ranks):
        group = new_group(list(topology.dp_ranks(r)), "the replicas' gradient sums",
                          datetime.timedelta(seconds=timeout))
        if r == topology.rank:
            mine = group
    return mine


def shard(batch: Any, topology: Topology) -> Any:
    """This replica's share of a global mini-batch: part ``replica`` of ``torch.tensor_split`` into ``W`` parts along
    dimension 0 of every tensor (sizes differ by at most one, the larger first)."""
    width, i = topology.data_parallel, topology.replica
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] < width:
            raise ValueError(f"a mini-batch of {batch.shape[0]} samples cannot give each of {width} replicas one")
        return torch.tensor_split(batch, width)[i]
    if isinstance(batch, dict):
        return {k: shard(v, topology) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(shard(v, topology) for v in batch)
    raise TypeError(f"cannot split a {type(batch).__name__} between replicas: give tensors, or tuples or dicts of "
                    "tensors (or pass each replica its own shard with step(..., local=True))")


def sum_over(group: Any, values: Sequence[float], device: torch.device, what: str = "a sum over the replicas"
             ) -> list[float]:
    """``values`` summed over ``group`` (float64 on ``device``, a GPU for NCCL: a loss, a sample count). A member
    that died or stopped answering within the group's timeout raises :class:`~pipecore.PeerError`."""
    import torch.distributed as dist

    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    try:
        dist.all_reduce(tensor, group=group)
    except RuntimeError as exc:
        from ..runtime.link import PeerError

        members = dist.get_process_group_ranks(group)
        raise PeerError(f"rank {dist.get_rank()}: {what} over ranks {members} failed ({str(exc).splitlines()[0]}); "
                        "one of them died or stopped answering within the timeout") from exc
    return tensor.tolist()
