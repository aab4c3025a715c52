"""PyTorch's ``torch.distributed.tensor._dtensor_spec`` names, from shardwise.placement."""

from shardwise.placement import DTensorSpec, ShardOrder, ShardOrderEntry, TensorMeta

__all__ = ["DTensorSpec", "ShardOrder", "ShardOrderEntry", "TensorMeta"]
