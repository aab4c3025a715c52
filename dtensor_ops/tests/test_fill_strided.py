"""fill_/zero_ keep a _StridedShard layout (FSDP over TP parameters and gradients) and write every element."""

from __future__ import annotations

import pytest
import torch

from shardwise.dtensor_ops import distribute_tensor
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh import init_device_mesh
from shardwise.placement import Shard, _StridedShard
from shardwise.testing import multi_rank


@pytest.mark.parametrize("rows", [8, 7])
@multi_rank(world_size=4)
def test_in_place_fills_keep_strided_pieces_without_communication(rows: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + 1
    layout = [_StridedShard(0, split_factor=2), Shard(0)]
    zeroed = distribute_tensor(full, mesh, layout)
    filled = distribute_tensor(full, mesh, layout)
    with CommDebugMode() as comm:
        zeroed.zero_()
        filled.fill_(2.5)
        filled_by_tensor = filled.fill_(torch.tensor(4.0))
    assert comm.get_total_counts() == 0
    assert tuple(zeroed.placements) == tuple(layout) and tuple(filled_by_tensor.placements) == tuple(layout)
    torch.testing.assert_close(zeroed.full_tensor(), torch.zeros_like(full))
    torch.testing.assert_close(filled.full_tensor(), torch.full_like(full, 4.0))
