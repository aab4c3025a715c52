"""Sharding context-parallel buffers and putting them back: PyTorch's ``_context_parallel_shard``,
``context_parallel_unshard`` and ``_create_cp_block_mask`` (served at PyTorch's path by ``_attention``).

Sharding is local (each rank cuts its own piece by the layout); unsharding is one all-gather per buffer.
The argument checks here are local too, the same verdict on every rank, so they raise before any collective.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch.nn.attention.flex_attention import BlockMask
from torch.utils._pytree import tree_flatten, tree_unflatten

from shardwise.mesh import DeviceMesh

from .. import _collectives
from .._dtensor import DTensor
from ._cp_flex import DEFAULT_BLOCK_SIZE, MaskMod, cp_block_mask, gather_rows, padded_rows
from ._cp_layout import SequenceLayout, _LoadBalancer, contiguous_layout
from ._cp_ring import on_each_rank
from ._cp_settings import _cp_options, _create_default_load_balancer, _record_layouts, _rows_of_local_length

# -- checks (local, identical on every rank: raised before any collective) ----------------------------------


def _check_cp_mesh(mesh: Any, what: str) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what} expects a shardwise DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"{what} needs a 1-D mesh (the context-parallel dim); got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)} "
            f"(dims {mesh.mesh_dim_names}); pass mesh['cp'] or the sub-mesh of the context-parallel dim"
        )


def _normalized_seq_dims(buffers: Sequence[torch.Tensor], seq_dims: Sequence[int], what: str) -> list[int]:
    if len(buffers) != len(seq_dims):
        raise ValueError(
            f"{what}: `seq_dims` must have the same number of elements as `buffers` (got {len(seq_dims)} seq dims "
            f"for {len(buffers)} buffers)"
        )
    normalized: list[int] = []
    for index, (buffer, seq_dim) in enumerate(zip(buffers, seq_dims)):
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"{what}: buffer {index} is a {type(buffer).__name__}; expected a torch.Tensor")
        if isinstance(buffer, DTensor):
            raise TypeError(f"{what}: buffer {index} is a DTensor; context parallel shards plain tensors")
        if not -buffer.dim() <= seq_dim < buffer.dim():
            raise ValueError(
                f"{what}: seq dim {seq_dim} of buffer {index} is out of range for its shape {tuple(buffer.shape)} "
                f"(expected a dim in [{-buffer.dim()}, {buffer.dim() - 1}])"
            )
        normalized.append(seq_dim % buffer.dim())
    lengths = [buffer.shape[dim] for buffer, dim in zip(buffers, normalized)]
    # Compared pairwise, not hashed: under LocalTensorMode a piece's length may be a per-rank SymInt.
    if any(length != lengths[0] for length in lengths[1:]):
        described = ", ".join(f"buffer {i}: {tuple(b.shape)} dim {d}" for i, (b, d) in enumerate(zip(buffers, normalized)))
        raise ValueError(f"{what}: the buffers' sequence dims disagree in length {lengths} ({described}); expected one length")
    devices = {buffer.device for buffer in buffers}
    if len(devices) > 1:
        raise ValueError(f"{what}: all buffers must be on the same device, got {sorted(str(d) for d in devices)}")
    return normalized


# -- sharding and unsharding ------------------------------------------------------------------------------


def _rank_positions(layout: SequenceLayout, rank: int, device: torch.device) -> torch.Tensor:
    positions = [position for start, stop in layout.segments[rank] for position in range(start, stop)]
    return torch.tensor(positions, dtype=torch.long, device=device)


def _shard(buffer: torch.Tensor, seq_dim: int, layout: SequenceLayout, rank: int) -> torch.Tensor:
    """This rank's piece of ``buffer`` along ``seq_dim`` (no communication)."""
    piece: torch.Tensor = on_each_rank(rank, _piece_of_rank, buffer, seq_dim, layout)
    return piece


def _shard_rows(buffer: torch.Tensor, seq_dim: int, rows: tuple[SequenceLayout, ...], rank: int) -> torch.Tensor:
    """This rank's piece of ``buffer``, batch row ``b`` (dim 0) cut by ``rows[b]`` when there are several layouts.

    A buffer whose sequence dim is 0 has no batch dim and takes the first row's layout (as PyTorch's).
    """
    if len(rows) == 1 or seq_dim == 0:
        return _shard(buffer, seq_dim, rows[0], rank)
    if buffer.size(0) != len(rows):
        raise ValueError(
            f"the load balancer rearranges {len(rows)} batch rows; a buffer of shape {tuple(buffer.shape)} has {buffer.size(0)} "
            "rows along dim 0"
        )
    return torch.stack([_shard(buffer[row], seq_dim - 1, layout, rank) for row, layout in enumerate(rows)])


def _piece_of_rank(rank: int, buffer: torch.Tensor, seq_dim: int, layout: SequenceLayout) -> torch.Tensor:
    segments = layout.segments[rank]
    if len(segments) == 1:
        start, stop = segments[0]
        return buffer.narrow(seq_dim, start, stop - start).clone()
    return buffer.index_select(seq_dim, _rank_positions(layout, rank, buffer.device))


def _padded_front(rank: int, piece: torch.Tensor, seq_dim: int, widest: int) -> torch.Tensor:
    """``piece`` with its sequence dim first, padded to ``widest`` tokens."""
    return padded_rows(piece.movedim(seq_dim, 0).contiguous(), widest)


def _unshard(mesh: DeviceMesh, piece: torch.Tensor, seq_dim: int, rows: tuple[SequenceLayout, ...], rank: int) -> torch.Tensor:
    """The whole sequence in its original order, from every rank's piece: one all-gather.

    With one layout per batch row, row ``b`` (dim 0 of ``piece``) is put back in its own order.
    """
    layout = rows[0]
    lengths = layout.local_lengths()
    widest = max(lengths)
    padded = on_each_rank(rank, _padded_front, piece, seq_dim, widest)
    in_layout_order = gather_rows(padded, lengths, _collectives.mesh_dim_group_name(mesh, 0))
    if len(rows) > 1 and seq_dim > 0:
        # Sequence first, then batch: row b's tokens are in_layout_order[:, b].
        restored_rows = [
            in_layout_order[:, row].index_select(0, _restore_index(row_layout, piece.device)) for row, row_layout in enumerate(rows)
        ]
        return torch.stack(restored_rows, dim=1).movedim(0, seq_dim)
    if not layout.is_contiguous:
        in_layout_order = in_layout_order.index_select(0, _restore_index(layout, piece.device))
    return in_layout_order.movedim(0, seq_dim)


def _restore_index(layout: SequenceLayout, device: torch.device) -> torch.Tensor:
    return torch.argsort(torch.tensor(layout.order(), dtype=torch.long, device=device))


def _rows_for_balancer(load_balancer: _LoadBalancer | None, seq_length: int, world_size: int) -> tuple[SequenceLayout, ...]:
    if load_balancer is None:
        return (contiguous_layout(seq_length, world_size),)
    rows = load_balancer._row_layouts()
    layout = rows[0]
    if layout.global_length != seq_length or layout.world_size != world_size:
        raise ValueError(
            f"the load balancer lays out {layout.global_length} tokens over {layout.world_size} ranks; the buffers have "
            f"{seq_length} tokens over a mesh of {world_size}"
        )
    lengths = {row.local_lengths() for row in rows}
    if len(lengths) != 1:
        raise ValueError(
            f"the load balancer gives the ranks {sorted(lengths)} tokens in different batch rows; every row must give each "
            "rank the same number of tokens (make every row's documents cut alike, e.g. lengths that divide by 2 * world size)"
        )
    return rows


@torch.no_grad()
def context_parallel_unshard(
    mesh: DeviceMesh,
    buffers: list[torch.Tensor],
    seq_dims: list[int],
    load_balancer: _LoadBalancer | None = None,
) -> list[torch.Tensor]:
    """Gather context-parallel pieces (outputs, gradients) back into whole sequences, one all-gather each.

    Without ``load_balancer`` the layout is the one the last ``context_parallel`` or
    ``_context_parallel_shard`` sharded with (when these pieces are its shares), else the default
    for ``local length * W`` tokens.  A balancer that rearranges each batch row its own way puts
    each row (dim 0) back in its order.
    """
    _check_cp_mesh(mesh, "context_parallel_unshard")
    buffers = list(buffers)
    normalized = _normalized_seq_dims(buffers, seq_dims, "context_parallel_unshard") if buffers else []
    if not buffers:
        return []
    world_size = mesh.size()
    rank = mesh.get_local_rank(0)
    local_length = buffers[0].shape[normalized[0]]
    if load_balancer is not None:
        first = load_balancer._row_layouts()[0]
        on_each_rank(rank, _check_balancer_share, first, local_length, world_size)
        rows = _rows_for_balancer(load_balancer, first.global_length, world_size)
    else:
        rows = _rows_of_local_length(local_length, rank, world_size)
    for index, (buffer, dim) in enumerate(zip(buffers, normalized)):
        if len(rows) > 1 and dim > 0 and buffer.size(0) != len(rows):
            raise ValueError(
                f"context_parallel_unshard: the layout rearranges {len(rows)} batch rows; buffer {index} "
                f"{tuple(buffer.shape)} has {buffer.size(0)} rows along dim 0"
            )
    return [_unshard(mesh, buffer, dim, rows, rank) for buffer, dim in zip(buffers, normalized)]


def _check_balancer_share(rank: int, layout: SequenceLayout, local_length: int, world_size: int) -> None:
    if layout.world_size != world_size or layout.local_length(rank) != local_length:
        raise ValueError(
            f"context_parallel_unshard: the load balancer gives rank {rank} {layout.local_length(rank)} of "
            f"{layout.global_length} tokens over {layout.world_size} ranks; the buffers hold {local_length} over {world_size}"
        )


def _context_parallel_shard(
    mesh: DeviceMesh,
    buffers: Sequence[torch.Tensor | BlockMask] | Mapping[str, torch.Tensor | BlockMask],
    seq_dims: Sequence[int] | Mapping[str, int],
    load_balancer: _LoadBalancer | None = None,
) -> Any:
    """This rank's pieces of ``buffers`` (same container structure), rearranged by ``load_balancer``.

    Tensors become new tensors holding this rank's tokens; a flex_attention ``BlockMask`` becomes
    this rank's mask for its queries against the all-gathered keys (:func:`_create_cp_block_mask`;
    its seq dim is ignored).  No communication.  Records the layout, so that attention under
    ``_ContextParallel`` and ``context_parallel_unshard`` read the same one; as PyTorch's, load
    balancing is on exactly when a balancer is given.
    """
    _check_cp_mesh(mesh, "_context_parallel_shard")
    if len(buffers) != len(seq_dims):
        raise ValueError("`seq_dims` must have the same number of elements as `buffers`.")
    flat_buffers, structure = tree_flatten(buffers)
    flat_seq_dims, _ = tree_flatten(seq_dims)
    if len(flat_buffers) != len(flat_seq_dims):
        raise ValueError("`seq_dims` must have the pytree structure as `buffers`.")
    for index, buffer in enumerate(flat_buffers):
        if not isinstance(buffer, (torch.Tensor, BlockMask)):
            raise TypeError(
                f"_context_parallel_shard: buffer {index} is a {type(buffer).__name__}; expected a torch.Tensor or a "
                "flex_attention BlockMask"
            )
    tensor_indices = [index for index, buffer in enumerate(flat_buffers) if isinstance(buffer, torch.Tensor)]
    tensors = [flat_buffers[index] for index in tensor_indices]
    normalized = _normalized_seq_dims(tensors, [flat_seq_dims[index] for index in tensor_indices], "_context_parallel_shard")
    masks = [buffer for buffer in flat_buffers if isinstance(buffer, BlockMask)]
    if not flat_buffers:
        return tree_unflatten([], structure)
    mask_lengths = {int(mask.seq_lengths[0]) for mask in masks}
    seq_length = tensors[0].shape[normalized[0]] if tensors else mask_lengths.pop()
    if any(length != seq_length for length in mask_lengths):
        raise ValueError(
            f"_context_parallel_shard: the BlockMasks' query lengths {sorted(mask_lengths)} differ from the buffers' "
            f"sequence length {seq_length}"
        )
    rows = _rows_for_balancer(load_balancer, seq_length, mesh.size())
    rank = mesh.get_local_rank(0)
    sharded: list[Any] = list(flat_buffers)
    for index, buffer, dim in zip(tensor_indices, tensors, normalized):
        sharded[index] = _shard_rows(buffer, dim, rows, rank)
    for index, buffer in enumerate(flat_buffers):
        if isinstance(buffer, BlockMask):
            sharded[index] = _cp_block_mask_of(buffer, mesh, rows)
    _cp_options.enable_load_balance = load_balancer is not None
    _record_layouts(rows)
    return tree_unflatten(sharded, structure)


def _cp_block_mask_of(block_mask: BlockMask, mesh: DeviceMesh, rows: tuple[SequenceLayout, ...]) -> BlockMask:
    batch, heads = block_mask.kv_num_blocks.shape[:2]
    kv_length = int(block_mask.seq_lengths[1])
    kv_rows = rows if kv_length == rows[0].global_length else (contiguous_layout(kv_length, mesh.size()),)
    return cp_block_mask(
        block_mask.mask_mod, batch, heads, rows, kv_rows, mesh.get_local_rank(0), block_mask.kv_num_blocks.device,
        block_size=(int(block_mask.BLOCK_SIZE[0]), int(block_mask.BLOCK_SIZE[1])),
    )  # fmt: skip


def _create_cp_block_mask(
    mask_mod: MaskMod,
    B: int,
    H: int,
    Q_LEN: int,
    KV_LEN: int,
    device_mesh: DeviceMesh,
    load_balancer: _LoadBalancer | None = None,
) -> BlockMask:
    """A flex_attention ``BlockMask`` for this rank's queries against the all-gathered keys (PyTorch's name and arguments).

    ``mask_mod`` is written on global positions.  Without ``load_balancer`` the default one applies
    (head-tail while ``_cp_options.enable_load_balance``), as PyTorch's.  Any lengths (PyTorch's needs
    ``Q_LEN % (W * 128) == 0``); keys of another length than the queries are laid out contiguously.
    """
    _check_cp_mesh(device_mesh, "_create_cp_block_mask")
    world_size = device_mesh.size()
    balancer = load_balancer or _create_default_load_balancer(Q_LEN, world_size, device_mesh.device_type)
    rows = _rows_for_balancer(balancer, Q_LEN, world_size)
    kv_rows = rows if KV_LEN == Q_LEN else (contiguous_layout(KV_LEN, world_size),)
    return cp_block_mask(mask_mod, B, H, rows, kv_rows, device_mesh.get_local_rank(0), device_mesh.device_type, DEFAULT_BLOCK_SIZE)

