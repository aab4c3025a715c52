"""What a sharding rule is, and the registry that maps each aten overload to its rule (a leaf of dtensor_ops).

A rule describes one op family on ONE mesh dim: the list of :class:`OneDimStrategy`
it can run under (what every DTensor input must be on that mesh dim, and what the
outputs then are).  ``_sharding_prop`` extends that to any n-D mesh by taking the
product over mesh dims, filters the combinations with the rule's ``is_valid``
hook, and keeps the one whose input redistribution is cheapest.

Everything a rule returns is plain data (tuples of placements), and rules are
module-level functions registered once at import: nothing here is created per
call, so a compiled fast path can hold the resulting decisions.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import torch

from shardwise.placement import SUPPORTED_REDUCE_OPS, DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta

from ._decision import ArgPosition, OpDecision
from ._engine import ENGINE

__all__ = [
    "override_rule",
    "ArgPosition",
    "CombinedDecision",
    "CombinedDecisionFn",
    "DecideFn",
    "LINEAR_REDUCE_OPS",
    "OneDimStrategy",
    "StrategiesFn",
    "OpCall",
    "OutputMetaFn",
    "PlacementsPerTensor",
    "RandomDraw",
    "ShardingPropagationError",
    "ShardingRule",
    "aten_overloads",
    "broadcast_input_placement",
    "partial_survives_cast",
    "register_rule",
    "registered_ops",
    "rule_for",
]


# Reductions that commute with any linear map: sum_i(c * x_i) == c * sum_i(x_i), same for avg.
LINEAR_REDUCE_OPS: tuple[str, ...] = ("sum", "avg")

# One entry per tensor (input or output), each a placement per mesh dim.
PlacementsPerTensor = tuple[tuple[Placement, ...], ...]

# (op, args, kwargs with DTensors as specs) -> the global metadata of the output(s), or None when unsure.
OutputMetaFn = Callable[
    [torch._ops.OpOverload, Sequence[object], Mapping[str, object]],
    TensorMeta | tuple[TensorMeta | None, ...] | None,
]

# The engine's own cached decision for another op's call (specs in place of DTensors): what a rule composed
# of other ops' decisions (a _foreach_* element) asks.  Handed to rules on the call, never imported by them.
DecideFn = Callable[[torch._ops.OpOverload, Sequence[object], Mapping[str, object]], OpDecision]


class RandomDraw(enum.Enum):
    """Whether an op's kernel draws from a random generator, and how its values are laid out.

    ``VALUES``: it draws values laid out like its first tensor output (the written tensor of an
    in-place op), so each shard gets its own stream (see ``_shard_rng``).  ``FILL_IGNORING_SELF``: an
    in-place fill that ignores ``self``'s old values; on a ``Partial(sum)`` self the parts must add up
    to one draw, so one rank per such mesh dim keeps the values and the others hold zeros.
    """

    NONE = "none"
    VALUES = "values"
    FILL_IGNORING_SELF = "fill ignoring self"


class OneDimStrategy(NamedTuple):
    """A valid way to run an op on one mesh dim.

    ``inputs`` has one placement per DTensor input the rule sees (flattened argument
    order, ``out=`` tensors excluded); ``outputs`` one per flattened output, ``None``
    for an output that is not a tensor.
    """

    outputs: tuple[Placement | None, ...]
    inputs: tuple[Placement, ...]


@dataclass(frozen=True, eq=False)
class OpCall:
    """Everything a rule may look at for one call, with DTensors replaced by their specs.

    ``output_metas`` are the global metadata of the flattened outputs.
    ``decide`` is the engine's cached propagation for *other* calls (rules composed of per-element
    decisions use it; nothing else should).
    ``partial_reduce_ops`` are the reduce ops of the Partial placements that the
    call's DTensors (inputs and written tensors) hold *on the mesh dim being
    considered*.  Rules offer strategies that carry a Partial through (``P -> P``)
    only for those kinds: carrying a partial defers a reduction that is pending
    anyway, while making a partial out of a Shard or Replicate input (a free,
    local step) would only create a reduction somebody pays for later.  Partials
    an op creates itself (a sharded contraction or reduction) do not depend on it.
    """

    op: torch._ops.OpOverload
    args: tuple[object, ...]
    kwargs: Mapping[str, object]
    input_specs: tuple[DTensorSpec[Any], ...]
    input_positions: tuple[ArgPosition, ...]
    output_metas: tuple[TensorMeta | None, ...]
    partial_reduce_ops: frozenset[str]
    # Set by the engine: its own cached decision for another op's call (see DecideFn).
    decide: DecideFn | None = None
    # The engine's own view of the call (rules need not read these): every DTensor argument in
    # flattened order (out= ones included) and which of them are out= arguments; the output
    # structure ("single", "sequence", "none"); the rule inputs / outputs a written tensor pins to its
    # current spec (self of in-place ops, out=); whether argument 0 is written.
    all_specs: tuple[DTensorSpec[Any], ...] = ()
    is_out_arg: tuple[bool, ...] = ()
    structure: str = "single"
    kept_inputs: Mapping[int, DTensorSpec[Any]] = field(default_factory=dict)
    kept_outputs: Mapping[int, DTensorSpec[Any]] = field(default_factory=dict)
    inplace: bool = False

    @property
    def mesh(self) -> Any:
        return self.input_specs[0].mesh

    def input_meta(self, index: int) -> TensorMeta:
        meta = self.input_specs[index].tensor_meta
        assert meta is not None, "propagation checks that every input spec carries tensor_meta"
        return meta

    def input_shape(self, index: int) -> torch.Size:
        return self.input_meta(index).shape

    def output_shape(self, index: int = 0) -> torch.Size:
        meta = self.output_metas[index]
        if meta is None:
            raise ValueError(f"{self.op}: output {index} is not a tensor")
        return meta.shape

    def arg(self, index: int, name: str, default: object = None) -> object:
        """The argument at positional ``index`` or passed as keyword ``name``; ``default`` if absent."""
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)

    def input_index_at(self, position: ArgPosition) -> int | None:
        """Which rule input is the (tensor) argument at ``position``; None if that argument is no DTensor."""
        for index, input_position in enumerate(self.input_positions):
            if input_position == position:
                return index
        return None

    def linear_reduce_ops(self) -> tuple[str, ...]:
        """Partial kinds a linear op carries through: the linear ones (sum, avg) present on this mesh dim."""
        return tuple(op for op in LINEAR_REDUCE_OPS if op in self.partial_reduce_ops)

    def every_reduce_op(self) -> tuple[str, ...]:
        """Partial kinds an element-moving op (view, copy) carries through: every ``Partial(kind)`` present on
        this mesh dim (a ``_NormPartial``'s own p-norm reduction is not a ``Partial`` kind: it is reduced first)."""
        return tuple(sorted(op for op in self.partial_reduce_ops if op in SUPPORTED_REDUCE_OPS))

    def placements_keeping_values_unread(self, tensor_ndim: int) -> list[Placement]:
        """Every placement an input whose values the op never reads may keep as it is (on this mesh dim)."""
        keep: list[Placement] = [Shard(dim) for dim in range(tensor_ndim)]
        keep.append(Replicate())
        keep.extend(Partial(reduce_op) for reduce_op in self.every_reduce_op())
        return keep


StrategiesFn = Callable[[OpCall], Sequence[OneDimStrategy]]
# call -> (n-D placements per rule input, n-D placements per output (None: not a tensor)), chosen directly
class CombinedDecision(NamedTuple):
    """A rule's direct n-D choice: placements per rule input, per output (None: not a tensor), and,
    for rules without ``output_meta`` whose outputs are known only through the choice (a ``_foreach_*``
    op's outputs are its elements' outputs), the outputs' global metadata."""

    inputs: PlacementsPerTensor
    outputs: tuple[tuple[Placement, ...] | None, ...]
    output_metas: tuple[TensorMeta | None, ...] | None = None


CombinedDecisionFn = Callable[[OpCall], CombinedDecision]


class ShardingPropagationError(RuntimeError):
    """An op has a rule, but none of its strategies fits the call (e.g. in place on a layout it cannot keep)."""
# (call, placements per rule input, placements per output (None: not a tensor)) -> is this n-D combination exact?
ValidityFn = Callable[[OpCall, PlacementsPerTensor, tuple[tuple[Placement, ...] | None, ...]], bool]
# (call, chosen output specs (flattened)) -> argument replacements for the local op
OverridesFn = Callable[[OpCall, tuple[DTensorSpec[Any] | None, ...]], tuple[tuple[ArgPosition, object], ...]]
# (call, chosen n-D placements per rule input, chosen output specs (flattened)) -> what runs on the local
# tensors instead of the op (taking the op's own arguments), or None to run the op itself.  Used where the
# shard-local computation is not the op (e.g. a lookup in a row-sharded table masks out-of-range ids); the
# kernel must be plain data (an instance of a module-level frozen dataclass with __call__), never a closure.
LocalKernelFn = Callable[[OpCall, PlacementsPerTensor, tuple[DTensorSpec[Any] | None, ...]], Callable[..., Any] | None]


@dataclass(frozen=True)
class ShardingRule:
    """How one op family shards, stated for one mesh dim.

    ``scalar_values_matter``: False when only the *type* of each top-level Python
    number argument can change the decision (pointwise ops, fills): the cache key
    then holds ``float`` instead of ``2.5``, so ``x * 2.0`` and ``x * 3.0`` share
    one decision.  ``tensor_outputs``: False for ops returning a Python value
    (the op is not run on meta tensors and the decision has no output specs).
    ``output_meta`` computes the single output's global metadata by shape rules
    (see :mod:`._shapes`); when absent or unsure, the op runs on meta tensors.

    ``combined_decision`` replaces ``one_dim_strategies`` for families whose n-D
    choice is composed of other decisions (a ``_foreach_*`` op: one engine decision
    per list element); it returns the chosen n-D placements of every rule input and
    output, and the engine skips its per-mesh-dim product.  Exactly one of the two
    is given.  A combined-decision rule with tensor outputs and no ``output_meta``
    returns the outputs' metadata with its choice (the call's ``output_metas`` are
    then empty when it is asked).

    ``local_kernel`` names what runs on the local tensors instead of the op for
    the chosen combination (see ``LocalKernelFn``); absent or None: the op itself.
    A kernel computes on this rank's pieces only: it never communicates (a reduction
    across ranks is a Partial output).

    ``random``: whether (and how) the op draws random values (see :class:`RandomDraw`);
    dispatch then runs it in this rank's shard stream.

    ``validity_reads_strided_shards``: ``is_valid`` judges ``_StridedShard`` placements itself (the
    view rule); otherwise the engine hands it a combination's ``Shard`` equivalent (see
    ``_propagation._is_valid``).
    """

    family: str
    one_dim_strategies: StrategiesFn | None = None
    is_valid: ValidityFn | None = None
    local_arg_overrides: OverridesFn | None = None
    scalar_values_matter: bool = True
    tensor_outputs: bool = True
    output_meta: OutputMetaFn | None = None
    combined_decision: CombinedDecisionFn | None = None
    local_kernel: LocalKernelFn | None = None
    random: RandomDraw = RandomDraw.NONE
    validity_reads_strided_shards: bool = False

    def __post_init__(self) -> None:
        if (self.one_dim_strategies is None) == (self.combined_decision is None):
            raise ValueError(
                f"sharding rule {self.family!r}: give exactly one of one_dim_strategies and combined_decision"
            )


# The one rule registry, held by the engine (``_engine.ENGINE.rules``): a change goes through the functions
# below, which start a new engine generation (every cached decision forgotten) when a rule really changes.
_RULES: dict[torch._ops.OpOverload, ShardingRule] = ENGINE.rules


def register_rule(ops: Iterable[torch._ops.OpOverload], rule: ShardingRule) -> None:
    """Give each overload in ``ops`` the ``rule``; an overload may have only one rule."""
    added = False
    for op in ops:
        existing = _RULES.get(op)
        if existing is not None and existing is not rule:
            raise ValueError(
                f"{op} already has the {existing.family!r} sharding rule; refusing to replace it with {rule.family!r}"
            )
        added = added or existing is None
        _RULES[op] = rule
    if added:
        ENGINE.changed("rules")


def override_rule(ops: Iterable[torch._ops.OpOverload], rule: ShardingRule) -> dict[torch._ops.OpOverload, ShardingRule | None]:
    """Give each overload in ``ops`` the ``rule`` even if it has one (users' ``register_sharding``).

    Returns the rules replaced (None where there was none).  Decisions made with the old rules are
    forgotten (a new engine generation).
    """
    replaced: dict[torch._ops.OpOverload, ShardingRule | None] = {}
    for op in ops:
        replaced[op] = _RULES.get(op)
        _RULES[op] = rule
    ENGINE.changed("rules")
    return replaced


def restore_rule(op: torch._ops.OpOverload, rule: ShardingRule | None) -> None:
    """Undo :func:`override_rule` for ``op``: put back the rule it replaced (None: the op has no rule again).

    Decisions made with the overriding rule are forgotten, as after ``override_rule``.
    """
    if rule is None:
        _RULES.pop(op, None)
    else:
        _RULES[op] = rule
    ENGINE.changed("rules")


def rule_for(op: torch._ops.OpOverload) -> ShardingRule | None:
    return _RULES.get(op)


def registered_ops() -> frozenset[torch._ops.OpOverload]:
    return frozenset(_RULES)


def _takes_and_returns_tensors(op: torch._ops.OpOverload) -> bool:
    schema = op._schema
    takes_tensor = any(isinstance(argument.type, torch.TensorType) for argument in schema.arguments)
    returns_tensor = any(isinstance(ret.type, torch.TensorType) for ret in schema.returns)
    return takes_tensor and returns_tensor


def aten_overloads(
    names: Iterable[str], *, overloads: Iterable[str] | None = None, with_inplace: bool = True
) -> list[torch._ops.OpOverload]:
    """The tensor overloads of ``aten.<name>`` (and ``aten.<name>_`` when ``with_inplace``).

    ``overloads`` restricts to those overload names (e.g. ``("default", "out")``);
    overloads on Python numbers only (``aten.add.int``) are never included.
    """
    wanted = None if overloads is None else frozenset(overloads)
    found: list[torch._ops.OpOverload] = []
    for name in names:
        packet_names = [name, name + "_"] if with_inplace else [name]
        for packet_name in packet_names:
            packet = getattr(torch.ops.aten, packet_name, None)
            if packet is None:
                continue
            for overload_name in packet.overloads():
                if wanted is not None and overload_name not in wanted:
                    continue
                op = getattr(packet, overload_name)
                if _takes_and_returns_tensors(op):
                    found.append(op)
    return found


def broadcast_input_placement(out_shape: Sequence[int], in_shape: Sequence[int], out_dim: int) -> Placement:
    """Placement an input broadcast to ``out_shape`` needs when the output is sharded on ``out_dim``.

    Shard on the matching input dim when the input really has that extent;
    Replicate when it is missing there or broadcast from size 1 (every shard of
    the output then reads all of it).
    """
    in_dim = out_dim - (len(out_shape) - len(in_shape))
    if in_dim >= 0 and in_shape[in_dim] == out_shape[out_dim]:
        return Shard(in_dim)
    return Replicate()


def partial_survives_cast(source: torch.dtype, target: torch.dtype, reduce_op: str) -> bool:
    """Whether converting each partial value to ``target`` keeps ``reduce_op`` of them meaningful.

    Sums, averages and products survive conversions between floating/complex types (only
    rounding changes), not into integers or bool (rounding each part then adding
    is not rounding the sum).  Max/min survive monotone conversions between real
    types, which excludes bool (``-1 -> True``) and complex.
    """
    if source == target:
        return True
    if reduce_op in LINEAR_REDUCE_OPS or reduce_op == "product":
        return target.is_floating_point or target.is_complex
    real_ordered = not (source.is_complex or target.is_complex or source == torch.bool or target == torch.bool)
    return real_ordered
