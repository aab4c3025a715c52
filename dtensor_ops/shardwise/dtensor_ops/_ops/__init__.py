"""Sharding rules per op family.  Importing this package registers all of them.

Each family module states, for one mesh dim, the placements its ops can run
under (see :mod:`._strategy`); :mod:`shardwise.dtensor_ops._sharding_prop`
extends them to n-D meshes and picks the cheapest.
"""

from . import (
    attention,
    concat_split,
    foreach_ops,
    indexing,
    math_ops,
    matrix,
    nn_ops,
    norm_ops,
    pointwise,
    random_ops,
    reduction,
    tensor_basics,
    view_ops,
)
from ._strategy import (
    LINEAR_REDUCE_OPS,
    ArgPosition,
    OneDimStrategy,
    OpCall,
    PlacementsPerTensor,
    ShardingRule,
    register_rule,
    registered_ops,
    rule_for,
)

__all__ = [
    "ArgPosition",
    "LINEAR_REDUCE_OPS",
    "OneDimStrategy",
    "OpCall",
    "PlacementsPerTensor",
    "ShardingRule",
    "concat_split",
    "matrix",
    "pointwise",
    "reduction",
    "register_rule",
    "registered_ops",
    "rule_for",
    "tensor_basics",
    "view_ops",
]
