"""shardwise.placement: placements, DTensorSpec and shard layout math (pure; no communication).

Drop-in for ``torch.distributed.tensor.placement_types`` plus the layout helpers
the rest of shardwise builds on.
"""

from ._layout import (
    chunk_size_and_offset,
    chunk_sizes,
    compute_local_shape,
    compute_local_shape_and_global_offset,
    normalize_dim,
    pad_dim,
    select_local_shard,
    shard_sizes_along_mesh_dim,
    split_tensor,
    unpad_dim,
)
from ._mesh_protocol import MeshLike
from ._placements import SUPPORTED_REDUCE_OPS, Partial, Placement, Replicate, Shard
from ._spec import DTensorSpec, TensorMeta

# PyTorch code written before Partial became public imports it under this name.
_Partial = Partial

__all__ = [
    "Placement",
    "Shard",
    "Replicate",
    "Partial",
    "SUPPORTED_REDUCE_OPS",
    "TensorMeta",
    "DTensorSpec",
    "MeshLike",
    "chunk_size_and_offset",
    "chunk_sizes",
    "compute_local_shape_and_global_offset",
    "compute_local_shape",
    "shard_sizes_along_mesh_dim",
    "select_local_shard",
    "split_tensor",
    "pad_dim",
    "unpad_dim",
    "normalize_dim",
]
