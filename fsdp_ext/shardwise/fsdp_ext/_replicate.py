"""``replicate``: data parallelism with replicated parameters on FSDP2's machinery (PyTorch's
``torch.distributed._composable.replicate_with_fsdp``).

Every rank of a 1-D mesh holds the whole parameter; gradients are averaged over the mesh after backward.
Built as what it is, hybrid sharding whose shard dim has one rank: the mesh is unflattened into
``(replicate=n, shard=1)`` and ``fully_shard`` runs on it, so parameters are DTensors, gradients are
all-reduced over the replicate dim, and no all-gather has anything to gather.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.nn as nn

from shardwise.mesh import DeviceMesh, init_device_mesh

from ._errors import FSDPError
from ._fully_shard import FSDPModule, fully_shard
from ._policies import MixedPrecisionPolicy, OffloadPolicy

__all__ = ["ReplicateModule", "replicate"]


class ReplicateModule(FSDPModule):
    """The class a module derives from once :func:`replicate` applied to it (an :class:`FSDPModule`)."""


def replicate(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
) -> Any:
    """Replicate ``module``'s parameters over the 1-D ``mesh`` (default: every rank) and average gradients."""
    if not isinstance(module, nn.Module):
        raise FSDPError(f"replicate expects an nn.Module, got {type(module).__name__}")
    if mesh is None:
        mesh = init_device_mesh("cpu" if dist.get_backend() == "gloo" else "cuda", (dist.get_world_size(),))
    if mesh.ndim != 1:
        raise FSDPError(f"replicate expects a 1-D mesh, got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}")
    name = (mesh.mesh_dim_names or ("replicate",))[0]
    hybrid = mesh._unflatten(0, (mesh.size(), 1), (name, f"{name}_shard"))
    fully_shard(
        module,
        mesh=hybrid,
        reshard_after_forward=False,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
    )
    sharded_class = type(module)
    module.__class__ = type(f"Replicate{sharded_class.__name__}", (sharded_class, ReplicateModule), {})
    return module
