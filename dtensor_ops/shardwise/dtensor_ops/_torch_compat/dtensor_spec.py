"""PyTorch's ``torch.distributed.tensor._dtensor_spec`` names, from shardwise.placement."""

from shardwise.placement import DTensorSpec, TensorMeta

__all__ = ["DTensorSpec", "TensorMeta"]
