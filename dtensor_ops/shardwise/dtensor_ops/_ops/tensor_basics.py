"""Tensor basics: copies and aliases, ``*_like`` and ``new_*`` factories, fills, ``equal``.

* ``detach``/``detach_``/``alias``/``clone``/``_to_copy`` keep the input's layout; a Partial
  input stays Partial when converting each part keeps the reduction meaningful
  (``_to_copy`` to an integer dtype does not keep a sum).
* ``copy_`` writes ``src`` into ``self`` in place: ``self`` keeps its placements,
  ``src`` is brought to them (broadcast dims of ``src`` replicated).
* ``*_like`` factories never read the input's values: the output takes the
  input's shards, and is Replicate where the input is Partial (the input itself
  is left as it is).  ``new_*`` factories build a tensor of the given global size,
  replicated.
* ``fill_`` keeps every placement except ``Partial(sum)``, whose parts would add
  up to ``world * value``; ``zero_`` keeps every placement.
* ``equal`` compares replicated tensors and ``item`` (``_local_scalar_dense``)
  reads a replicated one, so that every rank gets the same, global answer.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from shardwise.placement import Partial, Placement, Replicate, Shard, TensorMeta

from ._shapes import (
    broadcast_shapes,
    contiguous_meta,
    dtype_on_empty_tensors,
    has_row_major_layout,
    input_meta,
    same_as_input_meta,
)

from .._rules import (
    OneDimStrategy,
    OpCall,
    ShardingRule,
    aten_overloads,
    broadcast_input_placement,
    partial_survives_cast,
    register_rule,
)

__all__ = [
    "COPY_RULE",
    "EQUAL_RULE",
    "FILL_RULE",
    "INPLACE_COPY_RULE",
    "ITEM_RULE",
    "LIKE_FACTORY_RULE",
    "NEW_FACTORY_RULE",
]

aten = torch.ops.aten


def _copy_strategies(call: OpCall) -> list[OneDimStrategy]:
    ndim = len(call.input_shape(0))
    strategies = [OneDimStrategy((Shard(dim),), (Shard(dim),)) for dim in range(ndim)]
    strategies.append(OneDimStrategy((Replicate(),), (Replicate(),)))
    source_dtype = call.input_meta(0).dtype
    target = call.output_metas[0]
    assert target is not None
    for reduce_op in call.every_reduce_op():
        if partial_survives_cast(source_dtype, target.dtype, reduce_op):
            strategies.append(OneDimStrategy((Partial(reduce_op),), (Partial(reduce_op),)))
    return strategies


_KEEPS_LAYOUT = (None, torch.preserve_format, torch.contiguous_format)


def _copy_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    meta = input_meta(args[0]) if args else None
    if meta is None:
        return None
    name = op._schema.name
    if name in ("aten::detach", "aten::detach_", "aten::alias"):
        return meta
    if len(args) > 1 or not has_row_major_layout(meta) or kwargs.get("memory_format") not in _KEEPS_LAYOUT:
        return None
    dtype = kwargs.get("dtype") if name == "aten::_to_copy" else None
    if dtype is not None and not isinstance(dtype, torch.dtype):
        return None
    return contiguous_meta(meta.shape, dtype or meta.dtype)


COPY_RULE = ShardingRule(family="copy", one_dim_strategies=_copy_strategies, output_meta=_copy_output_meta)


def _inplace_copy_strategies(call: OpCall) -> list[OneDimStrategy]:
    self_shape = call.input_shape(0)
    self_dtype = call.input_meta(0).dtype
    source_index = call.input_index_at(1)
    if source_index is None:
        raise TypeError(f"{call.op}: the source must be a DTensor when copying into a DTensor")
    source_shape = call.input_shape(source_index)
    source_dtype = call.input_meta(source_index).dtype

    def inputs(self_placement: Placement, source_placement: Placement) -> tuple[Placement, ...]:
        placed: list[Placement] = [Replicate()] * len(call.input_specs)
        placed[0] = self_placement
        placed[source_index] = source_placement
        return tuple(placed)

    strategies = [
        OneDimStrategy((Shard(dim),), inputs(Shard(dim), broadcast_input_placement(self_shape, source_shape, dim)))
        for dim in range(len(self_shape))
    ]
    strategies.append(OneDimStrategy((Replicate(),), inputs(Replicate(), Replicate())))
    for reduce_op in call.every_reduce_op():
        if partial_survives_cast(source_dtype, self_dtype, reduce_op):
            partial = Partial(reduce_op)
            strategies.append(OneDimStrategy((partial,), inputs(partial, partial)))
    return strategies


def _inplace_copy_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    target = input_meta(args[0]) if args else None
    source = input_meta(args[1]) if len(args) > 1 else None
    if target is None or source is None:
        return None
    if broadcast_shapes(target.shape, source.shape) != target.shape:
        return None
    return target


INPLACE_COPY_RULE = ShardingRule(
    family="copy_", one_dim_strategies=_inplace_copy_strategies, output_meta=_inplace_copy_output_meta
)


def _like_factory_strategies(call: OpCall) -> list[OneDimStrategy]:
    strategies = []
    for placement in call.placements_keeping_values_unread(len(call.input_shape(0))):
        output: Placement = Replicate() if isinstance(placement, Partial) else placement
        strategies.append(OneDimStrategy((output,), (placement,)))
    return strategies


_FLOATING_RANDOM_LIKE = ("aten::rand_like", "aten::randn_like")


def _like_factory_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    meta = input_meta(args[0]) if args else None
    if (
        meta is None
        or not has_row_major_layout(meta)
        or kwargs.get("memory_format") not in _KEEPS_LAYOUT
        or kwargs.get("layout") not in (None, torch.strided)
    ):
        return None
    dtype = dtype_on_empty_tensors(op, args, kwargs)
    if dtype is None:
        return None
    if op._schema.name in _FLOATING_RANDOM_LIKE and not (dtype.is_floating_point or dtype.is_complex):
        return None  # torch rejects it, but only once there is an element to draw: let meta tensors raise
    return contiguous_meta(meta.shape, dtype)


LIKE_FACTORY_RULE = ShardingRule(
    family="like-factory",
    one_dim_strategies=_like_factory_strategies,
    scalar_values_matter=False,
    output_meta=_like_factory_output_meta,
)


def _new_factory_strategies(call: OpCall) -> list[OneDimStrategy]:
    return [
        OneDimStrategy((Replicate(),), (placement,))
        for placement in call.placements_keeping_values_unread(len(call.input_shape(0)))
    ]


def _new_factory_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    meta = input_meta(args[0]) if args else None
    size = args[1] if len(args) > 1 else kwargs.get("size")
    dtype = kwargs.get("dtype")
    if (
        meta is None
        or not isinstance(size, (list, tuple))
        or any(not isinstance(extent, int) or extent < 0 for extent in size)
        or op._schema.name == "aten::new_empty_strided"
        or kwargs.get("layout") not in (None, torch.strided)
        or (dtype is not None and not isinstance(dtype, torch.dtype))
    ):
        return None
    return contiguous_meta(size, dtype or meta.dtype)


NEW_FACTORY_RULE = ShardingRule(
    family="new-factory", one_dim_strategies=_new_factory_strategies, output_meta=_new_factory_output_meta
)


def _fill_strategies(call: OpCall) -> list[OneDimStrategy]:
    keeps_sum = call.op._schema.name == "aten::zero_"
    extra_inputs: tuple[Placement, ...] = (Replicate(),) * (len(call.input_specs) - 1)  # fill_.Tensor's value
    strategies = []
    for placement in call.placements_keeping_values_unread(len(call.input_shape(0))):
        if isinstance(placement, Partial) and placement.reduce_op == "sum" and not keeps_sum:
            continue
        strategies.append(OneDimStrategy((placement,), (placement,) + extra_inputs))
    return strategies


def _fill_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    if op is aten.fill_.Tensor:
        value = input_meta(args[1]) if len(args) > 1 else None
        if value is None or len(value.shape) != 0:
            return None  # fill_ takes a 0-dim value tensor; the meta run raises torch's error otherwise
    return same_as_input_meta(op, args, kwargs)


FILL_RULE = ShardingRule(
    family="fill", one_dim_strategies=_fill_strategies, scalar_values_matter=False, output_meta=_fill_output_meta
)


def _equal_strategies(call: OpCall) -> list[OneDimStrategy]:
    return [OneDimStrategy((), (Replicate(),) * len(call.input_specs))]


EQUAL_RULE = ShardingRule(family="equal", one_dim_strategies=_equal_strategies, tensor_outputs=False)

# .item(): the global value on every rank (PyTorch gives a Partial or Shard input's local value instead).
ITEM_RULE = ShardingRule(family="item", one_dim_strategies=_equal_strategies, tensor_outputs=False)

register_rule(
    aten_overloads(("detach", "alias", "clone", "_to_copy"), overloads=("default", "out"), with_inplace=False),
    COPY_RULE,
)
# Optimizer.zero_grad(set_to_none=False) detaches a gradient in place when it has a history (create_graph=True).
register_rule((aten.detach_.default,), COPY_RULE)
register_rule((aten.copy_.default,), INPLACE_COPY_RULE)
register_rule(
    aten_overloads(
        ("empty_like", "zeros_like", "ones_like", "full_like"),
        overloads=("default", "out"),
        with_inplace=False,
    ),
    LIKE_FACTORY_RULE,
)
register_rule(
    aten_overloads(
        ("new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided"),
        overloads=("default", "out"),
        with_inplace=False,
    ),
    NEW_FACTORY_RULE,
)
register_rule((aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default), FILL_RULE)
register_rule((aten.equal.default,), EQUAL_RULE)
register_rule((aten._local_scalar_dense.default,), ITEM_RULE)
