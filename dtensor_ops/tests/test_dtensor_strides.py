"""A DTensor's global stride is the same on every rank, whatever shape each rank's shard has."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.testing import multi_rank


def _strides_on_all_ranks(tensor: torch.Tensor) -> list[tuple[int, ...]]:
    gathered: list[tuple[int, ...] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, tuple(tensor.stride()))
    return [s for s in gathered if s is not None]


@multi_rank(world_size=4)
def test_stride_agrees_across_ranks_with_size_one_and_empty_shards() -> None:
    mesh = init_device_mesh("cpu", (4,))
    # 10 columns over 4 ranks: 3, 3, 3, 1; 3 columns: 1, 1, 1, 0.
    for columns in (10, 3, 5):
        full = torch.randn(6, columns)
        sharded = distribute_tensor(full, mesh, [Shard(1)])
        assert _strides_on_all_ranks(sharded) == [full.stride()] * 4, columns
    transposed = torch.randn(10, 6).t()
    sharded_t = distribute_tensor(transposed, mesh, [Shard(1)])
    assert _strides_on_all_ranks(sharded_t) == [transposed.stride()] * 4
    assert torch.equal(sharded_t.full_tensor(), transposed)


@multi_rank(world_size=4)
def test_gradient_layout_follows_the_parameter_on_every_rank() -> None:
    mesh = init_device_mesh("cpu", (4,))
    weight = distribute_tensor(torch.randn(6, 10), mesh, [Shard(1)]).requires_grad_()
    (weight.to_local() * 2).sum().backward()
    assert weight.grad is not None
    assert _strides_on_all_ranks(weight.grad) == [weight.stride()] * 4
    local = DTensor.from_local(torch.ones(2, 1), mesh, [Replicate()])
    assert _strides_on_all_ranks(local) == [(1, 1)] * 4


class _GradientStoredDimOneMajor(torch.autograd.Function):
    """Identity whose backward hands back its gradient stored dim-1-major, as sdpa's CPU kernel does."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.transpose(1, 2).contiguous().transpose(1, 2)


@multi_rank(world_size=4)
def test_local_gradient_is_laid_out_like_the_global_stride() -> None:
    mesh = init_device_mesh("cpu", (4,))
    source = distribute_tensor(torch.randn(4, 8, 6), mesh, [Shard(0)]).requires_grad_()
    out = _GradientStoredDimOneMajor.apply(source.to_local())
    (out * 3).sum().backward()
    assert source.grad is not None
    # The DTensor gradient reports the contiguous global stride, so its local piece must be contiguous
    # too, or views of the gradient fail on the local tensor.
    assert source.grad.to_local().is_contiguous()
    merged = source.grad.view(4, 48)
    torch.testing.assert_close(merged.full_tensor(), torch.full((4, 48), 3.0))
