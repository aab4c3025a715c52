"""``torch.distributed.fsdp._fully_shard._fsdp_api``: the policy and mesh-dims dataclasses."""

from .._policies import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["CPUOffloadPolicy", "DataParallelMeshDims", "MixedPrecisionPolicy", "OffloadPolicy"]
