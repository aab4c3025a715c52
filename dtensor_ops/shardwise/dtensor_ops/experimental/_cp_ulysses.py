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

Each all-to-all is one ``autograd.Function`` whose backward is the all-to-all the other way, and
the packing around it runs inside it.  What depends on the rank's own length (what it sends to
heads, how it reads back its tokens) runs per rank (``on_each_rank``), so under torch's
``LocalTensorMode`` every simulated rank packs its own piece and each all-to-all runs once; no
view of a per-rank length is ever differentiated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from .. import _collectives
from ._cp_layout import SequenceLayout
from ._cp_ring import on_each_rank

__all__ = ["ulysses_attention"]


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for extent in shape:
        total *= extent
    return total


@dataclass(frozen=True)
class _Exchanges:
    """The two all-to-alls between sequence-sharded ``(B, H, L_rank, D)`` and head-sharded ``(B, H / W, L, D)``.

    Tensors move together (one all-to-all for query, key and value); the whole sequence is in the
    layout's order (rank after rank).
    """

    group_name: str
    world_size: int
    rank: int  # a per-rank SymInt under LocalTensorMode
    lengths: tuple[int, ...]  # every rank's local length

    def _all_to_all(self, flat: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int]) -> torch.Tensor:
        return _collectives.wait(
            _collectives.launch_all_to_all_exact(flat, output_splits, input_splits, self.group_name)
        )

    def to_heads(self, pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Sequence-sharded pieces -> this rank's head group of every whole sequence."""
        flat, input_splits = on_each_rank(self.rank, _pack_head_groups, self.world_size, list(pieces))
        per_token = [(piece.shape[0], piece.shape[1] // self.world_size, piece.shape[3]) for piece in pieces]
        token_numel = sum(batch * heads * dim for batch, heads, dim in per_token)
        received = self._all_to_all(flat, [token_numel * length for length in self.lengths], input_splits)
        # From each source rank, every tensor's (B, H / W, L_source, D) block: received has the same size everywhere.
        blocks: list[list[torch.Tensor]] = [[] for _ in pieces]
        offset = 0
        for length in self.lengths:
            for index, (batch, heads, dim) in enumerate(per_token):
                shape = (batch, heads, length, dim)
                blocks[index].append(received[offset : offset + _numel(shape)].view(shape))
                offset += _numel(shape)
        return [torch.cat(parts, dim=2) for parts in blocks]

    def to_sequence(self, wholes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's head group of whole sequences -> every head of this rank's tokens."""
        starts = [sum(self.lengths[:source]) for source in range(self.world_size)]
        outgoing = torch.cat(
            [
                whole[:, :, starts[rank] : starts[rank] + length].reshape(-1)
                for rank, length in enumerate(self.lengths)
                for whole in wholes
            ]
        )
        per_token = [(whole.shape[0], whole.shape[1], whole.shape[3]) for whole in wholes]
        token_numel = sum(batch * heads * dim for batch, heads, dim in per_token)
        output_splits = on_each_rank(self.rank, _returned_splits, self.world_size, self.lengths, token_numel)
        returned = self._all_to_all(outgoing, output_splits, [token_numel * length for length in self.lengths])
        unpacked: list[torch.Tensor] = on_each_rank(self.rank, _unpack_head_groups, self.world_size, self.lengths, per_token, returned)
        return unpacked


def _pack_head_groups(rank: int, world_size: int, pieces: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Head group ``j`` of every piece, one after the other, for rank ``j``; and the input splits."""
    groups = [piece.unflatten(1, (world_size, piece.shape[1] // world_size)).transpose(0, 1).flatten(1) for piece in pieces]
    packets = torch.cat(groups, dim=1)
    return packets.reshape(-1), [packets.shape[1]] * world_size


def _returned_splits(rank: int, world_size: int, lengths: tuple[int, ...], token_numel: int) -> list[int]:
    return [token_numel * lengths[rank]] * world_size


def _unpack_head_groups(
    rank: int, world_size: int, lengths: tuple[int, ...], per_token: list[tuple[int, int, int]], returned: torch.Tensor
) -> list[torch.Tensor]:
    """Every tensor's ``(B, G * W, L_rank, D)`` from the head groups rank ``j`` sent back (group ``j`` of heads)."""
    length = lengths[rank]
    rows = returned.unflatten(0, (world_size, returned.numel() // world_size))
    results = []
    offset = 0
    for batch, heads, dim in per_token:
        numel = batch * heads * length * dim
        block = rows[:, offset : offset + numel].reshape(world_size, batch, heads, length, dim)
        results.append(block.transpose(0, 1).reshape(batch, world_size * heads, length, dim))
        offset += numel
    return results


class _ToHeads(torch.autograd.Function):
    """Query, key and value from sequence- to head-sharded (one all-to-all); the gradients go back the same way."""

    @staticmethod
    def forward(ctx: Any, exchanges: _Exchanges, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.exchanges = exchanges
        return tuple(exchanges.to_heads([query, key, value]))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return (None, *ctx.exchanges.to_sequence([grad.contiguous() for grad in grads]))


class _ToSequence(torch.autograd.Function):
    """The output from head- back to sequence-sharded (one all-to-all); its gradient goes to heads."""

    @staticmethod
    def forward(ctx: Any, exchanges: _Exchanges, out: torch.Tensor) -> torch.Tensor:
        ctx.exchanges = exchanges
        (sequence,) = exchanges.to_sequence([out])
        return sequence

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (heads,) = ctx.exchanges.to_heads([grad.contiguous()])
        return None, heads


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
    exchanges = _Exchanges(group_name, world_size, rank, layout.local_lengths())
    whole_query, whole_key, whole_value = _ToHeads.apply(exchanges, query, key, value)

    restore: torch.Tensor | None = None
    if is_causal and not layout.is_contiguous:
        # The causal mask is about sequence order: undo the load balancer's permutation, and redo it after.
        order = torch.tensor(layout.order(), dtype=torch.long, device=query.device)
        restore = torch.argsort(order)
        whole_query, whole_key, whole_value = (t.index_select(2, restore) for t in (whole_query, whole_key, whole_value))
    out = F.scaled_dot_product_attention(
        whole_query, whole_key, whole_value, is_causal=is_causal, scale=scale, enable_gqa=whole_query.shape[1] != whole_key.shape[1]
    )
    if restore is not None:
        out = out.index_select(2, torch.tensor(layout.order(), dtype=torch.long, device=query.device))
    result: torch.Tensor = _ToSequence.apply(exchanges, out)
    return result
