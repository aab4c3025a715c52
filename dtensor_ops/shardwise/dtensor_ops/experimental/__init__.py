"""Experimental DTensor APIs (mirrors ``torch.distributed.tensor.experimental``)."""

from .._implicit_replication import implicit_replication
from ._attention import context_parallel
from ._local_map import local_map
from ._register_sharding import register_sharding
from ._replicate_fallback import ReplicateFallbackWarning, replicate_fallback

__all__ = [
    "ReplicateFallbackWarning",
    "context_parallel",
    "implicit_replication",
    "local_map",
    "register_sharding",
    "replicate_fallback",
]
