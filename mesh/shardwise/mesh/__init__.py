"""shardwise.mesh: a drop-in for ``torch.distributed.device_mesh`` (PyTorch 2.13).

``DeviceMesh`` lays global ranks out on an n-D grid and owns one c10d process group per mesh
dim; ``init_device_mesh`` builds one over the whole world. Only imports torch and
torch.distributed.
"""

from shardwise.mesh._device_mesh import (
    DeviceMesh,
    _register_distributed_opaque_types,
    _register_opaque_type_registration,
    get_current_mesh,
    init_device_mesh,
)
from shardwise.mesh._errors import MeshDimError, MeshError

__all__ = ["DeviceMesh", "MeshDimError", "MeshError", "get_current_mesh", "init_device_mesh"]
