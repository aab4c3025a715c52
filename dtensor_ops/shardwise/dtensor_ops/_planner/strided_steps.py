"""Steps into and out of ``_StridedShard`` layouts, whose pieces are index runs.

Strided layouts: a ``_StridedShard`` piece (FSDP over tensor parallelism; any shard order other
than the default) is a set of index runs, not a contiguous range, so the one-dim steps above do
not apply to it. Plans into or out of such a layout (:func:`_plan_strided`) use three step kinds
of their own, priced like the collectives they run, and the cheapest valid candidate wins:

* strided all-gather (``_S -> R`` on one mesh dim): when, on every group along that mesh dim, the
  members' pieces in order are exactly the new piece (``(_S(0, sf=tp), S(0)) -> (R, S(0))``: FSDP
  over TP back to TP), one all-gather of the pieces padded to the largest, then a concatenation;
  cost ``(n-1) *`` the largest piece;
* gather whole (any strided layout without Partial -> R everywhere): one all-gather per mesh dim
  that cuts (innermost first; a Replicate dim's pieces are all alike) of every piece padded to the
  largest, each piece then put at its indices; cost ``(ranks of those dims - 1) *`` the largest
  piece, one latency per gathered mesh dim;
* select local (R everywhere -> a layout without Partial): this rank's index runs, no communication.

From a strided layout: a strided all-gather of one mesh dim followed by the best plan from the
layout it leaves (none where it reaches the target); or the whole gather followed by the selection
(or by the normal plan to a Partial target). Into one: the normal plan to R everywhere, then the
selection. So a plan through any intermediate layout costs at least the plan chosen (the
triangle inequality PyTorch's planner tests hold), up to the normal planner's own. A strided layout with a Partial mesh dim, and a target with
both, are refused (``NotImplementedError``, before any communication).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, _StridedShard, local_index_runs

from .steps import Placements, RedistributeStep, StepKind, _all_coordinates

def _is_strided(spec: DTensorSpec[Any]) -> bool:
    return any(type(p) is _StridedShard for p in spec.placements)


def run_indices(runs: Sequence[tuple[int, int]]) -> list[int]:
    """The indices that ``(start, length)`` runs (``local_index_runs``' entries) hold, in order."""
    return [start + k for start, length in runs for k in range(length)]


def run_length(runs: Sequence[tuple[int, int]]) -> int:
    return sum(length for _, length in runs)


def strided_gather_dim(
    global_shape: Sequence[int], mesh_shape: Sequence[int], src: Placements, dst: Placements
) -> int | None:
    """The mesh dim whose strided all-gather takes ``src`` to ``dst`` exactly, or None.

    ``src`` and ``dst`` differ on one mesh dim only, ``_StridedShard -> Replicate`` (no Partial
    anywhere), and on EVERY group along that dim (not only this rank's: every rank must take the
    same plan) the members' pieces of the cut tensor dim, in order, are the new piece.
    """
    differing = [m for m, (a, b) in enumerate(zip(src, dst)) if a != b]
    if len(differing) != 1 or any(isinstance(p, Partial) for p in (*src, *dst)):
        return None
    (mesh_dim,) = differing
    source = src[mesh_dim]
    if type(source) is not _StridedShard or not isinstance(dst[mesh_dim], Replicate):
        return None
    tensor_dim = source.dim % len(global_shape)
    others = [range(n) if m != mesh_dim else range(1) for m, n in enumerate(mesh_shape)]
    for coordinate in itertools.product(*others):
        joined: list[int] = []
        for index in range(mesh_shape[mesh_dim]):
            member = coordinate[:mesh_dim] + (index,) + coordinate[mesh_dim + 1 :]
            joined += run_indices(local_index_runs(global_shape, mesh_shape, member, src)[tensor_dim])
        if joined != run_indices(local_index_runs(global_shape, mesh_shape, coordinate, dst)[tensor_dim]):
            return None
    return mesh_dim


def largest_piece_shape(global_shape: Sequence[int], mesh_shape: Sequence[int], state: Placements) -> tuple[int, ...]:
    """Per tensor dim, the largest extent any rank's piece has in ``state`` (what pieces are padded to)."""
    largest = [0] * len(global_shape)
    for coordinate in _all_coordinates(mesh_shape):
        for dim, runs in enumerate(local_index_runs(global_shape, mesh_shape, coordinate, state)):
            largest[dim] = max(largest[dim], run_length(runs))
    return tuple(largest)


def _strided_all_gather_step(
    global_shape: Sequence[int], mesh_shape: Sequence[int], src: Placements, mesh_dim: int, itemsize: int
) -> RedistributeStep:
    largest = largest_piece_shape(global_shape, mesh_shape, src)
    received = (mesh_shape[mesh_dim] - 1) * math.prod(largest) * itemsize
    return RedistributeStep(
        mesh_dim, src[mesh_dim], Replicate(), StepKind.STRIDED_ALL_GATHER, received,
        local_copy_bytes=mesh_shape[mesh_dim] * math.prod(largest) * itemsize,
    )


def _changes(before: Placements, after: Placements) -> tuple[tuple[int, Placement, Placement], ...]:
    return tuple((m, a, b) for m, (a, b) in enumerate(zip(before, after)) if a != b)


def _gather_whole_step(
    global_shape: Sequence[int], mesh_shape: Sequence[int], src: Placements, itemsize: int
) -> RedistributeStep:
    # Gathered over the mesh dims that cut (the others are Replicate: every piece along them is the same).
    replicated = (Replicate(),) * len(src)
    changes = _changes(src, replicated)
    largest = math.prod(largest_piece_shape(global_shape, mesh_shape, src))
    ranks = math.prod(mesh_shape[m] for m, _, _ in changes)
    first = changes[0]
    return RedistributeStep(
        first[0], first[1], first[2], StepKind.GATHER_WHOLE, (ranks - 1) * largest * itemsize,
        joint=changes if len(changes) > 1 else (),
        local_copy_bytes=(ranks * largest + math.prod(global_shape)) * itemsize,
    )


def _select_local_step(
    global_shape: Sequence[int], mesh_shape: Sequence[int], dst: Placements, itemsize: int
) -> RedistributeStep:
    replicated = (Replicate(),) * len(dst)
    changes = _changes(replicated, dst)
    first = changes[0]
    return RedistributeStep(
        first[0], first[1], first[2], StepKind.SELECT_LOCAL, 0,
        joint=changes if len(changes) > 1 else (),
        local_copy_bytes=math.prod(largest_piece_shape(global_shape, mesh_shape, dst)) * itemsize,
    )

