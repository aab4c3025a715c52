"""PyTorch's strategy helpers: candidate costs, the shardability test, and single-dim strategies expanded over a mesh.

A *single-dim strategy* (PyTorch's ``register_single_dim_strategy``) lists, for ONE mesh dim, rows of
placements (outputs first, then every tensor input), with :class:`_ShardingPlaceholder` standing for
"sharded on this tensor dim, the way the inputs are sharded".  :func:`expand_single_dim_strategy` adds
the all-``Replicate`` row, fills the placeholders with the sharding kinds the inputs hold, and
:func:`expand_to_full_mesh_op_strategy` takes every combination of rows over the mesh dims as candidate
:class:`OpSpec` s.  Plain data over ``shardwise.placement`` specs; nothing here communicates.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

import torch

from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta, _StridedShard

from .._planner import redistribute_cost_picoseconds
from .._rules import ShardingPropagationError
from .strategy_types import ArgsType, KwargsType, OpSchema, OpSpec, OpStrategy, OutputSpecType, TupleStrategy

__all__ = [
    "SingleDimRow",
    "SingleDimStrategyFunc",
    "_ShardingPlaceholder",
    "_SingleDimStrategyInfo",
    "expand_single_dim_strategy",
    "expand_to_full_mesh_op_strategy",
    "generate_redistribute_costs",
    "is_tensor_shardable",
]


def generate_redistribute_costs(src_strategy: OpStrategy, dst_spec: DTensorSpec[Any]) -> list[float]:
    """Microseconds to move each of ``src_strategy``'s output specs to ``dst_spec`` (one OpSpec cost row),
    priced as ``redistribute_cost``: the fastest plan under the mesh's cost profile."""
    return [_cost(strategy.output_spec, dst_spec.placements) for strategy in src_strategy.strategies]


def _cost(spec: DTensorSpec[Any], target: tuple[Placement, ...]) -> float:
    if tuple(spec.placements) == tuple(target):
        return 0.0
    return redistribute_cost_picoseconds(spec, spec.with_placements(tuple(target))) * 1e-6


def _strategy_inputs(schema: OpSchema) -> list[OpStrategy]:
    """Every tensor input's strategy in call order: positional arguments (list elements one by one), then keywords."""
    found: list[OpStrategy] = []

    def visit(value: object) -> None:
        if isinstance(value, OpStrategy):
            found.append(value)
        elif isinstance(value, TupleStrategy):
            for child in value.children:
                visit(child)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    for arg in schema.args_schema:
        visit(arg)
    for value in schema.kwargs_schema.values():
        visit(value)
    return found


def _current_spec(strategy: OpStrategy) -> DTensorSpec[Any]:
    if len(strategy.strategies) != 1:
        raise ValueError(
            f"an input OpStrategy must hold its current spec only (one OpSpec), got {len(strategy.strategies)} OpSpecs"
        )
    return strategy.strategies[0].output_spec


def is_tensor_shardable(shape: Sequence[int], spec: DTensorSpec[Any], allow_unbacked_sharding: bool | None = None) -> bool:
    """Whether every sharded tensor dim of ``shape`` has at least one element per shard (PyTorch's test).

    Uneven shards pass; a dim smaller than its number of shards (some shard empty) does not.  For sizes
    that are symbolic and unknown, ``allow_unbacked_sharding`` decides: None asks for the value (may
    raise a data-dependent error), True assumes shardable, False assumes not.
    """
    from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true

    shards_per_dim = [1] * len(shape)
    for mesh_dim, placement in enumerate(spec.placements):
        if not isinstance(placement, (Shard, _StridedShard)):
            continue
        if not -len(shape) <= placement.dim < len(shape):
            return False
        dim = placement.dim % len(shape)
        shards_per_dim[dim] *= spec.mesh.size(mesh_dim)
        needed = shards_per_dim[dim] * (placement.split_factor if isinstance(placement, _StridedShard) else 1)
        too_small = shape[dim] < needed
        if allow_unbacked_sharding is None:
            if bool(too_small):
                return False
        elif allow_unbacked_sharding:
            if guard_or_false(too_small):
                return False
        elif guard_or_true(too_small):
            return False
    return True


class _ShardingPlaceholder:
    """In a single-dim strategy: sharded on tensor dim ``dim``, in whatever sharding kind the inputs use.

    Filled in per call with each kind found among the inputs' placements (``Shard``, or
    ``_StridedShard`` with its split factor); a row with placeholders is dropped when no input is
    sharded.
    """

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def __repr__(self) -> str:
        return f"_ShardingPlaceholder(dim={self.dim})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ShardingPlaceholder) and other.dim == self.dim

    def __hash__(self) -> int:
        return hash((_ShardingPlaceholder, self.dim))


SingleDimRow = Sequence[Union[Placement, _ShardingPlaceholder, None]]
# (op, args with tensors as TensorMeta, kwargs likewise) -> rows: placements of the outputs, then of every tensor input.
SingleDimStrategyFunc = Callable[[torch._ops.OpOverload, ArgsType, KwargsType], Sequence[SingleDimRow]]


@dataclass
class _SingleDimStrategyInfo:
    """A single-dim strategy function with its options (PyTorch's record of a registration).

    ``allow_uneven_sharding``: an input may stay sharded as it is even where a dim has fewer elements
    than shards (otherwise such candidates are dropped, as PyTorch does).  ``allow_unbacked_sharding``:
    see :func:`is_tensor_shardable`.  ``different_mesh_args``: positions of arguments that may live on
    another mesh (replicated); shardwise runs an op on one mesh only, so a registration naming any is refused.
    """

    func: SingleDimStrategyFunc
    allow_unbacked_sharding: bool | None = None
    allow_uneven_sharding: bool = False
    different_mesh_args: list[int] | None = None

    def __call__(self, op: torch._ops.OpOverload, args: ArgsType, kwargs: KwargsType) -> Sequence[SingleDimRow]:
        return self.func(op, args, kwargs)


def _mixes_partial_kinds(spec: DTensorSpec[Any]) -> bool:
    """Partial placements of different kinds on one tensor (sum with avg excepted: they commute)."""
    kinds = {(type(p), p.reduce_op) for p in spec.placements if isinstance(p, Partial)}
    return len(kinds) > 1 and not (len({kind for kind, _ in kinds}) == 1 and {op for _, op in kinds} == {"sum", "avg"})


def expand_to_full_mesh_op_strategy(
    mesh: Any,
    op_schema: OpSchema,
    single_mesh_dim_strategies: Sequence[Sequence[Placement | None]],
    *,
    output_tensor_meta: TensorMeta | Sequence[TensorMeta | None] | None = None,
    input_index: int = 1,
    inplace_op: bool = False,
    allow_unbacked_sharding: bool | None = None,
    allow_uneven_sharding: bool = False,
    is_valid_strategy_cb: Callable[[list[DTensorSpec[Any]], Any], bool] | None = None,
    different_mesh_args: list[int] | None = None,
) -> OpStrategy:
    """Every combination of one-mesh-dim rows over the mesh's dims, as candidate OpSpecs (PyTorch's helper).

    A row holds ``input_index`` output placements, then one placement per tensor input (None for an
    absent tensor).  Combinations are dropped where a tensor would mix Partial kinds, where an in-place
    op's ``self`` (or an ``out=`` tensor) would change placements, or where an input dim would have
    fewer elements than shards (unless ``allow_uneven_sharding`` and the input is already so), or that
    ``is_valid_strategy_cb(input_specs, output_specs)`` rejects.  Each candidate carries its cost rows
    (:func:`generate_redistribute_costs`, in bytes per rank).
    """
    if different_mesh_args:
        raise NotImplementedError(
            f"{op_schema.op}: different_mesh_args={different_mesh_args} asks for inputs on another mesh; shardwise "
            "runs an op on one mesh (put those inputs on the op's mesh, replicated)"
        )
    inputs = _strategy_inputs(op_schema)
    current = [_current_spec(strategy) for strategy in inputs]
    rows = [tuple(row) for row in single_mesh_dim_strategies]
    for row in rows:
        if len(row) != input_index + len(inputs):
            raise ValueError(
                f"{op_schema.op}: a one-mesh-dim strategy row has {len(row)} placements; expected {input_index} "
                f"outputs + {len(inputs)} tensor inputs = {input_index + len(inputs)}: {row}"
            )
    output_metas: list[TensorMeta | None]
    if isinstance(output_tensor_meta, TensorMeta):
        output_metas = [output_tensor_meta]
    elif output_tensor_meta is None:
        output_metas = []
    else:
        output_metas = list(output_tensor_meta)
    out_specs_given = _out_argument_specs(op_schema)
    candidates: list[OpSpec] = []
    blocked_inplace = False
    for combination in itertools.product(rows, repeat=mesh.ndim):
        specs: list[DTensorSpec[Any] | None] = []
        for position, placements in enumerate(zip(*combination)):
            if placements[0] is None:
                if any(placement is not None for placement in placements):
                    raise ValueError(
                        f"{op_schema.op}: position {position} of the strategy rows is None on some mesh dims and "
                        f"a placement on others: {placements}"
                    )
                specs.append(None)
                continue
            if position < input_index:
                meta = output_metas[position] if position < len(output_metas) else None
            else:
                meta = current[position - input_index].tensor_meta
            specs.append(DTensorSpec(mesh, tuple(placements), tensor_meta=meta))
        if any(spec is not None and _mixes_partial_kinds(spec) for spec in specs):
            continue
        input_specs = [spec for spec in specs[input_index:] if spec is not None]
        if len(input_specs) != len(inputs):
            raise ValueError(
                f"{op_schema.op}: a candidate names {len(input_specs)} input specs (None left out); the call has "
                f"{len(inputs)} tensor inputs"
            )
        if inplace_op and (
            input_specs[0].placements != current[0].placements
            or (specs[0] is not None and specs[0].placements != current[0].placements)
        ):
            blocked_inplace = True
            continue
        if any(
            index >= len(specs) or specs[index] is None or specs[index].placements != spec.placements  # type: ignore[union-attr]
            for index, spec in enumerate(out_specs_given)
        ):
            continue
        if not all(
            is_tensor_shardable(spec.shape, spec, allow_unbacked_sharding)
            or (allow_uneven_sharding and spec.placements == now.placements)
            for spec, now in zip(input_specs, current)
        ):
            continue
        output_specs: OutputSpecType
        if input_index == 0:
            output_specs = None
        elif input_index == 1:
            if specs[0] is None:
                raise ValueError(f"{op_schema.op}: the single output's placement is None in a strategy row")
            output_specs = specs[0]
        else:
            output_specs = tuple(specs[:input_index])
        if is_valid_strategy_cb is not None and output_specs is not None:
            if not is_valid_strategy_cb(input_specs, output_specs):
                continue
        candidates.append(
            OpSpec(
                output_specs=output_specs,
                input_specs=input_specs,
                redistribute_cost=[
                    generate_redistribute_costs(strategy, spec) for strategy, spec in zip(inputs, input_specs)
                ],
            )
        )
    if not candidates and blocked_inplace:
        raise ShardingPropagationError(
            f"{op_schema.op}: in-place operations that require placement changes are not supported: the input has "
            f"placements {current[0].placements} and no strategy keeps them. Use the out-of-place op instead."
        )
    return OpStrategy(candidates)


def _out_argument_specs(schema: OpSchema) -> list[DTensorSpec[Any]]:
    """The current specs of the ``out=`` tensors given as keywords, in the schema's order."""
    found = []
    for argument in schema.op._schema.arguments:
        if argument.is_out and isinstance(schema.kwargs_schema.get(argument.name), OpStrategy):
            found.append(_current_spec(schema.kwargs_schema[argument.name]))  # type: ignore[arg-type]
    return found


def _fill_placeholders(
    rows: Sequence[SingleDimRow], input_specs: Sequence[DTensorSpec[Any]]
) -> list[tuple[Placement | None, ...]]:
    """Rows with each placeholder made concrete once per sharding kind the inputs hold."""
    kinds: dict[object, Callable[[int], Placement]] = {}
    for spec in input_specs:
        for placement in spec.placements:
            if isinstance(placement, _StridedShard):
                factor = placement.split_factor
                kinds.setdefault(("strided", factor), lambda dim, factor=factor: _StridedShard(dim, split_factor=factor))  # type: ignore[misc]
            elif isinstance(placement, Shard):
                kinds.setdefault("shard", Shard)
    filled: list[tuple[Placement | None, ...]] = []
    for row in rows:
        if not any(isinstance(item, _ShardingPlaceholder) for item in row):
            filled.append(tuple(row))  # type: ignore[arg-type]
            continue
        for make in kinds.values():
            filled.append(tuple(make(item.dim) if isinstance(item, _ShardingPlaceholder) else item for item in row))
    return filled


def expand_single_dim_strategy(
    info: _SingleDimStrategyInfo | SingleDimStrategyFunc,
    op_schema: OpSchema,
    output_metas: Sequence[TensorMeta | None],
) -> OpStrategy:
    """A single-dim strategy asked for this call and expanded over the whole mesh into candidate OpSpecs.

    ``op_schema`` holds each tensor input as an OpStrategy of its current spec; ``output_metas`` has
    one entry per output (None for a non-tensor one).  The all-``Replicate`` row is added first
    unless the function lists it.
    """
    record = info if isinstance(info, _SingleDimStrategyInfo) else _SingleDimStrategyInfo(info)
    op = op_schema.op
    inputs = _strategy_inputs(op_schema)
    if not inputs:
        raise ValueError(f"{op}: no tensor input among the arguments; a single-dim strategy needs one")
    current = [_current_spec(strategy) for strategy in inputs]
    mesh = current[0].mesh
    rows = [tuple(row) for row in record.func(op, op_schema.args_meta, op_schema.kwargs_meta)]
    expected = len(output_metas) + len(inputs)
    for row in rows:
        if len(row) != expected:
            raise ValueError(
                f"{op}: the single-dim strategy gave a row of {len(row)} placements {row}; expected {expected}: one per "
                f"output ({len(output_metas)}) then one per tensor input ({len(inputs)}, list elements one by one, "
                "keyword tensors included)"
            )
        for item in row:
            if item is not None and not isinstance(item, (Placement, _ShardingPlaceholder)):
                raise TypeError(
                    f"{op}: the single-dim strategy gave {item!r} in a row; expected a Placement, a "
                    "_ShardingPlaceholder or None"
                )
    replicate_row = tuple(
        None if index < len(output_metas) and output_metas[index] is None else Replicate() for index in range(expected)
    )
    if not any(all(item is None or isinstance(item, Replicate) for item in row) for row in rows):
        rows.insert(0, replicate_row)
    filled = _fill_placeholders(rows, current)
    single_output = len(output_metas) == 1
    return expand_to_full_mesh_op_strategy(
        mesh,
        op_schema,
        filled,
        output_tensor_meta=(output_metas[0] if single_output else tuple(output_metas)),
        input_index=len(output_metas),
        inplace_op=op_schema.is_inplace_op(),
        allow_unbacked_sharding=record.allow_unbacked_sharding,
        allow_uneven_sharding=record.allow_uneven_sharding,
        different_mesh_args=record.different_mesh_args,
    )
