"""The context-parallel dispatcher where its TorchFunctionMode is off: backward-time recomputation.

``_enable_context_parallel_dispatcher()`` promises (as PyTorch's does) that SDPA on DTensors whose sequence
dim is sharded over a mesh dim runs as ring attention, output laid out as the query.  A ``TorchFunctionMode``
is off while it handles a call, and ``loss.backward()`` is such a call: an activation-checkpointed block
is recomputed inside it, so there SDPA reaches the CPU flash kernel's DTensor op directly.  That op must
keep the query's layout too (torchtitan's CP wrapper calls ``to_local()`` on the result and expects this
rank's sequence piece), and the recomputation must record the graph the forward did.

Checked against attention on the whole sequence, on a (cp=2, tp=2) mesh of 4 gloo ranks with
``[Shard(2), Shard(1)]`` inputs (sequence over cp, heads over tp), as torchtitan's CP x TP runs it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from shardwise.dtensor_ops import DTensor, Shard, distribute_tensor, init_device_mesh
from shardwise.dtensor_ops.experimental._attention import (
    _cp_options,
    _disable_context_parallel_dispatcher,
    _enable_context_parallel_dispatcher,
    _HeadTailLoadBalancer,
    set_rotate_method,
)
from shardwise.testing import multi_rank

BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 16, 8


def _block(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    # Work before and after the attention, so a recomputation replays more than the attention alone.
    return F.scaled_dot_product_attention(query * 2.0, key, value.sin(), is_causal=True) * 3.0


def _save_collectives_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # torchtitan's selective checkpointing keeps these outputs and recomputes the rest.
    saved = (torch.ops._c10d_functional.all_to_all_single.default, torch.ops._c10d_functional.reduce_scatter_tensor.default)
    return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _run_block(how: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if how == "eager":
        return _block(query, key, value)
    if how == "checkpoint":
        out: torch.Tensor = checkpoint(_block, query, key, value, use_reentrant=False)
        return out
    out = checkpoint(
        _block, query, key, value, use_reentrant=False,
        context_fn=lambda: create_selective_checkpoint_contexts(_save_collectives_policy),
    )  # fmt: skip
    return out


@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
@pytest.mark.parametrize("how", ["eager", "checkpoint", "selective"])
@multi_rank(world_size=4)
def test_dispatcher_ring_attention_matches_whole_sequence_also_when_recomputed_in_backward(how: str, rotate: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    generator = torch.Generator().manual_seed(11)
    query, key, value = (torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator) for _ in range(3))
    weights = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator)
    reference = [t.clone().requires_grad_(True) for t in (query, key, value)]
    expected = _block(*reference)
    (expected * weights).sum().backward()

    order = _HeadTailLoadBalancer(SEQ, 2, "cpu")._generate_indices()[0]
    restore = torch.argsort(order)
    placements = [Shard(2), Shard(1)]
    inputs = [distribute_tensor(t[:, :, order], mesh, placements).requires_grad_(True) for t in (query, key, value)]
    sharded_weights = distribute_tensor(weights[:, :, order], mesh, placements)
    set_rotate_method(rotate)
    _enable_context_parallel_dispatcher()
    try:
        out = _run_block(how, *inputs)
        (out * sharded_weights).sum().backward()
    finally:
        _disable_context_parallel_dispatcher()
        _cp_options.enable_load_balance = True
        set_rotate_method("allgather")

    assert isinstance(out, DTensor)
    assert out.placements == (Shard(2), Shard(1)), out.placements
    # This rank's piece is its own queries: (batch, heads / tp, seq / cp, head_dim).
    assert out.to_local().shape == (BATCH, HEADS // 2, SEQ // 2, HEAD_DIM)
    torch.testing.assert_close(out.full_tensor()[:, :, restore], expected.detach(), atol=2e-5, rtol=1e-5)
    for name, got, want in zip(("query", "key", "value"), inputs, reference):
        assert isinstance(got.grad, DTensor) and want.grad is not None, name
        assert got.grad.placements == (Shard(2), Shard(1)), (name, got.grad.placements)
        torch.testing.assert_close(got.grad.full_tensor()[:, :, restore], want.grad, atol=2e-5, rtol=1e-5, msg=name)


@multi_rank(world_size=4)
def test_cpu_flash_kernel_ops_on_sequence_sharded_dtensors_keep_the_query_layout() -> None:
    """The kernel's forward and backward ops themselves (what SDPA reaches where the mode is off)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    generator = torch.Generator().manual_seed(5)
    query, key, value, grad_out = (torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator) for _ in range(4))
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    scale = HEAD_DIM**-0.5
    want_out, want_lse = forward(query, key, value, 0.0, True, scale=scale)
    want_grads = backward(grad_out, query, key, value, want_out, want_lse, 0.0, True, scale=scale)

    order = _HeadTailLoadBalancer(SEQ, 2, "cpu")._generate_indices()[0]
    restore = torch.argsort(order)
    placements = [Shard(2), Shard(1)]
    q, k, v, g = (distribute_tensor(t[:, :, order], mesh, placements) for t in (query, key, value, grad_out))
    _enable_context_parallel_dispatcher()
    try:
        out, lse = forward(q, k, v, 0.0, True, scale=scale)
        grads = backward(g, q, k, v, out, lse, 0.0, True, scale=scale)
    finally:
        _disable_context_parallel_dispatcher()
    assert out.placements == (Shard(2), Shard(1)) and lse.placements == (Shard(2), Shard(1))
    torch.testing.assert_close(out.full_tensor()[:, :, restore], want_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.full_tensor()[:, :, restore], want_lse, atol=2e-5, rtol=1e-5)
    for got, want in zip(grads, want_grads):
        assert got.placements == (Shard(2), Shard(1))
        torch.testing.assert_close(got.full_tensor()[:, :, restore], want, atol=2e-5, rtol=1e-5)
