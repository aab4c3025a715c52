"""The layout of a mesh over process groups that already exist (``DeviceMesh.from_group``), checked against them."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from shardwise.mesh import _process_groups as process_groups
from shardwise.mesh import _validation as validation
from shardwise.mesh._errors import MeshError
from shardwise.mesh._layout import MeshLayout

__all__ = ["layout_of_groups"]


def layout_of_groups(
    group: dist.ProcessGroup | list[dist.ProcessGroup],
    mesh: torch.Tensor | Sequence[Any] | Any | None,
    mesh_dim_names: tuple[str, ...] | None,
) -> tuple[MeshLayout, tuple[str, ...] | None, tuple[dist.ProcessGroup, ...], int]:
    """The root layout, dim names, per-dim groups and this rank of a mesh over ``group`` (one, or one per dim).

    One group gives a 1-D mesh (``mesh``, if given, must list its ranks in group rank order); a list needs
    ``mesh`` and ``mesh_dim_names``. Each group must hold this rank and list, in group rank order, the
    ranks of ``mesh`` along its dim through this rank. Nothing is created.
    """
    if isinstance(group, dist.ProcessGroup):
        group_ranks = dist.get_process_group_ranks(group)
        if mesh is not None:
            given = validation.rank_grid_from(mesh)
            if given.shape != (len(group_ranks),) or list(given.ranks) != group_ranks:
                raise MeshError(
                    f"from_group: mesh {_ranks_text(mesh)} does not match the process group, whose ranks in group "
                    f"rank order are {group_ranks}; pass mesh=None or exactly those ranks"
                )
        groups = [group]
        grid = validation.rank_grid_from(group_ranks)
    else:
        if not isinstance(group, (list, tuple)) or not group:
            raise MeshError(f"from_group needs a ProcessGroup or a non-empty list of them, got {group!r}")
        not_groups = [g for g in group if not isinstance(g, dist.ProcessGroup)]
        if not_groups:
            raise MeshError(f"from_group: {not_groups!r} are not ProcessGroups")
        if mesh is None:
            raise MeshError(f"from_group with {len(group)} process groups needs mesh, the n-D grid of their ranks")
        if mesh_dim_names is None:
            raise MeshError(f"from_group with {len(group)} process groups needs mesh_dim_names, one per group")
        groups = list(group)
        grid = validation.rank_grid_from(mesh)
        if len(grid.shape) != len(groups):
            raise MeshError(
                f"from_group: mesh has {len(grid.shape)} dims (shape {list(grid.shape)}) but {len(groups)} process "
                "groups were given; expected one group per mesh dim"
            )
    names = validation.normalize_dim_names(mesh_dim_names, len(grid.shape))
    validation.check_fits_world(grid, process_groups.default_process_group().size())
    layout = MeshLayout.root(grid)
    rank = dist.get_rank()
    coordinate = layout.coordinate(rank)
    if coordinate is None:
        raise MeshError(f"from_group: rank {rank} is not in mesh {list(grid.ranks)}; its groups cannot be used here")
    for dim, dim_group in enumerate(groups):
        expected = layout.group_through(dim, rank)
        actual = tuple(dist.get_process_group_ranks(dim_group))
        if actual != expected:
            raise MeshError(
                f"from_group: the process group for mesh dim {dim} has ranks {list(actual)} (in group rank order) "
                f"but the mesh has {list(expected or ())} along that dim through rank {rank}"
            )
    return layout, names, tuple(groups), rank


def _ranks_text(mesh: object) -> str:
    return str(mesh.tolist()) if isinstance(mesh, torch.Tensor) else repr(mesh)
