"""PyTorch's ``torch.distributed.tensor._utils`` layout helpers, over shardwise's layout math."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from shardwise.mesh import DeviceMesh
from shardwise.mesh import _simulation as simulation
from shardwise.placement import Partial, Placement, Replicate, Shard, _StridedShard
from shardwise.placement import compute_local_shape_and_global_offset as _local_shape_and_offset

from .._collectives import all_gather_rows_over_mesh
from .._explicit_redistribution import ExplicitRedistributionContext

__all__ = [
    "ExplicitRedistributionContext",
    "_compute_local_shape_and_global_offset",
    "compute_global_tensor_info",
    "compute_global_tensor_shape",
    "compute_local_shape_and_global_offset",
    "compute_local_tensor_info",
]


def _compute_local_shape_and_global_offset(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    my_coordinate: Sequence[int] | None,
    placements: Sequence[Placement],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shard shape and global offset at mesh coordinate ``my_coordinate`` of a mesh of ``mesh_shape``.

    The mesh-free form of :func:`compute_local_shape_and_global_offset` (any coordinate, no mesh
    needed); ``None`` is a rank outside the mesh.
    """
    return _local_shape_and_offset(tuple(global_shape), tuple(mesh_shape), my_coordinate, tuple(placements))


def compute_local_shape_and_global_offset(
    global_shape: Sequence[int], mesh: Any, placements: Sequence[Placement]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of this rank's shard and its offset in the global tensor (uneven and nested shards included).

    A rank outside ``mesh`` holds nothing: shape 0 on every dim, offset the global shape. Under
    torch's LocalTensorMode, every simulated rank's (sizes that differ are ``LocalIntNode`` SymInts, as PyTorch's).
    """
    return simulation.run_for_each_simulated_rank(_own_local_shape_and_offset, tuple(global_shape), mesh, tuple(placements))


def _own_local_shape_and_offset(
    global_shape: tuple[int, ...], mesh: Any, placements: tuple[Placement, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return _local_shape_and_offset(global_shape, tuple(mesh.shape), mesh.get_coordinate(), placements)


def compute_global_tensor_info(
    tensor: torch.Tensor, mesh: Any, placements: Sequence[Placement]
) -> tuple[list[int], list[int]]:
    """Global shape and stride of a DTensor whose every rank holds a local piece like ``tensor``.

    Assumes even shards (each ``Shard(d)`` multiplies dim ``d`` by its mesh dim's size); the
    strides of dims laid out outside a sharded dim grow by the same factor. Shard dims must be
    non-negative, as in PyTorch.
    """
    shape = list(tensor.size())
    stride = list(tensor.stride())
    for mesh_dim, placement in enumerate(placements):
        size = mesh.size(mesh_dim)
        if isinstance(placement, (Shard, _StridedShard)):
            dim = placement.dim
            if dim < 0:
                raise AssertionError(f"Shard placements should have negative dims normalized in the user-facing APIs: {placement}")
            if dim >= len(shape):
                raise AssertionError(f"Sharding dim {dim} greater than tensor ndim {len(shape)} for placement number {mesh_dim}.")
            sharded_stride = stride[dim]
            shape[dim] *= size
            for other, other_stride in enumerate(stride):
                if other != dim and other_stride >= sharded_stride:
                    stride[other] = other_stride * size
        elif not isinstance(placement, (Replicate, Partial)):
            raise RuntimeError(f"placement type {type(placement)} not supported!")
    return shape, stride


def compute_local_tensor_info(
    global_tensor: torch.Tensor, mesh: Any, placements: Sequence[Placement]
) -> tuple[list[int], list[int]]:
    """Local shape and stride of each rank's piece of ``global_tensor`` laid out by ``placements`` (even shards).

    The inverse of :func:`compute_global_tensor_info`: each ``Shard(d)`` divides dim ``d`` by its
    mesh dim's size, and the strides of dims laid out outside dim ``d`` shrink by the same factor.
    """
    shape = list(global_tensor.size())
    stride = list(global_tensor.stride())
    for mesh_dim, placement in enumerate(placements):
        size = mesh.size(mesh_dim)
        if isinstance(placement, (Shard, _StridedShard)):
            dim = placement.dim
            if dim < 0 or dim >= len(shape):
                raise AssertionError(f"{placement} (placement {mesh_dim}) does not name a dim of a {len(shape)}-D tensor")
            if shape[dim] % size != 0:
                raise AssertionError(
                    f"dim {dim} of size {shape[dim]} does not split evenly over mesh dim {mesh_dim} of size {size}"
                )
            sharded_stride = stride[dim]
            shape[dim] //= size
            for other, other_stride in enumerate(stride):
                if other != dim and other_stride > sharded_stride:
                    stride[other] = other_stride // size
        elif not isinstance(placement, (Replicate, Partial)):
            raise RuntimeError(f"placement type {type(placement)} not supported!")
    return shape, stride


def compute_global_tensor_shape(shape: torch.Size, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Size:
    """The global shape from every rank's local ``shape`` (uneven shards included): one all-gather of the shapes.

    As in PyTorch, one placement on a 1-D mesh; the other dims must agree across ranks.
    """
    if len(placements) != 1:
        raise NotImplementedError("compute_global_tensor_shape only supports 1 placement for now.")
    if len(placements) != mesh.ndim:
        raise RuntimeError(
            f"Expected one placement per mesh dim, but found {len(placements)} placements and {mesh.ndim} mesh dims."
        )
    placement = placements[0]
    if isinstance(placement, Replicate):
        return torch.Size(shape)
    if not isinstance(placement, Shard):
        raise NotImplementedError(f"Placement type {type(placement)} not supported.")
    dim = placement.dim % len(shape)
    table = all_gather_rows_over_mesh(mesh, list(shape)).reshape(-1, len(shape))
    others = [d for d in range(len(shape)) if d != dim]
    for row in table:
        if any(int(row[d]) != shape[d] for d in others):
            raise RuntimeError("Non-sharded dimensions should have identical size across ranks.")
    global_shape = list(shape)
    global_shape[dim] = int(table[:, dim].sum())
    return torch.Size(global_shape)
