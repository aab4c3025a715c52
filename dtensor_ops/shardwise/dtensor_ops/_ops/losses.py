"""Elementwise losses: mse, huber, smooth_l1, soft_margin, binary_cross_entropy (with logits), and
their backwards.

Each loss is an elementwise term of broadcast operands followed by ``reduction``:

* ``'none'``: pointwise, every output dim may be sharded (operands sharded alike where they have
  the extent, replicated where they broadcast);
* ``'sum'``: the same shardings give ``Partial(sum)`` (each rank sums its terms);
* ``'mean'``: ``Partial(avg)`` only where every rank averages the same number of terms, i.e. the
  sharded dims divide evenly over the mesh dims cutting them; otherwise the inputs are
  redistributed.  (A per-rank mean of unequal pieces, or of an empty piece, is not the global
  mean: PyTorch's DTensor returns NaN or a wrong value there.)

The backwards are pointwise in (grad_output, self, target, ...) for ``'none'`` and ``'sum'``; for
``'mean'`` they divide by the global element count, which a shard's kernel does not know, so they
run replicated.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from shardwise.placement import Partial, Placement, Shard, TensorMeta

from ._shapes import broadcast_shapes, contiguous_meta, dtype_on_empty_tensors, input_meta
from .._rules import OneDimStrategy, OpCall, PlacementsPerTensor, ShardingRule, broadcast_input_placement, register_rule
from ._aligned import replicated_strategy
from .nn_ops import REDUCTION_MEAN, REDUCTION_NONE
from .pointwise import pointwise_output_meta, pointwise_strategies
from .reduction import schema_argument

__all__ = ["LOSS_BACKWARD_RULE", "LOSS_RULE"]

aten = torch.ops.aten


def _reduction(call: OpCall) -> int:
    value = schema_argument(call.op, call.args, call.kwargs, "reduction", REDUCTION_MEAN)
    assert isinstance(value, int)
    return value


def _operand_shape(call: OpCall) -> torch.Size | None:
    shapes = [call.input_shape(index) for index in range(len(call.input_specs))]
    return broadcast_shapes(*shapes)


def _sharded_term_strategies(call: OpCall, shape: Sequence[int]) -> list[tuple[int, tuple[Placement, ...]]]:
    """(term dim, input placements) for each dim of the broadcast terms that can be sharded."""
    found = []
    in_shapes = [call.input_shape(index) for index in range(len(call.input_specs))]
    for dim in range(len(shape)):
        inputs = tuple(broadcast_input_placement(shape, in_shape, dim) for in_shape in in_shapes)
        if any(isinstance(placement, Shard) for placement in inputs):
            found.append((dim, inputs))
    return found


def _loss_strategies(call: OpCall) -> list[OneDimStrategy]:
    reduction = _reduction(call)
    if reduction == REDUCTION_NONE:
        return pointwise_strategies(call)
    shape = _operand_shape(call)
    strategies = [replicated_strategy(call)]
    if shape is None:
        return strategies
    kind = "avg" if reduction == REDUCTION_MEAN else "sum"
    strategies.extend(OneDimStrategy((Partial(kind),), inputs) for _, inputs in _sharded_term_strategies(call, shape))
    return strategies


def _mean_terms_even(call: OpCall, inputs: PlacementsPerTensor, outputs: tuple[tuple[Placement, ...] | None, ...]) -> bool:
    if _reduction(call) != REDUCTION_MEAN:
        return True
    shape = _operand_shape(call)
    if shape is None:
        return False
    mesh_shape = tuple(call.mesh.shape)
    cuts: dict[int, int] = {}
    for mesh_dim in range(len(mesh_shape)):
        # the term dim this mesh dim shards, read from any input sharded on it (all agree by construction)
        for index, placements in enumerate(inputs):
            placement = placements[mesh_dim]
            if isinstance(placement, Shard):
                term_dim = placement.dim + len(shape) - len(call.input_shape(index))
                cuts[term_dim] = cuts.get(term_dim, 1) * mesh_shape[mesh_dim]
                break
    return all(shape[dim] % count == 0 for dim, count in cuts.items())


def _loss_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    reduction = schema_argument(op, args, kwargs, "reduction", REDUCTION_MEAN)
    if reduction == REDUCTION_NONE:
        return pointwise_output_meta(op, args, kwargs)
    metas = [input_meta(arg) for arg in args]
    if any(meta is not None and len(meta.shape) and 0 in meta.shape for meta in metas):
        return None
    dtype = dtype_on_empty_tensors(op, args, kwargs)
    return None if dtype is None else contiguous_meta((), dtype)


LOSS_RULE = ShardingRule(
    family="elementwise loss",
    one_dim_strategies=_loss_strategies,
    is_valid=_mean_terms_even,
    output_meta=_loss_output_meta,
)


def _loss_backward_strategies(call: OpCall) -> list[OneDimStrategy]:
    if _reduction(call) == REDUCTION_MEAN:
        return [replicated_strategy(call)]
    return pointwise_strategies(call)


LOSS_BACKWARD_RULE = ShardingRule(
    family="elementwise loss backward", one_dim_strategies=_loss_backward_strategies, output_meta=pointwise_output_meta
)

register_rule(
    (
        aten.mse_loss.default, aten.mse_loss.out, aten.huber_loss.default, aten.huber_loss.out,
        aten.smooth_l1_loss.default, aten.smooth_l1_loss.out, aten.soft_margin_loss.default,
        aten.soft_margin_loss.out, aten.binary_cross_entropy.default, aten.binary_cross_entropy.out,
        aten.binary_cross_entropy_with_logits.default, aten.binary_cross_entropy_with_logits.out,
    ),
    LOSS_RULE,
)  # fmt: skip
register_rule(
    (
        aten.mse_loss_backward.default, aten.huber_loss_backward.default, aten.smooth_l1_loss_backward.default,
        aten.soft_margin_loss_backward.default, aten.binary_cross_entropy_backward.default,
    ),
    LOSS_BACKWARD_RULE,
)  # fmt: skip
