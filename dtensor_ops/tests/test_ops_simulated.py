"""Every op family on every sharding of its inputs, simulated rank by rank in one process.

For each case and each combination of input placements, the decision is computed
for every mesh coordinate (a fake mesh per coordinate), each rank's local inputs
are cut from the full inputs in the *target* layout (an exact stand-in for
redistribution; Partial values are split with random parts that only reduce to
the right value), the op runs on the locals with the decision's local argument
overrides, and the outputs are reassembled from all ranks according to the
output spec.  The result must equal the op on the full tensors, replicas must
agree, every rank's local output must have the shape its spec says, and every
rank must take the same decision.  No processes: this checks the rules' exactness
(uneven shards, nested mesh dims, Partial linearity) quickly; the multi-rank
tests check the same ops through the real DTensor.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import pytest
import torch

from shardwise.dtensor_ops._sharding_prop import OpDecision, ShardingPropagationError, propagate_op_sharding
from shardwise.placement import (
    DTensorSpec,
    Partial,
    Placement,
    Replicate,
    Shard,
    TensorMeta,
    compute_local_shape_and_global_offset,
    select_local_shard,
)
from shardwise.testing import FakeMesh

aten = torch.ops.aten


class D:
    """Marks an argument that is a DTensor; holds its full (global) value."""

    def __init__(self, full: torch.Tensor) -> None:
        self.full = full

    def __repr__(self) -> str:
        return f"D{tuple(self.full.shape)}"


@dataclass
class Case:
    name: str
    op: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    compare_values: bool = True  # False for empty_like / rand_like: only layouts and shapes are checked
    extra_partials: tuple[str, ...] = ()  # Partial kinds tried on a 1-D mesh besides "sum"

    def __str__(self) -> str:
        return self.name


_GENERATOR = torch.Generator().manual_seed(1234)


def f(*shape: int) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=_GENERATOR)


def positive(*shape: int) -> torch.Tensor:
    return torch.rand(shape, dtype=torch.float64, generator=_GENERATOR) + 0.5


def ints(*shape: int) -> torch.Tensor:
    return torch.randint(-5, 6, shape, generator=_GENERATOR)


def mask(*shape: int) -> torch.Tensor:
    return torch.rand(shape, generator=_GENERATOR) > 0.5


def _cases() -> list[Case]:
    x53, y53 = f(5, 3), f(5, 3)
    cases = [
        # pointwise: unary
        Case("neg", aten.neg.default, (D(x53),), extra_partials=("avg", "max")),
        Case("relu", aten.relu.default, (D(x53),), extra_partials=("max",)),
        Case("exp", aten.exp.default, (D(f(4, 3)),)),
        Case("gelu_tanh", aten.gelu.default, (D(x53),), {"approximate": "tanh"}),
        Case("clamp", aten.clamp.default, (D(x53), -0.5, 0.5)),
        Case("pow_scalar", aten.pow.Tensor_Scalar, (D(x53), 2)),
        Case("sqrt", aten.sqrt.default, (D(positive(5, 3)),)),
        Case("isnan_bool_out", aten.isnan.default, (D(x53),)),
        Case("abs_int", aten.abs.default, (D(ints(5, 3)),)),
        Case("relu_inplace", aten.relu_.default, (D(f(5, 3)),)),
        Case("neg_inplace", aten.neg_.default, (D(f(4, 3)),), extra_partials=("avg",)),
        # pointwise: binary
        Case("add", aten.add.Tensor, (D(x53), D(y53)), extra_partials=("avg",)),
        Case("add_bias_broadcast", aten.add.Tensor, (D(x53), D(f(3))), extra_partials=("avg",)),
        Case("add_outer_broadcast", aten.add.Tensor, (D(f(5, 1)), D(f(1, 3)))),
        Case("add_python_scalar", aten.add.Tensor, (D(x53), 2.5)),
        Case("add_0dim_dtensor", aten.add.Tensor, (D(x53), D(f()))),
        Case("sub_alpha", aten.sub.Tensor, (D(x53), D(y53)), {"alpha": 2}),
        Case("rsub", aten.rsub.Tensor, (D(x53), D(y53))),
        Case("rsub_scalar", aten.rsub.Scalar, (D(x53), 1.5)),
        Case("mul", aten.mul.Tensor, (D(x53), D(y53)), extra_partials=("avg",)),
        Case("mul_python_scalar", aten.mul.Tensor, (D(x53), 3), extra_partials=("avg", "max")),
        Case("mul_scalar_overload", aten.mul.Scalar, (D(x53), -2.0)),
        Case("mul_broadcast", aten.mul.Tensor, (D(x53), D(f(3)))),
        Case("div", aten.div.Tensor, (D(x53), D(positive(5, 3))), extra_partials=("avg",)),
        Case("div_scalar", aten.div.Tensor, (D(x53), 4.0)),
        Case("div_floor", aten.div.Tensor_mode, (D(x53), D(positive(5, 3))), {"rounding_mode": "floor"}),
        Case("maximum", aten.maximum.default, (D(x53), D(y53))),
        Case("eq", aten.eq.Tensor, (D(ints(5, 3)), D(ints(5, 3)))),
        Case("lt_scalar", aten.lt.Scalar, (D(x53), 0.0)),
        Case("where", aten.where.self, (D(mask(5, 3)), D(x53), D(f(3)))),
        Case("masked_fill", aten.masked_fill.Scalar, (D(x53), D(mask(5, 1)), 0.5)),
        Case("addcmul", aten.addcmul.default, (D(x53), D(y53), D(f(3))), {"value": 0.5}),
        Case("threshold_backward", aten.threshold_backward.default, (D(f(5, 3)), D(x53), 0.0)),
        Case(
            "sigmoid_backward",
            aten.sigmoid_backward.default,
            (D(f(5, 3)), D(positive(5, 3))),
            extra_partials=("avg",),
        ),
        Case("add_inplace", aten.add_.Tensor, (D(f(5, 3)), D(y53)), extra_partials=("avg",)),
        Case("add_inplace_broadcast", aten.add_.Tensor, (D(f(5, 3)), D(f(3)))),
        Case("mul_inplace_scalar", aten.mul_.Tensor, (D(f(5, 3)), 2.0), extra_partials=("avg", "max")),
        Case("div_inplace", aten.div_.Tensor, (D(f(5, 3)), D(positive(5, 3)))),
        Case("add_out", aten.add.out, (D(x53), D(y53)), {"out": D(torch.zeros(5, 3, dtype=torch.float64))}),
        Case("mul_out", aten.mul.out, (D(x53), D(f(3))), {"out": D(torch.zeros(5, 3, dtype=torch.float64))}),
        # matrix
        Case("mm", aten.mm.default, (D(f(5, 4)), D(f(4, 3)))),
        Case("mm_even", aten.mm.default, (D(f(4, 8)), D(f(8, 4))), extra_partials=("avg",)),
        Case("addmm_bias_row", aten.addmm.default, (D(f(3)), D(f(5, 4)), D(f(4, 3)))),
        Case("addmm_bias_full", aten.addmm.default, (D(f(5, 3)), D(f(5, 4)), D(f(4, 3))), {"beta": 0.5, "alpha": 2.0}),
        Case("addmm_bias_column", aten.addmm.default, (D(f(5, 1)), D(f(5, 4)), D(f(4, 3)))),
        Case("addmm_inplace", aten.addmm_.default, (D(f(5, 3)), D(f(5, 4)), D(f(4, 3)))),
        Case("mm_out", aten.mm.out, (D(f(5, 4)), D(f(4, 3))), {"out": D(torch.zeros(5, 3, dtype=torch.float64))}),
        Case("bmm", aten.bmm.default, (D(f(2, 5, 4)), D(f(2, 4, 3)))),
        Case("baddbmm", aten.baddbmm.default, (D(f(2, 5, 3)), D(f(2, 5, 4)), D(f(2, 4, 3)))),
        Case("baddbmm_broadcast", aten.baddbmm.default, (D(f(3)), D(f(2, 5, 4)), D(f(2, 4, 3)))),
        Case("t", aten.t.default, (D(f(5, 3)),), extra_partials=("max",)),
        Case("t_1d", aten.t.default, (D(f(5)),)),
        Case("transpose", aten.transpose.int, (D(f(2, 5, 3)), 0, 2)),
        Case("transpose_negative", aten.transpose.int, (D(f(5, 3)), -1, 0)),
        # reductions
        Case("sum_all", aten.sum.default, (D(x53),), extra_partials=("avg",)),
        Case("sum_dim0", aten.sum.dim_IntList, (D(x53), [0])),
        Case("sum_dim1_keepdim", aten.sum.dim_IntList, (D(x53), [1], True)),
        Case("sum_dims_3d", aten.sum.dim_IntList, (D(f(2, 5, 3)), [0, 2])),
        Case("sum_empty_dims", aten.sum.dim_IntList, (D(x53), [])),
        Case("sum_negative_dim", aten.sum.dim_IntList, (D(x53), [-1])),
        Case("sum_dtype", aten.sum.dim_IntList, (D(x53), [0]), {"dtype": torch.float32}),
        Case("sum_int", aten.sum.default, (D(ints(5, 3)),)),
        Case("sum_out", aten.sum.IntList_out, (D(x53), [0]), {"out": D(torch.zeros(3, dtype=torch.float64))}),
        Case("mean_all_even", aten.mean.default, (D(f(4, 6)),), extra_partials=("avg",)),
        Case("mean_all_uneven", aten.mean.default, (D(x53),)),
        Case("mean_dim0_even", aten.mean.dim, (D(f(4, 6)), [0])),
        Case("mean_dim0_uneven", aten.mean.dim, (D(x53), [0])),
        Case("mean_dim1_keepdim", aten.mean.dim, (D(f(4, 6)), [1], True)),
        Case("mean_dims_3d", aten.mean.dim, (D(f(2, 4, 3)), [0, 1])),
        # tensor basics
        Case("detach", aten.detach.default, (D(x53),), extra_partials=("max", "avg")),
        Case("clone", aten.clone.default, (D(x53),)),
        Case("alias", aten.alias.default, (D(x53),)),
        Case("to_float32", aten._to_copy.default, (D(x53),), {"dtype": torch.float32}),
        Case("to_int64", aten._to_copy.default, (D(x53 * 4),), {"dtype": torch.int64}, extra_partials=("max",)),
        Case("copy_", aten.copy_.default, (D(f(5, 3)), D(y53)), extra_partials=("avg",)),
        Case("copy_broadcast", aten.copy_.default, (D(f(5, 3)), D(f(3)))),
        Case("copy_cast", aten.copy_.default, (D(f(5, 3)), D(y53.float()))),
        Case("empty_like", aten.empty_like.default, (D(x53),), compare_values=False),
        Case("zeros_like", aten.zeros_like.default, (D(x53),), extra_partials=("max",)),
        Case("ones_like", aten.ones_like.default, (D(x53),), {"dtype": torch.float32}),
        Case("full_like", aten.full_like.default, (D(x53), 7.0)),
        Case("rand_like", aten.rand_like.default, (D(x53),), compare_values=False),
        Case("randn_like", aten.randn_like.default, (D(x53),), compare_values=False),
        Case("new_zeros", aten.new_zeros.default, (D(x53), [3, 2])),
        Case("new_ones", aten.new_ones.default, (D(x53), [4])),
        Case("new_full", aten.new_full.default, (D(x53), [2, 2], 1.5)),
        Case("new_empty", aten.new_empty.default, (D(x53), [2, 3]), compare_values=False),
        Case("fill_scalar", aten.fill_.Scalar, (D(f(5, 3)), 1.5), extra_partials=("avg", "max")),
        Case("fill_tensor", aten.fill_.Tensor, (D(f(5, 3)), D(f()))),
        Case("zero_", aten.zero_.default, (D(f(5, 3)),), extra_partials=("avg",)),
        Case("equal_false", aten.equal.default, (D(x53), D(y53))),
        Case("equal_true", aten.equal.default, (D(x53), D(x53.clone()))),
        # views
        Case("view_merge_even", aten.view.default, (D(f(4, 3, 2)), [12, 2]), extra_partials=("max",)),
        Case("view_merge_uneven", aten.view.default, (D(f(2, 3, 2)), [6, 2])),
        Case("view_split", aten.view.default, (D(f(6, 2)), [2, 3, 2])),
        Case("view_flatten", aten.view.default, (D(x53), [15])),
        Case("view_drop_one", aten.view.default, (D(f(1, 6)), [6])),
        Case("view_add_one", aten.view.default, (D(f(6)), [1, 6])),
        Case("view_split_last", aten.view.default, (D(f(4, 6)), [4, 2, 3])),
        Case("view_infer", aten.view.default, (D(f(4, 6)), [-1])),
        Case("view_linear_input", aten.view.default, (D(f(4, 3, 4)), [-1, 4])),
        Case("view_nested_split", aten.view.default, (D(f(8, 3)), [2, 4, 3])),
        Case("unsafe_view_linear_output", aten._unsafe_view.default, (D(f(12, 6)), [4, 3, 6])),
        Case("expand_row", aten.expand.default, (D(f(1, 3)), [5, 3])),
        Case("expand_new_dim", aten.expand.default, (D(f(3)), [4, 3])),
        Case("expand_scalar", aten.expand.default, (D(f()), [5, 3])),
        Case("expand_column", aten.expand.default, (D(f(5, 1)), [5, 4])),
        Case("expand_keep", aten.expand.default, (D(x53), [-1, 3]), extra_partials=("max",)),
        # concatenating and splitting
        Case("cat_dim1", aten.cat.default, ([D(x53), D(y53)], 1), extra_partials=("max",)),
        Case("cat_dim0_three", aten.cat.default, ([D(x53), D(f(2, 3)), D(f(1, 3))],)),
        Case("cat_negative_dim", aten.cat.default, ([D(f(5, 2)), D(x53)], -1)),
        Case("split", aten.split.Tensor, (D(f(5, 6)), 4, 1), extra_partials=("avg",)),
        Case("split_with_sizes", aten.split_with_sizes.default, (D(f(5, 6)), [2, 3], 0)),
        Case("unbind", aten.unbind.int, (D(f(3, 5)), 0)),
        Case("unbind_last", aten.unbind.int, (D(f(5, 2)), 1)),
        Case("max_dim", aten.max.dim, (D(x53), 1)),
        Case("min_dim_keepdim", aten.min.dim, (D(x53), 0, True)),
        Case("item", aten._local_scalar_dense.default, (D(f()),)),
        Case("item_of_one_element", aten._local_scalar_dense.default, (D(f(1)),)),
    ]
    return cases


CASES = _cases()


def _placement_options(tensor: torch.Tensor, partial_kinds: Sequence[str]) -> list[Placement]:
    options: list[Placement] = [Replicate()]
    options += [Shard(dim) for dim in range(tensor.dim())]
    if tensor.is_floating_point():
        options += [Partial(kind) for kind in partial_kinds]
    return options


# On 2-D meshes ops with several inputs have thousands of layout combinations; by default a
# deterministic, evenly spread subset of this many is checked.  SHARDWISE_EXHAUSTIVE=1 checks all.
LAYOUTS_PER_CASE_ON_2D_MESHES = 48


def _input_layouts(case: Case, mesh_shape: tuple[int, ...]) -> list[tuple[tuple[Placement, ...], ...]]:
    dtensors = _dtensor_args(case)
    partial_kinds = ("sum",) + (case.extra_partials if len(mesh_shape) == 1 else ())
    per_tensor = []
    for marker in dtensors:
        options = _placement_options(marker.full, partial_kinds)
        per_tensor.append(list(itertools.product(options, repeat=len(mesh_shape))))
    every = [tuple(tuple(layout) for layout in layouts) for layouts in itertools.product(*per_tensor)]
    limit = LAYOUTS_PER_CASE_ON_2D_MESHES
    if len(mesh_shape) == 1 or len(every) <= limit or os.environ.get("SHARDWISE_EXHAUSTIVE") == "1":
        return every
    # The first and last combinations (all replicated / all partial) are always in the spread.
    return [every[round(index * (len(every) - 1) / (limit - 1))] for index in range(limit)]


def _walk(value: Any, visit: Callable[[D], Any]) -> Any:
    if isinstance(value, D):
        return visit(value)
    if isinstance(value, list):
        return [_walk(item, visit) for item in value]
    if isinstance(value, tuple):
        return tuple(_walk(item, visit) for item in value)
    return value


def _dtensor_args(case: Case) -> list[D]:
    found: list[D] = []

    def visit(marker: D) -> D:
        found.append(marker)
        return marker

    _walk(case.args, visit)
    _walk(tuple(case.kwargs.values()), visit)
    return found


def _replace_dtensors(case: Case, replacements: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    pending = iter(replacements)

    def visit(marker: D) -> Any:
        return next(pending)

    args = _walk(case.args, visit)
    kwargs = {name: _walk(value, visit) for name, value in case.kwargs.items()}
    return args, kwargs


def _meta_of(tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(tensor.shape, tuple(tensor.stride()), tensor.dtype)


def _pieces(
    full: torch.Tensor, mesh_shape: tuple[int, ...], placements: Sequence[Placement], seed: int
) -> dict[tuple[int, ...], torch.Tensor]:
    """Each coordinate's local tensor for ``full`` laid out as ``placements`` (random Partial parts)."""
    generator = torch.Generator().manual_seed(seed)
    base = full
    noise: dict[int, torch.Tensor] = {}
    for mesh_dim, placement in enumerate(placements):
        if not isinstance(placement, Partial):
            continue
        parts = mesh_shape[mesh_dim]
        draw = torch.randn((parts, *full.shape), dtype=full.dtype, generator=generator)
        if placement.reduce_op == "sum":
            base = base / parts
            noise[mesh_dim] = draw - draw.mean(0)
        elif placement.reduce_op == "avg":
            noise[mesh_dim] = draw - draw.mean(0)
        else:
            offsets = draw.abs()
            offsets[0] = 0
            noise[mesh_dim] = -offsets if placement.reduce_op == "max" else offsets
    pieces = {}
    for coordinate in itertools.product(*(range(size) for size in mesh_shape)):
        value = base
        for mesh_dim, parts_noise in noise.items():
            value = value + parts_noise[coordinate[mesh_dim]]
        pieces[coordinate] = select_local_shard(value, mesh_shape, coordinate, placements).clone()
    return pieces


_REDUCERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum": lambda stacked: stacked.sum(0),
    "avg": lambda stacked: stacked.mean(0),
    "max": lambda stacked: stacked.amax(0),
    "min": lambda stacked: stacked.amin(0),
}


def _assemble(
    pieces: dict[tuple[int, ...], torch.Tensor], mesh_shape: tuple[int, ...], spec: DTensorSpec[Any]
) -> torch.Tensor:
    """The global tensor the per-coordinate ``pieces`` represent under ``spec`` (checks replicas agree)."""
    meta = spec.tensor_meta
    assert meta is not None
    placements = spec.placements
    current = dict(pieces)
    # The last mesh dim is reduced first (the planner's convention for mixed Partial kinds).
    for mesh_dim in reversed(range(len(mesh_shape))):
        placement = placements[mesh_dim]
        if not isinstance(placement, Partial):
            continue
        grouped: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for coordinate, piece in sorted(current.items()):
            key = coordinate[:mesh_dim] + (0,) + coordinate[mesh_dim + 1 :]
            grouped.setdefault(key, []).append(piece)
        reducer = _REDUCERS[placement.reduce_op]
        current = {key: reducer(torch.stack(group)) for key, group in grouped.items()}
    result = torch.zeros(meta.shape, dtype=meta.dtype)
    covered = torch.zeros(meta.shape, dtype=torch.bool)
    # Which global elements each piece holds, by the layout's own selection: a _StridedShard piece is not
    # one box of the global tensor.
    global_index = torch.arange(result.numel()).reshape(meta.shape)
    flat_result, flat_covered = result.view(-1), covered.view(-1)
    for coordinate, piece in current.items():
        shape, _ = compute_local_shape_and_global_offset(meta.shape, mesh_shape, coordinate, placements)
        assert tuple(piece.shape) == shape, f"{coordinate}: local shape {tuple(piece.shape)}, spec says {shape}"
        held = select_local_shard(global_index, mesh_shape, coordinate, placements).reshape(-1)
        values = piece.reshape(-1)
        seen = flat_covered[held]
        if seen.any():
            torch.testing.assert_close(
                values[seen], flat_result[held][seen], equal_nan=True, msg=f"replicas differ at {coordinate}"
            )
        flat_result[held] = values
        flat_covered[held] = True
    assert bool(covered.all()), f"the shards of {spec} do not cover the tensor"
    return result


def _specs_for(mesh: FakeMesh, layouts: Sequence[tuple[Placement, ...]], dtensors: Sequence[D]) -> list[Any]:
    return [DTensorSpec(mesh, layout, _meta_of(marker.full)) for marker, layout in zip(dtensors, layouts)]


def _layout_of(decision: OpDecision) -> tuple[Any, ...]:
    outputs = decision.output_specs
    output_layout: Any
    if isinstance(outputs, DTensorSpec):
        output_layout = outputs.placements
    elif outputs is None:
        output_layout = None
    else:
        output_layout = tuple(None if spec is None else spec.placements for spec in outputs)
    return (tuple(spec.placements for spec in decision.input_specs), output_layout)


def _apply_overrides(
    args: tuple[Any, ...], kwargs: dict[str, Any], decision: OpDecision
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    positional = list(args)
    named = dict(kwargs)
    for position, value in decision.local_arg_overrides:
        if isinstance(position, int):
            positional[position] = value
        else:
            named[position] = value
    return tuple(positional), named


def run_case_on_layout(case: Case, mesh_shape: tuple[int, ...], layouts: Sequence[tuple[Placement, ...]]) -> None:
    dtensors = _dtensor_args(case)
    full_args, full_kwargs = _replace_dtensors(case, [marker.full.clone() for marker in dtensors])
    expected = case.op(*full_args, **full_kwargs)

    decisions = {}
    for coordinate in itertools.product(*(range(size) for size in mesh_shape)):
        mesh = FakeMesh(mesh_shape, coordinate)
        specs = _specs_for(mesh, layouts, dtensors)
        spec_args, spec_kwargs = _replace_dtensors(case, specs)
        try:
            decisions[coordinate] = propagate_op_sharding(case.op, spec_args, spec_kwargs)
        except ShardingPropagationError as error:
            # Only a written Partial tensor may be refused: Shard and Replicate are always kept.
            written = [layouts[0]] if _writes_self(case.op) else [layouts[-1]]
            assert any(isinstance(p, Partial) for layout in written for p in layout), error
            assert str(case.op) in str(error)
            return
    first = next(iter(decisions.values()))
    for coordinate, decision in decisions.items():
        assert _layout_of(decision) == _layout_of(first), f"coordinate {coordinate} decided differently"

    # Local inputs, cut from the full values in the target layout of each input.
    pieces_per_input = [
        _pieces(marker.full, mesh_shape, target.placements, seed=index)
        for index, (marker, target) in enumerate(zip(dtensors, first.input_specs))
    ]
    for marker, given, target in zip(dtensors, layouts, first.input_specs):
        assert target.tensor_meta == _meta_of(marker.full)
    local_results = {}
    for coordinate, decision in decisions.items():
        locals_ = [pieces[coordinate] for pieces in pieces_per_input]
        args, kwargs = _replace_dtensors(case, locals_)
        args, kwargs = _apply_overrides(args, kwargs, decision)
        # What dispatch runs on the pieces: the rule's local kernel where it has one (per coordinate), else the op.
        run = decision.local_kernel if decision.local_kernel is not None else case.op
        local_results[coordinate] = run(*args, **kwargs)

    if isinstance(expected, torch.Tensor):
        _check_output(case, mesh_shape, expected, decisions, {c: (r,) for c, r in local_results.items()}, None)
    elif isinstance(expected, (tuple, list)):
        for index, expected_piece in enumerate(expected):
            pieces = {coordinate: result[index] for coordinate, result in local_results.items()}
            _check_output(case, mesh_shape, expected_piece, decisions, pieces, index)
    else:
        assert first.output_specs is None
        for coordinate, value in local_results.items():
            assert value == expected, f"coordinate {coordinate} computed {value!r}, expected {expected!r}"


def _output_spec(decision: OpDecision, index: int | None) -> DTensorSpec[Any]:
    specs = decision.output_specs
    spec = specs if index is None else (specs[index] if isinstance(specs, tuple) else None)
    assert isinstance(spec, DTensorSpec), f"output {index}: {specs!r}"
    return spec


def _check_output(
    case: Case,
    mesh_shape: tuple[int, ...],
    expected: torch.Tensor,
    decisions: dict[tuple[int, ...], OpDecision],
    local_results: dict[tuple[int, ...], Any],
    index: int | None,
) -> None:
    """One tensor output: its global metadata, every rank's local shape, and the reassembled values."""
    first = next(iter(decisions.values()))
    output_spec = _output_spec(first, index)
    assert output_spec.tensor_meta is not None
    assert output_spec.tensor_meta.shape == expected.shape
    assert output_spec.tensor_meta.dtype == expected.dtype
    assert output_spec.tensor_meta.stride == tuple(expected.stride())
    locals_ = {coordinate: result[0] if index is None else result for coordinate, result in local_results.items()}
    for coordinate, decision in decisions.items():
        local_shape = _output_spec(decision, index).local_shape()
        assert tuple(locals_[coordinate].shape) == local_shape, f"local shape at {coordinate}"
    if case.compare_values:
        assembled = _assemble(locals_, mesh_shape, output_spec)
        rtol, atol = _tolerances(case, expected)
        torch.testing.assert_close(assembled, expected, equal_nan=True, rtol=rtol, atol=atol)


def _writes_self(op: torch._ops.OpOverload) -> bool:
    first = op._schema.arguments[0]
    return first.alias_info is not None and first.alias_info.is_write and not first.kwarg_only


def _tolerances(case: Case, expected: torch.Tensor) -> tuple[float, float]:
    """(rtol, atol): float32 anywhere in the case limits the precision of the partial parts."""
    dtypes = {marker.full.dtype for marker in _dtensor_args(case)} | {expected.dtype}
    if torch.float32 in dtypes:
        return 1e-5, 1e-5
    return 1e-7, 1e-9


def _run_case(case: Case, mesh_shape: tuple[int, ...]) -> int:
    checked = 0
    for layouts in _input_layouts(case, mesh_shape):
        try:
            run_case_on_layout(case, mesh_shape, layouts)
        except Exception as error:
            described = ", ".join("(" + ", ".join(str(p) for p in layout) + ")" for layout in layouts)
            raise AssertionError(f"{case} on mesh {mesh_shape} with inputs {described}: {error}") from error
        checked += 1
    return checked


@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_sharding_on_a_1d_mesh_of_4(case: Case) -> None:
    assert _run_case(case, (4,)) > 0


@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_sharding_on_a_2x2_mesh(case: Case) -> None:
    assert _run_case(case, (2, 2)) > 0


@pytest.mark.parametrize("case", [c for c in CASES if len(_dtensor_args(c)) == 1], ids=str)
def test_every_sharding_on_a_2x3_mesh(case: Case) -> None:
    assert _run_case(case, (2, 3)) > 0
