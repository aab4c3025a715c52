"""Communication for building DTensors from per-rank data (not for redistribution).

* :func:`agree_on_source_meta` and :func:`distribute_local_data`:
  ``distribute_tensor``'s data movement.  The source's shape, stride and dtype
  reach every rank first (one small broadcast per mesh dim), so every rank sizes
  its collectives from the source's tensor and the result is the source's
  tensor, whatever the others hold: a rank whose own tensor disagrees (a user
  error) gets a warning, never uninitialised memory, a crash or a hang.  Then
  Shard mesh dims scatter from ``src_data_rank`` (an ``all_to_all_single`` in
  which only the source sends, so each rank receives exactly its shard, uneven
  sizes included), Replicate/Partial mesh dims broadcast from it.
* :func:`check_and_sync_from_local`: ``from_local(run_check=True)``: every rank
  learns every rank's local dtype and shape, so all of them raise the same error
  together (no rank is left waiting) or agree on the global shape.
* :func:`agree_on_int`: one integer from the first rank of the mesh (random seeds).

The collectives themselves are issued by ``_collectives`` (over the mesh's per-dim
groups); ``src`` indices are positions along a mesh dim (group ranks).
"""

from __future__ import annotations

import warnings
from typing import Mapping, Sequence

import torch
from shardwise.mesh import DeviceMesh
from shardwise.mesh import _simulation as simulation
from shardwise.placement import (
    DTensorSpec,
    Partial,
    Placement,
    Replicate,
    Shard,
    TensorMeta,
    chunk_sizes,
    compute_local_shape,
    select_local_shard,
    even_global_shape,
    strides_in_local_dim_order,
)

from ._collectives import all_gather_rows_over_mesh, broadcast_along_mesh_dim, scatter_along_mesh_dim
from ._plan_executor import redistribute_local_tensor

__all__ = [
    "agree_on_source_meta",
    "distribute_local_data",
    "distribute_simulated",
    "check_and_sync_from_local",
    "agree_on_int",
]

# dtypes travel between ranks as their index in this table (the same in every process).
_DTYPES: tuple[torch.dtype, ...] = tuple(
    sorted({value for value in vars(torch).values() if isinstance(value, torch.dtype)}, key=str)
)
_DTYPE_CODE: dict[torch.dtype, int] = {dtype: code for code, dtype in enumerate(_DTYPES)}


def _local_chunk(tensor: torch.Tensor, tensor_dim: int, num_chunks: int, index: int) -> torch.Tensor:
    sizes = chunk_sizes(tensor.size(tensor_dim), num_chunks)
    offset = sum(sizes[:index])
    return tensor.narrow(tensor_dim, offset, sizes[index])


# The source's metadata travels as int64s: [ndim, dtype code, shape..., stride...], with up to
# this many dims inline (one broadcast); more dims take a second broadcast, which every rank
# knows to expect from the ndim it received.
_INLINE_DIMS = 16


def _global_stride(tensor: torch.Tensor) -> list[int]:
    # What the DTensor reports as its stride: dense, in the memory order of the tensor's dims.
    return list(strides_in_local_dim_order(tensor, tensor.shape))


def _meta_header(tensor: torch.Tensor) -> list[int]:
    shape, stride = list(tensor.shape), _global_stride(tensor)
    inline = shape[:_INLINE_DIMS] + [0] * (_INLINE_DIMS - min(len(shape), _INLINE_DIMS))
    inline_stride = stride[:_INLINE_DIMS] + [0] * (_INLINE_DIMS - min(len(stride), _INLINE_DIMS))
    return [tensor.ndim, _DTYPE_CODE[tensor.dtype], *inline, *inline_stride]


def _broadcast_from_source(values: list[int], mesh: DeviceMesh, src_data_rank: int) -> list[int]:
    """``values`` of the rank at index ``src_data_rank`` along every mesh dim, on every rank."""
    carrier = torch.tensor(values, dtype=torch.int64, device=mesh.device_type)
    # Along dim 0 every rank (i, j, ...) gets the values of (src, j, ...); then along dim 1
    # those of (src, src, ...), and so on: the source's values reach everyone.
    for mesh_dim in range(mesh.ndim):
        if mesh.shape[mesh_dim] > 1:
            carrier = broadcast_along_mesh_dim(carrier, mesh, mesh_dim, src_data_rank)
    return [int(value) for value in carrier.cpu().tolist()]


def agree_on_source_meta(tensor: torch.Tensor, mesh: DeviceMesh, src_data_rank: int) -> TensorMeta:
    """The shape, stride and dtype of the tensor held by the source rank, on every rank of the mesh.

    The source is the rank at index ``src_data_rank`` along every mesh dim.  The data of every
    other rank is ignored by ``distribute_tensor``; its metadata is too (a rank whose tensor
    differs gets a warning): collectives sized from each rank's own shape would receive into
    memory that nobody writes, or crash gloo, when the ranks disagree.
    """
    header = _broadcast_from_source(_meta_header(tensor), mesh, src_data_rank)
    ndim, dtype = header[0], _DTYPES[header[1]]
    if ndim <= _INLINE_DIMS:
        shape, stride = header[2 : 2 + ndim], header[2 + _INLINE_DIMS : 2 + _INLINE_DIMS + ndim]
    else:
        own = list(tensor.shape) + _global_stride(tensor) if tensor.ndim == ndim else [0] * (2 * ndim)
        rest = _broadcast_from_source(own, mesh, src_data_rank)
        shape, stride = rest[:ndim], rest[ndim:]
    meta = TensorMeta(torch.Size(shape), tuple(stride), dtype)
    if (tuple(tensor.shape), tensor.dtype) != (tuple(meta.shape), meta.dtype):
        warnings.warn(
            f"distribute_tensor: this rank (global rank {mesh.get_rank()}) holds a {tensor.dtype} tensor of "
            f"shape {tuple(tensor.shape)}, but the source (index {src_data_rank} along every dim of {mesh!r}) "
            f"holds {meta.dtype} of shape {tuple(meta.shape)}; the result is the source's tensor, as "
            "src_data_rank says. Pass the same tensor on every rank (or src_data_rank=None to cut each "
            "rank's own tensor without communication)",
            UserWarning,
            stacklevel=3,  # the caller of distribute_tensor
        )
    return meta


def distribute_local_data(
    tensor: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    src_data_rank: int | None,
    source_meta: TensorMeta | None = None,
) -> torch.Tensor:
    """This rank's local tensor for the global ``tensor`` laid out with ``placements``.

    With ``src_data_rank`` set, ``source_meta`` is what :func:`agree_on_source_meta` returned:
    every rank sizes its collectives from it.  A rank whose own tensor does not match it sends
    zeros where it must send something (along a mesh dim, a rank at index ``src_data_rank`` that
    is not the source itself); they are overwritten by the source's data further on.
    """
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        # Not part of the mesh: an empty shard, no communication (the mesh's groups do not include us).
        return tensor.new_empty(0)
    communicate = src_data_rank is not None and not tensor.is_meta
    if communicate and source_meta is not None and (tensor.shape, tensor.dtype) != (source_meta.shape, source_meta.dtype):
        tensor = torch.zeros(source_meta.shape, dtype=source_meta.dtype, device=tensor.device)
    mesh_shape = mesh.shape
    local = tensor
    # Collectives return new tensors; without one, local still aliases the caller's tensor.
    fresh = False
    # Scatter first (left to right keeps the nested torch.chunk order), broadcast the smaller
    # pieces afterwards: same result as the other order, fewer bytes.
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard) and mesh_shape[mesh_dim] > 1:
            if communicate:
                assert src_data_rank is not None
                local = scatter_along_mesh_dim(
                    local, mesh, mesh_dim, placement.dim, src_data_rank, coordinate[mesh_dim]
                )
                fresh = True
            else:
                local = _local_chunk(local, placement.dim, mesh_shape[mesh_dim], coordinate[mesh_dim])
    if communicate:
        assert src_data_rank is not None
        for mesh_dim, placement in enumerate(placements):
            if not isinstance(placement, Shard) and mesh_shape[mesh_dim] > 1:
                local = broadcast_along_mesh_dim(local, mesh, mesh_dim, src_data_rank)
                fresh = True
    if not fresh or not local.is_contiguous():
        # The DTensor owns its local data: it never aliases the caller's tensor.
        local = local.clone(memory_format=torch.contiguous_format)
    if any(isinstance(p, Partial) for p in placements):
        local = _replicated_to_partial(local, tensor, mesh, placements)
    return local


def _replicated_to_partial(
    local: torch.Tensor, global_tensor: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> torch.Tensor:
    meta = TensorMeta(global_tensor.shape, tuple(global_tensor.stride()), global_tensor.dtype)
    as_replicated = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
    return redistribute_local_tensor(
        local, DTensorSpec(mesh, as_replicated, meta), DTensorSpec(mesh, placements, meta)
    )


# -- every rank simulated in this process (torch's LocalTensorMode) --------------------------


def _simulated_coordinates(mesh: DeviceMesh, ranks: frozenset[int]) -> dict[int, tuple[int, ...] | None]:
    coordinates: dict[int, tuple[int, ...] | None] = {}
    for rank in sorted(ranks):
        with simulation.as_simulated_rank(rank):
            coordinates[rank] = mesh.get_coordinate()
    return coordinates


def _select_own_shard(tensor: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> torch.Tensor:
    # Runs once per simulated rank: the mesh reports that rank's coordinate.
    coordinate = mesh.get_coordinate()
    return select_local_shard(tensor, mesh.shape, coordinate, placements).clone(memory_format=torch.contiguous_format)


def distribute_simulated(
    tensor: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    src_data_rank: int | None,
    ranks: frozenset[int],
) -> tuple[torch.Tensor, TensorMeta]:
    """``distribute_tensor``'s local tensor (a ``LocalTensor``) and global meta with every rank simulated here.

    Every simulated rank's tensor is in this process, so no collective is needed: the source's
    piece (the rank at index ``src_data_rank`` along every mesh dim; with ``None`` each rank's
    own piece) is cut by each rank's coordinate, then Partial mesh dims are made by the
    (local) Replicate -> Partial redistribution.
    """
    with simulation.mode_disabled():
        pieces = simulation.local_tensor_pieces(tensor, ranks)
        if src_data_rank is None:
            source_piece = simulation.first_simulated_piece(tensor)
            data = tensor
        else:
            coordinates = _simulated_coordinates(mesh, ranks)
            at_source = tuple(src_data_rank for _ in mesh.shape)
            source_rank = next((rank for rank, coord in coordinates.items() if coord == at_source), None)
            if source_rank is None:
                raise ValueError(
                    f"distribute_tensor under LocalTensorMode: no simulated rank (of {sorted(ranks)}) sits at the "
                    f"source coordinate {at_source} of {mesh!r}; simulate the ranks of the mesh"
                )
            source_piece = pieces[source_rank]
            data = source_piece
            for rank, piece in pieces.items():
                if (piece.shape, piece.dtype) != (source_piece.shape, source_piece.dtype):
                    warnings.warn(
                        f"distribute_tensor: simulated rank {rank} holds a {piece.dtype} tensor of shape "
                        f"{tuple(piece.shape)}, but the source (rank {source_rank}) holds {source_piece.dtype} of shape "
                        f"{tuple(source_piece.shape)}; the result is the source's tensor, as src_data_rank says",
                        UserWarning,
                        stacklevel=3,
                    )
        meta = TensorMeta(source_piece.shape, tuple(_global_stride(source_piece)), source_piece.dtype)
    as_replicated = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
    local = simulation.run_for_each_simulated_rank(_select_own_shard, data, mesh, as_replicated)
    if any(isinstance(p, Partial) for p in placements):
        local = _replicated_to_partial(local, source_piece, mesh, placements)
    return local, meta


# -- from_local(run_check=True) ------------------------------------------------------------



def _coordinates(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    coordinates: list[tuple[int, ...]] = [()]
    for size in mesh_shape:
        coordinates = [coordinate + (index,) for coordinate in coordinates for index in range(size)]
    return coordinates


# Dims of the local shape gathered with the metadata in from_local's check (one all-gather for tensors
# of up to this many dims; every rank sees the same ndims first, so all of them agree on a second).
_SHAPE_SLOTS = 8


def check_and_sync_from_local(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    global_shape: tuple[int, ...] | None,
    *,
    where: str = "DTensor.from_local(run_check=True)",
    sync_replicated: bool = True,
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Validate every rank's local metadata against the placements; infer the global shape if not given.

    Returns the local tensor (with ``sync_replicated``, replicated mesh dims broadcast from their first
    rank) and the global shape.  Every rank sees the same gathered metadata and so raises the same
    ValueError (``where`` names the caller in it).
    """
    coordinate = mesh.get_coordinate()
    if coordinate is None or local.is_meta:
        if global_shape is None:
            global_shape = even_global_shape(tuple(local.shape), mesh.shape, placements)
        return local, global_shape
    coordinates = _coordinates(mesh.shape)
    ranks = simulation.simulated_ranks() if simulation.pinned_rank() is None else None
    if ranks is not None:
        # Every rank simulated here: read each rank's piece instead of gathering its metadata.
        with simulation.mode_disabled():
            pieces = simulation.local_tensor_pieces(local, ranks)
            by_coordinate = {coord: pieces[rank] for rank, coord in _simulated_coordinates(mesh, ranks).items() if coord}
        if set(by_coordinate) != set(coordinates):
            raise ValueError(f"{where} under LocalTensorMode: simulate every rank of {mesh!r}")
        header = {
            coord: (piece.ndim, _DTYPE_CODE[piece.dtype], int(piece.requires_grad))
            for coord, piece in by_coordinate.items()
        }
    else:
        # One all-gather carries the metadata and the local shape (padded to _SHAPE_SLOTS dims: the rows
        # must be equally long before ranks know each other's ndim); more dims take a second, below.
        shape_slots = list(local.shape[:_SHAPE_SLOTS]) + [0] * max(0, _SHAPE_SLOTS - local.ndim)
        gathered = all_gather_rows_over_mesh(
            mesh, [local.ndim, _DTYPE_CODE[local.dtype], int(local.requires_grad), *shape_slots]
        )
        header = {coord: (int(gathered[coord][0]), int(gathered[coord][1]), int(gathered[coord][2])) for coord in coordinates}
    ndims = {coord: int(header[coord][0]) for coord in coordinates}
    dtypes = {coord: _DTYPES[int(header[coord][1])] for coord in coordinates}
    requires_grad = {coord: bool(header[coord][2]) for coord in coordinates}
    if len(set(ndims.values())) > 1:
        raise ValueError(f"{where}: ranks hold local tensors with different numbers of dims: {_describe(ndims)}")
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"{where}: ranks hold local tensors with different dtypes: {_describe(dtypes)}")
    if len(set(requires_grad.values())) > 1:
        # Autograd would run on some ranks only, and their backward collectives would wait forever.
        raise ValueError(f"{where}: ranks disagree on requires_grad of the local tensor: {_describe(requires_grad)}")
    if local.ndim == 0:
        shapes: dict[tuple[int, ...], tuple[int, ...]] = {coord: () for coord in coordinates}
    elif ranks is not None:
        shapes = {coord: tuple(piece.shape) for coord, piece in by_coordinate.items()}
    elif local.ndim <= _SHAPE_SLOTS:
        shapes = {coord: tuple(int(v) for v in gathered[coord][3 : 3 + local.ndim].tolist()) for coord in coordinates}
    else:
        table = all_gather_rows_over_mesh(mesh, list(local.shape))
        shapes = {coord: tuple(int(v) for v in table[coord].tolist()) for coord in coordinates}
    if global_shape is None:
        global_shape = _infer_global_shape(shapes, mesh, placements, where)
    for coord, shape in shapes.items():
        expected = compute_local_shape(global_shape, mesh.shape, coord, placements)
        if shape != tuple(expected):
            raise ValueError(
                f"{where}: the local tensor at mesh coordinate {coord} has shape {shape}, but global shape "
                f"{global_shape} with placements {placements} gives it shape {tuple(expected)} (torch.chunk "
                f"layout); local shapes by coordinate: {_describe(shapes)}"
            )
    if sync_replicated:
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Replicate) and mesh.shape[mesh_dim] > 1:
                local = broadcast_along_mesh_dim(local, mesh, mesh_dim, 0)
    return local, global_shape


def _infer_global_shape(
    shapes: dict[tuple[int, ...], tuple[int, ...]],
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    where: str,
) -> tuple[int, ...]:
    """Sum the local sizes over the mesh dims that shard each tensor dim (other mesh dims at index 0)."""
    origin = (0,) * mesh.ndim
    ndim = len(shapes[origin])
    global_shape = list(shapes[origin])
    for tensor_dim in range(ndim):
        sharding_dims = [m for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim == tensor_dim]
        if not sharding_dims:
            sizes = {coord: shape[tensor_dim] for coord, shape in shapes.items()}
            if len(set(sizes.values())) > 1:
                raise ValueError(
                    f"{where}: tensor dim {tensor_dim} is not sharded by {placements}, yet ranks hold different "
                    f"sizes for it: {_describe(sizes)}"
                )
            continue
        total = 0
        for coord in _coordinates([mesh.shape[m] for m in sharding_dims]):
            full = list(origin)
            for mesh_dim, index in zip(sharding_dims, coord):
                full[mesh_dim] = index
            total += shapes[tuple(full)][tensor_dim]
        global_shape[tensor_dim] = total
    return tuple(global_shape)


def _describe(values: Mapping[tuple[int, ...], object]) -> str:
    return ", ".join(f"{coord}: {value}" for coord, value in values.items())


# -- seeds ----------------------------------------------------------------------------------


def agree_on_int(value: int, mesh: DeviceMesh) -> int:
    """The ``value`` of the rank at index 0 of every mesh dim, on every rank of the mesh."""
    if mesh.get_coordinate() is None:
        return value
    carrier = torch.tensor([value], dtype=torch.int64, device=mesh.device_type)
    for mesh_dim in range(mesh.ndim):
        if mesh.shape[mesh_dim] > 1:
            carrier = broadcast_along_mesh_dim(carrier, mesh, mesh_dim, 0)
    return int(carrier.item())
