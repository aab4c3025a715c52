"""shardwise.placement: placements, DTensorSpec and shard layout math (pure; no communication).

Drop-in for ``torch.distributed.tensor.placement_types`` plus the layout helpers
the rest of shardwise builds on.
"""

from ._layout import (
    chunk_size_and_offset,
    chunk_sizes,
    compute_local_shape,
    compute_local_shape_and_global_offset,
    contiguous_strides,
    even_global_shape,
    has_uneven_shards,
    local_index_runs,
    normalize_dim,
    pad_dim,
    select_local_shard,
    shard_sizes_along_mesh_dim,
    split_tensor,
    strides_in_local_dim_order,
    unpad_dim,
)
from ._mesh_protocol import MeshLike
from ._placements import SUPPORTED_REDUCE_OPS, Partial, Placement, Replicate, Shard, _StridedShard, holds_same_values
from ._mask_partial import _MaskPartial
from ._norm_partial import _NormPartial, norm_order_of, norm_reduce_op
from ._shard_order import ShardOrder, ShardOrderEntry
from ._spec import DTensorSpec, TensorMeta

# PyTorch code written before Partial became public imports it under this name.
_Partial = Partial

__all__ = [
    "Placement",
    "Shard",
    "_StridedShard",
    "_MaskPartial",
    "_NormPartial",
    "norm_order_of",
    "norm_reduce_op",
    "Replicate",
    "Partial",
    "SUPPORTED_REDUCE_OPS",
    "holds_same_values",
    "TensorMeta",
    "DTensorSpec",
    "ShardOrder",
    "ShardOrderEntry",
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
    "contiguous_strides",
    "strides_in_local_dim_order",
    "even_global_shape",
    "has_uneven_shards",
    "local_index_runs",
]
