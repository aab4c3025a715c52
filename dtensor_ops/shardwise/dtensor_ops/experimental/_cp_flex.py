"""flex_attention under context parallelism: this rank's queries against the whole key/value sequence.

Two pieces, as PyTorch's flex context parallelism has them, written over :class:`SequenceLayout`:

* :func:`cp_block_mask` turns a ``mask_mod`` over global positions into a ``BlockMask`` for this rank's
  queries (in its local order) against every rank's keys in layout order (rank 0's piece, then rank
  1's, ...), so a load balancer's permutation, per batch row if it has rows, is read by the mask
  itself.  Any lengths: the layout's uneven pieces and ``create_block_mask``'s own padding of a
  partial last block (PyTorch's needs ``Q_LEN % (W * 128) == 0``).
* :func:`gather_key_value` hands every rank the whole key and value sequence in layout order: key and
  value travel together, padded to the widest piece, in ONE all-gather; the backward returns each
  rank its summed gradient pieces with ONE reduce-scatter (PyTorch's: two of each).

``flex_attention(query, gathered_key, gathered_value, block_mask=cp_mask)`` then computes this rank's
rows of the global attention exactly; no log-sum-exp merging is needed.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, cast

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE, BlockMask, create_block_mask

from .. import _collectives
from ._cp_layout import SequenceLayout

__all__ = ["cp_block_mask", "gather_key_value", "gather_rows", "padded_rows", "sum_scatter_rows", "flex_cp_allgather", "DEFAULT_BLOCK_SIZE"]

DEFAULT_BLOCK_SIZE = _DEFAULT_SPARSE_BLOCK_SIZE

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _positions_of_rank(layout: SequenceLayout, rank: int) -> list[int]:
    return [position for start, stop in layout.segments[rank] for position in range(start, stop)]


def cp_block_mask(
    mask_mod: MaskMod,
    batch: int | None,
    heads: int | None,
    query_rows: Sequence[SequenceLayout],
    kv_rows: Sequence[SequenceLayout],
    rank: int,
    device: str | torch.device,
    block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
) -> BlockMask:
    """This rank's ``BlockMask``: its queries in local order, every key in layout order, ``mask_mod`` on global positions.

    ``query_rows``/``kv_rows`` hold one layout, or one per batch row (then ``batch`` must equal their
    number); every row must give this rank as many queries as the others do.
    """
    rows = max(len(query_rows), len(kv_rows))
    for name, layouts in (("query", query_rows), ("key/value", kv_rows)):
        if len(layouts) not in (1, rows):
            raise ValueError(f"context parallel block mask: {len(layouts)} {name} layouts for {rows} batch rows")
    if rows > 1 and batch != rows:
        raise ValueError(f"context parallel block mask: the load balancer rearranges {rows} batch rows; the mask has batch {batch}")
    query_lengths = {layout.local_length(rank) for layout in query_rows}
    if len(query_lengths) != 1:
        raise ValueError(
            f"context parallel block mask: rank {rank} would hold {sorted(query_lengths)} queries in different batch rows; "
            "every row must give a rank the same number of tokens"
        )
    query_positions = torch.tensor([_positions_of_rank(layout, rank) for layout in query_rows], dtype=torch.long, device=device)
    kv_order = torch.tensor([layout.order() for layout in kv_rows], dtype=torch.long, device=device)
    per_row_queries, per_row_keys = len(query_rows) > 1, len(kv_rows) > 1

    def local_mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        q_position = query_positions[b, q_idx] if per_row_queries else query_positions[0, q_idx]
        kv_position = kv_order[b, kv_idx] if per_row_keys else kv_order[0, kv_idx]
        return mask_mod(b, h, q_position, kv_position)

    return create_block_mask(
        local_mask_mod,
        batch,
        heads,
        query_lengths.pop(),
        kv_rows[0].global_length,
        device=device,
        BLOCK_SIZE=block_size,
    )


def _pack_rows(key: torch.Tensor, value: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """Key and value side by side as ``(seq, key features + value features)``."""
    key_rows = key.movedim(seq_dim, 0).reshape(key.size(seq_dim), -1)
    value_rows = value.movedim(seq_dim, 0).reshape(value.size(seq_dim), -1)
    return torch.cat([key_rows, value_rows], dim=1)


def _rest_of(shape: torch.Size, seq_dim: int) -> tuple[int, ...]:
    """``shape`` without its sequence dim, in the order ``movedim(seq_dim, 0)`` leaves the others."""
    return tuple(shape[:seq_dim]) + tuple(shape[seq_dim + 1 :])


def _unpack_rows(
    rows: torch.Tensor, key_rest: tuple[int, ...], value_rest: tuple[int, ...], seq_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`_pack_rows` for ``rows.size(0)`` tokens."""
    key_features = 1
    for extent in key_rest:
        key_features *= extent
    key = rows[:, :key_features].reshape(rows.size(0), *key_rest).movedim(0, seq_dim)
    value = rows[:, key_features:].reshape(rows.size(0), *value_rest).movedim(0, seq_dim)
    return key, value


def padded_rows(rows: torch.Tensor, widest: int) -> torch.Tensor:
    """``rows`` zero-padded along dim 0 to ``widest`` (any number of trailing dims)."""
    extra = widest - rows.size(0)
    return F.pad(rows, (0, 0) * (rows.dim() - 1) + (0, extra)) if extra > 0 else rows


def gather_rows(padded: torch.Tensor, lengths: Sequence[int], group_name: str) -> torch.Tensor:
    """Every rank's rows along dim 0, in rank order, each trimmed to its length (``padded``: this rank's
    rows padded to ``max(lengths)``): one all-gather."""
    widest = max(lengths)
    gathered = _collectives.wait(_collectives.launch_all_gather(padded.contiguous(), len(lengths), group_name))
    pieces = [gathered[rank * widest : rank * widest + length] for rank, length in enumerate(lengths)]
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def sum_scatter_rows(rows: torch.Tensor, lengths: Sequence[int], group_name: str) -> torch.Tensor:
    """The inverse of :func:`gather_rows` for gradients: rank ``r`` gets the sum over ranks of rows
    ``[offset_r, offset_r + lengths[r])`` (padded to the widest): one reduce-scatter."""
    widest = max(lengths)
    offsets = [sum(lengths[:rank]) for rank in range(len(lengths))]
    blocks = [padded_rows(rows[offset : offset + length], widest) for offset, length in zip(offsets, lengths)]
    return _collectives.wait(_collectives.launch_reduce_scatter(torch.cat(blocks).contiguous(), "sum", len(lengths), group_name))


class _GatherKeyValue(torch.autograd.Function):
    """Forward: one all-gather of packed key/value pieces; backward: one reduce-scatter of the packed gradients."""

    @staticmethod
    def forward(
        ctx: Any, key: torch.Tensor, value: torch.Tensor, seq_dim: int, group_name: str, lengths: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.seq_dim, ctx.group_name, ctx.lengths = seq_dim, group_name, lengths
        ctx.local_length = key.size(seq_dim)
        ctx.key_rest, ctx.value_rest = _rest_of(key.shape, seq_dim), _rest_of(value.shape, seq_dim)
        packed = padded_rows(_pack_rows(key, value, seq_dim), max(lengths))
        return _unpack_rows(gather_rows(packed, lengths, group_name), ctx.key_rest, ctx.value_rest, seq_dim)

    @staticmethod
    def backward(ctx: Any, grad_key: torch.Tensor | None, grad_value: torch.Tensor | None) -> tuple[Any, ...]:
        lengths, seq_dim = ctx.lengths, ctx.seq_dim
        total = sum(lengths)
        known = grad_key if grad_key is not None else grad_value
        assert known is not None  # autograd calls backward only when some output has a gradient
        if grad_key is None:
            grad_key = known.new_zeros((total, *ctx.key_rest)).movedim(0, seq_dim)
        if grad_value is None:
            grad_value = known.new_zeros((total, *ctx.value_rest)).movedim(0, seq_dim)
        summed = sum_scatter_rows(_pack_rows(grad_key, grad_value, seq_dim), lengths, ctx.group_name)
        key_grad, value_grad = _unpack_rows(summed[: ctx.local_length], ctx.key_rest, ctx.value_rest, seq_dim)
        return key_grad, value_grad, None, None, None


def gather_key_value(
    key: torch.Tensor, value: torch.Tensor, seq_dim: int, group_name: str, lengths: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's key and value pieces along ``seq_dim``, concatenated in rank order (one all-gather; differentiable)."""
    if key.dtype != value.dtype or key.device != value.device:
        raise ValueError(
            f"context parallel flex_attention: key ({key.dtype}, {key.device}) and value ({value.dtype}, {value.device}) "
            "must share dtype and device"
        )
    if key.size(seq_dim) != value.size(seq_dim):
        raise ValueError(
            f"context parallel flex_attention: key {tuple(key.shape)} and value {tuple(value.shape)} differ along the "
            f"sequence dim {seq_dim}"
        )
    gathered: tuple[torch.Tensor, torch.Tensor] = _GatherKeyValue.apply(key, value, seq_dim, group_name, tuple(lengths))
    return gathered


# PyTorch's ``cplib::flex_cp_allgather`` under shardwise's namespace: key and value of equal pieces on every
# rank of the group named ``pg_name``, gathered along ``seq_dim`` (one all-gather; its backward one
# reduce-scatter), as one opaque op with a fake kernel and autograd (``torch.library.opcheck`` passes).
@torch.library.custom_op("shardwise_cp::flex_cp_allgather", mutates_args=())
def flex_cp_allgather(key: torch.Tensor, value: torch.Tensor, seq_dim: int, pg_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = (key.size(seq_dim),) * _group_size(pg_name)
    with torch.no_grad():
        gathered_key, gathered_value = _GatherKeyValue.apply(key, value, seq_dim, pg_name, lengths)
    return gathered_key.contiguous(), gathered_value.contiguous()


@flex_cp_allgather.register_fake
def _(key: torch.Tensor, value: torch.Tensor, seq_dim: int, pg_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    world_size = _group_size(pg_name)
    key_shape, value_shape = list(key.shape), list(value.shape)
    key_shape[seq_dim] *= world_size
    value_shape[seq_dim] *= world_size
    return key.new_empty(key_shape), value.new_empty(value_shape)


@torch.library.custom_op("shardwise_cp::flex_cp_allgather_backward", mutates_args=())
def flex_cp_allgather_backward(
    grad_key: torch.Tensor, grad_value: torch.Tensor, seq_dim: int, pg_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    world_size = _group_size(pg_name)
    length = grad_key.size(seq_dim) // world_size
    summed = sum_scatter_rows(_pack_rows(grad_key, grad_value, seq_dim), (length,) * world_size, pg_name)
    key_grad, value_grad = _unpack_rows(summed[:length], _rest_of(grad_key.shape, seq_dim), _rest_of(grad_value.shape, seq_dim), seq_dim)
    return key_grad.contiguous(), value_grad.contiguous()


@flex_cp_allgather_backward.register_fake
def _(grad_key: torch.Tensor, grad_value: torch.Tensor, seq_dim: int, pg_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    world_size = _group_size(pg_name)
    key_shape, value_shape = list(grad_key.shape), list(grad_value.shape)
    key_shape[seq_dim] //= world_size
    value_shape[seq_dim] //= world_size
    return grad_key.new_empty(key_shape), grad_value.new_empty(value_shape)


def _flex_cp_allgather_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.seq_dim, ctx.pg_name = inputs[2], inputs[3]


def _flex_cp_allgather_grad(ctx: Any, grad_key: torch.Tensor, grad_value: torch.Tensor) -> tuple[Any, ...]:
    key_grad, value_grad = flex_cp_allgather_backward(grad_key.contiguous(), grad_value.contiguous(), ctx.seq_dim, ctx.pg_name)
    return key_grad, value_grad, None, None


flex_cp_allgather.register_autograd(_flex_cp_allgather_grad, setup_context=_flex_cp_allgather_setup)


def _group_size(pg_name: str) -> int:
    from torch.distributed.distributed_c10d import _get_group_size_by_name

    return int(_get_group_size_by_name(cast(Any, pg_name)))
