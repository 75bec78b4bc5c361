"""Data x pipeline parallelism, what one process can check: the grid, the shards, the bucketed gradient sum,
and clear errors for bad ``data_parallel`` and ``mesh`` values (tests/test_distributed.py runs the replicas)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pipecore
from pipecore.engine import data_parallel as dp
from pipecore.engine.data_parallel import GradientSum, Topology, shard


def test_the_grid_is_row_major_like_init_device_mesh():
    t = Topology(replica=1, rank=0, grid=((0, 1, 2), (3, 4, 5)))
    assert (t.data_parallel, t.num_ranks, t.replica_ranks) == (2, 3, (3, 4, 5))
    assert t.dp_ranks(2) == (2, 5)
    assert t.describe() == "rank 3 (replica 1, pipeline rank 0)"


def test_each_replica_takes_its_part_of_every_tensor():
    x = torch.arange(10)
    parts = [shard({"a": x, "b": (x, x * 2)}, Topology(i, 0, ((0,), (1,), (2,)))) for i in range(3)]
    assert [p["a"].tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]  # tensor_split's sizes
    assert parts[1]["b"][1].tolist() == [8, 10, 12]
    with pytest.raises(ValueError, match="a mini-batch of 2 samples cannot give each of 3 replicas one"):
        shard(torch.zeros(2), Topology(0, 0, ((0,), (1,), (2,))))
    with pytest.raises(TypeError, match="local=True"):
        shard("text", Topology(0, 0, ((0,), (1,))))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_data_parallel_is_refused(bad):
    with pytest.raises(ValueError, match="data_parallel must be a positive int"):
        pipecore.Pipeline(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 2, "1f1b", 2,
                          loss_fn=nn.MSELoss(), data_parallel=bad)


def test_replicas_need_processes():
    with pytest.raises(ValueError, match=r"data_parallel=2 needs 2 x the pipeline's ranks processes under torchrun"):
        pipecore.Pipeline(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 2, "1f1b", 2, loss_fn=nn.MSELoss(),
                          data_parallel=2)


@pytest.mark.parametrize("names,message", [
    (("x", "y"), "dimensions named 'dp' and 'pp'"),
    (None, "without names"),
])
def test_a_mesh_without_the_named_dimensions_is_refused(names, message):
    mesh = types.SimpleNamespace(mesh_dim_names=names, ndim=2, mesh=torch.arange(4).reshape(2, 2))
    with pytest.raises(ValueError, match=message):
        dp.join(2, 2, 30.0, None, mesh)


def test_a_mesh_whose_pp_dimension_is_not_the_pipeline_is_refused():
    mesh = types.SimpleNamespace(mesh_dim_names=("dp", "pp"), ndim=2, mesh=torch.arange(6).reshape(2, 3))
    with pytest.raises(ValueError, match="'pp' dimension has 3 ranks but num_stages=2 needs 2"):
        dp.join(2, 2, 30.0, None, mesh)
    with pytest.raises(ValueError, match="data_parallel=3 but the mesh's 'dp' dimension has 2 replicas"):
        dp.join(3, 3, 30.0, 3, mesh)


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo group of this process alone (its sums are the identity)."""
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_the_gradient_sum_starts_when_a_group_completes_in_buckets(one_process_group, monkeypatch):
    sizes = []
    real = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", recording)
    grad = torch.arange(10, dtype=torch.float64)
    summed = GradientSum(one_process_group, update_every=4, bucket_bytes=3 * 8)  # 3 float64 per bucket
    summed.after_backward(grad, 2)
    assert sizes == []                       # half a group: nothing to sum yet
    summed.after_backward(grad, 2)
    assert sizes == [3, 3, 3, 1]             # the group is complete: every bucket started
    summed.finish(grad)
    assert grad.tolist() == list(range(10))  # one replica: the sum is the gradient
    summed.finish(grad)                      # an update with no group started (a drain's last): sums now
    assert sizes == [3, 3, 3, 1] * 2
