"""nn ops: embedding and its backward, nll_loss / nll_loss2d (cross_entropy's loss part) and their backwards.

Activations and their backwards are pointwise (see :mod:`.pointwise`); dropout
belongs to the random ops; log_softmax to the math ops.

Embedding, ``out[..., :] = weight[indices[...], :]``, on one mesh dim:

* table sharded by columns (``weight`` Shard(1)), ids replicated -> output
  sharded on its last dim;
* ids sharded on any dim, table replicated -> output sharded on that dim;
* table sharded by rows (``weight`` Shard(0)), ids replicated -> each rank looks
  up only the ids inside its row range (shifted to local rows; the others give
  zero rows), so the output is ``Partial(sum)``.  The local computation is not the
  plain lookup, so this strategy runs a local kernel
  (:class:`RowShardedEmbeddingLookup`) holding this rank's row range; uneven and
  empty row shards work;
* a partial table passes through (a lookup only moves elements).

Its backward (``embedding_dense_backward``: the gradient rows added up per id)
keeps the gradient sharded by columns, turns ids and gradient sharded on the
same dim into a ``Partial(sum)`` weight gradient (not with
``scale_grad_by_freq``, whose per-id counts must see every id), carries a partial
gradient through, or runs replicated.  A replicated gradient with replicated ids
gives a replicated weight gradient, as PyTorch does: the backward call does not
say how the table was laid out in the forward, and a row-sharded weight gradient
there would cost an all-gather in the optimizer step of every replicated table.

nll_loss (``-weight[t] * input[n, t]``, summed or averaged over the batch, with
``ignore_index``) on one mesh dim:

* batch dims of input and target sharded alike (dim 0; also the spatial dims of
  ``nll_loss2d``), class weights replicated: ``reduction='none'`` stays sharded,
  ``'sum'`` gives ``Partial(sum)`` output and total weight; ``'mean'`` must divide
  by the *global* total weight (ignored targets and class weights make local
  means unequal), which no placement of the local means expresses: the rule
  replicates, and dtensor_ops's nll_loss op handler (``_handlers/nll_loss.py``)
  takes batch-sharded means first, as the ``'sum'`` decision followed by ONE
  reduction of (sum, total weight) and a division;
* a partial input carries through (the loss is linear in it; the total weight
  depends only on targets and class weights, so it is replicated);
* everything replicated.

Class-sharded logits are ``tp_styles.loss_parallel``'s business: here they are
redistributed.  ``nll_loss_backward`` needs the global total weight for
``'mean'`` (replicated), which the forward above provides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta, _MaskPartial

from ._shapes import contiguous_meta, input_meta
from .._rules import OneDimStrategy, OpCall, PlacementsPerTensor, ShardingRule, register_rule

__all__ = [
    "REDUCTION_MEAN",
    "REDUCTION_NONE",
    "REDUCTION_SUM",
    "bound_arguments",
    "nll_loss_batch_dim_pairs",
    "EMBEDDING_BACKWARD_RULE",
    "EMBEDDING_RULE",
    "NLL_LOSS_BACKWARD_RULE",
    "NLL_LOSS_FORWARD_RULE",
    "RowShardedEmbeddingLookup",
]

aten = torch.ops.aten

# at::Reduction
REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = 0, 1, 2
_REDUCTIONS = frozenset({REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM})


def bound_arguments(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    """The op's arguments in schema order, defaults filled in (kernels may be called with keywords)."""
    values: list[Any] = []
    for index, argument in enumerate(op._schema.arguments):
        if index < len(args):
            values.append(args[index])
        elif argument.name in kwargs:
            values.append(kwargs[argument.name])
        elif argument.has_default_value():
            values.append(argument.default_value)
        else:
            raise TypeError(f"{op}: missing argument {argument.name!r}")
    return values


# ----------------------------------------------------------------------------------------------- embedding


def embedding_strategies(call: OpCall) -> list[OneDimStrategy]:
    ids_ndim = len(call.input_shape(1))
    strategies = [OneDimStrategy((Shard(ids_ndim),), (Shard(1), Replicate()))]
    strategies.extend(OneDimStrategy((Shard(dim),), (Replicate(), Shard(dim))) for dim in range(ids_ndim))
    # rows held elsewhere are zeros: a pending sum, which PyTorch names _MaskPartial
    masked = _MaskPartial(offset_shape=torch.Size(call.input_shape(0)), offset_dim=0)
    strategies.append(OneDimStrategy((masked,), (Shard(0), Replicate())))
    strategies.append(OneDimStrategy((Replicate(),), (Replicate(), Replicate())))
    for reduce_op in call.every_reduce_op():
        strategies.append(OneDimStrategy((Partial(reduce_op),), (Partial(reduce_op), Replicate())))
    return strategies


@dataclass(frozen=True)
class RowShardedEmbeddingLookup:
    """``aten.embedding`` on this rank's rows ``[row_start, row_start + local rows)`` of a row-sharded table.

    Ids outside the range give zero rows, so that summing the ranks' results
    (``Partial(sum)``) is the plain lookup: exactly one rank holds each row.
    ``num_rows`` (the whole table) lets every rank reject bad ids as the plain op
    does, instead of silently returning zeros for them.
    """

    row_start: int
    num_rows: int

    def __call__(
        self,
        weight: torch.Tensor,
        indices: torch.Tensor,
        padding_idx: int = -1,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
    ) -> torch.Tensor:
        self._check_ids(indices)
        local_rows = weight.shape[0]
        if local_rows == 0:  # an empty shard (more ranks than rows) holds no id
            return weight.new_zeros((*indices.shape, *weight.shape[1:]))
        local_ids = indices - self.row_start
        outside = (local_ids < 0) | (local_ids >= local_rows)
        # Any valid local row stands in for the ids held elsewhere; their rows are zeroed afterwards
        # (masked_fill rather than a product, so that inf/nan in the stand-in row cannot leak through).
        looked_up = aten.embedding.default(weight, local_ids.masked_fill(outside, 0))
        return looked_up.masked_fill_(outside.unsqueeze(-1), 0)

    def _check_ids(self, indices: torch.Tensor) -> None:
        if indices.numel() == 0:
            return
        in_table = ((indices >= 0) & (indices < self.num_rows)).all()
        message = f"embedding: index out of range in self (ids must lie in [0, {self.num_rows}))"
        # A traced call (torch.compile: fake or functional tensors) cannot read the answer on the host.
        if indices.device.type == "cpu" and type(indices) is torch.Tensor:
            if not bool(in_table):
                raise IndexError(message)
        else:
            torch._assert_async(in_table, message)  # no host sync; a device-side assert as the plain op gives


def _embedding_kernel(
    call: OpCall, inputs: PlacementsPerTensor, outputs: tuple[DTensorSpec[Any] | None, ...]
) -> RowShardedEmbeddingLookup | None:
    weight_placements = inputs[0]
    if not any(placement == Shard(0) for placement in weight_placements):
        return None
    weight_spec = call.input_specs[0].with_placements(weight_placements)
    _, offset = weight_spec.local_shape_and_offset()
    return RowShardedEmbeddingLookup(row_start=offset[0], num_rows=call.input_shape(0)[0])


def embedding_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    """``(*indices.shape, *weight.shape[1:])``, contiguous (the lookup always allocates)."""
    weight = input_meta(args[0]) if args else None
    indices = input_meta(args[1]) if len(args) > 1 else None
    if weight is None or indices is None or len(weight.shape) != 2:
        return None
    if indices.dtype not in (torch.int64, torch.int32):
        return None  # the meta run raises torch's own error
    return contiguous_meta((*indices.shape, weight.shape[1]), weight.dtype)


EMBEDDING_RULE = ShardingRule(
    family="embedding",
    one_dim_strategies=embedding_strategies,
    output_meta=embedding_output_meta,
    local_kernel=_embedding_kernel,
)


def embedding_backward_strategies(call: OpCall) -> list[OneDimStrategy]:
    ids_ndim = len(call.input_shape(1))
    scale_grad_by_freq = bool(call.arg(4, "scale_grad_by_freq", False))
    strategies = [OneDimStrategy((Shard(1),), (Shard(ids_ndim), Replicate()))]
    if not scale_grad_by_freq:
        # Each rank adds up the gradient rows of its own ids; the per-id counts of scale_grad_by_freq
        # would only see those ids.
        strategies.extend(
            OneDimStrategy((Partial("sum"),), (Shard(dim), Shard(dim))) for dim in range(ids_ndim)
        )
    strategies.append(OneDimStrategy((Replicate(),), (Replicate(), Replicate())))
    for reduce_op in call.linear_reduce_ops():
        strategies.append(OneDimStrategy((Partial(reduce_op),), (Partial(reduce_op), Replicate())))
    return strategies


def embedding_backward_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    """``(num_weights, grad.shape[-1])``, contiguous."""
    grad = input_meta(args[0]) if args else None
    num_weights = args[2] if len(args) > 2 else kwargs.get("num_weights")
    if grad is None or not isinstance(num_weights, int) or len(grad.shape) == 0:
        return None
    return contiguous_meta((num_weights, grad.shape[-1]), grad.dtype)


EMBEDDING_BACKWARD_RULE = ShardingRule(
    family="embedding_backward",
    one_dim_strategies=embedding_backward_strategies,
    output_meta=embedding_backward_output_meta,
)

register_rule([aten.embedding.default], EMBEDDING_RULE)
register_rule([aten.embedding_dense_backward.default], EMBEDDING_BACKWARD_RULE)


# ------------------------------------------------------------------------------------------------ nll_loss


def nll_loss_batch_dim_pairs(op: torch._ops.OpOverload, input_ndim: int) -> list[tuple[int, int]]:
    """(input dim, target dim) pairs that index the same samples: dims a batch sharding may cut."""
    if op._schema.name in ("aten::nll_loss2d_forward", "aten::nll_loss2d_backward"):
        # input (N, C, H, W), target (N, H, W)
        return [(0, 0)] + [(dim, dim - 1) for dim in range(2, input_ndim)]
    return [(0, 0)] if input_ndim == 2 else []  # input (N, C) or (C,)


def _int_arg(call: OpCall, index: int, name: str) -> int:
    value = call.arg(index, name)
    if not isinstance(value, int):
        raise TypeError(f"{call.op}: argument {name!r} must be an int, got {value!r}")
    return value


def _with_class_weight(call: OpCall, weight_position: int, placements: list[Placement]) -> tuple[Placement, ...]:
    """Insert the class weight's placement (always Replicate: one entry per class) when it is a DTensor."""
    weight_index = call.input_index_at(weight_position)
    if weight_index is not None:
        placements.insert(weight_index, Replicate())
    return tuple(placements)


def nll_loss_forward_strategies(call: OpCall) -> list[OneDimStrategy]:
    reduction = _int_arg(call, 3, "reduction")
    strategies: list[OneDimStrategy] = []
    for input_dim, target_dim in nll_loss_batch_dim_pairs(call.op, len(call.input_shape(0))):
        inputs = _with_class_weight(call, 2, [Shard(input_dim), Shard(target_dim)])
        if reduction == REDUCTION_NONE:
            outputs: tuple[Placement, Placement] = (Shard(target_dim), Replicate())  # total weight is 0 everywhere
        elif reduction == REDUCTION_SUM:
            outputs = (Partial("sum"), Partial("sum"))
        else:
            continue  # a mean over shards is no placement of local means (see the module docstring)
        strategies.append(OneDimStrategy(outputs, inputs))
    strategies.append(OneDimStrategy((Replicate(), Replicate()), _with_class_weight(call, 2, [Replicate()] * 2)))
    for reduce_op in call.linear_reduce_ops():
        partial = Partial(reduce_op)
        inputs = _with_class_weight(call, 2, [partial, Replicate()])
        strategies.append(OneDimStrategy((partial, Replicate()), inputs))
    return strategies


def nll_loss_forward_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> tuple[TensorMeta | None, ...] | None:
    """(loss: the target's shape for 'none', else a scalar; total weight: a scalar), contiguous, input's dtype."""
    log_probs = input_meta(args[0]) if args else None
    target = input_meta(args[1]) if len(args) > 1 else None
    reduction = args[3] if len(args) > 3 else kwargs.get("reduction")
    if log_probs is None or target is None or reduction not in _REDUCTIONS:
        return None  # the meta run raises torch's own error for bad calls
    if not log_probs.dtype.is_floating_point or target.dtype != torch.int64:
        return None
    if len(log_probs.shape) not in (1, 2, 4) or len(target.shape) != max(len(log_probs.shape) - 1, 0):
        return None  # shape errors: let the meta run raise torch's message
    loss_shape = tuple(target.shape) if reduction == REDUCTION_NONE else ()
    return contiguous_meta(loss_shape, log_probs.dtype), contiguous_meta((), log_probs.dtype)


NLL_LOSS_FORWARD_RULE = ShardingRule(
    family="nll_loss_forward",
    one_dim_strategies=nll_loss_forward_strategies,
    output_meta=nll_loss_forward_output_meta,
)


def nll_loss_backward_strategies(call: OpCall) -> list[OneDimStrategy]:
    reduction = _int_arg(call, 4, "reduction")
    total_weight_index = call.input_index_at(6)
    # 'mean' divides by the total weight: it must be the global one.  Otherwise it is never read.
    if reduction == REDUCTION_MEAN:
        total_weight_options: list[Placement] = [Replicate()]
    else:
        total_weight_options = [Replicate(), *(Partial(op) for op in call.every_reduce_op())]

    def with_weights(placements: list[Placement], total_weight: Placement) -> tuple[Placement, ...]:
        full = list(_with_class_weight(call, 3, placements))
        if total_weight_index is not None:
            full.insert(total_weight_index, total_weight)
        return tuple(full)

    strategies: list[OneDimStrategy] = []
    for total_weight in total_weight_options:
        for input_dim, target_dim in nll_loss_batch_dim_pairs(call.op, len(call.input_shape(1))):
            grad: Placement = Shard(target_dim) if reduction == REDUCTION_NONE else Replicate()
            inputs = with_weights([grad, Shard(input_dim), Shard(target_dim)], total_weight)
            strategies.append(OneDimStrategy((Shard(input_dim),), inputs))
        strategies.append(OneDimStrategy((Replicate(),), with_weights([Replicate()] * 3, total_weight)))
        for reduce_op in call.linear_reduce_ops():
            partial = Partial(reduce_op)
            inputs = with_weights([partial, Replicate(), Replicate()], total_weight)
            strategies.append(OneDimStrategy((partial,), inputs))
    return strategies


def nll_loss_backward_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    """The input's shape and dtype, contiguous (a fresh zero-filled gradient)."""
    log_probs = input_meta(args[1]) if len(args) > 1 else None
    if log_probs is None or len(log_probs.shape) not in (1, 2, 4):
        return None
    return contiguous_meta(log_probs.shape, log_probs.dtype)


NLL_LOSS_BACKWARD_RULE = ShardingRule(
    family="nll_loss_backward",
    one_dim_strategies=nll_loss_backward_strategies,
    output_meta=nll_loss_backward_output_meta,
)

register_rule([aten.nll_loss_forward.default, aten.nll_loss2d_forward.default], NLL_LOSS_FORWARD_RULE)
register_rule([aten.nll_loss_backward.default, aten.nll_loss2d_backward.default], NLL_LOSS_BACKWARD_RULE)
