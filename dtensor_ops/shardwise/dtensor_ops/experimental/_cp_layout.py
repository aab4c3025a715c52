"""Where each rank's tokens sit in the global sequence under context parallelism, and the load balancers.

A :class:`SequenceLayout` says, for every rank of the context-parallel group, which global positions
it holds, in its local order, as runs of consecutive positions ("segments").  Sharding, ring
attention's causal plan and unsharding all read the same layout, so they cannot disagree.

Ring attention needs each rank's positions to increase along its local order: then the block of a
rank's queries against its own keys is exactly SDPA's top-left causal mask, and against another
rank's keys every query segment sees a prefix of that rank's keys.  Both layouts built here
(contiguous chunks, head-tail pairs) have that property; :meth:`SequenceLayout.from_order` checks it.

Pure: no communication.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from shardwise.placement import chunk_sizes

__all__ = [
    "SequenceLayout",
    "contiguous_layout",
    "head_tail_layout",
    "head_tail_chunk_sizes",
    "_LoadBalancer",
    "_HeadTailLoadBalancer",
]

Segment = tuple[int, int]  # [start, stop) global positions


@dataclass(frozen=True)
class SequenceLayout:
    """Per rank, the global positions it holds, as increasing runs ``[start, stop)`` in local order."""

    global_length: int
    segments: tuple[tuple[Segment, ...], ...]

    @property
    def world_size(self) -> int:
        return len(self.segments)

    def local_length(self, rank: int) -> int:
        return sum(stop - start for start, stop in self.segments[rank])

    def local_lengths(self) -> tuple[int, ...]:
        return tuple(self.local_length(rank) for rank in range(self.world_size))

    def order(self) -> list[int]:
        """The global position of every local token, rank after rank (the load-balancing permutation)."""
        return [position for rank_segments in self.segments for start, stop in rank_segments for position in range(start, stop)]

    @property
    def is_contiguous(self) -> bool:
        """Whether rank ``r`` holds the ``r``-th run of the unpermuted sequence (no rearranging needed)."""
        return self.order() == list(range(self.global_length))

    @staticmethod
    def from_order(order: list[int], rank_lengths: tuple[int, ...]) -> SequenceLayout:
        """The layout in which rank ``r`` holds ``order[offset_r : offset_r + rank_lengths[r]]``."""
        if sorted(order) != list(range(len(order))):
            raise ValueError(f"a load-balancing order must be a permutation of 0..{len(order) - 1}; got {order[:16]}...")
        if sum(rank_lengths) != len(order):
            raise ValueError(f"rank lengths {rank_lengths} do not add up to the sequence length {len(order)}")
        segments: list[tuple[Segment, ...]] = []
        offset = 0
        for rank, length in enumerate(rank_lengths):
            positions = order[offset : offset + length]
            offset += length
            if any(later <= earlier for earlier, later in zip(positions, positions[1:])):
                raise ValueError(
                    f"ring attention needs every rank's positions in increasing order; rank {rank} would hold "
                    f"{positions[:16]}{'...' if len(positions) > 16 else ''}"
                )
            runs: list[Segment] = []
            for position in positions:
                if runs and runs[-1][1] == position:
                    runs[-1] = (runs[-1][0], position + 1)
                else:
                    runs.append((position, position + 1))
            segments.append(tuple(runs))
        return SequenceLayout(len(order), tuple(segments))


def contiguous_layout(global_length: int, world_size: int) -> SequenceLayout:
    """Rank ``r`` holds torch.chunk's ``r``-th chunk (DTensor's ``Shard`` layout; trailing ranks smaller or empty)."""
    segments: list[tuple[Segment, ...]] = []
    start = 0
    for size in chunk_sizes(global_length, world_size):
        segments.append(((start, start + size),) if size else ())
        start += size
    return SequenceLayout(global_length, tuple(segments))


def head_tail_chunk_sizes(global_length: int, world_size: int) -> tuple[int, ...]:
    """Sizes of the ``2W`` chunks of the head-tail layout, so that every rank's pair differs by at most one token.

    Where ``2W`` divides the length all chunks are equal (PyTorch's layout).  Otherwise the extra
    tokens go first to the head chunks of ranks ``0, 1, ...``, then to the tail chunks of ranks
    ``0, 1, ...``: rank totals then differ by at most one.
    """
    chunks = 2 * world_size
    base, extra = divmod(global_length, chunks)
    sizes = [base] * chunks
    for index in range(extra):
        chunk = index if index < world_size else chunks - 1 - (index - world_size)
        sizes[chunk] += 1
    return tuple(sizes)


def head_tail_layout(global_length: int, world_size: int) -> SequenceLayout:
    """Rank ``r`` holds chunks ``r`` and ``2W-1-r`` of ``2W``: under a causal mask every rank does the same work."""
    sizes = head_tail_chunk_sizes(global_length, world_size)
    starts = [sum(sizes[:index]) for index in range(len(sizes))]
    segments: list[tuple[Segment, ...]] = []
    for rank in range(world_size):
        pair = (rank, 2 * world_size - 1 - rank)
        segments.append(tuple((starts[c], starts[c] + sizes[c]) for c in pair if sizes[c] > 0))
    return SequenceLayout(global_length, tuple(segments))


class _LoadBalancer(ABC):
    """Rearranges the sequence before it is sharded (PyTorch's ``_LoadBalancer`` contract).

    ``_generate_indices(restore=False)`` answers the ``(1, seq_len)`` permutation applied before
    sharding (``restore=True``: its inverse).  Subclasses may override :meth:`_rank_lengths` when
    ranks hold unequal numbers of tokens; by default rank ``r`` holds torch.chunk's ``r``-th share.
    """

    seq_length: int
    world_size: int

    @abstractmethod
    def _generate_indices(self, restore: bool = False) -> torch.Tensor | None:
        """The ``(1, seq_len)`` load-balancing permutation (or its inverse with ``restore=True``)."""

    def _rank_lengths(self) -> tuple[int, ...]:
        return chunk_sizes(self.seq_length, self.world_size)

    def _layout(self) -> SequenceLayout:
        indices = self._generate_indices(restore=False)
        if indices is None:
            return contiguous_layout(self.seq_length, self.world_size)
        if indices.ndim != 2 or indices.size(0) != 1:
            raise ValueError(
                f"ring attention takes one permutation for the whole batch, shape (1, seq_len); {type(self).__name__} "
                f"generated shape {tuple(indices.shape)}"
            )
        return SequenceLayout.from_order([int(i) for i in indices[0].tolist()], self._rank_lengths())


class _HeadTailLoadBalancer(_LoadBalancer):
    """Head-tail balancing: rank ``r`` holds chunks ``r`` and ``2W-1-r`` of the sequence cut in ``2W``.

    Any length works: where ``2W`` does not divide it, chunk sizes differ by one and rank totals by
    at most one (PyTorch's requires ``seq_length % (2 * world_size) == 0``).
    """

    def __init__(self, seq_length: int, world_size: int, device: str | torch.device) -> None:
        if seq_length < 0 or world_size < 1:
            raise ValueError(f"_HeadTailLoadBalancer needs seq_length >= 0 and world_size >= 1, got {seq_length}, {world_size}")
        self.seq_length = seq_length
        self.world_size = world_size
        self.device = device

    def _generate_indices(self, restore: bool = False) -> torch.Tensor:
        order = torch.tensor(head_tail_layout(self.seq_length, self.world_size).order(), dtype=torch.long, device=self.device)
        if restore:
            order = torch.argsort(order)
        return order.unsqueeze(0)

    def _rank_lengths(self) -> tuple[int, ...]:
        return head_tail_layout(self.seq_length, self.world_size).local_lengths()

    def _layout(self) -> SequenceLayout:
        return head_tail_layout(self.seq_length, self.world_size)
