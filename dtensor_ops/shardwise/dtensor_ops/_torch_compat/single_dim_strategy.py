"""PyTorch's ``torch.distributed.tensor._ops.single_dim_strategy`` names: one-mesh-dim strategies.

A single-dim strategy function ``(op, args_meta, kwargs_meta) -> rows`` sees every tensor as its global
``TensorMeta`` and lists the shardings valid on ONE mesh dim: each row the placements of the outputs,
then of every tensor input, with ``_ShardingPlaceholder(dim)`` for "sharded on ``dim`` the way the inputs
are".  Registered with :func:`register_single_dim_strategy`, it is expanded over every mesh dim and
chosen like a registered op strategy (see ``shardwise.dtensor_ops._op_schema``).
"""

from __future__ import annotations

from .op_schema import (
    SingleDimStrategyFunc,
    _ShardingPlaceholder,
    _SingleDimStrategyInfo,
    expand_single_dim_strategy,
    register_single_dim_strategy,
)

__all__ = [
    "SingleDimStrategyFunc",
    "_ShardingPlaceholder",
    "_SingleDimStrategyInfo",
    "expand_single_dim_strategy",
    "register_single_dim_strategy",
]
