"""PyTorch's ``DTensor._op_dispatcher``, as far as code outside DTensor reaches into it.

PyTorch's tests and users read ``DTensor._op_dispatcher.sharding_propagator`` to reach the strategy
registries (``op_strategy_funcs``, ``op_to_schema_info``, ...: add, replace or delete an op's entry).
shardwise dispatches in ``_op_runner``; this object only leads to the propagator view
(``sharding_prop.sharding_propagator``), imported when first asked for, so that wiring it onto
``DTensor`` costs nothing at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sharding_prop import ShardingPropagator

__all__ = ["OpDispatcher", "op_dispatcher"]


class OpDispatcher:
    @property
    def sharding_propagator(self) -> ShardingPropagator:
        from .sharding_prop import sharding_propagator

        return sharding_propagator


op_dispatcher = OpDispatcher()
