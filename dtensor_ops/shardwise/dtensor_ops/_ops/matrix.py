"""Matrix products: mm, bmm, addmm, baddbmm (and their in-place / out= forms).

For ``out[m, n] = a[m, k] @ b[k, n]`` one mesh dim can split:

* the rows of ``a`` -> rows of the output; ``b`` replicated;
* the columns of ``b`` -> columns of the output; ``a`` replicated;
* the contraction dim ``k`` of both (chunked identically, so exact even when
  uneven) -> each rank holds a partial sum: ``Partial(sum)``;
* a batch dim (bmm) of both -> batch dim of the output;
* nothing: all replicated;
* one operand partial, the other replicated: the product is linear in each
  operand, so ``Partial(sum)``/``Partial(avg)`` carries over.

``addmm``/``baddbmm`` add ``beta * input``: the added tensor follows the
output's placement (broadcast dims replicated); when the output is Partial the
added tensor must be Partial of the same kind, else it would be added once per
rank.  ``nn.Linear`` reaches here through its decomposition (``t`` + ``addmm`` /
``mm`` + ``view``), so these rules with the view rules cover its forward and
backward.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from shardwise.placement import Partial, Placement, Replicate, Shard, TensorMeta

from ._shapes import broadcast_shapes, contiguous_meta, dtype_on_empty_tensors, input_meta
from .._rules import OneDimStrategy, OpCall, ShardingRule, aten_overloads, broadcast_input_placement, register_rule

__all__ = ["MATMUL_RULE", "matmul_output_meta", "matmul_strategies"]

aten = torch.ops.aten

# (op schema name) -> (number of leading batch dims, position of the added tensor or None, positions of a and b)
_LAYOUTS: dict[str, tuple[int, int | None, int, int]] = {
    "aten::mm": (0, None, 0, 1),
    "aten::bmm": (1, None, 0, 1),
    "aten::addmm": (0, 0, 1, 2),
    "aten::addmm_": (0, 0, 1, 2),
    "aten::baddbmm": (1, 0, 1, 2),
    "aten::baddbmm_": (1, 0, 1, 2),
}


def _product_placements(call: OpCall, batch_dims: int) -> list[tuple[Placement, Placement, Placement]]:
    """(output, a, b) placements of the matrix product on one mesh dim."""
    rows, cols = batch_dims, batch_dims + 1
    options: list[tuple[Placement, Placement, Placement]] = []
    if batch_dims:
        options.append((Shard(0), Shard(0), Shard(0)))
    options.append((Shard(rows), Shard(rows), Replicate()))
    options.append((Shard(cols), Replicate(), Shard(cols)))
    # a's contraction dim is its last, b's is its second to last.
    options.append((Partial("sum"), Shard(batch_dims + 1), Shard(batch_dims)))
    options.append((Replicate(), Replicate(), Replicate()))
    for reduce_op in call.linear_reduce_ops():
        partial = Partial(reduce_op)
        options.append((partial, partial, Replicate()))
        options.append((partial, Replicate(), partial))
    return options


def matmul_strategies(call: OpCall) -> list[OneDimStrategy]:
    batch_dims, added_position, a_position, b_position = _LAYOUTS[call.op._schema.name]
    a_index = call.input_index_at(a_position)
    b_index = call.input_index_at(b_position)
    if a_index is None or b_index is None:
        raise TypeError(f"{call.op}: both matrix operands must be DTensors (got plain tensors mixed with DTensors)")
    added_index = None if added_position is None else call.input_index_at(added_position)
    # A plain (non-DTensor) added tensor would be added on every rank: no Partial output then.
    partial_output_allowed = added_position is None or added_index is not None
    out_shape = call.output_shape(0)

    strategies: list[OneDimStrategy] = []
    for output, a_placement, b_placement in _product_placements(call, batch_dims):
        if isinstance(output, Partial) and not partial_output_allowed:
            continue
        inputs: list[Placement] = [Replicate()] * len(call.input_specs)
        inputs[a_index] = a_placement
        inputs[b_index] = b_placement
        if added_index is not None:
            if isinstance(output, Shard):
                added: Placement = broadcast_input_placement(out_shape, call.input_shape(added_index), output.dim)
            else:
                added = output
            inputs[added_index] = added
        strategies.append(OneDimStrategy((output,), tuple(inputs)))
    return strategies


def matmul_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    """``[*batch, m, n]``, contiguous (matrix products always allocate a fresh row-major result)."""
    layout = _LAYOUTS.get(op._schema.name)
    if layout is None or len(args) < 2:
        return None
    batch_dims, added_position, a_position, b_position = layout
    if max(a_position, b_position) >= len(args):
        return None
    a, b = input_meta(args[a_position]), input_meta(args[b_position])
    if a is None or b is None or len(a.shape) != batch_dims + 2 or len(b.shape) != batch_dims + 2:
        return None
    if a.shape[-1] != b.shape[-2] or a.shape[:batch_dims] != b.shape[:batch_dims]:
        return None
    shape = torch.Size((*a.shape[:-1], b.shape[-1]))
    if added_position is not None:
        added = input_meta(args[added_position])
        if added is None:
            return None
        if broadcast_shapes(added.shape, shape) != shape:
            return None
    dtype = dtype_on_empty_tensors(op, args, kwargs)
    return None if dtype is None else contiguous_meta(shape, dtype)


MATMUL_RULE = ShardingRule(
    family="matrix",
    one_dim_strategies=matmul_strategies,
    scalar_values_matter=False,
    output_meta=matmul_output_meta,
)

register_rule(aten_overloads(("mm", "bmm", "addmm", "baddbmm")), MATMUL_RULE)
