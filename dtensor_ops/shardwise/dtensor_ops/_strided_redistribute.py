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
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from shardwise.placement import (
    DTensorSpec,
    Partial,
    Replicate,
    _StridedShard,
    local_index_runs,
    pad_dim,
    select_local_shard,
)

from ._collectives import launch_all_gather, mesh_dim_group_name, wait

__all__ = ["involves_strided_shard", "redistribute_with_strided_shards"]

Redistribute = Callable[[torch.Tensor, DTensorSpec[Any], DTensorSpec[Any]], torch.Tensor]


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
    coordinate = mesh.get_coordinate()
    return select_local_shard(full, mesh.shape, coordinate, dst.placements).contiguous()


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
