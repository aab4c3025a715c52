"""Complex tensors through redistribution on gloo (which has no complex types): every collective
kind, against plain torch."""

from __future__ import annotations

import pytest
import torch

from shardwise.testing import multi_rank


@pytest.mark.parametrize("gloo_all_to_all", [False, True])
@multi_rank(world_size=4)
def test_complex_redistribution_every_collective_kind(gloo_all_to_all: bool) -> None:
    from shardwise.dtensor_ops import DTensor, Partial, Replicate, Shard, distribute_tensor
    from shardwise.dtensor_ops._caches import clear_all_caches
    from shardwise.dtensor_ops._options import Options, use_options
    from shardwise.mesh import init_device_mesh

    clear_all_caches()  # programs compiled under the other option would be reused
    with use_options(Options(gloo_all_to_all=gloo_all_to_all)):
        mesh = init_device_mesh("cpu", (4,))
        torch.manual_seed(3)
        x = torch.randn(6, 5, dtype=torch.cfloat)
        rows = distribute_tensor(x, mesh, [Shard(0)])
        cols = rows.redistribute(mesh, [Shard(1)])  # all-to-all
        torch.testing.assert_close(cols.to_local(), distribute_tensor(x, mesh, [Shard(1)]).to_local())
        torch.testing.assert_close(cols.full_tensor(), x)  # all-gather
        partial = DTensor.from_local(x, mesh, [Partial()])
        torch.testing.assert_close(partial.redistribute(mesh, [Replicate()]).to_local(), 4 * x)  # all-reduce
        scattered = partial.redistribute(mesh, [Shard(1)])  # reduce-scatter
        torch.testing.assert_close(scattered.full_tensor(), 4 * x)
        mesh2 = init_device_mesh("cpu", (2, 2))
        both = distribute_tensor(x, mesh2, [Shard(0), Shard(1)]).redistribute(mesh2, [Shard(1), Shard(0)])
        torch.testing.assert_close(both.full_tensor(), x)
