"""Reductions: sum and mean over all dims or over ``dim`` (with ``keepdim``, ``dtype``, ``out=``).

On one mesh dim:

* a dim that is kept may stay sharded (its index shifts when ``keepdim`` is False);
* a reduced dim that is sharded leaves each rank with the reduction of its own
  shard.  For ``sum`` that is ``Partial(sum)``, exact for any shard sizes (an
  empty shard sums to 0).  For ``mean`` it is ``Partial(avg)``, which is exact
  only when every rank averaged the same number of elements, i.e. when every
  sharded reduced dim divides evenly over the mesh dims cutting it; otherwise the
  combination is rejected and the cost choice redistributes instead;
* both ops are linear, so a ``Partial(sum)``/``Partial(avg)`` input stays partial
  (unless ``dtype`` converts the partial values to integers).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from shardwise.placement import Partial, Placement, Replicate, Shard, TensorMeta, normalize_dim

from ._shapes import contiguous_meta, dtype_on_empty_tensors, has_row_major_layout, input_meta

from ._strategy import (
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
    "REDUCTION_RULE", "reduced_dims", "reduced_dims_of", "reduction_output_meta", "reduction_strategies"]


def reduced_dims_of(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object], ndim: int
) -> tuple[frozenset[int], bool]:
    """The input dims a sum/mean call reduces (normalised) and its keepdim flag."""
    takes_dim = any(argument.name == "dim" for argument in op._schema.arguments)
    if not takes_dim:
        return frozenset(range(ndim)), False
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    if dims is None:
        return frozenset(range(ndim)), keepdim
    if isinstance(dims, int):
        dims = [dims]
    assert isinstance(dims, (list, tuple))
    if len(dims) == 0:  # torch: an empty dim list reduces every dim
        return frozenset(range(ndim)), keepdim
    if ndim == 0:  # a 0-dim tensor accepts dim 0 / -1 and reduces nothing
        return frozenset(), keepdim
    return frozenset(normalize_dim(int(d), ndim) for d in dims), keepdim


def reduced_dims(call: OpCall) -> tuple[frozenset[int], bool]:
    return reduced_dims_of(call.op, call.args, call.kwargs, len(call.input_shape(0)))


def _is_mean(call: OpCall) -> bool:
    return call.op._schema.name == "aten::mean"


def reduction_strategies(call: OpCall) -> list[OneDimStrategy]:
    reduced, keepdim = reduced_dims(call)
    sharded_reduction: Placement = Partial("avg") if _is_mean(call) else Partial("sum")
    strategies: list[OneDimStrategy] = []
    dropped_before = 0
    for dim in range(len(call.input_shape(0))):
        if dim in reduced:
            strategies.append(OneDimStrategy((sharded_reduction,), (Shard(dim),)))
            dropped_before += 0 if keepdim else 1
        else:
            strategies.append(OneDimStrategy((Shard(dim - dropped_before),), (Shard(dim),)))
    strategies.append(OneDimStrategy((Replicate(),), (Replicate(),)))
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


def reduction_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    meta = input_meta(args[0]) if args else None
    if meta is None or not has_row_major_layout(meta):
        return None
    try:
        reduced, keepdim = reduced_dims_of(op, args, kwargs, len(meta.shape))
    except IndexError:
        return None  # a dim out of range: the meta run raises torch's error
    if keepdim:
        shape = [1 if dim in reduced else size for dim, size in enumerate(meta.shape)]
    else:
        shape = [size for dim, size in enumerate(meta.shape) if dim not in reduced]
    dtype = dtype_on_empty_tensors(op, args, kwargs)
    return None if dtype is None else contiguous_meta(shape, dtype)


REDUCTION_RULE = ShardingRule(
    family="reduction",
    one_dim_strategies=reduction_strategies,
    is_valid=_mean_shards_are_even,
    output_meta=reduction_output_meta,
)



def _arg_reduction_strategies(call: OpCall) -> list[OneDimStrategy]:
    """max.dim / min.dim: (values, indices) over one dim, which must not be sharded (indices are global)."""
    ndim = len(call.input_shape(0))
    dim_arg = call.arg(1, "dim")
    assert isinstance(dim_arg, int)
    reduced = normalize_dim(dim_arg, max(ndim, 1))
    keepdim = bool(call.arg(2, "keepdim", False))
    strategies = []
    for dim in range(ndim):
        if dim == reduced:
            continue
        out_dim = dim if keepdim or dim < reduced else dim - 1
        strategies.append(OneDimStrategy((Shard(out_dim), Shard(out_dim)), (Shard(dim),)))
    strategies.append(OneDimStrategy((Replicate(), Replicate()), (Replicate(),)))
    return strategies


ARG_REDUCTION_RULE = ShardingRule(family="max/min over a dim", one_dim_strategies=_arg_reduction_strategies)

register_rule(aten_overloads(("sum", "mean"), with_inplace=False), REDUCTION_RULE)
register_rule((torch.ops.aten.max.dim, torch.ops.aten.min.dim), ARG_REDUCTION_RULE)
