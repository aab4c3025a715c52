"""What torch.compile needs to know about shardwise's types, told through torch's public extension points.

* Placements (``Shard``, ``Replicate``, ``Partial``, ``_StridedShard``) are opaque *value* types: dynamo
  treats them as constants, guards on ``__eq__`` and prints them in graphs with ``__fx_repr__``.
* ``DeviceMesh`` is an opaque *reference* type, as torch 2.13's own mesh: a mesh owns communicators, so a
  graph takes it as an input (never rebuilds it) and is guarded on what it is (layout, rank, group
  names); what code reads from it while tracing (shape, coordinate, group names) is read from the real
  mesh and baked in as constants. It has to be a reference type for DTensor: dynamo's handling of torch's
  DTensor (which it applies to shardwise's under ``shardwise.torch_switch``) and AOTAutograd accept only
  tensors and reference-type opaques among a subclass's flattened attributes, and a DTensor flattens to
  its local tensor and its mesh (``DTensor.__tensor_flatten__``).
* ``DTensor.from_local`` is written into the graph as a call (``torch.compiler.allow_in_graph``): dynamo
  cannot build a wrapper subclass itself, AOTAutograd then traces through the call.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch._library.opaque_object import MemberType, register_opaque_type

from shardwise.dtensor_ops import DTensor
from shardwise.mesh import DeviceMesh
from shardwise.placement import Partial, Placement, Replicate, Shard, _StridedShard

__all__ = ["register_opaque_types", "allow_conversions_in_graph", "IN_GRAPH_FUNCTIONS"]

_PLACEMENT_QUERIES = {
    "is_shard": MemberType.USE_REAL,
    "is_replicate": MemberType.USE_REAL,
    "is_partial": MemberType.USE_REAL,
    "__eq__": MemberType.USE_REAL,
    "__ne__": MemberType.USE_REAL,
    "__hash__": MemberType.USE_REAL,
    "__repr__": MemberType.USE_REAL,
    "__str__": MemberType.USE_REAL,
}

_PLACEMENT_MEMBERS: dict[type[Placement], dict[str, MemberType]] = {
    Shard: _PLACEMENT_QUERIES | {"dim": MemberType.USE_REAL},
    _StridedShard: _PLACEMENT_QUERIES | {"dim": MemberType.USE_REAL, "split_factor": MemberType.USE_REAL},
    Replicate: _PLACEMENT_QUERIES,
    Partial: _PLACEMENT_QUERIES | {"reduce_op": MemberType.USE_REAL},
}

# What user code inside a compiled function may read from a mesh; each is answered with the real mesh
# at trace time and baked into the graph as a constant (the graph is guarded on the mesh: _mesh_guard).
_MESH_MEMBERS = {
    name: MemberType.USE_REAL
    for name in (
        "size",
        "shape",
        "ndim",
        "device_type",
        "mesh_dim_names",
        "get_rank",
        "get_coordinate",
        "get_local_rank",
        "get_group_name",
        "__eq__",
        "__ne__",
        "__hash__",
        "__repr__",
        "_dim_group_names",
    )
} | {
    # Traced: under dynamo they make the derived mesh a graph op's result (_mesh_in_graph), as a mesh
    # in a graph must be a graph value; get_group reads the live group by name.
    name: MemberType.INLINED
    for name in ("get_group", "__getitem__", "_flatten", "_get_root_mesh")
}


def _mesh_guard(mesh: DeviceMesh) -> list[Any]:
    """What a graph traced with ``mesh`` needs of the mesh it is called with: the same ranks in the same
    layout, the same coordinate, and the same process groups (the graph's collectives name them: a mesh
    rebuilt over new groups recompiles)."""
    return [mesh._stable_digest, mesh._rank, mesh._dim_group_names]


def _mesh_from_graph_inputs(mesh: Any, tracked_proxy: Callable[[Any], Any], tracer: Any) -> Any:
    """The graph input that stands for ``mesh`` when AOTAutograd meets the real mesh (a DTensor output keeps
    the real one, ``DTensor.__tensor_unflatten__``): the input carrying an equal mesh. None (torch then bakes
    the mesh into the graph as an attribute) when no input carries it."""
    return tracked_proxy(mesh)


_registered = False
_refusal: str | None = None  # why this torch refused the opaque types, if it did


def register_opaque_types() -> None:
    """Register placements and ``DeviceMesh`` with torch.compile (once per process)."""
    global _registered, _refusal
    if _registered:
        return
    _registered = True
    try:
        for cls, members in _PLACEMENT_MEMBERS.items():
            register_opaque_type(cls, typ="value", members=members)
        register_opaque_type(
            DeviceMesh,
            typ="reference",
            guard_fn=_mesh_guard,
            members=_MESH_MEMBERS,
            reconstruct_fn=_mesh_from_graph_inputs,
        )
    except TypeError as refusal:
        _refusal = str(refusal)
        # torch before 2.13 (2.11 on the GPU image) takes value types only as subclasses of its
        # OpaqueBase. Eager DTensor needs none of this: say what is lost instead of failing the import.
        warnings.warn(
            f"shardwise.compile_support: torch {torch.__version__} refuses placements and DeviceMesh as opaque "
            f"value types ({refusal}); torch.compile of functions that read them may fail. Use torch 2.13.",
            RuntimeWarning,
            stacklevel=2,
        )


def compile_refusal() -> str | None:
    """Why torch.compile cannot trace shardwise's placements and meshes on this torch (None: it can)."""
    register_opaque_types()
    return None if _refusal is None else f"torch {torch.__version__} refuses them as opaque value types (torch 2.13 takes them)"


# The conversions dynamo writes into the graph as calls instead of tracing their bodies.
IN_GRAPH_FUNCTIONS: tuple[Callable[..., Any], ...] = (DTensor.from_local,)


def allow_conversions_in_graph() -> None:
    """Mark ``IN_GRAPH_FUNCTIONS`` for dynamo (imports ``torch._dynamo``, about a second)."""
    for function in IN_GRAPH_FUNCTIONS:
        torch.compiler.allow_in_graph(function)
