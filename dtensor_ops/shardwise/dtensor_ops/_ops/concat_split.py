"""Concatenating and splitting: cat, stack, split, split_with_sizes, unbind.

On one mesh dim these run locally when every tensor involved is sharded on a dim
other than the one being concatenated / split (every input has the same extent
there, so the shards line up), or replicated, or partial: cutting and joining
only moves elements, so any Partial kind carries through.  The concatenated /
split dim itself must not be sharded: the local pieces would not be the global
pieces.  Outputs of split and unbind form a tuple of specs, one per piece.
``stack`` is ``cat`` along a new dim: shards of the inputs' dims move past it.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from shardwise.placement import Partial, Placement, Replicate, Shard, TensorMeta, normalize_dim

from ._shapes import contiguous_meta, dtype_on_empty_tensors, has_row_major_layout, input_meta
from .._rules import OneDimStrategy, OpCall, ShardingRule, register_rule

__all__ = ["CAT_RULE", "SPLIT_RULE", "STACK_RULE"]

aten = torch.ops.aten


def _cat_dim(call_args: Sequence[object], kwargs: Mapping[str, object], ndim: int) -> int:
    dim = call_args[1] if len(call_args) > 1 else kwargs.get("dim", 0)
    assert isinstance(dim, int)
    return normalize_dim(dim, ndim)


def _is_legacy_empty(meta: TensorMeta, ndim: int) -> bool:
    # torch.cat skips 1-D empty tensors whatever the other inputs' number of dims.
    return len(meta.shape) == 1 and meta.shape[0] == 0 and ndim != 1


def _cat_strategies(call: OpCall) -> list[OneDimStrategy]:
    ndim = len(call.output_shape(0))
    dim = _cat_dim(call.args, call.kwargs, ndim)
    metas = [call.input_meta(index) for index in range(len(call.input_specs))]
    strategies = []
    for shard_dim in range(ndim):
        if shard_dim == dim:
            continue
        inputs: tuple[Placement, ...] = tuple(
            Replicate() if _is_legacy_empty(meta, ndim) else Shard(shard_dim) for meta in metas
        )
        strategies.append(OneDimStrategy((Shard(shard_dim),), inputs))
    strategies.append(OneDimStrategy((Replicate(),), (Replicate(),) * len(metas)))
    for reduce_op in call.every_reduce_op():
        partial = Partial(reduce_op)
        strategies.append(OneDimStrategy((partial,), (partial,) * len(metas)))
    return strategies


def _cat_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    tensors = args[0] if args else kwargs.get("tensors")
    if not isinstance(tensors, (list, tuple)) or not tensors:
        return None
    metas = [input_meta(tensor) for tensor in tensors]
    if any(meta is None or not has_row_major_layout(meta) for meta in metas):
        return None
    shapes = [meta.shape for meta in metas if meta is not None]
    ndim = len(shapes[0])
    if ndim == 0 or any(len(shape) != ndim for shape in shapes):
        return None  # 0-dim or legacy empty inputs: meta tensors decide
    dim_arg = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(dim_arg, int) or not -ndim <= dim_arg < ndim:
        return None
    dim = dim_arg % ndim
    if any(shape[:dim] != shapes[0][:dim] or shape[dim + 1 :] != shapes[0][dim + 1 :] for shape in shapes):
        return None
    out_shape = list(shapes[0])
    out_shape[dim] = sum(shape[dim] for shape in shapes)
    dtype = dtype_on_empty_tensors(op, args, kwargs)
    return None if dtype is None else contiguous_meta(out_shape, dtype)


CAT_RULE = ShardingRule(family="cat", one_dim_strategies=_cat_strategies, output_meta=_cat_output_meta)


def _split_strategies(call: OpCall) -> list[OneDimStrategy]:
    ndim = len(call.input_shape(0))
    pieces = len(call.output_metas)
    dim_arg = call.arg(2 if call.op is not aten.unbind.int else 1, "dim", 0)
    assert isinstance(dim_arg, int)
    dim = normalize_dim(dim_arg, ndim)
    removes_dim = call.op is aten.unbind.int
    strategies = []
    for shard_dim in range(ndim):
        if shard_dim == dim:
            continue
        out_dim = shard_dim - 1 if removes_dim and shard_dim > dim else shard_dim
        strategies.append(OneDimStrategy((Shard(out_dim),) * pieces, (Shard(shard_dim),)))
    strategies.append(OneDimStrategy((Replicate(),) * pieces, (Replicate(),)))
    for reduce_op in call.every_reduce_op():
        partial = Partial(reduce_op)
        strategies.append(OneDimStrategy((partial,) * pieces, (partial,)))
    return strategies


SPLIT_RULE = ShardingRule(family="split", one_dim_strategies=_split_strategies)


def _stack_dim(call_args: Sequence[object], kwargs: Mapping[str, object], out_ndim: int) -> int:
    dim = call_args[1] if len(call_args) > 1 else kwargs.get("dim", 0)
    assert isinstance(dim, int)
    return normalize_dim(dim, out_ndim)


def _stack_strategies(call: OpCall) -> list[OneDimStrategy]:
    out_ndim = len(call.output_shape(0))
    new_dim = _stack_dim(call.args, call.kwargs, out_ndim)
    count = len(call.input_specs)
    strategies = []
    for shard_dim in range(out_ndim - 1):
        out_dim = shard_dim if shard_dim < new_dim else shard_dim + 1
        strategies.append(OneDimStrategy((Shard(out_dim),), (Shard(shard_dim),) * count))
    strategies.append(OneDimStrategy((Replicate(),), (Replicate(),) * count))
    for reduce_op in call.every_reduce_op():
        partial = Partial(reduce_op)
        strategies.append(OneDimStrategy((partial,), (partial,) * count))
    return strategies


def _stack_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    tensors = args[0] if args else kwargs.get("tensors")
    if not isinstance(tensors, (list, tuple)) or not tensors:
        return None
    metas = [input_meta(tensor) for tensor in tensors]
    if any(meta is None or not has_row_major_layout(meta) for meta in metas):
        return None
    shapes = {tuple(meta.shape) for meta in metas if meta is not None}
    if len(shapes) != 1:
        return None  # the meta run raises torch's error about unequal sizes
    (shape,) = shapes
    dim_arg = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(dim_arg, int) or not -(len(shape) + 1) <= dim_arg <= len(shape):
        return None
    dim = dim_arg % (len(shape) + 1)
    dtype = dtype_on_empty_tensors(op, args, kwargs)
    out_shape = (*shape[:dim], len(tensors), *shape[dim:])
    return None if dtype is None else contiguous_meta(out_shape, dtype)


STACK_RULE = ShardingRule(family="stack", one_dim_strategies=_stack_strategies, output_meta=_stack_output_meta)

register_rule((aten.cat.default, aten.cat.out), CAT_RULE)
register_rule((aten.stack.default, aten.stack.out), STACK_RULE)
register_rule(
    (
        aten.split.Tensor,
        aten.split_with_sizes.default,
        aten.unsafe_split.Tensor,
        aten.unsafe_split_with_sizes.default,
        aten.unbind.int,
    ),
    SPLIT_RULE,
)
