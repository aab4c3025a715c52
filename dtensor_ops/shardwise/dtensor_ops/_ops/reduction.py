"""Reductions over some or all dims: sum, mean, amax/amin, max/min, aminmax, all/any, prod, argmax/argmin.

On one mesh dim a dim the op keeps may stay sharded (its index shifts when
``keepdim`` is False).  A reduced dim that is sharded leaves each rank with the
reduction of its own shard; that is exact only where combining the per-rank
results is one of the Partial kinds:

* ``sum`` -> ``Partial(sum)``, exact for any shard sizes (an empty shard sums to 0);
* ``mean`` -> ``Partial(avg)``, exact only when every rank averaged the same
  number of elements, i.e. when every sharded reduced dim divides evenly over the
  mesh dims cutting it; otherwise the combination is rejected and the cost choice
  redistributes instead;
* ``amax``/``max`` -> ``Partial(max)``, ``amin``/``min`` -> ``Partial(min)``
  (``aminmax`` gives both), exact when no rank holds an empty piece of a reduced
  dim (torch refuses to take the maximum of nothing, and there is no identity
  that works for every dtype);
* ``all`` -> ``Partial(min)``, ``any`` -> ``Partial(max)``: their results are 0/1
  (bool, or uint8 for uint8 inputs) and an empty shard gives the identity
  (``all`` of nothing is True), so any shard sizes work; every rank then reads
  the same answer once the partial is reduced;
* ``prod``, ``argmax``/``argmin`` (indices are global positions) and ``max.dim``
  / ``min.dim`` (values with indices) have no matching Partial kind: their reduced
  dims must be whole on every rank.

Partial inputs carry through where the reduction commutes with the pending one:
``sum``/``mean`` are linear (``Partial(sum)``/``Partial(avg)``, unless ``dtype``
converts the parts to integers), ``amax``/``max`` of a ``Partial(max)`` is the max
of the per-rank maxima (likewise for min), and ``all``/``any`` of a bool
``Partial(min)``/``Partial(max)``.  Everything else reduces a Partial input first.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from shardwise.placement import Partial, Placement, Replicate, Shard, TensorMeta, chunk_sizes, normalize_dim

from ._shapes import contiguous_meta, dtype_on_empty_tensors, has_row_major_layout, input_meta
from .._rules import (
    OneDimStrategy,
    OpCall,
    PlacementsPerTensor,
    ShardingRule,
    aten_overloads,
    partial_survives_cast,
    register_rule,
)

__all__ = [
    "ARG_REDUCTION_RULE",
    "EXTREMUM_RULE",
    "LOGICAL_REDUCTION_RULE",
    "REDUCTION_RULE",
    "WHOLE_DIM_REDUCTION_RULE",
    "every_sharded_piece_nonempty",
    "kept_dim_strategies",
    "reduced_dims",
    "reduced_dims_of",
    "reduction_output_meta",
    "reduction_output_shape",
    "reduction_strategies",
    "schema_argument",
]

aten = torch.ops.aten


# --------------------------------------------------------------------------- arguments


def schema_argument(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object], name: str, default: object
) -> object:
    """The value of the schema argument ``name``, given positionally or by keyword; ``default`` if absent."""
    for index, argument in enumerate(op._schema.arguments):
        if argument.name == name:
            if not argument.kwarg_only and index < len(args):
                return args[index]
            return kwargs.get(name, default)
    return default


# Overloads of these read an empty dim list as "reduce nothing" (every other reduction: "reduce all").
_EMPTY_DIM_LIST_REDUCES_NOTHING = frozenset({"aten::all", "aten::any"})


def reduced_dims_of(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object], ndim: int
) -> tuple[frozenset[int], bool]:
    """The input dims a reduction call reduces (normalised) and its keepdim flag.

    Reads the schema's ``dim`` and ``keepdim`` arguments wherever the overload puts
    them (positional or keyword-only); ``dim=None`` or an absent ``dim`` reduces every
    dim (for ``argmax`` that is its flattened form).  Raises IndexError for a dim out
    of range.
    """
    keepdim = bool(schema_argument(op, args, kwargs, "keepdim", False))
    if not any(argument.name == "dim" for argument in op._schema.arguments):
        return frozenset(range(ndim)), keepdim
    dims = schema_argument(op, args, kwargs, "dim", None)
    if dims is None:
        return frozenset(range(ndim)), keepdim
    if isinstance(dims, int):
        dims = [dims]
    if not isinstance(dims, (list, tuple)):
        raise TypeError(f"{op}: dim must be an int, a list of ints or None, got {dims!r}")
    if len(dims) == 0:
        if op._schema.name in _EMPTY_DIM_LIST_REDUCES_NOTHING:
            return frozenset(), keepdim
        return frozenset(range(ndim)), keepdim
    if ndim == 0:  # a 0-dim tensor accepts dim 0 / -1 and reduces nothing
        return frozenset(), keepdim
    return frozenset(normalize_dim(int(d), ndim) for d in dims), keepdim


def reduced_dims(call: OpCall) -> tuple[frozenset[int], bool]:
    return reduced_dims_of(call.op, call.args, call.kwargs, len(call.input_shape(0)))


def reduction_output_shape(shape: Sequence[int], reduced: frozenset[int], keepdim: bool) -> list[int]:
    if keepdim:
        return [1 if dim in reduced else size for dim, size in enumerate(shape)]
    return [size for dim, size in enumerate(shape) if dim not in reduced]


# --------------------------------------------------------------------------- strategies


def kept_dim_strategies(
    ndim: int,
    reduced: frozenset[int],
    keepdim: bool,
    num_outputs: int,
    sharded_reduction: tuple[Placement, ...] | None = None,
) -> list[OneDimStrategy]:
    """Per input dim in order: a kept dim ``d`` gives Shard(d) -> Shard(d') on every output, a reduced one
    gives Shard(d) -> ``sharded_reduction`` (one placement per output) when that is given; then all replicated.
    """
    strategies = []
    for dim in range(ndim):
        if dim in reduced:
            if sharded_reduction is not None:
                strategies.append(OneDimStrategy(sharded_reduction, (Shard(dim),)))
            continue
        out_dim = dim if keepdim else dim - sum(1 for other in reduced if other < dim)
        strategies.append(OneDimStrategy((Shard(out_dim),) * num_outputs, (Shard(dim),)))
    strategies.append(OneDimStrategy((Replicate(),) * num_outputs, (Replicate(),)))
    return strategies


def every_sharded_piece_nonempty(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement], dims: frozenset[int]
) -> bool:
    """Whether every rank's piece of each of ``dims`` is non-empty under ``placements`` (nested, torch.chunk)."""
    pieces: dict[int, list[int]] = {dim: [shape[dim]] for dim in dims}
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard) and placement.dim in pieces:
            pieces[placement.dim] = [
                size for piece in pieces[placement.dim] for size in chunk_sizes(piece, mesh_shape[mesh_dim])
            ]
    return all(size > 0 for sizes in pieces.values() for size in sizes)


def _is_mean(call: OpCall) -> bool:
    return call.op._schema.name == "aten::mean"


def reduction_strategies(call: OpCall) -> list[OneDimStrategy]:
    """sum / mean."""
    reduced, keepdim = reduced_dims(call)
    sharded_reduction: Placement = Partial("avg") if _is_mean(call) else Partial("sum")
    strategies = kept_dim_strategies(len(call.input_shape(0)), reduced, keepdim, 1, (sharded_reduction,))
    source_dtype = call.input_meta(0).dtype
    output_meta = call.output_metas[0]
    assert output_meta is not None
    for reduce_op in call.linear_reduce_ops():
        if partial_survives_cast(source_dtype, output_meta.dtype, reduce_op):
            strategies.append(OneDimStrategy((Partial(reduce_op),), (Partial(reduce_op),)))
    return strategies


def _mean_shards_are_even(
    call: OpCall, inputs: PlacementsPerTensor, outputs: tuple[tuple[Placement, ...] | None, ...]
) -> bool:
    if not _is_mean(call):
        return True
    reduced, _ = reduced_dims(call)
    shape = call.input_shape(0)
    mesh_shape = tuple(call.mesh.shape)
    pieces = {dim: 1 for dim in reduced}
    for mesh_dim, placement in enumerate(inputs[0]):
        if isinstance(placement, Shard) and placement.dim in pieces:
            pieces[placement.dim] *= mesh_shape[mesh_dim]
    # Nested torch.chunk splits are all equal exactly when the size divides by the product of the splits.
    return all(shape[dim] % count == 0 for dim, count in pieces.items() if count > 1) or math.prod(shape) == 0


# Per op: the Partial kind each output becomes when a reduced dim is sharded.
_EXTREMUM_KINDS: dict[str, tuple[str, ...]] = {
    "aten::amax": ("max",),
    "aten::max": ("max",),
    "aten::amin": ("min",),
    "aten::min": ("min",),
    "aten::aminmax": ("min", "max"),
}


def _extremum_strategies(call: OpCall) -> list[OneDimStrategy]:
    kinds = _EXTREMUM_KINDS[call.op._schema.name]
    reduced, keepdim = reduced_dims(call)
    partial_outputs = tuple(Partial(kind) for kind in kinds)
    strategies = kept_dim_strategies(len(call.input_shape(0)), reduced, keepdim, len(kinds), partial_outputs)
    # max of per-rank maxima: a pending Partial(max) may be reduced after the op instead of before.
    if len(set(kinds)) == 1 and kinds[0] in call.partial_reduce_ops:
        strategies.append(OneDimStrategy(partial_outputs, (Partial(kinds[0]),)))
    return strategies


def _sharded_reduced_dims_nonempty(
    call: OpCall, inputs: PlacementsPerTensor, outputs: tuple[tuple[Placement, ...] | None, ...]
) -> bool:
    reduced, _ = reduced_dims(call)
    sharded = frozenset(p.dim for p in inputs[0] if isinstance(p, Shard) and p.dim in reduced)
    if not sharded:
        return True
    return every_sharded_piece_nonempty(call.input_shape(0), tuple(call.mesh.shape), inputs[0], sharded)


_LOGICAL_KINDS: dict[str, str] = {"aten::all": "min", "aten::any": "max"}


def _logical_reduction_strategies(call: OpCall) -> list[OneDimStrategy]:
    kind = _LOGICAL_KINDS[call.op._schema.name]
    reduced, keepdim = reduced_dims(call)
    strategies = kept_dim_strategies(len(call.input_shape(0)), reduced, keepdim, 1, (Partial(kind),))
    # Only on bool values is all() the min (any() the max): bool(min(-1, 0)) is True, all([-1, 0]) is not.
    if call.input_meta(0).dtype == torch.bool and kind in call.partial_reduce_ops:
        strategies.append(OneDimStrategy((Partial(kind),), (Partial(kind),)))
    return strategies


def _whole_dim_reduction_strategies(call: OpCall) -> list[OneDimStrategy]:
    reduced, keepdim = reduced_dims(call)
    return kept_dim_strategies(len(call.input_shape(0)), reduced, keepdim, len(call.output_metas))


def _arg_reduction_strategies(call: OpCall) -> list[OneDimStrategy]:
    """max.dim / min.dim: (values, indices) over one dim, which must not be sharded (indices are global)."""
    ndim = len(call.input_shape(0))
    dim_arg = call.arg(1, "dim")
    assert isinstance(dim_arg, int)
    reduced = frozenset([normalize_dim(dim_arg, ndim)]) if ndim else frozenset()
    keepdim = bool(call.arg(2, "keepdim", False))
    return kept_dim_strategies(ndim, reduced, keepdim, 2)


# --------------------------------------------------------------------------- output metadata

def _result_dtype(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object], source: torch.dtype
) -> torch.dtype | None:
    name = op._schema.name
    if name in _EXTREMUM_KINDS:
        return source
    if name in ("aten::argmax", "aten::argmin"):
        return torch.int64
    if name in _LOGICAL_KINDS:
        return torch.uint8 if source == torch.uint8 else torch.bool
    # Everything else: the op's own promotion, from a run on element-free tensors.
    return dtype_on_empty_tensors(op, args, kwargs)


def row_major_reduction(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object], *, allow_empty: bool = True
) -> tuple[TensorMeta, frozenset[int], bool] | None:
    """The input's metadata, reduced dims and keepdim flag, when a shape rule can give the output metadata.

    None (the engine then runs the op on meta tensors, which raises torch's own errors) when the input is
    not row-major, a dim is bad, or the input is empty and ``allow_empty`` is False.
    """
    meta = input_meta(args[0]) if args else None
    if meta is None or not has_row_major_layout(meta) or (not allow_empty and 0 in meta.shape):
        return None
    try:
        reduced, keepdim = reduced_dims_of(op, args, kwargs, len(meta.shape))
    except (IndexError, TypeError):
        return None
    return meta, reduced, keepdim


def reduction_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | tuple[TensorMeta | None, ...] | None:
    """Reduced shape, contiguous, when the input has a row-major layout; one meta per output."""
    layout = row_major_reduction(op, args, kwargs)
    if layout is None:
        return None
    meta, reduced, keepdim = layout
    if 0 in meta.shape and op._schema.name in _EXTREMUM_KINDS:
        return None  # torch refuses some empty reductions: the meta run raises its error
    dtype = _result_dtype(op, args, kwargs, meta.dtype)
    if dtype is None:
        return None
    output = contiguous_meta(reduction_output_shape(meta.shape, reduced, keepdim), dtype)
    outputs = len(op._schema.returns)
    return output if outputs == 1 else (output,) * outputs


def _arg_reduction_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> tuple[TensorMeta | None, ...] | None:
    layout = row_major_reduction(op, args, kwargs, allow_empty=False)
    if layout is None:
        return None
    meta, reduced, keepdim = layout
    shape = reduction_output_shape(meta.shape, reduced, keepdim)
    return (contiguous_meta(shape, meta.dtype), contiguous_meta(shape, torch.int64))


REDUCTION_RULE = ShardingRule(
    family="reduction",
    one_dim_strategies=reduction_strategies,
    is_valid=_mean_shards_are_even,
    output_meta=reduction_output_meta,
)

EXTREMUM_RULE = ShardingRule(
    family="max/min reduction",
    one_dim_strategies=_extremum_strategies,
    is_valid=_sharded_reduced_dims_nonempty,
    output_meta=reduction_output_meta,
)

LOGICAL_REDUCTION_RULE = ShardingRule(
    family="all/any", one_dim_strategies=_logical_reduction_strategies, output_meta=reduction_output_meta
)

# Reductions with no Partial kind for a sharded reduced dim: it is gathered first.
WHOLE_DIM_REDUCTION_RULE = ShardingRule(
    family="reduction over whole dims",
    one_dim_strategies=_whole_dim_reduction_strategies,
    output_meta=reduction_output_meta,
)

ARG_REDUCTION_RULE = ShardingRule(
    family="max/min over a dim", one_dim_strategies=_arg_reduction_strategies, output_meta=_arg_reduction_output_meta
)

register_rule(aten_overloads(("sum", "mean"), with_inplace=False), REDUCTION_RULE)
register_rule(
    (
        aten.amax.default, aten.amax.out, aten.amin.default, aten.amin.out,
        aten.max.default, aten.max.unary_out, aten.min.default, aten.min.unary_out,
        aten.aminmax.default, aten.aminmax.out,
    ),
    EXTREMUM_RULE,
)  # fmt: skip
register_rule(aten_overloads(("all", "any"), with_inplace=False), LOGICAL_REDUCTION_RULE)
register_rule(aten_overloads(("prod", "argmax", "argmin"), with_inplace=False), WHOLE_DIM_REDUCTION_RULE)
register_rule((aten.max.dim, aten.max.dim_max, aten.min.dim, aten.min.dim_min), ARG_REDUCTION_RULE)
