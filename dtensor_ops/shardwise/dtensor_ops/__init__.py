"""shardwise.dtensor_ops: the distributed tensor (drop-in for ``torch.distributed.tensor``, PyTorch 2.13).

``DTensor`` is a ``torch.Tensor`` laid out over a :class:`DeviceMesh` by one
placement per mesh dim (``Shard``, ``Replicate``, ``Partial``).  Build one with
``distribute_tensor``, ``DTensor.from_local``, ``distribute_module`` or the
factories (``zeros``, ``ones``, ``empty``, ``full``, ``rand``, ``randn``); aten ops
on it run shard by shard with the communication their sharding rules require.

``DeviceMesh``/``init_device_mesh`` (from ``shardwise.mesh``) and the placements
(from ``shardwise.placement``) are re-exported, as PyTorch does.
"""

from shardwise.mesh import DeviceMesh as DeviceMesh
from shardwise.mesh import init_device_mesh as init_device_mesh
from shardwise.placement import Partial, Placement, Replicate, Shard

from ._dtensor import DTensor
from ._api import distribute_module, distribute_tensor
from ._factories import empty, full, ones, rand, randn, zeros

# DeviceMesh and init_device_mesh are importable from here but, as in torch.distributed.tensor,
# not part of __all__.
__all__ = [
    "DTensor",
    "distribute_tensor",
    "distribute_module",
    "Shard",
    "Replicate",
    "Partial",
    "Placement",
    "ones",
    "empty",
    "full",
    "rand",
    "randn",
    "zeros",
]
