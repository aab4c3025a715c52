"""Shape ops: view / _unsafe_view / reshape, expand, t, transpose.

All of them move elements without combining them, so every Partial kind
(sum, avg, max, min) passes through unchanged.

``view`` groups the input and output dims into runs of equal element count
(``[b, s, h] -> [b*s, h]`` has the groups ``(b, s) -> (b*s)`` and ``h -> h``).  A
dim alone in its group maps one to one.  In a merged or split group only the
outermost dim can carry a shard, and only when the shards are the same flat
ranges on both sides: ``[4, 3] -> [12]`` cut in 4 (rows 1 each, flat 3 each)
works, ``[2, 3] -> [6]`` cut in 4 does not (torch.chunk gives rows 1,1,0,0 but
flat 2,2,2,0).  That is checked exactly for the mesh sizes at hand, including
several mesh dims nesting on the same dim.  The local op gets the local output
shape in place of the global ``size`` argument.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Mapping, Sequence

import torch

from shardwise.placement import (
    DTensorSpec,
    Partial,
    Placement,
    Replicate,
    Shard,
    TensorMeta,
    compute_local_shape_and_global_offset,
)

from ._shapes import contiguous_meta, input_meta, is_contiguous, resolve_view_size

from ._strategy import (
    ArgPosition,
    OneDimStrategy,
    OpCall,
    PlacementsPerTensor,
    ShardingRule,
    aten_overloads,
    register_rule,
)

__all__ = ["VIEW_RULE", "EXPAND_RULE", "TRANSPOSE_RULE", "view_dim_groups"]

aten = torch.ops.aten

DimGroup = tuple[tuple[int, ...], tuple[int, ...]]


def view_dim_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> tuple[DimGroup, ...] | None:
    """Split a view into (input dims, output dims) groups of equal element count, in order.

    Size-1 dims that can be matched alone form their own groups (an input size-1
    dim that disappears has no output dims, and the reverse).  ``None`` when the
    shapes hold no elements and differ: no dim correspondence is meaningful then.
    """
    if 0 in in_shape or 0 in out_shape:
        if tuple(in_shape) == tuple(out_shape):
            return tuple(((dim,), (dim,)) for dim in range(len(in_shape)))
        return None
    groups: list[DimGroup] = []
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        in_is_one = i < len(in_shape) and in_shape[i] == 1
        out_is_one = j < len(out_shape) and out_shape[j] == 1
        if in_is_one and out_is_one:
            groups.append(((i,), (j,)))
            i, j = i + 1, j + 1
            continue
        if in_is_one or j == len(out_shape):
            groups.append(((i,), ()))
            i += 1
            continue
        if out_is_one or i == len(in_shape):
            groups.append(((), (j,)))
            j += 1
            continue
        in_dims, out_dims = [i], [j]
        in_count, out_count = in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while in_count != out_count:
            if in_count < out_count:
                if i == len(in_shape):
                    return None
                in_count *= in_shape[i]
                in_dims.append(i)
                i += 1
            else:
                if j == len(out_shape):
                    return None
                out_count *= out_shape[j]
                out_dims.append(j)
                j += 1
        groups.append((tuple(in_dims), tuple(out_dims)))
    return tuple(groups)


def _view_size_position(call: OpCall) -> ArgPosition:
    return 1 if len(call.args) > 1 else "size"


def _view_strategies(call: OpCall) -> list[OneDimStrategy]:
    groups = view_dim_groups(call.input_shape(0), call.output_shape(0))
    strategies: list[OneDimStrategy] = []
    for in_dims, out_dims in groups or ():
        if in_dims and out_dims:
            strategies.append(OneDimStrategy((Shard(out_dims[0]),), (Shard(in_dims[0]),)))
    strategies.extend(_unchanged_replicate_and_partials(call))
    return strategies


def _unchanged_replicate_and_partials(call: OpCall) -> list[OneDimStrategy]:
    strategies = [OneDimStrategy((Replicate(),), (Replicate(),))]
    for reduce_op in call.every_reduce_op():
        strategies.append(OneDimStrategy((Partial(reduce_op),), (Partial(reduce_op),)))
    return strategies


def _flat_ranges_match(
    in_size: int, in_inner: int, out_size: int, out_inner: int, split_sizes: Sequence[int]
) -> bool:
    """Whether nested torch.chunk splits of two dims cover the same flat element ranges everywhere."""
    placements = (Shard(0),) * len(split_sizes)
    for coordinate in itertools.product(*(range(size) for size in split_sizes)):
        (in_len,), (in_off,) = compute_local_shape_and_global_offset((in_size,), split_sizes, coordinate, placements)
        (out_len,), (out_off,) = compute_local_shape_and_global_offset((out_size,), split_sizes, coordinate, placements)
        if in_len * in_inner != out_len * out_inner or in_off * in_inner != out_off * out_inner:
            return False
    return True


def _view_is_valid(
    call: OpCall, inputs: PlacementsPerTensor, outputs: tuple[tuple[Placement, ...] | None, ...]
) -> bool:
    in_shape, out_shape = call.input_shape(0), call.output_shape(0)
    groups = view_dim_groups(in_shape, out_shape)
    if groups is None:
        return True
    mesh_shape = tuple(call.mesh.shape)
    for in_dims, out_dims in groups:
        if len(in_dims) <= 1 and len(out_dims) <= 1:
            continue
        splitting = [mesh_shape[m] for m, placement in enumerate(inputs[0]) if placement == Shard(in_dims[0])]
        if not splitting:
            continue
        in_inner = math.prod(in_shape[d] for d in in_dims[1:])
        out_inner = math.prod(out_shape[d] for d in out_dims[1:])
        if not _flat_ranges_match(in_shape[in_dims[0]], in_inner, out_shape[out_dims[0]], out_inner, splitting):
            return False
    return True


def _local_size_override(
    call: OpCall, output_specs: tuple[DTensorSpec[Any] | None, ...]
) -> tuple[tuple[ArgPosition, object], ...]:
    output = output_specs[0]
    assert output is not None
    if not output.is_sharded():
        return ()  # every rank holds the full extent: the global size is the local size
    return ((_view_size_position(call), tuple(output.local_shape())),)


def _view_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    meta = input_meta(args[0]) if args else None
    size = args[1] if len(args) > 1 else kwargs.get("size")
    if meta is None or not is_contiguous(meta) or not isinstance(size, (list, tuple)):
        return None
    shape = resolve_view_size(size, math.prod(meta.shape))
    return None if shape is None else contiguous_meta(shape, meta.dtype)


VIEW_RULE = ShardingRule(
    family="view",
    one_dim_strategies=_view_strategies,
    is_valid=_view_is_valid,
    local_arg_overrides=_local_size_override,
    output_meta=_view_output_meta,
)


def _expand_strategies(call: OpCall) -> list[OneDimStrategy]:
    in_shape, out_shape = call.input_shape(0), call.output_shape(0)
    leading = len(out_shape) - len(in_shape)
    strategies = [
        OneDimStrategy((Shard(in_dim + leading),), (Shard(in_dim),))
        for in_dim in range(len(in_shape))
        if in_shape[in_dim] == out_shape[in_dim + leading]
    ]
    strategies.extend(_unchanged_replicate_and_partials(call))
    return strategies


def _expand_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    meta = input_meta(args[0]) if args else None
    size = args[1] if len(args) > 1 else kwargs.get("size")
    if meta is None or not isinstance(size, (list, tuple)) or len(size) < len(meta.shape):
        return None
    leading = len(size) - len(meta.shape)
    shape: list[int] = []
    stride: list[int] = []
    for dim, wanted in enumerate(int(extent) for extent in size):
        if dim < leading:
            if wanted < 0:
                return None
            shape.append(wanted)
            stride.append(0)
            continue
        have, have_stride = meta.shape[dim - leading], meta.stride[dim - leading]
        if wanted == -1 or wanted == have:
            shape.append(have)
            stride.append(have_stride)
        elif have == 1 and wanted >= 0:
            shape.append(wanted)
            stride.append(0)
        else:
            return None
    return TensorMeta(torch.Size(shape), tuple(stride), meta.dtype)


EXPAND_RULE = ShardingRule(
    family="expand",
    one_dim_strategies=_expand_strategies,
    local_arg_overrides=_local_size_override,
    output_meta=_expand_output_meta,
)


def _swapped_dims(call: OpCall) -> tuple[int, int]:
    ndim = len(call.input_shape(0))
    if call.op._schema.name in ("aten::t", "aten::t_"):
        return (0, 1) if ndim == 2 else (0, 0)
    first = int(call.arg(1, "dim0"))  # type: ignore[call-overload]
    second = int(call.arg(2, "dim1"))  # type: ignore[call-overload]
    size = max(ndim, 1)
    return first % size, second % size


def _transpose_strategies(call: OpCall) -> list[OneDimStrategy]:
    first, second = _swapped_dims(call)
    strategies = []
    for dim in range(len(call.input_shape(0))):
        moved = second if dim == first else first if dim == second else dim
        strategies.append(OneDimStrategy((Shard(moved),), (Shard(dim),)))
    strategies.extend(_unchanged_replicate_and_partials(call))
    return strategies


def _transpose_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    meta = input_meta(args[0]) if args else None
    if meta is None:
        return None
    ndim = len(meta.shape)
    if op._schema.name == "aten::t":
        if ndim > 2:
            return None
        first, second = (0, 1) if ndim == 2 else (0, 0)
    else:
        first_arg = args[1] if len(args) > 1 else kwargs.get("dim0")
        second_arg = args[2] if len(args) > 2 else kwargs.get("dim1")
        if not isinstance(first_arg, int) or not isinstance(second_arg, int):
            return None
        size = max(ndim, 1)
        if not (-size <= first_arg < size and -size <= second_arg < size):
            return None
        first, second = first_arg % size, second_arg % size
    if ndim == 0:
        return meta
    shape, stride = list(meta.shape), list(meta.stride)
    shape[first], shape[second] = shape[second], shape[first]
    stride[first], stride[second] = stride[second], stride[first]
    return TensorMeta(torch.Size(shape), tuple(stride), meta.dtype)


TRANSPOSE_RULE = ShardingRule(
    family="transpose", one_dim_strategies=_transpose_strategies, output_meta=_transpose_output_meta
)

register_rule((aten.view.default, aten._unsafe_view.default, aten._unsafe_view.out, aten.reshape.default), VIEW_RULE)
register_rule((aten.expand.default,), EXPAND_RULE)
# t_/transpose_ change the shape of self in place; not supported here.
register_rule(aten_overloads(("t", "transpose"), overloads=("default", "int"), with_inplace=False), TRANSPOSE_RULE)
