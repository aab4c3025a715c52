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


def test_philox_state_reads_and_writes_seed_and_offset_as_64_bit_tensors() -> None:
    from shardwise.dtensor_ops._random import _PhiloxState

    state = _PhiloxState(torch.zeros(16, dtype=torch.uint8))
    big_seed = torch.tensor([2**63 + 5], dtype=torch.uint64)  # does not fit an int64
    state.seed = big_seed
    state.seed = state.seed.clone()  # read back and written again unchanged
    state.offset = torch.tensor([12], dtype=torch.int64)
    assert state.seed.item() == big_seed.item() and state.offset.item() == 12
    assert state.state[:8].tolist() == [5, 0, 0, 0, 0, 0, 0, 128] and state.state[8].item() == 12
    with pytest.raises(AssertionError, match="one-element 64-bit tensor"):
        state.offset = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="16-byte uint8"):
        _PhiloxState(torch.zeros(8, dtype=torch.uint8))


@multi_rank(world_size=4)
def test_distribute_tensor_scatters_shards_with_one_c10d_scatter_even_or_uneven() -> None:
    import torch.distributed as dist

    from shardwise.dtensor_ops import Shard, distribute_tensor
    from shardwise.dtensor_ops.debug import CommDebugMode
    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    rank = dist.get_rank()
    for shape, dim in (((8, 3), 0), ((3, 7), 1), ((2, 5), 0)):
        full = torch.arange(float(shape[0] * shape[1])).reshape(shape)
        mine = full if rank == 0 else full + 100  # only the source rank's values count
        with CommDebugMode() as comms:
            sharded = distribute_tensor(mine, mesh, [Shard(dim)])
        assert comms.get_comm_counts()[torch.ops.c10d.scatter_] == 1, comms.get_comm_counts()
        expected = torch.chunk(full, 4, dim)
        piece = expected[rank] if rank < len(expected) else full.narrow(dim, 0, 0)
        assert torch.equal(sharded.to_local(), piece)


@multi_rank(world_size=4)
def test_constant_pad_keeps_a_pending_reduction_where_padding_commutes_with_it() -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from shardwise.dtensor_ops import DTensor, Partial, Replicate
    from shardwise.dtensor_ops.debug import CommDebugMode
    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    contributions = [torch.arange(12.0).reshape(3, 4) * (rank + 1) for rank in range(4)]
    mine = contributions[dist.get_rank()]
    for reduce_op, value, keeps in (("sum", 0.0, True), ("sum", 1.0, False), ("max", 2.0, True), ("avg", 3.0, True)):
        partial = DTensor.from_local(mine, mesh, [Partial(reduce_op)])
        with CommDebugMode() as comms:
            padded = F.pad(partial, [1, 2], value=value)
        assert (padded.placements == (Partial(reduce_op),)) is keeps, (reduce_op, value, padded.placements)
        assert (comms.get_total_counts() == 0) is keeps
        whole = partial.redistribute(mesh, [Replicate()]).to_local()
        torch.testing.assert_close(padded.full_tensor(), F.pad(whole, [1, 2], value=value))
