"""``nll_loss(2d)_forward`` with ``reduction='mean'`` on batch shards: the exact global mean.

The mean divides by the *global* total weight (ignored targets and class weights make the
ranks' local means unequal), which no placement of local means expresses, so this is an op
handler, not a rule.  It runs the ``'sum'`` decision of the same call (the rule's: batch shards
give ``Partial(sum)`` loss sum and total weight, no communication), stacks (loss sum, total
weight, number of bad targets) into one 3-element Partial tensor, reduces it with ONE
redistribution to Replicate and divides.  A target outside the classes on any rank makes every
rank raise the same error after that redistribution, so no rank is left waiting in it.

Calls it does not improve (no batch shard, a Partial input whose total weight stays replicated)
go back to the rule (``NotImplemented``).
"""

from __future__ import annotations

from typing import Any, cast

import torch

from shardwise.placement import DTensorSpec, Partial, Replicate, TensorMeta, contiguous_strides

from .._dtensor import DTensor, new_dtensor
from .._ops.nn_ops import REDUCTION_MEAN, REDUCTION_SUM, bound_arguments
from .._plan_executor import redistribute_local_tensor
from .._decision_pipeline import propagate_op_sharding

__all__ = ["NLL_LOSS_HANDLERS"]

aten = torch.ops.aten


def _spec_and_local(value: Any, mesh: Any) -> tuple[Any, Any]:
    """(spec, local tensor) of a DTensor; a plain tensor counts as replicated (as dispatch treats it)."""
    if isinstance(value, DTensor):
        return value._spec, value._local_tensor
    if isinstance(value, torch.Tensor):
        meta = TensorMeta(value.shape, tuple(value.stride()), value.dtype)
        return DTensorSpec(mesh, (Replicate(),) * mesh.ndim, meta), value
    return value, value


def _batch_sharded_mean(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Registered with declines_by_key: whether it declines depends only on the reduction and the specs.
    log_probs, target, weight, reduction, ignore_index = bound_arguments(op, args, kwargs)
    if reduction != REDUCTION_MEAN or not isinstance(log_probs, DTensor):
        return NotImplemented
    if not any(placement.is_shard() for placement in log_probs._spec.placements):
        return NotImplemented
    mesh = log_probs._spec.mesh
    pieces = [_spec_and_local(value, mesh) for value in (log_probs, target, weight)]
    sum_args = (*(spec for spec, _ in pieces), REDUCTION_SUM, ignore_index)
    decision = propagate_op_sharding(op, sum_args, {})
    loss_spec, weight_spec = cast(tuple[DTensorSpec[Any], DTensorSpec[Any]], decision.output_specs)
    if loss_spec.placements != weight_spec.placements or not loss_spec.has_partial():
        return NotImplemented

    # The sum decision's inputs, moved where it wants them (the rule's redistribution, if any).
    locals_: list[Any] = [local for _, local in pieces]
    tensor_slots = [slot for slot, (spec, _) in enumerate(pieces) if isinstance(spec, DTensorSpec)]
    for slot, wanted in zip(tensor_slots, decision.input_specs):
        current = pieces[slot][0]
        if current != wanted:
            locals_[slot] = redistribute_local_tensor(locals_[slot], current, wanted)
    local_log_probs, local_target, local_weight = locals_

    num_classes = local_log_probs.shape[1] if local_log_probs.dim() > 1 else local_log_probs.shape[0]
    bad = ((local_target < 0) | (local_target >= num_classes)) & (local_target != ignore_index)
    # Bad targets are counted and left out here, so that no rank raises before the others reach the reduction.
    safe_target = local_target.masked_fill(bad, ignore_index)
    loss_sum, weight_sum = op(local_log_probs, safe_target, local_weight, REDUCTION_SUM, ignore_index)
    totals = torch.stack([loss_sum, weight_sum, bad.sum().to(loss_sum.dtype)])
    meta = TensorMeta(torch.Size((3,)), contiguous_strides((3,)), totals.dtype)
    mesh = loss_spec.mesh
    partial_totals = DTensorSpec(mesh, loss_spec.placements, meta)
    replicated = tuple(Replicate() if isinstance(p, Partial) else p for p in loss_spec.placements)
    totals = redistribute_local_tensor(totals, partial_totals, DTensorSpec(mesh, replicated, meta))
    if bool(totals[2] > 0):
        raise IndexError(
            f"{op}: a target on at least one rank is outside the classes [0, {num_classes}) "
            f"and is not ignore_index={ignore_index}"
        )
    scalar_meta = TensorMeta(torch.Size(()), (), totals.dtype)
    scalar_spec = DTensorSpec(mesh, replicated, scalar_meta)
    return new_dtensor(totals[0] / totals[1], scalar_spec), new_dtensor(totals[1].clone(), scalar_spec)


NLL_LOSS_HANDLERS = {
    aten.nll_loss_forward.default: _batch_sharded_mean,
    aten.nll_loss2d_forward.default: _batch_sharded_mean,
}
