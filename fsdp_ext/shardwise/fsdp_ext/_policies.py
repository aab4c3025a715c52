"""Mixed-precision and offload policies, and the data-parallel dims of a full SPMD mesh of ``fully_shard`` (same names and fields as PyTorch's FSDP2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims"]


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


@dataclass
class DataParallelMeshDims:
    """Which named dims of a full SPMD mesh are data parallel, for ``fully_shard(mesh=spmd_mesh, dp_mesh_dims=...)``.

    The parameters then are DTensors on that whole mesh with ``Replicate()`` on these dims.
    - ``shard``: the dim name(s) FSDP shards the parameters over; several names are flattened into
      one shard dim (``mesh[names]._flatten("_".join(names))``).
    - ``replicate``: the dim name(s) the sharded parameters stay replicated over (HSDP); several names
      are flattened into one replicate dim.
    At least one of them must be set (``ValueError`` otherwise).
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "At least one of shard or replicate must be set in DataParallelMeshDims; got shard=None and "
                "replicate=None"
            )

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)
