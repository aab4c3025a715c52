"""``_MaskPartial``: PyTorch's placement for a row-sharded embedding lookup's pending sum.

shardwise's embedding and masked-gather rules give their outputs this placement, PyTorch's name:
the masking of ids outside a rank's rows happens in the rules' local kernels, so the pending value
is an ordinary sum. It is a ``Partial("sum")`` carrying PyTorch's ``offset_shape`` / ``offset_dim``
(the shape of the sharded table and its sharded dim); it reduces as a sum, and any op or plan that
wants a ``Partial("sum")`` takes it as it is (a relabel, no data moved).
"""

from __future__ import annotations

from typing import Any

import torch

from ._placements import Partial, Placement

__all__ = ["_MaskPartial"]


class _MaskPartial(Partial):
    __slots__ = ("offset_shape", "offset_dim", "mask_buffer")
    offset_shape: torch.Size | None
    offset_dim: int
    mask_buffer: Any

    def __init__(self, offset_shape: torch.Size | None = None, offset_dim: int = 0, reduce_op: str = "sum") -> None:
        if reduce_op != "sum":
            raise ValueError(f"_MaskPartial reduces by summing; got reduce_op={reduce_op!r}")
        super().__init__("sum")
        object.__setattr__(self, "offset_shape", torch.Size(offset_shape) if offset_shape is not None else None)
        object.__setattr__(self, "offset_dim", offset_dim)
        object.__setattr__(self, "mask_buffer", None)
        object.__setattr__(self, "_hash", hash((_MaskPartial, self.offset_shape, offset_dim)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _MaskPartial):
            return NotImplemented if not isinstance(other, Placement) else False
        return (self.offset_shape, self.offset_dim) == (other.offset_shape, other.offset_dim)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"_MaskPartial(offset_shape={self.offset_shape}, offset_dim={self.offset_dim})"

    def __str__(self) -> str:
        return "MaskP"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_MaskPartial, (self.offset_shape, self.offset_dim))
