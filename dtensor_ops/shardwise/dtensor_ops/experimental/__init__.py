"""Experimental DTensor APIs (mirrors ``torch.distributed.tensor.experimental``)."""

from .._dispatch import implicit_replication

__all__ = ["implicit_replication"]
