"""redistribute_together: several redistributions, the all-reduces among them coalesced into one
collective per (mesh dim, reduce op, dtype), values equal to one-by-one redistribution."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import multi_rank


@multi_rank(world_size=4)
def test_partial_sums_share_one_all_reduce_and_the_rest_goes_one_by_one() -> None:
    from shardwise.dtensor_ops import DTensor, Partial, Replicate, Shard, redistribute_together
    from shardwise.dtensor_ops.debug import CommDebugMode
    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    rank = dist.get_rank()
    torch.manual_seed(rank)  # every rank holds its own contribution
    sums = [torch.randn(3), torch.randn(2, 5), torch.randn(4, 3).t()]  # the last one not contiguous
    maxima = [torch.randn(6), torch.randn(1, 2)]
    averaged = torch.randn(3)
    row_shard = torch.randn(2, 3)
    inputs = (
        [DTensor.from_local(t, mesh, [Partial("sum")]) for t in sums]
        + [DTensor.from_local(t, mesh, [Partial("max")]) for t in maxima]
        + [DTensor.from_local(averaged, mesh, [Partial("avg")])]
        + [DTensor.from_local(row_shard, mesh, [Shard(0)])]
    )
    targets = [[Replicate()]] * len(inputs)
    with CommDebugMode() as comms:
        together = redistribute_together(inputs, targets)
    counts = {str(op).split(".")[-1]: n for op, n in comms.get_comm_counts().items() if n}
    # One all-reduce for the three sums, one for the two maxima, one for the average (its own: the
    # division after the sum is per tensor), one all-gather for the row shard.
    assert counts == {"all_reduce": 3, "all_gather_into_tensor": 1}, counts
    for got, source, target in zip(together, inputs, targets):
        expected = source.redistribute(mesh, target)
        assert got.placements == expected.placements and got.shape == expected.shape
        torch.testing.assert_close(got.to_local(), expected.to_local())


@multi_rank(world_size=2)
def test_refuses_tensors_that_require_grad_before_any_collective() -> None:
    from shardwise.dtensor_ops import DTensor, Partial, Replicate, redistribute_together
    from shardwise.dtensor_ops.debug import CommDebugMode
    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    free = DTensor.from_local(torch.ones(2), mesh, [Partial()])
    tracked = DTensor.from_local(torch.ones(2, requires_grad=True), mesh, [Partial()])
    with CommDebugMode() as comms:
        with pytest.raises(RuntimeError, match="item 1 requires grad"):
            redistribute_together([free, tracked], [[Replicate()], [Replicate()]])
        with pytest.raises(ValueError, match="2 DTensors but 1 placement lists"):
            redistribute_together([free, free], [[Replicate()]])
    assert comms.get_total_counts() == 0
