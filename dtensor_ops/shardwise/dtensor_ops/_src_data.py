"""Communication for building DTensors from per-rank data (not for redistribution).

* :func:`distribute_local_data`: ``distribute_tensor``'s data movement.  Shard
  mesh dims scatter from ``src_data_rank`` (an ``all_to_all_single`` in which
  only the source sends, so each rank receives exactly its shard, uneven sizes
  included), Replicate/Partial mesh dims broadcast from it.
* :func:`check_and_sync_from_local`: ``from_local(run_check=True)``: every rank
  learns every rank's local dtype and shape, so all of them raise the same error
  together (no rank is left waiting) or agree on the global shape.
* :func:`agree_on_int`: one integer from the first rank of the mesh (random seeds).

The collectives themselves are issued by ``_collectives`` (over the mesh's per-dim
groups); ``src`` indices are positions along a mesh dim (group ranks).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from shardwise.mesh import DeviceMesh
from shardwise.placement import (
    DTensorSpec,
    Partial,
    Placement,
    Replicate,
    Shard,
    TensorMeta,
    chunk_sizes,
    compute_local_shape,
    even_global_shape,
)

from ._collectives import all_gather_rows_over_mesh, broadcast_along_mesh_dim, scatter_along_mesh_dim
from ._redistribute import redistribute_local_tensor

__all__ = ["distribute_local_data", "check_and_sync_from_local", "agree_on_int"]


def _local_chunk(tensor: torch.Tensor, tensor_dim: int, num_chunks: int, index: int) -> torch.Tensor:
    sizes = chunk_sizes(tensor.size(tensor_dim), num_chunks)
    offset = sum(sizes[:index])
    return tensor.narrow(tensor_dim, offset, sizes[index])


def distribute_local_data(
    tensor: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...], src_data_rank: int | None
) -> torch.Tensor:
    """This rank's local tensor for the global ``tensor`` laid out with ``placements``."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        # Not part of the mesh: an empty shard, no communication (the mesh's groups do not include us).
        return tensor.new_empty(compute_local_shape(tensor.shape, mesh.shape, None, placements))
    communicate = src_data_rank is not None and not tensor.is_meta
    mesh_shape = mesh.shape
    local = tensor
    # Collectives return new tensors; without one, local still aliases the caller's tensor.
    fresh = False
    # Scatter first (left to right keeps the nested torch.chunk order), broadcast the smaller
    # pieces afterwards: same result as the other order, fewer bytes.
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard) and mesh_shape[mesh_dim] > 1:
            if communicate:
                assert src_data_rank is not None
                local = scatter_along_mesh_dim(
                    local, mesh, mesh_dim, placement.dim, src_data_rank, coordinate[mesh_dim]
                )
                fresh = True
            else:
                local = _local_chunk(local, placement.dim, mesh_shape[mesh_dim], coordinate[mesh_dim])
    if communicate:
        assert src_data_rank is not None
        for mesh_dim, placement in enumerate(placements):
            if not isinstance(placement, Shard) and mesh_shape[mesh_dim] > 1:
                local = broadcast_along_mesh_dim(local, mesh, mesh_dim, src_data_rank)
                fresh = True
    if not fresh or not local.is_contiguous():
        # The DTensor owns its local data: it never aliases the caller's tensor.
        local = local.clone(memory_format=torch.contiguous_format)
    if any(isinstance(p, Partial) for p in placements):
        local = _replicated_to_partial(local, tensor, mesh, placements)
    return local


def _replicated_to_partial(
    local: torch.Tensor, global_tensor: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> torch.Tensor:
    meta = TensorMeta(global_tensor.shape, tuple(global_tensor.stride()), global_tensor.dtype)
    as_replicated = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
    return redistribute_local_tensor(
        local, DTensorSpec(mesh, as_replicated, meta), DTensorSpec(mesh, placements, meta)
    )


# -- from_local(run_check=True) ------------------------------------------------------------

_DTYPES: tuple[torch.dtype, ...] = tuple(
    sorted({value for value in vars(torch).values() if isinstance(value, torch.dtype)}, key=str)
)
_DTYPE_CODE: dict[torch.dtype, int] = {dtype: code for code, dtype in enumerate(_DTYPES)}


def _coordinates(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    coordinates: list[tuple[int, ...]] = [()]
    for size in mesh_shape:
        coordinates = [coordinate + (index,) for coordinate in coordinates for index in range(size)]
    return coordinates


def check_and_sync_from_local(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    global_shape: tuple[int, ...] | None,
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Validate every rank's local metadata against the placements; infer the global shape if not given.

    Returns the local tensor (replicated mesh dims broadcast from their first
    rank) and the global shape.  Every rank sees the same gathered metadata and
    so raises the same ValueError.
    """
    coordinate = mesh.get_coordinate()
    if coordinate is None or local.is_meta:
        if global_shape is None:
            global_shape = even_global_shape(tuple(local.shape), mesh.shape, placements)
        return local, global_shape
    where = "DTensor.from_local(run_check=True)"
    header = all_gather_rows_over_mesh(mesh, [local.ndim, _DTYPE_CODE[local.dtype]])
    coordinates = _coordinates(mesh.shape)
    ndims = {coord: int(header[coord][0]) for coord in coordinates}
    dtypes = {coord: _DTYPES[int(header[coord][1])] for coord in coordinates}
    if len(set(ndims.values())) > 1:
        raise ValueError(f"{where}: ranks hold local tensors with different numbers of dims: {_describe(ndims)}")
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"{where}: ranks hold local tensors with different dtypes: {_describe(dtypes)}")
    if local.ndim == 0:
        shapes: dict[tuple[int, ...], tuple[int, ...]] = {coord: () for coord in coordinates}
    else:
        table = all_gather_rows_over_mesh(mesh, list(local.shape))
        shapes = {coord: tuple(int(v) for v in table[coord].tolist()) for coord in coordinates}
    if global_shape is None:
        global_shape = _infer_global_shape(shapes, mesh, placements, where)
    for coord, shape in shapes.items():
        expected = compute_local_shape(global_shape, mesh.shape, coord, placements)
        if shape != tuple(expected):
            raise ValueError(
                f"{where}: the local tensor at mesh coordinate {coord} has shape {shape}, but global shape "
                f"{global_shape} with placements {placements} gives it shape {tuple(expected)} (torch.chunk "
                f"layout); local shapes by coordinate: {_describe(shapes)}"
            )
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate) and mesh.shape[mesh_dim] > 1:
            local = broadcast_along_mesh_dim(local, mesh, mesh_dim, 0)
    return local, global_shape


def _infer_global_shape(
    shapes: dict[tuple[int, ...], tuple[int, ...]],
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    where: str,
) -> tuple[int, ...]:
    """Sum the local sizes over the mesh dims that shard each tensor dim (other mesh dims at index 0)."""
    origin = (0,) * mesh.ndim
    ndim = len(shapes[origin])
    global_shape = list(shapes[origin])
    for tensor_dim in range(ndim):
        sharding_dims = [m for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim == tensor_dim]
        if not sharding_dims:
            sizes = {coord: shape[tensor_dim] for coord, shape in shapes.items()}
            if len(set(sizes.values())) > 1:
                raise ValueError(
                    f"{where}: tensor dim {tensor_dim} is not sharded by {placements}, yet ranks hold different "
                    f"sizes for it: {_describe(sizes)}"
                )
            continue
        total = 0
        for coord in _coordinates([mesh.shape[m] for m in sharding_dims]):
            full = list(origin)
            for mesh_dim, index in zip(sharding_dims, coord):
                full[mesh_dim] = index
            total += shapes[tuple(full)][tensor_dim]
        global_shape[tensor_dim] = total
    return tuple(global_shape)


def _describe(values: Mapping[tuple[int, ...], object]) -> str:
    return ", ".join(f"{coord}: {value}" for coord, value in values.items())


# -- seeds ----------------------------------------------------------------------------------


def agree_on_int(value: int, mesh: DeviceMesh) -> int:
    """The ``value`` of the rank at index 0 of every mesh dim, on every rank of the mesh."""
    if mesh.get_coordinate() is None:
        return value
    carrier = torch.tensor([value], dtype=torch.int64, device=mesh.device_type)
    for mesh_dim in range(mesh.ndim):
        if mesh.shape[mesh_dim] > 1:
            carrier = broadcast_along_mesh_dim(carrier, mesh, mesh_dim, 0)
    return int(carrier.item())
