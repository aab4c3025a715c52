"""PyTorch's ``torch.distributed.tensor._ops.utils`` helpers that tests and users import."""

from __future__ import annotations

from typing import Any

from shardwise.placement import DTensorSpec
from shardwise.placement import normalize_dim as _normalize_dim

from .op_schema import (
    expand_to_full_mesh_op_strategy,
    generate_redistribute_costs,
    is_tensor_shardable,
    register_op_strategy,
    register_prop_rule,
)

__all__ = [
    "expand_to_full_mesh_op_strategy",
    "generate_redistribute_costs",
    "is_tensor_partial",
    "is_tensor_shardable",
    "normalize_dim",
    "register_op_strategy",
    "register_prop_rule",
]


def normalize_dim(dim: int, ndim: int) -> int:
    """``dim`` counted from the front (``dim + ndim`` for negative dims); raises for dims out of range."""
    return _normalize_dim(dim, ndim)


def is_tensor_partial(spec: DTensorSpec[Any]) -> bool:
    """Whether any mesh dim of ``spec`` holds a ``Partial`` placement."""
    return any(placement.is_partial() for placement in spec.placements)
