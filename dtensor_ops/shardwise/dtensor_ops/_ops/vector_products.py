"""Vector and matrix-vector products: dot, vdot, mv, addmv, addr, cdist, linalg_cross.

On one mesh dim:

* ``dot``/``vdot``: both vectors sharded alike give ``Partial(sum)`` (each rank sums its products);
* ``mv``: matrix rows sharded (vector replicated) give sharded output; matrix columns sharded with
  the vector sharded alike give ``Partial(sum)``; ``addmv`` the row case (``self`` sharded like the
  output where it has that extent, else replicated);
* ``addr``: output rows from ``vec1`` sharded, or columns from ``vec2`` sharded, ``self`` following;
* ``cdist(x1, x2)``: rows of ``x1`` sharded give output rows sharded, rows of ``x2`` output columns,
  equal batch dims of both the batch dims;
* ``linalg_cross`` is pointwise except along ``dim``, which must be whole.
"""

from __future__ import annotations

import torch

from shardwise.placement import Partial, Replicate, Shard, normalize_dim

from .._rules import OneDimStrategy, OpCall, ShardingRule, broadcast_input_placement, register_rule
from ._aligned import aligned_strategy, empty_piece_kernel, replicated_strategy
from .pointwise import pointwise_output_meta, pointwise_strategies

__all__ = ["ADDMV_RULE", "ADDR_RULE", "CDIST_RULE", "CROSS_RULE", "DOT_RULE", "MV_RULE"]

aten = torch.ops.aten


def _dot_strategies(call: OpCall) -> list[OneDimStrategy]:
    return [OneDimStrategy((Partial("sum"),), (Shard(0), Shard(0))), replicated_strategy(call)]


def _mv_strategies(call: OpCall) -> list[OneDimStrategy]:
    return [
        OneDimStrategy((Shard(0),), (Shard(0), Replicate())),
        OneDimStrategy((Partial("sum"),), (Shard(1), Shard(0))),
        replicated_strategy(call),
    ]


def _addmv_strategies(call: OpCall) -> list[OneDimStrategy]:
    out_shape = call.output_shape(0)
    self_placement = broadcast_input_placement(out_shape, call.input_shape(0), 0)
    return [
        OneDimStrategy((Shard(0),), (self_placement, Shard(0), Replicate())),
        replicated_strategy(call),
    ]


def _addr_strategies(call: OpCall) -> list[OneDimStrategy]:
    out_shape = call.output_shape(0)
    self_shape = call.input_shape(0)
    return [
        OneDimStrategy((Shard(0),), (broadcast_input_placement(out_shape, self_shape, 0), Shard(0), Replicate())),
        OneDimStrategy((Shard(1),), (broadcast_input_placement(out_shape, self_shape, 1), Replicate(), Shard(0))),
        replicated_strategy(call),
    ]


def _cdist_strategies(call: OpCall) -> list[OneDimStrategy]:
    x1, x2 = call.input_shape(0), call.input_shape(1)
    ndim = len(x1)
    strategies = [aligned_strategy(call, (ndim - 2, None), (ndim - 2,)), aligned_strategy(call, (None, ndim - 2), (ndim - 1,))]
    if len(x2) == ndim:
        strategies.extend(aligned_strategy(call, (dim, dim), (dim,)) for dim in range(ndim - 2) if x1[dim] == x2[dim])
    strategies.append(replicated_strategy(call))
    return strategies


def _cross_strategies(call: OpCall) -> list[OneDimStrategy]:
    out_ndim = len(call.output_shape(0))
    dim_arg = call.arg(2, "dim", -1)
    assert isinstance(dim_arg, int)
    along = normalize_dim(dim_arg, out_ndim)
    return [s for s in pointwise_strategies(call) if s.outputs[0] != Shard(along)]


DOT_RULE = ShardingRule(family="dot", one_dim_strategies=_dot_strategies)
MV_RULE = ShardingRule(family="mv", one_dim_strategies=_mv_strategies)
# torch's addmv broadcasts a 1-element self against an empty product to 1 element, not 0: a rank with an
# empty row piece makes its empty result itself.
ADDMV_RULE = ShardingRule(family="addmv", one_dim_strategies=_addmv_strategies, local_kernel=empty_piece_kernel)
ADDR_RULE = ShardingRule(family="addr", one_dim_strategies=_addr_strategies)
CDIST_RULE = ShardingRule(family="cdist", one_dim_strategies=_cdist_strategies, local_kernel=empty_piece_kernel)
CROSS_RULE = ShardingRule(family="linalg_cross", one_dim_strategies=_cross_strategies, output_meta=pointwise_output_meta)

register_rule((aten.dot.default, aten.dot.out, aten.vdot.default, aten.vdot.out), DOT_RULE)
register_rule((aten.mv.default, aten.mv.out), MV_RULE)
register_rule((aten.addmv.default, aten.addmv.out), ADDMV_RULE)
register_rule((aten.addr.default, aten.addr.out), ADDR_RULE)
register_rule((aten._cdist_forward.default,), CDIST_RULE)
register_rule((aten.linalg_cross.default, aten.linalg_cross.out), CROSS_RULE)
