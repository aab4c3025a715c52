"""Composite ops reaching DTensor dispatch whole: run through their own decomposition.

``aten.matmul`` and ``aten.linear`` are CompositeImplicitAutograd: under autograd torch decomposes
them before DTensor sees them, but with autograd off (``torch.inference_mode()``) they arrive
whole. Their decomposition (``mm``/``bmm``/``addmm``/views, each with a rule) is exactly what
autograd would have run, so the handler runs it: the same shardings and values as with autograd on.
"""

from __future__ import annotations

from typing import Any

import torch

from .._op_handlers import OpHandler

__all__ = ["COMPOSITE_HANDLERS"]

aten = torch.ops.aten


def _decompose(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Registered with declines_by_key: it never declines for these ops.
    return op.decompose(*args, **kwargs)


COMPOSITE_HANDLERS: dict[torch._ops.OpOverload, OpHandler] = {
    aten.matmul.default: _decompose,
    aten.linear.default: _decompose,
}
