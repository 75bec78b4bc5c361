"""Joining the process group under ``torchrun``, restarts included, and saying why a connection failed.

**Why a restarted round could not connect.** ``torchrun --max-restarts N`` (with the ``c10d`` or the ``static``
rendezvous) starts one TCPStore in the agent and hands the same ``MASTER_ADDR:MASTER_PORT`` to the workers of
every round; since that store is shared, torch's ``env://`` initialisation uses it without a prefix per round.
Process groups are named by a counter (``"0"`` for the default group, then ``"1"``, ``"2"``, ... for each
``new_group``), identical in every round, and gloo finds its peers by reading each rank's address from the store
under the group's name. In a restarted round the keys of the dead round are still there, so a rank reads a dead
process's address before its new peer has written its own, and connecting fails with ``Gloo connectFullMesh
failed ... Connection refused`` (or times out), on every rank, in every round.

:func:`init_process_group` joins with a store whose keys belong to this round: torchrun's store under the
prefix ``pipecore/<run id>/restart-<TORCHELASTIC_RESTART_COUNT>/world-<WORLD_SIZE>/``. Every group pipecore
creates afterwards (links, tied gradients, gradient norms, replicas) takes its keys from the default group's
store, so they are fresh too. A restart that torchrun does not count (a change of membership: nodes joining an
elastic job) keeps the restart count, and the world size tells it apart only where it changes.

:func:`new_group` creates a group as ``torch.distributed.new_group`` does, and turns a failure to connect into
a :class:`~pipecore.runtime.link.PeerError` that says what happened and what to do, instead of the backend's
message alone.
"""

from __future__ import annotations

import datetime
import os
import re
from typing import Any, Sequence

import torch.distributed as dist

#: The prefix of this process's store when :func:`init_process_group` joined the default group, else None.
_joined_with: str | None = None


def round_prefix() -> str:
    """The store prefix of this ``torchrun`` round: run id, restart count and world size (the environment that
    torchrun's agent gives each round's workers)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"pipecore/{run_id}/restart-{restart}/world-{os.environ.get('WORLD_SIZE', '1')}/"


def init_process_group(backend: str | None = None, timeout: float = 30.0) -> None:
    """``torch.distributed.init_process_group`` from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``), safe across ``torchrun --max-restarts`` restarts: under torchrun the
    store's keys are prefixed with the round (see the module docstring), so a restarted round never reads the
    addresses of the processes of a dead one. Outside torchrun it is torch's own ``env://`` initialisation.

    ``backend``: ``"gloo"`` or ``"nccl"`` (default: NCCL when CUDA is available, else gloo, as the pipeline
    picks); ``timeout``: seconds to wait for the other ranks. Call it instead of torch's function in a script
    that initialises the process group itself; a :class:`~pipecore.Pipeline` built without an initialised group
    joins this way by itself. A failure to reach the other ranks is a
    :class:`~pipecore.runtime.link.PeerError` that says why and what to do."""
    global _joined_with
    import torch

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    wait = datetime.timedelta(seconds=timeout)
    try:
        if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
            dist.init_process_group(backend, timeout=wait)
            return
        store, rank, world = next(dist.rendezvous("env://", timeout=wait))
        prefix = round_prefix()
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                                timeout=wait)
        _joined_with = prefix
    except RuntimeError as exc:  # torch's DistStoreError and DistNetworkError are RuntimeErrors
        raise connect_error(exc, "the default process group") from exc


def new_group(ranks: Sequence[int] | None, what: str, timeout: datetime.timedelta, **kwargs: Any) -> Any:
    """``torch.distributed.new_group(ranks, timeout=timeout, **kwargs)`` (collective over the default group);
    a failure to connect is a :class:`~pipecore.runtime.link.PeerError` naming ``what`` the group is for."""
    try:
        return dist.new_group(ranks, timeout=timeout, **kwargs)
    except RuntimeError as exc:
        if not _connection_failure(exc):
            raise
        raise connect_error(exc, what) from exc


def _connection_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is the backend or the store failing to reach another rank (not a usage error)."""
    text = str(exc).lower()
    return isinstance(exc, dist.DistError) or any(
        word in text for word in ("gloo", "connect", "timed out", "timeout", "refused", "socket", "nccl"))


def connect_error(exc: BaseException, what: str) -> Exception:
    """The error for a rank that could not reach the others while creating ``what``: the backend's first line
    (without its source path), the likely cause and the fix, in one line."""
    from .link import PeerError

    rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
    detail = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", str(exc).splitlines()[0] if str(exc) else "")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart and dist.is_initialized() and _joined_with is None:
        cause = (f"this is restart {restart} of a torchrun job and the default process group was initialised "
                 "outside pipecore: torchrun keeps one store across restarts, so torch's env:// keys still hold "
                 "the addresses of the dead round's processes; initialise it with pipecore.init_process_group() "
                 "(or let the Pipeline join it)")
    else:
        cause = ("another rank died or never got here (its own output says why), or cannot be reached at the "
                 "address it published (check MASTER_ADDR, and GLOO_SOCKET_IFNAME for the network interface); "
                 "under torchrun --max-restarts the job is restarted, and `pipecore train --resume auto` or "
                 "pipecore.checkpoint.resume() continues from the last checkpoint")
    return PeerError(f"rank {rank}: could not connect to the other ranks while creating {what} ({detail}); {cause}")
