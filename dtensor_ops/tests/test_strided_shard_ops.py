"""DTensors laid out with _StridedShard (FSDP over TP): element-wise ops run in place, ops that need other
rows move the strided input first (priced like any redistribution), and redistribution to and from the
layout is exact (rank threads)."""

from __future__ import annotations

import pytest
import torch

from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.placement import Placement, _StridedShard, select_local_shard
from shardwise.testing import run_on_threads

FSDP_OVER_TP: tuple[Placement, ...] = (_StridedShard(0, split_factor=2), Shard(0))
funcol = torch.ops.c10d_functional


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _laid_out(full: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> DTensor:
    local = select_local_shard(full, mesh.shape, mesh.get_coordinate(), placements).clone()
    return DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride())


def _redistribution_is_exact(rows: int) -> None:
    mesh = _mesh()
    full = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    strided = _laid_out(full, mesh, FSDP_OVER_TP)
    with CommDebugMode() as comm:
        gathered = strided.full_tensor()
    assert torch.equal(gathered, full)
    # One collective per mesh dim (which kinds is the cost model's choice: an all-to-all and an all-gather
    # on gloo's profile, where an all-to-all's latency is the lower).
    assert comm.get_total_counts() == 2, dict(comm.get_comm_counts())
    for target in [(Shard(0), Replicate()), (Replicate(), Shard(1)), (Shard(1), Shard(0))]:
        moved = strided.redistribute(mesh, target)
        assert moved.placements == target
        assert torch.equal(moved.to_local(), select_local_shard(full, mesh.shape, mesh.get_coordinate(), target))
    replicated = _laid_out(full, mesh, (Replicate(), Replicate()))
    with CommDebugMode() as comm:
        back = replicated.redistribute(mesh, FSDP_OVER_TP)
    assert comm.get_total_counts() == 0  # a local selection
    assert torch.equal(back.to_local(), strided.to_local())
    # Gradients flow back through the strided layout.
    leaf = strided.detach().requires_grad_(True)
    (leaf.full_tensor() * torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)).sum().backward()
    assert leaf.grad is not None and leaf.grad.placements == FSDP_OVER_TP
    assert torch.equal(leaf.grad.to_local(), strided.to_local())


@pytest.mark.parametrize("rows", [8, 7, 5, 2])
def test_redistribution_to_and_from_strided_shards_is_exact(rows: int) -> None:
    run_on_threads(_redistribution_is_exact, rows, world_size=4)


def _elementwise_ops_stay_local() -> None:
    mesh = _mesh()
    a_full = torch.randn(7, 3, generator=torch.Generator().manual_seed(1))
    b_full = torch.randn(7, 3, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(3, generator=torch.Generator().manual_seed(3))
    a, b = _laid_out(a_full, mesh, FSDP_OVER_TP), _laid_out(b_full, mesh, FSDP_OVER_TP)
    replicated_bias = _laid_out(bias, mesh, (Replicate(), Replicate()))
    with CommDebugMode() as comm:
        result = (a * 2 + b).relu() + replicated_bias
        a.add_(b, alpha=0.5)
        total = a.sum()
    assert comm.get_total_counts() == 0
    assert result.placements == FSDP_OVER_TP
    torch.testing.assert_close(result.full_tensor(), (a_full * 2 + b_full).relu() + bias)
    torch.testing.assert_close(a.full_tensor(), a_full + 0.5 * b_full)
    assert all(p.is_partial() for p in total.placements)
    torch.testing.assert_close(total.full_tensor(), (a_full + 0.5 * b_full).sum())
    # Foreach ops decide element by element: strided and plain shards may share one list.
    plain = _laid_out(b_full, mesh, (Shard(0), Replicate()))
    torch._foreach_mul_([a, plain], 3.0)
    assert a.placements == FSDP_OVER_TP and plain.placements == (Shard(0), Replicate())
    torch.testing.assert_close(plain.full_tensor(), b_full * 3)


def test_elementwise_ops_keep_the_strided_layout_without_communication() -> None:
    run_on_threads(_elementwise_ops_stay_local, world_size=4)


def _shards_paired_by_a_rule_keep_the_strided_rows() -> None:
    mesh = _mesh()
    weight_full = torch.randn(7, 5, generator=torch.Generator().manual_seed(4))
    x_full = torch.randn(3, 7, generator=torch.Generator().manual_seed(5))
    weight = _laid_out(weight_full, mesh, FSDP_OVER_TP)
    x = _laid_out(x_full, mesh, (Replicate(), Replicate()))
    with CommDebugMode() as comm:
        # The strided rows of the weight are the contraction dim: x is cut into the same columns locally,
        # and the products add up across ranks (a Partial on both mesh dims).
        product = x @ weight
        # A transpose moves the strided rows to dim 1, the same indices.
        transposed = weight.t()
    assert comm.get_total_counts() == 0, dict(comm.get_comm_counts())
    assert all(p.is_partial() for p in product.placements), product.placements
    assert transposed.placements == (_StridedShard(1, split_factor=2), Shard(1))
    torch.testing.assert_close(product.full_tensor(), x_full @ weight_full)
    torch.testing.assert_close(transposed.full_tensor(), weight_full.t())


def test_a_contraction_and_a_transpose_keep_the_strided_rows_without_communication() -> None:
    run_on_threads(_shards_paired_by_a_rule_keep_the_strided_rows, world_size=4)


def _reductions_over_strided_pieces_of_unequal_sizes() -> None:
    mesh = init_device_mesh("cpu", (2,))
    # 8 rows cut into 3 chunks (3, 3, 2), each split over 2 ranks: rank 0 holds 2+2+1 = 5 rows, rank 1
    # holds 3, where Shard(0) would give 4 and 4. A mean of the two local means would be wrong.
    layout = (_StridedShard(0, split_factor=3),)
    full = torch.arange(16.0).reshape(8, 2) ** 2
    strided = _laid_out(full, mesh, layout)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None and strided.to_local().shape[0] == (5 if coordinate[0] == 0 else 3)
    # The reduction rules' exactness checks reason about Shard pieces, so these strided pieces (sizes
    # other than Shard's) are moved first, even for a sum, which would not need it: correct, not free.
    torch.testing.assert_close(strided.sum(0).full_tensor(), full.sum(0))
    torch.testing.assert_close(strided.mean(0).full_tensor(), full.mean(0))
    torch.testing.assert_close(strided.mean().full_tensor(), full.mean())
    torch.testing.assert_close(strided.amax(0).full_tensor(), full.amax(0))


def test_reductions_over_strided_pieces_of_unequal_sizes_are_exact() -> None:
    run_on_threads(_reductions_over_strided_pieces_of_unequal_sizes, world_size=2)


def _layout_dependent_ops_move_the_strided_input() -> None:
    mesh = _mesh()
    full = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    strided = _laid_out(full, mesh, FSDP_OVER_TP)
    plain = _laid_out(full, mesh, (Shard(0), Shard(0)))
    gather, all_to_all = funcol.all_gather_into_tensor, funcol.all_to_all_single
    for name, run, expected, collectives, placements in [
        # A strided and a plain shard of dim 0 hold different rows: the plain one moves into the strided
        # layout (one all-to-all over dp, the planner's strided step) and the sum stays strided.
        ("strided + plain", lambda: strided + plain, full + full, {all_to_all: 1}, FSDP_OVER_TP),
        # Merging the strided dim: back to TP's layout first (one all-gather over dp), then a plain view.
        ("reshape", lambda: strided.reshape(24), full.reshape(24), {gather: 1}, (Replicate(), Shard(0))),
        # A scan along the strided dim needs it whole: the cost model moves the shards to dim 1.
        ("cumsum", lambda: torch.cumsum(strided, 0), torch.cumsum(full, 0), {gather: 1, all_to_all: 1}, (Shard(1), Shard(1))),
    ]:
        with CommDebugMode() as comm:
            result = run()
        assert {op: n for op, n in comm.get_comm_counts().items() if n} == collectives, (name, comm.get_comm_counts())
        assert result.placements == placements, (name, result.placements)
        torch.testing.assert_close(result.full_tensor(), expected)


def test_ops_that_depend_on_which_rows_a_rank_holds_move_the_strided_input_first() -> None:
    run_on_threads(_layout_dependent_ops_move_the_strided_input, world_size=4)


def _distribute_tensor_lays_out_strided_shards(rows: int) -> None:
    mesh = _mesh()
    full = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    expected = select_local_shard(full, mesh.shape, mesh.get_coordinate(), FSDP_OVER_TP)
    # Every rank passes a different tensor: the source's (mesh index 0 on every dim) wins.
    mine = full + 100 * torch.distributed.get_rank()
    with CommDebugMode() as comm:
        laid_out = distribute_tensor(mine, mesh, FSDP_OVER_TP)
    assert comm.get_comm_counts()[funcol.all_gather_into_tensor] == 0
    assert laid_out.placements == FSDP_OVER_TP and laid_out.shape == full.shape
    assert torch.equal(laid_out.to_local(), expected)
    assert torch.equal(laid_out.full_tensor(), full)
    with CommDebugMode() as comm:
        cut_locally = distribute_tensor(full, mesh, FSDP_OVER_TP, src_data_rank=None)
    assert comm.get_total_counts() == 0
    assert torch.equal(cut_locally.to_local(), expected)


@pytest.mark.parametrize("rows", [8, 7, 2])
def test_distribute_tensor_with_strided_shards(rows: int) -> None:
    run_on_threads(_distribute_tensor_lays_out_strided_shards, rows, world_size=4)


def _gathering_the_strided_mesh_dim_alone(rows: int) -> None:
    mesh = _mesh()
    full = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    strided = _laid_out(full, mesh, FSDP_OVER_TP)
    tensor_parallel = (Replicate(), Shard(0))
    with CommDebugMode() as comm:
        moved = strided.redistribute(mesh, tensor_parallel)
    assert torch.equal(moved.to_local(), select_local_shard(full, mesh.shape, mesh.get_coordinate(), tensor_parallel))
    if rows % 4 == 0:
        # Back to TP's layout: one all-gather over dp, not the whole tensor (two all-gathers).
        assert comm.get_comm_counts()[funcol.all_gather_into_tensor] == 1 and comm.get_total_counts() == 1
    # Dim 1 cut by TP, dim 0 strided over dp by another factor: the same gather along dim 0.
    wide = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4)
    layout = (_StridedShard(0, split_factor=1), Shard(1))
    cut = _laid_out(wide, mesh, layout)
    back = cut.redistribute(mesh, (Replicate(), Shard(1)))
    assert torch.equal(back.to_local(), select_local_shard(wide, mesh.shape, mesh.get_coordinate(), (Replicate(), Shard(1))))


@pytest.mark.parametrize("rows", [8, 7, 5, 2])
def test_gathering_the_strided_mesh_dim_alone_is_exact(rows: int) -> None:
    run_on_threads(_gathering_the_strided_mesh_dim_alone, rows, world_size=4)
