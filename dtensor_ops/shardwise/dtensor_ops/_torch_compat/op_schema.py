"""PyTorch's ``torch.distributed.tensor._op_schema`` types, and their adapters into shardwise's rules.

PyTorch states a custom op's sharding as a *strategy function*: given an :class:`OpSchema` whose
DTensor arguments are :class:`OpStrategy` objects (the placements each input can come in), it
returns an :class:`OpStrategy` listing the acceptable :class:`OpSpec` s (input specs -> output
specs) over the whole mesh.  Here such a function becomes a real :class:`ShardingRule` of the engine
with a *combined decision*: the engine hands it the call, the function is asked with each input's
current spec as that input's only strategy, and the candidate whose input redistribution moves the
fewest bytes per rank wins (earlier candidates win ties), as PyTorch picks its cheapest candidate.

A strategy function may also answer a :class:`TupleStrategy`: one child ``OpStrategy`` per element of
a list-of-tensors argument (foreach style) or per output.  Each child's cheapest candidate is taken on
its own; element ``i`` of a list argument goes where child ``i`` wants it, a single tensor argument where
child 0 wants it, and the outputs are the children's output specs in order (PyTorch's reading).

A *single-dim strategy* (PyTorch's ``register_single_dim_strategy``) lists, for ONE mesh dim, rows of
placements (outputs first, then every tensor input), with :class:`_ShardingPlaceholder` standing for
"sharded on this tensor dim, the way the inputs are sharded".  It becomes an op-strategy function: the
all-``Replicate`` row is added, placeholders are filled with the sharding kinds the inputs hold, and
:func:`expand_to_full_mesh_op_strategy` takes every combination of rows over the mesh dims; from there
it is chosen exactly like a registered op strategy.

A sharding-prop rule (``OpSchema -> OutputSharding``, PyTorch's older form) becomes a rule the same
way: its ``redistribute_schema`` names where the inputs must be, its ``output_spec`` the outputs.
When an op has several of these registered, the single-dim strategy wins over the op strategy, which
wins over the sharding-prop rule (PyTorch's order).

These types are plain data over ``shardwise.placement`` specs; nothing here communicates.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, TypeVar, Union

import torch

from shardwise.mesh import MeshError
from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta, _StridedShard

from .._caches import clear_all_caches
from .._planner import redistribute_cost_picoseconds
from .._rules import CombinedDecision, OpCall, ShardingPropagationError, ShardingRule, override_rule, restore_rule, rule_for

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
    "OP_SINGLE_DIM_STRATEGY_FUNCS",
    "OP_TO_SCHEMA_INFO_FOR_SINGLE_DIM_STRATEGY",
    "OpInfo",
    "SingleDimStrategyFunc",
    "_ShardingPlaceholder",
    "_SingleDimStrategyInfo",
    "expand_single_dim_strategy",
    "expand_to_full_mesh_op_strategy",
    "generate_redistribute_costs",
    "is_tensor_shardable",
    "prop_rule_as_sharding_rule",
    "register_op_strategy",
    "register_op_strategy_func",
    "register_prop_rule",
    "register_prop_rule_func",
    "register_single_dim_op_strategy_func",
    "register_single_dim_strategy",
    "single_dim_strategy_as_sharding_rule",
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

    def __str__(self) -> str:
        """PyTorch's compact form: ``(S(0), R) -> S(0)`` (one placement string per mesh dim, joined)."""
        shown = _compact(self.output_specs)
        return shown if self.input_specs is None else f"{_compact(self.input_specs)} -> {shown}"

    def input_spec(self, index: int = 0) -> DTensorSpec[Any]:
        if self.input_specs is None or not 0 <= index < len(self.input_specs):
            count = 0 if self.input_specs is None else len(self.input_specs)
            raise IndexError(f"OpSpec.input_spec({index}): this OpSpec has {count} input specs")
        return self.input_specs[index]


def _compact(specs: object) -> str:
    if specs is None:
        return "None"
    if isinstance(specs, DTensorSpec):
        return "".join(str(placement) for placement in specs.placements)
    if isinstance(specs, (list, tuple)):
        return "(" + ", ".join(_compact(spec) for spec in specs) + ")"
    raise TypeError(f"OpSpec: cannot show {type(specs).__name__} {specs!r} as a spec")


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
        """The OpStrategy arguments; with ``schema_info.needs_pytree``, list arguments' elements too (PyTorch's)."""
        return self._strategies_in(self.args_schema)

    @property
    def kwargs_strategy(self) -> tuple[OpStrategy, ...]:
        return self._strategies_in(tuple(self.kwargs_schema.values()))

    def _strategies_in(self, values: Sequence[object]) -> tuple[OpStrategy, ...]:
        flat = _flatten(values)
        if self.schema_info is not None and self.schema_info.needs_pytree:
            flat = [leaf for item in flat for leaf in (item.children if isinstance(item, TupleStrategy) else [item])]
        return tuple(item for item in flat if isinstance(item, OpStrategy))

    @property
    def args_meta(self) -> tuple[object, ...]:
        """The positional arguments as a single-dim strategy sees them: each tensor as its global
        ``TensorMeta`` (a list of tensors as a tuple of them), everything else as it is."""
        return tuple(_as_meta(arg) for arg in self.args_schema)

    @property
    def kwargs_meta(self) -> dict[str, object]:
        """The keyword arguments as a single-dim strategy sees them (see :attr:`args_meta`)."""
        return {name: _as_meta(value) for name, value in self.kwargs_schema.items()}

    def get_mesh_from_args(self, validate: bool = True) -> Any:
        meshes = [item.mesh for item in _flatten(self.args_schema) if isinstance(item, (DTensorSpec, OpStrategy))]
        if not meshes:
            raise ValueError(f"{self.op}: no DTensorSpec or OpStrategy among the arguments, so there is no mesh")
        if validate and any(mesh != meshes[0] for mesh in meshes[1:]):
            raise MeshError(
                f"DTensor does not support cross-mesh operation on {self.op}! Got meshes: {meshes}. "
                "Please make sure all the arguments have the same DeviceMesh."
            )
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


def _as_meta(value: object) -> object:
    if isinstance(value, OpStrategy):
        return value.tensor_meta
    if isinstance(value, DTensorSpec):
        return value.tensor_meta
    if isinstance(value, TupleStrategy):
        return tuple(_as_meta(child) for child in value.children)
    if isinstance(value, list):
        return [_as_meta(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_as_meta(item) for item in value)
    return value


def _flatten(values: Sequence[object]) -> list[object]:
    flat: list[object] = []
    for value in values:
        if isinstance(value, (list, tuple)):
            flat.extend(_flatten(value))
        else:
            flat.append(value)
    return flat


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


# ----------------------------------------------------------------------------- adapters into rules


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
    return OpSchema(call.op, args, kwargs, schema_info=OP_TO_SCHEMA_INFO.get(call.op))


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


# PyTorch's registries on its propagator (op_single_dim_strategy_funcs, op_strategy_funcs, op_to_rules and
# their schema infos): what users registered in PyTorch's forms.  The engine itself reads the rules these
# became (_rules): for each op, the highest of single-dim strategy, op strategy, sharding-prop rule.
_V = TypeVar("_V")


class _Registry(dict[torch._ops.OpOverload, _V]):
    """One of PyTorch's per-op registries.  Removing an op's entry (``del``, ``pop``: PyTorch's tests and
    users unregister this way) gives the engine the op's next registration, or the rule it had before any."""

    def __delitem__(self, overload: torch._ops.OpOverload) -> None:
        super().__delitem__(overload)
        _reinstall_after_removal(overload)

    def pop(self, overload: torch._ops.OpOverload, *default: Any) -> Any:
        present = overload in self
        value = super().pop(overload, *default)
        if present:
            _reinstall_after_removal(overload)
        return value


OP_SINGLE_DIM_STRATEGY_FUNCS: _Registry[_SingleDimStrategyInfo] = _Registry()
OP_STRATEGY_FUNCS: _Registry[Callable[[OpSchema], StrategyType]] = _Registry()
OP_TO_RULES: _Registry[Callable[[OpSchema], OutputSharding]] = _Registry()
class _SchemaInfoRegistry(_Registry[RuntimeSchemaInfo]):
    """``op_to_schema_info``: what was registered, and for ops given a sharding by ``register_sharding``
    (a rule of the engine, not an entry here) the info PyTorch's ``register_sharding`` derives: the first
    int argument is static, int keyword-only arguments are static keys, lists of tensors are walked."""

    def __missing__(self, overload: torch._ops.OpOverload) -> RuntimeSchemaInfo:
        derived = _registered_sharding_schema_info(overload)
        if derived is None:
            raise KeyError(overload)
        return derived

    def __contains__(self, overload: object) -> bool:
        if super().__contains__(overload):
            return True
        return isinstance(overload, torch._ops.OpOverload) and _registered_sharding_schema_info(overload) is not None

    def get(self, overload: torch._ops.OpOverload, default: Any = None) -> Any:
        return self[overload] if overload in self else default


def _registered_sharding_schema_info(overload: torch._ops.OpOverload) -> RuntimeSchemaInfo | None:
    from ..experimental._register_sharding import is_register_sharding_rule

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


OP_TO_SCHEMA_INFO: _SchemaInfoRegistry = _SchemaInfoRegistry()
OP_TO_SCHEMA_INFO_FOR_SINGLE_DIM_STRATEGY: _Registry[RuntimeSchemaInfo] = _Registry()

# The engine's rule of each op before its first PyTorch-style registration (None: it had none).
_RULES_BEFORE_REGISTRATION: dict[torch._ops.OpOverload, ShardingRule | None] = {}


def _install_registered_rule(overload: torch._ops.OpOverload) -> None:
    """Give the engine the rule of the op's highest registration (PyTorch's precedence) and forget decisions."""
    name = str(overload)
    if overload in OP_SINGLE_DIM_STRATEGY_FUNCS:
        rule = single_dim_strategy_as_sharding_rule(name, OP_SINGLE_DIM_STRATEGY_FUNCS[overload])
    elif overload in OP_STRATEGY_FUNCS:
        rule = strategy_as_sharding_rule(name, OP_STRATEGY_FUNCS[overload])
    else:
        rule = prop_rule_as_sharding_rule(name, OP_TO_RULES[overload])
    replaced = override_rule([overload], rule)
    _RULES_BEFORE_REGISTRATION.setdefault(overload, replaced[overload])
    clear_all_caches()


def _reinstall_after_removal(overload: torch._ops.OpOverload) -> None:
    if overload in OP_SINGLE_DIM_STRATEGY_FUNCS or overload in OP_STRATEGY_FUNCS or overload in OP_TO_RULES:
        _install_registered_rule(overload)
        return
    if overload in _RULES_BEFORE_REGISTRATION:
        restore_rule(overload, _RULES_BEFORE_REGISTRATION.pop(overload))
    clear_all_caches()


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
    registered for it), and forget cached decisions."""
    (overload,) = _overloads(op, "register_op_strategy")
    OP_STRATEGY_FUNCS[overload] = strategy_func
    if schema_info is not None:
        OP_TO_SCHEMA_INFO[overload] = schema_info
    _install_registered_rule(overload)


def register_prop_rule_func(
    op: torch._ops.OpOverload,
    rule_func: Callable[[OpSchema], OutputSharding],
    schema_info: RuntimeSchemaInfo | None = None,
) -> None:
    """Record ``rule_func`` (``OpSchema -> OutputSharding``) as the op's sharding-prop rule (it becomes the op's
    rule unless a strategy of either kind is registered for it)."""
    (overload,) = _overloads(op, "register_sharding_prop_rule")
    OP_TO_RULES[overload] = rule_func
    if schema_info is not None:
        OP_TO_SCHEMA_INFO[overload] = schema_info
    _install_registered_rule(overload)


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
    OP_SINGLE_DIM_STRATEGY_FUNCS[overload] = info
    if schema_info is not None:
        OP_TO_SCHEMA_INFO_FOR_SINGLE_DIM_STRATEGY[overload] = schema_info
    _install_registered_rule(overload)


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
