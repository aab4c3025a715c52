"""Experimental DTensor APIs (mirrors ``torch.distributed.tensor.experimental``)."""

from .._implicit_replication import implicit_replication

__all__ = ["implicit_replication"]
