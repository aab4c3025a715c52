"""Pure validation of mesh arguments: no process group, no communication.

Everything a user can get wrong when building or using a mesh is checked here, before any
collective starts, so a bad argument fails on every rank with the same message instead of
leaving some ranks waiting in a collective that others never join.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from shardwise.mesh._errors import MeshDimError, MeshError

__all__ = [
    "RankGrid",
    "check_device_type",
    "check_fits_world",
    "check_mesh_shape",
    "check_world_size_matches",
    "normalize_dim_names",
    "rank_grid_from",
    "resolve_dim_index",
    "resolve_slice",
]

MeshDim = int | str


@dataclass(frozen=True)
class RankGrid:
    """A validated mesh: its shape and its global ranks in row-major order."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    consecutive: bool = field(default=False, compare=False)
    """True when the builder knows ``ranks`` is ``first, first + 1, ...`` (spares a check of every rank)."""

    def index_of_position(self, position: int) -> tuple[int, ...]:
        index: list[int] = []
        for size in reversed(self.shape):
            position, within = divmod(position, size)
            index.append(within)
        return tuple(reversed(index))


def _describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _is_rank_value(value: object) -> bool:
    # bool is an Integral too, but True/False in a mesh is a mistake, not rank 1/0.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _shape_of_nested(value: object, index: tuple[int, ...], original: object) -> tuple[int, ...]:
    """Shape of a rectangular nested sequence; raises on ragged or non-integer entries."""
    if isinstance(value, (list, tuple, range)):
        if len(value) == 0:
            return (0,)
        inner_shapes = [
            _shape_of_nested(item, index + (position,), original) for position, item in enumerate(value)
        ]
        first = inner_shapes[0]
        for position, inner in enumerate(inner_shapes):
            if inner != first:
                raise MeshError(
                    f"mesh {_describe(original)} is ragged: the entry at {list(index + (position,))} has "
                    f"shape {list(inner)} but the entry at {list(index + (0,))} has shape {list(first)}; "
                    "a mesh must be a rectangular n-D array of ranks"
                )
        return (len(value),) + first
    if _is_rank_value(value):
        return ()
    raise MeshError(
        f"mesh {_describe(original)} has the non-integer entry {value!r} ({type(value).__name__}) at "
        f"{list(index)}; a mesh holds integer global ranks"
    )


def _flatten_nested(value: object, out: list[int]) -> None:
    if isinstance(value, (list, tuple, range)):
        for item in value:
            _flatten_nested(item, out)
    else:
        assert _is_rank_value(value)
        out.append(int(value))  # type: ignore[call-overload]


def rank_grid_from(mesh: object) -> RankGrid:
    """Validate ``mesh`` (a tensor, numpy array or nested sequence of ranks) and return its grid.

    Checks: integer entries, rectangular, at least one dim and one rank, no negative ranks, no
    rank listed twice. Whether the ranks exist in the world is ``check_fits_world``'s job.
    """
    if isinstance(mesh, torch.Tensor):
        if mesh.dtype == torch.bool or mesh.dtype.is_floating_point or mesh.dtype.is_complex:
            raise MeshError(f"mesh tensor has dtype {mesh.dtype}; expected an integer tensor of global ranks")
        if mesh.dim() == 0:
            raise MeshError(
                f"mesh tensor {mesh.tolist()} is 0-dimensional; expected at least one dim, e.g. [{mesh.item()}]"
            )
        shape = tuple(int(size) for size in mesh.shape)
        ranks = tuple(mesh.detach().reshape(-1).tolist())  # an integer tensor's tolist() gives ints
    else:
        nested: object = mesh
        tolist = getattr(mesh, "tolist", None)
        if callable(tolist) and not isinstance(mesh, (list, tuple, range)):
            nested = tolist()  # numpy arrays (and scalars) become plain Python values
        if not isinstance(nested, (list, tuple, range)):
            raise MeshError(
                f"mesh must be a tensor, numpy array or nested list of global ranks with at least one dim, "
                f"got {_describe(mesh)} ({type(mesh).__name__})"
            )
        shape = _shape_of_nested(nested, (), mesh)
        flat: list[int] = []
        _flatten_nested(nested, flat)
        ranks = tuple(flat)
    grid = RankGrid(shape=shape, ranks=ranks)
    if len(ranks) == 0:
        raise MeshError(f"mesh has no ranks (shape {list(shape)}); expected at least one rank in every dim")
    # Whole-tuple checks first (C speed at 16,384 ranks); the per-rank details only to explain an error.
    if min(ranks) >= 0 and len(set(ranks)) == len(ranks):
        return grid
    negative = [(rank, list(grid.index_of_position(position))) for position, rank in enumerate(ranks) if rank < 0]
    if negative:
        listed = ", ".join(f"{rank} at {index}" for rank, index in negative[:5])
        raise MeshError(f"mesh holds negative ranks ({listed}); global ranks are non-negative")
    counts = Counter(ranks)
    duplicates = sorted(rank for rank, count in counts.items() if count > 1)
    if duplicates:
        details = "; ".join(
            f"rank {rank} at "
            + ", ".join(str(list(grid.index_of_position(p))) for p, r in enumerate(ranks) if r == rank)
            for rank in duplicates[:5]
        )
        raise MeshError(
            f"mesh lists ranks {duplicates} more than once ({details}); each rank must appear exactly once "
            f"in a mesh"
        )
    return grid


def check_fits_world(grid: RankGrid, world_size: int) -> None:
    """A mesh may cover a subset of the world, never more ranks than exist."""
    if len(grid.ranks) > world_size:
        raise MeshError(
            f"mesh of shape {list(grid.shape)} has {len(grid.ranks)} ranks but the world has only {world_size} "
            f"(the default process group's size); a mesh cannot be bigger than the world"
        )
    if max(grid.ranks) < world_size:
        return
    out_of_range = [
        (rank, list(grid.index_of_position(position)))
        for position, rank in enumerate(grid.ranks)
        if rank >= world_size
    ]
    if out_of_range:
        listed = ", ".join(f"{rank} at {index}" for rank, index in out_of_range[:5])
        raise MeshError(
            f"mesh holds ranks outside the world ({listed}); with world size {world_size} valid ranks are "
            f"0..{world_size - 1}"
        )


def check_mesh_shape(mesh_shape: object) -> tuple[int, ...]:
    """``init_device_mesh``'s mesh_shape: a non-empty sequence of positive ints."""
    if isinstance(mesh_shape, (str, bytes)) or not isinstance(mesh_shape, (tuple, list, torch.Size)):
        hint = f" such as ({mesh_shape},)" if _is_rank_value(mesh_shape) else ""
        raise MeshError(f"mesh_shape must be a tuple of ints{hint}, got {_describe(mesh_shape)}")
    if len(mesh_shape) == 0:
        raise MeshError("mesh_shape is empty; expected at least one dim, e.g. (world_size,)")
    bad = [size for size in mesh_shape if not _is_rank_value(size) or int(size) < 1]
    if bad:
        raise MeshError(
            f"mesh_shape {tuple(mesh_shape)} has invalid sizes {bad}; every dim size must be a positive int"
        )
    return tuple(int(size) for size in mesh_shape)


def check_world_size_matches(mesh_shape: tuple[int, ...], world_size: int) -> None:
    """``init_device_mesh`` lays out the first ``prod(mesh_shape)`` ranks of the world (all of it, usually).

    A smaller shape leaves the other ranks outside the mesh, as PyTorch's does; a larger one is an error.
    """
    numel = math.prod(mesh_shape)
    if numel > world_size:
        raise MeshError(
            f"mesh_shape {mesh_shape} has {numel} ranks but the world size is {world_size}; init_device_mesh "
            f"needs the product of mesh_shape to be at most the world size"
        )


def check_device_type(device_type: object) -> str:
    """A device type such as "cpu" or "cuda", without an index."""
    if not isinstance(device_type, str) or not device_type:
        raise MeshError(f"device_type must be a device type name such as 'cpu' or 'cuda', got {_describe(device_type)}")
    if not device_type.isalpha():
        raise MeshError(
            f"device_type {device_type!r} is not a plain device type; pass the type without an index, such as "
            f"'cuda' (for a torch.device, pass device.type)"
        )
    return device_type


def normalize_dim_names(mesh_dim_names: object, ndim: int) -> tuple[str, ...] | None:
    """None/empty -> None; otherwise one unique str per mesh dim."""
    if mesh_dim_names is None:
        return None
    if isinstance(mesh_dim_names, str):
        raise MeshError(
            f"mesh_dim_names must be a tuple of str, one per mesh dim, e.g. ({mesh_dim_names!r},); got the str "
            f"{mesh_dim_names!r}"
        )
    if not isinstance(mesh_dim_names, (tuple, list)):
        raise MeshError(f"mesh_dim_names must be a tuple of str, one per mesh dim, got {_describe(mesh_dim_names)}")
    if len(mesh_dim_names) == 0:
        return None
    not_str = [name for name in mesh_dim_names if not isinstance(name, str)]
    if not_str:
        raise MeshError(f"mesh_dim_names {tuple(mesh_dim_names)!r} holds non-str entries {not_str!r}")
    names = tuple(mesh_dim_names)
    if len(names) != ndim:
        raise MeshError(
            f"mesh_dim_names {names} has {len(names)} names but the mesh has {ndim} dims; expected one name per dim"
        )
    repeated = sorted(name for name, count in Counter(names).items() if count > 1)
    if repeated:
        raise MeshError(f"mesh_dim_names {names} repeats {repeated}; each mesh dim needs a unique name")
    return names


def _valid_dims_text(ndim: int, names: tuple[str, ...] | None, extra_names: Sequence[str] = ()) -> str:
    text = f"an index in [{-ndim}, {ndim})"
    all_names = tuple(names or ()) + tuple(extra_names)
    if all_names:
        text += f" or one of the names {all_names}"
    return text


def resolve_dim_index(mesh_dim: object, ndim: int, names: tuple[str, ...] | None) -> int:
    """Index (negative allowed) or name -> non-negative dim index."""
    if isinstance(mesh_dim, str):
        if names is None:
            raise MeshDimError(
                f"mesh dim {mesh_dim!r} was asked for by name but this mesh has no mesh_dim_names; "
                f"use {_valid_dims_text(ndim, None)}"
            )
        if mesh_dim not in names:
            raise MeshDimError(f"mesh dim {mesh_dim!r} does not exist; expected {_valid_dims_text(ndim, names)}")
        return names.index(mesh_dim)
    if _is_rank_value(mesh_dim):
        index = int(mesh_dim)  # type: ignore[call-overload]
        if not -ndim <= index < ndim:
            raise MeshDimError(
                f"mesh dim {index} is out of range for a {ndim}-D mesh; expected {_valid_dims_text(ndim, names)}"
            )
        return index % ndim
    raise MeshDimError(f"mesh_dim must be an int or a str, got {_describe(mesh_dim)}; expected {_valid_dims_text(ndim, names)}")


def resolve_slice(
    requested: object,
    names: tuple[str, ...] | None,
    dims: tuple[tuple[int, ...], ...],
    flattened: Mapping[str, tuple[int, ...]],
    root_names: tuple[str, ...] | None,
) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
    """Validate ``mesh[requested]`` and return (the requested names, the root dims of each).

    ``dims`` are the root dims each of this mesh's dims spans; ``flattened`` the flattened dims
    known to the root (only sliceable from the root, as in PyTorch). Root dims must come out
    disjoint and in increasing order: a sub-mesh keeps the order of its parent's dims.
    """
    if names is None:
        raise MeshError("cannot slice a DeviceMesh that has no mesh_dim_names; create it with mesh_dim_names=(...)")
    if isinstance(requested, str):
        requested_names: tuple[str, ...] = (requested,)
    elif isinstance(requested, tuple) and all(isinstance(name, str) for name in requested):
        requested_names = requested
    else:
        raise TypeError(
            f"a DeviceMesh is sliced by mesh dim names (a str or a tuple of str), got {_describe(requested)}; "
            f"valid names: {names}"
        )
    if not requested_names:
        raise MeshDimError(f"mesh[()] names no mesh dims; expected one or more of {names}")
    valid = dict(zip(names, dims))
    for name, root_dims in flattened.items():
        valid.setdefault(name, root_dims)
    unknown = [name for name in requested_names if name not in valid]
    if unknown:
        flattened_note = f" and the flattened dims {tuple(flattened)}" if flattened else ""
        raise MeshDimError(
            f"mesh{list(requested_names)}: {unknown} {'is not a mesh dim' if len(unknown) == 1 else 'are not mesh dims'} "
            f"of this mesh; valid names are {names}{flattened_note}"
        )
    repeated = sorted(name for name, count in Counter(requested_names).items() if count > 1)
    if repeated:
        raise MeshDimError(f"mesh{list(requested_names)} names {repeated} more than once; name each mesh dim once")
    selected = tuple(valid[name] for name in requested_names)
    owner: dict[int, str] = {}
    for name, root_dims in zip(requested_names, selected):
        for root_dim in root_dims:
            if root_dim in owner:
                shared = root_names[root_dim] if root_names else str(root_dim)
                raise MeshDimError(
                    f"mesh{list(requested_names)}: {owner[root_dim]!r} and {name!r} overlap (both cover the root "
                    f"mesh dim {shared!r}); a sub-mesh cannot use a mesh dim twice"
                )
            owner[root_dim] = name
    concatenated = [root_dim for root_dims in selected for root_dim in root_dims]
    if concatenated != sorted(concatenated):
        in_order = tuple(sorted(requested_names, key=lambda name: min(valid[name])))
        raise MeshDimError(
            f"mesh{list(requested_names)}: mesh dims must be given in the order they have in the mesh, "
            f"i.e. mesh{list(in_order)} (mesh dims in order: {names})"
        )
    return requested_names, selected


def check_unflatten(
    where: str,
    dim: object,
    mesh_sizes: object,
    mesh_dim_names: object,
    shape: tuple[int, ...],
    names: tuple[str, ...] | None,
) -> tuple[int, tuple[int, ...], tuple[str, ...]]:
    """Validate ``_unflatten``'s arguments; return (the dim's index, the sizes, the new names)."""
    if names is None:
        raise MeshError(
            f"{where}: the mesh has no mesh_dim_names, so its unflattened dims could not be named alongside the "
            "others; create it with mesh_dim_names=(...)"
        )
    ndim = len(shape)
    if isinstance(dim, str):
        if dim not in names:
            raise MeshDimError(f"{where}: dim {dim!r} is not a dim of the mesh; expected {_valid_dims_text(ndim, names)}")
        index = names.index(dim)
    elif isinstance(dim, int) and not isinstance(dim, bool):
        if not -ndim <= dim < ndim:
            raise MeshDimError(f"{where}: dim {dim} is out of range for a {ndim}-D mesh; expected {_valid_dims_text(ndim, names)}")
        index = dim % ndim
    else:
        raise MeshDimError(f"{where}: dim must be an int or a str, got {_describe(dim)}; expected {_valid_dims_text(ndim, names)}")
    if not isinstance(mesh_sizes, (tuple, list)) or not mesh_sizes:
        raise MeshError(f"{where}: mesh_sizes must be a non-empty tuple of positive ints, got {_describe(mesh_sizes)}")
    bad = [size for size in mesh_sizes if isinstance(size, bool) or not isinstance(size, int) or size < 1]
    if bad:
        raise MeshError(f"{where}: mesh_sizes {tuple(mesh_sizes)} holds {bad!r}; expected positive ints")
    sizes = tuple(int(size) for size in mesh_sizes)
    if isinstance(mesh_dim_names, str):
        raise MeshError(
            f"{where}: mesh_dim_names must be a tuple of str, one per size, e.g. ({mesh_dim_names!r},); got the str "
            f"{mesh_dim_names!r}"
        )
    if not isinstance(mesh_dim_names, (tuple, list)) or any(not isinstance(name, str) for name in mesh_dim_names):
        raise MeshError(f"{where}: mesh_dim_names must be a tuple of str, one per size, got {_describe(mesh_dim_names)}")
    new_names = tuple(mesh_dim_names)
    if len(new_names) != len(sizes):
        raise MeshError(
            f"{where}: {len(new_names)} mesh_dim_names {new_names} for {len(sizes)} mesh_sizes {sizes}; expected one "
            "name per size"
        )
    if math.prod(sizes) != shape[index]:
        raise MeshError(
            f"{where}: mesh_sizes {sizes} multiply to {math.prod(sizes)}, but dim {names[index]!r} (index {index}) has "
            f"size {shape[index]}; expected sizes whose product is {shape[index]}"
        )
    return index, sizes, new_names


def check_unique_names(where: str, names: tuple[str, ...], others: str) -> None:
    """Names of a mesh being built from parts must not repeat (a new name may clash with ``others``)."""
    repeated = sorted(name for name, count in Counter(names).items() if count > 1)
    if repeated:
        raise MeshError(
            f"{where}: the resulting mesh would have dims {names}, repeating {repeated}; each dim needs a unique "
            f"name (check the new names against {others})"
        )
