"""Mixed-precision and offload policies of ``fully_shard`` (same names and fields as PyTorch's FSDP2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of one ``fully_shard`` unit's communication and computation.

    - ``param_dtype``: the unsharded parameters (what forward and backward compute with) and
      the all-gather are in this dtype; the sharded parameters, their gradients and the
      optimizer keep the original dtype.  ``None``: the original dtype.
    - ``reduce_dtype``: gradients are reduce-scattered in this dtype (then cast to the sharded
      parameter's dtype).  ``None``: ``param_dtype`` (or the original dtype).
    - ``output_dtype``: floating-point forward outputs are cast to it.  ``None``: left as they are.
    - ``cast_forward_inputs``: floating-point forward inputs are cast to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the mesh's device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters and gradients live in CPU memory (only meaningful on an accelerator mesh).

    On a CPU mesh everything already lives in CPU memory, so this is what ``fully_shard``
    does anyway.  On an accelerator mesh ``fully_shard`` refuses it (not implemented).
    """

    pin_memory: bool = True
