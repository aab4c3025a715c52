"""Redistribution to and from ``_StridedShard`` layouts (FSDP over tensor parallelism).

The planner's one-mesh-dim steps assume ``Shard`` pieces are contiguous ranges, which a
strided piece is not.  Redistributions that involve a ``_StridedShard`` therefore go through
the whole tensor, assembled exactly from the layout (``local_index_runs``):

- from a strided layout: every rank's piece is padded to the largest piece and gathered with
  one ``all_gather_into_tensor`` per mesh dim of size > 1, then each piece is put where its
  index ranges say; the result is the replicated tensor, from which the target layout is a
  local selection (or a normal plan, for Partial targets).  This is what ``full_tensor()`` and
  checkpoints need (they want the whole tensor anyway); other targets pay for a full gather.
- to a strided layout from a non-strided one: the normal plan to the replicated layout, then a
  local selection (no communication from a replicated source, e.g. ``full_tensor``'s backward).

One common case skips the whole tensor: gathering the strided mesh dim alone (``(_StridedShard(0,
sf=tp), Shard(0))`` -> ``(Replicate(), Shard(0))``, FSDP over TP back to TP: checkpoints loaded onto
TP, FSDP1's ``all_gather_dtensor``). When the pieces of the ranks along that mesh dim, in order, are
exactly the target piece (checked from the layout, once per spec pair and rank), one padded
``all_gather_into_tensor`` over that mesh dim and a concatenation give it.  Other targets without a
strided placement (``full_tensor()``, other shardings) start with that gather, where it is exact,
and let a normal plan do the rest: no index assembly of the whole tensor.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable

import torch

from shardwise.mesh import _simulation as simulation
from shardwise.placement import (
    DTensorSpec,
    Partial,
    Replicate,
    _StridedShard,
    local_index_runs,
    pad_dim,
    select_local_shard,
)

from ._caches import RANK_CACHES, SYMBOLIC, lookup
from ._collectives import launch_all_gather, mesh_dim_group_name, wait

__all__ = ["involves_strided_shard", "redistribute_with_strided_shards"]

Redistribute = Callable[[torch.Tensor, DTensorSpec[Any], DTensorSpec[Any]], torch.Tensor]

# lookup()'s answer for a key not computed yet (None is a computed answer: no one-dim gather serves it).
_NOT_YET = object()


def involves_strided_shard(src: DTensorSpec[Any], dst: DTensorSpec[Any]) -> bool:
    return any(type(p) is _StridedShard for p in src.placements) or any(
        type(p) is _StridedShard for p in dst.placements
    )


def redistribute_with_strided_shards(
    local: torch.Tensor, src: DTensorSpec[Any], dst: DTensorSpec[Any], redistribute: Redistribute
) -> torch.Tensor:
    """This rank's piece laid out as ``dst`` (see the module docstring); ``redistribute`` runs normal plans."""
    if src == dst:
        return local
    gathered = _gather_one_strided_mesh_dim(local, src, dst)
    if gathered is not None:
        return gathered
    strided = [m for m, p in enumerate(src.placements) if type(p) is _StridedShard]
    if len(strided) == 1 and not src.has_partial() and not any(type(p) is _StridedShard for p in dst.placements):
        # Gather the strided mesh dim alone first when that is exact; a normal plan does the rest.
        middle = src.with_placements([Replicate() if m == strided[0] else p for m, p in enumerate(src.placements)])
        gathered = _gather_one_strided_mesh_dim(local, src, middle)
        if gathered is not None:
            return redistribute(gathered, middle, dst)
    mesh = src.mesh
    replicated = src.with_placements([Replicate()] * mesh.ndim)
    if any(type(p) is _StridedShard for p in src.placements):
        if src.has_partial():
            raise NotImplementedError(
                f"redistribute {src} -> {dst}: a layout with both a _StridedShard and a Partial mesh dim; "
                "expected the Partial mesh dims reduced first"
            )
        full = _gather_whole(local, src)
    else:
        full = redistribute(local, src, replicated)
    if any(isinstance(p, Partial) for p in dst.placements):
        if any(type(p) is _StridedShard for p in dst.placements):
            raise NotImplementedError(f"redistribute {src} -> {dst}: a target with _StridedShard and Partial")
        return redistribute(full, replicated, dst)
    # Per simulated rank under torch's LocalTensorMode (each selects its own piece); a plain call otherwise.
    return simulation.run_for_each_simulated_rank(_select_own_piece, full, mesh, dst.placements)


def _select_own_piece(full: torch.Tensor, mesh: Any, placements: Any) -> torch.Tensor:
    return select_local_shard(full, mesh.shape, mesh.get_coordinate(), placements).contiguous()


@dataclasses.dataclass(frozen=True)
class _OneDimGather:
    """How to gather one strided mesh dim: over ``mesh_dim``, along ``tensor_dim``, pieces of ``sizes``."""

    mesh_dim: int
    tensor_dim: int
    sizes: tuple[int, ...]


# (src, dst, coordinate) -> the gather, or None when the fast path does not apply.


def _one_dim_gather(src: DTensorSpec[Any], dst: DTensorSpec[Any], coordinate: tuple[int, ...]) -> _OneDimGather | None:
    differing = [m for m, (a, b) in enumerate(zip(src.placements, dst.placements)) if a != b]
    if len(differing) != 1 or src.has_partial() or dst.has_partial():
        return None
    (mesh_dim,) = differing
    source, target = src.placements[mesh_dim], dst.placements[mesh_dim]
    if type(source) is not _StridedShard or not isinstance(target, Replicate):
        return None
    tensor_dim = source.dim % len(src.shape)
    shape, mesh_shape = tuple(src.shape), tuple(src.mesh.shape)

    def indices(coord: tuple[int, ...], placements: Any) -> list[int]:
        runs = local_index_runs(shape, mesh_shape, coord, placements)[tensor_dim]
        return [start + k for start, length in runs for k in range(length)]

    def pieces_at(coord: tuple[int, ...]) -> list[list[int]]:
        return [
            indices(coord[:mesh_dim] + (index,) + coord[mesh_dim + 1 :], src.placements)
            for index in range(mesh_shape[mesh_dim])
        ]

    # Exact on every group along mesh_dim, not only this rank's: ranks of other groups must take the
    # same path (this one gathers over mesh_dim only; the general path gathers over every mesh dim).
    others = [range(n) if m != mesh_dim else range(1) for m, n in enumerate(mesh_shape)]
    for coord in itertools.product(*others):
        group_pieces = pieces_at(coord)
        if [i for piece in group_pieces for i in piece] != indices(coord, dst.placements):
            return None
    pieces = pieces_at(coordinate)
    return _OneDimGather(mesh_dim, tensor_dim, tuple(len(piece) for piece in pieces))


def _gather_one_strided_mesh_dim(
    local: torch.Tensor, src: DTensorSpec[Any], dst: DTensorSpec[Any]
) -> torch.Tensor | None:
    """``dst``'s piece by one all-gather over the strided mesh dim, or None where that is not exact."""
    if src.mesh is not dst.mesh and src.mesh != dst.mesh:
        return None
    if simulation.simulated_view() is not None:
        # Every rank simulated here (LocalTensorMode): the pieces and sizes differ by rank, so the
        # whole-tensor path (the same program for every rank) is taken instead.
        return None
    coordinate = src.mesh.get_coordinate()
    if coordinate is None:
        return None
    key = (src, dst, tuple(coordinate))
    gathers = RANK_CACHES.one_dim_gathers
    plan = lookup(gathers, key, _NOT_YET)
    if plan is SYMBOLIC:
        return None  # symbolic shapes: not hashable, take the general path
    if plan is _NOT_YET:
        plan = gathers[key] = _one_dim_gather(src, dst, tuple(coordinate))
    if plan is None:
        return None
    largest = max(plan.sizes)
    moved = pad_dim(local.movedim(plan.tensor_dim, 0), 0, largest).contiguous()
    group_size = len(plan.sizes)
    gathered = wait(launch_all_gather(moved, group_size, mesh_dim_group_name(src.mesh, plan.mesh_dim)))
    blocks = gathered.view(group_size, largest, *moved.shape[1:])
    whole = torch.cat([blocks[index].narrow(0, 0, size) for index, size in enumerate(plan.sizes)])
    return whole.movedim(0, plan.tensor_dim).contiguous()


def _gather_whole(local: torch.Tensor, spec: DTensorSpec[Any]) -> torch.Tensor:
    mesh = spec.mesh
    global_shape = tuple(spec.shape)
    mesh_shape = tuple(mesh.shape)
    coordinates = [
        tuple(int(c) for c in coordinate)
        for coordinate in torch.cartesian_prod(*(torch.arange(n) for n in mesh_shape)).reshape(-1, len(mesh_shape)).tolist()
    ]
    all_runs = [local_index_runs(global_shape, mesh_shape, c, spec.placements) for c in coordinates]
    max_shape = [max(sum(length for _, length in runs[dim]) for runs in all_runs) for dim in range(len(global_shape))]
    padded = local.contiguous()
    for dim, size in enumerate(max_shape):
        padded = pad_dim(padded, dim, size)
    block = padded.reshape(1, -1)
    # Innermost mesh dim first: after gathering dims d+1.. the block holds every coordinate of them
    # in row-major order, so gathering dim d puts the blocks in row-major order of the whole mesh.
    for mesh_dim in reversed(range(mesh.ndim)):
        group_size = mesh_shape[mesh_dim]
        if group_size > 1:
            gathered = wait(launch_all_gather(block, group_size, mesh_dim_group_name(mesh, mesh_dim)))
            block = gathered.reshape(1, -1)
    pieces = block.reshape(math.prod(mesh_shape), *max_shape) if max_shape else block.reshape(-1)
    full = local.new_empty(global_shape)
    for index, runs in enumerate(all_runs):
        piece = pieces[index]
        target_index = []
        for dim, dim_runs in enumerate(runs):
            size = sum(length for _, length in dim_runs)
            piece = piece.narrow(dim, 0, size)
            target_index.append(
                torch.tensor(
                    [start + k for start, length in dim_runs for k in range(length)], dtype=torch.long, device=full.device
                )
            )
        if piece.numel() == 0:
            continue
        full[torch.meshgrid(*target_index, indexing="ij")] = piece
    return full
