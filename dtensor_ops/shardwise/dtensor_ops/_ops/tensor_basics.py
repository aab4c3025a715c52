"""Tensor basics: copies and aliases, ``*_like`` and ``new_*`` factories, fills, ``equal``.

* ``detach``/``detach_``/``alias``/``clone``/``_to_copy`` keep the input's layout; a Partial
  input stays Partial when converting each part keeps the reduction meaningful
  (``_to_copy`` to an integer dtype does not keep a sum).
* ``copy_`` writes ``src`` into ``self`` in place: ``self`` keeps its placements,
  ``src`` is brought to them (broadcast dims of ``src`` replicated).
* ``*_like`` factories never read the input's values: the output takes the
  input's shards, and is Replicate where the input is Partial (the input itself
  is left as it is), except ``empty_like``, whose unwritten values may as well be
  parts of a sum (PyTorch keeps them Partial too).  ``new_*`` factories build a tensor
  of the given global size: laid out like the input where that size is the input's
  own (shards followed; Partial too for the unwritten ``new_empty*``; each rank then
  builds its local piece's size), replicated otherwise, as PyTorch.
* ``is_same_size`` compares global shapes: answered from the specs, no data moved.
* ``fill_`` and ``zero_`` keep every placement; on ``Partial(sum)`` mesh dims only the first
  rank holds the value and the others zeros, so the parts add up to the value (PyTorch fills
  every part: ``world * value``).
* ``equal`` compares replicated tensors and ``item`` (``_local_scalar_dense``)
  reads a replicated one, so that every rank gets the same, global answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta, _StridedShard

from ._aligned import argument_location

from ._shapes import (
    broadcast_shapes,
    contiguous_meta,
    dtype_on_empty_tensors,
    has_row_major_layout,
    input_meta,
    same_as_input_meta,
)

from .._rules import (
    ArgPosition,
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
    "SAME_SIZE_RULE",
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
    unwritten = call.op._schema.name == "aten::empty_like"
    for placement in call.placements_keeping_values_unread(len(call.input_shape(0))):
        output: Placement = Replicate() if isinstance(placement, Partial) and not unwritten else placement
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


_UNWRITTEN_NEW_FACTORIES = ("aten::new_empty", "aten::new_empty_strided")


def _new_factory_size(call: OpCall) -> object:
    return call.arg(1, "size")


def _new_factory_strategies(call: OpCall) -> list[OneDimStrategy]:
    """Follow the input where the new tensor has the input's global shape (listed first: equal in cost, so
    the engine keeps the input's layout), else replicated."""
    input_shape = tuple(call.input_shape(0))
    size = _new_factory_size(call)
    same_shape = isinstance(size, (list, tuple)) and tuple(size) == input_shape
    unwritten = call.op._schema.name in _UNWRITTEN_NEW_FACTORIES
    strategies = []
    for placement in call.placements_keeping_values_unread(len(input_shape)):
        if same_shape and (isinstance(placement, Shard) or (unwritten and isinstance(placement, Partial))):
            strategies.append(OneDimStrategy((placement,), (placement,)))
        strategies.append(OneDimStrategy((Replicate(),), (placement,)))
    return strategies


def _strides_for(shape: Sequence[int], like_strides: Sequence[int]) -> tuple[int, ...]:
    """Dense strides for ``shape`` with the dims in the memory order ``like_strides`` gives (innermost =
    smallest stride; ties: the later dim innermost, as in a row-major tensor)."""
    order = sorted(range(len(shape)), key=lambda dim: (like_strides[dim], -dim))
    strides = [0] * len(shape)
    step = 1
    for dim in order:
        strides[dim] = step
        step *= max(shape[dim], 1)
    return tuple(strides)


def _new_factory_overrides(
    call: OpCall, outputs: tuple[DTensorSpec[Any] | None, ...]
) -> tuple[tuple[ArgPosition, object], ...]:
    """A new tensor laid out like its input is made at this rank's local size (and strides)."""
    output = outputs[0]
    if output is None or all(isinstance(placement, (Replicate, Partial)) for placement in output.placements):
        return ()
    local_shape = list(output.local_shape())
    overrides: list[tuple[ArgPosition, object]] = [(argument_location(call, 1, "size"), local_shape)]
    if call.op._schema.name == "aten::new_empty_strided":
        stride = call.arg(2, "stride")
        assert isinstance(stride, (list, tuple))
        overrides.append((argument_location(call, 2, "stride"), list(_strides_for(local_shape, stride))))
    return tuple(overrides)


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
    family="new-factory",
    one_dim_strategies=_new_factory_strategies,
    output_meta=_new_factory_output_meta,
    local_arg_overrides=_new_factory_overrides,
)


def _fill_strategies(call: OpCall) -> list[OneDimStrategy]:
    extra_inputs: tuple[Placement, ...] = (Replicate(),) * (len(call.input_specs) - 1)  # fill_.Tensor's value
    keep = call.placements_keeping_values_unread(len(call.input_shape(0)))
    # A fill writes one value everywhere, so any layout may stay as it is: also the _StridedShard pieces
    # FSDP over TP leaves (optimizers zero such gradients in place).
    keep += [p for p in dict.fromkeys(call.input_specs[0].placements) if isinstance(p, _StridedShard)]
    return [OneDimStrategy((placement,), (placement,) + extra_inputs) for placement in keep]


@dataclass(frozen=True)
class _FillOneShareOfSum:
    """``fill_`` of a ``Partial(sum)`` tensor on a rank whose parts must hold zeros: the parts of the
    filled value add up to the value once (the first rank of each such mesh dim holds it)."""

    def __call__(self, target: torch.Tensor, value: object) -> torch.Tensor:
        return target.zero_()


def _fill_kernel(
    call: OpCall, inputs: tuple[tuple[Placement, ...], ...], outputs: tuple[DTensorSpec[Any] | None, ...]
) -> _FillOneShareOfSum | None:
    if call.op._schema.name == "aten::zero_":
        return None  # zeros add up to zero: every rank zeroes its part
    sum_dims = [dim for dim, placement in enumerate(inputs[0]) if placement == Partial("sum")]
    if not sum_dims:
        return None
    coordinate = call.mesh.get_coordinate()
    if coordinate is None or all(coordinate[dim] == 0 for dim in sum_dims):
        return None  # this rank holds the value (or is not in the mesh: nothing to run)
    return _FillOneShareOfSum()


def _fill_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    if op is aten.fill_.Tensor:
        value = input_meta(args[1]) if len(args) > 1 else None
        if value is None or len(value.shape) != 0:
            return None  # fill_ takes a 0-dim value tensor; the meta run raises torch's error otherwise
    return same_as_input_meta(op, args, kwargs)


FILL_RULE = ShardingRule(
    family="fill",
    one_dim_strategies=_fill_strategies,
    scalar_values_matter=False,
    output_meta=_fill_output_meta,
    local_kernel=_fill_kernel,
)


def _equal_strategies(call: OpCall) -> list[OneDimStrategy]:
    return [OneDimStrategy((), (Replicate(),) * len(call.input_specs))]


EQUAL_RULE = ShardingRule(family="equal", one_dim_strategies=_equal_strategies, tensor_outputs=False)

# .item(): the global value on every rank (PyTorch gives a Partial or Shard input's local value instead).
ITEM_RULE = ShardingRule(family="item", one_dim_strategies=_equal_strategies, tensor_outputs=False)

def _keep_placements(call: OpCall) -> list[OneDimStrategy]:
    """Inputs stay as they are (their values are not read)."""
    ndims = [len(call.input_shape(index)) for index in range(len(call.input_specs))]
    choices = [call.placements_keeping_values_unread(ndim) for ndim in ndims]
    return [OneDimStrategy((), tuple(combination)) for combination in _product(choices)]


def _product(choices: Sequence[Sequence[Placement]]) -> list[tuple[Placement, ...]]:
    combinations: list[tuple[Placement, ...]] = [()]
    for options in choices:
        combinations = [(*done, option) for done in combinations for option in options]
    return combinations


@dataclass(frozen=True)
class _Answer:
    """A local kernel returning a value known from the specs alone (the same on every rank)."""

    value: bool

    def __call__(self, *args: object, **kwargs: object) -> bool:
        return self.value


def _same_size_kernel(
    call: OpCall, inputs: tuple[tuple[Placement, ...], ...], outputs: tuple[DTensorSpec[Any] | None, ...]
) -> _Answer:
    return _Answer(tuple(call.input_shape(0)) == tuple(call.input_shape(1)))


SAME_SIZE_RULE = ShardingRule(
    family="is_same_size",
    one_dim_strategies=_keep_placements,
    tensor_outputs=False,
    local_kernel=_same_size_kernel,
)

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
register_rule((aten.is_same_size.default,), SAME_SIZE_RULE)
