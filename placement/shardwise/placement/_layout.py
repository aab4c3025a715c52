"""Shard layout math: where each rank's shard lives in the global tensor.

Everything here derives from one 1-D rule, :func:`chunk_size_and_offset`
(torch.chunk semantics: chunk size ``ceil(n / k)``, trailing chunks smaller or
empty, but always exactly ``k`` chunks), applied per mesh dim by
:func:`compute_local_shape_and_global_offset`.  Several mesh dims sharding the
same tensor dim nest left to right: mesh dim 0 splits the global extent, mesh
dim 1 splits each of those pieces, and so on.

The local-tensor helpers (:func:`split_tensor`, :func:`pad_dim`,
:func:`unpad_dim`, :func:`select_local_shard`) are pure torch, no communication;
redistribution uses them around its collectives.
"""

from __future__ import annotations

from typing import Sequence, cast

import torch
import torch.nn.functional as F

from ._placements import Placement, Shard, _StridedShard
from ._simulated import any_per_rank_int, for_each_simulated_rank

__all__ = [
    "has_uneven_shards",
    "chunk_size_and_offset",
    "chunk_sizes",
    "compute_local_shape_and_global_offset",
    "compute_local_shape",
    "shard_sizes_along_mesh_dim",
    "select_local_shard",
    "split_tensor",
    "pad_dim",
    "unpad_dim",
    "normalize_dim",
    "contiguous_strides",
    "strides_in_local_dim_order",
    "even_global_shape",
    "local_index_runs",
]


def normalize_dim(dim: int, ndim: int, *, what: str = "dim") -> int:
    """Map ``dim`` in ``[-ndim, ndim)`` to ``[0, ndim)``; raise IndexError otherwise."""
    if -ndim <= dim < ndim:
        return dim + ndim if dim < 0 else dim
    if ndim == 0:
        raise IndexError(f"{what}={dim} is out of range: the tensor is 0-dimensional and has no dims")
    raise IndexError(
        f"{what}={dim} is out of range for a tensor with {ndim} dims; expected a dim in [{-ndim}, {ndim - 1}]"
    )


def chunk_size_and_offset(dim_size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """Size and start of chunk ``index`` when ``dim_size`` elements are cut into ``num_chunks``.

    torch.chunk rule: every chunk has ``ceil(dim_size / num_chunks)`` elements
    except the trailing ones, which are smaller or empty.  Unlike torch.chunk
    there are always ``num_chunks`` chunks; an empty chunk starts at ``dim_size``
    so ``[offset, offset + size)`` is always a valid slice.  Per-rank ints (LocalTensorMode) give
    per-rank answers (see ``_simulated``).
    """
    if any_per_rank_int((dim_size, num_chunks, index)):
        size, offset = for_each_simulated_rank(_chunk_size_and_offset, dim_size, num_chunks, index)
        return size, offset  # type: ignore[return-value]
    return _chunk_size_and_offset(dim_size, num_chunks, index)


def _chunk_size_and_offset(dim_size: int, num_chunks: int, index: int) -> tuple[int, int]:
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    if not 0 <= index < num_chunks:
        raise IndexError(f"chunk index {index} is out of range for {num_chunks} chunks; expected [0, {num_chunks - 1}]")
    if dim_size < 0:
        raise ValueError(f"dim_size must be >= 0, got {dim_size}")
    full_chunk = -(-dim_size // num_chunks)
    offset = min(index * full_chunk, dim_size)
    return min(full_chunk, dim_size - offset), offset


def chunk_sizes(dim_size: int, num_chunks: int) -> tuple[int, ...]:
    """Sizes of all ``num_chunks`` torch.chunk-style chunks of ``dim_size`` elements."""
    return tuple(chunk_size_and_offset(dim_size, num_chunks, i)[0] for i in range(num_chunks))


def _check_mesh_args(
    mesh_shape: Sequence[int],
    coordinate: Sequence[int] | None,
    placements: Sequence[Placement],
) -> None:
    if len(placements) != len(mesh_shape):
        raise ValueError(
            f"got {len(placements)} placements {tuple(placements)} for a {len(mesh_shape)}-D mesh of shape "
            f"{tuple(mesh_shape)}; expected one placement per mesh dim"
        )
    if coordinate is None:
        return
    if len(coordinate) != len(mesh_shape):
        raise ValueError(
            f"coordinate {tuple(coordinate)} has {len(coordinate)} entries but the mesh of shape "
            f"{tuple(mesh_shape)} has {len(mesh_shape)} dims"
        )
    for mesh_dim, (index, size) in enumerate(zip(coordinate, mesh_shape)):
        if not 0 <= index < size:
            raise IndexError(
                f"coordinate {tuple(coordinate)} is outside the mesh of shape {tuple(mesh_shape)}: "
                f"mesh dim {mesh_dim} has size {size}, got index {index}"
            )


def _shard_tensor_dim(placement: Shard | _StridedShard, mesh_dim: int, global_shape: Sequence[int]) -> int:
    ndim = len(global_shape)
    dim = placement.dim
    if -ndim <= dim < ndim:
        return dim + ndim if dim < 0 else dim
    expected = f"expected a dim in [{-ndim}, {ndim - 1}]" if ndim else "a 0-dim tensor cannot be sharded"
    raise ValueError(
        f"{placement!r} on mesh dim {mesh_dim} is out of range for a tensor with {ndim} dims "
        f"(shape {tuple(global_shape)}); {expected}"
    )


def compute_local_shape_and_global_offset(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int] | None,
    placements: Sequence[Placement],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape of the shard held at mesh ``coordinate`` and where it starts in the global tensor.

    ``Shard(d)`` on mesh dim ``m`` cuts the current extent of tensor dim ``d``
    into ``mesh_shape[m]`` torch.chunk-style pieces (see
    :func:`chunk_size_and_offset`) and keeps piece ``coordinate[m]``; mesh dims
    are applied left to right, so later mesh dims split the pieces of earlier
    ones.  ``Replicate`` and ``Partial`` keep the full extent.  Negative shard
    dims count from the end of ``global_shape``.

    An empty shard's offset is the global size of that dim (as in PyTorch), so
    ``[offset, offset + size)`` is always a valid, empty slice.

    A ``coordinate`` of ``None`` means this rank is not part of the mesh: it holds
    nothing, so the local shape is 0 on every dim and the offset equals the global
    shape (for a 0-dim global shape both are ``()``).

    A coordinate of per-rank ints (torch's LocalTensorMode) gives every simulated rank's shape and
    offset, as ``LocalIntNode`` SymInts where they differ (see ``_simulated``).
    """
    if coordinate is not None and any_per_rank_int(coordinate):
        flat = for_each_simulated_rank(_flat_local_shape_and_global_offset, global_shape, mesh_shape, coordinate, placements)
        # Per-rank SymInts stand where ints are expected: they carry one int per simulated rank.
        per_rank = cast(tuple[int, ...], flat)
        return per_rank[: len(global_shape)], per_rank[len(global_shape) :]
    return _compute_local_shape_and_global_offset(global_shape, mesh_shape, coordinate, placements)


def _flat_local_shape_and_global_offset(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Placement]
) -> tuple[int, ...]:
    shape, offset = _compute_local_shape_and_global_offset(global_shape, mesh_shape, coordinate, placements)
    return (*shape, *offset)


def _compute_local_shape_and_global_offset(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int] | None,
    placements: Sequence[Placement],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    _check_mesh_args(mesh_shape, coordinate, placements)
    ndim = len(global_shape)
    if coordinate is None:
        return (0,) * ndim, tuple(global_shape)
    local_shape = list(global_shape)
    global_offset = [0] * ndim
    some_shard_empty = False
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, _StridedShard):
            return _shape_and_offset_from_runs(global_shape, _index_runs(global_shape, mesh_shape, coordinate, placements))
        if isinstance(placement, Shard):
            tensor_dim = _shard_tensor_dim(placement, mesh_dim, global_shape)
            size, offset = chunk_size_and_offset(local_shape[tensor_dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
            local_shape[tensor_dim] = size
            global_offset[tensor_dim] += offset
            some_shard_empty = some_shard_empty or size == 0
    if some_shard_empty:
        # Same convention as PyTorch (checkpoint metadata relies on it): an empty
        # shard starts at the end of the global dim, wherever its parent piece was.
        for tensor_dim, size in enumerate(local_shape):
            if size == 0:
                global_offset[tensor_dim] = global_shape[tensor_dim]
    return tuple(local_shape), tuple(global_offset)


# -- strided shards: a local piece made of several ranges of the global tensor ----------------

IndexRuns = tuple[tuple[int, int], ...]
"""``(global start, length)`` ranges of one tensor dim, concatenated in order to form the local extent."""


def _take_runs(runs: IndexRuns, offset: int, size: int) -> list[tuple[int, int]]:
    """The ranges covering positions ``[offset, offset + size)`` of the concatenation of ``runs``."""
    taken: list[tuple[int, int]] = []
    position = 0
    end = offset + size
    for start, length in runs:
        low, high = max(offset, position), min(end, position + length)
        if low < high:
            taken.append((start + low - position, high - low))
        position += length
        if position >= end:
            break
    return taken


def _merge_runs(runs: list[tuple[int, int]]) -> IndexRuns:
    merged: list[tuple[int, int]] = []
    for start, length in runs:
        if length == 0:
            continue
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((start, length))
    return tuple(merged)


def _index_runs(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> tuple[IndexRuns, ...]:
    runs: list[IndexRuns] = [((0, extent),) if extent else () for extent in global_shape]
    for mesh_dim, placement in enumerate(placements):
        if not isinstance(placement, (Shard, _StridedShard)):
            continue
        tensor_dim = _shard_tensor_dim(placement, mesh_dim, global_shape)
        current = runs[tensor_dim]
        extent = sum(length for _, length in current)
        num_chunks, index = mesh_shape[mesh_dim], coordinate[mesh_dim]
        if isinstance(placement, Shard):
            size, offset = chunk_size_and_offset(extent, num_chunks, index)
            runs[tensor_dim] = _merge_runs(_take_runs(current, offset, size))
            continue
        # _StridedShard: cut into split_factor pieces, each into num_chunks; keep piece `index` of each.
        kept: list[tuple[int, int]] = []
        for piece in range(placement.split_factor):
            piece_size, piece_offset = chunk_size_and_offset(extent, placement.split_factor, piece)
            size, offset = chunk_size_and_offset(piece_size, num_chunks, index)
            kept.extend(_take_runs(current, piece_offset + offset, size))
        runs[tensor_dim] = _merge_runs(kept)
    return tuple(runs)


def _shape_and_offset_from_runs(
    global_shape: Sequence[int], runs: Sequence[IndexRuns]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    local_shape = tuple(sum(length for _, length in dim_runs) for dim_runs in runs)
    if any(size == 0 for size in local_shape):
        offsets = tuple(
            global_shape[dim] if size == 0 else dim_runs[0][0] for dim, (size, dim_runs) in enumerate(zip(local_shape, runs))
        )
    else:
        offsets = tuple(dim_runs[0][0] for dim_runs in runs)
    return local_shape, offsets


def local_index_runs(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int] | None,
    placements: Sequence[Placement],
) -> tuple[IndexRuns, ...]:
    """Exactly which global indices the shard at ``coordinate`` holds, per tensor dim.

    Entry ``d`` lists ``(global start, length)`` ranges of tensor dim ``d`` whose
    concatenation, in order, is the local extent of that dim (adjacent ranges merged;
    an empty extent has no range).  ``Shard`` placements give one range per dim (the
    one :func:`compute_local_shape_and_global_offset` describes); a ``_StridedShard``
    can give several.  The local tensor is the outer product of these ranges: local
    element ``(i, j, ...)`` is global element ``(runs[0] flattened[i], ...)``.
    ``coordinate=None`` (a rank outside the mesh) holds nothing.
    """
    _check_mesh_args(mesh_shape, coordinate, placements)
    if coordinate is None:
        return tuple(() for _ in global_shape)
    return _index_runs(global_shape, mesh_shape, coordinate, placements)


def even_global_shape(
    local_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> tuple[int, ...]:
    """The global shape whose shards all have ``local_shape``: each sharded dim times its mesh dims' sizes.

    What ``DTensor.from_local`` assumes when it is given neither the global shape nor ``run_check``.
    """
    shape = list(local_shape)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, (Shard, _StridedShard)):
            shape[_shard_tensor_dim(placement, mesh_dim, local_shape)] *= mesh_shape[mesh_dim]
    return tuple(shape)


def has_uneven_shards(global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]) -> bool:
    """Whether the shards of ``global_shape`` differ in shape between ranks (some sharded dim's size is not a
    multiple of the number of pieces it is cut into).  Read from the global layout only, so every rank answers
    the same: the first piece is the largest (torch.chunk), and all pieces are alike exactly when the even
    global shape of the first piece is the global shape."""
    first_piece = compute_local_shape(global_shape, mesh_shape, (0,) * len(mesh_shape), placements)
    return tuple(even_global_shape(first_piece, mesh_shape, placements)) != tuple(global_shape)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (size-0 dims count as size 1, as torch does)."""
    strides = [1] * len(shape)
    running = 1
    for dim in range(len(shape) - 1, -1, -1):
        strides[dim] = running
        size = shape[dim]
        # A symbolic size (torch.compile, dynamic shapes) stays symbolic: int() would pin it to one value.
        running *= max(size, 1) if type(size) is int else torch.sym_max(size, 1)
    return tuple(strides)


def strides_in_local_dim_order(local_tensor: torch.Tensor, global_shape: Sequence[int]) -> tuple[int, ...]:
    """Dense strides for ``global_shape`` that keep the local tensor's dim order in memory.

    A contiguous shard gives a contiguous global stride, a transposed one a transposed global
    stride; ties (size-1 dims) keep the logical order.  Every rank must report the same global
    stride, so a contiguous local tensor never looks at its own strides (those of size-0/1 dims
    are arbitrary and shard sizes differ between ranks).
    """
    ndim = len(global_shape)
    if local_tensor.is_contiguous():
        return contiguous_strides(global_shape)
    local_stride = local_tensor.stride()
    outer_to_inner = sorted(range(ndim), key=lambda dim: (-local_stride[dim], dim))
    strides = [0] * ndim
    running = 1
    for dim in reversed(outer_to_inner):
        strides[dim] = running
        running *= max(int(global_shape[dim]), 1)
    return tuple(strides)


def compute_local_shape(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int] | None,
    placements: Sequence[Placement],
) -> tuple[int, ...]:
    """Local shape part of :func:`compute_local_shape_and_global_offset`."""
    return compute_local_shape_and_global_offset(global_shape, mesh_shape, coordinate, placements)[0]


def shard_sizes_along_mesh_dim(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    *,
    mesh_dim: int,
    tensor_dim: int,
) -> tuple[int, ...]:
    """Local size of ``tensor_dim`` for every rank of the ``mesh_dim`` group containing ``coordinate``.

    Entry ``i`` is the size held at ``coordinate`` with its ``mesh_dim`` entry
    replaced by ``i``: a collective over ``mesh_dim`` pads every rank's piece to
    ``max(...)`` and trims each received piece back to its entry.
    """
    if not -len(mesh_shape) <= mesh_dim < len(mesh_shape):
        raise IndexError(f"mesh_dim={mesh_dim} is out of range for a mesh of shape {tuple(mesh_shape)}")
    mesh_dim %= len(mesh_shape)
    tensor_dim = normalize_dim(tensor_dim, len(global_shape), what="tensor_dim")
    group_coordinate = list(coordinate)
    sizes = []
    for index in range(mesh_shape[mesh_dim]):
        group_coordinate[mesh_dim] = index
        local_shape, _ = compute_local_shape_and_global_offset(global_shape, mesh_shape, group_coordinate, placements)
        sizes.append(local_shape[tensor_dim])
    return tuple(sizes)


def select_local_shard(
    full_tensor: torch.Tensor,
    mesh_shape: Sequence[int],
    coordinate: Sequence[int] | None,
    placements: Sequence[Placement],
) -> torch.Tensor:
    """View of ``full_tensor`` holding the shard that lives at ``coordinate`` (no copy).

    A ``_StridedShard`` whose piece is made of several ranges gives a copy (the ranges
    concatenated, see :func:`local_index_runs`).

    Values are not reduced or scaled for ``Partial``: the caller decides what a
    partial shard holds.  ``coordinate=None`` gives an empty tensor of the same
    number of dims.
    """
    if any(isinstance(placement, _StridedShard) for placement in placements):
        return _select_runs(full_tensor, local_index_runs(full_tensor.shape, mesh_shape, coordinate, placements))
    local_shape, global_offset = compute_local_shape_and_global_offset(
        full_tensor.shape, mesh_shape, coordinate, placements
    )
    shard = full_tensor
    for dim, (size, offset, full_size) in enumerate(zip(local_shape, global_offset, full_tensor.shape)):
        if size != full_size:
            shard = shard.narrow(dim, offset, size)
    return shard


def _select_runs(full_tensor: torch.Tensor, runs: Sequence[IndexRuns]) -> torch.Tensor:
    shard = full_tensor
    for dim, dim_runs in enumerate(runs):
        if len(dim_runs) == 1 and dim_runs[0] == (0, full_tensor.size(dim)):
            continue
        pieces = [shard.narrow(dim, start, length) for start, length in dim_runs]
        if not pieces:
            shard = shard.narrow(dim, full_tensor.size(dim), 0)
        elif len(pieces) == 1:
            shard = pieces[0]
        else:
            shard = torch.cat(pieces, dim)
    return shard


def split_tensor(tensor: torch.Tensor, dim: int, num_chunks: int) -> list[torch.Tensor]:
    """Exactly ``num_chunks`` views of ``tensor`` along ``dim`` with torch.chunk sizes (trailing maybe empty)."""
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    dim = normalize_dim(dim, tensor.dim())
    dim_size = tensor.size(dim)
    pieces = []
    for index in range(num_chunks):
        size, offset = chunk_size_and_offset(dim_size, num_chunks, index)
        pieces.append(tensor.narrow(dim, offset, size))
    return pieces


def pad_dim(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``tensor`` with zeros appended along ``dim`` up to ``size`` (returned as is when already that size)."""
    dim = normalize_dim(dim, tensor.dim())
    current = tensor.size(dim)
    if current == size:
        return tensor
    if current > size:
        raise ValueError(
            f"cannot pad dim {dim} of a tensor of shape {tuple(tensor.shape)} to {size}: it already has {current}"
        )
    # F.pad lists (before, after) pairs starting from the last dim.
    padding = [0, 0] * (tensor.dim() - 1 - dim) + [0, size - current]
    return F.pad(tensor, padding)


def unpad_dim(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """View of the first ``size`` entries of ``tensor`` along ``dim``: undoes :func:`pad_dim`."""
    dim = normalize_dim(dim, tensor.dim())
    current = tensor.size(dim)
    if current == size:
        return tensor
    if not 0 <= size < current:
        raise ValueError(
            f"cannot unpad dim {dim} of a tensor of shape {tuple(tensor.shape)} to {size}: "
            f"expected a size in [0, {current}]"
        )
    return tensor.narrow(dim, 0, size)
