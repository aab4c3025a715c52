"""Plain parameters annotated with per-mesh-axis SPMD types (the ``spmd_types`` package), read as DTensor layouts.

torchtitan's default backend (``spmd_types``) computes with plain local tensors: a parameter is this rank's
piece, and ``spmd_types.assert_type`` records on it, per mesh axis, whether the piece is replicated with a
gradient that is summed later (``R``), replicated with an identical gradient (``I``), a different piece per
rank (``V``, the tensor dim it cuts being named by the partition spec) or a partial sum (``P``).
``fully_shard(..., dp_mesh_dims=...)`` keeps such a parameter's storage as a DTensor on the full SPMD mesh
and hands the module the plain piece again, annotated as before. This module turns the annotation into
that DTensor layout, without importing ``spmd_types`` (the annotation is read by its attributes: the types'
names and each axis' ranks), so ``fsdp_ext`` does not depend on it.

A piece is taken as an even cut of the global tensor: ``spmd_types`` records no sizes, and a rank cannot
know another's piece without communicating (``fully_shard`` communicates nothing).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from shardwise.mesh import DeviceMesh
from shardwise.placement import DTensorSpec, Placement, Replicate, Shard, TensorMeta, contiguous_strides

from ._errors import FSDPError

# The attributes spmd_types keeps on an annotated tensor (spmd_types._type_attr / spmd_types.runtime).
LOCAL_TYPE_ATTRIBUTE = "_local_type"
PARTITION_SPEC_ATTRIBUTE = "_partition_spec"


@dataclasses.dataclass(frozen=True)
class PlainAnnotation:
    """What a plain annotated parameter carries back into compute, and where its gradient is a partial sum.

    ``attributes``: the annotation's attributes, set again on every unsharded piece the module sees (so the
    module and spmd_types' checker see the type they declared); ``partial_grad_dims``: the non data-parallel
    mesh dims typed ``R``, where each rank's gradient is a partial sum that the unit all-reduces before its
    reduce-scatter (what torchtitan's norm under sequence parallelism leaves to FSDP).
    """

    attributes: dict[str, Any]
    partial_grad_dims: tuple[int, ...]

    def apply_to(self, tensor: torch.Tensor) -> torch.Tensor:
        for name, value in self.attributes.items():
            setattr(tensor, name, value)
        return tensor


def is_annotated(param: torch.Tensor) -> bool:
    return isinstance(getattr(param, LOCAL_TYPE_ATTRIBUTE, None), dict)


def _axis_ranks(axis: object) -> list[int] | None:
    """The ranks of an spmd_types mesh axis, counted from its first rank (None: not a mesh axis)."""
    layout = getattr(axis, "layout", None)
    ranks = getattr(layout, "all_ranks_from_zero", None)
    if ranks is None:
        return None
    return [int(r) for r in ranks()]


def _mesh_dim_ranks(mesh: DeviceMesh, dim: int) -> list[int]:
    """The ranks along ``dim`` of ``mesh`` (through its first coordinate), counted from the first."""
    line = mesh.mesh
    for other in reversed(range(mesh.ndim)):
        if other != dim:
            line = line.select(other, 0)
    ranks = [int(r) for r in line.tolist()]
    return [r - ranks[0] for r in ranks]


def _type_name(value: object) -> str:
    return str(getattr(value, "name", value))


def _partition_dims(spec: Any, axis: object) -> list[tuple[int, int]]:
    """(tensor dim, position within that dim's entry) of every partition spec entry naming ``axis``."""
    found: list[tuple[int, int]] = []
    if spec is None:
        return found
    entry: Any
    for tensor_dim, entry in enumerate(tuple(spec)):
        if entry is None:
            continue
        axes = entry if isinstance(entry, tuple) else (entry,)
        for position, named in enumerate(axes):
            if named == axis:
                found.append((tensor_dim, position))
    return found


def plain_layout(
    fqn: str, param: torch.Tensor, mesh: DeviceMesh, dp_dims: frozenset[int]
) -> tuple[DTensorSpec[DeviceMesh], PlainAnnotation]:
    """The DTensor spec on ``mesh`` (Replicate on the dp dims) that an annotated plain ``param`` is a piece of,
    and what compute and backward need from the annotation. Raises ``FSDPError`` (no collective) when the
    annotation cannot be a DTensor layout on ``mesh``."""
    local_type: dict[Any, Any] = getattr(param, LOCAL_TYPE_ATTRIBUTE)
    partition_spec = getattr(param, PARTITION_SPEC_ATTRIBUTE, None)
    names = mesh.mesh_dim_names or tuple(str(d) for d in range(mesh.ndim))
    described = ", ".join(f"{axis!r}: {_type_name(kind)}" for axis, kind in local_type.items())
    where = f"fully_shard: plain parameter {fqn!r} annotated {{{described}}} (partition spec {partition_spec!r})"
    axes_by_ranks: dict[tuple[int, ...], Any] = {}
    for axis in local_type:
        ranks = _axis_ranks(axis)
        if ranks is None:
            raise FSDPError(f"{where}: {axis!r} is not a mesh axis; expected spmd_types' annotation (assert_type)")
        axes_by_ranks[tuple(ranks)] = axis
    placements: list[Placement] = []
    partial_dims: list[int] = []
    matched: set[int] = set()
    local_shape = list(param.shape)
    global_shape = list(param.shape)
    for dim in range(mesh.ndim):
        if dim in dp_dims:
            placements.append(Replicate())
            continue
        axis = axes_by_ranks.get(tuple(_mesh_dim_ranks(mesh, dim)))
        if axis is None:
            if mesh.size(dim) == 1:  # spmd_types leaves axes of size 1 out of annotations
                placements.append(Replicate())
                continue
            raise FSDPError(
                f"{where}: no type for mesh dim {names[dim]!r} of {mesh!r}; expected a type on every mesh dim "
                "that is not data-parallel"
            )
        matched.add(id(axis))
        kind = _type_name(local_type[axis])
        if kind in ("R", "I"):
            placements.append(Replicate())
            if kind == "R":
                partial_dims.append(dim)
        elif kind == "V":
            cuts = _partition_dims(partition_spec, axis)
            if len(cuts) != 1 or cuts[0][1] != 0:
                raise FSDPError(
                    f"{where}: mesh dim {names[dim]!r} is V but the partition spec names it "
                    f"{'nowhere' if not cuts else 'after another axis on the same tensor dim'}; expected it to "
                    "name this axis first on exactly one tensor dim (the dim this piece cuts)"
                )
            tensor_dim = cuts[0][0]
            if any(isinstance(p, Shard) and p.dim == tensor_dim for p in placements):
                raise FSDPError(
                    f"{where}: tensor dim {tensor_dim} is cut by more than one mesh dim; expected one at most"
                )
            placements.append(Shard(tensor_dim))
            global_shape[tensor_dim] = local_shape[tensor_dim] * mesh.size(dim)
        else:
            raise FSDPError(
                f"{where}: mesh dim {names[dim]!r} is {kind}; expected R, I or V (a parameter is not a partial sum)"
            )
    for axis, kind in local_type.items():
        if id(axis) not in matched and _type_name(kind) not in ("R", "I"):
            raise FSDPError(
                f"{where}: axis {axis!r} is {_type_name(kind)} but is no non data-parallel dim of {mesh!r}; "
                "expected R or I on the data-parallel axes (FSDP shards the parameter there)"
            )
    meta = TensorMeta(torch.Size(global_shape), contiguous_strides(tuple(global_shape)), param.dtype)
    attributes = {LOCAL_TYPE_ATTRIBUTE: local_type}
    if partition_spec is not None:
        attributes[PARTITION_SPEC_ATTRIBUTE] = partition_spec
    return DTensorSpec(mesh, tuple(placements), meta), PlainAnnotation(attributes, tuple(partial_dims))
