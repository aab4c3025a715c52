"""Shape ops: view / _unsafe_view / reshape, expand, t, transpose, permute, squeeze, unsqueeze.

All of them move elements without combining them, so every Partial kind
(sum, avg, max, min) passes through unchanged.

``view`` groups the input and output dims into runs of equal element count
(``[b, s, h] -> [b*s, h]`` has the groups ``(b, s) -> (b*s)`` and ``h -> h``).
A dim alone in its group on both sides maps one to one.  In a group that merges
or splits dims, a shard of any input dim of the group may become a shard of any
output dim of the group, but only where every rank then holds exactly the
elements the output placement says it holds: each rank's block of the group
must be one contiguous range of the group's row-major (flat) order, the same
range on both sides.  That is checked exactly, per mesh coordinate, for the
combination of all mesh dims sharding the group (nested left to right), uneven
and empty shards included.  So ``[4, 3] -> [12]`` cut in 4 keeps the shard
(rows of 3 = flat ranges of 3), ``[2, 3] -> [6]`` cut in 4 does not (rows
1,1,0,0 but flat 2,2,2,0); ``[b, s, h] -> [b*s, h]`` sharded on ``s`` only when
``b == 1`` (then ``b`` is a group of its own) or when other mesh dims already cut
``b`` into single rows; the attention head split ``[b, s, heads*hd] -> [b, s,
heads, hd]`` sharded on the last dim gives a shard of ``heads`` whenever the
heads divide evenly (and back again for the merge).

Merging dims behind a sharded one (attention's ``(b, h, s, d) -> (b*h, s, d)``
with the heads sharded) gives, as PyTorch does, ``_StridedShard(flat,
split_factor=b)``: every outer index keeps its own piece of the sharded dim.
That is taken only where it holds exactly the elements the input holds on every
rank (compared run by run with ``local_index_runs``, uneven sizes included),
where one mesh dim alone cuts the group, the input has no Partial mesh dim and
no communication is needed; splitting such a dim back (``split_factor`` = the
product of the outer new dims) gives the ``Shard`` again, and a strided dim that
maps one to one stays strided (the engine also relabels this rule's plain
shards to a strided input's layout, see ``_propagation._strided_variants``).
Otherwise the cheapest strategy that redistributes the input wins (a strided
input moved by the planner's strided steps, into a plain layout).  The local op gets the
local output shape in place of the global ``size`` argument.

``squeeze`` removes only the dims of *global* size 1.  A local shard can have
size 1 where the global dim does not (a 4-row dim cut in 4); ``squeeze.dims``
therefore gets the list of globally squeezed dims as its local argument, and
for ``squeeze()`` / ``squeeze(dim)``, which cannot be told which dims to keep,
the shardings that leave such a size-1 shard on a kept dim are refused (the
input is redistributed instead).  A sharded dim that is squeezed away is
replicated first.
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
    _StridedShard,
    chunk_size_and_offset,
    local_index_runs,
)

from ._shapes import contiguous_meta, input_meta, is_contiguous, resolve_view_size
from .._rules import (
    ArgPosition,
    OneDimStrategy,
    OpCall,
    PlacementsPerTensor,
    ShardingRule,
    aten_overloads,
    register_rule,
)

__all__ = [
    "EXPAND_RULE",
    "PERMUTE_RULE",
    "SQUEEZE_RULE",
    "TRANSPOSE_RULE",
    "UNSQUEEZE_RULE",
    "VIEW_RULE",
    "view_dim_groups",
]

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


def _unchanged_replicate_and_partials(call: OpCall) -> list[OneDimStrategy]:
    strategies = [OneDimStrategy((Replicate(),), (Replicate(),))]
    for reduce_op in call.every_reduce_op():
        strategies.append(OneDimStrategy((Partial(reduce_op),), (Partial(reduce_op),)))
    return strategies


# --------------------------------------------------------------------------- view


def _view_size_position(call: OpCall) -> ArgPosition:
    return 1 if len(call.args) > 1 else "size"


def _view_strategies(call: OpCall) -> list[OneDimStrategy]:
    in_shape = call.input_shape(0)
    groups = view_dim_groups(in_shape, call.output_shape(0))
    out_shape = call.output_shape(0)
    strided_inputs = {p for p in call.input_specs[0].placements if isinstance(p, _StridedShard)}
    strategies: list[OneDimStrategy] = []
    strided_strategies: list[OneDimStrategy] = []
    for in_dims, out_dims in groups or ():
        # Outermost to outermost first: on ties between exact strategies it is the natural one.
        for in_dim in in_dims:
            for out_dim in out_dims:
                strategies.append(OneDimStrategy((Shard(out_dim),), (Shard(in_dim),)))
        if len(in_dims) > 1 and len(out_dims) == 1:
            # Merging dims behind a sharded one: every outer index keeps its own piece of the sharded
            # dim, which is a strided shard of the merged dim (checked exact in _view_is_valid).
            for position in range(1, len(in_dims)):
                outer = math.prod(in_shape[dim] for dim in in_dims[:position])
                strided_strategies.append(
                    OneDimStrategy((_StridedShard(out_dims[0], split_factor=outer),), (Shard(in_dims[position]),))
                )
        for strided in strided_inputs:
            if in_dims != (strided.dim,):
                continue
            if len(out_dims) == 1:
                strided_strategies.append(
                    OneDimStrategy((_StridedShard(out_dims[0], split_factor=strided.split_factor),), (strided,))
                )
                continue
            # The inverse of the merge: the outer dims whose sizes make up the split factor come first.
            for position in range(1, len(out_dims)):
                if math.prod(out_shape[dim] for dim in out_dims[:position]) == strided.split_factor:
                    strided_strategies.append(OneDimStrategy((Shard(out_dims[position]),), (strided,)))
    # After the plain shards: where both are exact, the plain Shard is the simpler layout.
    strategies.extend(strided_strategies)
    strategies.extend(_unchanged_replicate_and_partials(call))
    return strategies


def _flat_block(
    shape: Sequence[int], dims: Sequence[int], cuts: Sequence[tuple[int, int, int]]
) -> tuple[int, int] | None:
    """(start, length) of one rank's block of ``dims`` in their row-major order; None if not one range.

    ``cuts`` are (tensor dim, number of chunks, chunk index) applied in order
    (nested mesh dims, left to right).  An empty block is ``(0, 0)``.
    """
    sizes = {dim: shape[dim] for dim in dims}
    offsets = {dim: 0 for dim in dims}
    for dim, chunks, index in cuts:
        size, offset = chunk_size_and_offset(sizes[dim], chunks, index)
        sizes[dim] = size
        offsets[dim] += offset
    if any(sizes[dim] == 0 for dim in dims):
        return (0, 0)
    # One range iff, inside the innermost dim not held whole, every outer dim holds a single index.
    cut_positions = [position for position, dim in enumerate(dims) if sizes[dim] != shape[dim]]
    if cut_positions and any(sizes[dim] != 1 for dim in dims[: cut_positions[-1]]):
        return None
    start = 0
    inner = 1
    for dim in reversed(dims):
        start += offsets[dim] * inner
        inner *= shape[dim]
    return (start, math.prod(sizes[dim] for dim in dims))


def _group_shards_line_up(
    in_shape: Sequence[int],
    out_shape: Sequence[int],
    group: DimGroup,
    mesh_shape: Sequence[int],
    in_cuts: Sequence[tuple[int, int]],
    out_cuts: Sequence[tuple[int, int]],
) -> bool:
    """Whether every coordinate holds the same single flat range of the group on both sides.

    ``in_cuts`` / ``out_cuts``: (mesh dim, tensor dim) for the mesh dims sharding the group, in mesh-dim order.
    """
    in_dims, out_dims = group
    mesh_dims = [mesh_dim for mesh_dim, _ in in_cuts]
    for coordinate in itertools.product(*(range(mesh_shape[mesh_dim]) for mesh_dim in mesh_dims)):
        in_block = _flat_block(
            in_shape,
            in_dims,
            [(dim, mesh_shape[mesh_dim], index) for (mesh_dim, dim), index in zip(in_cuts, coordinate)],
        )
        out_block = _flat_block(
            out_shape,
            out_dims,
            [(dim, mesh_shape[mesh_dim], index) for (mesh_dim, dim), index in zip(out_cuts, coordinate)],
        )
        if in_block is None or out_block is None:
            return False
        if in_block[1] == 0 and out_block[1] == 0:
            continue
        if in_block != out_block:
            return False
    return True


# Enumerating a strided layout costs one run per held index of the outer dims: beyond this, assume inexact.
_MAX_FLAT_RUNS = 1 << 14


def _flat_runs(
    group_shape: Sequence[int], mesh_size: int, index: int, placement: Placement
) -> list[tuple[int, int]] | None:
    """(start, length) runs of the group's row-major order held at ``index`` of a 1-D mesh of ``mesh_size``.

    ``placement`` is a ``Shard`` or ``_StridedShard`` of a dim of the group, numbered within the group.
    None when there would be more than ``_MAX_FLAT_RUNS`` runs.
    """
    per_dim = local_index_runs(group_shape, (mesh_size,), (index,), (placement,))
    outer_count = 1
    for dim_runs in per_dim[:-1]:
        outer_count *= sum(length for _, length in dim_runs)
    if outer_count * max(len(per_dim[-1]), 1) > _MAX_FLAT_RUNS:
        return None
    runs: list[tuple[int, int]] = []
    starts = [0]
    for dim, dim_runs in enumerate(per_dim[:-1]):
        inner = math.prod(group_shape[dim + 1 :])
        starts = [base + i * inner for base in starts for start, length in dim_runs for i in range(start, start + length)]
    for base in starts:
        for start, length in per_dim[-1]:
            if runs and runs[-1][0] + runs[-1][1] == base + start:
                runs[-1] = (runs[-1][0], runs[-1][1] + length)
            else:
                runs.append((base + start, length))
    return runs


def _strided_group_is_exact(
    in_shape: Sequence[int],
    out_shape: Sequence[int],
    group: DimGroup,
    mesh_size: int,
    before: Placement,
    after: Placement,
) -> bool:
    """Whether, with one mesh dim of ``mesh_size`` cutting the group, every rank holds the same flat elements."""
    in_dims, out_dims = group

    def within_group(placement: Placement, dims: Sequence[int]) -> Placement:
        if isinstance(placement, _StridedShard):
            return _StridedShard(dims.index(placement.dim), split_factor=placement.split_factor)
        assert isinstance(placement, Shard)
        return Shard(dims.index(placement.dim))

    in_group_shape = [in_shape[dim] for dim in in_dims]
    out_group_shape = [out_shape[dim] for dim in out_dims]
    for index in range(mesh_size):
        held_before = _flat_runs(in_group_shape, mesh_size, index, within_group(before, in_dims))
        held_after = _flat_runs(out_group_shape, mesh_size, index, within_group(after, out_dims))
        if held_before is None or held_after is None or held_before != held_after:
            return False
    return True


def _view_is_valid(
    call: OpCall, inputs: PlacementsPerTensor, outputs: tuple[tuple[Placement, ...] | None, ...]
) -> bool:
    current = call.input_specs[0].placements
    strided_in_or_out = any(isinstance(p, _StridedShard) for p in (*inputs[0], *(outputs[0] or ())))
    if strided_in_or_out and any(isinstance(p, Partial) for p in current):
        return False  # strided and Partial mesh dims together cannot be redistributed later
    if strided_in_or_out and inputs[0] != current:
        # Strided layouts only where they save the communication; after moving data anyway, a plain
        # layout serves every later op (the planner does not build strided layouts for a view either).
        return False
    in_shape, out_shape = call.input_shape(0), call.output_shape(0)
    groups = view_dim_groups(in_shape, out_shape)
    if groups is None:
        return not any(isinstance(p, _StridedShard) for p in (*inputs[0], *(outputs[0] or ())))
    output = outputs[0]
    assert output is not None
    mesh_shape = tuple(call.mesh.shape)
    for group in groups:
        in_dims, out_dims = group
        if len(in_dims) <= 1 and len(out_dims) <= 1:
            continue  # one dim to one dim of the same size: the same cut on both sides
        in_cuts: list[tuple[int, int]] = []
        out_cuts: list[tuple[int, int]] = []
        strided_cuts: list[tuple[int, Placement, Placement]] = []
        for mesh_dim, (before, after) in enumerate(zip(inputs[0], output)):
            if isinstance(before, (Shard, _StridedShard)) and before.dim in in_dims:
                assert isinstance(after, (Shard, _StridedShard)) and after.dim in out_dims, (
                    "strategies pair shards within a group"
                )
                if isinstance(before, _StridedShard) or isinstance(after, _StridedShard):
                    strided_cuts.append((mesh_dim, before, after))
                else:
                    in_cuts.append((mesh_dim, before.dim))
                    out_cuts.append((mesh_dim, after.dim))
        if strided_cuts:
            # Strided layouts are checked for one mesh dim cutting the group only (nested cuts: not exact here).
            if in_cuts or len(strided_cuts) > 1:
                return False
            mesh_dim, before, after = strided_cuts[0]
            if not _strided_group_is_exact(in_shape, out_shape, group, mesh_shape[mesh_dim], before, after):
                return False
            continue
        if in_cuts and not _group_shards_line_up(in_shape, out_shape, group, mesh_shape, in_cuts, out_cuts):
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
    validity_reads_strided_shards=True,
)


# --------------------------------------------------------------------------- expand


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


# --------------------------------------------------------------------------- transpose / t


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


# --------------------------------------------------------------------------- permute


def _permutation(dims: object, ndim: int) -> tuple[int, ...] | None:
    """``dims`` normalised, or None when it is not a permutation of ``range(ndim)`` (torch then raises)."""
    if not isinstance(dims, (list, tuple)) or len(dims) != ndim:
        return None
    if not all(isinstance(dim, int) and -max(ndim, 1) <= dim < max(ndim, 1) for dim in dims):
        return None
    normalised = tuple(dim % max(ndim, 1) for dim in dims)
    return normalised if sorted(normalised) == list(range(ndim)) else None


def _permute_strategies(call: OpCall) -> list[OneDimStrategy]:
    ndim = len(call.input_shape(0))
    order = _permutation(call.arg(1, "dims"), ndim)
    assert order is not None, "the output metadata check rejects a bad permutation first"
    strategies = [OneDimStrategy((Shard(out_dim),), (Shard(in_dim),)) for out_dim, in_dim in enumerate(order)]
    strategies.extend(_unchanged_replicate_and_partials(call))
    return strategies


def _permute_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    meta = input_meta(args[0]) if args else None
    if meta is None:
        return None
    order = _permutation(args[1] if len(args) > 1 else kwargs.get("dims"), len(meta.shape))
    if order is None:
        return None  # the meta run raises torch's own error
    return TensorMeta(
        torch.Size([meta.shape[dim] for dim in order]), tuple(meta.stride[dim] for dim in order), meta.dtype
    )


PERMUTE_RULE = ShardingRule(family="permute", one_dim_strategies=_permute_strategies, output_meta=_permute_output_meta)


# --------------------------------------------------------------------------- squeeze / unsqueeze


def _requested_squeeze_dims(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object], ndim: int
) -> tuple[int, ...] | None:
    """The dims the call asks to squeeze (normalised); None when an argument is out of range."""
    if op is aten.squeeze.default:
        return tuple(range(ndim))
    raw = args[1] if len(args) > 1 else kwargs.get("dim")
    requested = [raw] if isinstance(raw, int) else raw
    if not isinstance(requested, (list, tuple)):
        return None
    size = max(ndim, 1)
    if not all(isinstance(dim, int) and -size <= dim < size for dim in requested):
        return None
    return tuple(dim % size for dim in requested) if ndim > 0 else ()


def _squeezed_dims(call: OpCall) -> tuple[int, ...]:
    """Dims the call really removes: requested ones of global size 1."""
    shape = call.input_shape(0)
    requested = _requested_squeeze_dims(call.op, call.args, call.kwargs, len(shape))
    assert requested is not None, "the output metadata check rejects bad dims first"
    return tuple(sorted({dim for dim in requested if shape[dim] == 1}))


def _squeeze_strategies(call: OpCall) -> list[OneDimStrategy]:
    removed = _squeezed_dims(call)
    strategies = []
    for dim in range(len(call.input_shape(0))):
        if dim in removed:
            continue  # its only element sits on one rank; the others hold nothing to squeeze
        strategies.append(OneDimStrategy((Shard(dim - sum(1 for gone in removed if gone < dim)),), (Shard(dim),)))
    strategies.extend(_unchanged_replicate_and_partials(call))
    return strategies


def _nested_chunk_sizes(size: int, splits: Sequence[int]) -> set[int]:
    sizes = {size}
    for chunks in splits:
        sizes = {chunk_size_and_offset(piece, chunks, index)[0] for piece in sizes for index in range(chunks)}
    return sizes


def _squeeze_is_valid(
    call: OpCall, inputs: PlacementsPerTensor, outputs: tuple[tuple[Placement, ...] | None, ...]
) -> bool:
    if call.op is aten.squeeze.dims:
        return True  # the local call is told exactly which dims to squeeze
    shape = call.input_shape(0)
    requested = _requested_squeeze_dims(call.op, call.args, call.kwargs, len(shape))
    assert requested is not None
    mesh_shape = tuple(call.mesh.shape)
    for dim in requested:
        if shape[dim] == 1:
            continue
        splits = [mesh_shape[m] for m, placement in enumerate(inputs[0]) if placement == Shard(dim)]
        # squeeze() / squeeze(dim) on the local tensor would drop a kept dim whose shard has 1 element.
        if splits and 1 in _nested_chunk_sizes(shape[dim], splits):
            return False
    return True


def _squeeze_overrides(
    call: OpCall, output_specs: tuple[DTensorSpec[Any] | None, ...]
) -> tuple[tuple[ArgPosition, object], ...]:
    if call.op is not aten.squeeze.dims:
        return ()
    removed = _squeezed_dims(call)
    given = call.arg(1, "dim")
    if isinstance(given, (list, tuple)) and tuple(given) == removed:
        return ()
    return ((1 if len(call.args) > 1 else "dim", removed),)


def _squeeze_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    meta = input_meta(args[0]) if args else None
    if meta is None:
        return None
    requested = _requested_squeeze_dims(op, args, kwargs, len(meta.shape))
    if requested is None or len(set(requested)) != len(requested):
        return None
    kept = [dim for dim in range(len(meta.shape)) if not (dim in requested and meta.shape[dim] == 1)]
    return TensorMeta(
        torch.Size([meta.shape[dim] for dim in kept]), tuple(meta.stride[dim] for dim in kept), meta.dtype
    )


SQUEEZE_RULE = ShardingRule(
    family="squeeze",
    one_dim_strategies=_squeeze_strategies,
    is_valid=_squeeze_is_valid,
    local_arg_overrides=_squeeze_overrides,
    output_meta=_squeeze_output_meta,
)


def _unsqueeze_dim(dim: object, ndim: int) -> int | None:
    if not isinstance(dim, int) or not -(ndim + 1) <= dim <= ndim:
        return None
    return dim % (ndim + 1)


def _unsqueeze_strategies(call: OpCall) -> list[OneDimStrategy]:
    ndim = len(call.input_shape(0))
    new_dim = _unsqueeze_dim(call.arg(1, "dim"), ndim)
    assert new_dim is not None, "the output metadata check rejects a bad dim first"
    strategies = [
        OneDimStrategy((Shard(dim if dim < new_dim else dim + 1),), (Shard(dim),)) for dim in range(ndim)
    ]
    strategies.extend(_unchanged_replicate_and_partials(call))
    return strategies


def _unsqueeze_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    meta = input_meta(args[0]) if args else None
    if meta is None:
        return None
    new_dim = _unsqueeze_dim(args[1] if len(args) > 1 else kwargs.get("dim"), len(meta.shape))
    if new_dim is None:
        return None
    shape, stride = list(meta.shape), list(meta.stride)
    # torch's rule for the new dim's stride: what stepping over the next dim's whole extent would take.
    new_stride = 1 if new_dim == len(shape) else shape[new_dim] * stride[new_dim]
    shape.insert(new_dim, 1)
    stride.insert(new_dim, new_stride)
    return TensorMeta(torch.Size(shape), tuple(stride), meta.dtype)


UNSQUEEZE_RULE = ShardingRule(
    family="unsqueeze", one_dim_strategies=_unsqueeze_strategies, output_meta=_unsqueeze_output_meta
)

_VIEW_OPS = (aten.view.default, aten._unsafe_view.default, aten._unsafe_view.out, aten.reshape.default)
register_rule(_VIEW_OPS, VIEW_RULE)
register_rule((aten.expand.default,), EXPAND_RULE)
# t_/transpose_/squeeze_/unsqueeze_ change the shape of self in place; not supported here.
register_rule(aten_overloads(("t", "transpose"), overloads=("default", "int"), with_inplace=False), TRANSPOSE_RULE)
register_rule((aten.permute.default,), PERMUTE_RULE)
register_rule((aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims), SQUEEZE_RULE)
register_rule((aten.unsqueeze.default,), UNSQUEEZE_RULE)
