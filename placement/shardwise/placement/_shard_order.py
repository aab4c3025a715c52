"""Shard orders: in which order several mesh dims cut one tensor dim.

``[Shard(0), Shard(0)]`` on a 2x2 mesh cuts tensor dim 0 by mesh dim 0 first, then cuts each piece
by mesh dim 1 (the default, left-to-right order). The other order (mesh dim 1 first) puts rows
``[0:n/4]`` on coordinate (0, 0) and ``[n/4:n/2]`` on (1, 0): the same pieces as
``[_StridedShard(0, split_factor=2), Shard(0)]``. A shard order is the general way to say this;
``_StridedShard`` is how a layout spells it one mesh dim at a time: the split factor of mesh dim
``m`` is the product of the sizes of the mesh dims that cut the tensor dim *before* ``m`` while
standing *right* of it in the placements. Both forms describe the same local pieces, so shardwise
keeps one engine (``_StridedShard`` layouts) and converts at the edges.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

from ._placements import Placement, Shard, _StridedShard

__all__ = [
    "ShardOrderEntry",
    "ShardOrder",
    "default_shard_order",
    "is_default_shard_order",
    "shard_order_to_strided_placements",
    "strided_placements_to_shard_order",
    "check_shard_order",
]


class ShardOrderEntry(NamedTuple):
    """Tensor dim ``tensor_dim`` is cut by the mesh dims ``mesh_dims``, first one first (never empty)."""

    tensor_dim: int
    mesh_dims: tuple[int, ...]


ShardOrder = tuple[ShardOrderEntry, ...]


def _cut_dim(placement: Placement) -> int | None:
    if isinstance(placement, (Shard, _StridedShard)):
        return placement.dim
    return None


def default_shard_order(placements: Sequence[Placement]) -> ShardOrder:
    """Every sharded tensor dim (ascending), cut by its mesh dims left to right."""
    by_tensor_dim: dict[int, list[int]] = {}
    for mesh_dim, placement in enumerate(placements):
        tensor_dim = _cut_dim(placement)
        if tensor_dim is None:
            continue
        if tensor_dim < 0:
            raise ValueError(
                f"shard order of {tuple(placements)}: {placement} has a negative dim; normalise shard dims "
                "(against the tensor's rank) first"
            )
        by_tensor_dim.setdefault(tensor_dim, []).append(mesh_dim)
    return tuple(ShardOrderEntry(dim, tuple(mesh_dims)) for dim, mesh_dims in sorted(by_tensor_dim.items()))


def is_default_shard_order(shard_order: ShardOrder | None) -> bool:
    """True when every entry lists its mesh dims in increasing order (``None``: unknown, so False)."""
    if shard_order is None:
        return False
    return all(list(entry.mesh_dims) == sorted(set(entry.mesh_dims)) for entry in shard_order)


def check_shard_order(shard_order: ShardOrder, placements: Sequence[Placement]) -> None:
    """Raise unless ``shard_order`` names exactly the ``Shard`` mesh dims of ``placements``, tensor dims ascending."""
    seen: set[int] = set()
    previous = -1
    for entry in shard_order:
        if not isinstance(entry, tuple) or len(entry) != 2:
            raise ValueError(f"shard order {shard_order}: expected ShardOrderEntry(tensor_dim, mesh_dims), got {entry!r}")
        tensor_dim, mesh_dims = entry
        if not mesh_dims:
            raise ValueError(f"shard order {shard_order}: tensor dim {tensor_dim} has no mesh dims")
        if tensor_dim <= previous:
            raise ValueError(f"shard order {shard_order}: expected tensor dims in ascending order, each once")
        previous = tensor_dim
        for mesh_dim in mesh_dims:
            if not 0 <= mesh_dim < len(placements) or mesh_dim in seen:
                raise ValueError(
                    f"shard order {shard_order}: mesh dim {mesh_dim} is out of range or listed twice for "
                    f"{len(placements)} placements"
                )
            seen.add(mesh_dim)
            if placements[mesh_dim] != Shard(tensor_dim):
                raise ValueError(
                    f"shard order {shard_order} says mesh dim {mesh_dim} cuts tensor dim {tensor_dim}, but its "
                    f"placement is {placements[mesh_dim]} (placements {tuple(placements)})"
                )
    sharding = {mesh_dim for mesh_dim, p in enumerate(placements) if type(p) is Shard}
    if seen != sharding:
        raise ValueError(
            f"shard order {shard_order} covers mesh dims {sorted(seen)}, but placements {tuple(placements)} shard "
            f"on mesh dims {sorted(sharding)}; expected every Shard mesh dim exactly once"
        )


def shard_order_to_strided_placements(
    shard_order: ShardOrder, placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> tuple[Placement, ...]:
    """The same layout with ``Shard``/``_StridedShard`` placements in the default (left-to-right) reading.

    Mesh dim ``m`` at position ``k`` of its entry keeps ``Shard`` when no mesh dim right of it
    cut the tensor dim earlier; otherwise it becomes ``_StridedShard`` whose split factor is the
    product of those earlier, right-standing mesh dims' sizes.
    """
    result = list(placements)
    for tensor_dim, mesh_dims in shard_order:
        for position, mesh_dim in enumerate(mesh_dims):
            if type(placements[mesh_dim]) is not Shard:
                raise ValueError(
                    f"shard order {shard_order}: mesh dim {mesh_dim} holds {placements[mesh_dim]}; only Shard "
                    "placements can be reordered"
                )
            earlier_right = [mesh_shape[d] for d in mesh_dims[:position] if d > mesh_dim]
            factor = math.prod(earlier_right)
            result[mesh_dim] = Shard(tensor_dim) if factor == 1 else _StridedShard(tensor_dim, split_factor=factor)
    return tuple(result)


def strided_placements_to_shard_order(
    placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> ShardOrder | None:
    """The shard order that ``placements`` (``Shard``/``_StridedShard``) spell, or None when none does.

    Reads mesh dims right to left: each one's split factor says how much of the tensor dim the
    mesh dims to its right already cut before it, i.e. where it stands among them in the order.
    """
    if not any(isinstance(p, _StridedShard) for p in placements):
        return default_shard_order(placements)
    orders: dict[int, list[int]] = {}
    for mesh_dim in range(len(placements) - 1, -1, -1):
        placement = placements[mesh_dim]
        tensor_dim = _cut_dim(placement)
        if tensor_dim is None:
            continue
        wanted = placement.split_factor if isinstance(placement, _StridedShard) else 1
        order = orders.setdefault(tensor_dim, [])
        before = 1
        for position in range(len(order) + 1):
            if before == wanted:
                order.insert(position, mesh_dim)
                break
            if position < len(order):
                before *= mesh_shape[order[position]]
        else:
            return None
    return tuple(ShardOrderEntry(dim, tuple(order)) for dim, order in sorted(orders.items()))
