"""PyTorch's registration API (``register_op_strategy``, ``register_single_dim_strategy``, ``register_prop_rule``...)
over the registries the engine owns.

PyTorch keeps per-op registries on its propagator (``op_single_dim_strategy_funcs``, ``op_strategy_funcs``,
``op_to_rules`` and their schema infos).  Here they are the engine's (``_engine.ENGINE.registrations``),
bound below under PyTorch's names: a registration is an entry, and any change to an entry (registering,
``del`` / ``pop``: PyTorch's tests and users unregister this way) reaches :func:`_sync_rule` through the
engine, which gives the op the rule its highest registration calls for (single-dim strategy, then op
strategy, then sharding-prop rule: PyTorch's order) or, when none is left, the rule it had before any;
the engine then forgets every cache.  No caller clears caches by hand.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

from .._engine import ENGINE, RegistryMap
from .._rules import ShardingRule, override_rule, restore_rule, rule_for
from .strategy_choice import prop_rule_as_sharding_rule, single_dim_strategy_as_sharding_rule, strategy_as_sharding_rule
from .strategy_expansion import SingleDimStrategyFunc, _SingleDimStrategyInfo
from .strategy_types import OpSchema, OutputSharding, RuntimeSchemaInfo, StrategyType

__all__ = [
    "OP_SINGLE_DIM_STRATEGY_FUNCS",
    "OP_STRATEGY_FUNCS",
    "OP_TO_RULES",
    "OP_TO_SCHEMA_INFO",
    "OP_TO_SCHEMA_INFO_FOR_SINGLE_DIM_STRATEGY",
    "register_op_strategy",
    "register_op_strategy_func",
    "register_prop_rule",
    "register_prop_rule_func",
    "register_single_dim_op_strategy_func",
    "register_single_dim_strategy",
]

_REGISTRATIONS = ENGINE.registrations
OP_SINGLE_DIM_STRATEGY_FUNCS: RegistryMap[torch._ops.OpOverload, _SingleDimStrategyInfo] = (
    _REGISTRATIONS.single_dim_strategy_funcs
)
OP_STRATEGY_FUNCS: RegistryMap[torch._ops.OpOverload, Callable[[OpSchema], StrategyType]] = _REGISTRATIONS.strategy_funcs
OP_TO_RULES: RegistryMap[torch._ops.OpOverload, Callable[[OpSchema], OutputSharding]] = _REGISTRATIONS.prop_rules
# ``op_to_schema_info``: what was registered, and for ops given a sharding by ``register_sharding`` (a rule of
# the engine, not an entry here) the info that PyTorch's ``register_sharding`` derives (its fallback below).
OP_TO_SCHEMA_INFO: RegistryMap[torch._ops.OpOverload, RuntimeSchemaInfo] = _REGISTRATIONS.schema_info
OP_TO_SCHEMA_INFO_FOR_SINGLE_DIM_STRATEGY: RegistryMap[torch._ops.OpOverload, RuntimeSchemaInfo] = (
    _REGISTRATIONS.schema_info_for_single_dim_strategy
)
# The engine's rule of each op before its first PyTorch-style registration (None: it had none).
_RULES_BEFORE_REGISTRATION: dict[torch._ops.OpOverload, ShardingRule | None] = _REGISTRATIONS.rules_before_registration


def _registered_sharding_schema_info(overload: torch._ops.OpOverload) -> RuntimeSchemaInfo | None:
    """For an op given its rule by ``register_sharding``: the first int argument is static, int keyword-only
    arguments are static keys, lists of tensors are walked (PyTorch's derivation).  None for other ops."""
    from ..experimental._register_sharding import is_register_sharding_rule

    if not isinstance(overload, torch._ops.OpOverload):
        return None
    rule = rule_for(overload)
    if rule is None or not is_register_sharding_rule(rule):
        return None
    static_argnum, static_kwargkey = 100, []
    for index, argument in enumerate(overload._schema.arguments):
        kind = argument.type
        if isinstance(kind, torch.OptionalType):
            kind = kind.getElementType()
        if isinstance(kind, torch.IntType):
            static_argnum = min(static_argnum, index)
            if argument.kwarg_only:
                static_kwargkey.append(argument.name)
    return RuntimeSchemaInfo(static_argnum, static_kwargkey or None, needs_pytree=True)


def _sync_rule(overload: torch._ops.OpOverload) -> None:
    """Give the engine the rule of the op's highest registration (PyTorch's precedence), or, with none left,
    the rule it had before its first."""
    name = str(overload)
    rule: ShardingRule
    if overload in OP_SINGLE_DIM_STRATEGY_FUNCS:
        rule = single_dim_strategy_as_sharding_rule(name, OP_SINGLE_DIM_STRATEGY_FUNCS[overload])
    elif overload in OP_STRATEGY_FUNCS:
        rule = strategy_as_sharding_rule(name, OP_STRATEGY_FUNCS[overload])
    elif overload in OP_TO_RULES:
        rule = prop_rule_as_sharding_rule(name, OP_TO_RULES[overload])
    else:
        if overload in _RULES_BEFORE_REGISTRATION:
            restore_rule(overload, _RULES_BEFORE_REGISTRATION.pop(overload))
        return
    replaced = override_rule([overload], rule)
    _RULES_BEFORE_REGISTRATION.setdefault(overload, replaced[overload])


OP_TO_SCHEMA_INFO.fallback = _registered_sharding_schema_info
_REGISTRATIONS.sync_rule = _sync_rule


def _overloads(op: object, what: str) -> list[torch._ops.OpOverload]:
    ops = list(op) if isinstance(op, (list, tuple)) else [op]
    for item in ops:
        if not isinstance(item, torch._ops.OpOverload):
            raise TypeError(
                f"{what}: expected an OpOverload (e.g. torch.ops.mylib.op.default) or a list of them, got "
                f"{type(item).__name__} {item!r}"
            )
    return ops  # type: ignore[return-value]


def register_op_strategy_func(
    op: torch._ops.OpOverload,
    strategy_func: Callable[[OpSchema], StrategyType],
    schema_info: RuntimeSchemaInfo | None = None,
) -> None:
    """Record ``strategy_func`` as the op's strategy (it becomes the op's rule unless a single-dim strategy is
    registered for it); the engine forgets cached decisions."""
    (overload,) = _overloads(op, "register_op_strategy")
    if schema_info is not None:
        OP_TO_SCHEMA_INFO[overload] = schema_info
    OP_STRATEGY_FUNCS[overload] = strategy_func


def register_prop_rule_func(
    op: torch._ops.OpOverload,
    rule_func: Callable[[OpSchema], OutputSharding],
    schema_info: RuntimeSchemaInfo | None = None,
) -> None:
    """Record ``rule_func`` (``OpSchema -> OutputSharding``) as the op's sharding-prop rule (it becomes the op's
    rule unless a strategy of either kind is registered for it)."""
    (overload,) = _overloads(op, "register_sharding_prop_rule")
    if schema_info is not None:
        OP_TO_SCHEMA_INFO[overload] = schema_info
    OP_TO_RULES[overload] = rule_func


def register_single_dim_op_strategy_func(
    op: torch._ops.OpOverload,
    strategy_info: _SingleDimStrategyInfo | SingleDimStrategyFunc,
    schema_info: RuntimeSchemaInfo | None = None,
) -> None:
    """Record a single-dim strategy (a :class:`_SingleDimStrategyInfo` or a bare function) as the op's rule."""
    (overload,) = _overloads(op, "register_single_dim_op_strategy")
    info = strategy_info if isinstance(strategy_info, _SingleDimStrategyInfo) else _SingleDimStrategyInfo(strategy_info)
    if not callable(info.func):
        raise TypeError(f"register_single_dim_op_strategy({overload}): expected a function, got {info.func!r}")
    if info.different_mesh_args:
        raise NotImplementedError(
            f"register_single_dim_op_strategy({overload}): different_mesh_args={info.different_mesh_args} asks for "
            "inputs on another mesh; shardwise runs an op on one mesh (put those inputs on the op's mesh, replicated)"
        )
    if schema_info is not None:
        OP_TO_SCHEMA_INFO_FOR_SINGLE_DIM_STRATEGY[overload] = schema_info
    OP_SINGLE_DIM_STRATEGY_FUNCS[overload] = info


_SingleDimFunc = Callable[..., Any]


def register_single_dim_strategy(
    op: torch._ops.OpOverload | list[torch._ops.OpOverload],
    schema_info: RuntimeSchemaInfo | None = None,
    allow_unbacked_sharding: bool | None = None,
    allow_uneven_sharding: bool = False,
    different_mesh_args: list[int] | None = None,
) -> Callable[[_SingleDimFunc], _SingleDimFunc]:
    """Decorator (PyTorch's ``_ops.single_dim_strategy.register_single_dim_strategy``).

    The function ``(op, args_meta, kwargs_meta) -> rows`` sees tensors as their global ``TensorMeta`` and lists
    the sharding rows valid on ONE mesh dim (outputs then inputs; ``_ShardingPlaceholder(dim)`` for "sharded on
    dim"; the all-``Replicate`` row is implied); every combination over the mesh dims is a candidate and the
    cheapest redistribution of the inputs wins.
    """
    overloads = _overloads(op, "register_single_dim_strategy")

    def register(func: _SingleDimFunc) -> _SingleDimFunc:
        info = _SingleDimStrategyInfo(
            func=func,
            allow_unbacked_sharding=allow_unbacked_sharding,
            allow_uneven_sharding=allow_uneven_sharding,
            different_mesh_args=different_mesh_args,
        )
        for overload in overloads:
            register_single_dim_op_strategy_func(overload, info, schema_info)
        return func

    return register


_StrategyFunc = Callable[[OpSchema], StrategyType]
_PropRuleFunc = Callable[[OpSchema], OutputSharding]


_RegisteredFunc = TypeVar("_RegisteredFunc", _PropRuleFunc, _StrategyFunc)


def _registering_decorator(
    op: torch._ops.OpOverload | list[torch._ops.OpOverload],
    schema_info: RuntimeSchemaInfo | None,
    name: str,
    register_func: Callable[[torch._ops.OpOverload, Any, RuntimeSchemaInfo | None], None],
) -> Callable[[_RegisteredFunc], _RegisteredFunc]:
    overloads = _overloads(op, name)

    def register(func: _RegisteredFunc) -> _RegisteredFunc:
        for overload in overloads:
            register_func(overload, func, schema_info)
        return func

    return register


def register_prop_rule(
    op: torch._ops.OpOverload | list[torch._ops.OpOverload], schema_info: RuntimeSchemaInfo | None = None
) -> Callable[[_PropRuleFunc], _PropRuleFunc]:
    """Decorator (PyTorch's ``_ops.utils.register_prop_rule``): the function becomes the op's sharding-prop rule."""
    return _registering_decorator(op, schema_info, "register_prop_rule", register_prop_rule_func)


def register_op_strategy(
    op: torch._ops.OpOverload | list[torch._ops.OpOverload], schema_info: RuntimeSchemaInfo | None = None
) -> Callable[[_StrategyFunc], _StrategyFunc]:
    """Decorator (PyTorch's ``_ops.utils.register_op_strategy``): the function becomes the op's strategy."""
    return _registering_decorator(op, schema_info, "register_op_strategy", register_op_strategy_func)
