"""Drop-in behaviours PyTorch's own DTensor tests rely on: Replicate -> Partial, Partial gradients,
shard orders, explicit redistribution, composite ops under inference mode. Across gloo ranks,
against plain torch."""

from __future__ import annotations

import pytest
import torch

from shardwise.testing import multi_rank


def _mesh(shape: tuple[int, ...]) -> object:
    from shardwise.mesh import init_device_mesh

    return init_device_mesh("cpu", shape)


@multi_rank(world_size=4)
def test_replicate_to_partial_every_reduce_op_is_local_and_exact() -> None:
    from shardwise.dtensor_ops import Partial, Replicate, distribute_tensor
    from shardwise.dtensor_ops._redistribute import Redistribute
    from shardwise.dtensor_ops.debug import CommDebugMode

    mesh = _mesh((4,))
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    replicated = distribute_tensor(x, mesh, [Replicate()])
    for reduce_op in ("sum", "avg", "max", "min"):
        with CommDebugMode() as comms:
            partial = Redistribute.apply(replicated, mesh, [Partial(reduce_op)])
        assert comms.get_total_counts() == 0
        assert partial.placements == (Partial(reduce_op),)
        # Each rank holds an equal share of a sum; avg/max/min of equal values is the value.
        expected_local = x / 4 if reduce_op == "sum" else x
        torch.testing.assert_close(partial.to_local(), expected_local)
        torch.testing.assert_close(partial.full_tensor(), x)
    # Integers cannot be split exactly: the first rank keeps the value.
    ints = distribute_tensor(torch.arange(6), mesh, [Replicate()])
    assert torch.equal(Redistribute.apply(ints, mesh, [Partial()]).full_tensor(), torch.arange(6))


@multi_rank(world_size=4)
def test_partial_product_reduces_scatters_splits_and_comes_from_replicate_exactly() -> None:
    from shardwise.dtensor_ops import DTensor, Partial, Replicate, Shard, distribute_tensor
    from shardwise.dtensor_ops._redistribute import Redistribute

    assert Partial("prod") == Partial("product") and Partial("prod").reduce_op == "product"
    mesh = _mesh((2, 2))
    rank = torch.distributed.get_rank()
    # Every rank's factor, known to all: the product over the 2x2 mesh is their elementwise product.
    factors = [torch.linspace(0.5, 1.5, 24).reshape(6, 4) + 0.1 * r for r in range(4)]
    whole = factors[0] * factors[1] * factors[2] * factors[3]
    partial = DTensor.from_local(factors[rank], mesh, [Partial("product"), Partial("product")], run_check=False)
    torch.testing.assert_close(partial.full_tensor(), whole)
    for target in ([Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Replicate()]):
        torch.testing.assert_close(partial.redistribute(mesh, target).full_tensor(), whole)
    # A view keeps the pending product; one mesh dim reduced, the other kept.
    for piece, expected in zip(torch.split(partial, 4, dim=0), torch.split(whole, 4, dim=0)):
        assert piece.placements == (Partial("product"), Partial("product"))
        torch.testing.assert_close(piece.full_tensor(), expected)
    half = partial.redistribute(mesh, [Replicate(), Partial("product")])
    torch.testing.assert_close(half.full_tensor(), whole)
    # masked_fill of a pending product is done on the reduced value (no one-rank rule applies).
    mask = torch.zeros(6, 4, dtype=torch.bool)
    mask[::2] = True
    filled = partial.masked_fill(distribute_tensor(mask, mesh, [Replicate(), Replicate()]), 2.0)
    torch.testing.assert_close(filled.full_tensor(), whole.masked_fill(mask, 2.0))
    # Replicate -> Partial(product) (PyTorch refuses: an n-th root is not exact): the value on each
    # group's first rank, ones elsewhere; integers too.
    for value in (whole, torch.arange(-12, 12).reshape(6, 4)):
        replicated = distribute_tensor(value, mesh, [Replicate(), Replicate()])
        made = Redistribute.apply(replicated, mesh, [Replicate(), Partial("product")])
        expected_local = value if mesh.get_coordinate()[1] == 0 else torch.ones_like(value)
        assert torch.equal(made.to_local(), expected_local)
        assert torch.equal(made.full_tensor(), value)


@multi_rank(world_size=4)
def test_user_redistribute_to_partial_is_refused_with_both_wordings() -> None:
    from shardwise.dtensor_ops import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = _mesh((2, 2))
    dt = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Replicate()])
    with pytest.raises(RuntimeError, match="Can not redistribute"):
        dt.redistribute(mesh, [Shard(0), Partial()])
    partial = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0), Partial("max")])
    with pytest.raises(RuntimeError, match="Can not redistribute"):
        partial.redistribute(mesh, [Replicate(), Partial("sum")])
    assert partial.redistribute(mesh, [Replicate(), Partial("max")]).placements == (Replicate(), Partial("max"))


@multi_rank(world_size=4)
def test_partial_to_partial_backward_keeps_partial_without_communication() -> None:
    from shardwise.dtensor_ops import DTensor, Partial, distribute_tensor
    from shardwise.dtensor_ops.debug import CommDebugMode

    mesh = _mesh((4,))
    partial = distribute_tensor(torch.ones(3, 2, requires_grad=True), mesh, [Partial()])
    same = partial.redistribute(mesh, [Partial()])
    grad = DTensor.from_local(torch.full((3, 2), 2.0), mesh, [Partial()])
    with CommDebugMode() as comms:
        same.backward(grad)
    # The DTensor gradient stays a pending sum: its value (8 everywhere) is what a Replicate one would hold.
    assert comms.get_total_counts() == 0
    assert partial.grad is not None and partial.grad.placements == (Partial(),)
    torch.testing.assert_close(partial.grad.to_local(), torch.full((3, 2), 2.0))
    torch.testing.assert_close(partial.grad.full_tensor(), torch.full((3, 2), 8.0))


@multi_rank(world_size=4)
def test_matmul_and_linear_under_inference_mode_match_torch() -> None:
    from shardwise.dtensor_ops import Replicate, Shard, distribute_tensor

    mesh = _mesh((4,))
    torch.manual_seed(1)
    x, w = torch.randn(2, 5, 8), torch.randn(8, 8)
    dx = distribute_tensor(x, mesh, [Replicate()])
    dw = distribute_tensor(w, mesh, [Shard(0)])
    with torch.inference_mode():
        y = torch.matmul(dx, dw)
        z = torch.nn.functional.linear(dx, dw)
    torch.testing.assert_close(y.full_tensor(), x @ w)
    torch.testing.assert_close(z.full_tensor(), torch.nn.functional.linear(x, w))
    assert z.placements == (Shard(2),)


@multi_rank(world_size=8)
def test_shard_orders_lay_data_out_as_strided_shards_and_redistribute_exactly() -> None:
    from shardwise.dtensor_ops import Replicate, Shard, distribute_tensor
    from shardwise.placement import _StridedShard
    from shardwise.dtensor_ops._dtensor_spec import DTensorSpec, ShardOrderEntry
    from shardwise.testing import generate_shard_orders, make_full_tensor, patched_distribute_tensor, redistribute

    mesh = _mesh((2, 2, 2))
    torch.manual_seed(2)
    x = torch.randn(9, 6)
    order = (ShardOrderEntry(0, (2, 0, 1)),)
    ordered = patched_distribute_tensor(x, mesh, [Shard(0)] * 3, order)
    assert ordered.placements == (Shard(0),) * 3 and ordered._spec.shard_order == order
    strided = DTensorSpec._convert_shard_order_to_StridedShard(order, (Shard(0),) * 3, mesh)
    assert strided == (_StridedShard(0, split_factor=2), _StridedShard(0, split_factor=2), Shard(0))
    assert DTensorSpec._maybe_convert_StridedShard_to_shard_order(strided, mesh) == order
    torch.testing.assert_close(ordered.to_local(), distribute_tensor(x, mesh, strided).to_local())
    torch.testing.assert_close(ordered.full_tensor(), x)
    # From every order to the next: the pieces are those of distributing straight into the target.
    previous = ordered
    for target in list(generate_shard_orders(mesh, 2))[::7]:
        moved = redistribute(previous, mesh, None, target)
        direct = patched_distribute_tensor(x, mesh, None, target)
        torch.testing.assert_close(moved.to_local(), direct.to_local())
        torch.testing.assert_close(make_full_tensor(moved), x)
        previous = moved
    assert redistribute(previous, mesh, [Replicate()] * 3, None).to_local().shape == x.shape


def test_shard_order_spec_checks_and_identity() -> None:
    from shardwise.placement import DTensorSpec, Replicate, Shard, ShardOrderEntry, TensorMeta, _StridedShard
    from shardwise.testing import FakeMesh

    mesh = FakeMesh((2, 2))
    meta = TensorMeta(torch.Size([8]), (1,), torch.float32)
    default = DTensorSpec(mesh, (Shard(0), Shard(0)), meta, shard_order=(ShardOrderEntry(0, (0, 1)),))
    assert default == DTensorSpec(mesh, (Shard(0), Shard(0)), meta) and not default.has_explicit_shard_order
    reversed_ = DTensorSpec(mesh, (Shard(0), Shard(0)), meta, shard_order=(ShardOrderEntry(0, (1, 0)),))
    assert reversed_ != default and hash(reversed_) != hash(default)
    assert reversed_.layout_placements == (_StridedShard(0, split_factor=2), Shard(0))
    assert str(reversed_) == "Spec(S(0)[1]S(0)[0] on (8,))"
    with pytest.raises(ValueError, match="placement is R"):
        DTensorSpec(mesh, (Shard(0), Replicate()), meta, shard_order=(ShardOrderEntry(0, (1, 0)),))
    assert DTensorSpec._maybe_convert_StridedShard_to_shard_order((_StridedShard(0, split_factor=2), Shard(1)), mesh) is None


@multi_rank(world_size=4)
def test_explicit_redistribution_context_refuses_implicit_moves() -> None:
    from shardwise.dtensor_ops import Replicate, Shard, distribute_tensor
    from shardwise.dtensor_ops._utils import ExplicitRedistributionContext

    mesh = _mesh((4,))
    x, a = torch.randn(8, 16), torch.randn(16, 16)
    dx, da = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(a, mesh, [Shard(0)])
    with ExplicitRedistributionContext():
        with pytest.raises(RuntimeError, match="Implicit redistribution"):
            torch.matmul(dx, da)
        replicated = da.redistribute(mesh, [Replicate()])
        torch.testing.assert_close(torch.matmul(dx, replicated).full_tensor(), x @ a)
        with ExplicitRedistributionContext(enable=False):
            torch.testing.assert_close(torch.matmul(dx, da).full_tensor(), x @ a, atol=1e-5, rtol=1e-5)


@multi_rank(world_size=8)
def test_init_device_mesh_smaller_than_world_leaves_other_ranks_outside() -> None:
    import torch.distributed as dist

    mesh = _mesh((2, 2))
    rank = dist.get_rank()
    coordinate = mesh.get_coordinate()  # type: ignore[attr-defined]
    assert (coordinate is None) == (rank >= 4)
    if coordinate is not None:
        assert list(coordinate) == [rank // 2, rank % 2]


@multi_rank(world_size=4)
def test_strided_shard_split_and_gather_helpers() -> None:
    import torch.distributed as dist

    from shardwise.placement import Shard, _StridedShard

    mesh = _mesh((4,))
    x = torch.arange(8)
    strided = _StridedShard(0, split_factor=2)
    pieces, pads = strided._split_tensor(x, 4)
    assert [p.tolist() for p in pieces] == [[0, 4], [1, 5], [2, 6], [3, 7]] and pads == [0, 0, 0, 0]
    rank = dist.get_rank()
    assert torch.equal(strided._to_replicate_tensor(pieces[rank], mesh, 0, [8]), x)
    plain, _ = Shard(0)._split_tensor(x, 4)
    assert torch.equal(Shard(0)._to_replicate_tensor(plain[rank], mesh, 0, [8]), x)


@multi_rank(world_size=4)
def test_pytorch_redistribute_local_tensor_refuses_another_partial_op_before_any_collective() -> None:
    from shardwise.dtensor_ops import DTensor, Partial, Replicate
    from shardwise.dtensor_ops._redistribute import redistribute_local_tensor
    from shardwise.dtensor_ops.debug import CommDebugMode

    mesh = _mesh((4,))
    local = torch.full((4, 4), float(torch.distributed.get_rank()))
    summed = DTensor.from_local(local, mesh, [Partial()], run_check=False)
    to_avg = summed._spec.with_placements((Partial("avg"),))
    with CommDebugMode() as comms:
        for catch_as in (AssertionError, ValueError):
            with pytest.raises(catch_as, match="from one partial type .* to another .* is unsupported"):
                redistribute_local_tensor(local, summed._spec, to_avg)
    assert comms.get_total_counts() == 0
    # The same reduce op, or a reduction, is PyTorch's contract and runs.
    reduced = redistribute_local_tensor(local, summed._spec, summed._spec.with_placements((Replicate(),)))
    torch.testing.assert_close(reduced, torch.full((4, 4), 6.0))

