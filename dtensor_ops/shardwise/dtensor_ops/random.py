"""``shardwise.dtensor_ops.random``: seeding for random ops on DTensors (drop-in for ``torch.distributed.tensor.random``).

Random ops on DTensors draw per shard from the ranks' own generators, which must
be in the same state on every rank of the mesh: seed them alike with
:func:`manual_seed` (or ``torch.manual_seed(seed)`` on every rank). See the
package README, "Random ops", for what holds on CPU and on CUDA.
"""

import torch
from shardwise.mesh import DeviceMesh

from ._collectives import broadcast_along_mesh_dim
from ._random import is_rng_supported_mesh, manual_seed

__all__ = ["is_rng_supported_mesh", "manual_seed"]


def broadcast_first_rank_rng_state(mesh: DeviceMesh, state: torch.Tensor) -> torch.Tensor:
    """The generator state of the mesh's first rank (coordinate 0 on every dim), on every rank of the mesh.

    Along dim 0 every rank (i, j, ...) gets the state of (0, j, ...), then along dim 1 that of
    (0, 0, ...), and so on: one broadcast per mesh dim of size > 1 (``_random.set_rng_state_sync``).
    """
    carrier = state.to(mesh.device_type)
    for mesh_dim in range(mesh.ndim):
        if mesh.shape[mesh_dim] > 1:
            carrier = broadcast_along_mesh_dim(carrier, mesh, mesh_dim, 0)
    return carrier.to(state.device)
