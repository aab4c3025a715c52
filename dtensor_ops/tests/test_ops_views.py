"""View, shape, concatenation and split ops on DTensors, forward and backward, against plain torch.

Sweeps (every DTensorConverter sharding, plus uneven shards and Partial inputs)
run on 4 rank threads; a few placement and collective-count checks pin the
decisions that matter for tensor-parallel training (the attention head split
and merge keep the heads sharded without communication); one test runs the
attention pattern on 4 gloo processes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from shardwise.dtensor_ops import DeviceMesh, Partial, Replicate, Shard, distribute_tensor
from shardwise.dtensor_ops._ops import rule_for
from shardwise.dtensor_ops._propagation import run_on_meta as _run_on_meta
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.placement import DTensorSpec, TensorMeta, _StridedShard
from shardwise.testing import Attention, DTensorOpTestBase, DTensorTestBase, FakeMesh, ModelArgs, with_comms
from views_indexing_helpers import LAYOUT_SAMPLE_2D, as_dtensor, check_layout, sweep

aten = torch.ops.aten
funcol = torch.ops.c10d_functional


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def mesh_2x2() -> DeviceMesh:
    return DeviceMesh("cpu", torch.arange(4).reshape(2, 2))


def comm_counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).split(".")[-1]: count for op, count in mode.get_comm_counts().items() if count}


class ViewOpsTest(DTensorOpTestBase):
    """Every test method runs on 4 rank threads."""

    def test_view_reshape_flatten_unflatten(self) -> None:
        mesh = self.build_device_mesh()
        even, uneven = randn(4, 6, 8), randn(3, 5, 4, seed=1)
        cases = [
            (lambda t: t.view(24, 8), even),
            (lambda t: t.view(4, 6, 2, 4), even),
            (lambda t: t.view(8, 3, 8), even),  # merge and split in one group: (4, 6) -> (8, 3)
            (lambda t: t.view(-1), uneven),
            (lambda t: t.view(15, -1), uneven),
            (lambda t: t.reshape(3, 20), uneven),
            (lambda t: t.transpose(0, 1).reshape(6, 32), even),  # not a view: clone + _unsafe_view
            (lambda t: t.flatten(0, 1), even),
            (lambda t: t.flatten(1), uneven),
            (lambda t: t.unflatten(2, (2, 4)), even),
            (lambda t: t.view(1, 3, 5, 1, 4), uneven),
            (lambda t: t.view_as(torch.empty(4, 48)), even),
            (lambda t: torch.ops.aten.alias(t), uneven),
        ]
        for fn, x in cases:
            assert sweep(mesh, fn, [x]) > 0

    def test_squeeze_and_unsqueeze(self) -> None:
        mesh = self.build_device_mesh()
        with_ones, uneven = randn(4, 1, 6, 1), randn(5, 1, 3, seed=1)
        cases = [
            (lambda t: t.squeeze(), with_ones),
            (lambda t: t.squeeze(1), with_ones),
            (lambda t: t.squeeze(-1), with_ones),
            (lambda t: t.squeeze((1, 3)), with_ones),
            (lambda t: t.squeeze(0), with_ones),  # dim 0 is not of size 1: nothing is squeezed
            (lambda t: t.squeeze((0, 2)), with_ones),
            (lambda t: t.squeeze(), uneven),  # shards of dim 0 hold 2, 1, 1, 1 rows
            (lambda t: t.squeeze(0), uneven),
            (lambda t: t.squeeze((0, 1)), uneven),
            (lambda t: t.unsqueeze(0), uneven),
            (lambda t: t.unsqueeze(1), uneven),
            (lambda t: t.unsqueeze(-1), uneven),
        ]
        for fn, x in cases:
            assert sweep(mesh, fn, [x]) > 0

    def test_transpose_permute_t_expand_contiguous(self) -> None:
        mesh = self.build_device_mesh()
        x, matrix, column = randn(4, 6, 8), randn(5, 3, seed=1), randn(5, 1, seed=2)
        cases = [
            (lambda t: t.transpose(0, 2), x),
            (lambda t: t.transpose(-1, 1), x),
            (lambda t: t.permute(2, 0, 1), x),
            (lambda t: t.permute(-1, 1, 0), x),
            (lambda t: t.movedim(0, 2), x),
            (lambda t: t.t(), matrix),
            (lambda t: t.mT, x),
            (lambda t: t.expand(5, 4), column),
            (lambda t: t.expand(2, 5, 3), matrix),
            (lambda t: t.transpose(0, 1).contiguous(), x),
            (lambda t: t.permute(1, 2, 0).contiguous().view(6, 32), x),
        ]
        for fn, tensor in cases:
            assert sweep(mesh, fn, [tensor]) > 0

    def test_split_chunk_unbind_cat_stack(self) -> None:
        mesh = self.build_device_mesh()
        x, y, z = randn(4, 6), randn(4, 6, seed=1), randn(3, 6, seed=2)
        uneven = randn(5, 3, seed=3)
        single_input_cases = [
            lambda t: t.split(4, dim=1),
            lambda t: t.split([1, 3], dim=0),
            lambda t: t.chunk(3, dim=1),
            lambda t: t.chunk(2, dim=-2),
            lambda t: t.unbind(1),
            lambda t: t.unbind(0),
        ]
        for fn in single_input_cases:
            assert sweep(mesh, fn, [x]) > 0
        assert sweep(mesh, lambda t: t.split(2, dim=0), [uneven]) > 0
        assert sweep(mesh, lambda a, b: torch.cat([a, b], dim=0), [x, z]) > 0
        assert sweep(mesh, lambda a, b: torch.cat([a, b], dim=-1), [x, y]) > 0
        assert sweep(mesh, lambda a, b: torch.stack([a, b]), [x, y]) > 0
        assert sweep(mesh, lambda a, b: torch.stack([a, b], dim=2), [x, y]) > 0
        assert sweep(mesh, lambda a, b: torch.stack((a, b), dim=-2), [uneven, uneven * 2]) > 0

    def test_views_and_stacks_on_a_2x2_mesh(self) -> None:
        mesh = mesh_2x2()
        x = randn(4, 6, 8)
        for fn in (
            lambda t: t.view(24, 8),
            lambda t: t.view(4, 6, 2, 4),
            lambda t: t.flatten(1),
            lambda t: t.permute(2, 0, 1).contiguous(),
            lambda t: t.unsqueeze(1).squeeze(),
            lambda t: t.chunk(2, dim=2),
        ):
            assert sweep(mesh, fn, [x], limit=LAYOUT_SAMPLE_2D) > 0
        assert sweep(mesh, lambda a, b: torch.stack([a, b], 1), [x, x * 3], limit=LAYOUT_SAMPLE_2D) > 0
        assert sweep(mesh, lambda a, b: torch.cat([a, b], 1), [x, x * 3], limit=LAYOUT_SAMPLE_2D) > 0

    # -- decisions that tensor parallelism relies on ----------------------------------------------

    def test_a_merge_or_split_keeps_the_shard_where_the_flat_ranges_agree(self) -> None:
        mesh = self.build_device_mesh()
        cases = [
            # (shape, placement, new size, output placement, collectives)
            ((4, 6, 8), Shard(0), (24, 8), Shard(0), {}),  # the outermost merged dim: rows of 6*8
            ((4, 6, 8), Shard(0), (8, 3, 8), Shard(0), {}),  # (4, 6) -> (8, 3): 6 flat elements per rank either way
            # (4, 6) -> (2, 12): two ranks would share each new row; dim 2 takes the shard instead.
            ((4, 6, 8), Shard(0), (2, 12, 8), Shard(2), {"all_to_all_single": 1}),
            ((2, 5, 16), Shard(2), (2, 5, 4, 4), Shard(2), {}),  # heads split out of heads*head_dim
            ((2, 5, 4, 4), Shard(2), (2, 5, 16), Shard(2), {}),  # and merged back
            ((1, 8, 16), Shard(1), (8, 16), Shard(0), {}),  # a batch of 1 is its own group
            ((4, 3), Shard(0), (12,), Shard(0), {}),
            # (b, s) -> (b*s) sharded on s with b > 1: each rank's rows are strided, not a range, so the
            # merged dim is a strided shard (as in PyTorch), without communication.
            ((2, 8, 16), Shard(1), (16, 16), _StridedShard(0, split_factor=2), {}),
            # 2 rows cut 4 ways (1, 1, 0, 0) are not the 6 flat elements cut 4 ways (2, 2, 2, 0).
            ((2, 3), Shard(0), (6,), Replicate(), {"all_gather_into_tensor": 1}),
        ]
        for shape, placement, size, expected, collectives in cases:
            full = randn(*shape)
            dtensor = distribute_tensor(full, mesh, [placement], src_data_rank=None)
            with CommDebugMode() as mode:
                viewed = dtensor.view(size)
            where = f"{shape} {placement} -> {size}"
            assert viewed.placements == (expected,), f"{where}: {viewed.placements}"
            assert comm_counts(mode) == collectives, f"{where}: {comm_counts(mode)}"
            torch.testing.assert_close(viewed.full_tensor(), full.view(size), msg=where)

    def test_nested_shards_of_a_merged_group_on_a_2x2_mesh(self) -> None:
        mesh = mesh_2x2()
        full = randn(2, 4, 3)
        # Mesh dim 0 cuts the batch into single rows, so mesh dim 1's cut of s is one flat range per rank.
        batch_then_seq = distribute_tensor(full, mesh, [Shard(0), Shard(1)], src_data_rank=None)
        with CommDebugMode() as mode:
            merged = batch_then_seq.view(8, 3)
        assert merged.placements == (Shard(0), Shard(0)) and mode.get_total_counts() == 0
        torch.testing.assert_close(merged.full_tensor(), full.view(8, 3))
        # The other nesting order has no single-dim equivalent: it is redistributed.
        seq_then_batch = distribute_tensor(full, mesh, [Shard(1), Shard(0)], src_data_rank=None)
        with CommDebugMode() as mode:
            merged = seq_then_batch.view(8, 3)
        assert mode.get_total_counts() > 0
        torch.testing.assert_close(merged.full_tensor(), full.view(8, 3))
        # ... and the reverse split: (8) nested S(0), S(0) -> (2, 4) as S(0), S(1), no communication.
        flat = distribute_tensor(full.view(8, 3), mesh, [Shard(0), Shard(0)], src_data_rank=None)
        with CommDebugMode() as mode:
            split = flat.view(2, 4, 3)
        assert split.placements == (Shard(0), Shard(1)) and mode.get_total_counts() == 0
        torch.testing.assert_close(split.full_tensor(), full)

    def test_attention_head_split_and_merge_need_no_communication(self) -> None:
        mesh = self.build_device_mesh()
        batch, seq, heads, head_dim = 2, 5, 4, 3
        dim = heads * head_dim
        x_full = randn(batch, seq, dim)
        weights_full = [randn(dim, dim, seed=seed) for seed in range(1, 5)]

        def attention_like(
            x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor
        ) -> torch.Tensor:
            # The seed's Attention, with an elementwise stand-in for the attention kernel.
            def split_heads(projected: torch.Tensor) -> torch.Tensor:
                return projected.view(batch, seq, -1, head_dim).transpose(1, 2)

            q, k, v = split_heads(F.linear(x, wq)), split_heads(F.linear(x, wk)), split_heads(F.linear(x, wv))
            mixed = torch.tanh(q * k) + v
            merged = mixed.transpose(1, 2).contiguous().view(batch, seq, -1)
            return F.linear(merged, wo)

        x = distribute_tensor(x_full, mesh, [Replicate()], src_data_rank=None).requires_grad_()
        # Colwise q/k/v projections (output features = heads sharded), rowwise output projection.
        layouts = [Shard(0), Shard(0), Shard(0), Shard(1)]
        weights = [
            distribute_tensor(w, mesh, [p], src_data_rank=None).requires_grad_() for w, p in zip(weights_full, layouts)
        ]
        with CommDebugMode() as forward_mode:
            q = F.linear(x, weights[0]).view(batch, seq, -1, head_dim)
            heads_first = q.transpose(1, 2)
            output = attention_like(x, *weights)
        assert q.placements == (Shard(2),) and heads_first.placements == (Shard(1),)
        assert output.placements == (Partial(),)
        assert forward_mode.get_total_counts() == 0, comm_counts(forward_mode)

        plain_x = x_full.clone().requires_grad_()
        plain_weights = [w.clone().requires_grad_() for w in weights_full]
        expected = attention_like(plain_x, *plain_weights)
        torch.testing.assert_close(output.full_tensor(), expected)
        gradient = randn(batch, seq, dim, seed=9)
        expected.backward(gradient)
        with CommDebugMode() as backward_mode:
            output.backward(distribute_tensor(gradient, mesh, [Replicate()], src_data_rank=None))
        # Only x's gradient, a partial sum over the heads, is reduced (once, at the leaf).
        moved = comm_counts(backward_mode)
        assert "all_to_all_single" not in moved and "all_gather_into_tensor" not in moved, moved
        for weight, plain, layout in zip(weights, plain_weights, layouts):
            assert weight.grad is not None and weight.grad.placements == (layout,)
            torch.testing.assert_close(weight.grad.full_tensor(), plain.grad)
        assert x.grad is not None
        torch.testing.assert_close(x.grad.full_tensor(), plain_x.grad)

    def test_the_model_zoo_attention_with_sharded_heads_needs_no_communication(self) -> None:
        # The seed's Attention (view(b, s, -1, head_dim), transpose, sdpa, transpose, contiguous, view) with
        # colwise q/k/v and a rowwise output projection, as a tensor-parallel plan lays them out.
        mesh = self.build_device_mesh()
        plain = Attention(ModelArgs(dim=16, n_heads=4, dropout_p=0.0)).double().eval()
        with torch.no_grad():  # the same weights on every rank thread (the global generator is shared)
            for seed, parameter in enumerate(plain.parameters()):
                parameter.copy_(randn(*parameter.shape, seed=10 + seed) / 4)
        model = copy.deepcopy(plain)
        for name, layout in (("wq", Shard(0)), ("wk", Shard(0)), ("wv", Shard(0)), ("wo", Shard(1))):
            linear = getattr(model, name)
            weight = distribute_tensor(linear.weight.detach(), mesh, [layout], src_data_rank=None)
            linear.weight = torch.nn.Parameter(weight)
        x_full = randn(2, 5, 16)
        x = distribute_tensor(x_full, mesh, [Replicate()], src_data_rank=None)
        with CommDebugMode() as forward_mode:
            output = model(x)
        expected = plain(x_full)
        assert output.placements == (Partial(),) and forward_mode.get_total_counts() == 0, comm_counts(forward_mode)
        torch.testing.assert_close(output.full_tensor(), expected)
        gradient = randn(2, 5, 16, seed=1)
        expected.backward(gradient)
        with CommDebugMode() as backward_mode:
            output.backward(distribute_tensor(gradient, mesh, [Replicate()], src_data_rank=None))
        assert backward_mode.get_total_counts() == 0, comm_counts(backward_mode)
        for name in ("wq", "wk", "wv", "wo"):
            grad = getattr(model, name).weight.grad
            assert grad is not None and grad.placements == getattr(model, name).weight.placements
            torch.testing.assert_close(grad.full_tensor(), getattr(plain, name).weight.grad)

    def test_heads_that_do_not_divide_over_the_mesh_are_redistributed_exactly(self) -> None:
        mesh = self.build_device_mesh()
        full = randn(2, 3, 8)  # 2 heads of 4 over 4 ranks: a head would straddle two ranks
        dtensor = distribute_tensor(full, mesh, [Shard(2)], src_data_rank=None)
        heads = dtensor.view(2, 3, 2, 4)
        assert heads.placements != (Shard(2),)
        torch.testing.assert_close(heads.full_tensor(), full.view(2, 3, 2, 4))
        check_layout(mesh, lambda t: t.view(2, 3, 2, 4).transpose(1, 2), [full], [(Shard(2),)])

    def test_squeeze_never_drops_a_dim_whose_shard_happens_to_have_one_element(self) -> None:
        mesh = self.build_device_mesh()
        full = randn(4, 6)  # Shard(0): every rank holds a 1-row piece
        rows = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
        with CommDebugMode() as mode:
            kept = rows.squeeze((0,))  # told which dims: nothing to squeeze, no communication
        assert kept.shape == (4, 6) and kept.placements == (Shard(0),) and mode.get_total_counts() == 0
        for squeezed in (rows.squeeze(), rows.squeeze(0)):
            assert squeezed.shape == (4, 6)
            assert squeezed.to_local().shape == squeezed._spec.local_shape()
            torch.testing.assert_close(squeezed.full_tensor(), full)
        # A sharded size-1 dim that is squeezed away is resharded first (its one element is on rank 0):
        # an all-to-all onto the other dim is the cheapest way.
        row = randn(1, 6)
        one_row = distribute_tensor(row, mesh, [Shard(0)], src_data_rank=None)
        with CommDebugMode() as mode:
            squeezed = one_row.squeeze(0)
        assert squeezed.placements == (Shard(0),) and comm_counts(mode) == {"all_to_all_single": 1}
        torch.testing.assert_close(squeezed.full_tensor(), row.squeeze(0))

    def test_bad_arguments_fail_before_any_collective(self) -> None:
        mesh = self.build_device_mesh()
        dtensor = distribute_tensor(randn(4, 6), mesh, [Shard(1)], src_data_rank=None)
        bad_calls = [
            (lambda: dtensor.view(5, 5), RuntimeError, "invalid for input of size 24"),
            (lambda: dtensor.permute(0, 0), RuntimeError, "duplicate dims"),
            (lambda: dtensor.squeeze(3), IndexError, "Dimension out of range"),
            (lambda: dtensor.unsqueeze(4), IndexError, "Dimension out of range"),
            (lambda: dtensor.transpose(0, 2), IndexError, "Dimension out of range"),
            (lambda: dtensor.expand(3, 6), RuntimeError, "must match"),
            (lambda: torch.stack([dtensor, dtensor.t()]), RuntimeError, "stack expects each tensor to be equal size"),
            # (as_strided of a row-major sharded DTensor gathers it: test_ops_as_strided.py)
            (lambda: dtensor.t().as_strided((2, 2), (1, 2)), RuntimeError, "are not row-major"),
        ]
        for call, error, message in bad_calls:
            with CommDebugMode() as mode, pytest.raises(error, match=message):
                call()
            assert mode.get_total_counts() == 0, message


# -- output metadata by shape rules equals torch's -----------------------------------------------


def _spec_of(tensor: torch.Tensor) -> DTensorSpec:
    return DTensorSpec(FakeMesh((4,)), (Replicate(),), TensorMeta(tensor.shape, tuple(tensor.stride()), tensor.dtype))


LAYOUTS = {
    "contiguous": torch.empty(4, 1, 6, 3),
    "transposed": torch.empty(3, 6, 1, 4).permute(3, 2, 1, 0),
    "sliced": torch.empty(4, 2, 12, 3)[:, :1, ::2],
    "expanded": torch.empty(4, 1, 1, 3).expand(4, 1, 6, 3),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize(
    "op, extra_args",
    [
        (aten.permute.default, ([2, 0, 3, 1],)),
        (aten.permute.default, ([-1, -2, -3, -4],)),
        (aten.squeeze.default, ()),
        (aten.squeeze.dim, (1,)),
        (aten.squeeze.dim, (0,)),
        (aten.squeeze.dims, ([1, -1],)),
        (aten.unsqueeze.default, (0,)),
        (aten.unsqueeze.default, (2,)),
        (aten.unsqueeze.default, (-1,)),
        (aten.transpose.int, (1, 3)),
    ],
)
def test_view_output_metadata_matches_torch(layout: str, op: torch._ops.OpOverload, extra_args: tuple) -> None:
    tensor = LAYOUTS[layout]
    rule = rule_for(op)
    assert rule is not None and rule.output_meta is not None
    args = (_spec_of(tensor), *extra_args)
    computed = rule.output_meta(op, args, {})
    _, (from_meta,) = _run_on_meta(op, args, {})
    assert computed == from_meta
    reference = op(tensor, *extra_args)
    assert computed == TensorMeta(reference.shape, tuple(reference.stride()), reference.dtype)


def test_stack_output_metadata_matches_torch() -> None:
    rule = rule_for(aten.stack.default)
    assert rule is not None and rule.output_meta is not None
    parts = [torch.empty(2, 3), torch.empty(2, 3, dtype=torch.float64)]
    for dim in (0, 1, 2, -1):
        computed = rule.output_meta(aten.stack.default, ([_spec_of(p) for p in parts], dim), {})
        reference = torch.stack(parts, dim)
        assert computed == TensorMeta(reference.shape, tuple(reference.stride()), reference.dtype)


# -- the same pattern on 4 gloo processes ---------------------------------------------------------


class AttentionPatternOnProcesses(DTensorTestBase):
    @with_comms
    def test_head_split_merge_and_flatten_forward_backward(self) -> None:
        mesh = self.build_device_mesh()
        batch, seq, heads, head_dim = 2, 3, 4, 2
        full = randn(batch, seq, heads * head_dim)

        def pattern(t: torch.Tensor) -> torch.Tensor:
            split = t.view(batch, seq, -1, head_dim).transpose(1, 2)
            merged = (split * split.sum(-1, keepdim=True)).transpose(1, 2).contiguous().view(batch, seq, -1)
            return merged.flatten(0, 1)

        for placement in (Shard(2), Shard(1), Replicate()):
            outputs = check_layout(mesh, pattern, [full], [(placement,)])
            if placement == Shard(2):
                assert outputs[0].placements == (Shard(1),)
        x = as_dtensor(full, mesh, (Shard(2),), seed=0)
        with CommDebugMode() as mode:
            pattern(x)
        assert mode.get_total_counts() == 0
