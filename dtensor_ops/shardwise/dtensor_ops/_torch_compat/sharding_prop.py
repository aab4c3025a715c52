"""PyTorch's ``torch.distributed.tensor._sharding_prop`` surface over shardwise's decision pipeline.

``ShardingPropagator`` (reached as ``sharding_propagator``) is a view of the engine, not a second
one: its ``propagate_op_sharding`` is the pipeline's cached propagation (the one decision cache,
its counts), its ``register_*`` methods make PyTorch-style strategy
functions into :class:`ShardingRule` s of the one rule registry, and ``OpSchema``/``OutputSharding``
forms convert to and from :class:`OpDecision`.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Mapping, Sequence, cast, overload

import torch

from shardwise.placement import DTensorSpec, TensorMeta

from .._decision import OpDecision
from .._decision_pipeline import PropagationCacheInfo, call_key, clear_decisions, decision_cache_size, propagation_cache_info
from .._decision_pipeline import decide_from_specs, propagate_op_sharding
from .._ops import ShardingRule, rule_for
from .._propagation import STRUCTURE_SEQUENCE, STRUCTURE_SINGLE, ShardingPropagationError, run_on_meta
from .._rules import override_rule
from .op_schema import (
    OP_SINGLE_DIM_STRATEGY_FUNCS,
    OP_STRATEGY_FUNCS,
    OP_TO_RULES,
    OP_TO_SCHEMA_INFO,
    OP_TO_SCHEMA_INFO_FOR_SINGLE_DIM_STRATEGY,
    OpInfo,
    OpSchema,
    OutputSharding,
    OutputSpecType,
    RuntimeSchemaInfo,
    SingleDimStrategyFunc,
    StrategyType,
    _SingleDimStrategyInfo,
    register_op_strategy_func,
    register_prop_rule_func,
    register_single_dim_op_strategy_func,
    replace_specs,
)

__all__ = [
    "OpDecision",
    "OpInfo",
    "OpSchema",
    "OutputSharding",
    "PropagationCacheInfo",
    "ShardingPropagator",
    "ShardingPropagationError",
    "output_sharding_of",
    "propagate_op_sharding",
    "sharding_cache_key",
    "sharding_cache_size",
    "sharding_propagator",
]

def sharding_cache_size() -> int:
    """How many decisions the one decision cache holds."""
    return decision_cache_size()


def _propagate_in_either_form(
    name: str,
    decide: Callable[[torch._ops.OpOverload, Sequence[object], Mapping[str, object]], OpDecision],
    op: torch._ops.OpOverload | OpSchema,
    args: Sequence[object] | None,
    kwargs: Mapping[str, object] | None,
) -> OpDecision | OutputSharding:
    """``decide`` asked in PyTorch's form (an ``OpSchema`` -> ``OutputSharding``) or ours (op, specs -> ``OpDecision``)."""
    if isinstance(op, OpSchema):
        if args is not None or kwargs is not None:
            raise TypeError(
                f"{name}: given an OpSchema, expected no further arguments (or call it as {name}(op, args, kwargs))"
            )
        return output_sharding_of(op, decide(op.op, op.args_schema, op.kwargs_schema))
    if args is None:
        raise TypeError(
            f"{name}({op!r}): expected an OpSchema, or an op with its arguments (DTensors given as their DTensorSpec)"
        )
    return decide(op, args, kwargs or {})


class _CachedPropagation:
    """``ShardingPropagator.propagate_op_sharding``: the cached propagation, with functools' cache API."""

    @overload
    def __call__(self, op: OpSchema) -> OutputSharding: ...

    @overload
    def __call__(
        self, op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object] | None = None
    ) -> OpDecision: ...

    def __call__(
        self,
        op: torch._ops.OpOverload | OpSchema,
        args: Sequence[object] | None = None,
        kwargs: Mapping[str, object] | None = None,
    ) -> OpDecision | OutputSharding:
        return _propagate_in_either_form("propagate_op_sharding", propagate_op_sharding, op, args, kwargs)

    def cache_info(self) -> PropagationCacheInfo:
        return propagation_cache_info()

    def cache_clear(self) -> None:
        clear_decisions()


class ShardingPropagator:
    """PyTorch's propagator object over shardwise's engine (rules per op family, one decision cache).

    ``propagate_op_sharding(op, args, kwargs)``: the cached decision (an ``OpDecision``: output
    specs, target input specs), with ``.cache_info()`` / ``.cache_clear()``;
    ``propagate_op_sharding_non_cached(op, args, kwargs)``: the same, decided afresh;
    ``register_sharding_rule(op, rule)``: give ``op`` (an overload or a list) a ``ShardingRule``,
    replacing any it has (cached decisions are dropped). DTensors in ``args`` are given as their
    ``DTensorSpec`` (with ``tensor_meta``).

    PyTorch's forms (``_op_schema``): ``propagate_op_sharding(op_schema)`` -> ``OutputSharding``;
    ``propagate(op_info)`` sets ``op_info.output_sharding``; ``register_single_dim_op_strategy(op,
    strategy_info, schema_info=None)``, ``register_op_strategy(op, strategy_func, schema_info=None)`` and
    ``register_sharding_prop_rule(op, rule_func, schema_info=None)`` make such functions real rules of the
    engine (listed in ``op_single_dim_strategy_funcs`` / ``op_strategy_funcs`` / ``op_to_rules``; an op
    registered several ways follows the first of these, as in PyTorch).
    """

    def __init__(self) -> None:
        self.propagate_op_sharding = _CachedPropagation()
        self.op_single_dim_strategy_funcs = OP_SINGLE_DIM_STRATEGY_FUNCS
        self.op_strategy_funcs = OP_STRATEGY_FUNCS
        self.op_to_rules = OP_TO_RULES
        self.op_to_schema_info = OP_TO_SCHEMA_INFO
        self.op_to_schema_info_for_single_dim_strategy = OP_TO_SCHEMA_INFO_FOR_SINGLE_DIM_STRATEGY

    @overload
    def propagate_op_sharding_non_cached(self, op: OpSchema) -> OutputSharding: ...

    @overload
    def propagate_op_sharding_non_cached(
        self, op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object] | None = None
    ) -> OpDecision: ...

    def propagate_op_sharding_non_cached(
        self,
        op: torch._ops.OpOverload | OpSchema,
        args: Sequence[object] | None = None,
        kwargs: Mapping[str, object] | None = None,
    ) -> OpDecision | OutputSharding:
        return _propagate_in_either_form("propagate_op_sharding_non_cached", decide_from_specs, op, args, kwargs)

    def _propagate_tensor_meta_non_cached(
        self, op_schema: OpSchema
    ) -> TensorMeta | tuple[TensorMeta | None, ...] | None:
        """Global metadata of the call's output(s): the op run once on meta tensors of the inputs' global
        shapes (a tuple for several outputs, None for a non-tensor result).  Not cached; the engine itself
        takes an op family's shape rule first where it has one."""
        structure, metas = run_on_meta(op_schema.op, op_schema.args_schema, op_schema.kwargs_schema)
        if structure == STRUCTURE_SINGLE:
            return metas[0]
        if structure == STRUCTURE_SEQUENCE:
            return metas
        return None

    def propagate(self, op_info: OpInfo) -> None:
        """Set ``op_info.output_sharding`` from ``op_info.schema`` (PyTorch's dispatcher entry)."""
        if op_info.schema is None:
            raise ValueError("ShardingPropagator.propagate: op_info.schema is None; expected the call's OpSchema")
        op_info.output_sharding = self.propagate_op_sharding(op_info.schema)

    def register_single_dim_op_strategy(
        self,
        op_overload: torch._ops.OpOverload,
        strategy_info: _SingleDimStrategyInfo | SingleDimStrategyFunc,
        schema_info: RuntimeSchemaInfo | None = None,
    ) -> None:
        """Make a one-mesh-dim strategy (rows of placements, expanded over every mesh dim) the op's rule."""
        register_single_dim_op_strategy_func(op_overload, strategy_info, schema_info)

    def register_op_strategy(
        self,
        op_overload: torch._ops.OpOverload,
        strategy_func: Callable[[OpSchema], StrategyType],
        schema_info: RuntimeSchemaInfo | None = None,
    ) -> None:
        """Make ``strategy_func`` (OpSchema of OpStrategy inputs -> OpStrategy of candidates) the op's rule."""
        register_op_strategy_func(op_overload, strategy_func, schema_info)

    def register_sharding_prop_rule(
        self,
        op_overload: torch._ops.OpOverload,
        rule_func: Callable[[OpSchema], OutputSharding],
        schema_info: RuntimeSchemaInfo | None = None,
    ) -> None:
        """Make ``rule_func`` (OpSchema of specs -> OutputSharding) the op's rule."""
        register_prop_rule_func(op_overload, rule_func, schema_info)

    def register_sharding_rule(
        self, op: torch._ops.OpOverload | Sequence[torch._ops.OpOverload], rule: ShardingRule
    ) -> None:
        ops = [op] if isinstance(op, torch._ops.OpOverload) else list(op)
        override_rule(ops, rule)  # the engine forgets the caches made from the old rule

    def rule_for(self, op: torch._ops.OpOverload) -> ShardingRule | None:
        return rule_for(op)


# The one propagator (PyTorch reaches it as DTensor._op_dispatcher.sharding_propagator).
sharding_propagator = ShardingPropagator()


def output_sharding_of(schema: OpSchema, decision: OpDecision) -> OutputSharding:
    """A decision in PyTorch's form: the output specs and, when inputs move, the schema with their targets."""
    if not decision.needs_redistribute:
        return OutputSharding(cast(OutputSpecType, decision.output_specs))
    targets = iter(decision.input_specs)

    def target(spec: DTensorSpec[Any]) -> DTensorSpec[Any]:
        return next(targets)

    moved_args = tuple(replace_specs(arg, target) for arg in schema.args_schema)
    moved_kwargs = {name: replace_specs(value, target) for name, value in schema.kwargs_schema.items()}
    return OutputSharding(
        cast(OutputSpecType, decision.output_specs),
        redistribute_schema=OpSchema(schema.op, moved_args, moved_kwargs, schema.schema_info),
        needs_redistribute=True,
    )


def sharding_cache_key(op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]) -> Hashable:
    """The key :func:`propagate_op_sharding` (and dispatch) caches the decision for this call under."""
    return call_key(op, args, kwargs)
