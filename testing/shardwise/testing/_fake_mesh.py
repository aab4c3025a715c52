"""``FakeMesh``: a process-free stand-in for ``shardwise.mesh.DeviceMesh``, for pure tests.

Why it exists: layouts, the redistribute planner, sharding rules and random-op plans only read a
mesh's shape, this rank's coordinate, its dim names, its device type and the c10d group name of
each dim. Testing them on a real ``DeviceMesh`` needs a process group per rank, which costs
seconds; testing them on ad-hoc fakes lets each test file model a different (and drifting)
subset of the mesh. This class is the one fake they share: it models what the engine reads from a
mesh, with the real mesh's meaning and error types, so that a change of that interface changes
one file.
"""

from __future__ import annotations

import enum
from typing import Any, Literal, Sequence

import torch

from shardwise.mesh import MeshDimError, MeshError

__all__ = ["FakeMesh"]


class _Origin(enum.Enum):
    """Default of ``FakeMesh(coordinate=...)``: coordinate 0 along every dim (``None`` means outside)."""

    ORIGIN = 0


_ORIGIN: Literal[_Origin.ORIGIN] = _Origin.ORIGIN


class FakeMesh:
    """An n-D mesh of ``shape`` seen from one coordinate, without processes or process groups.

    ``FakeMesh(shape, coordinate=(0, ..., 0), group_names=None, *, device_type="cpu", dim_names=None)``

    - ``shape``: the extent of every mesh dim (at least one dim, each at least 1). The mesh's global
      ranks are ``0 .. size()-1`` in row-major order (``mesh`` is that grid).
    - ``coordinate``: this rank's index along every dim; ``None`` is a rank outside the mesh
      (``get_coordinate()`` is None and it has no process groups), as on a real mesh.
    - ``group_names``: the c10d group name of every dim (``_dim_group_names``, ``get_group_name``).
      ``None`` names them ``"fake-group-<dim>"`` (no names for a rank outside the mesh); ``()``
      models a mesh whose process groups are unknown here (as a real mesh unpickled in another
      process), so asking for a group name raises.
    - ``device_type``, ``dim_names``: as ``DeviceMesh``'s ``device_type`` and ``mesh_dim_names``.

    Equality and hash: by shape, coordinate, device type and dim names; not by group names, like
    ``DeviceMesh`` (whose equality ignores its process groups), so two meshes that differ only by
    their groups share cached decisions (and a cache that holds group names must check them).
    Unlike ``DeviceMesh``, whose equality is the same on every rank, the coordinate takes part:
    pure tests simulate several ranks in one process, and a decision that depends on the rank
    (local sizes, offsets, random streams) must not be shared between coordinates, as it is not
    shared between the processes of a real run. Immutable and picklable.

    Not modelled: slicing (``mesh["tp"]``), flattening and the process groups themselves.
    """

    _shape: tuple[int, ...]
    _coordinate: tuple[int, ...] | None
    _dim_group_names: tuple[str, ...]
    _device_type: str
    _mesh_dim_names: tuple[str, ...] | None
    _key: tuple[Any, ...]
    _hash: int

    def __init__(
        self,
        shape: Sequence[int],
        coordinate: Sequence[int] | None | Literal[_Origin.ORIGIN] = _ORIGIN,
        group_names: Sequence[str] | None = None,
        *,
        device_type: str = "cpu",
        dim_names: Sequence[str] | None = None,
    ) -> None:
        mesh_shape = _int_tuple(shape, "shape")
        if not mesh_shape or any(extent < 1 for extent in mesh_shape):
            raise MeshError(f"FakeMesh shape {mesh_shape} is invalid; expected at least one dim, each of extent >= 1")
        ndim = len(mesh_shape)
        point = (0,) * ndim if coordinate is _ORIGIN else coordinate
        here = None if point is None else _int_tuple(point, "coordinate")
        if here is not None and (
            len(here) != ndim or any(not 0 <= index < extent for index, extent in zip(here, mesh_shape))
        ):
            raise MeshError(
                f"FakeMesh coordinate {here} does not fit shape {mesh_shape}; expected one index per mesh dim, "
                "each in [0, extent) of its dim, or None for a rank outside the mesh"
            )
        if group_names is None:
            names = () if here is None else tuple(f"fake-group-{dim}" for dim in range(ndim))
        else:
            names = tuple(group_names)
            if any(not isinstance(name, str) for name in names):
                raise TypeError(f"FakeMesh group_names {names!r} must be strings")
            if names and here is None:
                raise MeshError(
                    f"FakeMesh group_names {names} were given for a rank outside the mesh (coordinate None); "
                    "such a rank has no process groups in it: pass no group_names"
                )
            if names and len(names) != ndim:
                raise MeshError(
                    f"FakeMesh got {len(names)} group_names {names} for a {ndim}-D mesh; "
                    f"expected one per mesh dim, or () for a mesh without process groups"
                )
        if not isinstance(device_type, str) or not device_type:
            raise TypeError(f"FakeMesh device_type must be a non-empty str like 'cpu' or 'cuda', got {device_type!r}")
        mesh_dim_names = None if dim_names is None else tuple(dim_names)
        if mesh_dim_names is not None and (
            len(mesh_dim_names) != ndim
            or len(set(mesh_dim_names)) != ndim
            or any(not isinstance(name, str) for name in mesh_dim_names)
        ):
            raise MeshDimError(
                f"FakeMesh dim_names {mesh_dim_names} are invalid for a {ndim}-D mesh; expected {ndim} distinct strings"
            )
        set_field = object.__setattr__
        set_field(self, "_shape", mesh_shape)
        set_field(self, "_coordinate", here)
        set_field(self, "_dim_group_names", names)
        set_field(self, "_device_type", device_type)
        set_field(self, "_mesh_dim_names", mesh_dim_names)
        set_field(self, "_key", (mesh_shape, here, device_type, mesh_dim_names))
        # Computed once: specs and cache keys hash their mesh on every lookup.
        set_field(self, "_hash", hash(("FakeMesh", mesh_shape, here, device_type, mesh_dim_names)))

    # ----------------------------------------------------------------------------------- shape

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def device_type(self) -> str:
        return self._device_type

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        return self._mesh_dim_names

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of ranks in the mesh, or along ``mesh_dim`` (index or name)."""
        if mesh_dim is None:
            total = 1
            for extent in self._shape:
                total *= extent
            return total
        return self._shape[self._resolve_dim(mesh_dim)]

    @property
    def mesh(self) -> torch.Tensor:
        """The grid of global ranks: ``0 .. size()-1`` laid out row-major over ``shape``."""
        return torch.arange(self.size(), dtype=torch.int).reshape(self._shape)

    # ------------------------------------------------------------------------------ this rank

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's index along every mesh dim; None if this rank is not in the mesh."""
        return self._coordinate

    def _is_current_rank_part_of_mesh(self) -> bool:
        return self._coordinate is not None

    def get_rank(self) -> int:
        """This rank's global rank: its place in ``mesh``; ``size()`` (one past the mesh) when outside it."""
        if self._coordinate is None:
            return self.size()
        rank = 0
        for index, extent in zip(self._coordinate, self._shape):
            rank = rank * extent + index
        return rank

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's index along ``mesh_dim`` (index or name; optional on a 1-D mesh)."""
        dim = self._resolve_dim(self._default_dim(mesh_dim, "get_local_rank"))
        if self._coordinate is None:
            raise MeshError(f"get_local_rank({mesh_dim!r}): this rank is not part of {self!r}; it has no coordinate")
        return self._coordinate[dim]

    def get_group_name(self, mesh_dim: int | str | None = None) -> str:
        """The c10d group name of ``mesh_dim`` (an index or a dim name; optional on a 1-D mesh)."""
        dim = self._resolve_dim(self._default_dim(mesh_dim, "get_group_name"))
        if self._coordinate is None:
            raise MeshError(
                f"get_group_name({mesh_dim!r}): this rank is not part of {self!r}, so it has no process group in it"
            )
        if not self._dim_group_names:
            raise MeshError(
                f"get_group_name({mesh_dim!r}): {self!r} was built without process group names (group_names=()); "
                "pass group_names, or leave them out to get 'fake-group-<dim>'"
            )
        return self._dim_group_names[dim]

    # -------------------------------------------------------------------------------- helpers

    def _default_dim(self, mesh_dim: int | str | None, method: str) -> int | str:
        if mesh_dim is not None:
            return mesh_dim
        if self.ndim != 1:
            raise MeshError(
                f"{method}() on a {self.ndim}-D mesh needs mesh_dim (an index or one of {self._mesh_dim_names})"
            )
        return 0

    def _resolve_dim(self, mesh_dim: object) -> int:
        """Index (negative allowed) or dim name -> non-negative index, or a MeshDimError naming the valid dims."""
        ndim = self.ndim
        names = self._mesh_dim_names
        valid = f"an index in [{-ndim}, {ndim})" + (f" or one of the names {names}" if names else "")
        if isinstance(mesh_dim, str):
            if names is None or mesh_dim not in names:
                missing = "this mesh has no dim names" if names is None else "no dim has that name"
                raise MeshDimError(f"mesh dim {mesh_dim!r} does not exist ({missing}) in {self!r}; expected {valid}")
            return names.index(mesh_dim)
        if isinstance(mesh_dim, int) and not isinstance(mesh_dim, bool):
            if not -ndim <= mesh_dim < ndim:
                raise MeshDimError(f"mesh dim {mesh_dim} is out of range for {self!r}; expected {valid}")
            return mesh_dim % ndim
        raise MeshDimError(f"mesh_dim must be an int or a str, got {mesh_dim!r} of type {type(mesh_dim).__name__}; expected {valid}")

    # ------------------------------------------------------------------- identity and display

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, FakeMesh):
            return NotImplemented
        return self._hash == other._hash and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"FakeMesh is immutable (it is hashed into specs and cache keys); cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"FakeMesh is immutable (it is hashed into specs and cache keys); cannot delete {name!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild,
            (type(self), self._shape, self._coordinate, self._dim_group_names, self._device_type, self._mesh_dim_names),
        )

    def __repr__(self) -> str:
        text = f"FakeMesh(shape={self._shape}, coordinate={self._coordinate}"
        if self._device_type != "cpu":
            text += f", device_type={self._device_type!r}"
        if self._mesh_dim_names is not None:
            text += f", dim_names={self._mesh_dim_names}"
        return text + ")"


def _rebuild(
    cls: type[FakeMesh],
    shape: tuple[int, ...],
    coordinate: tuple[int, ...] | None,
    group_names: tuple[str, ...],
    device_type: str,
    dim_names: tuple[str, ...] | None,
) -> FakeMesh:
    return cls(shape, coordinate, group_names, device_type=device_type, dim_names=dim_names)


def _int_tuple(values: Sequence[int], what: str) -> tuple[int, ...]:
    try:
        items = tuple(values)
    except TypeError:
        raise TypeError(f"FakeMesh {what} must be a sequence of ints, got {values!r}") from None
    if any(isinstance(item, bool) or not isinstance(item, int) for item in items):
        raise TypeError(f"FakeMesh {what} must be a sequence of ints, got {values!r}")
    return items
