"""PyTorch's ``torch.distributed.tensor._redistribute`` names over shardwise's redistribution.

``redistribute_local_tensor`` is the executor itself (``_redistribution``); ``Redistribute`` is
PyTorch's autograd-function spelling of ``DTensor.redistribute``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from shardwise.placement import Placement

from .._redistribution import (
    RedistributeStep,
    StepKind,
    grad_target_spec,
    gradient_placements,
    plan_bytes_per_rank,
    plan_redistribute,
    redistribute_cost_bytes,
    redistribute_local_tensor,
    redistribute_lower_bound_bytes,
)

__all__ = [
    "Redistribute",
    "RedistributeStep",
    "StepKind",
    "grad_target_spec",
    "gradient_placements",
    "plan_bytes_per_rank",
    "plan_redistribute",
    "redistribute_cost_bytes",
    "redistribute_local_tensor",
    "redistribute_lower_bound_bytes",
]


class Redistribute:
    """PyTorch's ``Redistribute`` autograd function: ``Redistribute.apply(input, device_mesh, placements, ...)``.

    The same as ``input.redistribute(device_mesh, placements, async_op=..., forward_dtype=...,
    backward_dtype=...)`` (differentiable, twice over). ``apply`` also takes PyTorch 2.13's fifth
    positional argument, the ``{"op_dtype", "out_dtype", "backward_options"}`` dtype configuration.
    """

    @staticmethod
    def apply(
        input: torch.Tensor,
        device_mesh: Any,
        placements: Sequence[Placement],
        async_op: bool = False,
        dtype_config: Mapping[str, Any] | torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        forward_dtype: torch.dtype | None
        if isinstance(dtype_config, Mapping):
            forward_dtype = dtype_config.get("op_dtype")
            backward_options = dtype_config.get("backward_options") or {}
            backward_dtype = backward_options.get("op_dtype", backward_dtype)
        else:
            forward_dtype = dtype_config
        redistribute = getattr(input, "redistribute", None)
        if redistribute is None or not hasattr(input, "_spec"):
            raise TypeError(f"Redistribute.apply expects a DTensor, got {type(input).__name__}")
        result: torch.Tensor = redistribute(
            device_mesh, placements, async_op=async_op, forward_dtype=forward_dtype, backward_dtype=backward_dtype
        )
        return result
