"""_ContextParallel applied with parallelize_module: SDPA inside the module's forward is ring attention.

PyTorch's module-wrapper usage: inputs cut with ``_context_parallel_shard`` and a load balancer, the
style on the attention module, the output gathered with ``context_parallel_unshard``.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardwise.dtensor_ops import init_device_mesh
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.dtensor_ops.experimental._attention import (
    _context_parallel_shard,
    _ContextParallel,
    _cp_options,
    _HeadTailLoadBalancer,
    context_parallel_unshard,
    set_rotate_method,
)
from shardwise.testing import multi_rank
from shardwise.tp_styles import ParallelStyle, parallelize_module

ALL_TO_ALL = "c10d_functional.all_to_all_single"


def _reset_options() -> None:
    # Options are process state: pooled rank processes keep them from one test to the next.
    _cp_options.enable_load_balance = True
    set_rotate_method("allgather")


def test_context_parallel_is_a_parallel_style() -> None:
    style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)
    assert isinstance(style, ParallelStyle)


class _SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        query, key, value = self.qkv(x).view(batch, seq, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(batch, seq, dim))


@multi_rank
def test_context_parallel_style_on_a_module_with_context_parallel_shard() -> None:
    _reset_options()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(5)
    model = _SelfAttention(16, 4)
    x = torch.randn(2, 22, 16)  # 22 tokens: not a multiple of 2W = 8
    expected = model(x)
    expected.sum().backward()
    assert model.qkv.weight.grad is not None
    expected_grad = model.qkv.weight.grad.clone()
    model.zero_grad()

    # The style is a ParallelStyle by registration (dtensor_ops sits below tp_styles), hence the cast for mypy.
    style = cast(ParallelStyle, _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA))
    parallelize_module(model, mesh, style)
    balancer = _HeadTailLoadBalancer(22, world, "cpu")
    (local_x,) = _context_parallel_shard(mesh, [x], [1], load_balancer=balancer)
    set_rotate_method("alltoall")
    with CommDebugMode() as comm:
        local_out = model(local_x)
    assert {str(k): v for k, v in comm.get_comm_counts().items()} == {ALL_TO_ALL: world - 1}
    local_out.sum().backward()
    (full_out,) = context_parallel_unshard(mesh, [local_out.detach()], [1], load_balancer=balancer)
    torch.testing.assert_close(full_out, expected.detach(), atol=2e-5, rtol=1e-5)
    # Weights are replicated over cp: each rank's gradient is its tokens' share; their sum is the whole.
    weight_grad = model.qkv.weight.grad
    assert weight_grad is not None
    dist.all_reduce(weight_grad)
    torch.testing.assert_close(weight_grad, expected_grad, atol=5e-5, rtol=1e-5)
    # Outside the module's forward SDPA is plain.
    q = torch.randn(1, 1, 4, 2)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q), F.scaled_dot_product_attention(q.clone(), q.clone(), q.clone()))
