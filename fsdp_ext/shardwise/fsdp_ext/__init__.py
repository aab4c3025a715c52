"""shardwise.fsdp_ext: fully sharded data parallelism on shardwise DTensors.

``fully_shard`` has the API of PyTorch 2.13's ``torch.distributed.fsdp.fully_shard`` (FSDP2)
and works with shardwise's tensor parallelism on a 2-D ``(dp, tp)`` mesh.
"""

from ._fully_shard import FSDPModule, UnshardHandle, fully_shard
from ._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
]
