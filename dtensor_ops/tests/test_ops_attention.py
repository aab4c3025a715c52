"""scaled_dot_product_attention on DTensors (CPU flash kernel), forward and backward, against plain torch.

q/k/v are made as the model makes them: ``(batch, seq, heads, head_dim)`` tensors
transposed to ``(batch, heads, seq, head_dim)``, so gradients flow back through
the transposes as in training.  Sweeps run on 4 rank threads; explicit checks pin
that head- and batch-sharded attention runs without communication, forward and
backward (PyTorch's DTensor has no rule for this kernel at all); the model zoo's
Attention block with column-sharded q/k/v projections runs on 4 threads and on
4 gloo processes.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardwise.dtensor_ops import DTensor, DeviceMesh, Partial, Placement, Replicate, Shard, distribute_tensor
from shardwise.dtensor_ops._decision_pipeline import propagate_op_sharding
from shardwise.dtensor_ops._ops import rule_for
from shardwise.dtensor_ops._propagation import run_on_meta as _run_on_meta
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.placement import DTensorSpec, TensorMeta
from shardwise.testing import Attention, DTensorOpTestBase, FakeMesh, ModelArgs, multi_rank
from views_indexing_helpers import LAYOUT_SAMPLE_2D, check_layout, sweep

aten = torch.ops.aten
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SEQ, HEADS = 1, 2  # dims of the (batch, seq, heads, head_dim) inputs


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def qkv(
    batch: int, heads: int, q_seq: int, kv_seq: int, head_dim: int = 8, kv_heads: int | None = None
) -> list[torch.Tensor]:
    """q, k, v of shape (batch, seq, heads, head_dim), float64, from fixed seeds."""
    kv_heads = heads if kv_heads is None else kv_heads
    return [
        randn(batch, q_seq, heads, head_dim, seed=1),
        randn(batch, kv_seq, kv_heads, head_dim, seed=2),
        randn(batch, kv_seq, kv_heads, head_dim, seed=3),
    ]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """sdpa on (batch, seq, heads, head_dim) inputs; an optional attention mask as a fourth input."""
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), *mask, **kwargs
    )


def attention_with_fixed_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # A mask that needs no gradient, as usual; one that does keeps sdpa off the flash kernel (math path).
    return attention(q, k, v, mask.detach())


def laid_out(full: torch.Tensor, mesh: DeviceMesh, *placements: Placement, grad: bool = True) -> DTensor:
    """``full`` laid out without communication; a floating one becomes a leaf requiring grad."""
    result = distribute_tensor(full, mesh, list(placements), src_data_rank=None)
    return result.requires_grad_(grad and full.is_floating_point())


def comm_counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).split(".")[-1]: count for op, count in mode.get_comm_counts().items() if count}


def ran_flash_kernel(mode: CommDebugMode) -> bool:
    return "_scaled_dot_product_flash_attention_for_cpu.default" in mode.generate_comm_debug_tracing_table(1)


def run_attention(
    mesh: DeviceMesh, inputs: list[torch.Tensor], layouts: list[tuple[Placement, ...]], **kwargs: Any
) -> tuple[DTensor, list[DTensor], dict[str, int], dict[str, int], bool]:
    """Forward and backward on DTensors laid out as ``layouts``: (output, inputs, fwd counts, bwd counts, flash?)."""
    # q, k, v get gradients; a mask does not (one that does keeps sdpa off the flash kernel)
    dtensors = [laid_out(t, mesh, *layout, grad=index < 3) for index, (t, layout) in enumerate(zip(inputs, layouts))]
    mode = CommDebugMode()
    with mode:
        out = attention(*dtensors, **kwargs)
    forward, used_flash = comm_counts(mode), ran_flash_kernel(mode)
    gradient = laid_out(torch.ones(out.shape, dtype=out.dtype), mesh, *out.placements, grad=False)
    with mode:
        out.backward(gradient)
    return out, dtensors, forward, comm_counts(mode), used_flash


def check_against_plain(inputs: list[torch.Tensor], out: DTensor, dtensors: list[DTensor], **kwargs: Any) -> None:
    plain = [t.clone().requires_grad_(index < 3) for index, t in enumerate(inputs)]  # q, k, v; not a mask
    expected = attention(*plain, **kwargs)
    expected.backward(torch.ones_like(expected))
    torch.testing.assert_close(out.full_tensor(), expected.detach())
    for index, (dtensor, reference) in enumerate(zip(dtensors, plain)):
        if reference.grad is not None:
            assert dtensor.grad is not None, f"input {index} got no gradient"
            torch.testing.assert_close(dtensor.grad.full_tensor(), reference.grad, msg=lambda m: f"input {index}: {m}")


def _spec(tensor: torch.Tensor) -> DTensorSpec[Any]:
    return DTensorSpec(FakeMesh((1,)), (Replicate(),), TensorMeta(tensor.shape, tuple(tensor.stride()), tensor.dtype))


def test_output_metadata_rules_agree_with_meta_tensors() -> None:
    """Layouts the rules compute (output like the query, logsumexp and gradients seq-major) are the kernel's."""
    contiguous = torch.empty(2, 4, 6, 8)
    seq_major = torch.empty(2, 6, 4, 8).transpose(1, 2)
    batch_last = torch.empty(4, 6, 8, 2).permute(3, 0, 1, 2)
    kv = torch.empty(2, 4, 5, 8)
    answered = 0
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for query in (contiguous, seq_major, batch_last, torch.empty(1, 4, 6, 8)):
            query = query.to(dtype)
            for kwargs in ({}, {"attn_mask": _spec(torch.empty(6, 5, dtype=dtype))}):
                args = (_spec(query), _spec(kv.to(dtype)), _spec(kv.to(dtype)))
                forward = rule_for(FLASH)
                assert forward is not None and forward.output_meta is not None
                computed = forward.output_meta(FLASH, args, kwargs)
                _, metas = _run_on_meta(FLASH, args, kwargs)
                if computed is not None:
                    assert computed == metas, (query.shape, query.stride(), dtype)
                    answered += 1
                out = _spec(torch.empty_strided(metas[0].shape, metas[0].stride, dtype=dtype))
                lse = _spec(torch.empty_strided(metas[1].shape, metas[1].stride, dtype=metas[1].dtype))
                backward_args = (out, args[0], args[1], args[2], out, lse, 0.0, False)
                backward = rule_for(FLASH_BACKWARD)
                assert backward is not None and backward.output_meta is not None
                computed = backward.output_meta(FLASH_BACKWARD, backward_args, kwargs)
                assert computed == _run_on_meta(FLASH_BACKWARD, backward_args, kwargs)[1]
    assert answered >= 18  # only size-1 dims outside the contiguous layout are left to meta tensors


class FlashAttentionTest(DTensorOpTestBase):
    """Every test method runs on 4 rank threads."""

    def test_layouts_against_plain_torch(self) -> None:
        mesh = self.build_device_mesh()
        cases: list[tuple[list[torch.Tensor], dict[str, Any]]] = [
            (qkv(2, 4, 6, 5), {}),
            (qkv(2, 4, 6, 6), {"is_causal": True}),
            (qkv(3, 6, 5, 5), {"is_causal": True, "scale": 0.3}),  # uneven batch and heads over 4 ranks
        ]
        for inputs, kwargs in cases:
            assert sweep(mesh, functools.partial(attention, **kwargs), inputs, limit=LAYOUT_SAMPLE_2D) > 0

    def test_head_sharding_needs_no_communication(self) -> None:
        mesh = self.build_device_mesh()
        for inputs, is_causal in ((qkv(2, 4, 6, 6), True), (qkv(2, 4, 6, 5), False), (qkv(1, 6, 5, 5), True)):
            heads = (Shard(HEADS),)
            out, dtensors, forward, backward, used_flash = run_attention(
                mesh, inputs, [heads] * 3, is_causal=is_causal
            )
            assert used_flash
            assert forward == {} and backward == {}, (forward, backward)
            assert out.placements == (Shard(1),)  # (batch, heads, seq, head_dim)
            assert all(d.grad is not None and d.grad.placements == heads for d in dtensors)
            check_against_plain(inputs, out, dtensors, is_causal=is_causal)

    def test_batch_sharding_needs_no_communication(self) -> None:
        mesh = self.build_device_mesh()
        for batch in (4, 3):  # even; uneven (1, 1, 1, 0)
            inputs = qkv(batch, 2, 5, 5)
            out, dtensors, forward, backward, used_flash = run_attention(
                mesh, inputs, [(Shard(0),)] * 3, is_causal=True
            )
            assert used_flash and forward == {} and backward == {}, (forward, backward)
            assert out.placements == (Shard(0),)
            check_against_plain(inputs, out, dtensors, is_causal=True)

    def test_query_rows_sharded_with_replicated_keys_and_values(self) -> None:
        mesh = self.build_device_mesh()
        layouts = [(Shard(SEQ),), (Replicate(),), (Replicate(),)]
        for query_rows in (8, 3):  # 3 rows: the last rank holds none, yet all keys and values
            inputs = qkv(2, 2, query_rows, 5)
            out, dtensors, forward, _, used_flash = run_attention(mesh, inputs, layouts)
            assert used_flash and forward == {}
            assert out.placements == (Shard(2),)
            # Every query shard contributes to every key/value gradient: partial sums.
            assert dtensors[1].grad is not None and dtensors[1].grad.placements == (Partial(),)
            check_against_plain(inputs, out, dtensors)
        inputs = qkv(2, 2, 8, 5)
        # With a causal mask the kernel would align the mask with the local rows: not a valid strategy.
        out, dtensors, _, _, _ = run_attention(mesh, inputs, layouts, is_causal=True)
        assert out.placements != (Shard(2),)
        check_against_plain(inputs, out, dtensors, is_causal=True)

    def test_attention_masks(self) -> None:
        mesh = self.build_device_mesh()
        inputs = qkv(2, 4, 6, 5)
        masks = [
            randn(6, 5, seed=4),  # additive, broadcast over batch and heads
            randn(2, 4, 6, 5, seed=5),  # one per (batch, head)
            randn(2, 1, 1, 5, seed=6),  # padding-style: per batch and key
        ]
        for mask in masks:
            assert sweep(mesh, attention_with_fixed_mask, [*inputs, mask], limit=8) > 0
            # Head-sharded q/k/v with a mask: the mask follows the heads where it has them, no communication.
            heads = (Shard(HEADS),)
            mask_layout = (Shard(1),) if mask.shape[1] == 4 else (Replicate(),)
            out, dtensors, forward, backward, used_flash = run_attention(
                mesh, [*inputs, mask], [heads, heads, heads, mask_layout]
            )
            assert used_flash and forward == {} and backward == {}, (mask.shape, forward, backward)
            check_against_plain([*inputs, mask], out, dtensors)
        keep = torch.rand(6, 5, generator=torch.Generator().manual_seed(7)) > 0.3
        keep[:, 0] = True  # every query keeps one key (a fully masked row is nan)
        check_layout(mesh, attention, [*inputs, keep], [(Shard(HEADS),)] * 3 + [(Replicate(),)])

    def test_grouped_key_value_heads(self) -> None:
        mesh = self.build_device_mesh()
        inputs = qkv(2, 4, 6, 6, kv_heads=2)
        gqa = functools.partial(attention, is_causal=True, enable_gqa=True)
        # 2 kv heads cannot follow 4 query heads over 4 ranks: redistributed, still exact.
        check_layout(mesh, gqa, inputs, [(Shard(HEADS),)] * 3)
        check_layout(mesh, gqa, inputs, [(Shard(0),)] * 3)
        # Over 2 ranks per mesh dim the head groups line up: batch on one mesh dim, heads on the other.
        mesh_2d = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
        layout = (Shard(0), Shard(HEADS))
        out, dtensors, forward, backward, used_flash = run_attention(
            mesh_2d, inputs, [layout] * 3, is_causal=True, enable_gqa=True
        )
        assert used_flash and forward == {} and backward == {}, (forward, backward)
        assert out.placements == (Shard(0), Shard(1))
        check_against_plain(inputs, out, dtensors, is_causal=True, enable_gqa=True)

    def test_layouts_on_a_2x2_mesh(self) -> None:
        mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
        inputs = qkv(2, 4, 6, 6)
        sweep(mesh, functools.partial(attention, is_causal=True), inputs, limit=LAYOUT_SAMPLE_2D)
        for layout in ((Shard(HEADS), Shard(HEADS)), (Shard(0), Shard(HEADS)), (Shard(HEADS), Shard(0))):
            out, dtensors, forward, backward, _ = run_attention(mesh, inputs, [layout] * 3, is_causal=True)
            assert forward == {} and backward == {}, (layout, forward, backward)
            check_against_plain(inputs, out, dtensors, is_causal=True)

    def test_mismatched_heads_raise_torchs_error_before_any_collective(self) -> None:
        mesh = self.build_device_mesh()
        q, k, v = (laid_out(t, mesh, Shard(HEADS)) for t in qkv(2, 4, 6, 6, kv_heads=3))
        mode = CommDebugMode()
        with mode, pytest.raises(RuntimeError):
            attention(q, k, v, enable_gqa=True)
        assert comm_counts(mode) == {}


# ------------------------------------------------------------------------------- the model zoo's Attention


def column_and_row_sharded(block: Attention, mesh: DeviceMesh) -> Attention:
    """Tensor-parallel Attention by hand: q/k/v projections column-sharded (heads per rank), wo row-sharded."""
    sharded = copy.deepcopy(block)
    for name, placement in (("wq", Shard(0)), ("wk", Shard(0)), ("wv", Shard(0)), ("wo", Shard(1))):
        linear = getattr(sharded, name)
        linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [placement], src_data_rank=None))
    return sharded


def check_attention_block(mesh: DeviceMesh) -> None:
    block = Attention(ModelArgs(dim=16, n_heads=4, dropout_p=0.0, use_attn_mask=True)).double()
    with torch.no_grad():  # rank threads share torch's generator: take values from private ones
        for seed, parameter in enumerate(block.parameters()):
            parameter.copy_(randn(*parameter.shape, seed=10 + seed))
    sharded = column_and_row_sharded(block, mesh)
    x = randn(2, 6, 16, seed=20)
    expected = block(x)
    expected.backward(torch.ones_like(expected))

    dx = distribute_tensor(x, mesh, [Replicate()], src_data_rank=None)
    mode = CommDebugMode()
    with mode:
        out = sharded(dx)
    assert ran_flash_kernel(mode)
    assert comm_counts(mode) == {}  # heads stay on their rank; wo leaves a partial sum
    assert out.placements == (Partial(),)
    torch.testing.assert_close(out.full_tensor(), expected.detach())
    gradient = distribute_tensor(torch.ones_like(expected), mesh, [Replicate()], src_data_rank=None)
    with mode:
        out.backward(gradient)
    assert comm_counts(mode) == {}
    for name in ("wq", "wk", "wv", "wo"):
        weight = getattr(sharded, name).weight
        assert weight.grad is not None and weight.grad.placements == weight.placements, name
        torch.testing.assert_close(
            weight.grad.full_tensor(), getattr(block, name).weight.grad, msg=lambda m: f"{name}: {m}"
        )


class AttentionBlockTest(DTensorOpTestBase):
    def test_column_sharded_projections_keep_heads_local(self) -> None:
        check_attention_block(self.build_device_mesh())


@multi_rank(world_size=4)
def test_attention_block_on_processes() -> None:
    check_attention_block(DeviceMesh("cpu", list(range(dist.get_world_size()))))


# -- CUDA kernels: decided on every machine, run by test_tp_sdpa_gpu.py on a GPU ----------------------------

CUDA_KERNELS = {
    # forward op, its positional arguments after q/k/v, its backward op
    "flash": (aten._scaled_dot_product_flash_attention.default, (0.0, True), aten._scaled_dot_product_flash_attention_backward.default),
    "efficient": (aten._scaled_dot_product_efficient_attention.default, (None, True, 0.0, True), aten._scaled_dot_product_efficient_attention_backward.default),
    "cudnn": (aten._scaled_dot_product_cudnn_attention.default, (None, True, 0.0, True), aten._scaled_dot_product_cudnn_attention_backward.default),
}


def _placed(tensor: torch.Tensor | None, mesh: FakeMesh, placement: Placement) -> DTensorSpec[Any] | None:
    if tensor is None:
        return None
    return DTensorSpec(mesh, (placement,), TensorMeta(tensor.shape, tuple(tensor.stride()), tensor.dtype))


def _backward_args(kernel: str, q: torch.Tensor, forward_results: tuple[Any, ...]) -> tuple[Any, ...]:
    """The backward's arguments as autograd passes them (meta tensors), from the forward's results."""
    out, lse = forward_results[0], forward_results[1]
    if kernel == "flash":
        _, _, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = forward_results
        return (out, q, q, q, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, rng_state, unused)
    if kernel == "efficient":
        seed, offset = forward_results[2], forward_results[3]
        return (out, q, q, q, None, out, lse, seed, offset, 0.0, [True, True, True, False], True)
    seed, offset = forward_results[6], forward_results[7]
    return (out, q, q, q, out, lse, seed, offset, None, None, None, q.shape[2], q.shape[2], 0.0, True)


@pytest.mark.parametrize("kernel", sorted(CUDA_KERNELS))
def test_cuda_kernels_run_head_and_batch_sharded_without_communication(kernel: str) -> None:
    forward, rest, backward = CUDA_KERNELS[kernel]
    mesh = FakeMesh((4,), (1,))
    q = torch.empty(4, 8, 16, 8, device="meta", dtype=torch.bfloat16)
    results = forward(q, q, q, *rest)
    for cut in (0, 1):
        specs = tuple(_placed(q, mesh, Shard(cut)) for _ in range(3))
        decision = propagate_op_sharding(forward, (*specs, *rest), {})
        assert not decision.needs_redistribute, (kernel, cut)
        assert isinstance(decision.output_specs, tuple)
        outputs = decision.output_specs
        assert outputs[0] is not None and outputs[0].placements == (Shard(cut),)
        assert outputs[1] is not None and outputs[1].placements == (Shard(cut),), "logsumexp follows the cut"
        for index, spec in enumerate(outputs[2:], 2):
            assert spec is None or spec.placements == (Replicate(),), (kernel, index, spec)
        # The backward, with the forward's results as autograd hands them back (bookkeeping replicated).
        args = tuple(
            _placed(arg, mesh, Shard(cut) if isinstance(arg, torch.Tensor) and arg.dim() >= 3 else Replicate())
            if isinstance(arg, torch.Tensor) else arg
            for arg in _backward_args(kernel, q, results)
        )
        grads = propagate_op_sharding(backward, args, {})
        assert not grads.needs_redistribute, (kernel, cut)
        assert isinstance(grads.output_specs, tuple)
        assert [spec.placements for spec in grads.output_specs[:3] if spec is not None] == [(Shard(cut),)] * 3


@pytest.mark.parametrize("kernel", sorted(CUDA_KERNELS))
def test_cuda_kernels_gather_query_rows_first(kernel: str) -> None:
    """Query rows are not a cut of the fused kernels (padded logsumexp, causal masks): they are gathered."""
    forward, rest, _ = CUDA_KERNELS[kernel]
    q = torch.empty(4, 8, 16, 8, device="meta", dtype=torch.bfloat16)
    specs = tuple(_placed(q, FakeMesh((4,), (1,)), Shard(2)) for _ in range(3))
    decision = propagate_op_sharding(forward, (*specs, *rest), {})
    assert decision.needs_redistribute
    assert all(spec.placements[0] != Shard(2) for spec in decision.input_specs)
