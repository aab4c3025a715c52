"""The hook ``import shardwise.dtensor_ops`` runs when this package is installed (see dtensor_ops ``_extensions``)."""

from __future__ import annotations

from shardwise.dtensor_ops._shard_rng import set_traced_random_runner

from ._dynamo_hook import after_dynamo_import
from ._mesh_in_graph import define_derived_mesh_op
from ._random_in_graph import run_sharded_random_in_graph
from ._registration import allow_conversions_in_graph, register_opaque_types

__all__ = ["install"]


def install() -> None:
    """Make DTensor, meshes and placements traceable by torch.compile (dynamo's part once it is imported)."""
    register_opaque_types()
    set_traced_random_runner(run_sharded_random_in_graph)
    after_dynamo_import(allow_conversions_in_graph)
    after_dynamo_import(define_derived_mesh_op)
