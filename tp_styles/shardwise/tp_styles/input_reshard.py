"""``input_reshard``: keep only a shard of the tensors a TP module saves for backward (drop-in for PyTorch's).

Under tensor parallelism every rank of the TP mesh holds the same module input, so saving it whole
on every rank for the backward pass wastes memory: while the module's forward runs, the tensors
autograd saves are cut to this rank's shard along ``input_reshard_dim`` (a local chunk: no
communication) and gathered back (one all-gather each) when the backward pass needs them.
Unlike PyTorch's, the saved piece remembers its full shape, so uneven dims come back whole, and a
DTensor that was already sharded when saved comes back as it was (PyTorch's replicates it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from shardwise.dtensor_ops import DTensor, Replicate, Shard
from shardwise.mesh import DeviceMesh
from shardwise.placement import strides_in_local_dim_order

__all__ = ["input_reshard"]


@dataclass(frozen=True)
class _ShardedDTensor:
    """A replicated DTensor saved as its shard (a sharded DTensor saved as it is stays sharded)."""

    sharded: DTensor


@dataclass(frozen=True)
class _ShardedPlainTensor:
    """A plain tensor saved as this rank's shard of it."""

    shard: torch.Tensor
    global_shape: torch.Size


def input_reshard(module: nn.Module, tp_device_mesh: DeviceMesh, input_reshard_dim: int | None = None) -> nn.Module:
    """Register hooks on ``module`` so that what its forward saves for backward is kept sharded over ``tp_device_mesh``.

    ``input_reshard_dim``: the tensor dim to shard the saved tensors on; ``None`` leaves the module
    as it is. Saved DTensors that are replicated on every mesh dim and plain tensors with at least
    as many elements as the mesh has ranks are sharded; everything else is saved as it is. Returns
    ``module``.
    """
    if input_reshard_dim is None:
        return module
    if not isinstance(module, nn.Module):
        raise TypeError(f"input_reshard expects an nn.Module, got {type(module).__name__}")
    if not isinstance(tp_device_mesh, DeviceMesh):
        raise TypeError(f"input_reshard expects a DeviceMesh as tp_device_mesh, got {type(tp_device_mesh).__name__}")
    if tp_device_mesh.ndim != 1:
        raise ValueError(f"input_reshard expects a 1-D TP mesh, got a {tp_device_mesh.ndim}-D mesh {tp_device_mesh}")
    hooks = _SavedTensorResharding(tp_device_mesh, input_reshard_dim)
    module.register_forward_pre_hook(hooks.enter)
    module.register_forward_hook(hooks.leave)
    return module


class _SavedTensorResharding:
    def __init__(self, mesh: DeviceMesh, dim: int) -> None:
        self.mesh = mesh
        self.dim = dim
        self.active: list[torch.autograd.graph.saved_tensors_hooks] = []

    def enter(self, module: nn.Module, inputs: Any) -> None:
        context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        context.__enter__()
        self.active.append(context)

    def leave(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
        if self.active:
            self.active.pop().__exit__(None, None, None)

    def _shard_dim(self, ndim: int) -> int | None:
        return self.dim + ndim if -ndim <= self.dim < 0 else (self.dim if 0 <= self.dim < ndim else None)

    def pack(self, tensor: torch.Tensor) -> Any:
        mesh = self.mesh
        dim = self._shard_dim(tensor.ndim)
        if dim is None:
            return tensor
        with torch.no_grad():
            if isinstance(tensor, DTensor):
                if tensor.device_mesh == mesh and all(p.is_replicate() for p in tensor.placements):
                    return _ShardedDTensor(tensor.redistribute(mesh, [Shard(dim)]))
                return tensor
            if tensor.numel() >= mesh.size():
                shard = DTensor.from_local(tensor, mesh, [Replicate()]).redistribute(mesh, [Shard(dim)]).to_local()
                return _ShardedPlainTensor(shard, tensor.shape)
        return tensor

    def unpack(self, saved: Any) -> torch.Tensor:
        mesh = self.mesh
        with torch.no_grad():
            if isinstance(saved, _ShardedPlainTensor):
                dim = self._shard_dim(len(saved.global_shape))
                sharded = DTensor.from_local(
                    saved.shard,
                    mesh,
                    [Shard(dim if dim is not None else 0)],
                    shape=saved.global_shape,
                    stride=strides_in_local_dim_order(saved.shard, saved.global_shape),
                )
                return sharded.redistribute(mesh, [Replicate()]).to_local()
            if isinstance(saved, _ShardedDTensor):
                return saved.sharded.redistribute(mesh, [Replicate()])
        result: torch.Tensor = saved
        return result
