"""``shardwise.dtensor_ops.random``: seeding for random ops on DTensors (drop-in for ``torch.distributed.tensor.random``).

Random ops on DTensors draw per shard from the ranks' own generators, which must
be in the same state on every rank of the mesh: seed them alike with
:func:`manual_seed` (or ``torch.manual_seed(seed)`` on every rank). See the
package README, "Random ops", for what holds on CPU and on CUDA.
"""

import warnings

import torch
from shardwise.mesh import DeviceMesh

from ._collectives import broadcast_along_mesh_dim

__all__ = ["is_rng_supported_mesh", "manual_seed"]


def broadcast_first_rank_rng_state(mesh: DeviceMesh, state: torch.Tensor) -> torch.Tensor:
    """The generator state of the mesh's first rank (coordinate 0 on every dim), on every rank of the mesh.

    Along dim 0 every rank (i, j, ...) gets the state of (0, j, ...), then along dim 1 that of
    (0, 0, ...), and so on: one broadcast per mesh dim of size > 1 (what ``OffsetBasedRNGTracker(run_state_sync=True)``
    does when it is made).
    """
    carrier = state.to(mesh.device_type)
    for mesh_dim in range(mesh.ndim):
        if mesh.shape[mesh_dim] > 1:
            carrier = broadcast_along_mesh_dim(carrier, mesh, mesh_dim, 0)
    return carrier.to(state.device)


def is_rng_supported_mesh(device_mesh: DeviceMesh) -> bool:
    """Whether random ops on DTensors of ``device_mesh`` draw per shard (``_shard_rng`` says how).

    True for CPU meshes and for CUDA meshes when CUDA is available (PyTorch's
    DTensor supports only CUDA-like devices here; ours also supports CPU). Other
    device types warn and return False: random ops on them run each rank's
    generator as it is.
    """
    device_type = device_mesh.device_type
    if device_type == "cpu" or (device_type == "cuda" and torch.cuda.is_available()):
        return True
    warnings.warn(
        f"DTensor random operators may not have complete support on {device_type} device mesh",
        UserWarning,
        stacklevel=2,
    )
    return False


def manual_seed(seed: int, device_mesh: DeviceMesh) -> None:
    """Seed the calling rank's generators (all devices) with ``seed``; call it with the same seed on every rank.

    Random ops on DTensors rely on every rank of the mesh drawing from generators
    in the same state; this is ``torch.manual_seed(seed)`` after checking that the
    calling rank belongs to ``device_mesh``. The value of ``seed`` is not checked
    against the other ranks' (that would need a collective).
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"manual_seed: seed must be an int, got {type(seed).__name__} {seed!r}")
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"manual_seed: device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
    if device_mesh.get_coordinate() is None:
        raise RuntimeError(
            f"manual_seed requires the calling rank to be part of the device mesh {device_mesh!r} (mesh ranks "
            f"{device_mesh.mesh.flatten().tolist()}); otherwise its DTensor random ops would not be in step with the "
            "mesh's ranks"
        )
    if device_mesh.device_type not in ("cpu", "cuda"):
        is_rng_supported_mesh(device_mesh)
    torch.manual_seed(seed)
