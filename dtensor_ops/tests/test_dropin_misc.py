"""Smaller drop-in behaviours: weights-only loading of a saved DTensor, from_local(run_check=True)
refusing ranks that disagree on requires_grad, and the warning of the raw constructor."""

from __future__ import annotations

import io

import pytest
import torch

from shardwise.testing import multi_rank


@multi_rank(world_size=2)
def test_saved_dtensor_loads_with_weights_only() -> None:
    from shardwise.dtensor_ops import DTensor, Shard
    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    dt = DTensor.from_local(torch.randn(3, 2), mesh, [Shard(0)])
    buffer = io.BytesIO()
    torch.save(dt, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded._spec == dt._spec and torch.equal(loaded.to_local(), dt.to_local())


@multi_rank(world_size=2)
def test_run_check_refuses_ranks_that_disagree_on_requires_grad() -> None:
    import torch.distributed as dist

    from shardwise.dtensor_ops import DTensor, Shard
    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    local = torch.randn(3, 2, requires_grad=dist.get_rank() == 0)
    with pytest.raises(ValueError, match="requires_grad"):
        DTensor.from_local(local, mesh, [Shard(0)], run_check=True)
    DTensor.from_local(local, mesh, [Shard(0)], run_check=False)  # not checked: no collective


@multi_rank(world_size=2)
def test_raw_constructor_warns_when_it_detaches_the_local_tensor() -> None:
    from shardwise.dtensor_ops import DTensor, Shard
    from shardwise.mesh import init_device_mesh
    from shardwise.placement import DTensorSpec, TensorMeta

    mesh = init_device_mesh("cpu", (2,))
    local = torch.randn(3, 2, requires_grad=True)
    spec = DTensorSpec(mesh, (Shard(0),), TensorMeta(torch.Size([6, 2]), (2, 1), torch.float32))
    assert DTensor(local, spec, requires_grad=True).requires_grad
    with pytest.warns(UserWarning, match="To construct"):
        DTensor(local, spec, requires_grad=False)
