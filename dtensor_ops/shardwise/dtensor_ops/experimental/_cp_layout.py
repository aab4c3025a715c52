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
from typing import Sequence

import threading

import torch
from torch.nn.attention.flex_attention import BlockMask

from shardwise.placement import chunk_sizes

__all__ = [
    "SequenceLayout",
    "contiguous_layout",
    "head_tail_layout",
    "head_tail_chunk_sizes",
    "per_document_head_tail_layout",
    "ptrr_layout",
    "record_layouts",
    "recorded_layouts",
    "_LoadBalancer",
    "_HeadTailLoadBalancer",
    "_PerDocumentHeadTailLoadBalancer",
    "_PTRRLoadBalancer",
]

Segment = tuple[int, int]  # [start, stop) global positions


# The layouts (one, or one per batch row) the most recent context_parallel / _context_parallel_shard of this
# thread cut its buffers with: attention in the context and context_parallel_unshard after it read them back.
# Per thread (ranks run as threads in the test world shard independently); a thread that never sharded
# (autograd's device threads, which run a checkpointed block's recompute on CUDA) reads the latest recorded.
_RECORDED = threading.local()
_latest_recorded: list[tuple[SequenceLayout, ...] | None] = [None]


def record_layouts(rows: tuple[SequenceLayout, ...] | None) -> None:
    _RECORDED.rows = rows
    _latest_recorded[0] = rows


def recorded_layouts() -> tuple[SequenceLayout, ...] | None:
    """This thread's recorded layouts (see :func:`record_layouts`), else the latest of any thread."""
    rows: tuple[SequenceLayout, ...] | None = getattr(_RECORDED, "rows", _latest_recorded[0])
    return rows


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
                _append_run(runs, position, position + 1)
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
    sharding, or ``(batch, seq_len)`` when every batch row is rearranged its own way
    (``restore=True``: the inverse).  Subclasses may override :meth:`_rank_lengths` when ranks hold
    unequal numbers of tokens; by default rank ``r`` holds torch.chunk's ``r``-th share.
    """

    seq_length: int
    world_size: int

    @abstractmethod
    def _generate_indices(self, restore: bool = False) -> torch.Tensor | None:
        """The ``(1 or batch, seq_len)`` load-balancing permutation (or its inverse with ``restore=True``)."""

    def _rank_lengths(self) -> tuple[int, ...]:
        return chunk_sizes(self.seq_length, self.world_size)

    def _row_layouts(self) -> tuple[SequenceLayout, ...]:
        """One layout per row of the permutation (one row when the whole batch is rearranged alike)."""
        indices = self._generate_indices(restore=False)
        if indices is None:
            return (contiguous_layout(self.seq_length, self.world_size),)
        if indices.ndim != 2:
            raise ValueError(f"{type(self).__name__} generated indices of shape {tuple(indices.shape)}; expected (1 or batch, seq_len)")
        return tuple(SequenceLayout.from_order([int(i) for i in row.tolist()], self._rank_lengths()) for row in indices)

    def _layout(self) -> SequenceLayout:
        """The one layout of the whole batch; refused when rows are rearranged differently."""
        return one_layout(self._row_layouts(), type(self).__name__)


def one_layout(rows: Sequence[SequenceLayout], source: str) -> SequenceLayout:
    """The layout every row shares; a clear error when the rows differ."""
    if any(row != rows[0] for row in rows[1:]):
        raise ValueError(
            f"{source} rearranges each of the {len(rows)} batch rows its own way; SDPA's ring attention and this call take "
            "one permutation for the whole batch (flex_attention under _ContextParallel takes one per row)"
        )
    return rows[0]


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
        return _indices_of_rows(self._row_layouts(), restore, self.device)

    def _rank_lengths(self) -> tuple[int, ...]:
        return head_tail_layout(self.seq_length, self.world_size).local_lengths()

    def _row_layouts(self) -> tuple[SequenceLayout, ...]:
        return (head_tail_layout(self.seq_length, self.world_size),)


def per_document_head_tail_layout(document_lengths: Sequence[int], world_size: int) -> SequenceLayout:
    """Head-tail within each document: rank ``r`` holds chunks ``r`` and ``2W-1-r`` of every document, in order.

    Any document length works (chunk sizes as :func:`head_tail_chunk_sizes`); PyTorch's needs every
    length to divide by ``2W``.  Under a per-document causal mask every rank then does the same work
    to within one token per document.
    """
    if world_size < 1 or any(length < 0 for length in document_lengths):
        raise ValueError(f"document lengths must be >= 0 and world_size >= 1; got {list(document_lengths)} over {world_size}")
    per_rank: list[list[Segment]] = [[] for _ in range(world_size)]
    document_start = 0
    for length in document_lengths:
        sizes = head_tail_chunk_sizes(length, world_size)
        starts = [document_start + sum(sizes[:index]) for index in range(len(sizes))]
        for rank in range(world_size):
            for chunk in (rank, 2 * world_size - 1 - rank):
                if sizes[chunk]:
                    _append_run(per_rank[rank], starts[chunk], starts[chunk] + sizes[chunk])
        document_start += length
    return SequenceLayout(document_start, tuple(tuple(runs) for runs in per_rank))


def _append_run(runs: list[Segment], start: int, stop: int) -> None:
    if runs and runs[-1][1] == start:
        runs[-1] = (runs[-1][0], stop)
    else:
        runs.append((start, stop))


def ptrr_groups(work: Sequence[int], world_size: int) -> list[list[int]]:
    """Processing-time round-robin: task indices per group, each group's in increasing order.

    Tasks are taken by decreasing work (ties in index order) in rounds of ``world_size``, dealt to
    groups ``0..W-1`` in even rounds and ``W-1..0`` in odd ones (a snake), so group totals stay close.
    Any number of tasks: a last, shorter round leaves the last groups (in its direction) one task short.
    """
    by_work = sorted(range(len(work)), key=lambda task: (-work[task], task))
    groups: list[list[int]] = [[] for _ in range(world_size)]
    for position, task in enumerate(by_work):
        round_index, seat = divmod(position, world_size)
        groups[seat if round_index % 2 == 0 else world_size - 1 - seat].append(task)
    return [sorted(group) for group in groups]


def ptrr_layout(block_work: Sequence[int], block_size: int, seq_length: int, world_size: int) -> SequenceLayout:
    """Query blocks of ``block_size`` tokens dealt to ranks by :func:`ptrr_groups` (the last block may be short)."""
    segments: list[tuple[Segment, ...]] = []
    for group in ptrr_groups(block_work, world_size):
        runs: list[Segment] = []
        for block in group:
            start, stop = block * block_size, min((block + 1) * block_size, seq_length)
            if stop > start:
                _append_run(runs, start, stop)
        segments.append(tuple(runs))
    return SequenceLayout(seq_length, tuple(segments))


def _indices_of_rows(rows: Sequence[SequenceLayout], restore: bool, device: str | torch.device) -> torch.Tensor:
    orders = torch.tensor([row.order() for row in rows], dtype=torch.long, device=device)
    return torch.argsort(orders, dim=1) if restore else orders


class _PerDocumentHeadTailLoadBalancer(_LoadBalancer):
    """Head-tail balancing inside every document (documents packed in one sequence, a document-causal mask).

    ``seq_length_per_doc[b]`` lists the document lengths of batch row ``b`` (one row: the whole batch
    alike); every row must add up to the same sequence length.  Any document length works.
    """

    def __init__(self, seq_length_per_doc: list[list[int]], world_size: int, device: str | torch.device) -> None:
        rows = [list(row) for row in seq_length_per_doc]
        if not rows:
            raise ValueError("_PerDocumentHeadTailLoadBalancer needs the document lengths of at least one batch row")
        totals = {sum(row) for row in rows}
        if len(totals) != 1:
            raise ValueError(
                f"_PerDocumentHeadTailLoadBalancer: batch rows hold {[sum(row) for row in rows]} tokens; every row must "
                "add up to the same sequence length"
            )
        self.seq_length_per_doc = rows
        self.seq_length = totals.pop()
        self.world_size = world_size
        self.device = device
        self._rows = tuple(per_document_head_tail_layout(row, world_size) for row in rows)

    def _generate_indices(self, restore: bool = False) -> torch.Tensor:
        return _indices_of_rows(self._rows, restore, self.device)

    def _row_layouts(self) -> tuple[SequenceLayout, ...]:
        return self._rows


class _PTRRLoadBalancer(_LoadBalancer):
    """Processing-time round-robin over a flex_attention ``BlockMask``'s query blocks (for flex_attention).

    A query block's work is the number of key blocks it visits (partial and full); blocks are dealt
    to ranks by :func:`ptrr_groups`.  The mask must be the same for every head (``H == 1``); batch
    rows of a ``(B, 1, ...)`` mask are balanced each their own way.  Any number of blocks (PyTorch's
    needs it to divide by the world size): ranks then differ by at most one block.
    """

    def __init__(self, block_mask: BlockMask, world_size: int) -> None:
        if block_mask.kv_num_blocks.size(1) != 1:
            raise ValueError(
                f"_PTRRLoadBalancer needs a BlockMask that is the same for every head (shape (B, 1, Q, KV)); got "
                f"{tuple(block_mask.shape)}"
            )
        q_block, kv_block = block_mask.BLOCK_SIZE
        if q_block != kv_block:
            raise ValueError(f"_PTRRLoadBalancer needs equal query and key block sizes; the BlockMask has {block_mask.BLOCK_SIZE}")
        self.block_mask = block_mask
        self.world_size = world_size
        self.seq_length = int(block_mask.seq_lengths[0])
        work = block_mask.kv_num_blocks if block_mask.full_kv_num_blocks is None else block_mask.kv_num_blocks + block_mask.full_kv_num_blocks
        blocks = -(-self.seq_length // q_block)
        if blocks < world_size:
            raise ValueError(
                f"_PTRRLoadBalancer deals query blocks of {q_block} tokens to ranks; {self.seq_length} tokens make {blocks} "
                f"blocks, fewer than the {world_size} ranks (use smaller blocks or another balancer)"
            )
        self._rows = tuple(
            ptrr_layout([int(w) for w in row[:blocks].tolist()], q_block, self.seq_length, world_size) for row in work[:, 0]
        )

    @staticmethod
    def ptrr_scheduling(process_time: torch.Tensor, group_size: int) -> torch.Tensor:
        """Task indices per group, shape ``(group_size, n // group_size)`` (PyTorch's signature; ``n`` divides)."""
        if process_time.ndim != 1 or process_time.numel() % group_size:
            raise ValueError(f"ptrr_scheduling takes a 1-D tensor whose length divides by {group_size}; got {tuple(process_time.shape)}")
        groups = ptrr_groups([int(t) for t in process_time.tolist()], group_size)
        return torch.tensor(groups, dtype=torch.long, device=process_time.device)

    def _generate_indices(self, restore: bool = False) -> torch.Tensor:
        return _indices_of_rows(self._rows, restore, self.block_mask.kv_num_blocks.device)

    def _row_layouts(self) -> tuple[SequenceLayout, ...]:
        return self._rows
