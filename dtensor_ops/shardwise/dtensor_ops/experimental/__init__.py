"""Experimental DTensor APIs (mirrors ``torch.distributed.tensor.experimental``)."""

from .._implicit_replication import implicit_replication
from ._local_map import local_map
from ._register_sharding import register_sharding

__all__ = ["implicit_replication", "local_map", "register_sharding"]
