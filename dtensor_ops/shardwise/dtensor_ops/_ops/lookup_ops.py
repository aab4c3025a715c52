"""Lookups and index writes: take, index_copy / index_fill / index_reduce, bucketize, isin, searchsorted.

On one mesh dim:

* ``take(self, index)`` reads ``self`` flattened: ``self`` replicated, the output is laid out like
  the index (any dim sharded); a Partial ``self`` passes through (elements are only picked);
* ``index_copy``/``index_fill``/``index_reduce`` along ``dim`` keep shards of ``self``'s other dims,
  with ``source`` sharded alike and the index replicated;
* ``bucketize``/``isin``: the looked-up values keep any shard, the boundaries / test elements are
  replicated; ``searchsorted`` likewise when the sorted sequence is 1-D, else the leading dims of
  the sequence and the values are sharded alike (the last dim is searched).
"""

from __future__ import annotations

import torch

from shardwise.placement import Partial, Placement, Replicate, Shard, normalize_dim

from .._rules import OneDimStrategy, OpCall, ShardingRule, register_rule
from ._aligned import aligned_strategy, replicated_strategy

__all__ = ["INDEX_ALONG_DIM_RULE", "LOOKUP_RULE", "TAKE_RULE"]

aten = torch.ops.aten


def _take_strategies(call: OpCall) -> list[OneDimStrategy]:
    index_ndim = len(call.input_shape(1))
    strategies = [aligned_strategy(call, (None, dim), (dim,)) for dim in range(index_ndim)]
    strategies.append(replicated_strategy(call))
    strategies.extend(OneDimStrategy((Partial(kind),), (Partial(kind), Replicate())) for kind in call.every_reduce_op())
    return strategies


TAKE_RULE = ShardingRule(family="take", one_dim_strategies=_take_strategies)


def _index_along_dim_strategies(call: OpCall) -> list[OneDimStrategy]:
    """self (argument 0) and source (a tensor argument of self's rank) sharded alike off ``dim``."""
    ndim = len(call.input_shape(0))
    dim_arg = call.arg(1, "dim")
    assert isinstance(dim_arg, int)
    along = normalize_dim(dim_arg, ndim) if ndim else None
    source = call.input_index_at(3)
    if source is not None and len(call.input_shape(source)) != ndim:
        source = None  # index_fill's 0-dim value: replicated
    strategies = []
    for dim in range(ndim):
        if dim == along:
            continue
        inputs: list[Placement] = [Replicate()] * len(call.input_specs)
        inputs[0] = Shard(dim)
        if source is not None:
            inputs[source] = Shard(dim)
        strategies.append(OneDimStrategy((Shard(dim),), tuple(inputs)))
    strategies.append(replicated_strategy(call))
    return strategies


INDEX_ALONG_DIM_RULE = ShardingRule(family="index along a dim", one_dim_strategies=_index_along_dim_strategies)


def _lookup_strategies(call: OpCall) -> list[OneDimStrategy]:
    """bucketize(self, boundaries) / isin(elements, test_elements) / searchsorted(sorted, self)."""
    values_at = 1 if call.op._schema.name == "aten::searchsorted" else 0
    values = call.input_index_at(values_at)
    if values is None:
        return [replicated_strategy(call)]
    values_ndim = len(call.input_shape(values))
    num_inputs = len(call.input_specs)
    strategies = []
    sequence = call.input_index_at(0) if values_at == 1 else None
    sequence_ndim = None if sequence is None else len(call.input_shape(sequence))
    for dim in range(values_ndim):
        inputs: list[Placement] = [Replicate()] * num_inputs
        inputs[values] = Shard(dim)
        if sequence_ndim is not None and sequence_ndim > 1:
            if dim >= values_ndim - 1:
                continue  # the searched dim
            inputs = [Shard(dim)] * num_inputs  # sequence, values and sorter share their leading dims
        strategies.append(OneDimStrategy((Shard(dim),), tuple(inputs)))
    strategies.append(replicated_strategy(call))
    return strategies


LOOKUP_RULE = ShardingRule(family="bucketize/isin/searchsorted", one_dim_strategies=_lookup_strategies)

register_rule((aten.take.default, aten.take.out), TAKE_RULE)
register_rule(
    (
        aten.index_copy.default, aten.index_copy.out, aten.index_fill.int_Scalar, aten.index_fill.int_Tensor,
        aten.index_reduce.default, aten.index_reduce.out,
    ),
    INDEX_ALONG_DIM_RULE,
)  # fmt: skip
register_rule(
    (
        aten.bucketize.Tensor, aten.bucketize.Tensor_out, aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar,
        aten.isin.Scalar_Tensor, aten.searchsorted.Tensor, aten.searchsorted.Tensor_out,
    ),
    LOOKUP_RULE,
)  # fmt: skip
