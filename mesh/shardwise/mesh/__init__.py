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
    unwrap_traced_mesh,
)
from shardwise.mesh._errors import MeshDimError, MeshError

# PyTorch 2.13's module exports its layout class under this name; torch.compile's guards import it from
# torch.distributed.device_mesh (shardwise.mesh under shardwise.torch_switch).
from shardwise.mesh._layout import MeshLayout as _MeshLayout

__all__ = ["DeviceMesh", "MeshDimError", "MeshError", "get_current_mesh", "init_device_mesh"]
