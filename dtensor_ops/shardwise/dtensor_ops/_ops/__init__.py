"""Sharding rules per op family (the rules layer of dtensor_ops).  Importing this package registers all of them.

Each family module states, for one mesh dim, the placements its ops can run
under (the rule types are in :mod:`shardwise.dtensor_ops._rules`);
:mod:`shardwise.dtensor_ops._propagation` extends them to n-D meshes and picks
the cheapest.  Rules are pure: they import neither the DTensor class nor the
collectives, and never communicate (a reduction is a Partial output).
"""

from .._rules import (
    LINEAR_REDUCE_OPS,
    ArgPosition,
    OneDimStrategy,
    OpCall,
    PlacementsPerTensor,
    RandomDraw,
    ShardingRule,
    register_rule,
    registered_ops,
    rule_for,
)
from . import (
    along_dim,
    attention,
    concat_split,
    foreach_ops,
    indexing,
    lookup_ops,
    losses,
    matrix,
    nn_ops,
    norm_ops,
    pointwise,
    reduction,
    reduction_extra,
    replicated,
    reshaping,
    shape_extra,
    spatial,
    stochastic,
    tensor_basics,
    vector_products,
)

__all__ = [
    "ArgPosition",
    "LINEAR_REDUCE_OPS",
    "OneDimStrategy",
    "OpCall",
    "PlacementsPerTensor",
    "RandomDraw",
    "ShardingRule",
    "along_dim",
    "attention",
    "concat_split",
    "foreach_ops",
    "indexing",
    "lookup_ops",
    "losses",
    "matrix",
    "nn_ops",
    "norm_ops",
    "pointwise",
    "reduction",
    "reduction_extra",
    "register_rule",
    "registered_ops",
    "replicated",
    "reshaping",
    "rule_for",
    "shape_extra",
    "spatial",
    "stochastic",
    "tensor_basics",
    "vector_products",
]
