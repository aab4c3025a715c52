"""Attention: the kernels of ``scaled_dot_product_attention``, forward and backward.

CPU: the flash kernel below. CUDA: flash, memory-efficient and cuDNN attention (the section
"CUDA kernels" at the end), cut by batch or heads.

On CPU, ``F.scaled_dot_product_attention`` runs
``aten._scaled_dot_product_flash_attention_for_cpu`` (and its ``_backward``)
whenever that kernel accepts the call (4-D inputs, no dropout, no mask that needs
a gradient, ...); otherwise it decomposes into matrix products and softmax
(``_scaled_dot_product_attention_math`` is a composite op) handled by those ops'
rules; with ``is_causal`` that decomposition builds its mask as a plain tensor,
which DTensor accepts only under ``implicit_replication()``.  PyTorch's DTensor
has no rule for the CPU kernel; here it has one.

Inputs are ``(batch, heads, seq, head_dim)``; every (batch, head) pair is an
independent attention problem, and so is every query row.  On one mesh dim:

* batch sharded: query, key, value (and the mask where it has a batch extent)
  sharded on dim 0 -> output and logsumexp sharded on dim 0;
* heads sharded (tensor parallelism: q/k/v come out of column-wise linears):
  dim 1 of all of them -> output and logsumexp on dim 1.  With grouped key/value
  heads (fewer kv heads than query heads) the shards only line up when both head
  counts divide evenly over the mesh dims cutting them;
* query rows sharded, key and value replicated (not with ``is_causal``: the
  kernel aligns its causal mask with the local rows, which would shift it) ->
  output and logsumexp sharded on the query dim; in the backward the key/value
  gradients are then partial sums over the query shards (``Partial(sum)``);
* everything replicated.

The mask (an additive float mask or a bool one, broadcast to
``(batch, heads, q_seq, kv_seq)``) follows the output's cut where it has that
extent and is replicated where it is broadcast.

Uneven cuts leave some ranks with no heads or no query rows.  The CPU kernel
divides by those extents (the process dies of a floating point exception), so a
rank whose shard is empty runs a local kernel that makes the (empty or zero)
results itself: :class:`EmptyShardFlashAttention` and its backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, TypeVar

import torch

from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta

from ._shapes import broadcast_shapes, contiguous_strides, input_meta
from .._rules import (
    OneDimStrategy,
    OpCall,
    PlacementsPerTensor,
    ShardingRule,
    StrategiesFn,
    broadcast_input_placement,
    register_rule,
)

__all__ = [
    "EmptyShardFlashAttention",
    "EmptyShardFlashAttentionBackward",
    "FLASH_ATTENTION_BACKWARD_RULE",
    "FLASH_ATTENTION_RULE",
]

aten = torch.ops.aten
_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_Kernel = TypeVar("_Kernel")

_BATCH_DIM, _HEAD_DIM, _QUERY_DIM = 0, 1, 2
_CUTS = (_BATCH_DIM, _HEAD_DIM, _QUERY_DIM)


class _Layout:
    """Where the tensors of one attention call sit among the rule inputs, and their shapes."""

    def __init__(self, call: OpCall, query_position: int, is_causal_position: int) -> None:
        # Rule input indices of query, key and value.
        self.qkv = tuple(
            self._index(call, query_position + offset, name) for offset, name in enumerate(("query", "key", "value"))
        )
        self.query = call.input_shape(self.qkv[0])
        self.key = call.input_shape(self.qkv[1])
        self.mask_index = call.input_index_at("attn_mask")
        self.mask = None if self.mask_index is None else call.input_shape(self.mask_index)
        # The shape every score (and the mask) is broadcast to.
        self.scores = (self.query[0], self.query[1], self.query[2], self.key[2])
        self.is_causal = bool(call.arg(is_causal_position, "is_causal", False))

    @staticmethod
    def _index(call: OpCall, position: int, name: str) -> int:
        index = call.input_index_at(position)
        if index is None:
            raise TypeError(f"{call.op}: {name} must be a DTensor when attention runs on DTensors")
        return index

    def mask_placement(self, cut: int) -> Placement:
        assert self.mask is not None
        return broadcast_input_placement(self.scores, self.mask, cut)

    def cuts(self) -> tuple[int, ...]:
        return _CUTS if not self.is_causal else (_BATCH_DIM, _HEAD_DIM)


def _grouped_heads_line_up(call: OpCall, layout: _Layout, inputs: PlacementsPerTensor) -> bool:
    """With fewer key/value heads than query heads, each rank's query heads must map onto its kv heads."""
    return _heads_line_up(call, layout.query[1], layout.key[1], inputs[layout.qkv[0]])


def _heads_line_up(call: OpCall, query_heads: int, kv_heads: int, query_placements: Sequence[Placement]) -> bool:
    if query_heads == kv_heads:
        return True  # identical chunking of identical extents
    mesh_shape = tuple(call.mesh.shape)
    shards = math.prod(
        mesh_shape[mesh_dim] for mesh_dim, placement in enumerate(query_placements) if placement == Shard(_HEAD_DIM)
    )
    return query_heads % shards == 0 and kv_heads % shards == 0


def _logsumexp_dtype(dtype: torch.dtype) -> torch.dtype:
    # Reduced-precision inputs keep their logsumexp in float32.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _sequence_major_zeros(shape: Sequence[int], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Zeros of a (batch, heads, seq, ...) shape stored (batch, seq, heads, ...), as the kernel stores its results."""
    stored = (shape[0], shape[2], shape[1], *shape[3:])
    return like.new_zeros(stored, dtype=dtype or like.dtype).transpose(1, 2)


def _empty_shard_kernel(call: OpCall, inputs: PlacementsPerTensor, layout: _Layout, kernel: _Kernel) -> _Kernel | None:
    """``kernel`` when this rank's shard of q, k or v is empty (and the global tensor is not), else None."""
    for index in layout.qkv:
        spec: DTensorSpec[Any] = call.input_specs[index]
        if 0 not in spec.shape and 0 in spec.with_placements(inputs[index]).local_shape():
            return kernel
    return None


# ------------------------------------------------------------------------------------------------- forward


@dataclass(frozen=True)
class EmptyShardFlashAttention:
    """The CPU flash kernel on a rank whose q/k/v shard may be empty: empty inputs give empty results here."""

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        *,
        attn_mask: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if query.numel() and key.numel() and value.numel():
            output, logsumexp = _FLASH(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
            return output, logsumexp
        output = _sequence_major_zeros((*query.shape[:-1], value.shape[-1]), query)
        logsumexp = _sequence_major_zeros(query.shape[:3], query, _logsumexp_dtype(query.dtype))
        return output, logsumexp


def _flash_attention_kernel(
    call: OpCall, inputs: PlacementsPerTensor, outputs: tuple[DTensorSpec[Any] | None, ...]
) -> EmptyShardFlashAttention | None:
    return _empty_shard_kernel(call, inputs, _Layout(call, 0, 4), EmptyShardFlashAttention())



def flash_attention_strategies(call: OpCall) -> list[OneDimStrategy]:
    layout = _Layout(call, 0, 4)
    strategies: list[OneDimStrategy] = []
    for cut in layout.cuts():
        inputs: list[Placement] = [Shard(cut), Shard(cut), Shard(cut)]
        if cut == _QUERY_DIM:
            inputs[1] = inputs[2] = Replicate()  # every query row needs all keys and values
        if layout.mask_index is not None:
            inputs.insert(layout.mask_index, layout.mask_placement(cut))
        strategies.append(OneDimStrategy((Shard(cut), Shard(cut)), tuple(inputs)))
    replicated = (Replicate(),) * len(call.input_specs)
    strategies.append(OneDimStrategy((Replicate(), Replicate()), replicated))
    return strategies


def _flash_attention_is_valid(
    call: OpCall, inputs: PlacementsPerTensor, outputs: tuple[tuple[Placement, ...] | None, ...]
) -> bool:
    return _grouped_heads_line_up(call, _Layout(call, 0, 4), inputs)


def _dense_strides_like(meta: TensorMeta) -> tuple[int, ...] | None:
    """Strides ``empty_like`` gives a tensor laid out as ``meta``: its own when dense in some dim order.

    None when unsure (size-1 dims, where torch breaks stride ties its own way, or gaps/overlaps).
    """
    shape, strides = tuple(meta.shape), tuple(meta.stride)
    if strides == contiguous_strides(shape):
        return strides
    if 1 in shape or 0 in shape:
        return None
    expected = 1
    for dim in sorted(range(len(shape)), key=lambda d: strides[d]):
        if strides[dim] != expected:
            return None
        expected *= shape[dim]
    return strides


def _sequence_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Strides of a (batch, heads, seq, ...) tensor stored as (batch, seq, heads, ...): the kernel's own layout."""
    permuted = contiguous_strides((shape[0], shape[2], shape[1], *shape[3:]))
    return (permuted[0], permuted[2], permuted[1], *permuted[3:])


def flash_attention_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> tuple[TensorMeta | None, ...] | None:
    """Output laid out like the query (``empty_like``); logsumexp ``(batch, heads, seq)`` stored seq-major."""
    if len(args) < 3:
        return None
    query, key, value = (input_meta(arg) for arg in args[:3])
    if query is None or key is None or value is None or not query.dtype.is_floating_point:
        return None
    if not (len(query.shape) == len(key.shape) == len(value.shape) == 4):
        return None  # the meta run raises the kernel's own error
    if query.shape[-1] != key.shape[-1] or key.shape[-1] != value.shape[-1] or key.shape[:3] != value.shape[:3]:
        return None
    if query.shape[0] != key.shape[0] or query.shape[1] % max(key.shape[1], 1) != 0:
        return None
    mask = kwargs.get("attn_mask")
    if mask is not None:
        mask_meta = input_meta(mask)
        scores = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        if mask_meta is None or broadcast_shapes(mask_meta.shape, scores) != torch.Size(scores):
            return None
    strides = _dense_strides_like(query)
    if strides is None:
        return None
    output = TensorMeta(query.shape, strides, query.dtype)
    lse_shape = tuple(query.shape[:3])
    logsumexp = TensorMeta(torch.Size(lse_shape), _sequence_major_strides(lse_shape), _logsumexp_dtype(query.dtype))
    return output, logsumexp


FLASH_ATTENTION_RULE = ShardingRule(
    family="flash_attention",
    one_dim_strategies=flash_attention_strategies,
    is_valid=_flash_attention_is_valid,
    output_meta=flash_attention_output_meta,
    local_kernel=_flash_attention_kernel,
)


# ------------------------------------------------------------------------------------------------ backward


@dataclass(frozen=True)
class EmptyShardFlashAttentionBackward:
    """The CPU flash backward on a rank whose q/k/v shard may be empty: zero (or empty) gradients made here.

    With query rows sharded, a rank without rows still holds all keys and values: its share of their
    (partial) gradients is zero.
    """

    def __call__(
        self,
        grad_out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        logsumexp: torch.Tensor,
        dropout_p: float,
        is_causal: bool,
        *,
        attn_mask: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if query.numel() and key.numel() and value.numel():
            grad_query, grad_key, grad_value = _FLASH_BACKWARD(
                grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )
            return grad_query, grad_key, grad_value
        return (
            _sequence_major_zeros(query.shape, query),
            _sequence_major_zeros(key.shape, key),
            _sequence_major_zeros(value.shape, value),
        )


def _flash_attention_backward_kernel(
    call: OpCall, inputs: PlacementsPerTensor, outputs: tuple[DTensorSpec[Any] | None, ...]
) -> EmptyShardFlashAttentionBackward | None:
    return _empty_shard_kernel(call, inputs, _Layout(call, 1, 7), EmptyShardFlashAttentionBackward())



def flash_attention_backward_strategies(call: OpCall) -> list[OneDimStrategy]:
    layout = _Layout(call, 1, 7)
    strategies: list[OneDimStrategy] = []
    for cut in layout.cuts():
        # grad_out, query, key, value, out, logsumexp (all of them cut alike, logsumexp has no head_dim)
        inputs: list[Placement] = [Shard(cut)] * 6
        outputs: tuple[Placement, ...] = (Shard(cut),) * 3
        if cut == _QUERY_DIM:
            inputs[2] = inputs[3] = Replicate()
            # Each rank's query rows contribute their share of every key/value gradient.
            outputs = (Shard(cut), Partial("sum"), Partial("sum"))
        if layout.mask_index is not None:
            inputs.insert(layout.mask_index, layout.mask_placement(cut))
        strategies.append(OneDimStrategy(outputs, tuple(inputs)))
    replicated = (Replicate(),) * len(call.input_specs)
    strategies.append(OneDimStrategy((Replicate(),) * 3, replicated))
    return strategies


def _flash_attention_backward_is_valid(
    call: OpCall, inputs: PlacementsPerTensor, outputs: tuple[tuple[Placement, ...] | None, ...]
) -> bool:
    return _grouped_heads_line_up(call, _Layout(call, 1, 7), inputs)


def flash_attention_backward_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> tuple[TensorMeta | None, ...] | None:
    """Gradients shaped like query, key and value, each stored seq-major as the kernel allocates them."""
    if len(args) < 4:
        return None
    metas = [input_meta(arg) for arg in args[1:4]]
    result: list[TensorMeta | None] = []
    for meta in metas:
        if meta is None or len(meta.shape) != 4 or not meta.dtype.is_floating_point:
            return None
        result.append(TensorMeta(meta.shape, _sequence_major_strides(meta.shape), meta.dtype))
    return tuple(result)


FLASH_ATTENTION_BACKWARD_RULE = ShardingRule(
    family="flash_attention_backward",
    one_dim_strategies=flash_attention_backward_strategies,
    is_valid=_flash_attention_backward_is_valid,
    output_meta=flash_attention_backward_output_meta,
    local_kernel=_flash_attention_backward_kernel,
)

register_rule([_FLASH], FLASH_ATTENTION_RULE)
register_rule([_FLASH_BACKWARD], FLASH_ATTENTION_BACKWARD_RULE)


# ------------------------------------------------------------------------------------------- CUDA kernels
#
# ``F.scaled_dot_product_attention`` on CUDA runs one of three fused kernels (flash, memory-efficient,
# cuDNN), each with its backward. Every (batch, head) pair is an independent problem for them too, so
# they are cut by batch or by heads (tensor parallelism); the query rows are not cut (the memory-efficient
# kernel pads its logsumexp's row dim to a multiple of 32, and a causal mask would shift). Their
# bookkeeping results (sequence offsets, the RNG seed and offset that dropout used) are per call, not per
# row: replicated. Output metadata comes from torch's meta kernels. Found missing by the first GPU run
# (an H200): before, a TP model on CUDA stopped at "no sharding rule for _scaled_dot_product_*".


@dataclass(frozen=True)
class _FusedAttentionRoles:
    """Which arguments and results of one CUDA attention kernel follow the batch/head cut."""

    cut_arguments: tuple[str, ...]  # (batch, heads, ...) tensors: q, k, v, and grad_out, out, logsumexp
    bias_argument: str | None  # the additive (or bool) mask, broadcast to (batch, heads, q_seq, kv_seq)
    cut_results: tuple[int, ...]  # the results cut alike (output and logsumexp, or the gradients)
    bias_result: int | None = None  # the bias gradient, laid out like the bias


def _rule_input_named(call: OpCall, name: str) -> int | None:
    """Which rule input is the schema argument ``name``, passed by position or keyword (None: no DTensor)."""
    position = [argument.name for argument in call.op._schema.arguments].index(name)
    index = call.input_index_at(position)
    return index if index is not None else call.input_index_at(name)


def _fused_attention_strategies(roles: _FusedAttentionRoles) -> StrategiesFn:
    def strategies(call: OpCall) -> list[OneDimStrategy]:
        def rule_input(name: str) -> int | None:
            return _rule_input_named(call, name)

        query, key = rule_input("query"), rule_input("key")
        if query is None or key is None:
            raise TypeError(f"{call.op}: query and key must be DTensors when attention runs on DTensors")
        query_shape, key_shape = call.input_shape(query), call.input_shape(key)
        scores = (query_shape[0], query_shape[1], query_shape[2], key_shape[2])
        bias = None if roles.bias_argument is None else rule_input(roles.bias_argument)
        result: list[OneDimStrategy] = []
        for cut in (_BATCH_DIM, _HEAD_DIM):
            inputs: list[Placement] = [Replicate()] * len(call.input_specs)
            for name in roles.cut_arguments:
                index = rule_input(name)
                if index is not None:
                    inputs[index] = Shard(cut)
            bias_placement = None
            if bias is not None:
                bias_placement = broadcast_input_placement(scores, call.input_shape(bias), cut)
                inputs[bias] = bias_placement
            outputs: list[Placement | None] = []
            for position, meta in enumerate(call.output_metas):
                if meta is None:
                    outputs.append(None)
                elif position in roles.cut_results:
                    outputs.append(Shard(cut))
                elif position == roles.bias_result and bias_placement is not None:
                    outputs.append(bias_placement)
                else:
                    outputs.append(Replicate())
            result.append(OneDimStrategy(tuple(outputs), tuple(inputs)))
        replicated_outputs = tuple(None if meta is None else Replicate() for meta in call.output_metas)
        result.append(OneDimStrategy(replicated_outputs, (Replicate(),) * len(call.input_specs)))
        return result

    return strategies


def _fused_attention_is_valid(
    call: OpCall, inputs: PlacementsPerTensor, outputs: tuple[tuple[Placement, ...] | None, ...]
) -> bool:
    query, key = _rule_input_named(call, "query"), _rule_input_named(call, "key")
    if query is None or key is None:
        return True
    return _heads_line_up(call, call.input_shape(query)[1], call.input_shape(key)[1], inputs[query])


def _register_fused_attention(name: str, roles: _FusedAttentionRoles) -> None:
    op = getattr(aten, name).default
    rule = ShardingRule(family=name.lstrip("_"), one_dim_strategies=_fused_attention_strategies(roles), is_valid=_fused_attention_is_valid)
    register_rule([op], rule)


_FORWARD_ROLES = _FusedAttentionRoles(("query", "key", "value"), None, (0, 1))
_register_fused_attention("_scaled_dot_product_flash_attention", _FORWARD_ROLES)
_register_fused_attention("_scaled_dot_product_efficient_attention", _FusedAttentionRoles(("query", "key", "value"), "attn_bias", (0, 1)))
_register_fused_attention("_scaled_dot_product_cudnn_attention", _FusedAttentionRoles(("query", "key", "value"), "attn_bias", (0, 1)))
_BACKWARD_CUT = ("grad_out", "query", "key", "value", "out", "logsumexp")
_register_fused_attention("_scaled_dot_product_flash_attention_backward", _FusedAttentionRoles(_BACKWARD_CUT, None, (0, 1, 2)))
_register_fused_attention(
    "_scaled_dot_product_efficient_attention_backward",
    _FusedAttentionRoles(("grad_out_", *_BACKWARD_CUT[1:]), "attn_bias", (0, 1, 2), bias_result=3),
)
_register_fused_attention("_scaled_dot_product_cudnn_attention_backward", _FusedAttentionRoles(_BACKWARD_CUT, "attn_bias", (0, 1, 2)))
