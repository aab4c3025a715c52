"""``torch.distributed.fsdp._fully_shard._fully_shard``: ``fully_shard`` and ``FSDPModule``."""

from .._fully_shard import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method, share_comm_ctx

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method", "share_comm_ctx"]
