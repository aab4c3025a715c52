"""Views that merge dims behind a sharded one keep the shard as a ``_StridedShard`` (as PyTorch 2.13 does).

Flattening ``(b, h, ...)`` sharded on ``h`` gives ``_StridedShard(flat, split_factor=b)`` without
communication where that layout holds exactly the same elements on every rank (uneven sizes
included), and splitting it back gives ``Shard(h)`` again.  The ops between the two reshapes of
attention (bmm, transpose, softmax, their backward) keep the strided batch dim, so the model zoo's
attention with sharded heads runs under the math SDPA backend with no collective.  Placements are
compared with PyTorch's DTensor on the same thread ranks, values with plain torch on the full tensor.
All tests run on 4 rank threads.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.distributed.tensor as torch_dtensor
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode
from torch.nn.attention import SDPBackend, sdpa_kernel

from shardwise.dtensor_ops import DeviceMesh, Placement, Replicate, Shard, distribute_tensor
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.dtensor_ops.experimental import implicit_replication
from shardwise.placement import _StridedShard, select_local_shard
from shardwise.testing import Attention, ModelArgs, run_on_threads

View = Callable[[torch.Tensor], torch.Tensor]


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _as_torch_placement(placement: Placement) -> torch_dtensor.Placement:
    if isinstance(placement, Shard):
        return torch_dtensor.Shard(placement.dim)
    assert isinstance(placement, Replicate)
    return torch_dtensor.Replicate()


def _same_placements(ours: tuple[Placement, ...], theirs: tuple[torch_dtensor.Placement, ...]) -> bool:
    """Our placements name PyTorch's (same class name, dim and split factor)."""
    if len(ours) != len(theirs):
        return False
    for mine, torch_one in zip(ours, theirs):
        if type(mine).__name__ != type(torch_one).__name__:
            return False
        if getattr(mine, "dim", None) != getattr(torch_one, "dim", None):
            return False
        if getattr(mine, "split_factor", None) != getattr(torch_one, "split_factor", None):
            return False
    return True


def _check_local_piece(viewed: torch.Tensor, expected_full: torch.Tensor, mesh: DeviceMesh, where: str) -> None:
    """This rank holds exactly the elements its placements name (not only a right full_tensor)."""
    from shardwise.dtensor_ops import DTensor

    assert isinstance(viewed, DTensor)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    expected = select_local_shard(expected_full, tuple(mesh.shape), coordinate, viewed.placements)
    torch.testing.assert_close(viewed.to_local(), expected, msg=where)
    torch.testing.assert_close(viewed.full_tensor(), expected_full, msg=where)


# (global shape, mesh shape, placements, view, expected placements of the view); PyTorch agrees on each.
AGREED_WITH_PYTORCH: list[tuple[tuple[int, ...], tuple[int, ...], tuple[Placement, ...], View, tuple[Placement, ...]]] = [
    # Attention's q/k/v: (b, h, s, d) with the heads sharded, flattened for the batched matmul.
    ((8, 4, 6, 2), (4,), (Shard(1),), lambda t: t.reshape(32, 6, 2), (_StridedShard(0, split_factor=8),)),
    ((2, 4, 3), (4,), (Shard(1),), lambda t: t.view(8, 3), (_StridedShard(0, split_factor=2),)),
    # Uneven but exact: 6 heads over 4 ranks hold 2, 2, 2, 0 of every batch row either way.
    ((3, 6, 5), (4,), (Shard(1),), lambda t: t.view(18, 5), (_StridedShard(0, split_factor=3),)),
    # Three dims merged, the sharded one last: the split factor is the product of the two before it.
    ((2, 3, 8, 2), (4,), (Shard(2),), lambda t: t.flatten(0, 2), (_StridedShard(0, split_factor=6),)),
    # Merged and split back: the heads are a Shard again.
    ((2, 4, 3, 5), (4,), (Shard(1),), lambda t: t.flatten(0, 1).unflatten(0, (2, 4)), (Shard(1),)),
    ((2, 4, 3, 5), (4,), (Shard(1),), lambda t: t.reshape(8, 15).view(2, 4, 15), (Shard(1),)),
    # A strided dim that maps one to one stays strided.
    ((2, 4, 6), (4,), (Shard(1),), lambda t: t.flatten(0, 1).view(8, 2, 3), (_StridedShard(0, split_factor=2),)),
    # 2-D meshes where only one mesh dim cuts the merged group.
    ((4, 4, 8), (2, 2), (Replicate(), Shard(1)), lambda t: t.view(16, 8), (Replicate(), _StridedShard(0, split_factor=4))),
    ((4, 4, 8), (2, 2), (Shard(2), Shard(1)), lambda t: t.view(16, 8), (Shard(1), _StridedShard(0, split_factor=4))),
]


def _views_match_pytorch() -> None:
    for shape, mesh_shape, placements, view, expected in AGREED_WITH_PYTORCH:
        where = f"{shape} {placements} on {mesh_shape}"
        full = randn(*shape)
        mesh = DeviceMesh("cpu", torch.arange(4).reshape(mesh_shape))
        dtensor = distribute_tensor(full, mesh, list(placements), src_data_rank=None)
        with CommDebugMode() as mode:
            viewed = view(dtensor)
        assert viewed.placements == expected and mode.get_total_counts() == 0, (
            f"{where}: {viewed.placements}, {mode.get_comm_counts()}"
        )
        _check_local_piece(viewed, view(full), mesh, where)

        torch_mesh = torch_init_device_mesh("cpu", mesh_shape)
        theirs = torch_dtensor.distribute_tensor(full, torch_mesh, [_as_torch_placement(p) for p in placements])
        with TorchCommDebugMode() as torch_mode:
            torch_viewed = view(theirs)
        assert torch_mode.get_total_counts() == 0, where
        assert _same_placements(viewed.placements, tuple(torch_viewed.placements)), (
            f"{where}: ours {viewed.placements}, PyTorch's {torch_viewed.placements}"
        )


def test_merges_behind_a_sharded_dim_give_pytorchs_strided_shards_without_communication() -> None:
    run_on_threads(_views_match_pytorch, world_size=4)


def _uneven_merges() -> None:
    mesh = DeviceMesh("cpu", torch.arange(4))
    # 3 heads over 4 ranks (1, 1, 1, 0), 2 elements each: the flat 12 cut as 2 pieces of 6 over 4 ranks
    # is (2, 2, 2, 0) per piece, the same elements; PyTorch refuses this flatten, ours keeps it exact.
    exact = randn(2, 3, 2)
    dtensor = distribute_tensor(exact, mesh, [Shard(1)], src_data_rank=None)
    with CommDebugMode() as mode:
        flat = dtensor.view(12)
        back = flat.view(2, 3, 2)
    assert flat.placements == (_StridedShard(0, split_factor=2),) and back.placements == (Shard(1),)
    assert mode.get_total_counts() == 0
    _check_local_piece(flat, exact.view(12), mesh, "(2, 3, 2) S(1) -> (12,)")
    _check_local_piece(back, exact, mesh, "(12,) back to (2, 3, 2)")
    # 5 rows of 3 over 4 ranks hold 6, 6, 3, 0 elements per batch row; the strided cut of 15 holds
    # 4, 4, 4, 3: not the same layout, so the input is redistributed (plain placements, exact values).
    inexact = randn(2, 5, 3, seed=1)
    dtensor = distribute_tensor(inexact, mesh, [Shard(1)], src_data_rank=None)
    with CommDebugMode() as mode:
        flat = dtensor.view(30)
    assert not any(isinstance(p, _StridedShard) for p in flat.placements) and mode.get_total_counts() == 1
    _check_local_piece(flat, inexact.view(30), mesh, "(2, 5, 3) S(1) -> (30,)")


def test_uneven_merges_are_strided_only_where_exact() -> None:
    run_on_threads(_uneven_merges, world_size=4)


def _matmul_and_bmm() -> None:
    mesh = DeviceMesh("cpu", torch.arange(4))
    x_full, y_full = randn(8, 4, 6, 3), randn(8, 4, 3, 5, seed=1)
    x = distribute_tensor(x_full, mesh, [Shard(1)], src_data_rank=None)
    y = distribute_tensor(y_full, mesh, [Shard(1)], src_data_rank=None)
    with CommDebugMode() as mode:
        product = torch.matmul(x, y)
    assert product.placements == (Shard(1),) and mode.get_total_counts() == 0, mode.get_comm_counts()
    _check_local_piece(product, torch.matmul(x_full, y_full), mesh, "matmul")

    torch_mesh = torch_init_device_mesh("cpu", (4,))
    theirs = torch.matmul(
        torch_dtensor.distribute_tensor(x_full, torch_mesh, [torch_dtensor.Shard(1)]),
        torch_dtensor.distribute_tensor(y_full, torch_mesh, [torch_dtensor.Shard(1)]),
    )
    assert _same_placements(product.placements, tuple(theirs.placements)), theirs.placements

    # A replicated operand is cut locally to the strided rows of its partner (no communication).
    strided = x.reshape(32, 6, 3)
    replicated_full = randn(32, 3, 2, seed=2)
    replicated = distribute_tensor(replicated_full, mesh, [Replicate()], src_data_rank=None)
    with CommDebugMode() as mode:
        mixed = torch.bmm(strided, replicated)
    assert mixed.placements == (_StridedShard(0, split_factor=8),) and mode.get_total_counts() == 0
    _check_local_piece(mixed, torch.bmm(x_full.reshape(32, 6, 3), replicated_full), mesh, "bmm(strided, replicated)")


def test_matmul_of_head_sharded_tensors_and_bmm_on_strided_batches_stay_local() -> None:
    run_on_threads(_matmul_and_bmm, world_size=4)


def _model_zoo_attention_under_the_math_backend() -> None:
    mesh = DeviceMesh("cpu", torch.arange(4))
    plain = Attention(ModelArgs(dim=16, n_heads=4, dropout_p=0.0, use_attn_mask=True)).double().eval()
    with torch.no_grad():  # the same weights on every rank thread
        for seed, parameter in enumerate(plain.parameters()):
            parameter.copy_(randn(*parameter.shape, seed=10 + seed) / 4)
    model = copy.deepcopy(plain)
    for name, layout in (("wq", Shard(0)), ("wk", Shard(0)), ("wv", Shard(0)), ("wo", Shard(1))):
        linear = getattr(model, name)
        linear.weight = torch.nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [layout], src_data_rank=None))
    x_full = randn(2, 5, 16, seed=3)
    x = distribute_tensor(x_full, mesh, [Replicate()], src_data_rank=None).requires_grad_()
    gradient = randn(2, 5, 16, seed=4)
    with CommDebugMode() as forward_mode:
        output = model(x)
    with CommDebugMode() as backward_mode:
        output.backward(distribute_tensor(gradient, mesh, [Replicate()], src_data_rank=None))
    plain_x = x_full.clone().requires_grad_()
    expected = plain(plain_x)
    expected.backward(gradient)
    assert forward_mode.get_total_counts() == 0, forward_mode.get_comm_counts()
    # x's gradient stays a partial sum over the heads: nothing moves in backward either.
    assert backward_mode.get_total_counts() == 0, backward_mode.get_comm_counts()
    torch.testing.assert_close(output.full_tensor(), expected)
    for name in ("wq", "wk", "wv", "wo"):
        grad = getattr(model, name).weight.grad
        assert grad is not None and grad.placements == getattr(model, name).weight.placements
        torch.testing.assert_close(grad.full_tensor(), getattr(plain, name).weight.grad)
    assert x.grad is not None
    torch.testing.assert_close(x.grad.full_tensor(), plain_x.grad)


def test_the_model_zoo_attention_with_sharded_heads_needs_no_collective_under_the_math_backend() -> None:
    # The math backend decomposes attention into matmuls (expand, reshape, bmm) and softmax, and adds the
    # causal mask as a plain tensor (hence implicit replication, as in bench_tp_step).  Both switches are
    # process-wide, so they are set once around the rank threads (entered per thread, their restores race).
    with sdpa_kernel(SDPBackend.MATH), implicit_replication():
        run_on_threads(_model_zoo_attention_under_the_math_backend, world_size=4)


def _ops_that_need_the_strided_dim_whole_gather_it() -> None:
    mesh = DeviceMesh("cpu", torch.arange(4))
    # linear on a sequence-sharded (b, s, d) input: the flattened rows are strided, the weight is cut on
    # its output dim; mm cannot pair those, so the strided mesh dim is gathered first (one all-gather).
    x_full, weight_full = randn(2, 8, 3), randn(4, 3, seed=1)
    x = distribute_tensor(x_full, mesh, [Shard(1)], src_data_rank=None)
    weight = distribute_tensor(weight_full, mesh, [Shard(0)], src_data_rank=None)
    out = torch.nn.functional.linear(x, weight)
    torch.testing.assert_close(out.full_tensor(), torch.nn.functional.linear(x_full, weight_full))
    # A contraction over a strided dim: the replicated partner must not be cut as a plain Shard of its rows.
    a_full, b_full = randn(2, 2, 4, seed=2), randn(2, 4, 3, seed=3)
    a = distribute_tensor(a_full, mesh, [Shard(2)], src_data_rank=None)
    b = distribute_tensor(b_full, mesh, [Replicate()], src_data_rank=None)
    torch.testing.assert_close(torch.tensordot(a, b, dims=2).full_tensor(), torch.tensordot(a_full, b_full, dims=2))
    # An op needing the strided dim whole (cumsum along it) runs on the gathered dim.
    flat = distribute_tensor(x_full, mesh, [Shard(1)], src_data_rank=None).flatten(0, 1)
    assert flat.placements == (_StridedShard(0, split_factor=2),)
    with CommDebugMode() as mode:
        summed = torch.cumsum(flat, 0)
    assert mode.get_total_counts() >= 1
    torch.testing.assert_close(summed.full_tensor(), torch.cumsum(x_full.flatten(0, 1), 0))


def test_ops_that_cannot_keep_a_view_made_strided_dim_gather_it_exactly() -> None:
    run_on_threads(_ops_that_need_the_strided_dim_whole_gather_it, world_size=4)


def _nested_cuts_of_one_group() -> None:
    # Two mesh dims cutting the merged group: PyTorch gives (Shard(0), _StridedShard(0, sf=2)); ours
    # keeps its plain nested layout (one all-to-all), with exact values.
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    full = randn(4, 4, 8)
    for placements in ((Shard(0), Shard(1)), (Shard(1), Shard(1))):
        dtensor = distribute_tensor(full, mesh, list(placements), src_data_rank=None)
        viewed = dtensor.view(16, 8)
        assert not any(isinstance(p, _StridedShard) for p in viewed.placements), viewed.placements
        _check_local_piece(viewed, full.view(16, 8), mesh, f"{placements} -> (16, 8)")


def test_nested_cuts_of_a_merged_group_keep_plain_layouts() -> None:
    run_on_threads(_nested_cuts_of_one_group, world_size=4)
