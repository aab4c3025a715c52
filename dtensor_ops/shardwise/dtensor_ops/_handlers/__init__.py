"""dtensor_ops's own op handlers: ops whose DTensor behaviour is an algorithm with its own communication.

The package ``__init__`` registers :data:`BUILTIN_OP_HANDLERS` with ``_op_handlers``; they sit
above the DTensor class and below dispatch (they run DTensor-level logic on local tensors and
communicate through redistribution or ``_collectives``).
"""

from __future__ import annotations

import torch

from .._op_handlers import OpHandler
from .as_strided import AS_STRIDED_HANDLERS
from .conv_halo import CONV_HALO_HANDLERS
from .foreach_norm import FOREACH_NORM_HANDLERS, norms_across_shards
from .inplace_views import INPLACE_VIEW_HANDLERS
from .lists_across_meshes import LIST_MESH_HANDLERS
from .nll_loss import NLL_LOSS_HANDLERS
from .value_sized import VALUE_SIZED_HANDLERS

__all__ = ["BUILTIN_OP_HANDLERS", "norms_across_shards"]

BUILTIN_OP_HANDLERS: dict[torch._ops.OpOverload, OpHandler] = {
    # First, so that an op with a handler of its own below (_foreach_norm groups meshes itself) keeps it.
    **LIST_MESH_HANDLERS,
    **FOREACH_NORM_HANDLERS,
    **NLL_LOSS_HANDLERS,
    **INPLACE_VIEW_HANDLERS,
    **VALUE_SIZED_HANDLERS,
    **AS_STRIDED_HANDLERS,
    **CONV_HALO_HANDLERS,
}
