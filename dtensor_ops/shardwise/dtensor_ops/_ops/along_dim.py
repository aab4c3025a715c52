"""Math ops along a dim: softmax/log_softmax/_safe_softmax (and backwards), var/std/var_mean/std_mean, logsumexp, norms,
topk/sort, cumsum/cumprod, flip, and ``allclose``.

On one mesh dim:

* softmax, log_softmax, topk, sort, cumsum, cumprod and flip work along one dim (``flip``:
  several): every *other* dim may stay sharded, the op dims must be whole on each
  rank, so a sharding there is redistributed (the engine picks the cheapest way,
  often an all-to-all to another dim rather than an all-gather);
* the softmax backwards are linear in the incoming gradient (the forward output
  fixed), so a ``Partial(sum)``/``Partial(avg)`` gradient with a replicated output
  stays partial; ``cumsum`` is linear and keeps those Partials too (unless
  ``dtype`` converts the parts to integers), ``flip`` only moves elements and keeps
  every Partial kind;
* var, std, var_mean, std_mean and logsumexp keep their kept dims sharded; their reduced
  dims have no exact per-rank combination among the Partial kinds and are
  gathered first;
* a vector norm over a sharded dim stays local only where combining the per-rank
  norms is exact: ord 0 (a count of non-zeros) and ord 1 give ``Partial(sum)``,
  ord inf / -inf give ``Partial(max)`` / ``Partial(min)`` (every rank's piece must
  be non-empty).  Other ords (2 included: the root of a sum is not a sum of
  roots) are gathered first;
* ``allclose`` compares replicated tensors, so every rank returns the same bool.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from shardwise.placement import Partial, Placement, Replicate, Shard, TensorMeta, _NormPartial, normalize_dim

from ._shapes import (
    broadcast_shapes,
    contiguous_meta,
    dtype_on_empty_tensors,
    input_meta,
    is_contiguous,
)
from .._call_schema import schema_facts
from .._rules import (
    OneDimStrategy,
    OpCall,
    PlacementsPerTensor,
    ShardingRule,
    aten_overloads,
    partial_survives_cast,
    register_rule,
)
from .reduction import (
    every_sharded_piece_nonempty,
    kept_dim_strategies,
    reduced_dims,
    row_major_reduction,
    reduction_output_shape,
    schema_argument,
)

__all__ = [
    "ALLCLOSE_RULE",
    "CUMULATIVE_RULE",
    "FLIP_RULE",
    "SOFTMAX_BACKWARD_RULE",
    "SOFTMAX_RULE",
    "SORT_RULE",
    "STATISTIC_RULE",
    "VECTOR_NORM_RULE",
]

aten = torch.ops.aten

_COMPLEX_TO_REAL = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}


def _real_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype of var/std/norm of a ``dtype`` tensor; None for integers and bool (torch refuses them)."""
    if dtype.is_complex:
        return _COMPLEX_TO_REAL.get(dtype)
    return dtype if dtype.is_floating_point else None


def _op_dim(call: OpCall, default: int | None = None) -> int | None:
    """The normalised ``dim`` argument of an op working along one dim; None for a 0-dim input."""
    ndim = len(call.input_shape(0))
    dim = schema_argument(call.op, call.args, call.kwargs, "dim", default)
    if not isinstance(dim, int):
        raise TypeError(f"{call.op}: dim must be an int, got {dim!r}")
    return normalize_dim(dim, ndim) if ndim else None


def _along_dims_strategies(
    ndim: int, whole_dims: frozenset[int], num_inputs: int, num_outputs: int
) -> list[OneDimStrategy]:
    """Shard(d) on every input and output for each dim ``d`` not in ``whole_dims``, then all replicated."""
    strategies = [
        OneDimStrategy((Shard(dim),) * num_outputs, (Shard(dim),) * num_inputs)
        for dim in range(ndim)
        if dim not in whole_dims
    ]
    strategies.append(OneDimStrategy((Replicate(),) * num_outputs, (Replicate(),) * num_inputs))
    return strategies


def _same_shape_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    """A fresh contiguous result shaped like a contiguous argument 0 (dtype by the op's own promotion)."""
    meta = input_meta(args[0]) if args else None
    if meta is None or not is_contiguous(meta):
        return None
    dtype = dtype_on_empty_tensors(op, args, kwargs)
    return None if dtype is None else contiguous_meta(meta.shape, dtype)


# --------------------------------------------------------------------------- softmax


def _softmax_strategies(call: OpCall) -> list[OneDimStrategy]:
    dim = _op_dim(call)
    whole = frozenset() if dim is None else frozenset([dim])
    return _along_dims_strategies(len(call.input_shape(0)), whole, 1, 1)


def _softmax_backward_strategies(call: OpCall) -> list[OneDimStrategy]:
    """(grad_output, output) -> grad_input; grad_output Partial with the output replicated stays Partial."""
    grad_index = call.input_index_at(0)
    output_index = call.input_index_at(1)
    if grad_index is None or output_index is None:
        raise TypeError(f"{call.op}: grad_output and output must both be DTensors")
    dim = _op_dim(call)
    whole = frozenset() if dim is None else frozenset([dim])
    strategies = _along_dims_strategies(len(call.input_shape(0)), whole, 2, 1)
    for reduce_op in call.linear_reduce_ops():
        inputs: list[Placement] = [Replicate(), Replicate()]
        inputs[grad_index] = Partial(reduce_op)
        strategies.append(OneDimStrategy((Partial(reduce_op),), tuple(inputs)))
    return strategies


def _softmax_backward_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    if len(args) < 2:
        return None
    grad, output = input_meta(args[0]), input_meta(args[1])
    if grad is None or output is None or grad.shape != output.shape:
        return None  # the meta run raises torch's error for mismatched shapes
    return _same_shape_output_meta(op, args, kwargs)


SOFTMAX_RULE = ShardingRule(
    family="softmax", one_dim_strategies=_softmax_strategies, output_meta=_same_shape_output_meta
)
SOFTMAX_BACKWARD_RULE = ShardingRule(
    family="softmax backward",
    one_dim_strategies=_softmax_backward_strategies,
    output_meta=_softmax_backward_output_meta,
)


# --------------------------------------------------------------------------- var / std / logsumexp


def _statistic_strategies(call: OpCall) -> list[OneDimStrategy]:
    reduced, keepdim = reduced_dims(call)
    return kept_dim_strategies(len(call.input_shape(0)), reduced, keepdim, len(call.output_metas))


def _statistic_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | tuple[TensorMeta | None, ...] | None:
    layout = row_major_reduction(op, args, kwargs)
    if layout is None:
        return None
    meta, reduced, keepdim = layout
    shape = reduction_output_shape(meta.shape, reduced, keepdim)
    name = op._schema.name
    if name == "aten::logsumexp":
        # No element-free run for var/std: torch warns about the degrees of freedom of an empty input.
        dtype = dtype_on_empty_tensors(op, args, kwargs)
    else:
        dtype = _real_dtype(meta.dtype)
    if dtype is None:
        return None
    if name in ("aten::var_mean", "aten::std_mean"):
        return (contiguous_meta(shape, dtype), contiguous_meta(shape, meta.dtype))
    return contiguous_meta(shape, dtype)


STATISTIC_RULE = ShardingRule(
    family="var/std/logsumexp", one_dim_strategies=_statistic_strategies, output_meta=_statistic_output_meta
)


# --------------------------------------------------------------------------- vector norms


def _norm_order(call: OpCall) -> float:
    name = "ord" if call.op._schema.name == "aten::linalg_vector_norm" else "p"
    order = schema_argument(call.op, call.args, call.kwargs, name, 2)
    if order is None:  # norm.* take p=None as the 2-norm
        return 2.0
    if not isinstance(order, (int, float)) or isinstance(order, bool):
        raise TypeError(f"{call.op}: the norm order must be a real number, got {order!r}")
    return float(order)


def _sharded_norm_placement(order: float) -> Placement | None:
    """How per-rank norms over pieces of a dim combine into the norm over the whole dim, if exactly: a sum,
    a max or a min, or for another positive order p the p-norm of the ranks' norms (``_NormPartial``:
    one scalar per rank travels where a gather would move the pieces)."""
    if order in (0.0, 1.0):
        return Partial("sum")
    if order == math.inf:
        return Partial("max")
    if order == -math.inf:
        return Partial("min")
    if order > 0:
        return _NormPartial(order)
    return None


def _vector_norm_strategies(call: OpCall) -> list[OneDimStrategy]:
    reduced, keepdim = reduced_dims(call)
    combined = _sharded_norm_placement(_norm_order(call))
    return kept_dim_strategies(
        len(call.input_shape(0)), reduced, keepdim, 1, None if combined is None else (combined,)
    )


def _norm_of_pieces_is_exact(call: OpCall, inputs: PlacementsPerTensor, reduced: frozenset[int]) -> bool:
    """Whether per-rank norms over the pieces of ``reduced`` combine exactly: always for finite orders (the
    norm of an empty piece is 0, the identity of the sum and of the p-norm), for ±inf only without empty
    pieces (the max of nothing is not defined)."""
    if math.isfinite(_norm_order(call)):
        return True
    sharded = frozenset(p.dim for p in inputs[0] if isinstance(p, Shard) and p.dim in reduced)
    return every_sharded_piece_nonempty(call.input_shape(0), tuple(call.mesh.shape), inputs[0], sharded)


def _vector_norm_is_exact(
    call: OpCall, inputs: PlacementsPerTensor, outputs: tuple[tuple[Placement, ...] | None, ...]
) -> bool:
    return _norm_of_pieces_is_exact(call, inputs, reduced_dims(call)[0])


def _vector_norm_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    layout = row_major_reduction(op, args, kwargs, allow_empty=False)
    if layout is None:
        return None
    meta, reduced, keepdim = layout
    requested = schema_argument(op, args, kwargs, "dtype", None)
    if requested is not None and not isinstance(requested, torch.dtype):
        return None
    dtype = requested if requested is not None else _real_dtype(meta.dtype)
    if dtype is None:
        return None
    return contiguous_meta(reduction_output_shape(meta.shape, reduced, keepdim), dtype)


def _dist_strategies(call: OpCall) -> list[OneDimStrategy]:
    """``dist(a, b, p)`` is the p-norm of ``a - b`` over every element: a and b laid out alike (same shape,
    no broadcast) give each rank the norm of its piece, combined as the vector norm's are."""
    strategies = [OneDimStrategy((Replicate(),), (Replicate(), Replicate()))]
    shape = call.input_shape(0)
    combined = _sharded_norm_placement(_norm_order(call))
    if combined is not None and len(call.input_specs) == 2 and call.input_shape(1) == shape:
        strategies.extend(OneDimStrategy((combined,), (Shard(dim), Shard(dim))) for dim in range(len(shape)))
    return strategies


def _dist_is_exact(
    call: OpCall, inputs: PlacementsPerTensor, outputs: tuple[tuple[Placement, ...] | None, ...]
) -> bool:
    return _norm_of_pieces_is_exact(call, inputs, frozenset(range(len(call.input_shape(0)))))


def _dist_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    first = input_meta(args[0]) if args else None
    second = input_meta(args[1]) if len(args) > 1 else None
    if first is None or second is None or first.dtype != second.dtype:
        return None  # (a plain tensor operand, or mixed dtypes: the meta run says what torch says)
    dtype = _real_dtype(first.dtype)
    return None if dtype is None else contiguous_meta((), dtype)


DIST_RULE = ShardingRule(
    family="dist (vector norm of a difference)",
    one_dim_strategies=_dist_strategies,
    is_valid=_dist_is_exact,
    output_meta=_dist_output_meta,
)


VECTOR_NORM_RULE = ShardingRule(
    family="vector norm",
    one_dim_strategies=_vector_norm_strategies,
    is_valid=_vector_norm_is_exact,
    output_meta=_vector_norm_output_meta,
)


# --------------------------------------------------------------------------- topk / sort


def _sort_strategies(call: OpCall) -> list[OneDimStrategy]:
    dim = _op_dim(call, default=-1)
    whole = frozenset() if dim is None else frozenset([dim])
    return _along_dims_strategies(len(call.input_shape(0)), whole, 1, 2)


def _has_required_arguments(op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]) -> bool:
    """Whether every schema argument without a default is given (sort.stable's keyword-only ``stable``)."""
    written = schema_facts(op).written
    for index, argument in enumerate(op._schema.arguments):
        given = index < len(args) and not argument.kwarg_only
        if not given and argument.name not in kwargs and not argument.has_default_value():
            if argument.name not in written:  # out= tensors are not passed here
                return False
    return True


def _sort_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> tuple[TensorMeta | None, ...] | None:
    meta = input_meta(args[0]) if args else None
    if meta is None or not is_contiguous(meta) or not _has_required_arguments(op, args, kwargs):
        return None
    ndim = len(meta.shape)
    dim = schema_argument(op, args, kwargs, "dim", -1)
    if not isinstance(dim, int) or not -max(ndim, 1) <= dim < max(ndim, 1):
        return None
    shape = list(meta.shape)
    if op._schema.name == "aten::topk":
        k = schema_argument(op, args, kwargs, "k", None)
        if not isinstance(k, int) or ndim == 0 or not 0 <= k <= shape[dim]:
            return None  # the meta run raises torch's error (k out of range)
        shape[dim] = k
    return (contiguous_meta(shape, meta.dtype), contiguous_meta(shape, torch.int64))


SORT_RULE = ShardingRule(family="topk/sort", one_dim_strategies=_sort_strategies, output_meta=_sort_output_meta)


# --------------------------------------------------------------------------- cumsum / flip


def _cumulative_strategies(call: OpCall) -> list[OneDimStrategy]:
    """cumsum / cumprod: other dims may stay sharded; cumsum (linear) also keeps Partial(sum / avg)."""
    dim = _op_dim(call)
    whole = frozenset() if dim is None else frozenset([dim])
    strategies = _along_dims_strategies(len(call.input_shape(0)), whole, 1, 1)
    if call.op._schema.name not in ("aten::cumsum", "aten::cumsum_"):
        return strategies
    output_meta = call.output_metas[0]
    assert output_meta is not None
    for reduce_op in call.linear_reduce_ops():
        if partial_survives_cast(call.input_meta(0).dtype, output_meta.dtype, reduce_op):
            strategies.append(OneDimStrategy((Partial(reduce_op),), (Partial(reduce_op),)))
    return strategies


CUMULATIVE_RULE = ShardingRule(
    family="cumsum/cumprod", one_dim_strategies=_cumulative_strategies, output_meta=_same_shape_output_meta
)


def _flip_strategies(call: OpCall) -> list[OneDimStrategy]:
    ndim = len(call.input_shape(0))
    dims = schema_argument(call.op, call.args, call.kwargs, "dims", ())
    if not isinstance(dims, (list, tuple)):
        raise TypeError(f"{call.op}: dims must be a list of ints, got {dims!r}")
    flipped = frozenset(normalize_dim(int(dim), ndim) for dim in dims) if ndim else frozenset()
    strategies = _along_dims_strategies(ndim, flipped, 1, 1)
    strategies.extend(OneDimStrategy((Partial(kind),), (Partial(kind),)) for kind in call.every_reduce_op())
    return strategies


FLIP_RULE = ShardingRule(family="flip", one_dim_strategies=_flip_strategies, output_meta=_same_shape_output_meta)


# --------------------------------------------------------------------------- allclose


def _allclose_strategies(call: OpCall) -> list[OneDimStrategy]:
    """Both inputs replicated; torch's argument errors are raised here, before anything is gathered."""
    metas = [call.input_meta(index) for index in range(len(call.input_specs))]
    if len(metas) == 2:
        if metas[0].dtype != metas[1].dtype:
            raise RuntimeError(
                f"{call.op}: the tensors have dtypes {metas[0].dtype} and {metas[1].dtype}; expected the same dtype"
            )
        if broadcast_shapes(metas[0].shape, metas[1].shape) is None:
            raise RuntimeError(
                f"{call.op}: the shapes {list(metas[0].shape)} and {list(metas[1].shape)} do not broadcast together"
            )
    return [OneDimStrategy((), (Replicate(),) * len(call.input_specs))]


ALLCLOSE_RULE = ShardingRule(family="allclose", one_dim_strategies=_allclose_strategies, tensor_outputs=False)


register_rule(
    (
        aten._softmax.default, aten._softmax.out, aten._log_softmax.default, aten._log_softmax.out,
        aten._safe_softmax.default,  # sdpa's math path: rows of only -inf give zeros instead of nan
    ),
    SOFTMAX_RULE,
)  # fmt: skip
register_rule(
    aten_overloads(("_softmax_backward_data", "_log_softmax_backward_data"), with_inplace=False),
    SOFTMAX_BACKWARD_RULE,
)
register_rule(
    (
        aten.var.correction, aten.var.correction_out, aten.std.correction, aten.std.correction_out,
        aten.var_mean.correction, aten.var_mean.correction_out, aten.std_mean.correction,
        aten.std_mean.correction_out, aten.logsumexp.default, aten.logsumexp.out,
    ),
    STATISTIC_RULE,
)  # fmt: skip
register_rule(
    (
        aten.linalg_vector_norm.default, aten.linalg_vector_norm.out,
        aten.norm.Scalar, aten.norm.Scalar_out, aten.norm.ScalarOpt_dim, aten.norm.out,
        aten.norm.ScalarOpt_dim_dtype, aten.norm.dtype_out, aten.norm.ScalarOpt_dtype, aten.norm.ScalarOpt_dtype_out,
    ),
    VECTOR_NORM_RULE,
)  # fmt: skip
register_rule((aten.dist.default,), DIST_RULE)
register_rule(
    (aten.topk.default, aten.topk.values, aten.sort.default, aten.sort.stable, aten.sort.values,
     aten.sort.values_stable),
    SORT_RULE,
)  # fmt: skip
register_rule(aten_overloads(("cumsum", "cumprod"), overloads=("default", "out")), CUMULATIVE_RULE)
register_rule((aten.flip.default, aten.flip.out), FLIP_RULE)
register_rule((aten.allclose.default,), ALLCLOSE_RULE)
