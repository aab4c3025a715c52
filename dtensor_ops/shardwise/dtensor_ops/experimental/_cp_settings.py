"""Context parallelism's options and the sequence layout they choose.

PyTorch's ``_cp_options``, ``set_rotate_method``, ``_RotateMethod``, ``_CausalBehavior`` and
``_is_causal_behavior`` (served at PyTorch's path by ``_attention``), and the one answer every part
of context parallelism reads for "which positions does each rank hold": the layout the last sharding
recorded when these pieces are its shares, else the default one (head-tail while load balancing is on).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

import torch

from ._cp_layout import (
    SequenceLayout,
    _HeadTailLoadBalancer,
    _LoadBalancer,
    contiguous_layout,
    head_tail_layout,
    one_layout,
    record_layouts,
    recorded_layouts,
)
from ._cp_ring import on_each_rank

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

