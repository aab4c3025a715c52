"""Joint steps: one collective over the joint group of several mesh dims.

Joint steps (``allow_joint_steps``, when the mesh has a process group for every set of
its dims): one collective over the joint group of several mesh dims ``D`` (group rank =
row-major index over ``D``) changes all of them at once.

* joint all-to-all: every dim of ``D`` is Shard or Replicate before and after (some may
  keep their placement: a nested shard's pieces still move when an outer dim changes).  Each rank sends
  each group member exactly the part of its piece that the member's new piece needs
  (``all_to_all_single`` with per-peer sizes: no padding, so uneven and nested shards
  cost what they move); where the source is Replicate on a dim of ``D``, the member with
  the receiver's coordinate on that dim sends.  Valid when, for every rank, those
  senders' pieces cover its new piece.  Cost: the most elements a rank needs and does
  not hold — the lower bound of the step.
* joint reduce-scatter: every dim of ``D`` is Partial (one reduce op) or Replicate, at
  least one Partial, and becomes Shard or Replicate (at least one Shard).  The
  reduce-scatter runs over the joint group of the Partial dims; every member's new piece
  is cut out of the local block (the Replicate dims of ``D`` only pick pieces locally) and
  padded to the group's largest piece.  Valid when every new piece lies inside the block
  and the reduction may go first (the mixed-Partial rule above).  Cost:
  ``(|group| - 1) *`` the padded piece.
* joint all-to-all with reduction: every dim of ``D`` is Partial (any reduce ops, mixed
  included) or Shard before, Shard or Replicate after, at least one Partial, and no Partial
  dim outside ``D``.  Every member sends each member the part of its own contribution that
  the member's new piece needs (exact pieces, ``all_to_all_single`` with per-peer sizes); the
  receiver reduces the contributions (the last mesh dim first).  Valid when every contribution
  of every new piece is in the group.  Cost: the most contribution elements a rank does not
  hold itself.  On 2x2 it takes ``(P(sum), P(max)) -> (S(0), S(0))`` to the lower bound in one
  collective (196608 B for 256x256 fp32, against 229376 B in three one-dim steps) and
  ``(S(0), P) -> (S(1), S(1))`` from 114688 B to 98304 B.

Joint steps are searched only on meshes of at most ``_JOINT_SEARCH_MAX_RANKS`` ranks (their
cost looks at every rank's piece), only from the source or into the target (where they replace
several one-dim steps; see ``_joint_moves``), and chosen only when they move strictly fewer
bytes: a tie keeps the one-dim plan (and its collective counts).
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Iterator, Sequence

from shardwise.placement import Partial, Placement, Replicate, Shard, compute_local_shape_and_global_offset

from .steps import Placements, StepKind, _all_coordinates, _reduction_is_valid

# Joint steps are searched on meshes up to this many ranks: their cost and validity look at
# every rank's piece and every group member's, which grows with the square of the mesh.
_JOINT_SEARCH_MAX_RANKS = 16

_Box = tuple[tuple[int, ...], tuple[int, ...]]  # (shape, global offset) of one rank's piece


def _overlap(a: _Box, b: _Box) -> int:
    elements = 1
    for size_a, start_a, size_b, start_b in zip(a[0], a[1], b[0], b[1]):
        extent = min(start_a + size_a, start_b + size_b) - max(start_a, start_b)
        if extent <= 0:
            return 0
        elements *= extent
    return elements


@functools.lru_cache(maxsize=4096)
def _group_coordinates(
    coordinate: tuple[int, ...], mesh_shape: tuple[int, ...], mesh_dims: tuple[int, ...]
) -> list[tuple[int, ...]]:
    """The coordinates that differ from ``coordinate`` only on ``mesh_dims``, row-major over them (cached: pure)."""
    members = []
    for values in itertools.product(*(range(mesh_shape[d]) for d in mesh_dims)):
        member = list(coordinate)
        for mesh_dim, value in zip(mesh_dims, values):
            member[mesh_dim] = value
        members.append(tuple(member))
    return members


def joint_transition_kind(
    state: Placements, mesh_shape: Sequence[int], mesh_dims: Sequence[int], afters: Sequence[Placement]
) -> StepKind | None:
    """The kind of the joint step setting ``state[mesh_dims[i]]`` to ``afters[i]``, or None.

    Only the placements are checked here; whether the pieces fit (coverage) is part of the cost
    (:func:`joint_step_bytes_per_rank`).
    """
    if len(mesh_dims) < 2 or any(mesh_shape[d] == 1 for d in mesh_dims):
        return None
    befores = [state[d] for d in mesh_dims]
    if all(before == after for before, after in zip(befores, afters)):
        return None
    if all(isinstance(p, (Shard, Replicate)) for p in (*befores, *afters)):
        return StepKind.JOINT_ALL_TO_ALL
    partials = [p for p in befores if isinstance(p, Partial)]
    if (
        len(partials) == len(befores)
        and len({p.reduce_op for p in partials}) == 1
        and all(isinstance(p, Replicate) for p in afters)
        and all(_reduction_is_valid(state, mesh_shape, d, partials[0].reduce_op) for d in mesh_dims)
    ):
        return StepKind.JOINT_ALL_REDUCE
    if (
        partials
        and all(isinstance(p, (Partial, Replicate)) for p in befores)
        and len({p.reduce_op for p in partials}) == 1
        and all(isinstance(p, (Shard, Replicate)) for p in afters)
        and any(isinstance(p, Shard) for p in afters)
    ):
        first_partial = min(d for d in mesh_dims if isinstance(state[d], Partial))
        if _reduction_is_valid(state, mesh_shape, first_partial, partials[0].reduce_op):
            return StepKind.JOINT_REDUCE_SCATTER
    if (
        partials
        and all(isinstance(p, (Partial, Shard)) for p in befores)
        and all(isinstance(p, (Shard, Replicate)) for p in afters)
        and not any(isinstance(p, Partial) for d, p in enumerate(state) if d not in mesh_dims)
    ):
        # Every Partial dim is reduced here, where the contributions arrive, in the order the
        # mixed-Partial rule gives (the last mesh dim first): any reduce ops may be mixed.
        return StepKind.JOINT_ALL_TO_ALL_REDUCE
    return None


def joint_collective_dims(kind: StepKind, state: Placements, mesh_dims: Sequence[int]) -> tuple[int, ...]:
    """The mesh dims whose joint group runs a joint step's collective.

    An all-to-all runs over all of ``mesh_dims``; a reduce-scatter over its Partial dims only (its
    Replicate dims just pick, locally, which pieces a rank's group reduces).
    """
    if kind is StepKind.JOINT_REDUCE_SCATTER:
        return tuple(d for d in mesh_dims if isinstance(state[d], Partial))
    return tuple(mesh_dims)


def _all_boxes(global_shape: Sequence[int], mesh_shape: Sequence[int], state: Placements) -> dict[tuple[int, ...], _Box]:
    return {
        coordinate: compute_local_shape_and_global_offset(global_shape, mesh_shape, coordinate, state)
        for coordinate in _all_coordinates(mesh_shape)
    }


def _joint_elements(
    kind: StepKind,
    state: Placements,
    mesh_shape: Sequence[int],
    mesh_dims: Sequence[int],
    new_state: Placements,
    before_boxes: dict[tuple[int, ...], _Box],
    after_boxes: dict[tuple[int, ...], _Box],
) -> int | None:
    """Elements the most loaded rank receives in a joint step; None when the pieces do not fit."""
    worst = 0
    if kind is StepKind.JOINT_ALL_TO_ALL:
        sending_dims = [d for d in mesh_dims if isinstance(state[d], Shard)]
        # Mesh dims along which some rank receives data. A joint step over a dim whose placement
        # it keeps and that no data crosses is the exchange of the other dims, in a larger group
        # and with a send buffer assembled from every member's part: that smaller step is
        # searched too (for 2 dims, a one-dim all-gather where this would be a 4-rank all-to-all).
        crossed: set[int] = set()
        for coordinate, wanted in after_boxes.items():
            needed = math.prod(wanted[0])
            if needed == 0:
                continue
            needs = needed - _overlap(before_boxes[coordinate], wanted)
            senders = _group_coordinates(coordinate, tuple(mesh_shape), tuple(sending_dims))
            received = 0
            for sender in senders:
                part = _overlap(before_boxes[sender], wanted)
                received += part
                if part and sender != coordinate:
                    crossed.update(d for d in sending_dims if sender[d] != coordinate[d])
            if received != needed:
                return None
            worst = max(worst, needs)
        if any(d not in crossed and state[d] == new_state[d] for d in mesh_dims):
            return None
        return worst
    if kind is StepKind.JOINT_ALL_TO_ALL_REDUCE:
        # Each member holding part of a rank's new piece sends that part of its contribution (Shard
        # dims make the holders of one contribution disjoint); the rank needs every contribution.
        partial_dims = [d for d in mesh_dims if isinstance(state[d], Partial)]
        contributions = math.prod(mesh_shape[d] for d in partial_dims)
        for coordinate, wanted in after_boxes.items():
            needed = math.prod(wanted[0])
            if needed == 0:
                continue
            covered: dict[tuple[int, ...], int] = {}
            receives = 0
            for member in _group_coordinates(coordinate, tuple(mesh_shape), tuple(mesh_dims)):
                part = _overlap(before_boxes[member], wanted)
                contribution = tuple(member[d] for d in partial_dims)
                covered[contribution] = covered.get(contribution, 0) + part
                if member != coordinate:
                    receives += part
            if len(covered) != contributions or any(count != needed for count in covered.values()):
                return None
            worst = max(worst, receives)
        return worst
    reducing_dims = joint_collective_dims(kind, state, mesh_dims)
    group_size = math.prod(mesh_shape[d] for d in reducing_dims)
    if kind is StepKind.JOINT_ALL_REDUCE:
        # As one-dim all-reduces are priced: a reduce-scatter then an all-gather of 1/n pieces.
        largest = max(math.prod(block[0]) for block in before_boxes.values())
        return 2 * (group_size - 1) * -(-largest // group_size)
    for coordinate, block in before_boxes.items():
        padded = [0] * len(block[0])
        for member in _group_coordinates(coordinate, tuple(mesh_shape), tuple(reducing_dims)):
            piece = after_boxes[member]
            elements = math.prod(piece[0])
            if elements and _overlap(block, piece) != elements:
                return None
            padded = [max(a, b) for a, b in zip(padded, piece[0])]
        worst = max(worst, (group_size - 1) * math.prod(padded))
    return worst


def joint_step_bytes_per_rank(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    state: Placements,
    mesh_dims: Sequence[int],
    afters: Sequence[Placement],
    itemsize: int,
) -> int | None:
    """Bytes the most loaded rank receives in the joint step, or None when it is not a valid joint step."""
    kind = joint_transition_kind(state, mesh_shape, mesh_dims, afters)
    if kind is None:
        return None
    new_state = list(state)
    for mesh_dim, after in zip(mesh_dims, afters):
        new_state[mesh_dim] = after
    elements = _joint_elements(
        kind,
        state,
        mesh_shape,
        mesh_dims,
        tuple(new_state),
        _all_boxes(global_shape, mesh_shape, state),
        _all_boxes(global_shape, mesh_shape, tuple(new_state)),
    )
    return None if elements is None else elements * itemsize


def _joint_moves(
    state: Placements,
    src: Placements,
    dst: Placements,
    joint_dim_sets: Sequence[tuple[int, ...]],
    candidates: Sequence[Sequence[Placement]],
) -> Iterator[tuple[tuple[int, ...], tuple[Placement, ...]]]:
    """The joint steps the search tries from ``state``: any, from the source; only into the target, elsewhere.

    A joint step pays where it replaces several one-dim steps at the start or the end of a plan;
    trying every joint move from every state costs 20-100x the one-dim search (every rank's piece is
    looked at) for plans that were no cheaper.
    """
    used = {p.dim for p in (*src, *dst) if isinstance(p, Shard)}
    for mesh_dims in joint_dim_sets:
        if state == src:
            # Shards of tensor dims neither end uses only help one-dim steps step aside.
            options = [[p for p in candidates[d] if not isinstance(p, Shard) or p.dim in used] for d in mesh_dims]
            yield from ((mesh_dims, afters) for afters in itertools.product(*options))
        elif all(state[d] == dst[d] for d in range(len(state)) if d not in mesh_dims):
            yield mesh_dims, tuple(dst[d] for d in mesh_dims)


def _joint_dim_sets(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    splitting = [d for d, size in enumerate(mesh_shape) if size > 1]
    return [dims for count in range(2, len(splitting) + 1) for dims in itertools.combinations(splitting, count)]

