"""Indexing ops on DTensors, forward and backward, against plain torch.

select, slice (narrow, negative and oversized bounds, steps), index_select,
gather, scatter / scatter_add / scatter_reduce, index_add, advanced indexing
(``x[idx]``, several and broadcast index tensors, ``None`` entries), index_put
(``x[idx] = v``, accumulate, boolean masks with a scalar), slice_scatter /
select_scatter, masked_fill and where: every sharding of every tensor argument
(index tensors and masks included; uneven shards and Partial inputs too) on 4
rank threads, a sample on a 2x2 mesh, and the decisions that avoid communication
(a sharded index, a slice of a whole sharded dim) with their collective counts.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.dtensor_ops import DeviceMesh, Partial, Replicate, Shard, distribute_tensor
from shardwise.dtensor_ops._ops import rule_for
from shardwise.dtensor_ops._ops.indexing import advanced_index_layout, slice_bounds
from shardwise.dtensor_ops._decision_pipeline import decide_from_specs as decide_op_sharding
from shardwise.dtensor_ops._propagation import ShardingPropagationError
from shardwise.dtensor_ops._propagation import run_on_meta as _run_on_meta
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.placement import DTensorSpec, TensorMeta, _MaskPartial
from shardwise.testing import DTensorOpTestBase, FakeMesh
from views_indexing_helpers import LAYOUT_SAMPLE_2D, check_layout, sweep

aten = torch.ops.aten


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def indices(high: int, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(100 + seed))


def distinct_indices(high: int, rows: int, count: int, seed: int = 0) -> torch.Tensor:
    """``rows`` rows of ``count`` distinct positions below ``high`` (scatter without collisions is deterministic)."""
    generator = torch.Generator().manual_seed(200 + seed)
    return torch.stack([torch.randperm(high, generator=generator)[:count] for _ in range(rows)])


def mask(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(300 + seed)) > 0.5


def mesh_2x2() -> DeviceMesh:
    return DeviceMesh("cpu", torch.arange(4).reshape(2, 2))


def comm_counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).split(".")[-1]: count for op, count in mode.get_comm_counts().items() if count}


class IndexingOpsTest(DTensorOpTestBase):
    """Every test method runs on 4 rank threads."""

    def test_select_slice_narrow(self) -> None:
        mesh = self.build_device_mesh()
        x, uneven = randn(4, 6, 8), randn(5, 3, seed=1)
        cases = [
            (lambda t: t[:, 2], x),
            (lambda t: t[1], x),
            (lambda t: t.select(2, -1), x),
            (lambda t: t[:, 1:5:2], x),
            (lambda t: t[..., -3:100], x),
            (lambda t: t[:, :], x),
            (lambda t: t[:, 0:6], x),  # the whole dim, spelled out
            (lambda t: t[:, 10:], x),  # empty
            (lambda t: t[::3], x),
            (lambda t: t.narrow(1, 1, 3), x),
            (lambda t: t[-1], uneven),
            (lambda t: t[1:4, 1], uneven),
            (lambda t: t[:, -2:], uneven),
            (lambda t: t[1:][:, ::2], uneven),
        ]
        for fn, tensor in cases:
            assert sweep(mesh, fn, [tensor]) > 0

    def test_index_select_and_index_add(self) -> None:
        mesh = self.build_device_mesh()
        x = randn(4, 6)
        assert sweep(mesh, lambda t, i: t.index_select(1, i), [x, indices(6, 8)]) > 0
        assert sweep(mesh, lambda t, i: t.index_select(0, i), [x, indices(4, 5, seed=1)]) > 0
        assert sweep(mesh, lambda t, i: t.index_select(-1, i), [x, indices(6, 1, seed=2)]) > 0
        source = randn(8, 6, seed=3)
        assert sweep(mesh, lambda t, i, s: t.index_add(0, i, s), [x, indices(4, 8, seed=4), source]) > 0
        assert sweep(mesh, lambda t, i, s: t.index_add(1, i, s, alpha=2.0), [x, indices(6, 4), randn(4, 4)]) > 0

    def test_masked_gather_is_a_mask_partial_that_later_ops_take_as_a_pending_sum(self) -> None:
        mesh = self.build_device_mesh()
        x, picks = randn(3, 8, 5), torch.tensor([[[1, 7, 0, 4, 6]], [[2, 2, 5, 3, 0]], [[7, 6, 1, 1, 4]]])
        sharded = distribute_tensor(x, mesh, [Shard(1)])
        positions = distribute_tensor(picks, mesh, [Replicate()])
        ones = distribute_tensor(torch.ones(3, 1, 5), mesh, [Partial()])
        mode = CommDebugMode()
        with mode:
            picked = torch.gather(sharded, 1, positions)
            # A pending sum under PyTorch's name: later ops that carry a Partial("sum") take it as it is.
            doubled = picked * 2
            picked.mul_(1.0)  # written in place: it stays what it is
            total = doubled * 0.5 + ones
        assert mode.get_total_counts() == 0
        assert picked.placements == (_MaskPartial(offset_shape=torch.Size([3, 8, 5]), offset_dim=1),)
        assert doubled.placements == total.placements == (Partial(),)
        expected = torch.gather(x, 1, picks)
        torch.testing.assert_close(picked.full_tensor(), expected)
        torch.testing.assert_close(total.full_tensor(), expected + 1)
        torch.testing.assert_close(picked.redistribute(mesh, [Shard(2)]).full_tensor(), expected)

    def test_gather_and_scatters(self) -> None:
        mesh = self.build_device_mesh()
        x = randn(4, 6)
        assert sweep(mesh, lambda t, i: t.gather(1, i), [x, indices(6, 4, 8)]) > 0
        assert sweep(mesh, lambda t, i: t.gather(0, i), [x, indices(4, 3, 6, seed=1)]) > 0
        assert sweep(mesh, lambda t, i: t.gather(1, i), [x, indices(6, 2, 3, seed=2)]) > 0  # smaller than self
        positions = distinct_indices(6, 4, 4)
        assert sweep(mesh, lambda t, i, s: t.scatter(1, i, s), [x, positions, randn(4, 4, seed=3)]) > 0
        assert sweep(mesh, lambda t, i: t.scatter(1, i, 2.5), [x, positions]) > 0
        assert sweep(mesh, lambda t, i, s: t.scatter_add(0, i, s), [x, indices(4, 8, 6, seed=4), randn(8, 6)]) > 0
        # torch's own scatter_add backward fails for a source larger than the index: no gradient for it here.
        smaller_index = [x, indices(6, 4, 3, seed=5), randn(4, 5)]
        assert sweep(mesh, lambda t, i, s: t.scatter_add(1, i, s), smaller_index, differentiable=[True, False, False]) > 0
        assert (
            sweep(mesh, lambda t, i, s: t.scatter_reduce(1, i, s, "sum"), [x, indices(6, 4, 4, seed=6), randn(4, 4)])
            > 0
        )
        assert (
            sweep(
                mesh,
                lambda t, i, s: t.scatter_reduce(1, i, s, "amax", include_self=False),
                [x, positions, randn(4, 4, seed=7)],
            )
            > 0
        )

    def test_advanced_indexing(self) -> None:
        mesh = self.build_device_mesh()
        x = randn(4, 6, 8)
        assert sweep(mesh, lambda t, i: t[i], [x, indices(4, 8)]) > 0
        assert sweep(mesh, lambda t, i: t[:, i], [x, indices(6, 4, 3, seed=1)]) > 0
        assert sweep(mesh, lambda t, i: t[..., i], [x, indices(8, 5, seed=2)]) > 0
        assert sweep(mesh, lambda t, i: t[None, i], [x, indices(4, 4, seed=3)]) > 0
        assert sweep(mesh, lambda t, a, b: t[a, b], [x, indices(4, 4, seed=4), indices(6, 4, seed=5)]) > 0
        # Separated index tensors: their dims move to the front of the result.
        assert sweep(mesh, lambda t, a, b: t[a, :, b], [x, indices(4, 4, 1, seed=6), indices(8, 3, seed=7)]) > 0
        assert sweep(mesh, lambda t, a: t[a, 2], [x, indices(4, 6, seed=8)]) > 0  # an int index is a select first

    def test_index_put(self) -> None:
        mesh = self.build_device_mesh()
        x = randn(4, 6)
        rows = distinct_indices(4, 1, 4)[0]
        # A gradient for self would need torch's own plain zeros (see the report): values only.
        values_only = [False, False, True]
        assert sweep(mesh, lambda t, i, v: t.index_put((i,), v), [x, rows[:2], randn(2, 6)], differentiable=values_only) > 0
        assert (
            sweep(
                mesh,
                lambda t, i, v: t.index_put((i,), v, accumulate=True),
                [x, indices(4, 8, seed=1), randn(8, 6, seed=2)],
                differentiable=values_only,
            )
            > 0
        )
        assert (
            sweep(
                mesh,
                lambda t, i, v: t.index_put((i,), v, accumulate=True),
                [x, indices(4, 8, seed=3), randn(6, seed=4)],  # values broadcast over the indexed rows
                differentiable=values_only,
            )
            > 0
        )

        def set_columns(t: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            written = t * 1.0
            written[:, i] = v
            return written

        columns, new_values = distinct_indices(6, 1, 3, seed=5)[0], randn(4, 3, seed=6)
        # Written in place, self keeps its layout: every one but a shard of the written columns.
        for self_layout in (Replicate(), Shard(0), Partial()):
            for index_layout in (Replicate(), Shard(0)):
                for values_layout in (Replicate(), Shard(0), Shard(1), Partial()):
                    layouts = [(self_layout,), (index_layout,), (values_layout,)]
                    check_layout(mesh, set_columns, [x, columns, new_values], layouts, differentiable=values_only)
        # Each rank holds other columns: the write would need self moved, which an in-place op must not do.
        written = distribute_tensor(x, mesh, [Shard(1)], src_data_rank=None)
        local_ids = distribute_tensor(columns, mesh, [Replicate()], src_data_rank=None)
        local_values = distribute_tensor(new_values, mesh, [Replicate()], src_data_rank=None)
        with CommDebugMode() as mode, pytest.raises(ShardingPropagationError, match=r"aten\.index_put_\.default"):
            written[:, local_ids] = local_values
        assert mode.get_total_counts() == 0

        def zero_where(t: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            written = t * 1.0
            written[m] = 0.0
            return written

        assert sweep(mesh, zero_where, [x, mask(4, 6)]) > 0  # a mask and a scalar: differentiable in self

        def zero_pairs(t: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
            # The i-th selected row pairs with the i-th selected column: not elementwise, so self is
            # replicated first (out of place; in place, a sharded self would be refused).
            return torch.index_put(t, (rows, cols), torch.tensor(0.0, dtype=t.dtype))

        row_flags = torch.tensor([True, False, True, False])
        col_flags = torch.tensor([False, True, False, False, True, False])
        assert sweep(mesh, zero_pairs, [x, row_flags, col_flags]) > 0

    def test_slice_and_select_scatter(self) -> None:
        mesh = self.build_device_mesh()
        x = randn(4, 6)
        # As for index_put, torch's gradient for self is built from plain zeros: the source's only.
        source_only = [False, True]
        for fn, source in (
            (lambda t, s: torch.slice_scatter(t, s, 1, 1, 5, 2), randn(4, 2, seed=1)),
            (lambda t, s: torch.slice_scatter(t, s, 0, 0, 4), randn(4, 6, seed=2)),
            (lambda t, s: torch.select_scatter(t, s, 0, -1), randn(6, seed=3)),
        ):
            assert sweep(mesh, fn, [x, source], differentiable=source_only) > 0

    def test_masked_fill_and_where(self) -> None:
        mesh = self.build_device_mesh()
        x, y = randn(4, 6), randn(4, 6, seed=1)
        assert sweep(mesh, lambda t, m: t.masked_fill(m, 0.5), [x, mask(4, 6)]) > 0
        assert sweep(mesh, lambda t, m: t.masked_fill(m, -1.0), [x, mask(4, 1, seed=1)]) > 0
        assert sweep(mesh, lambda t, m, v: t.masked_fill(m, v), [x, mask(6, seed=2), randn(seed=3)]) > 0
        assert sweep(mesh, lambda c, a, b: torch.where(c, a, b), [mask(4, 6, seed=4), x, y]) > 0
        assert sweep(mesh, lambda c, a: torch.where(c, a, 0.0), [mask(4, 6, seed=5), x]) > 0
        assert sweep(mesh, lambda a, c, b: a.where(c, b), [x, mask(4, 1, seed=6), randn(6, seed=7)]) > 0

    def test_indexing_on_a_2x2_mesh(self) -> None:
        mesh = mesh_2x2()
        x = randn(4, 6, 8)
        for fn, inputs in (
            (lambda t: t[:, 2:5], [x]),
            (lambda t: t[:, -1], [x]),
            (lambda t, i: t[:, i], [x, indices(6, 4, 2)]),
            (lambda t, i: t.gather(2, i), [x, indices(8, 4, 6, 4)]),
            (lambda t, i: t.index_select(0, i), [x, indices(4, 8)]),
            (lambda t, m: t.masked_fill(m, 0.0), [x, mask(4, 6, 8)]),
        ):
            assert sweep(mesh, fn, inputs, limit=LAYOUT_SAMPLE_2D) > 0

    # -- decisions ----------------------------------------------------------------------------

    def test_slicing_a_sharded_dim_redistributes_unless_the_slice_is_the_whole_dim(self) -> None:
        mesh = self.build_device_mesh()
        full = randn(4, 8)
        columns = distribute_tensor(full, mesh, [Shard(1)], src_data_rank=None)
        for whole in (lambda t: t[:, :], lambda t: t[:, 0:8], lambda t: t[:, -8:100], lambda t: t.narrow(1, 0, 8)):
            with CommDebugMode() as mode:
                result = whole(columns)
            assert result.placements == (Shard(1),) and mode.get_total_counts() == 0
            torch.testing.assert_close(result.full_tensor(), full)
        with CommDebugMode() as mode:
            part = columns[:, 1:7]
        # The sliced dim must be whole on every rank; an all-to-all onto the rows moves the fewest bytes.
        assert part.placements == (Shard(0),) and comm_counts(mode) == {"all_to_all_single": 1}
        torch.testing.assert_close(part.full_tensor(), full[:, 1:7])
        with CommDebugMode() as mode:
            other_dim = columns[1:3]
        assert other_dim.placements == (Shard(1),) and mode.get_total_counts() == 0
        torch.testing.assert_close(other_dim.full_tensor(), full[1:3])

    def test_a_sharded_index_picks_from_a_replicated_table_without_communication(self) -> None:
        mesh = self.build_device_mesh()
        table_full, ids_full = randn(10, 4), indices(10, 8, 3)
        table = distribute_tensor(table_full, mesh, [Replicate()], src_data_rank=None).requires_grad_()
        ids = distribute_tensor(ids_full, mesh, [Shard(0)], src_data_rank=None)
        plain_table = table_full.clone().requires_grad_()
        gradient = randn(8, 3, 4, seed=1)
        for lookup in (
            lambda t, i: t[i],
            lambda t, i: t.index_select(0, i.flatten()).view(8, 3, 4),
            lambda t, i: t.gather(0, i.flatten()[:, None].expand(24, 4)).view(8, 3, 4),
        ):
            table.grad = None
            plain_table.grad = None
            with CommDebugMode() as mode:
                rows = lookup(table, ids)
            assert rows.placements == (Shard(0),) and mode.get_total_counts() == 0
            expected = lookup(plain_table, ids_full)
            torch.testing.assert_close(rows.full_tensor(), expected)
            expected.backward(gradient)
            with CommDebugMode() as mode:
                rows.backward(distribute_tensor(gradient, mesh, [Shard(0)], src_data_rank=None))
            # Each rank adds its rows' gradients into its own copy of the table: a partial sum, not a gather.
            assert table.grad is not None and table.grad.placements == (Partial(),)
            assert "all_gather_into_tensor" not in comm_counts(mode), comm_counts(mode)
            torch.testing.assert_close(table.grad.full_tensor(), plain_table.grad)

    def test_selecting_from_a_sharded_dim_moves_the_shard_first(self) -> None:
        mesh = self.build_device_mesh()
        full = randn(4, 8)
        rows = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
        with CommDebugMode() as mode:
            picked = rows[2]
        assert picked.placements == (Shard(0),) and comm_counts(mode) == {"all_to_all_single": 1}
        torch.testing.assert_close(picked.full_tensor(), full[2])
        with CommDebugMode() as mode:
            column = rows[:, 3]
        assert column.placements == (Shard(0),) and mode.get_total_counts() == 0
        torch.testing.assert_close(column.full_tensor(), full[:, 3])

    def test_bad_arguments_fail_before_any_collective(self) -> None:
        mesh = self.build_device_mesh()
        x = distribute_tensor(randn(4, 6), mesh, [Shard(0)], src_data_rank=None)
        ids = distribute_tensor(indices(6, 2, 2), mesh, [Shard(0)], src_data_rank=None)
        flat_ids = distribute_tensor(indices(4, 4), mesh, [Shard(0)], src_data_rank=None)
        three_rows = distribute_tensor(randn(3, 6), mesh, [Replicate()], src_data_rank=None)
        single_rows = distribute_tensor(randn(4, 6).float(), mesh, [Replicate()], src_data_rank=None)
        flags = distribute_tensor(mask(4, 6), mesh, [Replicate()], src_data_rank=None)
        bad_calls = [
            (lambda: x.select(1, 6), IndexError, "out of range"),
            (lambda: x.narrow(1, 4, 3), RuntimeError, "exceeds dimension size"),
            (lambda: x.index_select(1, ids), IndexError, "Index is supposed to be a vector"),
            (lambda: x.gather(1, flat_ids), RuntimeError, "same number of dimensions"),
            (lambda: x.index_put((flat_ids,), three_rows), RuntimeError, "cannot be broadcast to indexing result"),
            (lambda: x.index_put((flat_ids,), single_rows), RuntimeError, "dtypes match"),
            # A mask read runs on the whole tensors (value-sized); a mask of the wrong shape fails before the gather.
            (lambda: x[flags[:3]], IndexError, r"shape of the mask \[3, 6\] at index 0 does not match"),
        ]
        for call, error, message in bad_calls:
            with CommDebugMode() as mode, pytest.raises(error, match=message):
                call()
            assert mode.get_total_counts() == 0, message


# -- shape helpers (pure) --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size, start, end, step",
    [(8, None, None, 1), (8, -3, 100, 1), (8, 2, 1, 1), (8, -100, 3, 2), (8, 1, 8, 3), (0, 0, 5, 1), (5, 9, 12, 1)],
)
def test_slice_bounds_follow_python_slicing(size: int, start: int | None, end: int | None, step: int) -> None:
    bounds = slice_bounds(size, start, end, step)
    assert bounds is not None
    assert bounds.length == len(range(size)[slice(start, end, step)])
    assert torch.arange(size)[bounds.start : bounds.end : bounds.step].tolist() == list(range(size))[start:end:step]


def test_slice_bounds_reject_a_non_positive_step() -> None:
    assert slice_bounds(8, 0, 4, 0) is None and slice_bounds(8, 0, 4, -1) is None


@pytest.mark.parametrize(
    "self_shape, index_shapes",
    [
        ((4, 6, 8), [(5,)]),
        ((4, 6, 8), [None, (2, 3)]),
        ((4, 6, 8), [(3, 1), (1, 2)]),
        ((4, 6, 8), [(2,), None, (2,)]),
        ((4, 6, 8), [None, (3,), (3,)]),
        ((4, 6, 8, 2), [None, (3,), None, (1,)]),
    ],
)
def test_advanced_index_layout_matches_torch(self_shape: tuple[int, ...], index_shapes: list) -> None:
    layout = advanced_index_layout(self_shape, [None if shape is None else torch.Size(shape) for shape in index_shapes])
    assert layout is not None
    key = tuple(slice(None) if shape is None else torch.zeros(shape, dtype=torch.long) for shape in index_shapes)
    assert layout.result_shape == tuple(torch.empty(self_shape)[key].shape)
    # Each kept dim of self lands where a marker of its own size shows it.
    for dim, result_dim in layout.result_dim_of_self_dim.items():
        marked = list(self_shape)
        marked[dim] = 7
        assert torch.empty(marked)[key].shape[result_dim] == 7


# -- output metadata equals torch's, for every input layout ---------------------------------------


_MESH = FakeMesh((4,))


def _as_spec(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return DTensorSpec(_MESH, (Replicate(),), TensorMeta(value.shape, tuple(value.stride()), value.dtype))
    if isinstance(value, (list, tuple)):
        return type(value)(_as_spec(item) for item in value)
    return value


SELF_LAYOUTS = {
    "contiguous": lambda: randn(4, 6),
    "transposed": lambda: randn(6, 4).t(),
    "sliced": lambda: randn(4, 12)[:, ::2],
    "expanded": lambda: randn(4, 1).expand(4, 6),
}
META_CALLS = {
    "select": (aten.select.int, lambda: (1, -2)),
    "slice_step": (aten.slice.Tensor, lambda: (1, 1, 5, 2)),
    "slice_clamped": (aten.slice.Tensor, lambda: (0, -3, 100)),
    "index_select": (aten.index_select.default, lambda: (1, torch.tensor([0, 2, 2]))),
    "gather": (aten.gather.default, lambda: (1, indices(6, 4, 3))),
    "scatter_src": (aten.scatter.src, lambda: (1, distinct_indices(6, 4, 2), randn(4, 2))),
    "scatter_add": (aten.scatter_add.default, lambda: (0, indices(4, 2, 6), randn(2, 6))),
    "index_add": (aten.index_add.default, lambda: (0, indices(4, 3), randn(3, 6))),
    "index_put": (aten.index_put.default, lambda: ([torch.tensor([0, 3])], randn(2, 6))),
    "index_put_accumulate": (aten.index_put.default, lambda: ([None, torch.tensor([1, 1])], randn(4, 2), True)),
    "index": (aten.index.Tensor, lambda: ([None, torch.tensor([[0, 5]])],)),
    "slice_scatter": (aten.slice_scatter.default, lambda: (randn(4, 2), 1, 0, 4, 2)),
    "select_scatter": (aten.select_scatter.default, lambda: (randn(6), 0, 1)),
}


@pytest.mark.parametrize("layout", sorted(SELF_LAYOUTS))
@pytest.mark.parametrize("call", sorted(META_CALLS))
def test_output_metadata_matches_torch(layout: str, call: str) -> None:
    op, make_args = META_CALLS[call]
    self_tensor, extra = SELF_LAYOUTS[layout](), make_args()
    rule = rule_for(op)
    assert rule is not None
    spec_args = (_as_spec(self_tensor), *[_as_spec(arg) for arg in extra])
    computed = rule.output_meta(op, spec_args, {}) if rule.output_meta is not None else None
    if computed is None:
        _, (computed,) = _run_on_meta(op, spec_args, {})
    reference = op(self_tensor, *extra)
    assert computed == TensorMeta(reference.shape, tuple(reference.stride()), reference.dtype)


@pytest.mark.parametrize(
    "op, args",
    [
        (aten.slice_backward.default, (randn(4, 2), [4, 6], 1, 1, 5, 2)),
        (aten.slice_backward.default, (randn(4, 6).t(), [9, 4], 0, 3, 100, 1)),
        (aten.select_backward.default, (randn(4), [4, 6], 1, -1)),
    ],
)
def test_backward_output_metadata_matches_torch(op: torch._ops.OpOverload, args: tuple) -> None:
    rule = rule_for(op)
    assert rule is not None and rule.output_meta is not None
    reference = op(*args)
    computed = rule.output_meta(op, tuple(_as_spec(arg) for arg in args), {})
    assert computed == TensorMeta(reference.shape, tuple(reference.stride()), reference.dtype)


@pytest.mark.parametrize(
    "op, args, error, message",
    [
        (aten.slice_scatter.default, (randn(4, 6), randn(4, 3), 1, 0, 2), RuntimeError, "src to have a size equal"),
        (aten.select_scatter.default, (randn(4, 6), randn(5), 0, 1), RuntimeError, "src to have a size equal"),
        (aten.select_scatter.default, (randn(4, 6), randn(6), 0, 4), IndexError, "out of range"),
        (aten.index_add.default, (randn(4, 6), 0, randn(3), randn(3, 6)), RuntimeError, "int32/int64 for index"),
        (aten.index_put.default, (randn(4, 6), [randn(3)], randn(3, 6)), IndexError, "must be long, int"),
        (
            aten.index_put.default,
            (randn(4, 6), [torch.tensor([0])] * 3, randn(1)),
            IndexError,
            "too many indices for tensor of dimension 2",
        ),
        (aten.slice_backward.default, (randn(4, 3), [4, 6], 1, 0, 2, 1), RuntimeError, "must match the size"),
        (aten.index_select.default, (randn(4, 6), 1, torch.zeros(2, 2, dtype=torch.long)), IndexError, "a vector"),
        (aten.index_select.default, (randn(4, 6), 1, torch.zeros(2)), RuntimeError, "int32 or int64 for index"),
    ],
)
def test_bad_calls_are_refused_by_the_rule_like_torch_would(
    op: torch._ops.OpOverload, args: tuple, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        op(*args)  # torch refuses them, but meta tensors do not: the rule must, before any redistribution
    with pytest.raises(error, match=message):
        decide_op_sharding(op, tuple(_as_spec(arg) for arg in args), {})
