"""``_NormPartial``: a pending p-norm over the ranks, PyTorch's placement for a norm of sharded data.

Each rank holds the p-norm of its piece; the true value is the p-norm of those, ``(sum |n_i|^p)^(1/p)``.
Orders 1 and 0 are plain sums and the infinite ones a max / min: for those ``reduce_op`` is
``"sum"``, ``"max"`` or ``"min"`` (as PyTorch's) and the placement reduces like that ``Partial``. Any other
positive finite order has its own pending reduction, ``reduce_op == norm_reduce_op(p)`` (``"norm_2"``
for the 2-norm): the collectives raise each value to the power p, sum, and take the p-th root
(:func:`norm_order_of` reads p back), so no two different pending reductions share a name.
"""

from __future__ import annotations

import math
from typing import Any

from ._placements import Partial, Placement

__all__ = ["_NormPartial", "norm_order_of", "norm_reduce_op"]

_NORM_PREFIX = "norm_"


def norm_reduce_op(norm_type: float) -> str:
    """The pending reduction of a p-norm: sum / max / min where it is one, else ``"norm_<p>"``."""
    if norm_type in (0, 1):
        return "sum"
    if norm_type == math.inf:
        return "max"
    if norm_type == -math.inf:
        return "min"
    return f"{_NORM_PREFIX}{float(norm_type)!r}"


def norm_order_of(reduce_op: str) -> float | None:
    """p for a ``"norm_<p>"`` reduction, None for any other reduce op."""
    if not reduce_op.startswith(_NORM_PREFIX):
        return None
    return float(reduce_op[len(_NORM_PREFIX) :])


class _NormPartial(Partial):
    __slots__ = ("norm_type",)
    norm_type: float

    def __init__(self, norm_type: float | int = 2) -> None:
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or math.isnan(norm_type):
            raise ValueError(f"_NormPartial needs a real norm order, got {norm_type!r}")
        if math.isfinite(norm_type) and norm_type < 0:
            raise ValueError(f"_NormPartial: negative norm orders are not supported, got {norm_type!r}")
        reduce_op = norm_reduce_op(norm_type)
        if reduce_op in ("sum", "max", "min"):
            super().__init__(reduce_op)
        else:
            object.__setattr__(self, "reduce_op", reduce_op)
        object.__setattr__(self, "norm_type", norm_type)
        object.__setattr__(self, "_hash", hash((_NormPartial, float(norm_type))))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _NormPartial):
            return NotImplemented if not isinstance(other, Placement) else False
        return float(self.norm_type) == float(other.norm_type)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"_NormPartial(reduce_op={self.reduce_op}, norm_type={self.norm_type})"

    def __str__(self) -> str:
        return f"NormP({self.norm_type})"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_NormPartial, (self.norm_type,))
