"""``register_sharding``: users state the valid shardings of an op (a custom op included) for one mesh dim."""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar, Union

import torch

from shardwise.placement import Placement

from .._caches import clear_all_caches
from .._rules import OneDimStrategy, OpCall, ShardingRule, override_rule

__all__ = ["register_sharding", "is_register_sharding_rule"]

PlacementList = Sequence[Union[Placement, None]]
ShardingFn = Callable[..., Sequence[tuple[PlacementList, PlacementList]]]
_Fn = TypeVar("_Fn", bound=ShardingFn)


def register_sharding(op: torch._ops.OpOverload | list[torch._ops.OpOverload]) -> Callable[[_Fn], _Fn]:
    """Decorator registering a sharding function for ``op`` (one overload or a list), as PyTorch's.

    The function receives the op's arguments with every DTensor replaced by its ``DTensorSpec``
    (``.shape``, ``.ndim``, ``.placements``, ``.tensor_meta``) and returns the acceptable shardings on
    one mesh dim: ``(output placements, input placements)`` pairs, one placement per output and
    per argument (``None`` for arguments that are not tensors). On an n-D mesh every combination of
    these per-dim choices is acceptable, and dispatch takes the one whose input redistribution
    moves the fewest bytes. The function replaces the op's built-in rule, if any; decisions cached
    before the registration are forgotten. Output metadata comes from running the op on meta
    tensors, so a custom op needs a fake (meta) kernel, as in PyTorch.
    """
    overloads = list(op) if isinstance(op, list) else [op]
    for overload in overloads:
        if not isinstance(overload, torch._ops.OpOverload):
            raise TypeError(
                f"register_sharding expects an OpOverload (e.g. torch.ops.aten.mul.Tensor) or a list of them, got {overload!r}"
            )

    def register(sharding_fn: _Fn) -> _Fn:
        if not callable(sharding_fn):
            raise TypeError(f"register_sharding decorates a function, got {sharding_fn!r}")
        name = getattr(sharding_fn, "__qualname__", repr(sharding_fn))
        rule = ShardingRule(family=f"register_sharding({name})", one_dim_strategies=_UserStrategies(sharding_fn, name))
        override_rule(overloads, rule)
        clear_all_caches()
        return sharding_fn

    return register


def is_register_sharding_rule(rule: ShardingRule) -> bool:
    """Whether ``rule`` is one that ``register_sharding`` made from a user's function."""
    return isinstance(rule.one_dim_strategies, _UserStrategies)


class _UserStrategies:
    """The user's function as the rule's one-mesh-dim strategies (an object: rules hold no closures)."""

    def __init__(self, sharding_fn: ShardingFn, name: str) -> None:
        self.sharding_fn = sharding_fn
        self.name = name

    def __call__(self, call: OpCall) -> list[OneDimStrategy]:
        acceptable = self.sharding_fn(*call.args, **call.kwargs)
        strategies: list[OneDimStrategy] = []
        num_outputs = len(call.output_metas)
        num_inputs = len(call.input_specs)
        for index, choice in enumerate(acceptable):
            try:
                outputs, inputs = choice
            except (TypeError, ValueError):
                raise TypeError(
                    f"register_sharding function {self.name} for {call.op}: sharding {index} must be a pair "
                    f"(output placements, input placements), got {choice!r}"
                ) from None
            output_tuple = tuple(_check_placement(p, self.name, call.op, "output") for p in outputs)
            # Arguments that are not DTensors have None: the rule sees one placement per DTensor input.
            input_tuple = tuple(
                _check_placement(p, self.name, call.op, "input") for p in inputs if p is not None
            )
            if len(input_tuple) == len(call.all_specs) != num_inputs and any(call.is_out_arg):
                # Placements for the out= tensors too (PyTorch's functions list every argument): those
                # are written with the outputs' layout, not inputs to move.
                input_tuple = tuple(p for p, is_out in zip(input_tuple, call.is_out_arg) if not is_out)
            if len(input_tuple) != num_inputs:
                raise ValueError(
                    f"register_sharding function {self.name} for {call.op}: sharding {index} gives "
                    f"{len(input_tuple)} input placements (not None) but the call has {num_inputs} DTensor inputs"
                )
            if num_outputs and len(output_tuple) != num_outputs:
                raise ValueError(
                    f"register_sharding function {self.name} for {call.op}: sharding {index} gives "
                    f"{len(output_tuple)} output placements but the op has {num_outputs} outputs"
                )
            strategies.append(OneDimStrategy(output_tuple, tuple(p for p in input_tuple if p is not None)))
        return strategies


def _check_placement(value: Any, name: str, op: torch._ops.OpOverload, what: str) -> Placement | None:
    if value is None or isinstance(value, Placement):
        return value
    raise TypeError(f"register_sharding function {name} for {op}: {what} placements must be Placement or None, got {value!r}")
