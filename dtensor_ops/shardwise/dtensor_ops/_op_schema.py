"""PyTorch's ``torch.distributed.tensor._op_schema`` types, and their adapters into shardwise's rules.

PyTorch states a custom op's sharding as a *strategy function*: given an :class:`OpSchema` whose
DTensor arguments are :class:`OpStrategy` objects (the placements each input can come in), it
returns an :class:`OpStrategy` listing the acceptable :class:`OpSpec` s (input specs -> output
specs) over the whole mesh.  Here such a function becomes a real :class:`ShardingRule` of the engine
with a *combined decision*: the engine hands it the call, the function is asked with each input's
current spec as that input's only strategy, and the candidate whose input redistribution moves the
fewest bytes per rank wins (earlier candidates win ties), as PyTorch picks its cheapest candidate.

A sharding-prop rule (``OpSchema -> OutputSharding``, PyTorch's older form) becomes a rule the same
way: its ``redistribute_schema`` names where the inputs must be, its ``output_spec`` the outputs.

These types are plain data over ``shardwise.placement`` specs; nothing here communicates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, Union

import torch

from shardwise.placement import DTensorSpec, Placement, TensorMeta

from ._caches import clear_all_caches
from ._redistribute_plan import redistribute_cost_bytes
from ._rules import CombinedDecision, OpCall, ShardingPropagationError, ShardingRule, override_rule

__all__ = [
    "ArgsType",
    "KwargsType",
    "OpSchema",
    "OpSpec",
    "OpStrategy",
    "OutputSharding",
    "OutputSpecType",
    "PlacementList",
    "RuntimeSchemaInfo",
    "StrategyType",
    "TupleStrategy",
    "OP_STRATEGY_FUNCS",
    "OP_TO_RULES",
    "OP_TO_SCHEMA_INFO",
    "OpInfo",
    "generate_redistribute_costs",
    "prop_rule_as_sharding_rule",
    "register_op_strategy",
    "register_op_strategy_func",
    "register_prop_rule_func",
    "strategy_as_sharding_rule",
]

ArgsType = tuple[object, ...]
KwargsType = dict[str, object]
# One placement per tensor (outputs first, then inputs) for one mesh dim; None for a non-tensor.
PlacementList = list[Union[Placement, None]]
OutputSpecType = Union[DTensorSpec[Any], Sequence[Union[DTensorSpec[Any], None]], None]


@dataclass(frozen=True)
class RuntimeSchemaInfo:
    """Which non-tensor arguments may change an op's sharding (PyTorch's cache hints).

    Kept for compatibility: shardwise keys its decision cache on every argument, so these only
    document the op (``static_argnum``: first positional argument that matters, ``static_kwargkey``:
    keyword arguments that matter, ``needs_pytree``: tensors nested in lists).
    """

    static_argnum: int = 100
    static_kwargkey: list[str] | None = None
    needs_pytree: bool = False


@dataclass
class OpSpec:
    """One acceptable sharding of an op: the specs of its outputs for the given input specs.

    ``output_specs``: a spec for a single-tensor result, a tuple (None for non-tensor outputs) for
    several.  ``input_specs``: one per DTensor argument in order (lists flattened); None means the
    inputs stay where they are.  ``redistribute_cost``: PyTorch's per-input cost rows; shardwise
    ranks candidates by its own planner's bytes moved instead.
    """

    output_specs: OutputSpecType
    input_specs: Sequence[DTensorSpec[Any]] | None = None
    redistribute_cost: list[list[float]] | None = None

    @property
    def output_spec(self) -> DTensorSpec[Any]:
        if isinstance(self.output_specs, DTensorSpec):
            return self.output_specs
        raise ValueError(
            f"OpSpec.output_spec: this OpSpec has {type(self.output_specs).__name__} output specs, expected a single "
            "DTensorSpec (read output_specs for ops with several outputs)"
        )

    @property
    def mesh(self) -> Any:
        specs = self.output_specs if isinstance(self.output_specs, (tuple, list)) else (self.output_specs,)
        for spec in (*specs, *(self.input_specs or ())):
            if isinstance(spec, DTensorSpec):
                return spec.mesh
        raise ValueError("OpSpec.mesh: no DTensorSpec among the output or input specs")

    def input_spec(self, index: int = 0) -> DTensorSpec[Any]:
        if self.input_specs is None or not 0 <= index < len(self.input_specs):
            count = 0 if self.input_specs is None else len(self.input_specs)
            raise IndexError(f"OpSpec.input_spec({index}): this OpSpec has {count} input specs")
        return self.input_specs[index]


class StrategyType:
    """Base of :class:`OpStrategy` (one tensor) and :class:`TupleStrategy` (a list of tensors)."""


class OpStrategy(StrategyType):
    """The acceptable shardings of one tensor (an input's current placements, or an op's candidates)."""

    def __init__(self, strategies: list[OpSpec]) -> None:
        self.strategies = list(strategies)

    def _first_output_spec(self) -> DTensorSpec[Any]:
        if not self.strategies:
            raise ValueError("OpStrategy has no strategies")
        return self.strategies[0].output_spec

    @property
    def mesh(self) -> Any:
        return self._first_output_spec().mesh

    @property
    def tensor_meta(self) -> TensorMeta:
        meta = self._first_output_spec().tensor_meta
        if meta is None:
            raise ValueError("OpStrategy.tensor_meta: its first OpSpec's output spec carries no tensor_meta")
        return meta

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.tensor_meta.shape)

    @property
    def ndim(self) -> int:
        return len(self.tensor_meta.shape)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    def __repr__(self) -> str:
        return f"OpStrategy({self.strategies!r})"


class TupleStrategy(StrategyType):
    """One strategy per element of a list-of-tensors argument or result."""

    def __init__(self, children: Sequence[StrategyType]) -> None:
        self.children = list(children)

    @property
    def childs(self) -> list[StrategyType]:  # PyTorch's older spelling
        return self.children

    def __repr__(self) -> str:
        return f"TupleStrategy({self.children!r})"


@dataclass
class OpSchema:
    """An op call with DTensors replaced by their specs (or, for strategy functions, by OpStrategy)."""

    op: torch._ops.OpOverload
    args_schema: ArgsType
    kwargs_schema: KwargsType = field(default_factory=dict)
    schema_info: RuntimeSchemaInfo | None = None

    @property
    def args_spec(self) -> tuple[DTensorSpec[Any], ...]:
        """The DTensor specs among the positional arguments (lists flattened)."""
        return tuple(item for item in _flatten(self.args_schema) if isinstance(item, DTensorSpec))

    @property
    def args_strategy(self) -> tuple[OpStrategy, ...]:
        return tuple(item for item in _flatten(self.args_schema) if isinstance(item, OpStrategy))

    @property
    def kwargs_strategy(self) -> tuple[OpStrategy, ...]:
        return tuple(item for item in _flatten(tuple(self.kwargs_schema.values())) if isinstance(item, OpStrategy))

    def get_mesh_from_args(self, validate: bool = True) -> Any:
        meshes = [item.mesh for item in _flatten(self.args_schema) if isinstance(item, (DTensorSpec, OpStrategy))]
        if not meshes:
            raise ValueError(f"{self.op}: no DTensorSpec or OpStrategy among the arguments, so there is no mesh")
        if validate and any(mesh != meshes[0] for mesh in meshes[1:]):
            raise ValueError(f"{self.op}: the arguments are on different meshes {meshes}; expected one mesh")
        return meshes[0]

    def is_inplace_op(self) -> bool:
        name = self.op._schema.name
        return name[-1] == "_" and not name.endswith("__")

    def is_out_variant_op(self) -> bool:
        return "out" in self.op._schema.overload_name


@dataclass
class OutputSharding:
    """A sharding-prop rule's answer: the output specs, and where the inputs must be first (if moved)."""

    output_spec: OutputSpecType
    redistribute_schema: OpSchema | None = None
    needs_redistribute: bool = False
    use_val_from_redistribute_schema: bool = False


@dataclass
class OpInfo:
    """One op call as PyTorch's dispatcher packs it; ``ShardingPropagator.propagate`` fills ``output_sharding``."""

    compute_mesh: Any
    schema: OpSchema | None
    flat_args_schema: list[object] = field(default_factory=list)
    local_args: Sequence[object] = ()
    local_kwargs: dict[str, object] = field(default_factory=dict)
    args_tree_spec: Any = None
    output_sharding: OutputSharding | None = None


def _flatten(values: Sequence[object]) -> list[object]:
    flat: list[object] = []
    for value in values:
        if isinstance(value, (list, tuple)):
            flat.extend(_flatten(value))
        else:
            flat.append(value)
    return flat


def generate_redistribute_costs(src_strategy: OpStrategy, dst_spec: DTensorSpec[Any]) -> list[float]:
    """Bytes per rank to move each of ``src_strategy``'s output specs to ``dst_spec`` (one OpSpec cost row)."""
    return [_cost(strategy.output_spec, dst_spec.placements) for strategy in src_strategy.strategies]


def _cost(spec: DTensorSpec[Any], target: tuple[Placement, ...]) -> float:
    if tuple(spec.placements) == tuple(target):
        return 0.0
    return float(redistribute_cost_bytes(spec, spec.with_placements(tuple(target))))


# ----------------------------------------------------------------------------- adapters into rules


def _replace_specs(value: object, replace: Callable[[DTensorSpec[Any]], object]) -> object:
    if isinstance(value, DTensorSpec):
        return replace(value)
    if isinstance(value, list):
        return [_replace_specs(item, replace) for item in value]
    if isinstance(value, tuple):
        return tuple(_replace_specs(item, replace) for item in value)
    return value


def _as_strategy(value: object) -> object:
    """An argument as a strategy function sees it: a spec becomes an OpStrategy, a list a TupleStrategy."""
    if isinstance(value, DTensorSpec):
        return OpStrategy([OpSpec(output_specs=value)])
    if isinstance(value, (list, tuple)) and any(isinstance(item, DTensorSpec) for item in value):
        return TupleStrategy([_as_strategy(item) for item in value])  # type: ignore[misc]
    return value


def _schema_of(call: OpCall, as_strategies: bool) -> OpSchema:
    """The call as PyTorch's OpSchema (written ``out=`` tensors are left out, as the rule never sees them)."""
    convert: Callable[[object], object] = _as_strategy if as_strategies else (lambda value: value)
    out_names = {position for position, is_out in zip(_positions(call), call.is_out_arg) if is_out}
    args = tuple(convert(arg) for arg in call.args)
    kwargs = {name: convert(value) for name, value in call.kwargs.items() if name not in out_names}
    return OpSchema(call.op, args, kwargs)


def _positions(call: OpCall) -> tuple[object, ...]:
    positions: list[object] = []
    for index, arg in enumerate(call.args):
        positions.extend([index] * sum(1 for item in _flatten((arg,)) if isinstance(item, DTensorSpec)))
    for name, value in call.kwargs.items():
        positions.extend([name] * sum(1 for item in _flatten((value,)) if isinstance(item, DTensorSpec)))
    return tuple(positions)


def _output_placements(
    op: torch._ops.OpOverload, output_specs: OutputSpecType, call: OpCall, source: str
) -> tuple[tuple[Placement, ...] | None, ...]:
    flat = [output_specs] if not isinstance(output_specs, (tuple, list)) else list(output_specs)
    if len(flat) != len(call.output_metas):
        raise ShardingPropagationError(
            f"{op}: {source} gave {len(flat)} output specs, but the op returns {len(call.output_metas)} outputs"
        )
    placements: list[tuple[Placement, ...] | None] = []
    for index, (spec, meta) in enumerate(zip(flat, call.output_metas)):
        if meta is None:
            placements.append(None)
            continue
        if not isinstance(spec, DTensorSpec):
            raise ShardingPropagationError(
                f"{op}: {source} gave {spec!r} for output {index}, a tensor; expected a DTensorSpec"
            )
        _check_mesh(op, spec, call, source)
        placements.append(tuple(spec.placements))
    return tuple(placements)


def _check_mesh(op: torch._ops.OpOverload, spec: DTensorSpec[Any], call: OpCall, source: str) -> None:
    if spec.mesh != call.mesh:
        raise ShardingPropagationError(
            f"{op}: {source} gave a spec on mesh {spec.mesh}, but the inputs are on mesh {call.mesh}"
        )


def _input_placements(
    op: torch._ops.OpOverload, input_specs: Sequence[DTensorSpec[Any]] | None, call: OpCall, source: str
) -> tuple[tuple[Placement, ...], ...]:
    if input_specs is None:
        return tuple(tuple(spec.placements) for spec in call.input_specs)
    if len(input_specs) != len(call.input_specs):
        raise ShardingPropagationError(
            f"{op}: {source} gave {len(input_specs)} input specs, but the call has {len(call.input_specs)} DTensor "
            "inputs (one spec per DTensor argument, lists flattened, in order)"
        )
    for spec in input_specs:
        if not isinstance(spec, DTensorSpec):
            raise ShardingPropagationError(f"{op}: {source} gave input spec {spec!r}; expected a DTensorSpec")
        _check_mesh(op, spec, call, source)
    return tuple(tuple(spec.placements) for spec in input_specs)


@dataclass(frozen=True)
class _StrategyDecision:
    """A PyTorch strategy function as a combined decision: its cheapest candidate."""

    op_name: str
    strategy_func: Callable[[OpSchema], StrategyType]

    def __call__(self, call: OpCall) -> CombinedDecision:
        source = f"the op strategy registered for {self.op_name}"
        strategy = self.strategy_func(_schema_of(call, as_strategies=True))
        if not isinstance(strategy, OpStrategy):
            raise ShardingPropagationError(
                f"{call.op}: {source} returned {type(strategy).__name__}; expected an OpStrategy of candidate OpSpecs "
                "(TupleStrategy results are not supported)"
            )
        if not strategy.strategies:
            raise ShardingPropagationError(f"{call.op}: {source} returned an OpStrategy with no candidate OpSpecs")
        best: CombinedDecision | None = None
        best_rank: tuple[int, float] | None = None
        for candidate in strategy.strategies:
            inputs = _input_placements(call.op, candidate.input_specs, call, source)
            outputs = _output_placements(call.op, candidate.output_specs, call, source)
            # Candidates that would move a tensor the op writes cannot run; rank them last so the
            # engine's check names the problem only when nothing else fits.
            moves_written = any(inputs[index] != tuple(spec.placements) for index, spec in call.kept_inputs.items())
            cost = sum(_cost(spec, target) for spec, target in zip(call.input_specs, inputs))
            rank = (int(moves_written), cost)
            if best_rank is None or rank < best_rank:
                best_rank, best = rank, CombinedDecision(inputs, outputs)
        assert best is not None
        return best


@dataclass(frozen=True)
class _PropRuleDecision:
    """A PyTorch sharding-prop rule (``OpSchema -> OutputSharding``) as a combined decision."""

    op_name: str
    rule_func: Callable[[OpSchema], OutputSharding]

    def __call__(self, call: OpCall) -> CombinedDecision:
        source = f"the sharding prop rule registered for {self.op_name}"
        sharding = self.rule_func(_schema_of(call, as_strategies=False))
        if not isinstance(sharding, OutputSharding):
            raise ShardingPropagationError(
                f"{call.op}: {source} returned {type(sharding).__name__}; expected an OutputSharding"
            )
        if sharding.output_spec is None and call.output_metas:
            raise ShardingPropagationError(
                f"{call.op}: {source} gave no output spec (output_spec=None) and no other layout; the inputs "
                "cannot be run as they are"
            )
        moved = sharding.redistribute_schema
        inputs = _input_placements(call.op, None if moved is None else moved.args_spec, call, source)
        return CombinedDecision(inputs, _output_placements(call.op, sharding.output_spec, call, source))


def _any_output_meta(op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]) -> None:
    """No shape rule: the engine runs the op on meta tensors for its outputs' metadata."""
    return None


def strategy_as_sharding_rule(op_name: str, strategy_func: Callable[[OpSchema], StrategyType]) -> ShardingRule:
    """A PyTorch op-strategy function as a rule of shardwise's engine."""
    return ShardingRule(
        family=f"register_op_strategy({op_name})",
        combined_decision=_StrategyDecision(op_name, strategy_func),
        output_meta=_any_output_meta,
    )


def prop_rule_as_sharding_rule(op_name: str, rule_func: Callable[[OpSchema], OutputSharding]) -> ShardingRule:
    """A PyTorch sharding-prop rule function as a rule of shardwise's engine."""
    return ShardingRule(
        family=f"register_sharding_prop_rule({op_name})",
        combined_decision=_PropRuleDecision(op_name, rule_func),
        output_meta=_any_output_meta,
    )


# PyTorch's registries on its propagator (op_strategy_funcs, op_to_rules, op_to_schema_info): what
# users registered in PyTorch's forms.  The engine itself reads the rules these became (_rules).
OP_STRATEGY_FUNCS: dict[torch._ops.OpOverload, Callable[[OpSchema], StrategyType]] = {}
OP_TO_RULES: dict[torch._ops.OpOverload, Callable[[OpSchema], OutputSharding]] = {}
OP_TO_SCHEMA_INFO: dict[torch._ops.OpOverload, RuntimeSchemaInfo] = {}


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
    """Make ``strategy_func`` the rule of ``op`` (replacing any), and forget cached decisions."""
    (overload,) = _overloads(op, "register_op_strategy")
    override_rule([overload], strategy_as_sharding_rule(str(overload), strategy_func))
    OP_STRATEGY_FUNCS[overload] = strategy_func
    OP_TO_RULES.pop(overload, None)
    if schema_info is not None:
        OP_TO_SCHEMA_INFO[overload] = schema_info
    clear_all_caches()


def register_prop_rule_func(
    op: torch._ops.OpOverload,
    rule_func: Callable[[OpSchema], OutputSharding],
    schema_info: RuntimeSchemaInfo | None = None,
) -> None:
    """Make ``rule_func`` (``OpSchema -> OutputSharding``) the rule of ``op`` (replacing any)."""
    (overload,) = _overloads(op, "register_sharding_prop_rule")
    override_rule([overload], prop_rule_as_sharding_rule(str(overload), rule_func))
    OP_TO_RULES[overload] = rule_func
    OP_STRATEGY_FUNCS.pop(overload, None)
    if schema_info is not None:
        OP_TO_SCHEMA_INFO[overload] = schema_info
    clear_all_caches()


_StrategyFunc = Callable[[OpSchema], StrategyType]


def register_op_strategy(
    op: torch._ops.OpOverload | list[torch._ops.OpOverload], schema_info: RuntimeSchemaInfo | None = None
) -> Callable[[_StrategyFunc], _StrategyFunc]:
    """Decorator (PyTorch's ``_ops.utils.register_op_strategy``): the function becomes the op's strategy."""
    overloads = _overloads(op, "register_op_strategy")

    def register(strategy_func: _StrategyFunc) -> _StrategyFunc:
        for overload in overloads:
            register_op_strategy_func(overload, strategy_func, schema_info)
        return strategy_func

    return register
