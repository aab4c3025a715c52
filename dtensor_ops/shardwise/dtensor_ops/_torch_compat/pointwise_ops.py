"""PyTorch's ``torch.distributed.tensor._ops._pointwise_ops`` names that torch's own code calls.

``torch._inductor.inductor_prims`` calls ``register_inductor_prims()`` right after it creates its prims,
to give DTensor a sharding strategy for them; with torch's paths resolving to shardwise
(``shardwise.torch_switch``) that call reaches this module, and gives them shardwise's pointwise rule.
"""

from __future__ import annotations

import torch

from .._ops.pointwise import POINTWISE_RULE
from .._rules import rule_for, register_rule

__all__ = ["register_inductor_prims"]


def register_inductor_prims() -> None:
    """Shard ``prims.fma`` (a fused multiply-add inductor creates) like any elementwise op (idempotent)."""
    fma = torch.ops.prims.fma.default
    if rule_for(fma) is None:
        register_rule([fma], POINTWISE_RULE)
