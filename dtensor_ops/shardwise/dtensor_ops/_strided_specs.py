"""Sharding decisions for inputs laid out with ``_StridedShard`` (FSDP over tensor parallelism).

A ``_StridedShard(d, sf)`` mesh dim holds, on each rank, a fixed set of indices of tensor dim
``d`` (see ``shardwise.placement.local_index_runs``).  An op that works element by element
along ``d`` (pointwise and foreach ops, copies, detach, reductions into a Partial) does not care
WHICH indices a rank holds, only that all its inputs hold the same ones.  So the rules are asked
as if the mesh dim were ``Shard(d)``, and the decision is accepted only when it keeps every
input where it is on that mesh dim and gives outputs that are either the same ``Shard(d)`` with
the same extent of ``d`` (relabelled back to the ``_StridedShard``) or Partial.  Anything else
(a view changing ``d``, an op needing ``d`` whole) is refused with an error naming the op: the
caller redistributes first.  A replicated input that the rule cuts along ``d`` to line up with a
strided partner gets the partner's strided layout (a local selection); one cut another way (a
contraction dim) is refused.  A refused op whose strided inputs are lone strided shards (a merged view
dim, cut by no other mesh dim) runs on those mesh dims gathered instead.  Rules declared with
:func:`declare_rule_reads_strided_shards` (the view rule) get the strided inputs as they are
wherever their predicate says they can keep them.  Pure: no collectives.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import torch

from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, _StridedShard

from ._decision import OpDecision

__all__ = [
    "declare_rule_reads_strided_shards",
    "decide_with_strided_shards",
    "has_strided_shard",
    "rule_reads_strided_shards",
]

# Ops whose sharding rules take some _StridedShard inputs as they are (the view rule: a strided merged
# dim splits back into a Shard).  The predicate says, from the call's arguments, whether the rule can
# keep this call's strided inputs; when it cannot, the substitution below decides (or refuses) as usual.
StridedCallPredicate = Callable[[torch._ops.OpOverload, Sequence[object], Mapping[str, object]], bool]
_RULES_READING_STRIDED_SHARDS: dict[torch._ops.OpOverload, StridedCallPredicate] = {}


def declare_rule_reads_strided_shards(ops: Sequence[torch._ops.OpOverload], keeps: StridedCallPredicate) -> None:
    for op in ops:
        _RULES_READING_STRIDED_SHARDS[op] = keeps


def rule_reads_strided_shards(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> bool:
    keeps = _RULES_READING_STRIDED_SHARDS.get(op)
    return keeps is not None and keeps(op, args, kwargs)


def has_strided_shard(values: Sequence[object] | Mapping[str, object]) -> bool:
    items = values.values() if isinstance(values, Mapping) else values
    for value in items:
        if isinstance(value, DTensorSpec):
            if any(type(p) is _StridedShard for p in value.placements):
                return True
        elif isinstance(value, (list, tuple)) and has_strided_shard(value):
            return True
    return False


def _substitute(value: object) -> object:
    if isinstance(value, DTensorSpec):
        if not any(type(p) is _StridedShard for p in value.placements):
            return value
        return value.with_placements(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in value.placements)
    if isinstance(value, list):
        return [_substitute(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_substitute(item) for item in value)
    return value


def _strided_dims(op: object, specs: Sequence[DTensorSpec[Any]]) -> dict[int, _StridedShard]:
    """The strided placement of each mesh dim among ``specs`` (which work together); refuses mixes."""
    found: dict[int, _StridedShard] = {}
    for spec in specs:
        for mesh_dim, placement in enumerate(spec.placements):
            if isinstance(placement, _StridedShard):
                seen = found.setdefault(mesh_dim, placement)
                if seen != placement:
                    raise NotImplementedError(
                        f"{op}: inputs are laid out with different strided shards on mesh dim {mesh_dim} "
                        f"({seen!r} and {placement!r}); expected them to agree (redistribute one of them first)"
                    )
    for spec in specs:
        for mesh_dim, strided in found.items():
            placement = spec.placements[mesh_dim]
            # A plain Shard(d) input on a strided mesh dim holds other indices than the strided ones.
            if isinstance(placement, Shard):
                raise NotImplementedError(
                    f"{op}: mixes {strided!r} and {placement!r} on mesh dim {mesh_dim}, which hold different "
                    "indices; expected the same strided layout on every sharded input (redistribute first)"
                )
    return found


def _foreach_elements(args: Sequence[object], kwargs: Mapping[str, object]) -> list[list[DTensorSpec[Any]]]:
    """Element ``i`` of a foreach op: the ``i``-th spec of every list argument, plus the shared specs."""
    lists = [v for v in (*args, *kwargs.values()) if isinstance(v, (list, tuple))]
    shared = [v for v in (*args, *kwargs.values()) if isinstance(v, DTensorSpec)]
    length = max((len(v) for v in lists), default=0)
    elements = []
    for index in range(length):
        element = [v[index] for v in lists if index < len(v) and isinstance(v[index], DTensorSpec)]
        elements.append(element + shared)
    return elements


def _flat_specs(value: object, into: list[DTensorSpec[Any]]) -> None:
    if isinstance(value, DTensorSpec):
        into.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _flat_specs(item, into)


def _is_lone_strided_shard(spec: DTensorSpec[Any]) -> bool:
    """Every strided mesh dim of ``spec`` is the only mesh dim cutting its tensor dim (a view's layout).

    FSDP over TP nests a strided and a plain shard on one tensor dim; a merged view dim (see the view
    rule) is cut by its strided mesh dim alone, and gathering that mesh dim is one all-gather.
    """
    for placement in spec.placements:
        if isinstance(placement, _StridedShard):
            cuts = [p for p in spec.placements if isinstance(p, (Shard, _StridedShard)) and p.dim == placement.dim]
            if len(cuts) > 1:
                return False
    return True


def _gathered(value: object) -> object:
    if isinstance(value, DTensorSpec):
        if not any(type(p) is _StridedShard for p in value.placements):
            return value
        return value.with_placements(Replicate() if isinstance(p, _StridedShard) else p for p in value.placements)
    if isinstance(value, list):
        return [_gathered(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_gathered(item) for item in value)
    return value


def decide_with_strided_shards(
    op: torch._ops.OpOverload,
    args: Sequence[object],
    kwargs: Mapping[str, object],
    decide: Callable[[torch._ops.OpOverload, Sequence[object], Mapping[str, object]], OpDecision],
) -> OpDecision:
    """``decide``'s decision for inputs with ``_StridedShard`` placements, or an error when it would be wrong.

    Where keeping the strided layout is refused and every strided input is a lone strided shard (a
    merged view dim, not FSDP over TP), those mesh dims are gathered instead (as PyTorch redistributes
    them) and the op is decided on the gathered layouts: the dispatcher moves each input there.
    """
    try:
        return _decide_keeping_strided_shards(op, args, kwargs, decide)
    except NotImplementedError:
        specs: list[DTensorSpec[Any]] = []
        for value in (*args, *kwargs.values()):
            _flat_specs(value, specs)
        if not all(_is_lone_strided_shard(spec) for spec in specs):
            raise
    decision = decide(op, [_gathered(arg) for arg in args], {name: _gathered(v) for name, v in kwargs.items()})
    return dataclasses.replace(decision, needs_redistribute=True)


def _decide_keeping_strided_shards(
    op: torch._ops.OpOverload,
    args: Sequence[object],
    kwargs: Mapping[str, object],
    decide: Callable[[torch._ops.OpOverload, Sequence[object], Mapping[str, object]], OpDecision],
) -> OpDecision:
    substituted_args = [_substitute(arg) for arg in args]
    substituted_kwargs = {name: _substitute(value) for name, value in kwargs.items()}
    originals: list[DTensorSpec[Any]] = []
    stand_ins: list[DTensorSpec[Any]] = []
    for arg in args:
        _flat_specs(arg, originals)
    for value in kwargs.values():
        _flat_specs(value, originals)
    for arg in substituted_args:
        _flat_specs(arg, stand_ins)
    for value in substituted_kwargs.values():
        _flat_specs(value, stand_ins)
    # Foreach ops are decided element by element: each element's inputs must agree, not the whole list.
    is_foreach = op.name().split("::")[-1].startswith("_foreach_")
    groups = _foreach_elements(args, kwargs) if is_foreach else [originals]
    found_per_group = [_strided_dims(op, group) for group in groups]
    found: dict[int, _StridedShard] = {}
    for group_found in found_per_group:
        found.update(group_found)

    decision = decide(op, substituted_args, substituted_kwargs)

    def refuse(why: str) -> NotImplementedError:
        placements = ", ".join(str(spec.placements) for spec in originals)
        return NotImplementedError(
            f"{op} on inputs laid out as {placements}: {why}; only ops that work element by element along a "
            "strided-sharded dim run on it directly (redistribute the input to Shard/Replicate first)"
        )

    if decision.random_plan is not None or decision.local_kernel is not None:
        raise refuse("the op draws random values or needs a layout-aware local kernel")
    input_targets: list[DTensorSpec[Any]] = []
    for original, stand_in, target in zip(originals, stand_ins, decision.input_specs):
        strided_here = [m for m, p in enumerate(original.placements) if isinstance(p, _StridedShard)]
        for mesh_dim in strided_here:
            if target.placements[mesh_dim] != stand_in.placements[mesh_dim]:
                raise refuse(
                    f"its sharding rule needs mesh dim {mesh_dim} as {target.placements[mesh_dim]!r} instead"
                )
        if target is stand_in or target == stand_in:
            input_targets.append(original)
        else:
            # Redistribution on the other mesh dims only: put the strided placements back.  An input not
            # strided there (Replicate) that the rule cuts along the strided dim, to line up with its
            # strided partner, must hold the partner's indices: the strided layout, not a plain Shard.
            def target_on(mesh_dim: int, placement: Placement) -> Placement:
                if mesh_dim in strided_here:
                    return original.placements[mesh_dim]
                partner = found.get(mesh_dim)
                if (
                    partner is not None
                    and placement == Shard(partner.dim)
                    and any(
                        len(spec.shape) == len(original.shape)
                        and spec.shape[partner.dim] == original.shape[partner.dim]
                        for spec in originals
                        if spec.placements[mesh_dim] == partner
                    )
                ):
                    return partner
                if partner is not None and isinstance(placement, Shard):
                    # Lined up with other indices of the partner (a contraction dim, another tensor dim):
                    # a plain Shard would pair wrong elements.
                    raise refuse(f"its sharding rule cuts another input as {placement!r} on mesh dim {mesh_dim}")
                return placement

            input_targets.append(
                target.with_placements(
                    target_on(mesh_dim, placement) for mesh_dim, placement in enumerate(target.placements)
                )
            )
    extents = {
        mesh_dim: {spec.shape[strided.dim] for spec in originals if spec.placements[mesh_dim] == strided}
        for mesh_dim, strided in found.items()
    }

    def relabel(spec: object, group_found: dict[int, _StridedShard]) -> object:
        if not isinstance(spec, DTensorSpec):
            return spec
        placements = list(spec.placements)
        for mesh_dim, strided in group_found.items():
            placement = placements[mesh_dim]
            if isinstance(placement, Partial):
                continue
            if placement != Shard(strided.dim):
                raise refuse(f"its output would be {placement!r} on mesh dim {mesh_dim}")
            if spec.tensor_meta is None or spec.shape[strided.dim] not in extents[mesh_dim]:
                raise refuse(f"its output changes the extent of the strided dim {strided.dim}")
            placements[mesh_dim] = strided
        return spec.with_placements(placements)

    outputs = decision.output_specs
    relabelled: Any
    if isinstance(outputs, tuple):
        relabelled = tuple(
            relabel(spec, found_per_group[index] if is_foreach and index < len(found_per_group) else found)
            for index, spec in enumerate(outputs)
        )
    else:
        relabelled = relabel(outputs, found)
    return dataclasses.replace(
        decision,
        output_specs=relabelled,
        input_specs=tuple(input_targets),
        needs_redistribute=any(t is not o for t, o in zip(input_targets, originals)),
    )
