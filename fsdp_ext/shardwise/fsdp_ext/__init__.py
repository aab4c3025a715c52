"""shardwise.fsdp_ext: fully sharded data parallelism on shardwise DTensors.

``fully_shard`` has the API of PyTorch 2.13's ``torch.distributed.fsdp.fully_shard`` (FSDP2)
and works with shardwise's tensor parallelism on a 2-D ``(dp, tp)`` mesh.
"""

from ._errors import FSDPError
from ._fully_shard import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method, share_comm_ctx
from ._mesh_info import DDPMeshInfo, FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
from ._policies import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy


def __getattr__(name: str) -> object:
    # DTensorExtensions builds on torch.distributed.fsdp (FSDP1), which loads PyTorch's DTensor:
    # imported on first use only, so that fully_shard users never pay for it.
    if name == "DTensorExtensions":
        from ._fsdp1_extensions import DTensorExtensions

        return DTensorExtensions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FSDPError",
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPMeshInfo",
    "HSDPMeshInfo",
    "DDPMeshInfo",
    "ShardPlacementResult",
    "DTensorExtensions",
]
