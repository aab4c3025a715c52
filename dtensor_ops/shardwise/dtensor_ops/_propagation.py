"""The rule engine: one op call decided by its sharding rule (a layer of the decision pipeline).

Given the op's :class:`ShardingRule` and the call with every DTensor replaced by its spec,
:func:`decide_with_rule` returns a plain-data :class:`OpDecision`:

1. the call is sorted out (:func:`_prepare_call`): which DTensors the rule sees, which ones the op
   writes (they must stay where they are), the outputs' global metadata (the rule's ``output_meta``,
   else the op run once on meta tensors);
2. a rule in *strategy* mode lists its valid strategies for ONE mesh dim, to which the engine adds
   their variants on an input's ``_StridedShard`` layout where those are exact (:func:`_strided_variants`);
   the n-D candidates are their product over the mesh dims, filtered by the rule's exactness check,
   and the chosen one redistributes the inputs in the least time under the mesh's cost profile, then
   changes the fewest placements, then comes first in enumeration order (deterministic on every
   rank); a rule in *combined* mode chooses the n-D placements itself and is checked;
3. the decision is completed with the local argument overrides, local kernel and random plan the
   rule asks for (per simulated rank under torch's LocalTensorMode).

What asks the engine, and in which order with the other deciders, is ``_decision_pipeline``.
Pure: no collectives, no cache (the pipeline caches).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, Mapping, Sequence, cast

import torch

from shardwise.mesh import MeshError
from shardwise.placement import (
    DTensorSpec,
    Partial,
    Placement,
    Shard,
    TensorMeta,
    _StridedShard,
    compute_local_shape,
    holds_same_values,
)

from ._caches import SHARED_CACHES, SYMBOLIC, lookup, store
from ._decision import ArgPosition, OpDecision, OutputSpecs
from ._ops import OneDimStrategy, OpCall, RandomDraw, ShardingRule
from ._shard_rng import plan_random_draw
from ._planner import redistribute_cost_picoseconds
from ._rules import DecideFn, ShardingPropagationError
from ._call_schema import schema_facts
from ._simulated_kernels import local_arg_overrides_for_each_simulated_rank, local_kernel_for_each_simulated_rank

__all__ = [
    "ShardingPropagationError",
    "collect_specs",
    "decide_with_rule",
    "describe_inputs",
    "run_on_meta",
]

# --------------------------------------------------------------------------- decision


def _describe_placements(spec: DTensorSpec[Any]) -> str:
    if len(spec.placements) == 1:
        return repr(spec.placements[0])
    return "(" + ", ".join(repr(placement) for placement in spec.placements) + ")"


def describe_inputs(specs: Sequence[DTensorSpec[Any]]) -> str:
    return ", ".join(_describe_placements(spec) for spec in specs)


def collect_specs(
    op: torch._ops.OpOverload,
    value: object,
    position: ArgPosition,
    specs: list[DTensorSpec[Any]],
    positions: list[ArgPosition],
) -> None:
    if isinstance(value, DTensorSpec):
        specs.append(value)
        positions.append(position)
    elif isinstance(value, (list, tuple)):
        for item in value:
            collect_specs(op, item, position, specs, positions)
    elif isinstance(value, torch.Tensor) and value.dim() > 0:
        raise TypeError(
            f"{op}: argument {position!r} is a plain torch.Tensor of shape {tuple(value.shape)} mixed with "
            "DTensors; only 0-dim plain tensors (scalars) may be mixed in. Convert it with "
            "distribute_tensor or DTensor.from_local first."
        )


def _meta_tensor(shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype, device="meta")


def _to_meta(value: object) -> object:
    if isinstance(value, DTensorSpec):
        meta = value.tensor_meta
        assert meta is not None
        return _meta_tensor(meta.shape, meta.stride, meta.dtype)
    if isinstance(value, torch.Tensor):
        return _meta_tensor(value.shape, value.stride(), value.dtype)
    if isinstance(value, list):
        return [_to_meta(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_to_meta(item) for item in value)
    return value


def _tensor_meta(tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(tensor.shape, tuple(tensor.stride()), tensor.dtype)


STRUCTURE_SINGLE, STRUCTURE_SEQUENCE, STRUCTURE_NONE = "single", "sequence", "none"


def run_on_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> tuple[str, tuple[TensorMeta | None, ...]]:
    """Global output metadata: the op run once on meta tensors of the inputs' global shapes."""
    meta_args = [_to_meta(arg) for arg in args]
    meta_kwargs = {name: _to_meta(value) for name, value in kwargs.items()}
    if "device" in meta_kwargs:
        meta_kwargs["device"] = torch.device("meta")  # never allocate the global tensor for real
    if meta_kwargs.get("pin_memory"):
        meta_kwargs["pin_memory"] = False
    result = op(*meta_args, **meta_kwargs)
    if isinstance(result, torch.Tensor):
        return STRUCTURE_SINGLE, (_tensor_meta(result),)
    if isinstance(result, (list, tuple)):
        return STRUCTURE_SEQUENCE, tuple(_tensor_meta(item) if isinstance(item, torch.Tensor) else None for item in result)
    return STRUCTURE_NONE, ()


def _check_inputs(op: torch._ops.OpOverload, specs: Sequence[DTensorSpec[Any]]) -> None:
    mesh = specs[0].mesh
    for index, spec in enumerate(specs):
        if spec.tensor_meta is None:
            raise ValueError(f"{op}: the spec of DTensor argument {index} has no tensor_meta ({spec}); it is required")
        if spec.mesh != mesh:
            # PyTorch raises RuntimeError here: MeshError is both that and the ValueError we raised before.
            raise MeshError(
                f"Cannot run {op} on inputs with different meshes: got {mesh!r} and {spec.mesh!r}. "
                f"{op}: DTensor arguments live on different device meshes; expected all of them on the same mesh"
            )


def _check_strategy_shapes(
    op: torch._ops.OpOverload, rule: ShardingRule, strategies: Sequence[OneDimStrategy], inputs: int, outputs: int
) -> None:
    for strategy in strategies:
        if len(strategy.inputs) != inputs or len(strategy.outputs) != outputs:
            raise AssertionError(
                f"the {rule.family!r} rule gave {op} a strategy for {len(strategy.inputs)} inputs and "
                f"{len(strategy.outputs)} outputs; the call has {inputs} DTensor inputs and {outputs} outputs"
            )


def _same_layout(held: Sequence[Placement], wanted: Sequence[Placement]) -> bool:
    return len(held) == len(wanted) and all(holds_same_values(h, w) for h, w in zip(held, wanted))


def _fits_written_tensors(
    strategy: OneDimStrategy,
    mesh_dim: int,
    kept_inputs: Mapping[int, DTensorSpec[Any]],
    kept_outputs: Mapping[int, DTensorSpec[Any]],
) -> bool:
    for index, spec in kept_inputs.items():
        if not holds_same_values(spec.placements[mesh_dim], strategy.inputs[index]):
            return False
    for index, spec in kept_outputs.items():
        output = strategy.outputs[index]
        if output is None or not holds_same_values(spec.placements[mesh_dim], output):
            return False
    return True


def _placements_of_output(combo: Sequence[OneDimStrategy], index: int) -> tuple[Placement, ...] | None:
    placements: list[Placement] = []
    for strategy in combo:
        placement = strategy.outputs[index]
        if placement is None:
            if placements:
                raise AssertionError(f"output {index} is a tensor on some mesh dims and not on others: {combo}")
            return None
        placements.append(placement)
    return tuple(placements)


def _prepare_call(
    op: torch._ops.OpOverload,
    rule: ShardingRule,
    args: Sequence[object],
    kwargs: Mapping[str, object],
    specs: tuple[DTensorSpec[Any], ...],
    positions: tuple[ArgPosition, ...],
    decide: DecideFn,
) -> OpCall:
    """The call sorted out: its rule inputs, which DTensors the op writes, its output metadata."""
    facts = schema_facts(op)
    is_out_arg = tuple(position in facts.out_names for position in positions)
    rule_specs = tuple(spec for spec, is_out in zip(specs, is_out_arg) if not is_out)
    rule_positions = tuple(position for position, is_out in zip(positions, is_out_arg) if not is_out)
    output_metas: tuple[TensorMeta | None, ...]
    if not rule.tensor_outputs:
        structure, output_metas = STRUCTURE_NONE, ()
    elif rule.output_meta is None and rule.combined_decision is not None:
        structure, output_metas = STRUCTURE_SEQUENCE, ()  # the combined decision gives them (see ShardingRule)
    else:
        computed = None if rule.output_meta is None else rule.output_meta(op, args, kwargs)
        if isinstance(computed, TensorMeta):
            structure, output_metas = STRUCTURE_SINGLE, (computed,)
        elif computed is not None:  # several outputs (None for a non-tensor one)
            structure, output_metas = STRUCTURE_SEQUENCE, computed
        else:
            structure, output_metas = run_on_meta(op, args, kwargs)
    kept_inputs: dict[int, DTensorSpec[Any]] = {}
    kept_outputs: dict[int, DTensorSpec[Any]] = {}
    if facts.writes_first_argument:
        # Every tensor of the written argument stays put: one for add_, a whole list for _foreach_add_.
        for index, position in enumerate(rule_positions):
            if position == 0:
                kept_inputs[index] = rule_specs[index]
        if output_metas:  # _foreach_add_ and friends return nothing
            kept_outputs[0] = rule_specs[0]
    for spec, position in zip(specs, positions):
        if position in facts.out_names:
            kept_outputs[facts.out_names.index(str(position))] = spec
    return OpCall(
        op=op,
        args=tuple(args),
        kwargs=dict(kwargs),
        input_specs=rule_specs,
        input_positions=rule_positions,
        output_metas=output_metas,
        partial_reduce_ops=frozenset(),
        decide=decide,
        all_specs=specs,
        is_out_arg=is_out_arg,
        structure=structure,
        kept_inputs=kept_inputs,
        kept_outputs=kept_outputs,
        inplace=facts.writes_first_argument,
    )


def _strategies_per_mesh_dim(op: torch._ops.OpOverload, rule: ShardingRule, call: OpCall) -> list[list[OneDimStrategy]]:
    """The rule's one-dim strategies for each mesh dim, less those that would move a written tensor."""
    input_ndims = tuple(len(spec.shape) for spec in call.input_specs)
    output_ndims = tuple(None if meta is None else len(meta.shape) for meta in call.output_metas)
    # The rule is asked once per distinct set of Partial kinds found on a mesh dim (usually once).
    asked: dict[frozenset[str], Sequence[OneDimStrategy]] = {}
    per_mesh_dim = []
    for mesh_dim in range(len(call.all_specs[0].placements)):
        partials_here = frozenset(
            placement.reduce_op
            for spec in call.all_specs
            if isinstance(placement := spec.placements[mesh_dim], Partial)
        )
        strategies = asked.get(partials_here)
        if strategies is None:
            assert rule.one_dim_strategies is not None, "rules without one_dim_strategies decide combined"
            strategies = rule.one_dim_strategies(dataclasses.replace(call, partial_reduce_ops=partials_here))
            _check_strategy_shapes(op, rule, strategies, len(call.input_specs), len(call.output_metas))
            asked[partials_here] = strategies
        variants = _strided_variants(rule, call, mesh_dim, strategies)
        if variants:
            strategies = [*strategies, *variants]
        fitting = [
            s
            for s in strategies
            if _fits_written_tensors(s, mesh_dim, call.kept_inputs, call.kept_outputs)
            and _shards_existing_dims(s, input_ndims, output_ndims)
        ]
        if not fitting:
            written = ", ".join(
                f"{'self' if index == 0 and call.inplace else 'out'}: {_describe_placements(spec)}"
                for index, spec in call.kept_outputs.items()
            )
            raise ShardingPropagationError(
                f"{op} cannot write its result into a DTensor with placements ({written}) on mesh dim {mesh_dim}: "
                f"every sharding strategy of the {rule.family!r} rule would need it redistributed "
                f"(inputs: {describe_inputs(call.all_specs)}): in-place operations that require placement changes "
                "are not supported. Redistribute it first or use the out-of-place op."
            )
        per_mesh_dim.append(fitting)
    return per_mesh_dim


def _strided_variants(
    rule: ShardingRule, call: OpCall, mesh_dim: int, strategies: Sequence[OneDimStrategy]
) -> list[OneDimStrategy]:
    """The rule's strategies for ``mesh_dim`` with its shards relabelled to the inputs' ``_StridedShard`` layouts.

    A ``_StridedShard(d, sf)`` mesh dim holds on each rank a fixed set of indices of a dim of extent
    ``E`` (``local_index_runs``), where ``Shard(d)`` holds one block of them.  A strategy that pairs
    the shards of its tensors block for block (element by element along them, a batch dim, a
    contraction summed into a Partial) is exact for any fixed index set, so it is exact for the
    strided set as well when every shard it names cuts a dim of extent ``E``: those become
    ``_StridedShard(dim, sf)``, which hold the same indices.  A strategy naming a shard of another
    extent has no such variant.  The variants compete with the rule's own strategies on the cost model
    (keeping a strided input costs nothing; moving it is priced by the planner's strided steps).
    Random ops (offsets follow block positions) and rules with layout-aware local kernels get none.
    """
    if rule.random is not RandomDraw.NONE or rule.local_kernel is not None:
        return []
    layouts = {
        (spec.shape[placement.dim], placement.split_factor)
        for spec in call.input_specs
        if isinstance(placement := spec.placements[mesh_dim], _StridedShard)
    }
    variants: list[OneDimStrategy] = []
    for extent, split_factor in sorted(layouts):
        for strategy in strategies:
            variant = _relabelled(call, strategy, extent, split_factor)
            if variant is not None and variant not in strategies and variant not in variants:
                variants.append(variant)
    return variants


def _relabelled(call: OpCall, strategy: OneDimStrategy, extent: int, split_factor: int) -> OneDimStrategy | None:
    def strided(placement: Placement | None, shape: Sequence[int] | None) -> Placement | None | bool:
        if not isinstance(placement, Shard):  # _StridedShard is not a Shard: a rule's own strided entry stays
            return placement
        assert shape is not None
        if not -len(shape) <= placement.dim < len(shape):
            return placement  # not a dim of this tensor: _shards_existing_dims drops the strategy
        dim = placement.dim % len(shape)
        return _StridedShard(dim, split_factor=split_factor) if shape[dim] == extent else False

    inputs = [strided(p, spec.shape) for p, spec in zip(strategy.inputs, call.input_specs)]
    outputs = [
        strided(p, None if meta is None else meta.shape) for p, meta in zip(strategy.outputs, call.output_metas)
    ]
    if any(p is False for p in (*inputs, *outputs)) or not any(isinstance(p, _StridedShard) for p in inputs):
        return None
    return OneDimStrategy(tuple(outputs), tuple(inputs))  # type: ignore[arg-type]


def _shards_existing_dims(
    strategy: OneDimStrategy, input_ndims: Sequence[int], output_ndims: Sequence[int | None]
) -> bool:
    """Whether every Shard of the strategy names a dim its tensor has (a rule written for n-D inputs may
    offer Shard(0) to a 0-dim argument; such a strategy cannot be run, so it is not a candidate)."""
    for placement, ndim in zip(strategy.inputs, input_ndims):
        if isinstance(placement, Shard) and not -ndim <= placement.dim < ndim:
            return False
    for output_placement, output_ndim in zip(strategy.outputs, output_ndims):
        if isinstance(output_placement, Shard) and output_ndim is not None and not -output_ndim <= output_placement.dim < output_ndim:
            return False
    return True


def _priced_combination(
    rule: ShardingRule,
    call: OpCall,
    rule_specs: Sequence[DTensorSpec[Any]],
    combo: Sequence[OneDimStrategy],
    costs: dict[tuple[int, tuple[Placement, ...]], int],
) -> tuple[tuple[tuple[Placement, ...], ...], tuple[tuple[Placement, ...] | None, ...], int, int] | None:
    """One n-D combination of per-mesh-dim strategies: its input and output placements, the cost of moving the
    inputs there and how many mesh dims change; None where the rule's exactness check refuses it. ``costs``
    memoises the redistribution price per (input, target) across the combinations of one decision."""
    inputs_nd = tuple(tuple(strategy.inputs[index] for strategy in combo) for index in range(len(rule_specs)))
    outputs_nd = tuple(_placements_of_output(combo, index) for index in range(len(call.output_metas)))
    # A tensor laid out with both a _StridedShard and a Partial mesh dim is never a candidate: the
    # redistribution planner refuses such layouts, so an output in one could not even be gathered (a sharded
    # contraction of strided inputs gave bmm a (P(sum), S(1), _S(1, 2)) output whose full_tensor() raised).
    if any(placements and _mixes_strided_and_partial(placements) for placements in (*inputs_nd, *outputs_nd)):
        return None
    if rule.is_valid is not None and not _is_valid(rule, call, inputs_nd, outputs_nd):
        return None
    moved = 0
    changed = 0
    for index, target in enumerate(inputs_nd):
        current = rule_specs[index].placements
        if target == current:
            continue
        cost = costs.get((index, target))
        if cost is None:
            cost = _redistribute_cost(rule_specs[index], target)
            costs[(index, target)] = cost
        moved += cost
        changed += sum(1 for have, want in zip(current, target) if have != want)
    return inputs_nd, outputs_nd, moved, changed


def _cheapest_combination(
    op: torch._ops.OpOverload, rule: ShardingRule, call: OpCall, per_mesh_dim: Sequence[Sequence[OneDimStrategy]]
) -> tuple[tuple[tuple[Placement, ...], ...], tuple[tuple[Placement, ...] | None, ...]]:
    """Input and output placements of the exact n-D combination with the cheapest input redistribution.

    Ranked by (seconds the inputs' redistribution takes under the mesh's cost profile, placements
    changed, enumeration order): free local steps still lose to no step at all, and equal candidates
    resolve the same way on every rank.
    """
    if _size_one_dims_choose_freely(call, per_mesh_dim):
        return _cheapest_combination_over_larger_dims(op, rule, call, per_mesh_dim)
    rule_specs = call.input_specs
    best_rank: tuple[int, int, int] | None = None
    best: tuple[tuple[tuple[Placement, ...], ...], tuple[tuple[Placement, ...] | None, ...]] = ((), ())
    costs: dict[tuple[int, tuple[Placement, ...]], int] = {}
    for order, combo in enumerate(itertools.product(*per_mesh_dim)):
        priced = _priced_combination(rule, call, rule_specs, combo, costs)
        if priced is None:
            continue
        inputs_nd, outputs_nd, moved, changed = priced
        rank = (moved, changed, order)
        if best_rank is None or rank < best_rank:
            best_rank, best = rank, (inputs_nd, outputs_nd)
    if best_rank is None:
        raise ShardingPropagationError(
            f"{op}: none of the {rule.family!r} rule's strategies is exact for inputs ({describe_inputs(call.all_specs)})"
        )
    return best


def _size_one_dims_choose_freely(call: OpCall, per_mesh_dim: Sequence[Sequence[OneDimStrategy]]) -> bool:
    """Whether some mesh dim of size 1 offers several strategies and what they cost does not depend on them.

    On a mesh dim of size 1 every placement holds the same values, so the planner moves an input's
    placements there by free relabels and prices the rest of its plan without them
    (``_planner.size_one_dims``, "Mesh dims of size 1"). Not where a ``_StridedShard`` layout (or a shard
    order, which is one) is involved: those plans are priced on the whole layout.
    """
    mesh_shape = tuple(call.mesh.shape)
    if not any(size == 1 and len(strategies) > 1 for size, strategies in zip(mesh_shape, per_mesh_dim)):
        return False
    for spec in call.input_specs:
        if spec.has_explicit_shard_order or any(isinstance(p, _StridedShard) for p in spec.placements):
            return False
    return not any(
        isinstance(p, _StridedShard) for strategies in per_mesh_dim for strategy in strategies for p in strategy.inputs
    )


def _cheapest_combination_over_larger_dims(
    op: torch._ops.OpOverload, rule: ShardingRule, call: OpCall, per_mesh_dim: Sequence[Sequence[OneDimStrategy]]
) -> tuple[tuple[tuple[Placement, ...], ...], tuple[tuple[Placement, ...] | None, ...]]:
    """``_cheapest_combination``'s choice, enumerating the product over the mesh dims of size > 1 only.

    The rank of a combination is (redistribution time, placements changed, enumeration order). Its time
    does not depend on the strategies of the size-1 dims (``_size_one_dims_choose_freely``), its changed
    placements are a sum over mesh dims, and two combinations that agree on the larger dims compare in
    enumeration order as their size-1 parts do. So for each combination of the larger dims the best
    completion is the first exact one among the size-1 parts sorted by (placements they change, their
    enumeration order): usually the first, so the rule's exactness check and the planner are asked about
    as often as on the mesh without those dims. The choice is the full enumeration's.
    """
    rule_specs = call.input_specs
    mesh_shape = tuple(call.mesh.shape)
    ndim = len(per_mesh_dim)
    # Weight of each mesh dim's strategy index in the full product's enumeration order (row-major).
    weights = [math.prod(len(per_mesh_dim[later]) for later in range(d + 1, ndim)) for d in range(ndim)]
    free_dims = [d for d in range(ndim) if mesh_shape[d] == 1]
    larger_dims = [d for d in range(ndim) if mesh_shape[d] != 1]

    def changed_on(d: int, strategy: OneDimStrategy) -> int:
        return sum(1 for spec, wanted in zip(rule_specs, strategy.inputs) if spec.placements[d] != wanted)

    free_changed = [[changed_on(d, strategy) for strategy in per_mesh_dim[d]] for d in free_dims]

    def free_rank(indices: tuple[int, ...]) -> tuple[int, int]:
        changed = sum(free_changed[k][i] for k, i in enumerate(indices))
        return changed, sum(weights[d] * i for d, i in zip(free_dims, indices))

    free_parts = sorted(itertools.product(*(range(len(per_mesh_dim[d])) for d in free_dims)), key=free_rank)

    best_rank: tuple[int, int, int] | None = None
    best: tuple[tuple[tuple[Placement, ...], ...], tuple[tuple[Placement, ...] | None, ...]] = ((), ())
    costs: dict[tuple[int, tuple[Placement, ...]], int] = {}
    combo: list[OneDimStrategy] = [per_mesh_dim[d][0] for d in range(ndim)]
    for larger in itertools.product(*(range(len(per_mesh_dim[d])) for d in larger_dims)):
        for d, i in zip(larger_dims, larger):
            combo[d] = per_mesh_dim[d][i]
        for free in free_parts:
            for d, i in zip(free_dims, free):
                combo[d] = per_mesh_dim[d][i]
            priced = _priced_combination(rule, call, rule_specs, combo, costs)
            if priced is None:
                continue
            inputs_nd, outputs_nd, moved, changed = priced
            order = sum(weights[d] * i for d, i in zip(larger_dims, larger)) + free_rank(free)[1]
            rank = (moved, changed, order)
            if best_rank is None or rank < best_rank:
                best_rank, best = rank, (inputs_nd, outputs_nd)
            break  # the first exact completion is this combination's best
    if best_rank is None:
        raise ShardingPropagationError(
            f"{op}: none of the {rule.family!r} rule's strategies is exact for inputs ({describe_inputs(call.all_specs)})"
        )
    return best


def _is_valid(
    rule: ShardingRule,
    call: OpCall,
    inputs: tuple[tuple[Placement, ...], ...],
    outputs: tuple[tuple[Placement, ...] | None, ...],
) -> bool:
    """``rule.is_valid`` for a combination, strided variants included.

    A rule's exactness checks reason about the sizes of ``Shard`` pieces (a mean over even pieces, no
    empty piece under a max).  Unless the rule reads strided layouts itself, a combination holding
    ``_StridedShard`` placements is checked as its ``Shard`` equivalent, and only where every tensor's
    strided pieces have, at every mesh coordinate, the sizes the equivalent's pieces have (the same
    numbers of elements, in other places); otherwise it is not a candidate (the input is moved instead).
    """
    if rule.validity_reads_strided_shards or not any(
        isinstance(p, _StridedShard) for placements in (*inputs, *outputs) if placements for p in placements
    ):
        return rule.is_valid(call, inputs, outputs)  # type: ignore[misc]
    shapes = [spec.shape for spec in call.input_specs] + [
        None if meta is None else meta.shape for meta in call.output_metas
    ]
    equivalents: list[tuple[Placement, ...] | None] = []
    for shape, placements in zip(shapes, (*inputs, *outputs)):
        if placements is None or shape is None:
            equivalents.append(placements)
            continue
        plain = tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements)
        if plain != placements and not _same_piece_sizes(tuple(shape), tuple(call.mesh.shape), placements, plain):
            return False
        equivalents.append(plain)
    equivalent_inputs = cast(tuple[tuple[Placement, ...], ...], tuple(equivalents[: len(inputs)]))
    return rule.is_valid(call, equivalent_inputs, tuple(equivalents[len(inputs) :]))  # type: ignore[misc]


def _mixes_strided_and_partial(placements: tuple[Placement, ...]) -> bool:
    return any(isinstance(p, _StridedShard) for p in placements) and any(isinstance(p, Partial) for p in placements)


def _same_piece_sizes(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...], plain: tuple[Placement, ...]
) -> bool:
    # One local shape per mesh coordinate, twice: cached (SHARED_CACHES, the same on every rank).
    cache = SHARED_CACHES.strided_piece_sizes
    key = (shape, mesh_shape, placements)
    known = lookup(cache, key)
    if isinstance(known, bool):
        return known
    same = all(
        compute_local_shape(shape, mesh_shape, coordinate, placements)
        == compute_local_shape(shape, mesh_shape, coordinate, plain)
        for coordinate in itertools.product(*(range(size) for size in mesh_shape))
    )
    if known is not SYMBOLIC:
        store(cache, key, same, limit=1024)
    return same


def _check_combined_decision(
    op: torch._ops.OpOverload,
    rule: ShardingRule,
    call: OpCall,
    inputs: Sequence[tuple[Placement, ...]],
    outputs: Sequence[tuple[Placement, ...] | None],
) -> None:
    """A combined decision covers every input and output, and leaves written tensors where they are."""
    if len(inputs) != len(call.input_specs) or len(outputs) != len(call.output_metas):
        raise AssertionError(
            f"the {rule.family!r} rule decided {len(inputs)} inputs and {len(outputs)} outputs for {op}; "
            f"the call has {len(call.input_specs)} DTensor inputs and {len(call.output_metas)} outputs"
        )
    for index, spec in call.kept_inputs.items():
        if not _same_layout(spec.placements, inputs[index]):
            raise ShardingPropagationError(
                f"{op} cannot keep the DTensor it writes (input {index}) at placements "
                f"{_describe_placements(spec)}: the {rule.family!r} rule needs {inputs[index]} "
                f"(inputs: {describe_inputs(call.all_specs)}). Redistribute it first or use the out-of-place op."
            )
    for index, spec in call.kept_outputs.items():
        written = outputs[index]
        if written is None or not _same_layout(spec.placements, written):
            raise ShardingPropagationError(
                f"{op} cannot write its output {index} into a DTensor with placements "
                f"{_describe_placements(spec)}: the {rule.family!r} rule produces {outputs[index]} "
                f"(inputs: {describe_inputs(call.all_specs)})"
            )


def decide_with_rule(
    op: torch._ops.OpOverload,
    rule: ShardingRule,
    args: Sequence[object],
    kwargs: Mapping[str, object],
    specs: tuple[DTensorSpec[Any], ...],
    positions: tuple[ArgPosition, ...],
    decide: DecideFn,
) -> OpDecision:
    """``rule``'s decision for ``op(*args, **kwargs)`` (DTensors given as specs; ``specs``/``positions``:
    every one of them in flattened argument order, from :func:`collect_specs`).  ``decide``: the
    pipeline's cached decision for other calls (what rules composed of per-element decisions ask)."""
    _check_inputs(op, specs)
    mesh = specs[0].mesh

    call = _prepare_call(op, rule, args, kwargs, specs, positions, decide)
    if rule.combined_decision is not None:
        best_inputs, best_outputs, given_metas = rule.combined_decision(call)
        if rule.tensor_outputs and rule.output_meta is None:
            if given_metas is None:
                raise AssertionError(
                    f"the {rule.family!r} rule has no output_meta, so its combined decision for {op} must give the "
                    "outputs' metadata"
                )
            call = dataclasses.replace(call, output_metas=tuple(given_metas))
        _check_combined_decision(op, rule, call, best_inputs, best_outputs)
    else:
        best_inputs, best_outputs = _cheapest_combination(op, rule, call, _strategies_per_mesh_dim(op, rule, call))

    rule_targets = iter(
        spec if _same_layout(spec.placements, target) else spec.with_placements(target)
        for spec, target in zip(call.input_specs, best_inputs)
    )
    input_targets = tuple(spec if is_out else next(rule_targets) for spec, is_out in zip(specs, call.is_out_arg))

    flat_outputs: list[DTensorSpec[Any] | None] = []
    for index, (meta, placements) in enumerate(zip(call.output_metas, best_outputs)):
        if meta is None or placements is None:
            flat_outputs.append(None)
        elif index in call.kept_outputs:
            kept = call.kept_outputs[index]
            if kept.tensor_meta is not None and kept.tensor_meta.shape != meta.shape:
                raise ValueError(
                    f"{op}: the written DTensor has global shape {tuple(kept.tensor_meta.shape)} but the result "
                    f"has shape {tuple(meta.shape)}; resizing a DTensor in place is not supported"
                )
            flat_outputs.append(kept)
        else:
            flat_outputs.append(DTensorSpec(mesh, placements, meta))
    output_specs: OutputSpecs
    if call.structure == STRUCTURE_SINGLE:
        output_specs = flat_outputs[0]
    elif call.structure == STRUCTURE_SEQUENCE:
        output_specs = tuple(flat_outputs)
    else:
        output_specs = None

    overrides: tuple[tuple[ArgPosition, object], ...] = ()
    if rule.local_arg_overrides is not None:
        # Per simulated rank under torch's LocalTensorMode: a local size may depend on the coordinate.
        overrides = local_arg_overrides_for_each_simulated_rank(
            functools.partial(rule.local_arg_overrides, call, tuple(flat_outputs))
        )
    local_kernel = None
    if rule.local_kernel is not None:
        # Made per simulated rank under torch's LocalTensorMode: a kernel may depend on the coordinate.
        local_kernel = local_kernel_for_each_simulated_rank(
            functools.partial(rule.local_kernel, call, best_inputs, tuple(flat_outputs)), getattr(op, "_op", op)
        )
    return OpDecision(
        output_specs=output_specs,
        input_specs=input_targets,
        needs_redistribute=any(target is not spec for target, spec in zip(input_targets, specs)),
        local_arg_overrides=overrides,
        local_kernel=local_kernel,
        random_plan=plan_random_draw(op, rule.random, output_specs, input_targets),
        op=op,
    )


def _redistribute_cost(spec: DTensorSpec[Any], target: tuple[Placement, ...]) -> int:
    """Picoseconds the redistribute planner's fastest plan takes under the mesh's cost profile (plans cached)."""
    return redistribute_cost_picoseconds(spec, spec.with_placements(target))
