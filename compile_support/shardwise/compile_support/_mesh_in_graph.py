"""Meshes derived inside a compiled graph (``mesh["tp"]``, ``mesh._flatten()``, ``mesh._get_root_mesh()``).

A mesh is an opaque reference type (``_registration``): in a graph it is a value (an input, or an op's
result), never a constant, and dynamo refuses a mesh that is neither. So a mesh derived from another one
in code dynamo traces is the result of one graph op, ``shardwise_compile::derived_mesh``, whose kernel
(and fake kernel) derives it from the real mesh: a slice and a flattened mesh are lookups of meshes made
in eager (the process groups exist), the root is an attribute. ``shardwise.mesh`` calls
:func:`derive_in_graph` from those members while dynamo traces them (they are inlined members).
"""

from __future__ import annotations

import json

import torch

from shardwise.mesh import DeviceMesh
from shardwise.mesh._device_mesh import _set_traced_mesh_derivation, derive_mesh_now

from ._registration import compile_refusal

__all__ = ["define_derived_mesh_op", "derive_in_graph"]

_defined = False


def define_derived_mesh_op() -> None:
    """Define ``shardwise_compile::derived_mesh`` (after the mesh's opaque registration) and hand
    :func:`derive_in_graph` to the mesh. Once per process."""
    global _defined
    if _defined or compile_refusal() is not None:
        return  # (a torch that refuses meshes as opaque types cannot name one in an op's schema either)
    _defined = True

    # Dim names travel as one JSON string: an op schema has no list of strings.
    @torch.library.custom_op("shardwise_compile::derived_mesh", mutates_args=())
    def derived_mesh(mesh: DeviceMesh, how: str, names_json: str) -> DeviceMesh:
        return derive_mesh_now(mesh, how, tuple(json.loads(names_json)))

    @derived_mesh.register_fake
    def _derived_mesh_fake(mesh: DeviceMesh, how: str, names_json: str) -> DeviceMesh:
        # No tensor involved: the same mesh as at run time (it exists already).
        return derive_mesh_now(mesh, how, tuple(json.loads(names_json)))

    _set_traced_mesh_derivation(derive_in_graph)


def derive_in_graph(mesh: DeviceMesh, how: str, names: tuple[str, ...]) -> DeviceMesh:
    """The derived mesh as the graph op's result (called from code dynamo traces)."""
    result: DeviceMesh = torch.ops.shardwise_compile.derived_mesh(mesh, how, json.dumps(list(names)))
    return result
