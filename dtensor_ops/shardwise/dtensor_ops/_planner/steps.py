"""The planner's model: states, one-mesh-dim steps, their validity and their bytes.

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

Mixed Partial kinds: when several mesh dims are Partial with different reduce ops,
the logical value is ``reduce_0(reduce_1(...reduce_{n-1}(locals)))`` — the last mesh
dim is reduced first.  Reducing mesh dim ``d`` before the partial dims after it is
therefore valid only when its op commutes with theirs (equal ops, or both linear:
sum/avg).  Creating a Partial (R->P, S->P) is valid in any state.
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from shardwise.placement import Partial, Placement, Replicate, Shard, compute_local_shape_and_global_offset, holds_same_values

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
    (``_executor_steps``: a step's ``prepare`` and ``finish``) copies around the collective.

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



# -- problems ------------------------------------------------------------------------------


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


def _all_coordinates(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(size) for size in mesh_shape)))

