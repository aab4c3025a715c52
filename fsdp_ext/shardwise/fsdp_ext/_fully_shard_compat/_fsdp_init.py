"""``torch.distributed.fsdp._fully_shard._fsdp_init``: ``_get_mesh_info``, the mesh info ``fully_shard`` uses."""

from .._mesh_info import get_mesh_info as _get_mesh_info

__all__ = ["_get_mesh_info"]
