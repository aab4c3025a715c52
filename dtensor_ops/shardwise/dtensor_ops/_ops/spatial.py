"""Ops over trailing spatial dims: pooling, upsampling, padding, convolution, pixel/channel shuffles,
grid sampling, im2col, and the batch / group normalisations.

On one mesh dim:

* pooling, upsampling, reflection/replication/constant padding and their backwards work on the
  last 1, 2 or 3 dims of every tensor argument; the leading (batch, channel) dims may stay sharded,
  alike in every tensor argument (values, indices and gradients), the spatial dims must be whole.
  A window crossing a shard boundary would need its neighbours' rows (a halo): we replicate
  the spatial dims instead, never compute a window from a partial neighbourhood;
* ``convolution``: batch-sharded input with replicated weight and bias gives a batch-sharded
  output; output channels sharded in weight and bias (``groups == 1``) give channel-sharded output;
  input channels sharded in input and weight (``groups == 1``, no bias: a bias would be added once
  per rank) give ``Partial(sum)``; a sharded spatial dim is replicated first (the one spatial shard
  with replicated weight and bias is the halo exchange of ``_handlers/conv_halo.py``, asked first).  Its backward mirrors
  these: batch-sharded gives ``Partial(sum)`` weight and bias gradients, out-channel-sharded a
  ``Partial(sum)`` input gradient, in-channel-sharded a replicated bias gradient;
* ``native_batch_norm`` and friends: channels sharded in the input (dim 1) and in every per-channel
  vector; in evaluation mode (``training=False``) any other input dim may be sharded with replicated
  vectors.  Training statistics over a sharded batch or spatial dim would need a reduction across
  ranks, so those dims are replicated;
* ``native_group_norm`` (and backward): the batch dim may be sharded (statistics are per sample),
  the local call gets the local batch size;
* ``pixel_shuffle``/``pixel_unshuffle`` keep dims before the last three, ``channel_shuffle`` every
  dim but the channels, ``im2col`` the batch, ``grid_sampler`` the batch (with the grid) or the
  channels (grid replicated).

Kernels of this family reject an empty input (a rank holding an empty piece of an uneven shard)
even where the global tensor is not empty: such a rank makes its empty outputs itself
(``EmptyPieceResult``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta

from .._rules import ArgPosition, OneDimStrategy, OpCall, ShardingRule, aten_overloads, register_rule
from ._aligned import (
    aligned_strategy,
    argument_location,
    empty_piece_kernel,
    outputs_on,
    pieces_nonempty,
    replicated_strategy,
)

__all__ = [
    "BATCH_NORM_BACKWARD_RULE",
    "BATCH_NORM_RULE",
    "CONVOLUTION_BACKWARD_RULE",
    "CONVOLUTION_RULE",
    "GROUP_NORM_BACKWARD_RULE",
    "GROUP_NORM_RULE",
    "SPATIAL_RULE",
]

aten = torch.ops.aten

# ----------------------------------------------------------------------------- leading-dim ops

# op name -> how many trailing dims are spatial
_SPATIAL_DIMS: dict[str, int] = {}
for _k, _names in (
    (1, ("upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_linear1d", "reflection_pad1d",
         "replication_pad1d")),
    (2, ("max_pool2d_with_indices", "avg_pool2d", "_adaptive_avg_pool2d", "adaptive_max_pool2d",
         "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
         "upsample_bicubic2d", "_upsample_bicubic2d_aa", "reflection_pad2d", "replication_pad2d", "max_unpool2d")),
    (3, ("max_pool3d_with_indices", "avg_pool3d", "_adaptive_avg_pool3d", "adaptive_max_pool3d",
         "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_trilinear3d", "reflection_pad3d",
         "replication_pad3d", "max_unpool3d")),
):  # fmt: skip
    for _name in _names:
        _SPATIAL_DIMS[_name] = _k
        _SPATIAL_DIMS[_name + "_backward"] = _k

_UPSAMPLE_BACKWARDS = frozenset(name + "_backward" for name in _SPATIAL_DIMS if "upsample" in name)


def _spatial_dims(call: OpCall) -> int:
    name = call.op._schema.name.removeprefix("aten::")
    if name == "constant_pad_nd":
        pad = call.arg(1, "pad")
        assert isinstance(pad, (list, tuple))
        return len(pad) // 2
    return _SPATIAL_DIMS[name]


def _spatial_strategies(call: OpCall) -> list[OneDimStrategy]:
    spatial = _spatial_dims(call)
    ndims = [len(call.input_shape(index)) for index in range(len(call.input_specs))]
    leading = min(ndim - spatial for ndim in ndims)
    output_ndims = [None if meta is None else len(meta.shape) for meta in call.output_metas]
    strategies = []
    for dim in range(max(leading, 0)):
        # every tensor argument has the same leading dims (values, indices, gradients)
        if any(call.input_shape(index)[dim] != call.input_shape(0)[dim] for index in range(len(ndims))):
            continue
        strategies.append(aligned_strategy(call, (dim,) * len(ndims), tuple(dim for _ in output_ndims)))
    strategies.extend(_pad_partial_strategies(call))
    strategies.append(replicated_strategy(call))
    return strategies


def _pad_partial_strategies(call: OpCall) -> list[OneDimStrategy]:
    """``constant_pad_nd`` of a pending reduction, where padding each contribution pads the result:
    sum with a zero pad (the pads add up to zero), avg, max and min with any pad value (v reduces to v)."""
    if call.op._schema.name != "aten::constant_pad_nd":
        return []
    value = call.arg(2, "value", 0)
    strategies = []
    for reduce_op in sorted(call.partial_reduce_ops):
        if reduce_op in ("avg", "max", "min") or (reduce_op == "sum" and value == 0):
            strategies.append(OneDimStrategy((Partial(reduce_op),), (Partial(reduce_op),)))
    return strategies


def _spatial_overrides(
    call: OpCall, outputs: tuple[DTensorSpec[Any] | None, ...]
) -> tuple[tuple[ArgPosition, object], ...]:
    """The upsample backwards take the input's global size: the local call needs the local one."""
    if call.op._schema.name.removeprefix("aten::") not in _UPSAMPLE_BACKWARDS or outputs[0] is None:
        return ()
    return ((argument_location(call, 2, "input_size"), list(outputs[0].local_shape())),)


SPATIAL_RULE = ShardingRule(
    family="pooling/upsampling/padding",
    one_dim_strategies=_spatial_strategies,
    local_arg_overrides=_spatial_overrides,
    local_kernel=empty_piece_kernel,
)

_SPATIAL_OPS = [
    op
    for op in aten_overloads(sorted(_SPATIAL_DIMS), with_inplace=False)
    if not op._schema.name.endswith("_backward") or op._overloadname in ("default", "grad_input")
]
_SPATIAL_OPS.append(aten.constant_pad_nd.default)
_SPATIAL_OPS.append(aten.constant_pad_nd.out)


# ------------------------------------------------------------------------------ other layouts


def _kept_dims_strategies(call: OpCall, free: range | list[int]) -> list[OneDimStrategy]:
    strategies = [aligned_strategy(call, (dim,), (dim,) * len(call.output_metas)) for dim in free]
    strategies.append(replicated_strategy(call))
    return strategies


def _pixel_shuffle_strategies(call: OpCall) -> list[OneDimStrategy]:
    return _kept_dims_strategies(call, range(max(len(call.input_shape(0)) - 3, 0)))


def _channel_shuffle_strategies(call: OpCall) -> list[OneDimStrategy]:
    return _kept_dims_strategies(call, [dim for dim in range(len(call.input_shape(0))) if dim != 1])


def _im2col_strategies(call: OpCall) -> list[OneDimStrategy]:
    # im2col takes (N, C, H, W) or (C, H, W); col2im (N, C*k*k, L) or (C*k*k, L)
    batched = len(call.input_shape(0)) == (4 if call.op._schema.name == "aten::im2col" else 3)
    return _kept_dims_strategies(call, [0] if batched else [])


def _grid_sampler_strategies(call: OpCall) -> list[OneDimStrategy]:
    return [
        aligned_strategy(call, (0, 0), (0,)),
        aligned_strategy(call, (1, None), (1,)),
        replicated_strategy(call),
    ]


LAYOUT_KEEPING_RULES = {
    "pixel shuffle": (_pixel_shuffle_strategies, (aten.pixel_shuffle, aten.pixel_unshuffle)),
    "channel shuffle": (_channel_shuffle_strategies, (aten.channel_shuffle,)),
    "im2col": (_im2col_strategies, (aten.im2col, aten.col2im)),
    "grid sampler": (_grid_sampler_strategies, (aten.grid_sampler_2d, aten.grid_sampler_3d)),
}


# -------------------------------------------------------------------------------- convolution


def _conv_layout(call: OpCall) -> tuple[bool, bool, int, bool]:
    """(batched, transposed, groups, has bias) of a convolution call."""
    batched = len(call.input_shape(0)) == len(call.input_shape(1))
    transposed = bool(call.arg(6, "transposed", False))
    groups = call.arg(8, "groups", 1)
    assert isinstance(groups, int)
    has_bias = call.input_index_at(2) is not None
    return batched, transposed, groups, has_bias


def _convolution_strategies(call: OpCall) -> list[OneDimStrategy]:
    batched, transposed, groups, has_bias = _conv_layout(call)
    channel = 1 if batched else 0

    def inputs(x: Placement, w: Placement, b: Placement) -> tuple[Placement, ...]:
        return (x, w, b) if has_bias else (x, w)

    strategies = []
    if batched:
        strategies.append(OneDimStrategy((Shard(0),), inputs(Shard(0), Replicate(), Replicate())))
    if groups == 1:
        out_channel_dim = 1 if transposed else 0
        in_channel_dim = 0 if transposed else 1
        strategies.append(OneDimStrategy((Shard(channel),), inputs(Replicate(), Shard(out_channel_dim), Shard(0))))
        if not has_bias:
            strategies.append(OneDimStrategy((Partial("sum"),), inputs(Shard(channel), Shard(in_channel_dim), Replicate())))
    if not has_bias:
        for reduce_op in call.linear_reduce_ops():
            strategies.append(OneDimStrategy((Partial(reduce_op),), inputs(Partial(reduce_op), Replicate(), Replicate())))
            strategies.append(OneDimStrategy((Partial(reduce_op),), inputs(Replicate(), Partial(reduce_op), Replicate())))
    strategies.append(OneDimStrategy((Replicate(),), inputs(Replicate(), Replicate(), Replicate())))
    return strategies


CONVOLUTION_RULE = ShardingRule(
    family="convolution", one_dim_strategies=_convolution_strategies, local_kernel=empty_piece_kernel
)


def _conv_backward_layout(call: OpCall) -> tuple[bool, bool, int]:
    batched = len(call.input_shape(1)) == len(call.input_shape(2))
    transposed = bool(call.arg(7, "transposed", False))
    groups = call.arg(9, "groups", 1)
    assert isinstance(groups, int)
    return batched, transposed, groups


def _convolution_backward_strategies(call: OpCall) -> list[OneDimStrategy]:
    """(grad_output, input, weight) -> (grad_input, grad_weight, grad_bias); masked-out outputs are None."""
    batched, transposed, groups = _conv_backward_layout(call)
    channel = 1 if batched else 0
    metas = call.output_metas

    def strategy(outputs: tuple[Placement, Placement, Placement], inputs: tuple[Placement, ...]) -> OneDimStrategy:
        return OneDimStrategy(tuple(None if meta is None else p for meta, p in zip(metas, outputs)), inputs)

    strategies = []
    if batched:
        strategies.append(
            strategy((Shard(0), Partial("sum"), Partial("sum")), (Shard(0), Shard(0), Replicate()))
        )
    if groups == 1:
        out_channel_dim = 1 if transposed else 0
        in_channel_dim = 0 if transposed else 1
        strategies.append(
            strategy(
                (Partial("sum"), Shard(out_channel_dim), Shard(0)),
                (Shard(channel), Replicate(), Shard(out_channel_dim)),
            )
        )
        strategies.append(
            strategy((Shard(channel), Shard(in_channel_dim), Replicate()), (Replicate(), Shard(channel), Shard(in_channel_dim)))
        )
    strategies.append(strategy((Replicate(), Replicate(), Replicate()), (Replicate(),) * 3))
    return strategies


def _convolution_backward_overrides(
    call: OpCall, outputs: tuple[DTensorSpec[Any] | None, ...]
) -> tuple[tuple[ArgPosition, object], ...]:
    """``bias_sizes`` is the global bias size; with sharded output channels the local bias is a piece."""
    bias_sizes = call.arg(3, "bias_sizes")
    if bias_sizes is None or len(outputs) < 3 or outputs[2] is None:
        return ()
    local = list(outputs[2].local_shape())
    if list(bias_sizes) == local:  # type: ignore[call-overload]
        return ()
    return ((argument_location(call, 3, "bias_sizes"), local),)


CONVOLUTION_BACKWARD_RULE = ShardingRule(
    family="convolution backward",
    one_dim_strategies=_convolution_backward_strategies,
    # a rank with an empty piece cannot make up a replicated bias gradient: no empty pieces here
    is_valid=pieces_nonempty,
    local_arg_overrides=_convolution_backward_overrides,
    local_kernel=empty_piece_kernel,
)


# ------------------------------------------------------------------------------ normalisation

# op -> (positions of per-channel vector arguments, position of the training flag or None (always training),
#        whether it is a backward)
_BATCH_NORMS: dict[torch._ops.OpOverload, tuple[tuple[int, ...], int | None]] = {
    aten.native_batch_norm.default: ((1, 2, 3, 4), 5),
    aten._native_batch_norm_legit.default: ((1, 2, 3, 4), 5),
    aten._native_batch_norm_legit.no_stats: ((1, 2), 3),
    aten._native_batch_norm_legit_no_training.default: ((1, 2, 3, 4), -1),
    aten._batch_norm_with_update.default: ((1, 2, 3, 4), None),
    aten._batch_norm_no_update.default: ((1, 2, 3, 4), -1),
}


def _batch_norm_strategies(call: OpCall) -> list[OneDimStrategy]:
    vectors, training_at = _BATCH_NORMS[call.op]
    if training_at is None:
        training = True
    elif training_at < 0:
        training = False
    else:
        training = bool(call.arg(training_at, "training"))
    ndim = len(call.input_shape(0))
    num_inputs = len(call.input_specs)
    vector_inputs = {call.input_index_at(position) for position in vectors} - {None}
    num_outputs = len(call.output_metas)
    strategies = []
    if ndim >= 2:
        inputs: tuple[Placement, ...] = tuple(
            Shard(0) if index in vector_inputs else Shard(1) for index in range(num_inputs)
        )
        outputs: list[Placement] = [Shard(1)]
        outputs += [Shard(0)] * min(2, num_outputs - 1)
        outputs += [Replicate()] * (num_outputs - len(outputs))
        strategies.append(OneDimStrategy(tuple(outputs), inputs))
    if not training:
        for dim in range(ndim):
            if dim == 1:
                continue
            inputs = tuple(Replicate() if index in vector_inputs else Shard(dim) for index in range(num_inputs))
            strategies.append(OneDimStrategy((Shard(dim),) + (Replicate(),) * (num_outputs - 1), inputs))
    strategies.append(OneDimStrategy((Replicate(),) * num_outputs, (Replicate(),) * num_inputs))
    return strategies


def _is_training(op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]) -> bool:
    _, training_at = _BATCH_NORMS[op]
    if training_at is None:
        return True
    if training_at < 0:
        return False
    value = args[training_at] if training_at < len(args) else kwargs.get("training", False)
    return bool(value)


def _batch_norm_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | tuple[TensorMeta | None, ...] | None:
    """The meta kernels give the saved mean / invstd of evaluation mode the channel count, but the CPU
    and CUDA kernels return them empty: the specs must say what the local kernels return."""
    metas = outputs_on(op, args, kwargs, "meta")
    if metas is None or isinstance(metas, TensorMeta) or _is_training(op, args, kwargs):
        return metas
    outputs: list[TensorMeta | None] = list(metas)
    for index in (1, 2):
        meta = outputs[index]
        if meta is not None:
            outputs[index] = TensorMeta(torch.Size([0]), (1,), meta.dtype)
    return tuple(outputs)


BATCH_NORM_RULE = ShardingRule(
    family="batch norm",
    one_dim_strategies=_batch_norm_strategies,
    output_meta=_batch_norm_output_meta,
    local_kernel=empty_piece_kernel,
)


def _batch_norm_backward_strategies(call: OpCall) -> list[OneDimStrategy]:
    """native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean,
    save_invstd, train, eps, output_mask): channels sharded everywhere, or everything replicated."""
    num_inputs = len(call.input_specs)
    image_inputs = {call.input_index_at(0), call.input_index_at(1)}
    inputs = tuple(Shard(1) if index in image_inputs else Shard(0) for index in range(num_inputs))
    metas = call.output_metas
    channel = tuple(None if meta is None else p for meta, p in zip(metas, (Shard(1), Shard(0), Shard(0))))
    replicated = tuple(None if meta is None else Replicate() for meta in metas)
    strategies = []
    if len(call.input_shape(0)) >= 2:
        strategies.append(OneDimStrategy(channel, inputs))
    strategies.append(OneDimStrategy(replicated, (Replicate(),) * num_inputs))
    return strategies


BATCH_NORM_BACKWARD_RULE = ShardingRule(
    family="batch norm backward", one_dim_strategies=_batch_norm_backward_strategies, local_kernel=empty_piece_kernel
)


def _group_norm_strategies(call: OpCall) -> list[OneDimStrategy]:
    """native_group_norm(input, weight, bias, N, C, HxW, group, eps) -> (out, mean, rstd)."""
    num_inputs = len(call.input_specs)
    inputs = tuple(Shard(0) if index == 0 else Replicate() for index in range(num_inputs))
    return [
        OneDimStrategy((Shard(0), Shard(0), Shard(0)), inputs),
        OneDimStrategy((Replicate(),) * 3, (Replicate(),) * num_inputs),
    ]


def _group_norm_backward_strategies(call: OpCall) -> list[OneDimStrategy]:
    """native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask)."""
    per_sample = {call.input_index_at(position) for position in (0, 1, 2, 3)} - {None}
    num_inputs = len(call.input_specs)
    inputs = tuple(Shard(0) if index in per_sample else Replicate() for index in range(num_inputs))
    metas = call.output_metas
    batch = tuple(None if meta is None else p for meta, p in zip(metas, (Shard(0), Partial("sum"), Partial("sum"))))
    replicated = tuple(None if meta is None else Replicate() for meta in metas)
    return [OneDimStrategy(batch, inputs), OneDimStrategy(replicated, (Replicate(),) * num_inputs)]


@dataclass(frozen=True)
class _LocalBatchSize:
    """Overrides the ``N`` argument (at ``position``) with the local batch size of the first output."""

    position: int

    def __call__(
        self, call: OpCall, outputs: tuple[DTensorSpec[Any] | None, ...]
    ) -> tuple[tuple[ArgPosition, object], ...]:
        first = next((spec for spec in outputs if spec is not None), None)
        if first is None:
            return ()
        return ((argument_location(call, self.position, "N"), first.local_shape()[0]),)


GROUP_NORM_RULE = ShardingRule(
    family="group norm",
    one_dim_strategies=_group_norm_strategies,
    local_arg_overrides=_LocalBatchSize(3),
    local_kernel=empty_piece_kernel,
)
GROUP_NORM_BACKWARD_RULE = ShardingRule(
    family="group norm backward",
    one_dim_strategies=_group_norm_backward_strategies,
    local_arg_overrides=_LocalBatchSize(5),
    local_kernel=empty_piece_kernel,
)


register_rule(_SPATIAL_OPS, SPATIAL_RULE)
for _family, (_strategies, _packets) in LAYOUT_KEEPING_RULES.items():
    register_rule(
        [getattr(packet, name) for packet in _packets for name in packet.overloads()],
        ShardingRule(family=_family, one_dim_strategies=_strategies, local_kernel=empty_piece_kernel),
    )
register_rule((aten.convolution.default, aten.convolution.out), CONVOLUTION_RULE)
register_rule((aten.convolution_backward.default,), CONVOLUTION_BACKWARD_RULE)
register_rule(tuple(_BATCH_NORMS), BATCH_NORM_RULE)
register_rule((aten.native_batch_norm_backward.default,), BATCH_NORM_BACKWARD_RULE)
register_rule((aten.native_group_norm.default,), GROUP_NORM_RULE)
register_rule((aten.native_group_norm_backward.default,), GROUP_NORM_BACKWARD_RULE)
