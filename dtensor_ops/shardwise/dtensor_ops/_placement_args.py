"""Checking and completing the mesh and placements a user passes (before anything communicates)."""

from __future__ import annotations

from typing import Sequence

from shardwise.mesh import DeviceMesh, MeshError, get_current_mesh, unwrap_traced_mesh
from shardwise.placement import Placement, Replicate, Shard

__all__ = ["normalize_placements", "resolve_device_mesh"]


def resolve_device_mesh(device_mesh: DeviceMesh | None, where: str) -> DeviceMesh:
    """``device_mesh`` itself, else the mesh entered with ``with mesh:``; raises when there is none."""
    if device_mesh is not None:
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(f"{where}: device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
        # Under torch.compile a mesh is a graph input, handed to code as torch's stand-in while tracing.
        return unwrap_traced_mesh(device_mesh)
    try:
        return get_current_mesh()
    except MeshError:
        raise RuntimeError(
            f"{where}: no device_mesh was given and no mesh is active; pass device_mesh=... or call it "
            "inside `with mesh:`"
        ) from None


def normalize_placements(
    placements: Sequence[Placement] | None, mesh: DeviceMesh, tensor_ndim: int, where: str
) -> tuple[Placement, ...]:
    """Placements as a tuple with non-negative Shard dims; defaults to all Replicate.

    Raises before any communication when the count or a shard dim is wrong.
    """
    if placements is None:
        return (Replicate(),) * mesh.ndim
    if isinstance(placements, Placement):
        raise TypeError(f"{where}: placements must be a sequence of Placement (one per mesh dim), got {placements!r}")
    result = tuple(placements)
    if len(result) != mesh.ndim:
        raise ValueError(
            f"{where}: `placements` must have the same length as `device_mesh.ndim`! Found placements length: "
            f"{len(result)}, and device_mesh.ndim: {mesh.ndim} (placements {result}, mesh {mesh})"
        )
    normalized: list[Placement] | None = None
    for mesh_dim, placement in enumerate(result):
        if not isinstance(placement, Placement):
            raise TypeError(
                f"{where}: placements[{mesh_dim}] is {placement!r} of type {type(placement).__name__}; "
                "expected Shard, Replicate or Partial"
            )
        if isinstance(placement, Shard):
            dim = placement.dim
            if not -tensor_ndim <= dim < tensor_ndim:
                raise ValueError(
                    f"{where}: {placement!r} on mesh dim {mesh_dim} is out of range for a tensor with "
                    f"{tensor_ndim} dims; expected a dim in [{-tensor_ndim}, {tensor_ndim - 1}]"
                )
            if dim < 0:
                if normalized is None:
                    normalized = list(result)
                normalized[mesh_dim] = Shard(dim + tensor_ndim)
    return result if normalized is None else tuple(normalized)
