"""``torch.distributed.fsdp._fully_shard._fsdp_common``: mesh infos and ``shard_placement_fn`` results."""

from .._mesh_info import (
    DataParallelMeshInfo,
    DDPMeshInfo,
    FSDPMeshInfo,
    HSDPMeshInfo,
    ShardPlacementFnResult,
    ShardPlacementResult,
    resolve_shard_placement,
)
from .._policies import DataParallelMeshDims

__all__ = [
    "DataParallelMeshDims",
    "DataParallelMeshInfo",
    "DDPMeshInfo",
    "FSDPMeshInfo",
    "HSDPMeshInfo",
    "ShardPlacementFnResult",
    "ShardPlacementResult",
    "resolve_shard_placement",
]
