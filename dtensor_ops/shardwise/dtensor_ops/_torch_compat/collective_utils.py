"""PyTorch's ``torch.distributed.tensor._collective_utils`` helpers, over shardwise's planner and collectives."""

from __future__ import annotations

from typing import Any

import torch

from shardwise.mesh import DeviceMesh
from shardwise.placement import DTensorSpec

from .._collectives import launch_all_to_all, mesh_dim_group_name, wait
from .._planner import redistribute_cost_picoseconds

__all__ = ["pad_tensor", "redistribute_cost", "shard_dim_alltoall", "unpad_tensor"]


def redistribute_cost(current_spec: DTensorSpec[Any], target_spec: DTensorSpec[Any]) -> float:
    """The communication cost of redistributing ``current_spec`` to ``target_spec``.

    As PyTorch's: 0 for the same placements or a replicated source, ``inf`` across meshes, else an
    estimated time in microseconds: here the fastest plan's time under the mesh's cost profile
    (``_cost_model``; PyTorch prices its own plan with its own bandwidth model). Needs
    ``tensor_meta`` on both specs.
    """
    if current_spec.mesh != target_spec.mesh:
        return float("inf")
    if current_spec.layout_placements == target_spec.layout_placements or current_spec.is_replicated():
        return 0.0
    return redistribute_cost_picoseconds(current_spec, target_spec) * 1e-6


def shard_dim_alltoall(
    input: torch.Tensor, gather_dim: int, shard_dim: int, mesh: DeviceMesh, mesh_dim: int
) -> torch.Tensor:
    """This rank's piece after moving the sharding along ``mesh_dim`` from ``gather_dim`` to ``shard_dim``.

    ``input`` is this rank's shard along ``gather_dim``; the result holds the whole
    ``gather_dim`` and this rank's chunk of ``shard_dim``. One ``all_to_all_single`` (gloo
    included; PyTorch falls back to all-gather and chunk on CPU). ``shard_dim`` of ``input`` must
    divide evenly by the mesh dim's size.
    """
    group_size = mesh.size(mesh_dim)
    ndim = input.ndim
    if not -ndim <= gather_dim < ndim or not -ndim <= shard_dim < ndim:
        raise IndexError(f"shard_dim_alltoall: gather_dim {gather_dim} / shard_dim {shard_dim} out of range for a {ndim}-d input")
    gather_dim, shard_dim = gather_dim % ndim, shard_dim % ndim
    if input.size(shard_dim) % group_size != 0:
        raise ValueError(
            f"shard_dim_alltoall: dim {shard_dim} of the input has size {input.size(shard_dim)}, which does not "
            f"divide evenly over mesh dim {mesh_dim} of size {group_size}"
        )
    if group_size == 1:
        return input
    # Chunk i (of shard_dim) goes to member i; stacked on a new leading dim for the collective.
    send = torch.stack(torch.chunk(input, group_size, dim=shard_dim))
    received = wait(launch_all_to_all(send, group_size, mesh_dim_group_name(mesh, mesh_dim)))
    # Piece j came from member j: its part of gather_dim, in member order.
    return torch.cat(list(received.unbind(0)), dim=gather_dim)


def pad_tensor(tensor: torch.Tensor, pad_dim: int, pad_size: int) -> torch.Tensor:
    """``tensor`` with ``pad_size`` zeros appended along ``pad_dim``."""
    if pad_size == 0:
        return tensor
    pad = [0, 0] * (tensor.ndim - pad_dim)
    pad[-1] = pad_size
    return torch.nn.functional.pad(tensor, pad)


def unpad_tensor(tensor: torch.Tensor, pad_dim: int, pad_size: int) -> torch.Tensor:
    """``tensor`` without its last ``pad_size`` entries along ``pad_dim`` (a view)."""
    if pad_size == 0:
        return tensor
    return tensor.narrow(pad_dim, 0, tensor.size(pad_dim) - pad_size)
