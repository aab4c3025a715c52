"""PyTorch-style sharding functions as rules of shardwise's engine: choosing among a strategy's candidates.

A strategy function (``OpSchema`` of :class:`OpStrategy` inputs -> :class:`OpStrategy` of candidate
:class:`OpSpec` s) becomes a :class:`ShardingRule` with a *combined decision*: the engine hands it the
call, the function is asked with each input's current spec as that input's only strategy, and the
candidate whose input redistribution moves the fewest bytes per rank wins (earlier candidates win ties),
as PyTorch picks its cheapest candidate.

A strategy function may also answer a :class:`TupleStrategy`: one child ``OpStrategy`` per element of
a list-of-tensors argument (foreach style) or per output.  Each child's cheapest candidate is taken on
its own; element ``i`` of a list argument goes where child ``i`` wants it, a single tensor argument where
child 0 wants it, and the outputs are the children's output specs in order (PyTorch's reading).

A single-dim strategy is expanded over the mesh (``strategy_expansion``) and then chosen exactly like an
op strategy.  A sharding-prop rule (``OpSchema -> OutputSharding``, PyTorch's older form) becomes a rule
the same way: its ``redistribute_schema`` names where the inputs must be, its ``output_spec`` the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from shardwise.placement import DTensorSpec, Placement

from .._engine import ENGINE
from .._rules import CombinedDecision, OpCall, ShardingPropagationError, ShardingRule
from .strategy_expansion import _cost, _SingleDimStrategyInfo, expand_single_dim_strategy
from .strategy_types import OpSchema, OpSpec, OpStrategy, OutputSharding, OutputSpecType, StrategyType, TupleStrategy, _flatten

__all__ = [
    "prop_rule_as_sharding_rule",
    "replace_specs",
    "single_dim_strategy_as_sharding_rule",
    "strategy_as_sharding_rule",
]


def replace_specs(value: object, replace: Callable[[DTensorSpec[Any]], object]) -> object:
    """``value`` with each spec in it (also inside lists and tuples) replaced by ``replace(spec)``, in order."""
    if isinstance(value, DTensorSpec):
        return replace(value)
    if isinstance(value, list):
        return [replace_specs(item, replace) for item in value]
    if isinstance(value, tuple):
        return tuple(replace_specs(item, replace) for item in value)
    return value


def _as_strategy(value: object) -> object:
    """An argument as a strategy function sees it: a spec becomes an OpStrategy, a list a TupleStrategy."""
    if isinstance(value, DTensorSpec):
        return OpStrategy([OpSpec(output_specs=value)])
    if isinstance(value, (list, tuple)) and any(isinstance(item, DTensorSpec) for item in value):
        return TupleStrategy([_as_strategy(item) for item in value])  # type: ignore[misc]
    return value


def _schema_of(call: OpCall, as_strategies: bool, keep_out: bool = False) -> OpSchema:
    """The call as PyTorch's OpSchema (written ``out=`` tensors left out unless ``keep_out``: the engine's
    rule inputs never include them)."""
    convert: Callable[[object], object] = _as_strategy if as_strategies else (lambda value: value)
    out_names = set() if keep_out else {position for position, is_out in zip(_positions(call), call.is_out_arg) if is_out}
    args = tuple(convert(arg) for arg in call.args)
    kwargs = {name: convert(value) for name, value in call.kwargs.items() if name not in out_names}
    # PyTorch's op_to_schema_info, owned by the engine (registration changes forget the decisions made from it).
    return OpSchema(call.op, args, kwargs, schema_info=ENGINE.registrations.schema_info.get(call.op))


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


def _candidate_rank(call: OpCall, targets: Mapping[int, tuple[Placement, ...]], order: int) -> tuple[int, float, int, int]:
    """How a candidate ranks: moving a written tensor last, then bytes moved per rank, then placements
    changed (a free local chunk still loses to staying put, as PyTorch prefers no redistribution among
    zero-cost candidates), then the function's own order."""
    moves_written = any(
        index in targets and targets[index] != tuple(spec.placements) for index, spec in call.kept_inputs.items()
    )
    cost = 0.0
    changed = 0
    for index, target in targets.items():
        spec = call.input_specs[index]
        cost += _cost(spec, target)
        changed += sum(1 for have, want in zip(spec.placements, target) if have != want)
    return (int(moves_written), cost, changed, order)


def _cheapest_op_spec(call: OpCall, strategy: OpStrategy, source: str) -> CombinedDecision:
    """The cheapest candidate of an OpStrategy as the engine's decision (outputs as the candidate gives them)."""
    if not strategy.strategies:
        raise ShardingPropagationError(f"{call.op}: {source} returned an OpStrategy with no candidate OpSpecs")
    best: CombinedDecision | None = None
    best_rank: tuple[int, float, int, int] | None = None
    for order, candidate in enumerate(strategy.strategies):
        inputs = _input_placements(call.op, candidate.input_specs, call, source)
        outputs = _output_placements(call.op, candidate.output_specs, call, source)
        rank = _candidate_rank(call, dict(enumerate(inputs)), order)
        if best_rank is None or rank < best_rank:
            best_rank, best = rank, CombinedDecision(inputs, outputs)
    assert best is not None
    return best


def _tensor_arguments(call: OpCall) -> list[tuple[int, list[int]]]:
    """Each positional argument holding DTensors, in order: (whether it is a list, the rule inputs it holds).

    As PyTorch reads a TupleStrategy, its index among these is the input index in a child's OpSpecs."""
    arguments: list[tuple[int, list[int]]] = []
    for position, arg in enumerate(call.args):
        if isinstance(arg, DTensorSpec):
            arguments.append((0, [index for index, at in enumerate(call.input_positions) if at == position]))
        elif isinstance(arg, (list, tuple)) and any(isinstance(item, DTensorSpec) for item in _flatten(arg)):
            arguments.append((1, [index for index, at in enumerate(call.input_positions) if at == position]))
    return arguments


def _cheapest_per_child(call: OpCall, strategy: TupleStrategy, source: str) -> CombinedDecision:
    """A TupleStrategy as the engine's decision: each child (an OpStrategy) picks its cheapest candidate;
    list element ``i`` goes where child ``i`` wants it, a single tensor argument where child 0 wants it,
    keyword tensors stay; the outputs are the children's output specs, in order.

    As in PyTorch, a child's candidates are ranked by moving every input they name.  Unlike PyTorch, a
    child after the first only takes candidates that read the single tensor arguments where child 0
    put them (PyTorch would run such a child on inputs laid out otherwise: wrong shapes or values);
    if it has none, the error says so.
    """
    children = strategy.children
    if not children:
        raise ShardingPropagationError(f"{call.op}: {source} returned a TupleStrategy with no children")
    for index, child in enumerate(children):
        if not isinstance(child, OpStrategy) or not child.strategies:
            what = "no candidate OpSpecs" if isinstance(child, OpStrategy) else type(child).__name__
            raise ShardingPropagationError(
                f"{call.op}: {source} returned a TupleStrategy whose child {index} is {what}; expected an "
                "OpStrategy of candidates per list element or output"
            )
    arguments = _tensor_arguments(call)
    for is_list, held in arguments:
        if is_list and len(held) > len(children):
            raise ShardingPropagationError(
                f"{call.op}: {source} returned a TupleStrategy of {len(children)} children for a list of "
                f"{len(held)} tensors; expected one child per element"
            )

    def named(child_index: int, candidate: OpSpec) -> tuple[dict[int, tuple[Placement, ...]], dict[int, tuple[Placement, ...]]]:
        """(this child's list elements, the single tensor arguments): rule input -> placements the candidate names."""
        if candidate.input_specs is None:
            return {}, {}
        if len(candidate.input_specs) != len(arguments):
            raise ShardingPropagationError(
                f"{call.op}: {source} gave child {child_index} an OpSpec with {len(candidate.input_specs)} input specs; "
                f"expected one per tensor or tensor-list argument ({len(arguments)})"
            )
        elements: dict[int, tuple[Placement, ...]] = {}
        singles: dict[int, tuple[Placement, ...]] = {}
        for (is_list, held), spec in zip(arguments, candidate.input_specs):
            if not isinstance(spec, DTensorSpec):
                raise ShardingPropagationError(f"{call.op}: {source} gave input spec {spec!r}; expected a DTensorSpec")
            _check_mesh(call.op, spec, call, source)
            if is_list and child_index < len(held):
                elements[held[child_index]] = tuple(spec.placements)
            elif not is_list:
                singles.update((index, tuple(spec.placements)) for index in held)
        return elements, singles

    targets: dict[int, tuple[Placement, ...]] = {}
    fixed_singles: dict[int, tuple[Placement, ...]] | None = None
    output_specs: list[DTensorSpec[Any] | None] = []
    for child_index, child in enumerate(children):
        assert isinstance(child, OpStrategy)
        best: tuple[tuple[int, int, float, int, int], OpSpec] | None = None
        for order, candidate in enumerate(child.strategies):
            elements, singles = named(child_index, candidate)
            disagreeing = fixed_singles is not None and any(
                fixed_singles.get(index, want) != want for index, want in singles.items()
            )
            rank = (int(disagreeing), *_candidate_rank(call, {**elements, **singles}, order))
            if best is None or rank < best[0]:
                best = (rank, candidate)
        assert best is not None
        (disagrees, *_), chosen = best
        elements, singles = named(child_index, chosen)
        if disagrees:
            raise ShardingPropagationError(
                f"{call.op}: {source} returned a TupleStrategy whose child {child_index} has no candidate reading the "
                f"single tensor arguments where child 0 puts them ({fixed_singles}); every child must accept child 0's "
                "placements of the arguments they share"
            )
        if fixed_singles is None:
            fixed_singles = singles
            targets.update(singles)
        targets.update(elements)
        if chosen.output_specs is not None:
            if not isinstance(chosen.output_specs, DTensorSpec):
                raise ShardingPropagationError(
                    f"{call.op}: {source} gave child {child_index} an OpSpec with {type(chosen.output_specs).__name__} "
                    "output specs; a TupleStrategy child gives one DTensorSpec (its output)"
                )
            output_specs.append(chosen.output_specs)
    inputs = tuple(targets.get(index, tuple(spec.placements)) for index, spec in enumerate(call.input_specs))
    outputs = _output_placements(call.op, tuple(output_specs), call, source) if call.output_metas else ()
    return CombinedDecision(inputs, outputs)


def _choose(call: OpCall, strategy: object, source: str) -> CombinedDecision:
    if isinstance(strategy, OpStrategy):
        return _cheapest_op_spec(call, strategy, source)
    if isinstance(strategy, TupleStrategy):
        return _cheapest_per_child(call, strategy, source)
    raise ShardingPropagationError(
        f"{call.op}: {source} returned {type(strategy).__name__}; expected an OpStrategy of candidate OpSpecs or a "
        "TupleStrategy of them"
    )


@dataclass(frozen=True)
class _StrategyDecision:
    """A PyTorch strategy function as a combined decision: its cheapest candidate."""

    op_name: str
    strategy_func: Callable[[OpSchema], StrategyType]

    def __call__(self, call: OpCall) -> CombinedDecision:
        source = f"the op strategy registered for {self.op_name}"
        return _choose(call, self.strategy_func(_schema_of(call, as_strategies=True)), source)


@dataclass(frozen=True, eq=False)
class _SingleDimDecision:
    """A single-dim strategy as a combined decision: expanded over the mesh, then chosen as an op strategy."""

    op_name: str
    info: _SingleDimStrategyInfo

    def __call__(self, call: OpCall) -> CombinedDecision:
        source = f"the single-dim strategy registered for {self.op_name}"
        # PyTorch's rows name out= tensors among the inputs; the engine's decision does not.
        expanded = expand_single_dim_strategy(
            self.info, _schema_of(call, as_strategies=True, keep_out=True), call.output_metas
        )
        if any(call.is_out_arg):
            for candidate in expanded.strategies:
                assert candidate.input_specs is not None
                candidate.input_specs = [
                    spec for spec, is_out in zip(candidate.input_specs, call.is_out_arg) if not is_out
                ]
        return _choose(call, expanded, source)


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


def single_dim_strategy_as_sharding_rule(op_name: str, info: _SingleDimStrategyInfo) -> ShardingRule:
    """A PyTorch single-dim strategy as a rule of shardwise's engine (through the op-strategy choice)."""
    return ShardingRule(
        family=f"register_single_dim_strategy({op_name})",
        combined_decision=_SingleDimDecision(op_name, info),
        output_meta=_any_output_meta,
    )


def prop_rule_as_sharding_rule(op_name: str, rule_func: Callable[[OpSchema], OutputSharding]) -> ShardingRule:
    """A PyTorch sharding-prop rule function as a rule of shardwise's engine."""
    return ShardingRule(
        family=f"register_sharding_prop_rule({op_name})",
        combined_decision=_PropRuleDecision(op_name, rule_func),
        output_meta=_any_output_meta,
    )
