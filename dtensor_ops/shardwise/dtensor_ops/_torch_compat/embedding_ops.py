"""PyTorch's ``_MaskPartial`` placement name (``torch.distributed.tensor._ops._embedding_ops``).

The placement itself lives with the other placements (``shardwise.placement._mask_partial``), so
``torch.distributed.tensor.placement_types._MaskPartial`` has a home there too.
"""

from shardwise.placement import _MaskPartial

__all__ = ["_MaskPartial"]
