"""Data-parallel mesh descriptions (PyTorch FSDP2's ``FSDPMeshInfo`` family) and ``shard_placement_fn`` results.

``get_mesh_info(mesh, dp_mesh_dims)`` says which dims of ``mesh`` FSDP shards and replicates over;
``shard_placement_fn`` may return a :class:`ShardPlacementResult` naming another mesh info for one
parameter (e.g. experts on an expert-data-parallel mesh): ``fully_shard`` then makes one parameter group
(one all-gather, one reduce-scatter) per data-parallel mesh in the unit.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import torch.distributed as dist

from shardwise.mesh import DeviceMesh
from shardwise.placement import Shard

from ._errors import FSDPError
from ._policies import DataParallelMeshDims

__all__ = [
    "DataParallelMeshInfo",
    "FSDPMeshInfo",
    "DDPMeshInfo",
    "HSDPMeshInfo",
    "ShardPlacementResult",
    "ShardPlacementFnResult",
    "get_mesh_info",
    "resolve_shard_placement",
    "combine_meshes",
]


@dataclasses.dataclass
class DataParallelMeshInfo:
    """A data-parallel mesh and which of its dims shard and replicate (at least one of them).

    With ``dp_mesh_dims`` (``is_spmd_mesh``), ``mesh`` was taken out of the full SPMD mesh ``spmd_mesh`` that
    the parameters live on (several shard or replicate dims flattened into one).
    """

    mesh: DeviceMesh
    shard_mesh_dim: int | None = None
    replicate_mesh_dim: int | None = None
    dp_mesh_dims: DataParallelMeshDims | None = None
    spmd_mesh: DeviceMesh | None = dataclasses.field(default=None, repr=False)
    is_spmd_mesh: bool = dataclasses.field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.shard_mesh_dim is None and self.replicate_mesh_dim is None:
            raise FSDPError(
                f"{type(self).__name__}: expected shard_mesh_dim or replicate_mesh_dim (or both), got neither "
                f"for {self.mesh!r}"
            )
        self.is_spmd_mesh = self.dp_mesh_dims is not None


@dataclasses.dataclass
class FSDPMeshInfo(DataParallelMeshInfo):
    """Sharding over ``shard_mesh_dim`` of ``mesh``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shard_mesh_dim is None:
            raise FSDPError(f"{type(self).__name__}: expected a shard_mesh_dim for {self.mesh!r}")
        self.shard_mesh_size: int = self.mesh.size(self.shard_mesh_dim)
        self.shard_process_group: dist.ProcessGroup = self.mesh.get_group(self.shard_mesh_dim)
        self.shard_mesh_rank: int = self.mesh.get_local_rank(self.shard_mesh_dim)


@dataclasses.dataclass
class DDPMeshInfo(DataParallelMeshInfo):
    """Replication over ``replicate_mesh_dim`` of ``mesh``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.replicate_mesh_dim is None:
            raise FSDPError(f"{type(self).__name__}: expected a replicate_mesh_dim for {self.mesh!r}")
        self.replicate_mesh_size: int = self.mesh.size(self.replicate_mesh_dim)
        self.replicate_process_group: dist.ProcessGroup = self.mesh.get_group(self.replicate_mesh_dim)
        self.replicate_mesh_rank: int = self.mesh.get_local_rank(self.replicate_mesh_dim)


@dataclasses.dataclass
class HSDPMeshInfo(FSDPMeshInfo, DDPMeshInfo):
    """Sharding over ``shard_mesh_dim`` (1) and replication over ``replicate_mesh_dim`` (0)."""


@dataclasses.dataclass
class ShardPlacementResult:
    """What ``shard_placement_fn`` may return for a parameter: its FSDP placement (``None``: ``Shard(0)``) and
    the data-parallel mesh it is sharded over (instead of the one given to ``fully_shard``)."""

    placement: Shard | None
    mesh_info: FSDPMeshInfo


ShardPlacementFnResult = Union[Shard, ShardPlacementResult, None]


def resolve_shard_placement(result: ShardPlacementFnResult, default_mesh_info: FSDPMeshInfo) -> ShardPlacementResult:
    """``shard_placement_fn``'s result as a ShardPlacementResult (the default mesh info where it names none)."""
    if result is None or isinstance(result, Shard):
        return ShardPlacementResult(placement=result, mesh_info=default_mesh_info)
    if isinstance(result, ShardPlacementResult):
        return result
    raise FSDPError(f"shard_placement_fn returned {result!r}; expected None, Shard(dim) or a ShardPlacementResult")


def get_mesh_info(mesh: DeviceMesh, dp_mesh_dims: DataParallelMeshDims | None = None) -> DataParallelMeshInfo:
    """The mesh info ``fully_shard(mesh=mesh, dp_mesh_dims=dp_mesh_dims)`` uses.

    Without ``dp_mesh_dims``: a 1-D mesh shards (FSDPMeshInfo), a 2-D mesh replicates over dim 0 and shards
    over dim 1 (HSDPMeshInfo). With it, ``mesh`` is the full SPMD mesh: the shard (and replicate) dims are
    taken out of it, several of a kind flattened into one (which creates its process group: call on every
    rank in the same order), giving FSDPMeshInfo, HSDPMeshInfo, or DDPMeshInfo with no shard dim.
    """
    if dp_mesh_dims is None:
        if mesh.ndim == 1:
            return FSDPMeshInfo(mesh, shard_mesh_dim=0)
        if mesh.ndim == 2:
            return HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
        raise FSDPError(f"get_mesh_info: expected a 1-D or 2-D data-parallel mesh, got {mesh!r}")
    if not dp_mesh_dims.shard_names:
        _check_dp_mesh_dims(mesh, dp_mesh_dims, allow_ddp=True)
        names = dp_mesh_dims.replicate_names
        replicate = mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))
        return DDPMeshInfo(replicate, replicate_mesh_dim=0, dp_mesh_dims=dp_mesh_dims, spmd_mesh=mesh)
    dp_mesh = _dp_mesh_of(mesh, dp_mesh_dims)
    if dp_mesh_dims.replicate_names:
        return HSDPMeshInfo(dp_mesh, shard_mesh_dim=1, replicate_mesh_dim=0, dp_mesh_dims=dp_mesh_dims, spmd_mesh=mesh)
    return FSDPMeshInfo(dp_mesh, shard_mesh_dim=0, dp_mesh_dims=dp_mesh_dims, spmd_mesh=mesh)


def _check_dp_mesh_dims(spmd_mesh: DeviceMesh, dims: DataParallelMeshDims, *, allow_ddp: bool = False) -> None:
    if not isinstance(dims, DataParallelMeshDims):
        raise TypeError(f"fully_shard: dp_mesh_dims must be a DataParallelMeshDims, got {type(dims).__name__}")
    names = spmd_mesh.mesh_dim_names
    if names is None:
        raise FSDPError(
            f"fully_shard: dp_mesh_dims needs a mesh with mesh_dim_names, got {spmd_mesh!r}; expected the full "
            "SPMD mesh, e.g. init_device_mesh(..., mesh_dim_names=(\"dp_replicate\", \"dp_shard\", \"cp\", \"tp\"))"
        )
    for name in (*dims.shard_names, *dims.replicate_names):
        if name not in names:
            raise FSDPError(
                f"fully_shard: mesh dim name {name!r} of {dims!r} is not in the mesh's mesh_dim_names {names}"
            )
    both = set(dims.shard_names) & set(dims.replicate_names)
    if both or len(set(dims.shard_names)) != len(dims.shard_names):
        raise FSDPError(
            f"fully_shard: {dims!r} names {sorted(both) or list(dims.shard_names)} twice; expected each "
            "data-parallel dim once, as either a shard or a replicate dim"
        )
    if not dims.shard_names and not allow_ddp:
        raise NotImplementedError(
            f"fully_shard: {dims!r} names no shard dim (DDP only); shardwise.fsdp_ext shards parameters, "
            "expected at least one shard dim"
        )


def _dp_mesh_of(spmd_mesh: DeviceMesh, dims: DataParallelMeshDims) -> DeviceMesh:
    """The data-parallel mesh inside ``spmd_mesh``: 1-D over the shard dim(s), or 2-D (replicate, shard) for HSDP.

    Several names of one kind are flattened into one dim, named by joining them with "_" (registered on
    the root mesh, which creates its process group on first use: every rank calls this in the same order).
    """
    _check_dp_mesh_dims(spmd_mesh, dims)

    def submesh(names: tuple[str, ...]) -> DeviceMesh:
        if len(names) == 1:
            return spmd_mesh[names[0]]
        return spmd_mesh[names]._flatten("_".join(names))

    shard = submesh(dims.shard_names)
    if not dims.replicate_names:
        return shard
    replicate = submesh(dims.replicate_names)
    try:
        combined = combine_meshes([replicate, shard])
    except (KeyError, ValueError) as error:
        combined = None
        reason = str(error)
    else:
        reason = f"the shard dims come first in the mesh: {combined!r}"
    if combined is None or combined.mesh_dim_names != (*(replicate.mesh_dim_names or ()), *(shard.mesh_dim_names or ())):
        raise FSDPError(
            f"fully_shard: the replicate dim(s) {dims.replicate_names} and shard dim(s) {dims.shard_names} of "
            f"{spmd_mesh!r} do not form a (replicate, shard) mesh ({reason}); expected the replicate dims before "
            "the shard dims in the mesh, each kind adjacent"
        )
    return combined


def combine_meshes(parts: list[DeviceMesh]) -> DeviceMesh:
    """One mesh over the dims of ``parts`` (views of one root mesh), its dims in the order they have there.

    Slices and flattenings of one root: the root sliced by the parts' dim names (a dim the root knows by
    name, or a flattened one). Otherwise (views from ``_unflatten``, which re-grid the root's ranks, as
    torchtitan's meshes are): the parts' dims one by one, outer dims (larger strides through the root's
    ranks) first, joined by ``DeviceMesh._concatenate``. Raises ``KeyError``/``ValueError`` (the mesh's
    errors) when the dims overlap or do not fit one grid; creates no process group.
    """
    root = parts[0]._get_root_mesh()
    names = [name for part in parts for name in (part.mesh_dim_names or ())]
    if all(part._layout.root_shape == root._layout.root_shape for part in parts):
        root_dims = {
            name: dims for part in parts for name, dims in zip(part.mesh_dim_names or (), part._layout.dims)
        }
        ordered = tuple(sorted(names, key=lambda name: min(root_dims[name], default=-1)))
        try:
            return root[ordered]
        except (KeyError, ValueError):
            pass  # a name the root does not know (an unflattened dim): concatenate below
    keyed: list[tuple[float, int, int, DeviceMesh]] = []
    for part_index, part in enumerate(parts):
        singles = [part if part.ndim == 1 else part[name] for name in (part.mesh_dim_names or ())]
        strides = [_stride_through_ranks(single) for single in singles]
        for index, single in enumerate(singles):
            # A dim of size 1 walks no ranks: it keeps its place next to its part's neighbours.
            stride = strides[index]
            if stride is None:
                before = [s for s in strides[:index] if s is not None]
                after = [s for s in strides[index + 1 :] if s is not None]
                stride = before[-1] if before else after[0] if after else (float("inf") if part_index == 0 else -1)
            keyed.append((-stride, part_index, index, single))
    keyed.sort(key=lambda entry: entry[:3])
    return DeviceMesh._concatenate([single for *_, single in keyed])


def _stride_through_ranks(mesh: DeviceMesh) -> float | None:
    """How far one step along a 1-D mesh moves in its root's rank list (None for a dim of size 1)."""
    runs = mesh._layout.runs[0]
    return max((stride for _, stride in runs), default=None)
