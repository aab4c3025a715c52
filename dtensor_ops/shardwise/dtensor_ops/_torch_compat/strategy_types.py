"""PyTorch's ``_op_schema`` data classes over ``shardwise.placement`` specs: what a strategy function sees and answers.

:class:`OpSchema` is an op call with DTensors replaced by their specs (or, for strategy functions, by
:class:`OpStrategy`: the placements each input can come in); an :class:`OpStrategy` lists acceptable
:class:`OpSpec` s (input specs -> output specs); a :class:`TupleStrategy` holds one strategy per element
of a list-of-tensors argument or per output; :class:`OutputSharding` is a sharding-prop rule's answer.
Plain data; nothing here communicates.  Served, with the rest of PyTorch's names, by ``op_schema``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, Union

import torch

from shardwise.mesh import MeshError
from shardwise.placement import DTensorSpec, Placement, TensorMeta

__all__ = [
    "ArgsType",
    "KwargsType",
    "OpInfo",
    "OpSchema",
    "OpSpec",
    "OpStrategy",
    "OutputSharding",
    "OutputSpecType",
    "PlacementList",
    "RuntimeSchemaInfo",
    "StrategyType",
    "TupleStrategy",
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
