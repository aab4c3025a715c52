"""local_map on unevenly sharded DTensors: the outputs get the right global shape on every rank.

PyTorch's local_map wraps each output with ``DTensor.from_local`` assuming even shards, so with an input
of 7 rows on 4 ranks (pieces 2, 2, 2, 1, as torch.chunk cuts) ranks 0-2 think the output has 8 rows and
rank 3 thinks 4, and the next collective hangs or aborts gloo. shardwise agrees the shapes of sharded outputs when an input is
uneven, and refuses pieces that do not fit the placements, on every rank, before any collective on data.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.testing import multi_rank


@multi_rank(world_size=4)
def test_an_uneven_input_gives_outputs_of_the_right_global_shape() -> None:
    from shardwise.dtensor_ops import Replicate, Shard, distribute_tensor
    from shardwise.dtensor_ops.debug import CommDebugMode
    from shardwise.dtensor_ops.experimental import local_map
    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    full = torch.arange(21.0).reshape(7, 3)
    x = distribute_tensor(full, mesh, [Shard(0)])
    assert tuple(x.to_local().shape) in ((2, 3), (1, 3))

    same_rows = local_map(lambda t: t * 2 + 1, out_placements=[Shard(0)])
    with CommDebugMode() as comm:
        doubled = same_rows(x)
    assert doubled.shape == (7, 3)
    torch.testing.assert_close(doubled.full_tensor(), full * 2 + 1)
    # Agreeing the shape: one small all-gather of every rank's metadata and local shape.
    assert comm.get_total_counts() == 1
    # The output is an ordinary DTensor: ops with collectives after it run on every rank alike.
    torch.testing.assert_close((doubled + x).redistribute(placements=[Replicate()]).to_local(), full * 3 + 1)

    # Sharded on another dim than the input: the transposed pieces (3, 2|1) make a (3, 7) global tensor.
    transposed = local_map(lambda t: t.t().contiguous(), out_placements=[Shard(1)])(x)
    assert transposed.shape == (3, 7) and transposed.stride() == (7, 1)
    torch.testing.assert_close(transposed.full_tensor(), full.t())

    # Replicated outputs (a reduction all-reduced inside the function) need no agreement: no extra collective.
    def column_sums(t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        sums = t.sum(0)
        dist.all_reduce(sums)
        return sums

    with CommDebugMode() as direct:
        column_sums(x.to_local())
    with CommDebugMode() as mapped:
        sums = local_map(column_sums, out_placements=[Replicate()])(x)
    assert mapped.get_total_counts() == direct.get_total_counts()
    torch.testing.assert_close(sums.full_tensor(), full.sum(0))


@multi_rank(world_size=4)
def test_an_uneven_input_of_many_dims_agrees_its_shape_in_a_second_gather() -> None:
    from shardwise.dtensor_ops import Shard, distribute_tensor
    from shardwise.dtensor_ops.debug import CommDebugMode
    from shardwise.dtensor_ops.experimental import local_map
    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    # 9 dims: more than the first gather carries, so the local shapes follow in a second one.
    full = torch.arange(7.0 * 2 * 3).reshape(7, 1, 1, 1, 1, 1, 1, 2, 3)
    x = distribute_tensor(full, mesh, [Shard(0)])
    with CommDebugMode() as comm:
        out = local_map(torch.neg, out_placements=[Shard(0)])(x)
    assert comm.get_total_counts() == 2
    assert out.shape == full.shape
    torch.testing.assert_close(out.full_tensor(), -full)


@multi_rank(world_size=4)
def test_uneven_shards_on_a_2d_mesh() -> None:
    from shardwise.dtensor_ops import Shard, distribute_tensor
    from shardwise.dtensor_ops.experimental import local_map
    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.arange(30.0).reshape(5, 6)
    for placements in ([Shard(0), Shard(1)], [Shard(0), Shard(0)], [Shard(1), Shard(0)]):
        x = distribute_tensor(full, mesh, placements)
        out = local_map(torch.neg, out_placements=placements)(x)
        assert out.shape == (5, 6), (placements, out.shape)
        torch.testing.assert_close(out.full_tensor(), -full)


@multi_rank(world_size=4)
def test_even_inputs_keep_pytorchs_even_assumption_without_communication() -> None:
    from shardwise.dtensor_ops import Shard, distribute_tensor
    from shardwise.dtensor_ops.debug import CommDebugMode
    from shardwise.dtensor_ops.experimental import local_map

    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    full = torch.arange(24.0).reshape(8, 3)
    x = distribute_tensor(full, mesh, [Shard(0)])
    with CommDebugMode() as comm:
        out = local_map(lambda t: t[:1], out_placements=[Shard(0)])(x)
    assert comm.get_total_counts() == 0
    assert out.shape == (4, 3)
    torch.testing.assert_close(out.full_tensor(), full[::2])


@multi_rank(world_size=4)
def test_pieces_that_do_not_fit_the_placements_are_refused_on_every_rank() -> None:
    import torch.distributed as dist

    from shardwise.dtensor_ops import Shard, distribute_tensor
    from shardwise.dtensor_ops.experimental import local_map
    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    x = distribute_tensor(torch.ones(7, 2), mesh, [Shard(0)])
    rank = dist.get_rank()
    # Rows 1, 2, 3, 4 on ranks 0..3: 10 rows chunked over 4 ranks would be 3, 3, 3, 1.
    grow = local_map(lambda t: torch.ones(rank + 1, 2), out_placements=[Shard(0)])
    with pytest.raises(ValueError, match=r"local_map output 0: the local tensor at mesh coordinate"):
        grow(x)
    # Every rank raised, and the group is still usable.
    check = torch.ones(1)
    dist.all_reduce(check)
    assert check.item() == 4.0
