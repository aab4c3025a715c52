"""``DeviceMesh`` and ``init_device_mesh``: an n-D grid of ranks with a process group per dim."""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import threading
import weakref
from typing import Any, Callable, Sequence, cast

import torch
import torch.distributed as dist

from shardwise.mesh import _existing_groups as existing_groups
from shardwise.mesh import _process_groups as process_groups
from shardwise.mesh import _simulation as simulation
from shardwise.mesh import _validation as validation
from shardwise.mesh._errors import MeshDimError, MeshError
from shardwise.mesh._layout import MeshLayout, Run, nested_ranks
from shardwise.mesh._mesh_metaclass import (
    _METHODS_LOCAL_TENSOR_MODE_PATCHES,
    _DeviceMeshClass,
    _is_local_tensor_mode_patch,
)
from shardwise.mesh._opaque_registration import (
    _opaque_type_registrations,
    _register_distributed_opaque_types,
    _register_opaque_type_registration,
)
from shardwise.mesh._existing_groups import _ranks_text
from shardwise.mesh._process_groups import backend_choices_for_new_dims as _backend_choices
from shardwise.mesh._world import ensure_default_process_group, world_generation, world_size_for_validation

__all__ = [
    "DeviceMesh",
    "get_current_mesh",
    "init_device_mesh",
    "unwrap_traced_mesh",
    "_register_distributed_opaque_types",
    # Moved to their own modules, still importable from here (tests import some):
    "_METHODS_LOCAL_TENSOR_MODE_PATCHES",
    "_DeviceMeshClass",
    "_backend_choices",
    "_is_local_tensor_mode_patch",
    "_opaque_type_registrations",
    "_ranks_text",
    "_register_opaque_type_registration",
]


class _MeshStack(threading.local):
    def __init__(self) -> None:
        self.meshes: list[DeviceMesh] = []


_active_meshes = _MeshStack()


def get_current_mesh() -> DeviceMesh:
    """The innermost mesh entered with ``with mesh:`` on this thread."""
    if not _active_meshes.meshes:
        raise MeshError("no DeviceMesh is active; enter one with `with mesh:` first")
    return _active_meshes.meshes[-1]


class DeviceMesh(metaclass=_DeviceMeshClass):
    """An n-D grid of global ranks, with one c10d process group per dim for each rank in it.

    Follows ``torch.distributed.device_mesh.DeviceMesh`` (PyTorch 2.13). The ranks of a mesh build
    it in the same order relative to their other meshes (SPMD); each rank creates only its own
    group per dim (``_process_groups`` states the protocol), so a rank outside the mesh creates
    nothing (it may build the mesh or not; with a device-bound NCCL world it must, as c10d then
    splits communicators world-collectively). On such a rank ``get_coordinate()`` is None,
    ``_dim_group_names`` is empty and ``get_group``/``get_local_rank`` raise.

    A sliced (``mesh["tp"]``) or flattened (``mesh[...]._flatten()``) mesh is a view of its root
    mesh: it sees the sub-mesh holding this rank and uses the root's process groups.
    Equality, hash and repr depend only on what every rank agrees on (the root's ranks, the dims
    of the view, the names, the device type), so they are the same on all ranks. Equality also
    asks for the same world: meshes built before and after re-initialising the default process
    group differ (the old one's groups are gone), so nothing cached with the old one is reused.
    """

    device_type: str
    mesh_dim_names: tuple[str, ...] | None
    ndim: int
    shape: tuple[int, ...]
    _device_type: str
    _layout: MeshLayout
    _mesh_dim_names: tuple[str, ...] | None
    _root: DeviceMesh | None
    _group_refs: tuple[weakref.ref[dist.ProcessGroup], ...]
    _dim_group_names: tuple[str, ...]
    _rank: int
    _coordinate: tuple[int, ...] | None
    _flatten_mapping: dict[str, DeviceMesh]
    _joint_groups: dict[tuple[Run, ...], tuple[str, tuple[int, ...]]]
    _has_joint_groups: bool
    _slices: dict[tuple[str, ...], DeviceMesh]
    _key: tuple[Any, ...]
    _init_backend: bool
    _world_generation: int | None
    _stable_digest: bytes
    _hash: int

    def __init__(
        self,
        device_type: str,
        mesh: torch.Tensor | Sequence[Any] | Any,
        *,
        mesh_dim_names: tuple[str, ...] | None = None,
        _init_backend: bool = True,
        _rank: int | None = None,
    ) -> None:
        """``_init_backend=False`` (PyTorch's private keyword): a mesh without process groups, needing no
        default process group; it describes a layout only (shape, coordinates, slicing, ``_flatten``,
        ``_unflatten``) and its ``get_group`` raises. ``_rank``: the global rank whose coordinate the mesh
        reports (default: this process's rank); with a backend it must be this process's rank.
        """
        device_type = validation.check_device_type(device_type)
        if not isinstance(_init_backend, bool):
            raise MeshError(f"DeviceMesh: _init_backend must be a bool, got {_init_backend!r}")
        if _rank is not None and (isinstance(_rank, bool) or not isinstance(_rank, int)):
            raise MeshError(f"DeviceMesh: _rank must be an int (a global rank) or None, got {_rank!r}")
        if isinstance(mesh, validation.RankGrid):  # init_device_mesh's grid, valid by construction
            grid = mesh
        else:
            grid = validation.rank_grid_from(mesh)
        names = validation.normalize_dim_names(mesh_dim_names, len(grid.shape))
        if not _init_backend:
            self._init_without_backend(device_type, grid, names, _rank)
            return
        validation.check_fits_world(grid, world_size_for_validation())
        ensure_default_process_group(device_type)
        layout = MeshLayout.root(grid)
        rank = dist.get_rank()
        if _rank is not None and _rank != rank:
            # The groups are this process's: a mesh reporting another rank's coordinate would pair
            # that coordinate with this rank's groups.
            raise MeshError(
                f"DeviceMesh(..., _rank={_rank}) in the process of rank {rank}: with process groups the mesh "
                f"answers for this process's rank only; pass _rank={rank} or None, or _init_backend=False for "
                "a mesh that only describes a layout"
            )
        groups = [
            process_groups.group_for_dim(layout, dim, rank, _group_description(names, dim))
            for dim in range(layout.ndim)
        ]
        self._setup(device_type, layout, names, root=None, groups=_member_groups(groups), rank=rank)
        self._has_joint_groups = True
        if not process_groups.member_only_creation():
            # Bound (NCCL split) worlds create groups world-collectively, which a redistribution,
            # run by the mesh's ranks only, cannot do later: make them all now.
            self._create_joint_groups()

    def _init_without_backend(
        self, device_type: str, grid: validation.RankGrid, names: tuple[str, ...] | None, rank: int | None
    ) -> None:
        """A mesh that only describes a layout: no default group needed, no group created or looked up."""
        if rank is None:
            if not dist.is_initialized():
                raise MeshError(
                    "DeviceMesh(..., _init_backend=False) without _rank needs the default process group to know "
                    "this process's rank, and none is initialised; pass _rank=<the global rank whose coordinate "
                    "the mesh should report> or call init_process_group first"
                )
            rank = dist.get_rank()
        # No world check: without groups the ranks are labels (spmd_types builds arange(n) meshes
        # for any axis size, also larger than the world or with no world at all).
        self._setup(device_type, MeshLayout.root(grid), names, root=None, groups=(), rank=rank, init_backend=False)

    def _setup(
        self,
        device_type: str,
        layout: MeshLayout,
        names: tuple[str, ...] | None,
        *,
        root: DeviceMesh | None,
        groups: tuple[dist.ProcessGroup, ...],
        rank: int,
        init_backend: bool = True,
    ) -> None:
        self._device_type = device_type
        self._init_backend = root._init_backend if root is not None else init_backend
        self._layout = layout
        self._mesh_dim_names = names
        self.device_type = device_type
        self.mesh_dim_names = names
        self.ndim = layout.ndim
        self.shape = layout.shape
        self._root = root
        # Weak: c10d owns the groups until destroy_process_group, and a mesh (or a DTensor holding
        # one) that outlives that must not keep a gloo group's worker threads running into
        # interpreter shutdown, where they abort the process (see _process_groups).
        self._group_refs = tuple(weakref.ref(group) for group in groups)
        self._dim_group_names = tuple(group.group_name for group in groups)
        self._pickled_group_names: tuple[str, ...] = ()
        self._rank = rank
        self._coordinate = layout.coordinate(rank)
        self._flatten_mapping = {}
        self._joint_groups = {}
        self._has_joint_groups = False
        self._slices = {}
        # The layout's signature, not its grid: views of one root cut into different grids (a mesh
        # and its ``_unflatten``) that walk the same ranks are the same mesh.
        layout_key: tuple[Any, ...] = (device_type, layout.signature, names)
        if not self._init_backend:
            # Never equal to a mesh with groups (nor sharing its digest, which compiled graphs look
            # meshes up by): a DTensor cache must not hand a group-less mesh to real communication.
            # The rank is part of it, as it sets every coordinate the mesh reports.
            layout_key = (*layout_key, ("_init_backend=False", "_rank", rank))
        # Python's str hash differs between processes; a digest of the key does not, so the hash is
        # the same on every rank (and in every process: the world's number stays out of it).
        self._stable_digest = hashlib.blake2b(repr(layout_key).encode(), digest_size=16).digest()
        if root is not None:
            self._world_generation = root._world_generation
        else:
            self._world_generation = world_generation() if self._init_backend else None
        self._key = (*layout_key, self._world_generation)
        self._hash = int.from_bytes(self._stable_digest[:8], "little", signed=True)
        _LATEST_MESH_BY_DIGEST[self._stable_digest.hex()] = self

    @classmethod
    def _view(
        cls,
        root: DeviceMesh,
        layout: MeshLayout,
        names: tuple[str, ...],
        groups: tuple[dist.ProcessGroup, ...],
    ) -> DeviceMesh:
        view = cls.__new__(cls)
        view._setup(root._device_type, layout, names, root=root, groups=groups, rank=root._rank)
        return view

    # ----------------------------------------------------------------------------------- shape

    # ``device_type``, ``mesh_dim_names``, ``ndim`` and ``shape`` are plain attributes set once in ``_setup``,
    # not properties: torch.compile (2.13) reads a registered member of an opaque value type through its
    # class MRO and fails on Python properties, while plain attributes trace (compile_support's README).

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of ranks in the mesh, or along ``mesh_dim`` (index or name)."""
        if mesh_dim is None:
            return self._layout.numel
        owner, dim = self._resolve_dim(mesh_dim)
        return owner._layout.shape[dim]

    @property
    def mesh(self) -> torch.Tensor:
        """The grid of global ranks of the (sub-)mesh that holds this rank."""
        pinned = simulation.pinned_rank()
        rank = self._rank if pinned is None else pinned
        ranks = self._layout.submesh_ranks(rank)
        if ranks is None:
            raise MeshError(
                f"rank {rank} is not part of {self!r}, which is one of several sub-meshes of its root mesh; "
                "there is no single grid of ranks to return on this rank"
            )
        return torch.tensor(ranks, dtype=torch.int).reshape(self.shape)

    # ------------------------------------------------------------------------------ this rank

    # Under torch's LocalTensorMode (every rank simulated in this process, see ``_simulation``) the
    # rank-dependent answers below are each simulated rank's: as plain ints for the rank pinned by
    # ``run_for_each_simulated_rank``, as ``LocalIntNode`` SymInts otherwise (PyTorch's patched
    # DeviceMesh answers the same). Real runs pay one check of a thread-local and ``sys.modules``.

    def get_rank(self) -> int:
        """This process's global rank."""
        view = simulation.simulated_view()
        if view is None:
            return self._rank
        if isinstance(view, int):
            return view
        return simulation.per_rank_int({rank: rank for rank in view})  # type: ignore[return-value]

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's index along every mesh dim; None if this rank is not in the mesh."""
        view = simulation.simulated_view()
        if view is None:
            return self._coordinate
        return self._simulated_coordinate(view)

    def _simulated_coordinate(self, view: int | frozenset[int]) -> tuple[int, ...] | None:
        if isinstance(view, int):
            return self._layout.coordinate(view)
        coordinates = {rank: self._layout.coordinate(rank) for rank in sorted(view)}
        outside = [rank for rank, coordinate in coordinates.items() if coordinate is None]
        if outside:
            if len(outside) == len(coordinates):
                return None
            raise MeshError(
                f"get_coordinate() under LocalTensorMode: simulated ranks {outside} are not part of {self!r} but "
                f"ranks {sorted(set(coordinates) - set(outside))} are; one coordinate per simulated rank needs every "
                "simulated rank in the mesh (or none of them)"
            )
        members = cast(dict[int, tuple[int, ...]], coordinates)
        return tuple(
            simulation.per_rank_int({rank: coordinate[dim] for rank, coordinate in members.items()})  # type: ignore[misc]
            for dim in range(self.ndim)
        )

    def _is_current_rank_part_of_mesh(self) -> bool:
        return self.get_coordinate() is not None

    def _sym_get_coordinate(self, index: int) -> int:
        """This rank's coordinate along mesh dim ``index`` (PyTorch's DTensor reads it; the rank must be in the mesh)."""
        coordinate = self.get_coordinate()
        if coordinate is None:
            raise MeshError(f"_sym_get_coordinate({index}): rank {self._rank} is not part of {self!r}")
        return coordinate[index]

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's index along ``mesh_dim`` (= its rank in that dim's process group)."""
        owner, dim = self._resolve_dim(self._default_dim(mesh_dim, "get_local_rank"))
        if simulation.simulated_view() is not None:
            simulated = owner.get_coordinate()
            if simulated is None:
                raise MeshError(f"get_local_rank({mesh_dim!r}): the simulated ranks are not part of {owner!r}")
            return simulated[dim]
        coordinate = owner._require_member(f"get_local_rank({mesh_dim!r})")
        return coordinate[dim]

    def get_group(self, mesh_dim: int | str | None = None) -> dist.ProcessGroup:
        """The process group of ``mesh_dim`` (index or name) that holds this rank."""
        if torch.compiler.is_compiling():
            # Traced by dynamo (an inlined member, see compile_support): the group must come from a
            # global so that dynamo can lift it into the graph as an input; the mesh is a constant.
            return process_groups.live_group_named(self.get_group_name(mesh_dim))
        owner, dim = self._resolve_dim(self._default_dim(mesh_dim, "get_group"))
        return owner._require_groups(f"get_group({mesh_dim!r})")[dim]

    def get_group_name(self, mesh_dim: int | str | None = None) -> str:
        """The c10d name of ``mesh_dim``'s process group (what ``torch.ops._c10d_functional`` collectives take).

        Cheaper than ``get_group(mesh_dim).group_name`` on the hot path: a tuple lookup for an index.
        """
        if type(mesh_dim) is int and len(self._dim_group_names) == self.ndim and -self.ndim <= mesh_dim < self.ndim:
            return self._dim_group_names[mesh_dim]
        owner, dim = self._resolve_dim(self._default_dim(mesh_dim, "get_group_name"))
        owner._require_groups(f"get_group_name({mesh_dim!r})")
        return owner._dim_group_names[dim]

    def get_all_groups(self) -> list[dist.ProcessGroup]:
        """This rank's process group for every mesh dim, in dim order."""
        return list(self._require_groups("get_all_groups()"))

    def _default_dim(self, mesh_dim: int | str | None, method: str) -> int | str:
        if mesh_dim is not None:
            return mesh_dim
        if self.ndim != 1:
            raise MeshError(
                f"{method}() on a {self.ndim}-D mesh needs mesh_dim (an index or one of {self._mesh_dim_names}); "
                + ("use get_all_groups() for the groups of every dim" if method == "get_group" else "")
            )
        return 0

    def _resolve_dim(self, mesh_dim: int | str) -> tuple[DeviceMesh, int]:
        """(the mesh that owns the dim, its index there): own dims, or a flattened dim of the root."""
        if isinstance(mesh_dim, str) and mesh_dim not in (self._mesh_dim_names or ()):
            flattened = self._get_root_mesh()._flatten_mapping.get(mesh_dim)
            if flattened is not None:
                return flattened, 0
            known = tuple(self._mesh_dim_names or ()) + tuple(self._get_root_mesh()._flatten_mapping)
            if known:
                raise MeshDimError(
                    f"mesh dim {mesh_dim!r} does not exist; expected an index in [{-self.ndim}, {self.ndim}) "
                    f"or one of the names {known}"
                )
        return self, validation.resolve_dim_index(mesh_dim, self.ndim, self._mesh_dim_names)

    def _require_member(self, what: str) -> tuple[int, ...]:
        if self._coordinate is None:
            raise MeshError(
                f"{what}: rank {self._rank} is not part of {self!r} (ranks {list(self._layout.root_ranks)}), "
                "so it has no coordinate or process group in it"
            )
        return self._coordinate

    def _require_groups(self, what: str) -> tuple[dist.ProcessGroup, ...]:
        if not self._init_backend:
            raise MeshError(
                f"{what}: {self!r} was built with _init_backend=False, so no process group was initialised for "
                "it (it describes a layout only: shape, coordinates, slicing); build the mesh with process groups "
                "(DeviceMesh(...) without _init_backend=False, or init_device_mesh) to communicate over it"
            )
        self._require_member(what)
        if len(self._group_refs) != self.ndim:
            raise MeshError(
                f"{what}: {self!r} was unpickled in a process that does not have its process groups "
                f"{self._pickled_group_names}; rebuild the mesh in this process instead"
            )
        groups = tuple(reference() for reference in self._group_refs)
        if any(group is None for group in groups):
            raise MeshError(
                f"{what}: the process groups {list(self._dim_group_names)} of {self!r} were destroyed "
                "(destroy_process_group); build a new mesh after init_process_group"
            )
        return cast(tuple[dist.ProcessGroup, ...], groups)

    # ---------------------------------------------------------------------------- joint groups

    def _create_joint_groups(self) -> None:
        """Every joint group of this mesh's grid now (world-ordered creation only; see ``_joint_group``)."""
        splitting = [dim for dim, size in enumerate(self._layout.root_shape) if size > 1]
        for count in range(2, len(splitting) + 1):
            for root_dims in itertools.combinations(splitting, count):
                self._get_root_mesh()._joint_group_over_root_dims(root_dims, self._layout)

    def _joint_group_over_root_dims(
        self, root_dims: tuple[int, ...], layout: MeshLayout | None = None
    ) -> tuple[str, tuple[int, ...]] | None:
        """This rank's group over several grid dims of ``layout`` together, created on first request (on the root).

        ``layout`` (default: the root's) is a view of this root, perhaps on a finer grid (``_unflatten``);
        the cache is keyed by the ranks the joint dim walks, so every grid shares one group per rank set.
        """
        joint_layout = (layout or self._layout).view((root_dims,))
        key = joint_layout.runs[0]
        known = self._joint_groups.get(key)
        if known is not None or not self._has_joint_groups:
            return known
        group = process_groups.group_for_dim(
            joint_layout, 0, self._rank, f"mesh_joint_{'_'.join(map(str, root_dims))}", in_rank_order=True
        )
        if group is None:
            return None
        row_major = joint_layout.group_through(0, self._rank)
        assert row_major is not None
        member_of_group_rank = tuple(sorted(range(len(row_major)), key=lambda index: row_major[index]))
        self._joint_groups[key] = (group.group_name, member_of_group_rank)
        return self._joint_groups[key]

    def _supports_joint_groups(self) -> bool:
        """Whether every set of this mesh's dims can have a joint process group (see ``_joint_group``).

        True for meshes built by ``DeviceMesh(...)``/``init_device_mesh`` and their slices; False for
        ``from_group`` meshes and unpickled ones. The same answer on every rank; creates nothing.
        """
        return self._get_root_mesh()._has_joint_groups

    def _joint_group(self, mesh_dims: Sequence[int]) -> tuple[str, tuple[int, ...]] | None:
        """The group spanning ``mesh_dims`` (increasing) together, or None where there is none.

        Returns its c10d name and, for each group rank, the member's row-major index over those
        dims' coordinates (the group orders its ranks by rank, not by coordinate). Dims of size 1
        are left out; a single remaining dim gives that dim's own group (group rank = coordinate).

        A joint group is created here, by its members, the first time it is asked for: the
        redistribution that asks issues its collective on the group right after, so members create
        joint groups in the order of their collectives on them, which SPMD already makes the same
        on every member (the protocol is in ``_process_groups``). Under torch.compile the first
        request comes while dynamo propagates fake tensors through the redistribution, on every
        rank that traces, in program order; the graph then names the group, which exists from then
        on in this process. Ranks that never redistribute over these dims never create it.
        """
        if self._coordinate is None or len(self._dim_group_names) != self.ndim:
            return None
        root = self._get_root_mesh()
        root_dims = tuple(
            root_dim
            for mesh_dim in mesh_dims
            for root_dim in self._layout.dims[mesh_dim]
            if self._layout.root_shape[root_dim] > 1
        )
        if len(root_dims) == 1:
            for dim, dims in enumerate(self._layout.dims):
                if root_dims[0] in dims and len(dims) == 1:
                    return self._dim_group_names[dim], tuple(range(self._layout.root_shape[root_dims[0]]))
        return root._joint_group_over_root_dims(root_dims, self._layout)

    # ------------------------------------------------------------------------ slicing, flatten

    def _get_root_mesh(self) -> DeviceMesh:
        if _traced_mesh_derivation is not None and torch.compiler.is_dynamo_compiling():
            return _traced_mesh_derivation(self, "root", ())
        return self._root if self._root is not None else self

    def _get_mesh_dim_by_name(self, mesh_dim_name: str) -> int:
        return validation.resolve_dim_index(mesh_dim_name, self.ndim, self._mesh_dim_names)

    def __getitem__(self, mesh_dim_names: str | tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh over the named dims (in mesh order) that holds this rank."""
        if _traced_mesh_derivation is not None and torch.compiler.is_dynamo_compiling():
            names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
            return _traced_mesh_derivation(self, "slice", names)
        return self._slice(mesh_dim_names)

    def _slice(self, mesh_dim_names: str | tuple[str, ...]) -> DeviceMesh:
        key = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else mesh_dim_names
        if isinstance(key, tuple) and all(isinstance(name, str) for name in key):
            cached = self._slices.get(key)
            if cached is not None:
                return cached
        root = self._get_root_mesh()
        flattened: dict[str, tuple[int, ...]] = {}
        if root is self:
            for name, mesh in root._flatten_mapping.items():
                if mesh._layout.root_shape == self._layout.root_shape:
                    flattened[name] = mesh._layout.dims[0]
                elif key == (name,):  # flattened from an ``_unflatten``ed mesh: on another grid, sliced alone
                    return mesh
        names, root_dims = validation.resolve_slice(
            mesh_dim_names, self._mesh_dim_names, self._layout.dims, flattened, root._mesh_dim_names
        )
        if names == self._mesh_dim_names:
            return self
        if len(names) == 1 and names[0] in flattened:
            submesh = root._flatten_mapping[names[0]]
        else:
            groups: tuple[dist.ProcessGroup, ...] = ()
            if self._coordinate is not None and self._init_backend:
                groups = tuple(self._group_by_root_dims(dims) for dims in root_dims)
            submesh = DeviceMesh._view(root, self._layout.view(root_dims), names, groups)
        self._slices[names] = submesh
        return submesh

    def _group_by_root_dims(self, root_dims: tuple[int, ...]) -> dist.ProcessGroup:
        for dim, dims in enumerate(self._layout.dims):
            if dims == root_dims:
                return self._require_groups("slicing")[dim]
        for flattened in self._get_root_mesh()._flatten_mapping.values():
            if flattened._layout.root_shape == self._layout.root_shape and flattened._layout.dims[0] == root_dims:
                return flattened._require_groups("slicing")[0]
        raise AssertionError(f"no process group spans root dims {root_dims}")

    def _flattened_over(self, mesh_dims: Sequence[int]) -> DeviceMesh | None:
        """The flattened mesh (``_flatten``) spanning exactly this mesh's ``mesh_dims``, in that order, if one exists."""
        root_dims = tuple(d for mesh_dim in mesh_dims for d in self._layout.dims[mesh_dim])
        runs = self._layout.view((root_dims,)).runs[0]
        for flattened in self._get_root_mesh()._flatten_mapping.values():
            if flattened._layout.runs[0] == runs:
                return flattened
        return None

    def _flatten(self, mesh_dim_name: str | None = None, backend_override: object = None) -> DeviceMesh:
        """A 1-D mesh over all of this mesh's dims, named ``mesh_dim_name`` (default: names joined by "_").

        The flattened dim is registered on the root mesh, so ``root[mesh_dim_name]`` and
        ``root.get_group(mesh_dim_name)`` find it. Creates this rank's group over the flattened dim
        (unless one exists already), so every rank of the mesh must call it, in the same order.
        ``backend_override`` (a backend name, backend options, or both as a tuple; ``"fake"``: no
        communication over it) picks the backend of that group, as in ``_unflatten``.
        """
        if _traced_mesh_derivation is not None and torch.compiler.is_dynamo_compiling():
            if backend_override is not None:
                raise MeshError("_flatten(backend_override=...) creates a process group: call it before torch.compile")
            return _traced_mesh_derivation(self, "flatten", () if mesh_dim_name is None else (mesh_dim_name,))
        return self._flatten_now(mesh_dim_name, backend_override)

    def _flatten_now(self, mesh_dim_name: str | None = None, backend_override: object = None) -> DeviceMesh:
        choice = process_groups.backend_choice(backend_override, f"_flatten({mesh_dim_name!r}) backend_override")
        if self._mesh_dim_names is None:
            raise MeshError("cannot flatten a DeviceMesh that has no mesh_dim_names; create it with mesh_dim_names=(...)")
        if mesh_dim_name is None or mesh_dim_name == "":
            mesh_dim_name = "_".join(self._mesh_dim_names)
        if not isinstance(mesh_dim_name, str):
            raise MeshError(f"mesh_dim_name must be a str, got {mesh_dim_name!r}")
        if self.ndim == 1 and mesh_dim_name in self._mesh_dim_names:
            return self
        root = self._get_root_mesh()
        if mesh_dim_name in (root._mesh_dim_names or ()):
            raise MeshError(
                f"cannot flatten {self._mesh_dim_names} into {mesh_dim_name!r}: the root mesh already has a dim "
                f"named {mesh_dim_name!r} (its dims: {root._mesh_dim_names}); pick another name"
            )
        flat_dims = (tuple(d for dims in self._layout.dims for d in dims),)
        existing = root._flatten_mapping.get(mesh_dim_name)
        layout = self._layout.view(flat_dims)
        if existing is not None:
            if existing._layout.runs == layout.runs:
                return existing
            raise MeshError(
                f"a flattened dim named {mesh_dim_name!r} already exists over different mesh dims; pick another name"
            )
        group = (
            process_groups.group_for_dim(layout, 0, self._rank, f"mesh_{mesh_dim_name}", choice=choice)
            if self._init_backend
            else None  # a layout only: the override was checked, there is no group to give it to
        )
        flattened = DeviceMesh._view(root, layout, (mesh_dim_name,), _member_groups([group]))
        root._flatten_mapping[mesh_dim_name] = flattened
        return flattened

    def _unflatten(
        self,
        dim: int | str,
        mesh_sizes: tuple[int, ...],
        mesh_dim_names: tuple[str, ...],
        backend_override: dict[Any, Any] | None = None,
    ) -> DeviceMesh:
        """This mesh with dim ``dim`` (index or name) split row-major into dims of ``mesh_sizes`` named ``mesh_dim_names``.

        As PyTorch 2.13: the result is a view of this mesh's root (``_get_root_mesh()`` is the root),
        so ``_flatten`` on its slices registers on the root. ``backend_override`` maps new dims (by
        name, or by index among the new dims) to a backend name, backend options, or both as a
        tuple; ``"fake"`` marks a dim the program never communicates over: its group is c10d's
        fake process group of the dim's size, created locally (see ``_process_groups``). Creates
        this rank's group for each new dim (groups over ranks that already have one are reused,
        e.g. the same dim unflattened twice), so every rank of the mesh calls it in the same order.
        Every argument is checked before any group is created, with the same message on every rank.
        """
        where = f"_unflatten({dim!r}, {mesh_sizes!r}, {mesh_dim_names!r})"
        index, sizes, new_names = validation.check_unflatten(
            where, dim, mesh_sizes, mesh_dim_names, self.shape, self._mesh_dim_names
        )
        names = (*(self._mesh_dim_names or ())[:index], *new_names, *(self._mesh_dim_names or ())[index + 1 :])
        validation.check_unique_names(where, names, f"the other dims of {self!r}")
        choices = _backend_choices(where, backend_override, new_names)
        try:
            layout = self._layout.unflatten(index, sizes)
        except ValueError as error:
            raise MeshError(
                f"{where}: dim {index} of {self!r} walks its ranks as {self._layout.runs[index]} (size, stride) runs, "
                f"which sizes {sizes} cannot split into a grid ({error})"
            ) from error
        kept = self._require_groups(where) if self._coordinate is not None and self._init_backend else ()
        created = [
            process_groups.group_for_dim(layout, index + offset, self._rank, _group_description(names, index + offset), choice=choice)
            for offset, choice in enumerate(choices)
            if self._init_backend
        ]
        new_groups = _member_groups(created)
        groups = (*kept[:index], *new_groups, *kept[index + 1 :]) if kept else ()
        root = self._get_root_mesh()
        result = DeviceMesh._view(root, layout, names, groups)
        if root._has_joint_groups and not process_groups.member_only_creation():
            result._create_joint_groups()
        return result

    @staticmethod
    def _concatenate(device_mesh_list: list[DeviceMesh]) -> DeviceMesh:
        """One mesh over the dims of several views of one root mesh, in the order given (PyTorch 2.13).

        The meshes' dims must be disjoint (no rank walked twice) and come in the order they have in
        the root, outer dims first (e.g. ``[dp_mesh, tp_mesh]``). Uses the meshes' groups; creates none.
        """
        where = "DeviceMesh._concatenate"
        if not isinstance(device_mesh_list, (list, tuple)) or not device_mesh_list:
            raise MeshError(f"{where} needs a non-empty list of DeviceMesh, got {device_mesh_list!r}")
        not_meshes = [mesh for mesh in device_mesh_list if not isinstance(mesh, DeviceMesh)]
        if not_meshes:
            raise MeshError(f"{where}: {not_meshes!r} are not DeviceMesh objects")
        first = device_mesh_list[0]
        for mesh in device_mesh_list[1:]:
            if mesh._layout.ranks_identity != first._layout.ranks_identity or mesh._device_type != first._device_type:
                raise MeshError(
                    f"{where}: {mesh!r} and {first!r} are not views of one root mesh (different ranks or device "
                    "type); expected slices, flattenings or unflattenings of the same mesh"
                )
        if any(mesh._init_backend != first._init_backend or mesh._rank != first._rank for mesh in device_mesh_list):
            raise MeshError(
                f"{where}: {list(device_mesh_list)!r} mix meshes with process groups and meshes built with "
                "_init_backend=False (or for different _rank); expected views of one root mesh"
            )
        unnamed = [mesh for mesh in device_mesh_list if mesh._mesh_dim_names is None]
        if unnamed:
            raise MeshError(f"{where}: {unnamed!r} have no mesh_dim_names; every mesh concatenated needs them")
        names = tuple(name for mesh in device_mesh_list for name in (mesh._mesh_dim_names or ()))
        validation.check_unique_names(where, names, "the other meshes")
        try:
            layout = MeshLayout.concatenate(tuple(mesh._layout for mesh in device_mesh_list))
        except ValueError as error:
            raise MeshError(
                f"{where}: cannot concatenate {list(device_mesh_list)!r}: {error}; expected disjoint dims given "
                f"in the order they have in the root mesh"
            ) from error
        groups: tuple[dist.ProcessGroup, ...] = ()
        if first._coordinate is not None and first._init_backend:
            groups = tuple(group for mesh in device_mesh_list for group in mesh._require_groups(where))
        return DeviceMesh._view(first._get_root_mesh(), layout, names, groups)

    # ------------------------------------------------------------------------------ from_group

    @staticmethod
    def from_group(
        group: dist.ProcessGroup | list[dist.ProcessGroup],
        device_type: str,
        mesh: torch.Tensor | Sequence[Any] | Any | None = None,
        *,
        mesh_dim_names: tuple[str, ...] | None = None,
    ) -> DeviceMesh:
        """A mesh over existing process groups: one group -> 1-D; a list of groups -> n-D (mesh required).

        No process group is created. The groups must hold this rank; each must list, in group rank
        order, the ranks of ``mesh`` along its dim through this rank.
        """
        device_type = validation.check_device_type(device_type)
        layout, names, groups, rank = existing_groups.layout_of_groups(group, mesh, mesh_dim_names)
        result = DeviceMesh.__new__(DeviceMesh)
        result._setup(device_type, layout, names, root=None, groups=groups, rank=rank)
        return result

    # ------------------------------------------------------------------- identity and display

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return self._hash == other._hash and self._key == other._key

    def _stable_hash(self) -> str:
        """A hex digest equal on every rank and in every process (for compile caches)."""
        return self._stable_digest.hex()

    def __fx_repr__(self) -> tuple[str, dict[str, Any]]:
        """Source text naming this mesh in a compiled graph, and the globals it uses (torch.compile's FX codegen).

        A mesh holds communicators, so a graph cannot rebuild it: it looks it up by its stable
        digest among the live meshes (the most recently built of equal meshes).
        """
        return f"_live_mesh_by_digest({self._stable_digest.hex()!r})", {"_live_mesh_by_digest": _live_mesh_by_digest}

    def __repr__(self) -> str:
        if self._mesh_dim_names:
            sizes = "(" + ", ".join(f"{name}={size}" for name, size in zip(self._mesh_dim_names, self.shape)) + ")"
        else:
            sizes = str(self.shape)
        # PyTorch prints sizes and strides only, so meshes over other ranks (``[0, 1, 2, 3]`` and
        # ``[3, 2, 1, 0]``) print alike; the rank listing tells them apart and, like the rest,
        # is the same on every rank.
        text = f"DeviceMesh({sizes}, '{self._device_type}', stride={self._layout.strides}, {self._layout.rank_listing}"
        if not self._init_backend:
            text += f", _init_backend=False, _rank={self._rank}"
        if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "") == "DETAIL":
            # As PyTorch: with detail on, show this rank's grid (the only rank-dependent repr).
            ranks = self._layout.submesh_ranks(self._rank)
            text += f", Mesh: {nested_ranks(ranks, self.shape) if ranks is not None else None}"
        return text + ")"

    def __copy__(self) -> DeviceMesh:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> DeviceMesh:
        # A mesh is a handle on communicators, which cannot be copied; copies of modules and
        # tensors share it.
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_group_refs")
        state.pop("_slices")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._slices = {}
        # Joint groups are not looked up again: redistribution then keeps to one mesh dim per step.
        self._joint_groups = {}
        self._has_joint_groups = False
        if not self.__dict__.setdefault("_init_backend", True):
            # A layout only: it keeps the rank it was built for and has no groups to find.
            self._group_refs = ()
            return
        groups: list[dist.ProcessGroup] = []
        if dist.is_initialized():
            self._rank = dist.get_rank()
            self._coordinate = self._layout.coordinate(self._rank)
            for name in self._dim_group_names:
                group = process_groups.registered_group(name)
                if group is None:
                    break
                groups.append(group)
        if len(groups) != len(self._dim_group_names) or self._coordinate is None:
            # Groups cannot travel between processes; without them this mesh only describes a layout.
            self._pickled_group_names = self._dim_group_names
            self._dim_group_names = ()
            groups = []
        self._group_refs = tuple(weakref.ref(group) for group in groups)
        if groups:
            # Its groups live in this process's current world: it is that world's mesh now.
            self._world_generation = world_generation()
            self._key = (*self._key[:-1], self._world_generation)

    def __enter__(self) -> DeviceMesh:
        _active_meshes.meshes.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        _active_meshes.meshes.pop()


# The most recently built mesh per stable digest (weakly held): what a compiled graph's mesh constant names.
_LATEST_MESH_BY_DIGEST: weakref.WeakValueDictionary[str, DeviceMesh] = weakref.WeakValueDictionary()


def _live_mesh_by_digest(digest: str) -> DeviceMesh:
    """The live mesh whose ``_stable_hash()`` is ``digest`` (see ``DeviceMesh.__fx_repr__``)."""
    mesh = _LATEST_MESH_BY_DIGEST.get(digest)
    if mesh is None:
        raise MeshError(
            f"a compiled graph names a DeviceMesh (digest {digest}) that no longer exists; "
            "expected the mesh it was compiled with (or an equal one) to be alive"
        )
    return mesh


def _member_groups(groups: Sequence[dist.ProcessGroup | None]) -> tuple[dist.ProcessGroup, ...]:
    """All of a rank's per-dim groups, or () on a rank outside the mesh (it has none)."""
    present = [group for group in groups if group is not None]
    if present and len(present) != len(groups):
        raise AssertionError(f"a rank is in the groups of some mesh dims but not others: {groups}")
    return tuple(present)


def unwrap_traced_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` itself, also when torch.compile hands its tracing stand-in for it.

    As an opaque reference type (shardwise.compile_support), a mesh is a graph input, and while
    AOTAutograd traces, code receives torch's ``FakeScriptObject`` wrapping it (still an instance of
    this class, by its metaclass). What a DTensor keeps is the real mesh: every layout question is
    answered from it, and AOTAutograd maps it back to the graph input it came in as.
    """
    if type(mesh) is DeviceMesh:
        return mesh
    from torch._library.fake_class_registry import maybe_unwrap_fake_script_object

    real = maybe_unwrap_fake_script_object(mesh)
    return real if isinstance(real, DeviceMesh) else mesh


# How a mesh derived from another one (a slice, a flattened mesh, the root) is obtained in code dynamo traces
# (``torch.compiler.is_dynamo_compiling()`` is true only there, not in code that runs while compiling, such as
# dispatch on fake tensors); None: as in eager. As an opaque reference type (shardwise.compile_support) a mesh in a graph is a graph
# value, and so must be one derived from it inside the graph: compile_support installs a function that
# makes the derivation a graph op. Arguments: the mesh, "slice" / "flatten" / "root", the dim names.
_traced_mesh_derivation: Callable[[DeviceMesh, str, tuple[str, ...]], DeviceMesh] | None = None


def _set_traced_mesh_derivation(derive: Callable[[DeviceMesh, str, tuple[str, ...]], DeviceMesh] | None) -> None:
    global _traced_mesh_derivation
    _traced_mesh_derivation = derive


def derive_mesh_now(mesh: DeviceMesh, how: str, names: tuple[str, ...]) -> DeviceMesh:
    """The mesh ``how`` ("slice", "flatten", "root") derives from ``mesh``, computed on the real mesh now."""
    mesh = unwrap_traced_mesh(mesh)
    if how == "slice":
        return mesh._slice(names[0] if len(names) == 1 else names)
    if how == "flatten":
        return mesh._flatten_now(names[0] if names else None)
    if how == "root":
        return mesh._root if mesh._root is not None else mesh
    raise ValueError(f"derive_mesh_now: unknown derivation {how!r}; expected 'slice', 'flatten' or 'root'")


def _group_description(names: tuple[str, ...] | None, dim: int) -> str:
    return f"mesh_{names[dim]}" if names else f"mesh_dim_{dim}"


def init_device_mesh(
    device_type: str,
    mesh_shape: tuple[int, ...],
    *,
    mesh_dim_names: tuple[str, ...] | None = None,
) -> DeviceMesh:
    """A mesh of shape ``mesh_shape`` over the world's first ``prod(mesh_shape)`` ranks (usually all), row-major.

    Ranks beyond the mesh (a shape smaller than the world, as PyTorch allows) are outside it: their
    ``get_coordinate()`` is None and DTensors on it hold empty local tensors there.

    Starts the default process group from the torchrun environment (env://) if none exists:
    gloo for "cpu", "cpu:gloo,cuda:nccl" for "cuda"; and for an accelerator sets this process's
    device from LOCAL_RANK unless one was already selected.
    """
    device_type = validation.check_device_type(device_type)
    shape = validation.check_mesh_shape(mesh_shape)
    names = validation.normalize_dim_names(mesh_dim_names, len(shape))
    validation.check_world_size_matches(shape, world_size_for_validation())
    # The grid directly: at 16,384 ranks a tensor round trip and re-validating range(world) cost more
    # than everything else init_device_mesh does.
    return DeviceMesh(device_type, validation.RankGrid(shape, tuple(range(math.prod(shape))), consecutive=True), mesh_dim_names=names)
