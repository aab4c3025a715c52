"""DTensors on a mesh over part of the world: ranks outside hold nothing and run nothing, as in
PyTorch (an empty local tensor, default results), while ranks inside compute as usual."""

from __future__ import annotations

import torch

from shardwise.testing import multi_rank


@multi_rank(world_size=4)
def test_ranks_outside_a_sub_mesh_hold_empty_locals_and_get_default_results() -> None:
    import torch.distributed as dist

    from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor, zeros
    from shardwise.mesh import DeviceMesh

    mesh = DeviceMesh("cpu", [0, 2])
    inside = dist.get_rank() in (0, 2)
    dt = DTensor.from_local(torch.ones(3, 4), mesh, [Shard(0)])
    assert dt.shape == (6, 4)
    plus = dt + 2
    halves = dt.split([2, 2], dim=1)
    total = DTensor.from_local(torch.ones(4, 3), mesh, [Shard(0)]).sum()
    replicated = dt.redistribute(placements=[Replicate()])
    x = torch.arange(12.0).reshape(6, 2)
    scattered = distribute_tensor(x, mesh, [Shard(0)])
    made = zeros(6, 2, device_mesh=mesh, placements=[Shard(0)])
    if inside:
        torch.testing.assert_close(plus.to_local(), torch.full((3, 4), 3.0))
        assert [tuple(h.to_local().shape) for h in halves] == [(3, 2), (3, 2)]
        assert total.to_local().item() == 12.0 and total.full_tensor().item() == 24.0
        torch.testing.assert_close(replicated.to_local(), torch.ones(6, 4))
        torch.testing.assert_close(scattered.full_tensor(), x)
        torch.testing.assert_close(made.to_local(), torch.zeros(3, 2))
    else:
        for value in (dt, plus, *halves, replicated, scattered, made):
            assert value.to_local().shape == (0,)
        assert total.to_local().shape == () and total.to_local().item() == 0.0
    assert all(h.shape == (6, 2) for h in halves) and plus.shape == (6, 4) and total.shape == ()
    assert dt.equal(dt) is True
    in_place = dt.add_(1)
    assert in_place is dt
