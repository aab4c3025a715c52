"""Ulysses-style context parallelism: all-to-all from sequence-sharded to head-sharded, local attention, back.

Each rank starts with its tokens of every head.  One all-to-all (query, key and value packed
together) gives every rank the whole sequence of ``heads / W`` heads; SDPA runs there with the
kernel the user would get (any mask SDPA supports on the whole sequence: causal needs no ring
bookkeeping); a second all-to-all sends every rank its tokens of every head back.  Backward is
the same two all-to-alls in reverse (gradient of the output in, packed gradients of q/k/v out), so
each attention call costs 2 all-to-alls forward and 2 backward whatever ``W`` is, moving each
activation once; the ring instead moves key/value blocks ``W - 1`` times but never holds a whole
sequence.  Needs query and key/value heads divisible by ``W``.

Uneven layouts work unchanged: every piece travels with its exact size (no padding).  A
load-balanced (permuted) layout is put back in sequence order for the causal mask and the output
permuted back, both locally.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from .. import _collectives
from ._cp_layout import SequenceLayout

__all__ = ["ulysses_attention"]


class _ExactAllToAll(torch.autograd.Function):
    """``all_to_all_single`` on a flat buffer with exact splits; its gradient travels back the same way."""

    @staticmethod
    def forward(
        ctx: Any, flat: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group_name: str
    ) -> torch.Tensor:
        ctx.splits = (list(output_splits), list(input_splits), group_name)
        return _collectives.wait(_collectives.launch_all_to_all_exact(flat, output_splits, input_splits, group_name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits, group_name = ctx.splits
        returned = _collectives.wait(_collectives.launch_all_to_all_exact(grad.contiguous(), input_splits, output_splits, group_name))
        return returned, None, None, None


def _exchange(flat: torch.Tensor, output_splits: list[int], input_splits: list[int], group_name: str) -> torch.Tensor:
    exchanged: torch.Tensor = _ExactAllToAll.apply(flat, output_splits, input_splits, group_name)
    return exchanged


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for extent in shape:
        total *= extent
    return total


def ulysses_attention(
    group_name: str,
    rank: int,
    world_size: int,
    layout: SequenceLayout,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    """This rank's attention output ``(B, Hq, L_rank, Dv)``; query and key/value share ``layout`` (checked by the caller)."""
    batch, query_heads, _, head_dim = query.shape
    kv_heads, value_dim = key.shape[1], value.shape[3]
    query_group, kv_group = query_heads // world_size, kv_heads // world_size
    lengths = layout.local_lengths()

    def packet_numel(length: int) -> int:
        return batch * length * (query_group * head_dim + kv_group * head_dim + kv_group * value_dim)

    # Sequence -> heads: head group j of my tokens goes to rank j.
    packets = [
        torch.cat(
            [
                query[:, j * query_group : (j + 1) * query_group].reshape(-1),
                key[:, j * kv_group : (j + 1) * kv_group].reshape(-1),
                value[:, j * kv_group : (j + 1) * kv_group].reshape(-1),
            ]
        )
        for j in range(world_size)
    ]
    received = _exchange(
        torch.cat(packets), [packet_numel(lengths[s]) for s in range(world_size)], [packet_numel(lengths[rank])] * world_size, group_name
    )
    pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    offset = 0
    for source in range(world_size):
        shapes = (
            (batch, query_group, lengths[source], head_dim),
            (batch, kv_group, lengths[source], head_dim),
            (batch, kv_group, lengths[source], value_dim),
        )
        parts = []
        for shape in shapes:
            parts.append(received[offset : offset + _numel(shape)].reshape(shape))
            offset += _numel(shape)
        pieces.append((parts[0], parts[1], parts[2]))
    whole_query, whole_key, whole_value = (torch.cat([piece[i] for piece in pieces], dim=2) for i in range(3))

    restore: torch.Tensor | None = None
    if is_causal and not layout.is_contiguous:
        # The causal mask is about sequence order: undo the load balancer's permutation, and redo it after.
        order = torch.tensor(layout.order(), dtype=torch.long, device=query.device)
        restore = torch.argsort(order)
        whole_query, whole_key, whole_value = (t.index_select(2, restore) for t in (whole_query, whole_key, whole_value))
    out = F.scaled_dot_product_attention(
        whole_query, whole_key, whole_value, is_causal=is_causal, scale=scale, enable_gqa=query_group != kv_group
    )
    if restore is not None:
        out = out.index_select(2, torch.tensor(layout.order(), dtype=torch.long, device=query.device))

    # Heads -> sequence: rank s's tokens of my head group go back to rank s.
    starts = [sum(lengths[:s]) for s in range(world_size)]
    outgoing = torch.cat([out[:, :, starts[s] : starts[s] + lengths[s]].reshape(-1) for s in range(world_size)])
    mine = batch * query_group * lengths[rank] * value_dim
    returned = _exchange(outgoing, [mine] * world_size, [batch * query_group * lengths[s] * value_dim for s in range(world_size)], group_name)
    head_groups = [returned[j * mine : (j + 1) * mine].reshape(batch, query_group, lengths[rank], value_dim) for j in range(world_size)]
    return torch.cat(head_groups, dim=1)
