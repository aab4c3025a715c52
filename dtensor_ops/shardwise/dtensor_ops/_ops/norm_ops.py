"""Normalisation layers: native_layer_norm (forward and backward), _fused_rms_norm_backward.

``F.layer_norm`` reaches DTensor as ``native_layer_norm`` (its backward as
``native_layer_norm_backward``).  ``F.rms_norm`` and ``aten._fused_rms_norm``
are composite: on CPU they decompose into pow / mean / add_ / rsqrt / mul before
dispatch (the pointwise and reduction rules cover those).  Only
``_fused_rms_norm_backward`` is an op of its own, reached where a device runs
the fused kernel (no CPU kernel in torch 2.13); it follows the layer norm rule.

On one mesh dim the statistics of a row need the whole row, so the normalised
(trailing) dims must be whole on every rank, while the leading (batch /
sequence) dims may stay sharded: the output and the saved statistics (mean,
rstd: the leading dims followed by size-1 dims) are sharded the same way, with
weight and bias replicated.  That is sequence parallelism.  In the backward
pass the weight and bias gradients sum over the leading dims, so with those
sharded each rank holds the sum over its rows: ``Partial(sum)``.  The backward
is linear in the incoming gradient, so a ``Partial(sum)``/``Partial(avg)``
gradient (everything else replicated) gives partial gradients of that kind.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import torch

from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta

from ._shapes import contiguous_meta, input_meta
from .._rules import OneDimStrategy, OpCall, ShardingRule, register_rule

__all__ = ["NORMALIZATION_BACKWARD_RULE", "NORMALIZATION_RULE", "normalized_axis"]

aten = torch.ops.aten


class _Layout(NamedTuple):
    """Where a normalisation op keeps its arguments (positions in the schema)."""

    grad: int | None  # the incoming gradient (backward only)
    input: int
    normalized_shape: int
    stats: tuple[int, ...]  # saved mean / rstd (backward only)
    params: tuple[int, ...]  # weight (and bias)


_LAYOUTS: dict[str, _Layout] = {
    "aten::native_layer_norm": _Layout(None, 0, 1, (), (2, 3)),
    "aten::native_layer_norm_backward": _Layout(0, 1, 2, (3, 4), (5, 6)),
    "aten::_fused_rms_norm_backward": _Layout(0, 1, 2, (3,), (4,)),
}


def normalized_axis(op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]) -> int:
    """The first normalised dim of the input: the dims before it are the ones that may stay sharded."""
    layout = _LAYOUTS[op._schema.name]
    spec = args[layout.input]
    normalized_shape = args[layout.normalized_shape]
    if not isinstance(spec, DTensorSpec) or spec.tensor_meta is None:
        raise TypeError(f"{op}: the input must be a DTensor")
    if not isinstance(normalized_shape, (list, tuple)):
        raise TypeError(f"{op}: normalized_shape must be a list of ints, got {normalized_shape!r}")
    shape = spec.tensor_meta.shape
    if len(normalized_shape) == 0 or tuple(shape[len(shape) - len(normalized_shape) :]) != tuple(normalized_shape):
        raise ValueError(
            f"{op}: normalized_shape {list(normalized_shape)} must be non-empty and equal the trailing dims of the "
            f"input of shape {list(shape)}"
        )
    return len(shape) - len(normalized_shape)


def _parameters_fit(op: torch._ops.OpOverload, args: Sequence[object]) -> bool:
    """Whether every DTensor weight / bias has exactly the normalised shape (else torch raises its own error)."""
    layout = _LAYOUTS[op._schema.name]
    given = args[layout.normalized_shape]
    if not isinstance(given, (list, tuple)):
        return False
    normalized_shape = tuple(given)
    for position in layout.params:
        meta = input_meta(args[position]) if position < len(args) else None
        if meta is not None and tuple(meta.shape) != normalized_shape:
            return False
    return True


def _backward_shapes_fit(op: torch._ops.OpOverload, args: Sequence[object]) -> bool:
    """grad_out shaped like the input, the saved statistics like the input's leading dims then size-1 dims."""
    layout = _LAYOUTS[op._schema.name]
    assert layout.grad is not None
    grad, source = input_meta(args[layout.grad]), input_meta(args[layout.input])
    if grad is None or source is None or grad.shape != source.shape:
        return False
    axis = normalized_axis(op, args, {})
    stats_shape = (*source.shape[:axis], *([1] * (len(source.shape) - axis)))
    for position in layout.stats:
        meta = input_meta(args[position])
        if meta is not None and tuple(meta.shape) != stats_shape:
            return False
    return True


def _rule_inputs(call: OpCall, positions: Sequence[int]) -> list[int]:
    """Rule input indices of the DTensor arguments at ``positions`` (absent / None arguments skipped)."""
    found = []
    for position in positions:
        index = call.input_index_at(position)
        if index is not None:
            found.append(index)
    return found


def _normalization_strategies(call: OpCall) -> list[OneDimStrategy]:
    axis = normalized_axis(call.op, call.args, call.kwargs)
    outputs = len(call.output_metas)
    inputs = len(call.input_specs)
    strategies = []
    for dim in range(axis):
        placements: list[Placement] = [Replicate()] * inputs  # weight and bias
        for index in _rule_inputs(call, (0,)):
            placements[index] = Shard(dim)
        strategies.append(OneDimStrategy((Shard(dim),) * outputs, tuple(placements)))
    strategies.append(OneDimStrategy((Replicate(),) * outputs, (Replicate(),) * inputs))
    return strategies


def _normalization_backward_strategies(call: OpCall) -> list[OneDimStrategy]:
    layout = _LAYOUTS[call.op._schema.name]
    assert layout.grad is not None
    axis = normalized_axis(call.op, call.args, call.kwargs)
    inputs = len(call.input_specs)
    grad_index = call.input_index_at(layout.grad)
    if grad_index is None:
        raise TypeError(f"{call.op}: grad_out must be a DTensor")
    rows = _rule_inputs(call, (layout.grad, layout.input, *layout.stats))
    present = tuple(meta is not None for meta in call.output_metas)

    def outputs_of(grad_input: Placement, param_grads: Placement) -> tuple[Placement | None, ...]:
        wanted = (grad_input,) + (param_grads,) * (len(present) - 1)
        return tuple(placement if here else None for placement, here in zip(wanted, present))

    strategies = []
    for dim in range(axis):
        placements: list[Placement] = [Replicate()] * inputs  # weight and bias
        for index in rows:
            placements[index] = Shard(dim)
        # Weight / bias gradients sum over the leading dims: each rank has the sum over its rows.
        strategies.append(OneDimStrategy(outputs_of(Shard(dim), Partial("sum")), tuple(placements)))
    strategies.append(OneDimStrategy(outputs_of(Replicate(), Replicate()), (Replicate(),) * inputs))
    for reduce_op in call.linear_reduce_ops():
        placements = [Replicate()] * inputs
        placements[grad_index] = Partial(reduce_op)
        strategies.append(OneDimStrategy(outputs_of(Partial(reduce_op), Partial(reduce_op)), tuple(placements)))
    return strategies


def _same_dtype_metas(values: Sequence[object]) -> list[TensorMeta] | None:
    """The metadata of the DTensor arguments among ``values``, if they all share one dtype (else None)."""
    metas = [meta for meta in (input_meta(value) for value in values) if meta is not None]
    if len({meta.dtype for meta in metas}) > 1:
        return None  # mixed precision: the dtypes of the statistics depend on the kernel, ask meta tensors
    return metas


def _layer_norm_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> tuple[TensorMeta | None, ...] | None:
    """(out, mean, rstd): the input's shape, then the leading dims followed by size-1 dims; all contiguous."""
    if len(args) < 5 or _same_dtype_metas(args[:4]) is None:
        return None
    meta = input_meta(args[0])
    try:
        axis = normalized_axis(op, args, kwargs)
    except (TypeError, ValueError):
        return None  # the meta run raises torch's own error
    if not _parameters_fit(op, args):
        return None
    assert meta is not None
    stats_shape = [*meta.shape[:axis], *([1] * (len(meta.shape) - axis))]
    stats = contiguous_meta(stats_shape, meta.dtype)
    return (contiguous_meta(meta.shape, meta.dtype), stats, stats)


def _normalization_backward_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> tuple[TensorMeta | None, ...] | None:
    """(grad_input, grad_weight[, grad_bias]) where output_mask asks for them; shaped like input / weight / bias."""
    layout = _LAYOUTS[op._schema.name]
    mask = args[-1] if len(args) == len(op._schema.arguments) else kwargs.get("output_mask")
    if not isinstance(mask, (list, tuple)) or len(mask) != 1 + len(layout.params):
        return None
    if _same_dtype_metas(args[: len(op._schema.arguments) - 1]) is None:
        return None
    try:
        normalized_axis(op, args, kwargs)
    except (TypeError, ValueError):
        return None
    if not _parameters_fit(op, args) or not _backward_shapes_fit(op, args):
        return None
    shaped_like = (layout.input, *layout.params)
    metas: list[TensorMeta | None] = []
    for wanted, position in zip(mask, shaped_like):
        source = input_meta(args[position]) if position < len(args) else None
        if not wanted:
            metas.append(None)
        elif source is None:
            return None  # a gradient for an absent weight: torch's own error from the meta run
        else:
            metas.append(contiguous_meta(source.shape, source.dtype))
    return tuple(metas)


NORMALIZATION_RULE = ShardingRule(
    family="layer norm / rms norm",
    one_dim_strategies=_normalization_strategies,
    output_meta=_layer_norm_output_meta,
)

NORMALIZATION_BACKWARD_RULE = ShardingRule(
    family="layer norm / rms norm backward",
    one_dim_strategies=_normalization_backward_strategies,
    output_meta=_normalization_backward_output_meta,
)

register_rule((aten.native_layer_norm.default,), NORMALIZATION_RULE)
register_rule(
    (aten.native_layer_norm_backward.default, aten._fused_rms_norm_backward.default), NORMALIZATION_BACKWARD_RULE
)
