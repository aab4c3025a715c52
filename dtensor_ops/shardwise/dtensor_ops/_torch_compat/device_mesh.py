"""PyTorch's old ``torch.distributed._tensor.device_mesh`` names: the mesh lives in ``shardwise.mesh``.

A mechanical import swap (``torch.distributed._tensor`` -> ``shardwise.dtensor_ops``) turns
``torch.distributed._tensor.device_mesh`` into ``shardwise.dtensor_ops.device_mesh``: this is it.
"""

from shardwise.mesh import DeviceMesh, init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh"]
