"""The redistribution planner: the cheapest sequence of one-mesh-dim steps between two layouts.

Pure: no tensors, no communication.  Everything here works on plain data (global
shape, mesh shape, placement tuples, item size) so that it can be unit-tested
without processes and cached by value.

Model
-----
A *state* is a tuple of placements, one per mesh dim.  A *step* changes the
placement of exactly one mesh dim and runs at most one collective over that mesh
dim's process group:

==================  ======================  =============================================
before -> after     step kind               data moved per rank (padded, ring algorithms)
==================  ======================  =============================================
S(i) -> R           all-gather              (n-1) * shard
P    -> R           all-reduce              2 (n-1) * ceil(local / n)
P    -> S(j)        reduce-scatter          (n-1) * shard after the step
S(i) -> S(j)        all-to-all              (n-1) * local / n  (one block per peer)
R    -> S(j)        local chunk             0
R    -> P           local                   0  (sum: zeros off coordinate 0; avg/max/min:
                                               the replicated value already reduces to itself)
S(i) -> P           local                   0  (the shard is put back into its parent block,
                                               which is filled with the reduction's identity)
P(a) -> P(b), a!=b  not a step              the search goes through R (all-reduce) or,
                                               cheaper, a Shard (reduce-scatter, then S->P)
any, mesh size 1    relabel                 0  (one rank: every placement holds the same data)
==================  ======================  =============================================

"Bytes moved per rank" is what the most loaded rank receives; with torch.chunk
layouts that is the rank at coordinate (0, ..., 0), whose shards are the largest,
so costs are computed from the layout at that coordinate.

Nested sharding: when several mesh dims shard one tensor dim, mesh dim 0 makes the
outer split (see :func:`shardwise.placement.compute_local_shape_and_global_offset`).
A collective over mesh dim ``d`` only regroups the pieces of the block that the
*other* mesh dims define, so:

* un-sharding tensor dim ``i`` over ``d`` (all-gather, all-to-all, S->P) is valid only
  when ``d`` is the innermost mesh dim sharding ``i``;
* sharding tensor dim ``j`` over ``d`` (local chunk, reduce-scatter, all-to-all) is valid
  only when ``d`` becomes the innermost mesh dim sharding ``j``.

Mesh dims of size 1 split nothing and are ignored by both rules.

Mesh dims of size 1 (torchtitan's ``("pp", "dp_replicate", "dp_shard", "cp", "tp")`` of sizes
``(1, 1, 2, 1, 2)``): one rank holds, whatever the placement, the whole tensor's values along such a
dim (one Shard piece is the whole extent and leaves the pieces of the other dims cutting that tensor
dim as they are; a reduction of one contribution is that contribution), so every change there is a
free relabel, and no step on another dim depends on it. ``plan_redistribute`` therefore searches the
problem with those dims removed and puts the target's placements on them first, as relabels
(``find_cheapest_plan_without_size_one_dims``): the search costs what it costs on the smaller mesh
(the full search's states grow as candidates ** mesh dims) and is memoised by the reduced problem, so
layouts that differ only there share it. ``find_cheapest_plan`` itself still searches every dim. A
``_StridedShard`` on a size-1 dim is relabelled too, where the layout function gives every rank the
piece it gives with Replicate there (checked per problem); other strided layouts take ``_plan_strided``.

Mixed Partial kinds: when several mesh dims are Partial with different reduce ops,
the logical value is ``reduce_0(reduce_1(...reduce_{n-1}(locals)))`` — the last mesh
dim is reduced first.  Reducing mesh dim ``d`` before the partial dims after it is
therefore valid only when its op commutes with theirs (equal ops, or both linear:
sum/avg).  Creating a Partial (R->P, S->P) is valid in any state.

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

The search is uniform-cost (Dijkstra) over states; the state space is small because
mesh ndim is small.  Costs are compared as ``(bytes, joint steps, collectives, steps)`` so
that among equally cheap plans the one without joint steps, then with fewer collectives,
then fewer steps, wins.  Ties are broken by a fixed exploration order, so every rank
computes the same plan.

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

Where no joint step is searched, the search runs in C++ when the optional ``_plan_search_ext``
module is built (``dtensor_ops/csrc/plan_search.cpp``, ``python dtensor_ops/csrc/build.py``): a
port of the Python search (``_search_in_python``, the reference and the fallback) that returns the
same plans, ties included, 10-40x faster on 3-D and 4-D meshes (tools/README.md,
``bench_mesh_scale``).  ``SHARDWISE_PLAN_SEARCH=python`` turns it off.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import heapq
import importlib
import importlib.machinery
import importlib.util
import itertools
import math
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Iterator, Sequence

from shardwise.placement import (
    DTensorSpec,
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
    compute_local_shape_and_global_offset,
    holds_same_values,
    local_index_runs,
)

from ._caches import SHARED_CACHES, SYMBOLIC, lookup, store
from ._cost_model import StepPricer, priced_kind, pricer_for_mesh
from ._options import ENVIRONMENT_OVERRIDES, current_options

__all__ = [
    "StepKind",
    "RedistributeStep",
    "Placements",
    "transition_kind",
    "step_bytes_per_rank",
    "joint_transition_kind",
    "joint_step_bytes_per_rank",
    "joint_collective_dims",
    "mesh_supports_joint_steps",
    "find_cheapest_plan",
    "find_cheapest_plan_without_size_one_dims",
    "relabel_size_one_dims",
    "lift_plan",
    "without_size_one_dims",
    "naive_greedy_plan",
    "plan_bytes_per_rank",
    "plan_states",
    "lower_bound_bytes_per_rank",
    "reduce_ops_commute",
    "plan_redistribute",
    "redistribute_cost_bytes",
    "redistribute_cost_picoseconds",
    "redistribute_lower_bound_bytes",
    "check_redistribute_specs",
    "largest_piece_shape",
    "run_indices",
    "run_length",
    "strided_gather_dim",
]

Placements = tuple[Placement, ...]
# What a step costs in the planner's search: (kind, mesh dims, bytes a rank receives, bytes it copies
# locally) -> a non-negative integer.
StepPrice = Callable[["StepKind", tuple[int, ...], int, int], int]

_LINEAR_REDUCE_OPS = frozenset({"sum", "avg"})


class StepKind(enum.Enum):
    """What one redistribution step does on its mesh dim."""

    ALL_GATHER = "all_gather"  # S(i) -> R
    ALL_REDUCE = "all_reduce"  # P -> R
    REDUCE_SCATTER = "reduce_scatter"  # P -> S(j)
    ALL_TO_ALL = "all_to_all"  # S(i) -> S(j)
    LOCAL_CHUNK = "local_chunk"  # R -> S(j)
    LOCAL_PARTIAL = "local_partial"  # R -> P
    SHARD_TO_PARTIAL = "shard_to_partial"  # S(i) -> P
    RELABEL = "relabel"  # any change on a mesh dim of size 1
    # Several mesh dims at once, one collective over their joint group (see "Joint steps" above):
    JOINT_ALL_TO_ALL = "joint_all_to_all"  # Shard/Replicate -> Shard/Replicate, exact per-peer pieces
    JOINT_REDUCE_SCATTER = "joint_reduce_scatter"  # Partial (one op) -> Shard/Replicate, at least one Shard
    # Partial/Shard -> Shard/Replicate: one all-to-all of raw contributions, reduced where they arrive
    JOINT_ALL_TO_ALL_REDUCE = "joint_all_to_all_reduce"
    # Partial (one op) on every joint dim -> Replicate: one all-reduce over the joint group
    JOINT_ALL_REDUCE = "joint_all_reduce"
    # Into and out of _StridedShard layouts, whose pieces are not contiguous ranges (see "Strided layouts"):
    STRIDED_ALL_GATHER = "strided_all_gather"  # _S -> R on one mesh dim whose group's pieces, in order, are the new piece
    GATHER_WHOLE = "gather_whole"  # any _S layout (no Partial) -> R everywhere: one all-gather per mesh dim
    SELECT_LOCAL = "select_local"  # R everywhere -> any layout without Partial: this rank's indices, locally

    @property
    def is_collective(self) -> bool:
        return self in _COLLECTIVE_KINDS

    @property
    def is_strided(self) -> bool:
        """A step into or out of a ``_StridedShard`` layout (its pieces are located by index runs)."""
        return self in _STRIDED_KINDS


_COLLECTIVE_KINDS = frozenset(
    {
        StepKind.ALL_GATHER,
        StepKind.ALL_REDUCE,
        StepKind.REDUCE_SCATTER,
        StepKind.ALL_TO_ALL,
        StepKind.JOINT_ALL_TO_ALL,
        StepKind.JOINT_REDUCE_SCATTER,
        StepKind.JOINT_ALL_TO_ALL_REDUCE,
        StepKind.JOINT_ALL_REDUCE,
        StepKind.STRIDED_ALL_GATHER,
        StepKind.GATHER_WHOLE,
    }
)
_STRIDED_KINDS = frozenset({StepKind.STRIDED_ALL_GATHER, StepKind.GATHER_WHOLE, StepKind.SELECT_LOCAL})


@dataclass(frozen=True, slots=True)
class RedistributeStep:
    """Change mesh dim ``mesh_dim`` from ``before`` to ``after``.

    ``bytes_per_rank`` is what the most loaded rank receives in this step (0 for local steps).
    A joint step changes several mesh dims with one collective over their joint group:
    ``joint`` lists every ``(mesh dim, before, after)`` it changes, in mesh dim order
    (``mesh_dim``/``before``/``after`` are its first entry); ``()`` for a one-dim step.
    """

    mesh_dim: int
    before: Placement
    after: Placement
    kind: StepKind
    bytes_per_rank: int
    joint: tuple[tuple[int, Placement, Placement], ...] = ()
    # Bytes the most loaded rank writes on its own device in the step (padding, regrouping, trimming,
    # chunking, filling: ``local_copy_bytes``); priced, but not part of what makes two steps equal.
    local_copy_bytes: int = field(default=0, compare=False)

    @property
    def changes(self) -> tuple[tuple[int, Placement, Placement], ...]:
        """Every ``(mesh dim, before, after)`` the step changes."""
        return self.joint or ((self.mesh_dim, self.before, self.after),)

    @property
    def mesh_dims(self) -> tuple[int, ...]:
        return tuple(mesh_dim for mesh_dim, _, _ in self.changes)

    def __str__(self) -> str:
        if self.joint:
            moves = ", ".join(f"{before} -> {after}" for _, before, after in self.joint)
            return f"mesh dims {self.mesh_dims}: {moves} ({self.kind.value}, {self.bytes_per_rank} B)"
        return f"mesh dim {self.mesh_dim}: {self.before} -> {self.after} ({self.kind.value}, {self.bytes_per_rank} B)"


# -- validity ------------------------------------------------------------------------------


def reduce_ops_commute(op_a: str, op_b: str) -> bool:
    """Whether reducing by ``op_a`` then ``op_b`` equals reducing by ``op_b`` then ``op_a``."""
    return op_a == op_b or (op_a in _LINEAR_REDUCE_OPS and op_b in _LINEAR_REDUCE_OPS)


def _splitting_mesh_dims(state: Placements, mesh_shape: Sequence[int], tensor_dim: int) -> Iterator[int]:
    for mesh_dim, placement in enumerate(state):
        if isinstance(placement, Shard) and placement.dim == tensor_dim and mesh_shape[mesh_dim] > 1:
            yield mesh_dim


def _reduction_is_valid(state: Placements, mesh_shape: Sequence[int], mesh_dim: int, op: str) -> bool:
    for inner in range(mesh_dim + 1, len(state)):
        placement = state[inner]
        if isinstance(placement, Partial) and mesh_shape[inner] > 1:
            if not reduce_ops_commute(op, placement.reduce_op):
                return False
    return True


def transition_kind(
    state: Placements, mesh_shape: Sequence[int], mesh_dim: int, after: Placement
) -> StepKind | None:
    """The kind of the step setting ``state[mesh_dim]`` to ``after``, or None when no single step does it.

    None means: not a change, a direct Partial -> other Partial change (go through
    Replicate), or a change that nested sharding or mixed Partial ops make invalid in
    ``state`` (see the module docstring). Partials of one reduce op but different classes
    (``_MaskPartial`` and ``Partial("sum")``) hold the same values: a relabel.
    """
    before = state[mesh_dim]
    if before == after:
        return None
    if isinstance(before, Partial) and isinstance(after, Partial):
        return StepKind.RELABEL if holds_same_values(before, after) else None
    if mesh_shape[mesh_dim] == 1:
        return StepKind.RELABEL
    if isinstance(before, Shard):
        if max(_splitting_mesh_dims(state, mesh_shape, before.dim)) != mesh_dim:
            return None
    if isinstance(after, Shard):
        if any(other > mesh_dim for other in _splitting_mesh_dims(state, mesh_shape, after.dim)):
            return None
    if isinstance(before, Partial) and not _reduction_is_valid(state, mesh_shape, mesh_dim, before.reduce_op):
        return None

    if isinstance(before, Shard):
        if isinstance(after, Replicate):
            return StepKind.ALL_GATHER
        if isinstance(after, Shard):
            return StepKind.ALL_TO_ALL
        return StepKind.SHARD_TO_PARTIAL
    if isinstance(before, Replicate):
        return StepKind.LOCAL_CHUNK if isinstance(after, Shard) else StepKind.LOCAL_PARTIAL
    if isinstance(before, Partial):
        return StepKind.ALL_REDUCE if isinstance(after, Replicate) else StepKind.REDUCE_SCATTER
    raise TypeError(f"unsupported placement {before!r} on mesh dim {mesh_dim}; expected Shard, Replicate or Partial")


# -- joint steps ---------------------------------------------------------------------------

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


# -- cost ----------------------------------------------------------------------------------


def _largest_local_shape(
    global_shape: Sequence[int], mesh_shape: Sequence[int], state: Placements
) -> tuple[int, ...]:
    # torch.chunk puts the largest piece first at every nesting level.
    return compute_local_shape_and_global_offset(global_shape, mesh_shape, (0,) * len(mesh_shape), state)[0]


def _kind_bytes(
    kind: StepKind,
    largest_before: Sequence[int],
    largest_after: Sequence[int],
    group_size: int,
    itemsize: int,
    after: Placement,
) -> int:
    if not kind.is_collective:
        return 0
    peers = group_size - 1
    if kind is StepKind.ALL_GATHER:
        elements = peers * math.prod(largest_before)
    elif kind is StepKind.REDUCE_SCATTER:
        elements = peers * math.prod(largest_after)
    elif kind is StepKind.ALL_REDUCE:
        elements = 2 * peers * -(-math.prod(largest_before) // group_size)
    else:  # all-to-all: one block per peer, the target dim cut into padded pieces
        assert isinstance(after, Shard)
        block = list(largest_before)
        block[after.dim] = largest_after[after.dim]
        elements = peers * math.prod(block)
    return elements * itemsize


def local_copy_bytes(
    kind: StepKind,
    largest_before: Sequence[int],
    largest_after: Sequence[int],
    group_size: int,
    itemsize: int,
    before: Placement,
    after: Placement,
) -> int:
    """Bytes the most loaded rank writes locally in a one-dim step: what the executor
    (``_redistribution._send_buffer``, ``_finish``, ``_run_local``) copies around the collective.

    On the largest pieces, as ``_kind_bytes``: padding an uneven piece to the group's largest,
    regrouping when the collective's dim is not the tensor's outermost (the pieces travel as dim-0
    blocks; an all-gather's are a view when only dims of size 1 precede its dim), trimming the padding off, a chunk that is not a leading-dim view, a sum's split or zero
    fill, a shard's placement into its zero-filled parent. An all-reduce works in place; joint steps
    are not modelled (0).
    """
    n = group_size
    before_elements = math.prod(largest_before)
    after_elements = math.prod(largest_after)
    if kind is StepKind.ALL_GATHER:
        assert isinstance(before, Shard)
        i = before.dim
        uneven = largest_before[i] * n != largest_after[i]
        elements = before_elements if uneven else 0  # this piece padded to the largest
        if any(size != 1 for size in largest_before[:i]):
            # the received dim-0 blocks joined along dim i, then the padding trimmed (where only
            # dims of size 1 precede dim i, the blocks already lie in order: a view)
            elements += n * before_elements + (after_elements if uneven else 0)
    elif kind is StepKind.REDUCE_SCATTER:
        assert isinstance(after, Shard)
        j = after.dim
        uneven = largest_after[j] * n != largest_before[j]
        sent = n * after_elements
        elements = sent if uneven else 0  # the input padded to n equal pieces
        if j != 0:  # the pieces regrouped to dim-0 blocks, the received one trimmed
            elements += sent + (after_elements if uneven else 0)
    elif kind is StepKind.ALL_TO_ALL:
        assert isinstance(before, Shard) and isinstance(after, Shard)
        i, j = before.dim, after.dim
        block = list(largest_before)
        block[j] = largest_after[j]
        sent = n * math.prod(block)
        uneven = largest_before[i] * n != largest_after[i] or largest_after[j] * n != largest_before[j]
        regroupings = (1 if uneven else 0) + (1 if i != 0 else 0) + (1 if j != 0 else 0)
        elements = sent * regroupings + (after_elements if uneven else 0)
    elif kind is StepKind.LOCAL_CHUNK:
        assert isinstance(after, Shard)
        elements = after_elements if after.dim != 0 else 0
    elif kind is StepKind.LOCAL_PARTIAL:
        assert isinstance(after, Partial)
        elements = before_elements if after.reduce_op == "sum" else 0
    elif kind is StepKind.SHARD_TO_PARTIAL:
        elements = after_elements + before_elements
    else:  # all-reduce (in place), relabel
        elements = 0
    return elements * itemsize


def step_bytes_per_rank(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    state: Placements,
    mesh_dim: int,
    after: Placement,
    itemsize: int,
) -> int:
    """Bytes the most loaded rank receives when ``state[mesh_dim]`` becomes ``after``.

    Raises ValueError when that is not a valid single step in ``state``.
    """
    kind = transition_kind(state, mesh_shape, mesh_dim, after)
    if kind is None:
        raise ValueError(
            f"{_fmt(state)} -> mesh dim {mesh_dim} = {after}: not a valid single redistribution step "
            f"on a mesh of shape {tuple(mesh_shape)}"
        )
    new_state = state[:mesh_dim] + (after,) + state[mesh_dim + 1 :]
    return _kind_bytes(
        kind,
        _largest_local_shape(global_shape, mesh_shape, state),
        _largest_local_shape(global_shape, mesh_shape, new_state),
        mesh_shape[mesh_dim],
        itemsize,
        after,
    )


def plan_bytes_per_rank(plan: Sequence[RedistributeStep]) -> int:
    """Total bytes the plan moves per rank (sum over its steps of the most loaded rank's bytes)."""
    return sum(step.bytes_per_rank for step in plan)


def plan_states(src: Placements, plan: Sequence[RedistributeStep]) -> list[Placements]:
    """The states a plan goes through, ``src`` first; checks that each step starts where the last ended."""
    states = [tuple(src)]
    for index, step in enumerate(plan):
        current = list(states[-1])
        for mesh_dim, before, after in step.changes:
            if current[mesh_dim] != before:
                raise ValueError(
                    f"step {index} ({step}) expects {before} on mesh dim {mesh_dim} but the plan has "
                    f"reached {_fmt(states[-1])}"
                )
            current[mesh_dim] = after
        states.append(tuple(current))
    return states


# -- search --------------------------------------------------------------------------------


def _fmt(state: Sequence[Placement]) -> str:
    return "(" + ", ".join(str(p) for p in state) + ")"


def _check_problem(
    global_shape: Sequence[int], mesh_shape: Sequence[int], src: Placements, dst: Placements, itemsize: int
) -> None:
    for name, state in (("source", src), ("target", dst)):
        if len(state) != len(mesh_shape):
            raise ValueError(
                f"{name} placements {_fmt(state)} have {len(state)} entries for a mesh of shape "
                f"{tuple(mesh_shape)}; expected one placement per mesh dim"
            )
        for mesh_dim, placement in enumerate(state):
            if isinstance(placement, Shard) and not 0 <= placement.dim < len(global_shape):
                raise ValueError(
                    f"{name} placements {_fmt(state)}: {placement!r} on mesh dim {mesh_dim} is out of range "
                    f"for a tensor of shape {tuple(global_shape)} (expected a normalised dim in "
                    f"[0, {len(global_shape) - 1}])"
                )
            if not isinstance(placement, (Shard, Replicate, Partial)):
                raise TypeError(
                    f"{name} placements {_fmt(state)}: {placement!r} on mesh dim {mesh_dim} is not a "
                    "Shard, Replicate or Partial"
                )
    if itemsize <= 0:
        raise ValueError(f"itemsize must be positive, got {itemsize}")


def _candidates(src: Placements, dst: Placements, tensor_ndim: int) -> list[list[Placement]]:
    """Placements a mesh dim may take on the way: R, every Shard, and the Partials of its ends.

    Other Partials never help: creating one is free but reducing it costs at least as
    much as the direct route.  Shards of tensor dims that neither end uses do help:
    they let an inner mesh dim step out of the way of an outer one cheaply.
    """
    shards: list[Placement] = [Shard(dim) for dim in range(tensor_ndim)]
    per_dim: list[list[Placement]] = []
    for src_placement, dst_placement in zip(src, dst):
        options: list[Placement] = [dst_placement]
        for option in [Replicate(), *shards, src_placement]:
            if option not in options:
                options.append(option)
        per_dim.append(options)
    return per_dim


def find_cheapest_plan(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    src: Placements,
    dst: Placements,
    itemsize: int,
    *,
    allow_joint_steps: bool = False,
    step_price: StepPrice | None = None,
) -> tuple[RedistributeStep, ...]:
    """The cheapest plan from ``src`` to ``dst``.

    ``step_price(kind, mesh dims, bytes received, bytes copied locally)``: what a step costs (any
    non-negative integer unit; the time model's picoseconds, a ``_cost_model.StepPricer``; copies
    per ``local_copy_bytes``, 0 for joint steps). Plans are then ranked by (total price,
    collectives, joint steps, bytes, steps): ties go to fewer collectives, then to plans without
    joint steps (PyTorch's one-dim steps), then to fewer bytes. Without it, by bytes per rank (then
    joint steps, collectives, steps): the plan when bandwidth alone counts, the lower-bound view.

    ``allow_joint_steps``: also consider steps changing several mesh dims with one collective over
    their joint group (the mesh must have those groups).

    ``step_price`` must be a pure function: the C++ search (used where no joint step is searched and
    the module is built) calls it once per distinct (kind, mesh dims, bytes, copied bytes).
    """
    src, dst = tuple(src), tuple(dst)
    _check_problem(global_shape, mesh_shape, src, dst, itemsize)
    if src == dst:
        return ()
    candidates = _candidates(src, dst, len(global_shape))
    joint_dim_sets = (
        _joint_dim_sets(mesh_shape)
        if allow_joint_steps and math.prod(mesh_shape) <= _JOINT_SEARCH_MAX_RANKS
        else []
    )
    if not joint_dim_sets:
        extension = _plan_search_extension()
        if extension is not None:
            plan = _search_in_cpp(extension, global_shape, mesh_shape, src, dst, itemsize, candidates, step_price)
            if plan is not None:
                return plan
    return _search_in_python(global_shape, mesh_shape, src, dst, itemsize, candidates, joint_dim_sets, step_price)


def _search_in_python(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    src: Placements,
    dst: Placements,
    itemsize: int,
    candidates: Sequence[Sequence[Placement]],
    joint_dim_sets: Sequence[tuple[int, ...]],
    step_price: StepPrice | None,
) -> tuple[RedistributeStep, ...]:
    """The search itself, in Python: the reference and the fallback of ``_search_in_cpp``.

    Uniform-cost search from ``src`` to ``dst`` (``src != dst``, both checked) over one-dim steps to
    ``candidates`` and joint steps over ``joint_dim_sets``; see ``find_cheapest_plan``. Pure work is
    done once: a step's price once per (kind, mesh dims, bytes, copied bytes), the largest local shape once per
    state (by torch.chunk arithmetic), a step's rules only into states not yet done, a step object
    only for the plan's own steps (``test_plan_search_ext`` checks this against the straightforward
    search on random problems).
    """
    all_boxes: dict[Placements, dict[tuple[int, ...], _Box]] = {}

    def boxes(state: Placements) -> dict[tuple[int, ...], _Box]:
        found = all_boxes.get(state)
        if found is None:
            found = _all_boxes(global_shape, mesh_shape, state)
            all_boxes[state] = found
        return found

    largest_shapes: dict[Placements, tuple[int, ...]] = {}
    # torch.chunk's first piece of an extent s >= 0 cut in n >= 1 is ceil(s / n): the local shape at
    # coordinate 0 is global_shape with each Shard's ceil division applied left to right. Other
    # sizes (negative, not plain ints) take the layout function, which says what is wrong with them.
    by_arithmetic = all(type(size) is int and size >= 0 for size in global_shape) and all(
        type(size) is int and size >= 1 for size in mesh_shape
    )

    def largest(state: Placements) -> tuple[int, ...]:
        shape = largest_shapes.get(state)
        if shape is None:
            if by_arithmetic:
                sizes = list(global_shape)
                for placement, size in zip(state, mesh_shape):
                    if isinstance(placement, Shard):
                        sizes[placement.dim] = -(-sizes[placement.dim] // size)
                shape = tuple(sizes)
            else:
                shape = _largest_local_shape(global_shape, mesh_shape, state)
            largest_shapes[state] = shape
        return shape

    prices: dict[tuple[StepKind, tuple[int, ...], int, int], int] = {}

    def price(kind: StepKind, mesh_dims: tuple[int, ...], moved: int, copied: int) -> int:
        key = (kind, mesh_dims, moved, copied)
        found = prices.get(key)
        if found is None:
            assert step_price is not None
            found = prices[key] = step_price(kind, mesh_dims, moved, copied)
        return found

    # By price: (price, collectives, joint steps, bytes, steps); by bytes: (bytes, joint steps,
    # collectives, bytes, steps). Every entry is an integer sum, so equal plans tie exactly.
    Cost = tuple[int, int, int, int, int]
    zero: Cost = (0, 0, 0, 0, 0)
    best: dict[Placements, Cost] = {src: zero}
    # state -> (the state before, its one-dim step's mesh dim, placement after, kind, bytes) or, for a
    # joint step, (the state before, the step): steps are built for the plan only.
    came_from: dict[Placements, tuple[Any, ...]] = {}
    order = itertools.count()
    frontier: list[tuple[Cost, int, Placements]] = [(zero, next(order), src)]
    done: set[Placements] = set()
    by_bytes = step_price is None
    one_dim_sets = [(mesh_dim,) for mesh_dim in range(len(mesh_shape))]

    while frontier:
        cost, _, state = heapq.heappop(frontier)
        if state in done:
            continue
        if state == dst:
            break
        done.add(state)
        c0, c1, c2, c3, c4 = cost
        for mesh_dim, options in enumerate(candidates):
            head, tail = state[:mesh_dim], state[mesh_dim + 1 :]
            for after in options:
                new_state = head + (after,) + tail
                if new_state in done:  # also every after equal to state[mesh_dim]: new_state is state
                    continue
                kind = transition_kind(state, mesh_shape, mesh_dim, after)
                if kind is None:
                    continue
                before_shape, after_shape = largest(state), largest(new_state)
                moved = _kind_bytes(kind, before_shape, after_shape, mesh_shape[mesh_dim], itemsize, after)
                collective = 1 if kind in _COLLECTIVE_KINDS else 0
                if by_bytes:
                    copied = 0  # the bandwidth view: received bytes only
                    new_cost = (c0 + moved, c1, c2 + collective, c3 + moved, c4 + 1)
                else:
                    copied = local_copy_bytes(
                        kind, before_shape, after_shape, mesh_shape[mesh_dim], itemsize, state[mesh_dim], after
                    )
                    step_cost = price(kind, one_dim_sets[mesh_dim], moved, copied)
                    new_cost = (c0 + step_cost, c1 + collective, c2, c3 + moved, c4 + 1)
                known = best.get(new_state)
                if known is None or new_cost < known:
                    best[new_state] = new_cost
                    came_from[new_state] = (state, mesh_dim, after, kind, moved, copied)
                    heapq.heappush(frontier, (new_cost, next(order), new_state))
        for mesh_dims, afters in _joint_moves(state, src, dst, joint_dim_sets, candidates):
            changed = list(state)
            for mesh_dim, after in zip(mesh_dims, afters):
                changed[mesh_dim] = after
            new_state = tuple(changed)
            if new_state in done:
                continue
            kind = joint_transition_kind(state, mesh_shape, mesh_dims, afters)
            if kind is None:
                continue
            elements = _joint_elements(kind, state, mesh_shape, mesh_dims, new_state, boxes(state), boxes(new_state))
            if not elements:
                continue  # pieces that do not fit, or nothing to move (a local step does that)
            joint = tuple((d, state[d], after) for d, after in zip(mesh_dims, afters))
            first_dim, first_before, first_after = joint[0]
            step = RedistributeStep(first_dim, first_before, first_after, kind, elements * itemsize, joint)
            moved = step.bytes_per_rank
            if by_bytes:
                new_cost = (c0 + moved, c1 + 1, c2 + 1, c3 + moved, c4 + 1)
            else:
                new_cost = (c0 + price(kind, step.mesh_dims, moved, 0), c1 + 1, c2 + 1, c3 + moved, c4 + 1)
            known = best.get(new_state)
            if known is None or new_cost < known:
                best[new_state] = new_cost
                came_from[new_state] = (state, step)
                heapq.heappush(frontier, (new_cost, next(order), new_state))
    if dst not in came_from:
        # Every state reaches all-Replicate and all-Replicate reaches every state, so this
        # means a bug in the transition rules, not bad input.
        raise AssertionError(f"no redistribution path from {_fmt(src)} to {_fmt(dst)} on mesh {tuple(mesh_shape)}")
    steps: list[RedistributeStep] = []
    state = dst
    while state != src:
        entry = came_from[state]
        if len(entry) == 2:
            state, step = entry
        else:
            state, mesh_dim, after, kind, moved, copied = entry
            step = RedistributeStep(mesh_dim, state[mesh_dim], after, kind, moved, local_copy_bytes=copied)
        steps.append(step)
    steps.reverse()
    return tuple(steps)


# -- the search in C++ (optional) ----------------------------------------------------------------

# The environment overrides of the plan_search / plan_search_ext options (``_options``).
PLAN_SEARCH_ENV_VAR = ENVIRONMENT_OVERRIDES["plan_search"]
PLAN_SEARCH_EXT_ENV_VAR = ENVIRONMENT_OVERRIDES["plan_search_ext"]
# The interface of dtensor_ops/csrc/plan_search.cpp this module speaks (its kInterfaceVersion).
_PLAN_SEARCH_INTERFACE_VERSION = 3
# plan_search.cpp's Kind codes, in order.
_CPP_STEP_KINDS = (
    StepKind.ALL_GATHER,
    StepKind.ALL_REDUCE,
    StepKind.REDUCE_SCATTER,
    StepKind.ALL_TO_ALL,
    StepKind.LOCAL_CHUNK,
    StepKind.LOCAL_PARTIAL,
    StepKind.SHARD_TO_PARTIAL,
    StepKind.RELABEL,
)
_CPP_STEP_KINDS_LIST = list(_CPP_STEP_KINDS)
# The collective kind that prices each (None: free), as StepPricer.one_dim_price_terms takes them.
_CPP_PRICED_KINDS = tuple(priced_kind(kind) for kind in _CPP_STEP_KINDS)
# Sizes the C++ search takes (its integers are 64-bit; larger ones go to the Python search).
_CPP_MAX_SIZE = 2**62


def _plan_search_extension() -> ModuleType | None:
    """The compiled ``_plan_search_ext`` (``dtensor_ops/csrc/plan_search.cpp``), or None: search in Python.

    None where it is not built (a source checkout without ``python dtensor_ops/csrc/build.py``,
    another platform), built from another interface version, or switched off by the ``plan_search``
    option (``SHARDWISE_PLAN_SEARCH=python``). The ``plan_search_ext`` option
    (``SHARDWISE_PLAN_SEARCH_EXT=<path>``) loads a built module from that path (a Bazel output, which
    does not sit inside the package).
    """
    options = current_options()
    if options.plan_search == "python":
        return None
    return _load_plan_search_extension(options.plan_search_ext)


@functools.cache
def _load_plan_search_extension(path: str | None) -> ModuleType | None:
    name = __name__.rpartition(".")[0] + "._plan_search_ext"
    try:
        if path and name not in sys.modules:
            loader = importlib.machinery.ExtensionFileLoader(name, path)
            module_spec = importlib.util.spec_from_file_location(name, path, loader=loader)
            if module_spec is None:
                return None
            module = importlib.util.module_from_spec(module_spec)
            loader.exec_module(module)
            sys.modules[name] = module
        else:
            module = importlib.import_module(name)
    except ImportError:
        return None
    if getattr(module, "INTERFACE_VERSION", None) != _PLAN_SEARCH_INTERFACE_VERSION:
        return None
    return module


def _index_of(options: Sequence[Placement], placement: Placement) -> int:
    """Where ``placement`` is among ``options``: by identity first (``_candidates`` puts src's and
    dst's own objects there), so no placement ``__eq__`` runs in the common case."""
    for index, option in enumerate(options):
        if option is placement:
            return index
    return list(options).index(placement)


def _search_in_cpp(
    extension: ModuleType,
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    src: Placements,
    dst: Placements,
    itemsize: int,
    candidates: Sequence[Sequence[Placement]],
    step_price: StepPrice | None,
) -> tuple[RedistributeStep, ...] | None:
    """``_search_in_python`` over one-dim steps (no joint steps), in C++; None where it cannot run it.

    The same plan, ties included (``test_plan_search_ext`` compares them on random problems).
    ``step_price`` is called once per distinct (kind, mesh dim, bytes, copied bytes), so it must be pure; where it
    returns something other than an int, or a sum leaves 64 bits, None (the Python search decides).
    """
    if (
        type(itemsize) is not int
        or itemsize >= _CPP_MAX_SIZE
        or any(type(size) is not int or not 1 <= size < _CPP_MAX_SIZE for size in mesh_shape)
        or any(type(size) is not int or not 0 <= size < _CPP_MAX_SIZE for size in global_shape)
    ):
        return None
    reduce_ops: dict[str, int] = {"sum": 0}  # plan_search.cpp's kSumOp: a sum's local split copies
    encoded = []
    for options in candidates:
        row = []
        for placement in options:
            if isinstance(placement, Shard):
                row.append((1, placement.dim, 0, False))
            elif isinstance(placement, Replicate):
                row.append((0, 0, 0, False))
            else:
                assert isinstance(placement, Partial)
                op = placement.reduce_op
                row.append((2, 0, reduce_ops.setdefault(op, len(reduce_ops)), op in _LINEAR_REDUCE_OPS))
        encoded.append(row)
    src_indices = [_index_of(options, placement) for options, placement in zip(candidates, src)]
    dst_indices = [_index_of(options, placement) for options, placement in zip(candidates, dst)]
    # A pricer that gives its prices as numbers is priced in C++ (StepPricer.one_dim_price_terms).
    terms_of = getattr(step_price, "one_dim_price_terms", None)
    found = extension.search(
        list(mesh_shape),
        list(global_shape),
        itemsize,
        encoded,
        src_indices,
        dst_indices,
        step_price,
        _CPP_STEP_KINDS_LIST,
        None if terms_of is None else terms_of(_CPP_PRICED_KINDS),
    )
    if found is None:
        return None
    # Each step's ``before`` is the object the Python search has there: src's own until the dim changes.
    current = list(src)
    steps = []
    for mesh_dim, after_index, kind_code, moved, copied in found:
        after = candidates[mesh_dim][after_index]
        steps.append(
            RedistributeStep(mesh_dim, current[mesh_dim], after, _CPP_STEP_KINDS[kind_code], moved, local_copy_bytes=copied)
        )
        current[mesh_dim] = after
    return tuple(steps)


def naive_greedy_plan(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    src: Placements,
    dst: Placements,
    itemsize: int,
) -> tuple[RedistributeStep, ...]:
    """A left-to-right greedy plan, the baseline the search is measured against.

    Mesh dims are fixed in order 0, 1, ...; when the direct step on a mesh dim is not
    valid, the inner mesh dims in the way are first made Replicate (innermost first), and
    a Partial -> other Partial change goes through Replicate.  Later iterations then
    re-shard those inner dims.  This is how a planner without search typically handles
    nested layouts, and it can pass through far more replicated data than needed.
    """
    src, dst = tuple(src), tuple(dst)
    _check_problem(global_shape, mesh_shape, src, dst, itemsize)
    steps: list[RedistributeStep] = []
    state = src

    def apply(mesh_dim: int, after: Placement) -> None:
        nonlocal state
        kind = transition_kind(state, mesh_shape, mesh_dim, after)
        assert kind is not None
        moved = step_bytes_per_rank(global_shape, mesh_shape, state, mesh_dim, after, itemsize)
        steps.append(RedistributeStep(mesh_dim, state[mesh_dim], after, kind, moved))
        state = state[:mesh_dim] + (after,) + state[mesh_dim + 1 :]

    def innermost_blocker(mesh_dim: int, after: Placement) -> int:
        """The innermost mesh dim after ``mesh_dim`` that keeps ``mesh_dim`` from becoming ``after``."""
        before = state[mesh_dim]
        for inner in range(len(state) - 1, mesh_dim, -1):
            placement = state[inner]
            if mesh_shape[inner] == 1:
                continue
            if isinstance(placement, Shard) and (
                (isinstance(before, Shard) and placement.dim == before.dim)
                or (isinstance(after, Shard) and placement.dim == after.dim)
            ):
                return inner
            if (
                isinstance(placement, Partial)
                and isinstance(before, Partial)
                and not reduce_ops_commute(before.reduce_op, placement.reduce_op)
            ):
                return inner
        raise AssertionError(f"greedy planner: nothing blocks mesh dim {mesh_dim} -> {after} in {_fmt(state)}")

    def change(mesh_dim: int, after: Placement) -> None:
        before = state[mesh_dim]
        if isinstance(before, Partial) and isinstance(after, Partial) and before.reduce_op != after.reduce_op:
            change(mesh_dim, Replicate())
        while transition_kind(state, mesh_shape, mesh_dim, after) is None:
            change(innermost_blocker(mesh_dim, after), Replicate())
        apply(mesh_dim, after)

    for mesh_dim, target in enumerate(dst):
        if state[mesh_dim] != target:
            change(mesh_dim, target)
    # Inner dims replicated on the way are re-sharded when the loop reaches them; a dim
    # already passed cannot be disturbed because blockers are always inner dims.
    assert state == dst, (state, dst)
    return tuple(steps)


# -- lower bound ---------------------------------------------------------------------------


def _all_coordinates(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(size) for size in mesh_shape)))


def _partials_compatible(src: Placement, dst: Placement) -> bool:
    """Whether ``src`` Partial values can become ``dst`` Partial values without talking to anyone.

    Same op: nothing to do.  sum <-> avg: scale by the mesh dim size.  (The planner does
    not take the second route — it changes a Partial's op only through Replicate or
    Shard — but a lower bound must hold for any algorithm.)
    """
    return (
        isinstance(src, Partial)
        and isinstance(dst, Partial)
        and (holds_same_values(src, dst) or (src.reduce_op in _LINEAR_REDUCE_OPS and dst.reduce_op in _LINEAR_REDUCE_OPS))
    )


def lower_bound_bytes_per_rank(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    src: Placements,
    dst: Placements,
    itemsize: int,
) -> int:
    """A lower bound on the bytes that the most loaded rank must receive, for any algorithm.

    Mesh dims that are Partial in both ``src`` and ``dst`` with compatible ops (equal, or
    sum/avg) need no reduction and split the problem into independent slices.  In a
    slice, every element of the global tensor has ``k`` distinct contributions (the
    product of the sizes of the other source Partial dims) and must reach ``m`` *target
    groups*: the ranks whose target shard contains it, grouped by their coordinates off
    the target's Partial dims (a group only needs the element as a decomposition over
    its members, so one copy inside the group is enough).  Then:

    * with ``k == 1``, every group that has no member already holding it receives it once;
    * with ``k > 1``, combining the contributions takes ``k - 1`` transfers and handing
      the result to the other groups ``m - 1`` more.

    The bound is ``max(total transfers / number of ranks, max over ranks of the elements
    it needs alone and does not hold in final form) * itemsize``, where "alone" means
    the rank's target group is just itself.  It is exact for the basic 1-D transitions
    with even shapes (all-gather, reduce-scatter, all-reduce, all-to-all) and a floor
    for everything else.
    """
    src, dst = tuple(src), tuple(dst)
    _check_problem(global_shape, mesh_shape, src, dst, itemsize)
    mesh_dims = range(len(mesh_shape))
    kept_partial = [d for d in mesh_dims if _partials_compatible(src[d], dst[d])]
    reduced_partial = [d for d in mesh_dims if isinstance(src[d], Partial) and d not in kept_partial]
    target_partial = [d for d in mesh_dims if isinstance(dst[d], Partial) and d not in kept_partial]
    group_coordinate_dims = [d for d in mesh_dims if d not in kept_partial and d not in target_partial]
    contributions = math.prod(mesh_shape[d] for d in reduced_partial)
    target_group_size = math.prod(mesh_shape[d] for d in target_partial)

    coordinates = _all_coordinates(mesh_shape)
    src_boxes = [compute_local_shape_and_global_offset(global_shape, mesh_shape, c, src) for c in coordinates]
    dst_boxes = [compute_local_shape_and_global_offset(global_shape, mesh_shape, c, dst) for c in coordinates]

    # Cut every tensor dim at every shard boundary: inside a cell, who holds and who
    # needs an element does not change.
    cuts: list[list[int]] = []
    for tensor_dim, extent in enumerate(global_shape):
        points = {0, extent}
        for shape, offset in src_boxes + dst_boxes:
            if shape[tensor_dim] > 0:
                points.update((offset[tensor_dim], offset[tensor_dim] + shape[tensor_dim]))
        cuts.append(sorted(points))
    cells_per_dim = [[(a, b) for a, b in zip(points, points[1:]) if b > a] for points in cuts]

    def contains(box: tuple[tuple[int, ...], tuple[int, ...]], cell: Sequence[tuple[int, int]]) -> bool:
        shape, offset = box
        return all(offset[d] <= start and end <= offset[d] + shape[d] for d, (start, end) in enumerate(cell))

    total_transfers = 0
    missing_per_rank = [0] * len(coordinates)
    for cell in itertools.product(*cells_per_dim):
        elements = math.prod(end - start for start, end in cell)
        # slice -> target group -> (members, whether a member holds the element)
        slices: dict[tuple[int, ...], dict[tuple[int, ...], tuple[list[int], list[bool]]]] = {}
        for rank, coordinate in enumerate(coordinates):
            if not contains(dst_boxes[rank], cell):
                continue
            groups = slices.setdefault(tuple(coordinate[d] for d in kept_partial), {})
            members, holds = groups.setdefault(tuple(coordinate[d] for d in group_coordinate_dims), ([], [False]))
            members.append(rank)
            if contributions == 1 and contains(src_boxes[rank], cell):
                holds[0] = True
        for groups in slices.values():
            if contributions > 1:
                total_transfers += elements * (contributions - 1 + len(groups) - 1)
                needy = [members for members, _ in groups.values()]
            else:
                needy = [members for members, holds in groups.values() if not holds[0]]
                total_transfers += elements * len(needy)
            if target_group_size == 1:
                for members in needy:
                    for rank in members:
                        missing_per_rank[rank] += elements
    average = -(-total_transfers // len(coordinates))
    return max(average, max(missing_per_rank, default=0)) * itemsize


# -- plans for specs (cached) ---------------------------------------------------------------------

# Caches are dicts cleared when full (_caches.store): a hit must stay a plain dict lookup.
_MAX_CACHE_ENTRIES = 8192

_ProblemKey = tuple[tuple[int, ...], tuple[int, ...], int, Placements, Placements, bool, tuple[object, ...]]


# -- planning ------------------------------------------------------------------------------


def _global_shape(spec: DTensorSpec[Any], role: str) -> tuple[int, ...]:
    if spec.tensor_meta is None:
        raise ValueError(
            f"redistribute needs the global shape: the {role} spec {spec} has no tensor_meta; "
            "expected a DTensorSpec built with a TensorMeta"
        )
    return tuple(spec.tensor_meta.shape)


def check_redistribute_specs(src: DTensorSpec[Any], dst: DTensorSpec[Any]) -> tuple[int, ...]:
    if src.mesh != dst.mesh:
        raise ValueError(
            f"cannot redistribute between meshes: source {src} is on {src.mesh!r}, target {dst} is on "
            f"{dst.mesh!r}; redistribute changes placements on one mesh"
        )
    src_shape = _global_shape(src, "source")
    dst_shape = _global_shape(dst, "target")
    if src_shape != dst_shape:
        raise ValueError(
            f"cannot redistribute a tensor of global shape {src_shape} ({src}) to global shape {dst_shape} "
            f"({dst}); redistribute keeps the global shape"
        )
    _check_complex_reductions(src, dst)
    return src_shape


# Reductions that are not elementwise on a complex number's (real, imag) pair, the form in which complex
# tensors travel (gloo has no complex types), and that c10d refuses for complex tensors: max and min (no
# order), product ((a + bi)(c + di) is not (ac) + (bd)i).
_NOT_COMPLEX_REDUCTIONS = frozenset({"product", "max", "min"})


def _check_complex_reductions(src: DTensorSpec[Any], dst: DTensorSpec[Any]) -> None:
    """Refuse, before any collective, a plan that would reduce complex contributions by product, max or min."""
    meta = src.tensor_meta
    if meta is None or not meta.dtype.is_complex:
        return
    mesh_shape = tuple(src.mesh.shape)
    for mesh_dim, (before, after) in enumerate(zip(src.placements, dst.placements)):
        reduce_op = getattr(before, "reduce_op", None) if isinstance(before, Partial) else None
        if reduce_op in _NOT_COMPLEX_REDUCTIONS and before != after and mesh_shape[mesh_dim] > 1:
            raise ValueError(
                f"cannot redistribute {src} -> {dst}: mesh dim {mesh_dim} is Partial({reduce_op!r}) of a "
                f"{meta.dtype} tensor, and {reduce_op} is not a reduction defined for complex values here "
                "(collectives move complex numbers as (real, imag) pairs; c10d refuses it too); expected "
                "Partial('sum') or Partial('avg') for complex tensors"
            )


def mesh_supports_joint_steps(mesh: Any) -> bool:
    """Whether ``mesh`` has a process group for every set of its dims (so joint steps can run on it)."""
    supports = getattr(mesh, "_supports_joint_groups", None)
    return bool(supports()) if supports is not None else False


def plan_redistribute(src: DTensorSpec[Any], dst: DTensorSpec[Any]) -> tuple[RedistributeStep, ...]:
    """The fastest plan from ``src`` to ``dst`` under the mesh's cost profile; ``()`` when they match.

    Both specs need ``tensor_meta`` and the same mesh and global shape.  Joint steps are
    considered when the mesh has a process group for every set of its dims
    (``DeviceMesh._supports_joint_groups()``) and the shape is concrete.  Cached.
    """
    if src.has_explicit_shard_order or dst.has_explicit_shard_order:
        # Planned on the _StridedShard form of the same layouts (see shardwise.placement._shard_order).
        return plan_redistribute(src.as_layout_spec(), dst.as_layout_spec())
    joint = mesh_supports_joint_steps(src.mesh)
    pricer = pricer_for_mesh(src.mesh)
    key = (src, dst, joint, pricer.setting)
    plan = lookup(SHARED_CACHES.plans_by_specs, key)
    if plan is SYMBOLIC:
        return _plan_for_symbolic_shape(src, dst)
    if plan is not None:
        return plan
    global_shape = check_redistribute_specs(src, dst)
    assert src.tensor_meta is not None
    if (_is_strided(src) or _is_strided(dst)) and not (
        _strided_only_on_size_one_dims(global_shape, src) and _strided_only_on_size_one_dims(global_shape, dst)
    ):
        plan = _plan_strided(global_shape, src, dst, pricer) if src != dst else ()
    else:
        plan = _plan_problem(global_shape, src, dst, joint, pricer)
    store(SHARED_CACHES.plans_by_specs, key, plan, _MAX_CACHE_ENTRIES)
    return plan


def _strided_only_on_size_one_dims(global_shape: tuple[int, ...], spec: DTensorSpec[Any]) -> bool:
    """Whether every ``_StridedShard`` of ``spec`` sits on a mesh dim of size 1 and the layout is, at every
    coordinate, the one with Replicate there (one piece of a strided cut is every index; checked on
    the layout function, not assumed). Those dims are then relabelled like any size-1 dim."""
    mesh_shape = tuple(spec.mesh.shape)
    strided = [d for d, p in enumerate(spec.placements) if type(p) is _StridedShard]
    if not strided:
        return True
    if any(mesh_shape[d] != 1 for d in strided):
        return False
    plain = tuple(Replicate() if d in strided else p for d, p in enumerate(spec.placements))
    # The executor reads pieces by index runs (strided steps) and by (shape, offset) boxes (the others).
    return all(
        local_index_runs(global_shape, mesh_shape, coordinate, spec.placements)
        == local_index_runs(global_shape, mesh_shape, coordinate, plain)
        and compute_local_shape_and_global_offset(global_shape, mesh_shape, coordinate, spec.placements)
        == compute_local_shape_and_global_offset(global_shape, mesh_shape, coordinate, plain)
        for coordinate in _all_coordinates(mesh_shape)
    )


def _plan_problem(
    global_shape: tuple[int, ...], src: DTensorSpec[Any], dst: DTensorSpec[Any], joint: bool, pricer: StepPricer
) -> tuple[RedistributeStep, ...]:
    """The plan for this global shape (concrete ints), memoised by the problem alone (not the specs)."""
    assert src.tensor_meta is not None
    mesh_shape = tuple(src.mesh.shape)
    itemsize = src.tensor_meta.dtype.itemsize
    problem: _ProblemKey = (mesh_shape, global_shape, itemsize, src.placements, dst.placements, joint, pricer.cache_key)
    plan = SHARED_CACHES.plans_by_problem.get(problem)
    if plan is None:
        if 1 in mesh_shape:
            plan = _plan_without_size_one_dims(global_shape, mesh_shape, src.placements, dst.placements, itemsize, joint, pricer)
        else:
            plan = find_cheapest_plan(
                global_shape,
                mesh_shape,
                src.placements,
                dst.placements,
                itemsize,
                allow_joint_steps=joint,
                step_price=pricer,
            )
        store(SHARED_CACHES.plans_by_problem, problem, plan, _MAX_CACHE_ENTRIES)
    return plan


# -- mesh dims of size 1 (see "Mesh dims of size 1" in the module docstring) -------------------------


def relabel_size_one_dims(mesh_shape: Sequence[int], src: Placements, dst: Placements) -> tuple[RedistributeStep, ...]:
    """The free steps that set every mesh dim of size 1 from its ``src`` placement to its ``dst`` one.

    A group of one rank: whatever the placement, that rank holds the whole tensor's values along the
    dim (one Shard piece is the whole extent, a reduction over one contribution is that contribution),
    so each change is a ``RELABEL`` (the executor keeps the local tensor). A Partial of another reduce
    op goes through Replicate, as ``transition_kind`` allows one-dim steps on such a dim.
    """
    steps: list[RedistributeStep] = []
    for mesh_dim, (before, after) in enumerate(zip(src, dst)):
        if mesh_shape[mesh_dim] != 1 or before == after:
            continue
        if isinstance(before, Partial) and isinstance(after, Partial) and not holds_same_values(before, after):
            replicate = Replicate()
            steps.append(RedistributeStep(mesh_dim, before, replicate, StepKind.RELABEL, 0))
            before = replicate
        steps.append(RedistributeStep(mesh_dim, before, after, StepKind.RELABEL, 0))
    return tuple(steps)


def without_size_one_dims(mesh_shape: Sequence[int], placements: Placements) -> Placements:
    """``placements`` on the mesh without its dims of size 1 (the same objects, in mesh dim order)."""
    return tuple(p for p, size in zip(placements, mesh_shape) if size != 1)


def lift_plan(plan: Sequence[RedistributeStep], kept_dims: Sequence[int]) -> tuple[RedistributeStep, ...]:
    """A plan found on the mesh without its dims of size 1, its mesh dims renumbered to the full mesh's."""
    return tuple(
        dataclasses.replace(
            step,
            mesh_dim=kept_dims[step.mesh_dim],
            joint=tuple((kept_dims[d], before, after) for d, before, after in step.joint),
        )
        for step in plan
    )


class _PriceOnKeptDims:
    """A step price on the mesh without its dims of size 1: mesh dims renumbered to the full mesh's."""

    __slots__ = ("inner", "kept_dims")

    def __init__(self, inner: StepPrice, kept_dims: tuple[int, ...]) -> None:
        self.inner = inner
        self.kept_dims = kept_dims

    def __call__(self, kind: StepKind, mesh_dims: tuple[int, ...], moved: int, copied: int) -> int:
        return self.inner(kind, tuple(self.kept_dims[d] for d in mesh_dims), moved, copied)


class _PricerOnKeptDims(_PriceOnKeptDims):
    """``_PriceOnKeptDims`` of a pricer that hands the C++ search its prices as numbers (``StepPricer``)."""

    __slots__ = ()

    def one_dim_price_terms(self, priced_kinds: Sequence[str | None]) -> list[Any]:
        rows = self.inner.one_dim_price_terms(priced_kinds)  # type: ignore[attr-defined]
        return [rows[d] for d in self.kept_dims]


def find_cheapest_plan_without_size_one_dims(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    src: Placements,
    dst: Placements,
    itemsize: int,
    *,
    allow_joint_steps: bool = False,
    step_price: StepPrice | None = None,
) -> tuple[RedistributeStep, ...]:
    """The plan ``plan_redistribute`` runs: ``relabel_size_one_dims`` first, then ``find_cheapest_plan``'s plan
    on the mesh with its dims of size 1 removed (``lift_plan``).

    On a mesh without such dims it is ``find_cheapest_plan``'s plan. Otherwise the search costs what it
    costs on the smaller mesh (a (1, 2, 1, 2) mesh searches as (2, 2) does, where the full search's
    states grow as the candidates to the power of the mesh's dims), and the plan is as fast: a size-1
    dim only ever relabels (free), it splits no nested shard and orders no Partial reduction. Pieces and
    prices are those of the full mesh (a step's mesh dims are renumbered before ``step_price`` sees them).
    """
    src, dst = tuple(src), tuple(dst)
    _check_problem(global_shape, mesh_shape, src, dst, itemsize)
    if 1 not in mesh_shape:
        return find_cheapest_plan(
            global_shape, mesh_shape, src, dst, itemsize, allow_joint_steps=allow_joint_steps, step_price=step_price
        )
    kept_dims = tuple(d for d, size in enumerate(mesh_shape) if size != 1)
    reduced_price: StepPrice | None = None
    if step_price is not None:
        wrapper = _PricerOnKeptDims if hasattr(step_price, "one_dim_price_terms") else _PriceOnKeptDims
        reduced_price = wrapper(step_price, kept_dims)
    reduced = find_cheapest_plan(
        global_shape,
        tuple(mesh_shape[d] for d in kept_dims),
        without_size_one_dims(mesh_shape, src),
        without_size_one_dims(mesh_shape, dst),
        itemsize,
        allow_joint_steps=allow_joint_steps,
        step_price=reduced_price,
    )
    return relabel_size_one_dims(mesh_shape, src, dst) + lift_plan(reduced, kept_dims)


def _plan_without_size_one_dims(
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    src: Placements,
    dst: Placements,
    itemsize: int,
    joint: bool,
    pricer: StepPricer,
) -> tuple[RedistributeStep, ...]:
    """``find_cheapest_plan_without_size_one_dims`` with the search memoised by the reduced problem: layouts
    that differ only on size-1 dims (every placement a strategy may put there) share one search."""
    kept_dims = tuple(d for d, size in enumerate(mesh_shape) if size != 1)
    reduced_mesh = tuple(mesh_shape[d] for d in kept_dims)
    reduced_src, reduced_dst = without_size_one_dims(mesh_shape, src), without_size_one_dims(mesh_shape, dst)
    # The reduced search prices steps on the full mesh's dims: the renumbering is part of the key.
    problem: _ProblemKey = (
        reduced_mesh, global_shape, itemsize, reduced_src, reduced_dst, joint, ("kept mesh dims", kept_dims, pricer.cache_key)
    )
    reduced = () if reduced_src == reduced_dst else SHARED_CACHES.plans_by_problem.get(problem)
    if reduced is None:
        reduced = find_cheapest_plan(
            global_shape,
            reduced_mesh,
            reduced_src,
            reduced_dst,
            itemsize,
            allow_joint_steps=joint,
            step_price=_PricerOnKeptDims(pricer, kept_dims),
        )
        store(SHARED_CACHES.plans_by_problem, problem, reduced, _MAX_CACHE_ENTRIES)
    return relabel_size_one_dims(mesh_shape, src, dst) + lift_plan(reduced, kept_dims)


def _plan_for_symbolic_shape(src: DTensorSpec[Any], dst: DTensorSpec[Any]) -> tuple[RedistributeStep, ...]:
    """The plan for specs with symbolic (SymInt) global shapes, while torch.compile traces with dynamic shapes.

    Planned for the traced example's sizes, which adds no guard: every plan is correct for any shape
    (execution pads and trims by the actual sizes), only its cost ranking used the example. What a
    plan depends on is then concrete (the example sizes, placements, mesh, pricer), so it is memoised
    by that problem: retracing, or another spec with the same example sizes, searches no more. One-dim
    steps only (a joint step's cost looks at every rank's piece).
    """
    try:
        from torch.fx.experimental.symbolic_shapes import optimization_hint
    except ImportError:  # torch before 2.13 (the GPU image's 2.11) names it hint_int
        from torch.fx.experimental.symbolic_shapes import hint_int as optimization_hint  # type: ignore[attr-defined,no-redef]

    global_shape = check_redistribute_specs(src, dst)
    example_shape = tuple(int(optimization_hint(size)) for size in global_shape)
    if _is_strided(src) or _is_strided(dst):
        # Whole gathers only: whether one mesh dim's pieces line up depends on the sizes, and the plan
        # must hold for every size the graph takes.
        return _plan_strided(example_shape, src, dst, pricer_for_mesh(src.mesh), exact_gathers=False) if src != dst else ()
    return _plan_problem(example_shape, src, dst, False, pricer_for_mesh(src.mesh))


# -- strided layouts (see "Strided layouts" above) ----------------------------------------------


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


def _plan_strided(
    global_shape: tuple[int, ...],
    src: DTensorSpec[Any],
    dst: DTensorSpec[Any],
    pricer: StepPricer,
    *,
    exact_gathers: bool = True,
) -> tuple[RedistributeStep, ...]:
    """The cheapest valid plan between layouts of which one at least has a ``_StridedShard`` ("Strided layouts")."""
    assert src.tensor_meta is not None
    mesh_shape = tuple(src.mesh.shape)
    itemsize = src.tensor_meta.dtype.itemsize
    source, target = src.placements, dst.placements
    replicated = src.with_placements([Replicate()] * len(source))
    if _is_strided(src) and src.has_partial():
        raise NotImplementedError(
            f"redistribute {src} -> {dst}: a layout with both a _StridedShard and a Partial mesh dim; "
            "expected the Partial mesh dims reduced first"
        )
    if _is_strided(dst) and dst.has_partial():
        raise NotImplementedError(f"redistribute {src} -> {dst}: a target with _StridedShard and Partial")
    candidates: list[tuple[RedistributeStep, ...]] = []
    if _is_strided(src):
        if exact_gathers:
            # Gather one strided mesh dim where that is exact, then the best plan from there (recursively:
            # the layout left has one strided dim fewer; the target itself when that gather reaches it).
            for mesh_dim, placement in enumerate(source):
                if type(placement) is not _StridedShard:
                    continue
                middle = src.with_placements([Replicate() if m == mesh_dim else p for m, p in enumerate(source)])
                if strided_gather_dim(global_shape, mesh_shape, source, middle.placements) is None:
                    continue
                first = _strided_all_gather_step(global_shape, mesh_shape, source, mesh_dim, itemsize)
                rest = plan_redistribute(middle, dst) if middle.placements != target else ()
                candidates.append((first, *rest))
        whole = (_gather_whole_step(global_shape, mesh_shape, source, itemsize),)
        if dst.placements == replicated.placements:
            candidates.append(whole)
        elif dst.has_partial():
            candidates.append((*whole, *plan_redistribute(replicated, dst)))
        else:
            candidates.append((*whole, _select_local_step(global_shape, mesh_shape, target, itemsize)))
    else:
        to_replicated = plan_redistribute(src, replicated) if src.placements != replicated.placements else ()
        candidates.append((*to_replicated, _select_local_step(global_shape, mesh_shape, target, itemsize)))

    def price(plan: tuple[RedistributeStep, ...]) -> tuple[int, int]:
        time = sum(pricer.step_picoseconds(s.kind, s.mesh_dims, s.bytes_per_rank, s.local_copy_bytes) for s in plan)
        return time, sum(1 for s in plan if s.kind.is_collective)

    return min(candidates, key=price)  # the first of equals: the listed order is the preference


def _plan_that_prices(src: DTensorSpec[Any], dst: DTensorSpec[Any]) -> tuple[RedistributeStep, ...]:
    """The plan whose steps price redistributing ``src`` to ``dst`` (``()`` when they match): the plan that runs."""
    src, dst = src.as_layout_spec(), dst.as_layout_spec()
    return () if src == dst else plan_redistribute(src, dst)


def redistribute_cost_bytes(src: DTensorSpec[Any], dst: DTensorSpec[Any]) -> int:
    """Bytes per rank that redistributing ``src`` to ``dst`` moves (0 when they match)."""
    return plan_bytes_per_rank(_plan_that_prices(src, dst))


def redistribute_cost_picoseconds(src: DTensorSpec[Any], dst: DTensorSpec[Any]) -> int:
    """Picoseconds redistributing ``src`` to ``dst`` takes under the mesh's cost profile (0 when they match).

    Whole picoseconds, as the planner sums them, so equal plans cost exactly the same.
    """
    plan = _plan_that_prices(src, dst)
    if not plan:
        return 0
    pricer = pricer_for_mesh(src.mesh)
    return sum(
        pricer.step_picoseconds(step.kind, step.mesh_dims, step.bytes_per_rank, step.local_copy_bytes) for step in plan
    )


def redistribute_lower_bound_bytes(src: DTensorSpec[Any], dst: DTensorSpec[Any]) -> int:
    """A floor on the bytes per rank any algorithm must move (see ``lower_bound_bytes_per_rank``)."""
    global_shape = check_redistribute_specs(src, dst)
    assert src.tensor_meta is not None
    return lower_bound_bytes_per_rank(
        global_shape, tuple(src.mesh.shape), src.placements, dst.placements, src.tensor_meta.dtype.itemsize
    )
