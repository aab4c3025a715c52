"""Context parallelism (mirrors ``torch.distributed.tensor.experimental._attention``).

``context_parallel(mesh, buffers=..., buffer_seq_dims=...)`` shards the given buffers in place along
their sequence dims and, while it is open, runs ``F.scaled_dot_product_attention`` as ring attention
over the mesh (``_cp_ring``).  How SDPA is intercepted: a ``TorchFunctionMode`` pushed for the
duration of the context sees the call before any kernel is chosen, so the CPU flash kernel, the math
path and the CUDA kernels all take the same way, and autograd sees one differentiable ring call.

Which positions each rank holds is one :class:`~._cp_layout.SequenceLayout`, chosen when the buffers
are sharded (head-tail balanced by default, any length) and read again by the attention inside the
context and by :func:`context_parallel_unshard`.  Plain tensors seen by SDPA in the context are
this rank's pieces of that layout (a length that is not this rank's share of it is taken as an even
share of ``local length * W``).  DTensors whose query is ``Shard(2)`` on one mesh dim are ring-
attended over that mesh dim, so context parallelism composes with tensor parallelism on a 2-D mesh.

Errors about the arguments are raised on every rank before any collective, and the buffers are put
back as they were.

Under torch's ``LocalTensorMode`` (every rank simulated in one process) the buffers are
``LocalTensor``s and the mesh answers every rank's coordinate at once: what depends on the rank
(the piece a rank keeps, the layout its local length stands for) runs once per simulated rank
(``_cp_ring.on_each_rank``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from enum import Enum, auto
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from shardwise.mesh import DeviceMesh
from shardwise.placement import Placement, Shard

from .. import _collectives
from .._dtensor import DTensor
from .._op_handlers import register_op_handler, unregister_op_handler
from ._cp_flex import DEFAULT_BLOCK_SIZE, MaskMod, cp_block_mask, flex_cp_allgather, gather_key_value, gather_rows, padded_rows
from ._cp_kernels import choose_kernel, kernel_by_name
from ._cp_layout import (
    SequenceLayout,
    _HeadTailLoadBalancer,
    _LoadBalancer,
    _PerDocumentHeadTailLoadBalancer,
    _PTRRLoadBalancer,
    contiguous_layout,
    head_tail_layout,
    one_layout,
    record_layouts,
    recorded_layouts,
)
from ._cp_ring import RingSpec, on_each_rank, ring_attention, ring_backward, ring_forward
from ._cp_ulysses import ulysses_attention

__all__ = [
    "_CausalBehavior",
    "_context_parallel_shard",
    "_ContextParallel",
    "_cp_options",
    "_create_cp_block_mask",
    "_create_default_load_balancer",
    "_disable_context_parallel_dispatcher",
    "_enable_context_parallel_dispatcher",
    "_is_causal_behavior",
    "_RotateMethod",
    "_HeadTailLoadBalancer",
    "_LoadBalancer",
    "_PerDocumentHeadTailLoadBalancer",
    "_PTRRLoadBalancer",
    "context_parallel",
    "context_parallel_unshard",
    "set_rotate_method",
    # PyTorch's _context_parallel._attention (this module, at that path too) imports it for flex attention.
    "flex_cp_allgather",
]

SDPA_SEQ_DIM = 2  # F.scaled_dot_product_attention's inputs are (batch, heads, seq, head_dim)


class _CausalBehavior(Enum):
    SKIP = None
    NOT_IS_CAUSAL = False
    IS_CAUSAL = True


class _RotateMethod(Enum):
    ALL_TO_ALL = auto()
    ALL_GATHER = auto()
    # Beyond PyTorch: no ring; all-to-all from sequence- to head-sharded, local attention, and back.
    ULYSSES = auto()


_ROTATE_METHOD_NAMES = {_RotateMethod.ALL_TO_ALL: "alltoall", _RotateMethod.ALL_GATHER: "allgather", _RotateMethod.ULYSSES: "ulysses"}


@dataclass
class _ContextParallelOptions:
    # Partial results are always merged in float32; kept for code that sets it.
    convert_to_f32: bool = True
    enable_load_balance: bool = True
    rotate_method: _RotateMethod = _RotateMethod.ALL_GATHER


_cp_options = _ContextParallelOptions()


def set_rotate_method(rotate_method: str) -> None:
    """How attention crosses ranks: ``"allgather"`` (key/value blocks gathered once, the default),
    ``"alltoall"`` (key/value blocks handed around a ring) or ``"ulysses"`` (beyond PyTorch: one all-to-all
    from sequence- to head-sharded, attention on whole sequences of ``heads / W`` heads, one all-to-all
    back; needs query and key/value heads divisible by the mesh size)."""
    for method, name in _ROTATE_METHOD_NAMES.items():
        if rotate_method == name:
            _cp_options.rotate_method = method
            return
    raise NotImplementedError(
        f"Context Parallel does not support using {rotate_method!r} for kv shards rotation; "
        f"expected one of {sorted(_ROTATE_METHOD_NAMES.values())}"
    )


def _is_causal_behavior(rank: int, world_size: int, i: int, is_causal: bool) -> _CausalBehavior:
    """What step ``i`` of a causal ring computes on ``rank`` (PyTorch's contract, for its even layouts)."""
    if not is_causal:
        return _CausalBehavior.NOT_IS_CAUSAL
    if i == 0:
        return _CausalBehavior.IS_CAUSAL
    source = (rank - i) % world_size
    if source < rank or _cp_options.enable_load_balance:
        return _CausalBehavior.NOT_IS_CAUSAL
    return _CausalBehavior.SKIP


def _create_default_load_balancer(
    seq_length: int, world_size: int, device: str | torch.device
) -> _LoadBalancer | None:
    """Head-tail when load balancing is on (any length here; PyTorch's needs ``seq_length % 2W == 0``)."""
    if _cp_options.enable_load_balance:
        return _HeadTailLoadBalancer(seq_length, world_size, device)
    return None


def _default_layout(global_length: int, world_size: int) -> SequenceLayout:
    if _cp_options.enable_load_balance:
        return head_tail_layout(global_length, world_size)
    return contiguous_layout(global_length, world_size)


def _record_layouts(rows: tuple[SequenceLayout, ...]) -> None:
    record_layouts(rows)  # per thread (_cp_layout)


def _rows_of_local_length(local_length: int, rank: int, world_size: int) -> tuple[SequenceLayout, ...]:
    """The recorded layouts when this rank's share of them is ``local_length`` tokens, else the default layout.

    The same answer on every rank.
    """
    rows: tuple[SequenceLayout, ...] = on_each_rank(rank, _rows_of_rank_length, local_length, world_size)
    return rows


def _rows_of_rank_length(rank: int, local_length: int, world_size: int) -> tuple[SequenceLayout, ...]:
    recorded = recorded_layouts()
    if recorded is not None and recorded[0].world_size == world_size and recorded[0].local_length(rank) == local_length:
        return recorded
    return (_default_layout(local_length * world_size, world_size),)


def _layout_of_local_length(local_length: int, rank: int, world_size: int) -> SequenceLayout:
    """The one layout whose share on ``rank`` is ``local_length`` tokens (refused when rows were rearranged apart)."""
    return one_layout(_rows_of_local_length(local_length, rank, world_size), "the load balancer the buffers were sharded with")


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


# -- attention inside the context ---------------------------------------------------------------------------

SdpaArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", float, bool, "float | None", bool]


def _sdpa_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> SdpaArgs:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    bound = dict(defaults)
    bound.update(zip(names, args))
    unknown = set(kwargs) - set(names)
    if unknown:
        raise TypeError(f"scaled_dot_product_attention() got unexpected keyword arguments {sorted(unknown)}")
    bound.update(kwargs)
    missing = [name for name in names[:3] if name not in bound]
    if missing:
        raise TypeError(f"scaled_dot_product_attention() missing arguments {missing}")
    return (
        bound["query"],
        bound["key"],
        bound["value"],
        bound["attn_mask"],
        float(bound["dropout_p"]),
        bool(bound["is_causal"]),
        bound["scale"],
        bool(bound["enable_gqa"]),
    )


def _ring_spec(
    group_name: str,
    rank: int,
    world_size: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_layout: SequenceLayout,
    kv_layout: SequenceLayout,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> RingSpec:
    """Check one attention call (locally, the same verdict on every rank) and describe its ring."""
    where = "context parallel scaled_dot_product_attention"
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.dim() != 4:
            raise ValueError(f"{where} takes (batch, heads, seq, head_dim) tensors; {name} has shape {tuple(tensor.shape)}")
    if attn_mask is not None:
        raise ValueError(
            f"{where}: attn_mask is not supported (a mask over the whole sequence cannot be cut per ring step); "
            "use is_causal=True for causal attention"
        )
    if dropout_p != 0.0:
        raise ValueError(f"{where}: dropout_p={dropout_p} is not supported (expected 0.0)")
    if query.shape[0] != key.shape[0] or key.shape[0] != value.shape[0]:
        raise ValueError(f"{where}: batch sizes differ: query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2]:
        raise ValueError(f"{where}: key {tuple(key.shape)} and value {tuple(value.shape)} must agree in heads and sequence")
    if query.shape[3] != key.shape[3]:
        raise ValueError(f"{where}: query head dim {query.shape[3]} differs from key head dim {key.shape[3]}")
    query_heads, kv_heads = query.shape[1], key.shape[1]
    if query_heads != kv_heads and not (enable_gqa and kv_heads > 0 and query_heads % kv_heads == 0):
        raise ValueError(
            f"{where}: {query_heads} query heads against {kv_heads} key/value heads; expected equal heads, or "
            "enable_gqa=True with query heads a multiple of key/value heads"
        )
    if is_causal and query_layout.global_length != kv_layout.global_length:
        raise ValueError(
            f"{where}: is_causal=True needs as many queries as keys; the sequences have {query_layout.global_length} "
            f"queries and {kv_layout.global_length} keys (across {world_size} ranks)"
        )
    if is_causal and query_layout != kv_layout:
        raise ValueError(f"{where}: is_causal=True needs queries and keys laid out alike over the ranks")
    if _cp_options.rotate_method == _RotateMethod.ULYSSES:
        if query_heads % world_size or kv_heads % world_size:
            raise ValueError(
                f"{where} with set_rotate_method('ulysses'): {query_heads} query and {kv_heads} key/value heads must both "
                f"divide by the {world_size} context-parallel ranks (each rank attends heads / {world_size} heads); "
                "use 'alltoall' or 'allgather' otherwise"
            )
        if query_layout != kv_layout:
            raise ValueError(f"{where} with set_rotate_method('ulysses'): queries and keys must have the same length")
    resolved_scale = float(scale) if scale is not None else 1.0 / math.sqrt(query.shape[3])
    return RingSpec(
        group_name=group_name,
        rank=rank,
        world_size=world_size,
        query_layout=query_layout,
        kv_layout=kv_layout,
        is_causal=is_causal,
        scale=resolved_scale,
        query_heads_per_kv_head=query_heads // kv_heads,
        kernel=choose_kernel(
            query, key, value, is_causal, resolved_scale, max(query_layout.local_lengths()), max(kv_layout.local_lengths())
        ),
        rotate_method=_ROTATE_METHOD_NAMES[_cp_options.rotate_method],
    )


def _plain_tensor_attention(mesh: DeviceMesh, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_arguments(args, kwargs)
    world_size = mesh.size()
    rank = mesh.get_local_rank(0)
    if query.dim() == 4 and key.dim() == 4:
        query_layout = _layout_of_local_length(query.shape[SDPA_SEQ_DIM], rank, world_size)
        kv_layout = (
            query_layout
            if key.shape[SDPA_SEQ_DIM] == query.shape[SDPA_SEQ_DIM]
            else _layout_of_local_length(key.shape[SDPA_SEQ_DIM], rank, world_size)
        )
    else:
        query_layout = kv_layout = contiguous_layout(0, world_size)  # _ring_spec refuses the shapes
    spec = _ring_spec(
        _collectives.mesh_dim_group_name(mesh, 0), rank, world_size, query, key, value,
        query_layout, kv_layout, attn_mask, dropout_p, is_causal, scale, enable_gqa,
    )  # fmt: skip
    return _attend(spec, query, key, value)


def _attend(spec: RingSpec, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if spec.rotate_method == "ulysses":
        return ulysses_attention(
            spec.group_name, spec.rank, spec.world_size, spec.query_layout, query, key, value, spec.is_causal, spec.scale
        )
    return ring_attention(spec, query, key, value)


def _dtensor_layout(global_length: int, world_size: int) -> SequenceLayout:
    # A DTensor's Shard(2) is torch.chunk's layout of its (possibly head-tail permuted) sequence: the two
    # agree when 2W divides the length, which is when a permuted sequence is taken as head-tail balanced.
    if _cp_options.enable_load_balance and global_length % (2 * world_size) == 0:
        return head_tail_layout(global_length, world_size)
    return contiguous_layout(global_length, world_size)


def _check_inputs_laid_out_as_query(where: str, query: Any, key: Any, value: Any) -> None:
    """Context-parallel attention needs key and value laid out as the query, on its mesh, and nothing Partial."""
    mesh = query.device_mesh
    for name, tensor in (("key", key), ("value", value)):
        if tensor.device_mesh != mesh or tuple(tensor.placements) != tuple(query.placements):
            raise ValueError(
                f"{where}: {name} is laid out as {tuple(tensor.placements)} on {tensor.device_mesh}; expected the query's "
                f"{tuple(query.placements)} on {mesh}"
            )
    if any(placement.is_partial() for placement in query.placements):
        raise ValueError(f"{where}: Partial inputs {tuple(query.placements)} must be reduced first")


def _context_parallel_mesh_dim(placements: Sequence[Placement]) -> int | None:
    found = [dim for dim, placement in enumerate(placements) if isinstance(placement, Shard) and placement.dim % 4 == SDPA_SEQ_DIM]
    return found[0] if len(found) == 1 else None


def _dtensor_attention(args: tuple[Any, ...], kwargs: dict[str, Any], defer_to_dispatch: bool = False) -> torch.Tensor | None:
    """Ring attention over the mesh dim that shards the query's sequence; None when no mesh dim does.

    ``defer_to_dispatch`` (the dispatcher's mode): None also when SDPA itself would reach a kernel whose
    DTensor op the dispatcher takes (:func:`_dispatch_level_kernel`), so the forward takes the one way a
    recomputation (activation checkpointing, in the backward where this mode is off) takes too.
    """
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_arguments(args, kwargs)
    where = "context parallel scaled_dot_product_attention on DTensors"
    if not (isinstance(query, DTensor) and isinstance(key, DTensor) and isinstance(value, DTensor)):
        raise TypeError(f"{where}: query, key and value must all be DTensors or all plain tensors")
    if query.dim() != 4:
        raise ValueError(f"{where} takes (batch, heads, seq, head_dim) tensors; query has shape {tuple(query.shape)}")
    cp_dim = _context_parallel_mesh_dim(query.placements)
    if cp_dim is None:
        return None
    mesh = query.device_mesh
    _check_inputs_laid_out_as_query(where, query, key, value)
    world_size = mesh.size(cp_dim)
    query_layout = _dtensor_layout(query.shape[SDPA_SEQ_DIM], world_size)
    kv_layout = query_layout if key.shape[SDPA_SEQ_DIM] == query.shape[SDPA_SEQ_DIM] else _dtensor_layout(key.shape[SDPA_SEQ_DIM], world_size)
    if defer_to_dispatch and _dispatch_level_kernel(mesh, cp_dim, query, key, value, query_layout, kv_layout, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return None
    local_query, local_key, local_value = query.to_local(), key.to_local(), value.to_local()
    spec = _ring_spec(
        _collectives.mesh_dim_group_name(mesh, cp_dim), mesh.get_local_rank(cp_dim), world_size,
        local_query, local_key, local_value, query_layout, kv_layout, attn_mask, dropout_p, is_causal, scale, enable_gqa,
    )  # fmt: skip
    local_out = _attend(spec, local_query, local_key, local_value)
    global_shape = (*query.shape[:3], value.shape[3])
    return DTensor.from_local(
        local_out, mesh, query.placements, run_check=False, shape=global_shape,
        stride=torch.empty(global_shape, device="meta").stride(),
    )  # fmt: skip


class _ContextParallelAttentionMode(TorchFunctionMode):
    """Runs ``F.scaled_dot_product_attention`` as ring attention.

    With a mesh, plain tensors are this rank's pieces along the mesh's one dim; DTensors (with or
    without a mesh here) use the mesh dim that shards their sequence.  Everything else runs as usual.
    """

    def __init__(self, mesh: DeviceMesh | None) -> None:
        super().__init__()
        self._mesh = mesh

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            if any(isinstance(arg, DTensor) for arg in (*args, *kwargs.values())):
                result = _dtensor_attention(args, kwargs, defer_to_dispatch=self._mesh is None)
                if result is not None:
                    return result
            elif self._mesh is not None:
                return _plain_tensor_attention(self._mesh, args, kwargs)
        return func(*args, **kwargs)


_active_context: list[DeviceMesh] = []


@contextlib.contextmanager
def context_parallel(
    mesh: DeviceMesh,
    *,
    buffers: Sequence[torch.Tensor] | None = None,
    buffer_seq_dims: Sequence[int] | None = None,
    no_restore_buffers: set[torch.Tensor] | None = None,
) -> Iterator[None]:
    """Shard ``buffers`` in place along ``buffer_seq_dims`` over the 1-D ``mesh`` and run SDPA as ring attention.

    The buffers are rearranged by the default load balancer (head-tail while
    ``_cp_options.enable_load_balance``, the default; any length) and each rank keeps its share.
    On exit every buffer not in ``no_restore_buffers`` gets its original shape and values back,
    also when the block raised.  Buffers must not require grad while they are resized (set
    ``requires_grad`` inside the context).  Contexts do not nest.
    """
    buffer_list = list(buffers) if buffers is not None else []
    seq_dims = list(buffer_seq_dims) if buffer_seq_dims is not None else []
    not_restored = list(no_restore_buffers) if no_restore_buffers is not None else []
    _check_cp_mesh(mesh, "context_parallel")
    if _active_context:
        raise RuntimeError(
            f"context_parallel contexts cannot be nested: one is already open on {_active_context[-1]}; "
            "close it before opening another"
        )
    normalized = _normalized_seq_dims(buffer_list, seq_dims, "context_parallel")
    for buffer in not_restored:
        if not any(buffer is candidate for candidate in buffer_list):
            raise ValueError("`no_restore_buffers` must be a subset of `buffers`.")
    for index, buffer in enumerate(buffer_list):
        if buffer.requires_grad:
            raise ValueError(
                f"context_parallel: buffer {index} {tuple(buffer.shape)} requires grad and cannot be resized in place; "
                "pass it with requires_grad=False and set requires_grad inside the context"
            )
        if any(other is buffer for other in buffer_list[:index]):
            raise ValueError(f"context_parallel: buffer {index} is given twice")
    world_size = mesh.size()
    rank = mesh.get_local_rank(0)
    layout = _default_layout(buffer_list[0].shape[normalized[0]], world_size) if buffer_list else None
    originals = [None if any(buffer is kept for kept in not_restored) else buffer.clone() for buffer in buffer_list]
    mode = _ContextParallelAttentionMode(mesh)
    _active_context.append(mesh)
    try:
        if layout is not None:
            with torch.no_grad():
                for buffer, dim in zip(buffer_list, normalized):
                    piece = _shard(buffer, dim, layout, rank)
                    buffer.resize_(piece.shape)
                    buffer.copy_(piece)
            _record_layouts((layout,))
        with mode:
            yield
    finally:
        _active_context.pop()
        with torch.no_grad():
            for buffer, original in zip(buffer_list, originals):
                if original is not None:
                    # A buffer made to require grad inside the context is a leaf (it had no history at
                    # entry): resize it with the flag off and put the flag back.  Its .grad is left as is.
                    wanted_grad = buffer.requires_grad
                    buffer.requires_grad_(False)
                    buffer.resize_(original.shape)
                    buffer.copy_(original)
                    buffer.requires_grad_(wanted_grad)


# -- the module style and the dispatcher switch ---------------------------------------------------------------


class _ContextParallel:
    """Context parallelism inside one attention module's forward (PyTorch's ``_ContextParallel`` ParallelStyle).

    Apply it with ``parallelize_module(module, cp_mesh, _ContextParallel(seq_dim=2, attention_type=...))``
    (``shardwise.tp_styles`` counts it as a ``ParallelStyle``):

    * ``AttentionType.SDPA``: during the module's forward, SDPA on plain tensors is ring attention over
      the mesh, with the layout of the last ``_context_parallel_shard``; DTensor inputs sharded on
      their sequence dim are ring-attended too.
    * ``AttentionType.FLEX``: the module is called as ``flex_attention`` is, ``(query, key, value, ...)``
      with this rank's pieces; before its forward, key and value become the whole sequence in layout
      order (one all-gather; one reduce-scatter of their gradients in backward), so the module's
      ``flex_attention`` with the ``BlockMask`` from ``_context_parallel_shard`` (or
      ``_create_cp_block_mask``) computes this rank's rows exactly.
    """

    class AttentionType(Enum):
        FLEX = "flex_attention"
        SDPA = "scaled_dot_product_attention"

    src_data_rank: int | None = 0

    def __init__(self, seq_dim: int, attention_type: _ContextParallel.AttentionType) -> None:
        if not isinstance(attention_type, self.AttentionType):
            raise ValueError(f"_ContextParallel: unknown attention type {attention_type!r}; expected one of {list(self.AttentionType)}")
        if seq_dim % 4 != SDPA_SEQ_DIM:
            raise ValueError(
                f"_ContextParallel: the sequence dim of (batch, heads, seq, head_dim) attention inputs is {SDPA_SEQ_DIM}; got {seq_dim}"
            )
        self.seq_dim = seq_dim
        self.attention_type = attention_type

    def _check_module(self, module: nn.Module, module_path: str | None) -> None:
        """Any module may hold attention calls: nothing to refuse."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_cp_mesh(device_mesh, "_ContextParallel")
        if self.attention_type is self.AttentionType.FLEX:
            module.register_forward_pre_hook(_FlexKeyValueGather(device_mesh, self.seq_dim % 4), with_kwargs=True)
            return module
        hooks = _RingAttentionDuringForward(device_mesh)
        module.register_forward_pre_hook(hooks.enter)
        module.register_forward_hook(hooks.leave, always_call=True)
        return module

    def _apply_at(self, module: nn.Module, device_mesh: DeviceMesh, module_path: str | None) -> nn.Module:
        """What ``shardwise.tp_styles.parallelize_module`` calls (it registers this class as a ParallelStyle)."""
        return self._apply(module, device_mesh)


class _FlexKeyValueGather:
    """A forward pre-hook: the module's ``key``/``value`` arguments become every rank's pieces in layout order."""

    ARGUMENT_NAMES = ("query", "key", "value")

    def __init__(self, mesh: DeviceMesh, seq_dim: int) -> None:
        self.mesh = mesh
        self.seq_dim = seq_dim

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        bound = dict(zip(self.ARGUMENT_NAMES, args))
        bound.update({name: kwargs[name] for name in self.ARGUMENT_NAMES if name in kwargs})
        missing = [name for name in self.ARGUMENT_NAMES if not isinstance(bound.get(name), torch.Tensor)]
        if missing:
            raise TypeError(
                f"_ContextParallel(FLEX) calls the module as flex_attention(query, key, value, ...); {missing} are not tensors "
                f"(got {type(module).__name__} called with {len(args)} positional and {sorted(kwargs)} keyword arguments)"
            )
        query, key, value = (bound[name] for name in self.ARGUMENT_NAMES)
        if isinstance(query, DTensor) or isinstance(key, DTensor) or isinstance(value, DTensor):
            raise TypeError("_ContextParallel(FLEX) takes this rank's pieces as plain tensors, not DTensors")
        world_size = self.mesh.size()
        rank = self.mesh.get_local_rank(0)
        key_layout = _rows_of_local_length(key.shape[self.seq_dim], rank, world_size)[0]
        gathered_key, gathered_value = gather_key_value(
            key, value, self.seq_dim, _collectives.mesh_dim_group_name(self.mesh, 0), key_layout.local_lengths()
        )
        replaced = {"key": gathered_key, "value": gathered_value}
        new_args = list(args)
        for index, name in enumerate(self.ARGUMENT_NAMES[: len(args)]):
            new_args[index] = replaced.get(name, new_args[index])
        new_kwargs = {name: replaced.get(name, arg) for name, arg in kwargs.items()}
        return tuple(new_args), new_kwargs


class _RingAttentionDuringForward:
    """Forward hooks that hold a ring-attention mode open for the module's forward (a class: modules stay deep-copyable)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.open_modes: list[_ContextParallelAttentionMode] = []

    def enter(self, module: nn.Module, args: Any) -> None:
        mode = _ContextParallelAttentionMode(self.mesh)
        mode.__enter__()
        self.open_modes.append(mode)

    def leave(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.open_modes:
            self.open_modes.pop().__exit__(None, None, None)
        return output


_dispatcher_modes: list[_ContextParallelAttentionMode] = []


def _enable_context_parallel_dispatcher() -> None:
    """From now on SDPA on DTensors whose sequence dim is sharded runs as ring attention (until disabled).

    Two ways in, as one: a ``TorchFunctionMode`` takes ``F.scaled_dot_product_attention`` calls, and, like
    PyTorch's dispatcher, handlers of the CPU flash kernel's DTensor ops (forward and backward) take the
    kernel calls.  The handlers are what a call reaches where the mode is off: a ``TorchFunctionMode`` is
    off while it handles a call, so inside ``loss.backward()`` (which the mode sees) an activation-
    checkpointed block is recomputed without it.  The mode hands such calls to the handlers in the forward
    too, so the forward and its recomputation record the same autograd graph.
    """
    mode = _ContextParallelAttentionMode(None)
    mode.__enter__()
    _dispatcher_modes.append(mode)
    register_op_handler(_FLASH_CPU, _ring_flash_cpu_forward)
    register_op_handler(_FLASH_CPU_BACKWARD, _ring_flash_cpu_backward)


def _disable_context_parallel_dispatcher() -> None:
    """Undo the most recent :func:`_enable_context_parallel_dispatcher` (nothing if none is on)."""
    if _dispatcher_modes:
        _dispatcher_modes.pop().__exit__(None, None, None)
        unregister_op_handler(_FLASH_CPU, _ring_flash_cpu_forward)
        unregister_op_handler(_FLASH_CPU_BACKWARD, _ring_flash_cpu_backward)


# -- the dispatcher at the DTensor op level: the CPU flash kernel's forward and backward ----------------------

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _dispatch_level_kernel(
    mesh: DeviceMesh,
    cp_dim: int,
    query: DTensor,
    key: DTensor,
    value: DTensor,
    query_layout: SequenceLayout,
    kv_layout: SequenceLayout,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> bool:
    """Whether this (checked) DTensor SDPA call reaches the CPU flash kernel, whose DTensor ops the dispatcher handles."""
    if query.device.type != "cpu" or _cp_options.rotate_method == _RotateMethod.ULYSSES:
        return False
    if attn_mask is not None or dropout_p != 0.0 or query.shape[1] != key.shape[1]:
        return False  # SDPA's decomposition or a refusal: the mode's own ring says which
    if not isinstance(mesh.get_local_rank(cp_dim), int):
        return False  # every rank simulated in one process (LocalTensorMode): the mode's ring runs per rank
    # Asked without the dispatch modes (activation checkpointing's among them): the recomputation asks nothing.
    with _disable_current_modes():
        spec = _ring_spec(
            _collectives.mesh_dim_group_name(mesh, cp_dim), mesh.get_local_rank(cp_dim), mesh.size(cp_dim),
            query._local_tensor, key._local_tensor, value._local_tensor, query_layout, kv_layout,
            attn_mask, dropout_p, is_causal, scale, enable_gqa,
        )  # fmt: skip
    return spec.kernel.name == "flash_cpu"


def _sequence_sharded(query: Any, key: Any, value: Any) -> tuple[DeviceMesh, int] | None:
    """The mesh and mesh dim sharding these DTensors' sequence dim, or None when the call is not the ring's."""
    if not all(isinstance(tensor, DTensor) for tensor in (query, key, value)) or query.dim() != 4:
        return None
    cp_dim = _context_parallel_mesh_dim(query.placements)
    if cp_dim is None:
        return None
    mesh = query.device_mesh
    where = "context parallel scaled_dot_product_attention on DTensors"
    _check_inputs_laid_out_as_query(where, query, key, value)
    if any(isinstance(placement, Shard) and placement.dim % 4 == 3 for placement in query.placements):
        return None  # a cut head dim: the kernel's sharding rule decides
    return mesh, cp_dim


def _op_ring_spec(
    mesh: DeviceMesh, cp_dim: int, query: DTensor, key: DTensor, value: DTensor, is_causal: bool, scale: float | None
) -> RingSpec:
    world_size = mesh.size(cp_dim)
    query_layout = _dtensor_layout(query.shape[SDPA_SEQ_DIM], world_size)
    kv_layout = query_layout if key.shape[SDPA_SEQ_DIM] == query.shape[SDPA_SEQ_DIM] else _dtensor_layout(key.shape[SDPA_SEQ_DIM], world_size)
    if _cp_options.rotate_method == _RotateMethod.ULYSSES:
        raise NotImplementedError(
            "context parallel dispatcher: set_rotate_method('ulysses') runs through F.scaled_dot_product_attention "
            "inside the dispatcher's mode only; its CPU flash kernel ops (reached in a backward-time recomputation) "
            "take 'allgather' or 'alltoall'"
        )
    spec = _ring_spec(
        _collectives.mesh_dim_group_name(mesh, cp_dim), mesh.get_local_rank(cp_dim), world_size,
        query._local_tensor, key._local_tensor, value._local_tensor, query_layout, kv_layout,
        None, 0.0, is_causal, scale, query.shape[1] != key.shape[1],
    )  # fmt: skip
    # The kernel is the op's: the local tensors' own choice may differ (they do not require grad here).
    return replace(spec, kernel=kernel_by_name("flash_cpu"))


def _like(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]) -> DTensor:
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=tuple(shape), stride=torch.empty(tuple(shape), device="meta").stride()
    )


def _in_layout(tensor: DTensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    if tuple(tensor.placements) != tuple(placements):
        tensor = tensor.redistribute(mesh, placements)
    return tensor._local_tensor


def _flash_cpu_arguments(args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    bound: dict[str, Any] = {"dropout_p": 0.0, "is_causal": False, "attn_mask": None, "scale": None}
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


def _ring_flash_cpu_forward(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_scaled_dot_product_flash_attention_for_cpu`` on sequence-sharded DTensors: the ring's output and log-sum-exp."""
    bound = _flash_cpu_arguments(args, kwargs, ("query", "key", "value", "dropout_p", "is_causal"))
    query, key, value = bound["query"], bound["key"], bound["value"]
    found = _sequence_sharded(query, key, value)
    if found is None or bound["attn_mask"] is not None or float(bound["dropout_p"]) != 0.0:
        return NotImplemented
    mesh, cp_dim = found
    spec = _op_ring_spec(mesh, cp_dim, query, key, value, bool(bound["is_causal"]), bound["scale"])
    local_out, local_lse = ring_forward(spec, query._local_tensor, key._local_tensor, value._local_tensor)
    batch, heads, q_len = query.shape[:3]
    placements = tuple(query.placements)
    return (
        _like(local_out, mesh, placements, (batch, heads, q_len, value.shape[3])),
        _like(local_lse, mesh, placements, (batch, heads, q_len)),
    )


def _ring_flash_cpu_backward(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_scaled_dot_product_flash_attention_for_cpu_backward`` on sequence-sharded DTensors: the ring's gradients."""
    names = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")
    bound = _flash_cpu_arguments(args, kwargs, names)
    query, key, value = bound["query"], bound["key"], bound["value"]
    found = _sequence_sharded(query, key, value)
    if found is None or bound["attn_mask"] is not None or float(bound["dropout_p"]) != 0.0:
        return NotImplemented
    if not all(isinstance(bound[name], DTensor) for name in ("grad_out", "out", "logsumexp")):
        return NotImplemented
    mesh, cp_dim = found
    placements = tuple(query.placements)
    spec = _op_ring_spec(mesh, cp_dim, query, key, value, bool(bound["is_causal"]), bound["scale"])
    grad_query, grad_key, grad_value = ring_backward(
        spec,
        _in_layout(bound["grad_out"], mesh, placements),
        query._local_tensor,
        key._local_tensor,
        value._local_tensor,
        _in_layout(bound["out"], mesh, placements),
        _in_layout(bound["logsumexp"], mesh, placements),
    )
    return (
        _like(grad_query, mesh, placements, query.shape),
        _like(grad_key, mesh, placements, key.shape),
        _like(grad_value, mesh, placements, value.shape),
    )
