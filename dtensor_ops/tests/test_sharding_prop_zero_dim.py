"""Rules written for n-D inputs must not hand a 0-dim argument a Shard it cannot have."""

from __future__ import annotations

import torch

from shardwise.dtensor_ops import Replicate, distribute_tensor, init_device_mesh
from shardwise.testing import multi_rank


@multi_rank(world_size=2)
def test_index_add_on_zero_dim_replicated_tensors_matches_torch() -> None:
    mesh = init_device_mesh("cpu", (2,))
    target, source = torch.tensor(1.0), torch.tensor(3.0)
    index = torch.tensor([0])
    expected = torch.index_add(target, 0, index, source, alpha=-1)
    result = torch.index_add(
        distribute_tensor(target, mesh, [Replicate()]),
        0,
        distribute_tensor(index, mesh, [Replicate()]),
        distribute_tensor(source, mesh, [Replicate()]),
        alpha=-1,
    )
    assert result.placements == (Replicate(),)
    torch.testing.assert_close(result.full_tensor(), expected)
