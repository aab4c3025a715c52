"""Redistribution: move a DTensor's local shard from one placement tuple to another.

Three layers:

1. ``_planner.plan_redistribute`` — the cheapest plan, plain data, cached by
   ``(source spec, target spec)`` and by the underlying problem
   ``(mesh shape, global shape, item size, placements)``.
2. A per-rank *program*: the plan with this rank's group names, padded sizes, offsets
   and trims worked out once, cached by ``(source spec, target spec)``.  Plain data too.
3. Execution (:func:`_run_steps`, the one executor): a loop over the program's steps issuing
   ``torch.ops._c10d_functional`` collectives and local tensor ops, for this rank or, under
   torch's LocalTensorMode, for every simulated rank (each runs its own program on its piece,
   each collective is issued once for all of them).  A call that hits the cache does one dict
   lookup, one shape check and then only the tensor work.

Uneven shards: before a collective every rank pads its piece to the group's largest
piece (torch.chunk puts the largest pieces first, so once the pieces are concatenated
the real data is a prefix, and trimming is a single ``narrow``).

Asynchronous execution (``async_op=True``): collectives before the last one are waited
for immediately (the next step reads their result); the last collective is left in
flight and the function returns an :class:`~shardwise.dtensor_ops._collectives.AsyncCollectiveTensor`
with the final local shape.  Its first use waits, trims and runs any local steps that
follow.  A plan with no collective returns a plain tensor either way.

Autograd: :func:`gradient_placements` is the one rule for where a gradient goes back to
(:func:`grad_target_spec` applies it to a redistribution) — see its docstring.  The executor itself is not differentiable (the
functional collectives have no autograd formulas); the DTensor's ``redistribute``
autograd.Function calls it in forward and again, mirrored, in backward.
"""

from __future__ import annotations

import dataclasses
import math
from itertools import product as _product
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, cast

import torch
import torch.distributed._functional_collectives as funcol
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from shardwise.placement import (
    DTensorSpec,
    Partial,
    Placement,
    Replicate,
    Shard,
    TensorMeta,
    _StridedShard,
    chunk_size_and_offset,
    compute_local_shape_and_global_offset,
    contiguous_strides,
    local_index_runs,
    norm_order_of,
    pad_dim,
    shard_sizes_along_mesh_dim,
)

from shardwise.mesh import _simulation as simulation

try:
    from torch.utils._debug_mode import get_active_debug_mode as _active_debug_mode
except ImportError:  # a torch without DebugMode records nothing

    def _active_debug_mode() -> Any:  # type: ignore[misc]
        return None


from ._caches import RANK_CACHES, SHARED_CACHES, SYMBOLIC, lookup, store
from ._collectives import (
    AsyncCollectiveTensor,
    c10d_reduce_op,
    launch_all_gather,
    launch_all_reduce,
    launch_all_to_all,
    launch_all_to_all_exact,
    launch_all_gather_one_round,
    launch_reduce_scatter_one_round,
    one_round_collectives,
    reduce_in_dtype,
    reduce_received_blocks,
    from_reduced,
    to_reducible,
    launch_reduce_scatter,
    mark_arrived,
    mesh_group_names,
    wait,
    wait_local_tensor,
)
from ._planner import (
    Placements,
    RedistributeStep,
    StepKind,
    check_redistribute_specs,
    joint_collective_dims,
    largest_piece_shape,
    run_indices,
    run_length,
    plan_bytes_per_rank,
    plan_redistribute,
    plan_states,
    redistribute_cost_bytes,
    redistribute_lower_bound_bytes,
)

__all__ = [
    "RedistributeStep",
    "StepKind",
    "gradient_placements",
    "grad_target_spec",
    "plan_bytes_per_rank",
    "plan_redistribute",
    "redistribute_cost_bytes",
    "redistribute_local_tensor",
    "redistribute_lower_bound_bytes",
]

# Programs hold this rank's offsets and sizes: rank-local.  Cleared when full (see _planner).
_MAX_PROGRAMS = 8192

# -- autograd ------------------------------------------------------------------------------


def gradient_placements(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """Where the gradient of a tensor laid out with ``placements`` goes back to: the one rule.

    The adjoint of summing partial values is handing every rank the whole gradient, so
    ``Partial`` (any reduce op) becomes ``Replicate``; Shard and Replicate are kept, so an
    input's gradient is laid out like the input.
    """
    if not any(isinstance(placement, Partial) for placement in placements):
        return placements
    return tuple(Replicate() if isinstance(placement, Partial) else placement for placement in placements)


def gradient_placements_for(source: tuple[Placement, ...], grad: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """Where the gradient arriving as ``grad`` goes back to, for a redistribution from ``source``.

    :func:`gradient_placements`, except that a ``Partial`` source mesh dim whose gradient arrives
    as that same ``Partial`` keeps it: a Partial -> Partial redistribution is the identity on the
    contributions, so its backward is too (no collective), as in PyTorch.
    """
    result = gradient_placements(source)
    if result is source:
        return source
    return tuple(
        g if isinstance(s, Partial) and g == s else r for s, g, r in zip(source, grad, result)
    )


def grad_target_spec(
    src: DTensorSpec[Any], dst: DTensorSpec[Any], grad_spec: DTensorSpec[Any] | None = None
) -> DTensorSpec[Any]:
    """Where the gradient of ``redistribute(src -> dst)`` must be redistributed to in backward.

    The gradient of a DTensor is a DTensor of the same global shape whose *logical*
    value is dL/d(logical value); any placement holding that value is correct, so the
    rule is about what is useful and cheap:

    * Shard / Replicate mesh dims of ``src``: the gradient goes back to the same
      placement (the mirrored plan), so the input's gradient is laid out like the input.
    * Partial mesh dims of ``src`` (any reduce op): Replicate.  The local values of a
      Partial are not the tensor, only contributions to it; the gradient of the logical
      value is the same for every contribution's owner (for sum exactly dL/dy on every
      rank; for avg/max/min the DTensor-level gradient is still dL/dy — the 1/n of avg or
      the arg-max selection belong to the op that produced the Partial, not to the
      placement), so every rank gets the full gradient.
    * ``dst`` plays no role in the target: the gradient arrives with whatever placements
      the ops after the redistribution gave it (``grad_spec``: often ``dst``, but a
      Partial ``dst`` may well get a Replicate or Shard gradient, and a Replicate ``dst``
      a Partial(sum) gradient), and the planner finds the cheapest way from there.  A
      Partial ``dst`` needs no special handling: R -> P in forward was a local op whose
      logical value is its input's, so its gradient flows through unchanged.

    ``grad_spec`` (the gradient's actual spec) supplies the tensor_meta (stride, dtype)
    of the result; without it ``src``'s is used.
    """
    placements = gradient_placements(src.placements)
    tensor_meta = grad_spec.tensor_meta if grad_spec is not None else src.tensor_meta
    if placements == src.placements and tensor_meta == src.tensor_meta:
        return src
    return DTensorSpec(src.mesh, placements, tensor_meta)


# -- per-rank programs -----------------------------------------------------------------------


_Region = tuple[tuple[int, ...], tuple[int, ...]]  # (start, size) per tensor dim


@dataclass(frozen=True, slots=True)
class _JointLayout:
    """This rank's part in a joint step (one collective over the joint group of several mesh dims).

    All-to-all: ``send_regions[i]`` is the part of the local piece sent to group member ``i`` and
    ``receive_regions[i]`` where member ``i``'s part lands in the new piece (None: nothing);
    ``input_splits``/``output_splits`` their element counts.  Reduce-scatter: ``send_regions[i]``
    is member ``i``'s new piece inside the local block, every piece padded to ``padded_shape``.
    """

    send_regions: tuple[_Region | None, ...]
    receive_regions: tuple[_Region | None, ...]
    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]
    padded_shape: tuple[int, ...]
    # All-to-all with reduction: member i's part is of contribution ``receive_slots[i]`` (row-major over
    # the Partial dims of the group, whose sizes are ``slot_shape`` and reduce ops ``slot_ops``).
    receive_slots: tuple[int, ...] = ()
    slot_shape: tuple[int, ...] = ()
    slot_ops: tuple[str, ...] = ()


IndexRuns = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class _StridedLayout:
    """This rank's part in a step into or out of a ``_StridedShard`` layout, whose pieces are index runs.

    Strided all-gather: every member sends its piece padded to ``padded_shape``; member ``i``'s real
    extent along ``tensor_dim`` is ``member_sizes[i]`` and the pieces, in order, are the new piece.
    Gather whole: one all-gather per entry of ``gather_groups`` ((group name, size), innermost mesh dim
    first) of the piece padded to ``padded_shape``; the block then holds the pieces of
    ``piece_runs`` (per rank of the gathered dims, row-major: its index runs per tensor dim).
    Select local: ``piece_runs[0]`` are this rank's runs of the whole tensor.
    """

    padded_shape: tuple[int, ...]
    tensor_dim: int = -1
    member_sizes: tuple[int, ...] = ()
    gather_groups: tuple[tuple[str, int], ...] = ()
    piece_runs: tuple[tuple[IndexRuns, ...], ...] = ()
    global_shape: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class _ExecStep:
    """One plan step with everything this rank needs to run it, precomputed.

    Each field means one thing for every kind (the defaults, 0 or -1, where a kind has no such dim):
    ``from_dim`` is the tensor dim a step un-shards (all-gather, all-to-all, S->P) and ``to_dim``
    the one it shards (chunk, reduce-scatter, all-to-all).  Along ``from_dim``: ``from_piece`` is
    the padded piece every member sends, ``joined`` the real size once un-sharded and
    ``from_offset`` where this rank's piece starts in it.  Along ``to_dim``: ``to_piece`` is the
    padded piece each member receives, ``kept`` this rank's real size once sharded and
    ``to_offset`` where this rank's piece starts in the current extent.
    """

    kind: StepKind
    group_name: str
    group_size: int
    index_in_group: int
    reduce_op: str
    sends_nothing: bool
    shape_before: tuple[int, ...]
    shape_after: tuple[int, ...]
    from_dim: int = -1
    to_dim: int = -1
    from_piece: int = 0
    to_piece: int = 0
    joined: int = 0
    kept: int = 0
    from_offset: int = 0
    to_offset: int = 0
    joint: _JointLayout | None = None
    # A reduce-scatter or all-gather run as one all-to-all (_collectives.one_round_collectives).
    one_round: bool = False
    strided: _StridedLayout | None = None


@dataclass(frozen=True, slots=True)
class _Program:
    src_local_shape: tuple[int, ...]
    dst_local_shape: tuple[int, ...]
    steps: tuple[_ExecStep, ...]
    last_collective: int  # index into steps, -1 when there is none
    participating: bool
    # Meshes compare equal by their ranks, but a mesh rebuilt after the process groups
    # were recreated has other groups: a program is reused as is only for the mesh object
    # it was compiled for, or one with the same group names.
    mesh: Any
    group_names: tuple[str, ...]
    joint_groups: tuple[tuple[tuple[int, ...], tuple[str, tuple[int, ...]]], ...] = ()




def _compile_program(src: DTensorSpec[Any], dst: DTensorSpec[Any], plan: tuple[RedistributeStep, ...]) -> _Program:
    mesh = src.mesh
    mesh_shape = tuple(mesh.shape)
    global_shape = check_redistribute_specs(src, dst)
    coordinate_or_none = mesh.get_coordinate()
    if coordinate_or_none is None:
        return _Program(
            src_local_shape=(0,) * len(global_shape),
            dst_local_shape=(0,) * len(global_shape),
            steps=(),
            last_collective=-1,
            participating=False,
            mesh=mesh,
            group_names=(),
        )
    coordinate = tuple(coordinate_or_none)
    group_names = mesh_group_names(mesh) if any(step.kind.is_collective for step in plan) else ()

    def local_shape(state: Placements) -> tuple[int, ...]:
        return compute_local_shape_and_global_offset(global_shape, mesh_shape, coordinate, state)[0]

    states = plan_states(src.placements, plan)
    steps: list[_ExecStep] = []
    joint_groups: dict[tuple[int, ...], tuple[str, tuple[int, ...]]] = {}
    for step, before_state, after_state in zip(plan, states, states[1:]):
        if step.kind.is_strided:
            steps.append(
                _compile_strided_step(
                    step, before_state, after_state, global_shape, mesh, coordinate, group_names, local_shape
                )
            )
            continue
        if step.kind is StepKind.JOINT_ALL_REDUCE:
            steps.append(_compile_joint_all_reduce(step, local_shape(before_state), mesh, joint_groups))
            continue
        if step.joint:
            steps.append(
                _compile_joint_step(step, before_state, after_state, global_shape, mesh, coordinate, joint_groups)
            )
            continue
        mesh_dim = step.mesh_dim
        group_size = mesh_shape[mesh_dim]
        index_in_group = coordinate[mesh_dim]
        before, after = step.before, step.after
        shape_before, shape_after = local_shape(before_state), local_shape(after_state)
        from_dim = before.dim if isinstance(before, Shard) else -1
        to_dim = after.dim if isinstance(after, Shard) else -1
        reduce_op = (
            before.reduce_op
            if isinstance(before, Partial)
            else after.reduce_op if isinstance(after, Partial) else ""
        )
        from_piece = to_piece = joined = kept = from_offset = to_offset = 0
        if from_dim >= 0 and step.kind is not StepKind.RELABEL:
            pieces = shard_sizes_along_mesh_dim(
                global_shape, mesh_shape, coordinate, before_state, mesh_dim=mesh_dim, tensor_dim=from_dim
            )
            from_piece = max(pieces)
            joined = sum(pieces)
            from_offset = sum(pieces[:index_in_group])
            assert joined == shape_after[from_dim], (pieces, shape_after, step)
        if to_dim >= 0 and step.kind is not StepKind.RELABEL:
            extent = shape_before[to_dim]
            to_piece = -(-extent // group_size)
            kept, to_offset = chunk_size_and_offset(extent, group_size, index_in_group)
            assert kept == shape_after[to_dim], (extent, shape_after, step)
        # Every member of the group sends the same padded shape, so all of them agree on
        # skipping a collective that would move nothing.
        sent = list(shape_before)
        if step.kind in (StepKind.ALL_GATHER, StepKind.ALL_TO_ALL):
            sent[from_dim] = from_piece
        if step.kind in (StepKind.REDUCE_SCATTER, StepKind.ALL_TO_ALL):
            sent[to_dim] = to_piece * group_size
        sends_nothing = math.prod(sent) == 0
        steps.append(
            _ExecStep(
                kind=step.kind,
                group_name=group_names[mesh_dim] if group_names else "",
                group_size=group_size,
                index_in_group=index_in_group,
                reduce_op=reduce_op,
                from_dim=from_dim,
                to_dim=to_dim,
                from_piece=from_piece,
                to_piece=to_piece,
                joined=joined,
                kept=kept,
                from_offset=from_offset,
                to_offset=to_offset,
                sends_nothing=sends_nothing,
                shape_before=shape_before,
                shape_after=shape_after,
                one_round=step.kind in (StepKind.REDUCE_SCATTER, StepKind.ALL_GATHER)
                and one_round_collectives(mesh, mesh_dim),
            )
        )
    last_collective = -1
    for index, exec_step in enumerate(steps):
        if exec_step.kind.is_collective and not exec_step.sends_nothing:
            last_collective = index
    return _Program(
        src_local_shape=local_shape(src.placements),
        dst_local_shape=local_shape(dst.placements),
        steps=tuple(steps),
        last_collective=last_collective,
        participating=True,
        mesh=mesh,
        group_names=tuple(group_names),
        joint_groups=tuple(joint_groups.items()),
    )


def _compile_strided_step(
    step: RedistributeStep,
    before_state: Placements,
    after_state: Placements,
    global_shape: tuple[int, ...],
    mesh: Any,
    coordinate: tuple[int, ...],
    group_names: Sequence[str],
    local_shape: Any,
) -> _ExecStep:
    """A step into or out of a ``_StridedShard`` layout (see ``_StridedLayout``)."""
    mesh_shape = tuple(mesh.shape)
    # What every rank sends in a collective step: its piece padded to the largest any rank has.
    padded = largest_piece_shape(global_shape, mesh_shape, before_state) if step.kind.is_collective else ()
    shape_before, shape_after = local_shape(before_state), local_shape(after_state)
    group_name, group_size, index_in_group = "", 1, 0
    if step.kind is StepKind.STRIDED_ALL_GATHER:
        mesh_dim = step.mesh_dim
        group_name, group_size, index_in_group = group_names[mesh_dim], mesh_shape[mesh_dim], coordinate[mesh_dim]
        tensor_dim = cast(_StridedShard, step.before).dim % len(global_shape)
        members = (coordinate[:mesh_dim] + (index,) + coordinate[mesh_dim + 1 :] for index in range(group_size))
        sizes = tuple(
            run_length(local_index_runs(global_shape, mesh_shape, member, before_state)[tensor_dim]) for member in members
        )
        layout = _StridedLayout(padded_shape=padded, tensor_dim=tensor_dim, member_sizes=sizes)
    elif step.kind is StepKind.GATHER_WHOLE:
        gathered = step.mesh_dims
        group_size = math.prod(mesh_shape[m] for m in gathered)
        # Row-major over the gathered dims, the others at this rank's coordinate (Replicate there).
        ranks = [
            tuple(dict(zip(gathered, choice)).get(m, c) for m, c in enumerate(coordinate))
            for choice in _product(*(range(mesh_shape[m]) for m in gathered))
        ]
        layout = _StridedLayout(
            padded_shape=padded,
            gather_groups=tuple((group_names[m], mesh_shape[m]) for m in reversed(gathered) if mesh_shape[m] > 1),
            piece_runs=tuple(local_index_runs(global_shape, mesh_shape, rank, before_state) for rank in ranks),
            global_shape=global_shape,
        )
    else:
        layout = _StridedLayout(
            padded_shape=shape_after, piece_runs=(local_index_runs(global_shape, mesh_shape, coordinate, after_state),)
        )
    return _ExecStep(
        kind=step.kind,
        group_name=group_name,
        group_size=group_size,
        index_in_group=index_in_group,
        reduce_op="",
        from_dim=layout.tensor_dim,
        sends_nothing=step.kind.is_collective and math.prod(padded) == 0,
        shape_before=shape_before,
        shape_after=shape_after,
        strided=layout,
    )


def _pad_to(local: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    padded = local
    for dim, size in enumerate(shape):
        padded = pad_dim(padded, dim, size)
    return padded.contiguous()


def _issue_gather_whole(buffer: torch.Tensor, layout: _StridedLayout) -> torch.Tensor:
    """Every gathered rank's padded piece, row-major over the gathered mesh dims (each all-gather waited)."""
    block = buffer.reshape(1, -1)
    # Innermost mesh dim first: after gathering dims d+1.. the block holds every coordinate of them in
    # row-major order, so gathering dim d puts the blocks in row-major order of all the gathered dims.
    for group_name, size in layout.gather_groups:
        block = wait(launch_all_gather(block, size, group_name)).reshape(1, -1)
    return block


def _assemble_whole(received: torch.Tensor, layout: _StridedLayout) -> torch.Tensor:
    """The whole tensor from every gathered rank's padded piece, each put at its index runs."""
    pieces = received.reshape(len(layout.piece_runs), *layout.padded_shape)
    whole = received.new_empty(layout.global_shape)
    for piece, runs in zip(pieces, layout.piece_runs):
        for dim, dim_runs in enumerate(runs):
            piece = piece.narrow(dim, 0, run_length(dim_runs))
        if piece.numel() == 0:
            continue
        index = [torch.tensor(run_indices(dim_runs), device=whole.device) for dim_runs in runs]
        whole[torch.meshgrid(*index, indexing="ij")] = piece
    return whole


def _select_runs(whole: torch.Tensor, runs: tuple[IndexRuns, ...]) -> torch.Tensor:
    """The part of ``whole`` at these index runs (per tensor dim), in run order."""
    selected = whole
    for dim, dim_runs in enumerate(runs):
        if len(dim_runs) == 1 and dim_runs[0] == (0, selected.size(dim)):
            continue
        parts = [selected.narrow(dim, start, length) for start, length in dim_runs]
        selected = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim) if parts else selected.narrow(dim, 0, 0)
    return selected.contiguous()


def _intersection(a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[
    tuple[int, ...], tuple[int, ...]
] | None:
    """The global (start, size) box shared by pieces ``a`` and ``b`` ((shape, offset) each), None when empty."""
    starts, sizes = [], []
    for size_a, start_a, size_b, start_b in zip(a[0], a[1], b[0], b[1]):
        start = max(start_a, start_b)
        extent = min(start_a + size_a, start_b + size_b) - start
        if extent <= 0:
            return None
        starts.append(start)
        sizes.append(extent)
    return tuple(starts), tuple(sizes)


def _relative(box: tuple[tuple[int, ...], tuple[int, ...]], origin: tuple[int, ...]) -> _Region:
    return tuple(start - base for start, base in zip(box[0], origin)), box[1]


def _compile_joint_all_reduce(
    step: RedistributeStep,
    local_shape: tuple[int, ...],
    mesh: Any,
    joint_groups: dict[tuple[int, ...], tuple[str, tuple[int, ...]]],
) -> _ExecStep:
    """A joint all-reduce runs as one all-reduce, over the joint group of its mesh dims."""
    joint_group = mesh._joint_group(step.mesh_dims)
    if joint_group is None:
        raise AssertionError(f"the plan uses a joint all-reduce over mesh dims {step.mesh_dims} but {mesh!r} has no group for them")
    joint_groups[step.mesh_dims] = joint_group
    assert isinstance(step.before, Partial)
    return _ExecStep(
        kind=StepKind.JOINT_ALL_REDUCE,
        group_name=joint_group[0],
        group_size=math.prod(mesh.shape[d] for d in step.mesh_dims),
        index_in_group=0,
        reduce_op=step.before.reduce_op,
        sends_nothing=math.prod(local_shape) == 0,
        shape_before=local_shape,
        shape_after=local_shape,
    )


def _compile_joint_step(
    step: RedistributeStep,
    before_state: Placements,
    after_state: Placements,
    global_shape: tuple[int, ...],
    mesh: Any,
    coordinate: tuple[int, ...],
    joint_groups: dict[tuple[int, ...], tuple[str, tuple[int, ...]]],
) -> _ExecStep:
    mesh_shape = tuple(mesh.shape)
    group_dims = joint_collective_dims(step.kind, before_state, step.mesh_dims)
    joint_group = mesh._joint_group(group_dims)
    if joint_group is None:
        raise AssertionError(f"the plan uses a joint step over mesh dims {group_dims} but {mesh!r} has no group for them")
    joint_groups[group_dims] = joint_group
    group_name, member_of_group_rank = joint_group

    def members(dims: Sequence[int], around: tuple[int, ...]) -> list[tuple[int, ...]]:
        found = []
        for values in _product(*(range(mesh_shape[d]) for d in dims)):
            member = list(around)
            for mesh_dim, value in zip(dims, values):
                member[mesh_dim] = value
            found.append(tuple(member))
        return found

    def box(state: Placements, at: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return compute_local_shape_and_global_offset(global_shape, mesh_shape, at, state)

    # In group rank order: the collectives' pieces are ordered by group rank.
    row_major = members(group_dims, coordinate)
    group = [row_major[member] for member in member_of_group_rank]
    index_in_group = group.index(coordinate)
    mine_before, mine_after = box(before_state, coordinate), box(after_state, coordinate)
    send: list[_Region | None] = []
    receive: list[_Region | None] = []
    input_splits: list[int] = []
    output_splits: list[int] = []
    padded = [0] * len(global_shape)
    moves_anything = False
    receive_slots: list[int] = []
    partial_dims = [d for d in group_dims if isinstance(before_state[d], Partial)]
    if step.kind is StepKind.JOINT_ALL_TO_ALL_REDUCE:
        # Contribution index of each member: row-major over its coordinates on the Partial dims.
        for member in group:
            slot = 0
            for d in partial_dims:
                slot = slot * mesh_shape[d] + member[d]
            receive_slots.append(slot)
    if step.kind in (StepKind.JOINT_ALL_TO_ALL, StepKind.JOINT_ALL_TO_ALL_REDUCE):
        # A Replicate source dim has many holders: the one at the receiver's coordinate there sends.  (With
        # a reduction there is none: every member's part of a contribution is its own.)
        replicated = [d for d in group_dims if isinstance(before_state[d], Replicate)]
        for member in group:
            same_replica = all(member[d] == coordinate[d] for d in replicated)
            outgoing = _intersection(box(after_state, member), mine_before) if same_replica else None
            incoming = _intersection(box(before_state, member), mine_after) if same_replica else None
            send.append(None if outgoing is None else _relative(outgoing, mine_before[1]))
            receive.append(None if incoming is None else _relative(incoming, mine_after[1]))
            input_splits.append(0 if outgoing is None else math.prod(outgoing[1]))
            output_splits.append(0 if incoming is None else math.prod(incoming[1]))
        # Every member must agree on skipping: look at the whole group's traffic.
        for sender in group:
            for receiver in group:
                if all(sender[d] == receiver[d] for d in replicated) and _intersection(
                    box(before_state, sender), box(after_state, receiver)
                ):
                    moves_anything = True
    else:
        for member in group:
            piece = box(after_state, member)
            padded = [max(a, b) for a, b in zip(padded, piece[0])]
            region = (tuple(o - b for o, b in zip(piece[1], mine_before[1])), piece[0])
            send.append(region if math.prod(piece[0]) else None)
            receive.append(None)
        moves_anything = math.prod(padded) > 0
    reducing = [before_state[d] for d in group_dims]
    reduce_op = reducing[0].reduce_op if isinstance(reducing[0], Partial) else ""
    return _ExecStep(
        kind=step.kind,
        group_name=group_name,
        group_size=len(group),
        index_in_group=index_in_group,
        reduce_op=reduce_op,
        sends_nothing=not moves_anything,
        shape_before=mine_before[0],
        shape_after=mine_after[0],
        one_round=step.kind is StepKind.JOINT_REDUCE_SCATTER and one_round_collectives(mesh, group_dims[0]),
        joint=_JointLayout(
            send_regions=tuple(send),
            receive_regions=tuple(receive),
            input_splits=tuple(input_splits),
            output_splits=tuple(output_splits),
            padded_shape=tuple(padded),
            receive_slots=tuple(receive_slots),
            slot_shape=tuple(mesh_shape[d] for d in partial_dims) if receive_slots else (),
            slot_ops=tuple(cast(Partial, before_state[d]).reduce_op for d in partial_dims) if receive_slots else (),
        ),
    )


# -- execution -----------------------------------------------------------------------------


def _divide(tensor: torch.Tensor, divisor: int) -> torch.Tensor:
    if divisor == 1:
        return tensor
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.div_(divisor)
    return torch.div(tensor, divisor, rounding_mode="trunc")


def _reduction_identity(dtype: torch.dtype, reduce_op: str) -> float | int | bool:
    if reduce_op in ("sum", "avg") or norm_order_of(reduce_op) is not None:
        return 0
    if reduce_op == "product":
        return 1
    if dtype == torch.bool:
        return reduce_op == "min"
    if dtype.is_floating_point:
        return -math.inf if reduce_op == "max" else math.inf
    if dtype.is_complex:
        raise ValueError(f"Partial(reduce_op={reduce_op!r}) is not defined for complex dtype {dtype}")
    info = torch.iinfo(dtype)
    return info.min if reduce_op == "max" else info.max


def _cut(tensor: torch.Tensor, region: _Region) -> torch.Tensor:
    for dim, (start, size) in enumerate(zip(*region)):
        tensor = tensor.narrow(dim, start, size)
    return tensor


def _joint_send_buffer(local: torch.Tensor, step: _ExecStep, layout: _JointLayout) -> torch.Tensor:
    if step.kind is not StepKind.JOINT_REDUCE_SCATTER:
        parts = [_cut(local, region).reshape(-1) for region in layout.send_regions if region is not None]
        return torch.cat(parts) if parts else local.new_empty((0,))
    # reduce-scatter: member i's piece, padded, is dim-0 block i (padding is reduced and dropped)
    local = to_reducible(local, step.reduce_op)
    buffer = local.new_zeros((step.group_size, *layout.padded_shape))
    for member, region in enumerate(layout.send_regions):
        if region is not None:
            _cut(buffer[member], ((0,) * len(region[1]), region[1])).copy_(_cut(local, region))
    return buffer.flatten(0, 1)


def _finish_joint(received: torch.Tensor, step: _ExecStep, layout: _JointLayout) -> torch.Tensor:
    if step.kind is StepKind.JOINT_REDUCE_SCATTER:
        if step.one_round:
            received = reduce_received_blocks(received, step.reduce_op, step.group_size)
        if step.reduce_op == "avg":
            received = _divide(received, step.group_size)
        received = from_reduced(received, step.reduce_op)
        return _cut(received, ((0,) * len(step.shape_after), step.shape_after)).contiguous()
    if step.kind is StepKind.JOINT_ALL_TO_ALL_REDUCE:
        return _reduce_contributions(received, step, layout)
    result = received.new_empty(step.shape_after)
    start = 0
    for region, count in zip(layout.receive_regions, layout.output_splits):
        if region is not None:
            _cut(result, region).copy_(received.narrow(0, start, count).view(region[1]))
        start += count
    return result


def _reduce_contributions(received: torch.Tensor, step: _ExecStep, layout: _JointLayout) -> torch.Tensor:
    """Every contribution of the new piece, placed from the members' parts, then reduced (last mesh dim first)."""
    contributions = received.new_empty((math.prod(layout.slot_shape), *step.shape_after))
    start = 0
    for region, count, slot in zip(layout.receive_regions, layout.output_splits, layout.receive_slots):
        if region is not None:
            _cut(contributions[slot], region).copy_(received.narrow(0, start, count).view(region[1]))
        start += count
    value = contributions.view(*layout.slot_shape, *step.shape_after)
    for axis in reversed(range(len(layout.slot_shape))):
        reduce_op = layout.slot_ops[axis]
        # Reduced in the tensor's dtype, as the one-dim steps' collectives reduce (a bool sum stays bool).
        value = from_reduced(reduce_in_dtype(to_reducible(value, reduce_op), axis, c10d_reduce_op(reduce_op)), reduce_op)
        if reduce_op == "avg":
            value = _divide(value, layout.slot_shape[axis])
    return value.contiguous()


def _send_buffer(local: torch.Tensor, step: _ExecStep) -> torch.Tensor:
    """``local`` padded and laid out for the step's collective (no communication)."""
    if step.joint is not None:
        return _joint_send_buffer(local, step, step.joint)
    if step.strided is not None:
        return _pad_to(local, step.strided.padded_shape)
    kind, group_size = step.kind, step.group_size
    if kind in (StepKind.ALL_REDUCE, StepKind.JOINT_ALL_REDUCE):
        return to_reducible(local, step.reduce_op)
    if kind is StepKind.ALL_GATHER:
        return pad_dim(local, step.from_dim, step.from_piece)
    if kind is StepKind.REDUCE_SCATTER:
        to_dim = step.to_dim
        padded = pad_dim(to_reducible(local, step.reduce_op), to_dim, step.to_piece * group_size)
        if to_dim != 0:
            # Put the group's pieces outermost so that member i's piece is dim-0 block i.
            padded = padded.unflatten(to_dim, (group_size, step.to_piece)).movedim(to_dim, 0).flatten(0, 1)
        return padded
    # all-to-all: block i (this rank's piece of to_dim i) goes to member i
    to_dim = step.to_dim
    padded = pad_dim(pad_dim(local, step.from_dim, step.from_piece), to_dim, step.to_piece * group_size)
    return padded.unflatten(to_dim, (group_size, step.to_piece)).movedim(to_dim, 0).flatten(0, 1)


def _issue(
    buffer: torch.Tensor,
    step: _ExecStep,
    input_splits: Sequence[int | torch.SymInt] = (),
    output_splits: Sequence[int | torch.SymInt] = (),
) -> torch.Tensor:
    """Start the step's collective on its send buffer (unwaited).  A joint all-to-all sends
    ``input_splits`` and receives ``output_splits`` elements per member (its layout's, unless given)."""
    kind, group_size = step.kind, step.group_size
    if kind is StepKind.GATHER_WHOLE:
        assert step.strided is not None
        return mark_arrived(_issue_gather_whole(buffer, step.strided))
    if kind is StepKind.STRIDED_ALL_GATHER:
        return launch_all_gather(buffer, group_size, step.group_name)
    if kind in (StepKind.JOINT_ALL_TO_ALL, StepKind.JOINT_ALL_TO_ALL_REDUCE):
        assert step.joint is not None
        return launch_all_to_all_exact(
            buffer,
            output_splits or step.joint.output_splits,  # type: ignore[arg-type]
            input_splits or step.joint.input_splits,  # type: ignore[arg-type]
            step.group_name,
        )
    if kind in (StepKind.ALL_REDUCE, StepKind.JOINT_ALL_REDUCE):
        return launch_all_reduce(buffer, step.reduce_op, step.group_name)
    if kind is StepKind.ALL_GATHER:
        if step.one_round:
            return launch_all_gather_one_round(buffer, group_size, step.group_name)
        return launch_all_gather(buffer, group_size, step.group_name)
    if kind in (StepKind.REDUCE_SCATTER, StepKind.JOINT_REDUCE_SCATTER):
        if step.one_round:
            return launch_reduce_scatter_one_round(buffer, group_size, step.group_name)
        return launch_reduce_scatter(buffer, step.reduce_op, group_size, step.group_name)
    return launch_all_to_all(buffer, group_size, step.group_name)


def _finish(received: torch.Tensor, step: _ExecStep) -> torch.Tensor:
    """Turn a waited collective result into the step's local tensor (trim, regroup, scale)."""
    kind, group_size = step.kind, step.group_size
    if step.joint is not None:
        return _finish_joint(received, step, step.joint)
    if step.strided is not None:
        layout = step.strided
        if kind is StepKind.GATHER_WHOLE:
            return _assemble_whole(received, layout)
        # Strided all-gather: member i's block, trimmed to its real extent, in member order.
        blocks = received.view(group_size, *layout.padded_shape)
        trimmed = [
            _select_runs(block, tuple(((0, size),) for size in _with_dim(step.shape_after, layout.tensor_dim, member)))
            for block, member in zip(blocks, layout.member_sizes)
        ]
        return torch.cat(trimmed, dim=layout.tensor_dim).contiguous()
    if kind in (StepKind.ALL_REDUCE, StepKind.JOINT_ALL_REDUCE):
        return _divide(received, group_size) if step.reduce_op == "avg" else from_reduced(received, step.reduce_op)
    if kind is StepKind.REDUCE_SCATTER:
        if step.one_round:
            received = reduce_received_blocks(received, step.reduce_op, group_size)
        if step.reduce_op == "avg":
            received = _divide(received, group_size)
        received = from_reduced(received, step.reduce_op)
        # The pieces were laid out with the group outermost, so the received piece is
        # already in local dim order.
        return received.narrow(step.to_dim, 0, step.kept).contiguous()
    if kind is StepKind.ALL_GATHER:
        from_dim = step.from_dim
        piece_shape = list(step.shape_before)
        piece_shape[from_dim] = step.from_piece
        if all(size == 1 for size in piece_shape[:from_dim]):
            # Member i's block is already the i-th run of dim from_dim: a view, and trimming the
            # padding off the outermost dim of size > 1 keeps it contiguous (no copy).
            joined_shape = list(piece_shape)
            joined_shape[from_dim] = group_size * step.from_piece
            return received.view(joined_shape).narrow(from_dim, 0, step.joined)
        blocks = received.split(piece_shape[0], dim=0)
        return torch.cat([block.view(piece_shape) for block in blocks], dim=from_dim).narrow(
            from_dim, 0, step.joined
        ).contiguous()
    # all-to-all: block i came from member i and holds its piece of from_dim
    from_dim, to_dim = step.from_dim, step.to_dim
    block_shape = list(step.shape_before)
    block_shape[from_dim] = step.from_piece
    block_shape[to_dim] = step.to_piece
    joined = received.unflatten(0, (group_size, block_shape[0])).movedim(0, from_dim).flatten(from_dim, from_dim + 1)
    return joined.narrow(from_dim, 0, step.joined).narrow(to_dim, 0, step.kept).contiguous()


def _run_local(local: torch.Tensor, step: _ExecStep) -> torch.Tensor:
    kind = step.kind
    if kind is StepKind.LOCAL_CHUNK:
        return local.narrow(step.to_dim, step.to_offset, step.kept).contiguous()
    if kind is StepKind.LOCAL_PARTIAL:
        # avg/max/min of identical values is that value. A sum needs the value once in total: floating
        # and complex values are split evenly (each rank holds value / n, as PyTorch), integers, which
        # cannot be split exactly, are kept whole by the group's first rank. A product keeps the value
        # on the first rank and ones on the others (exact; PyTorch refuses, an n-th root is not).
        # A p-norm's pending value (non-negative: a norm) stays on the first rank, zeros elsewhere.
        is_norm = norm_order_of(step.reduce_op) is not None
        if step.reduce_op not in ("sum", "product") and not is_norm:
            return local
        if step.reduce_op == "sum" and (local.dtype.is_floating_point or local.dtype.is_complex):
            return local / step.group_size
        if step.index_in_group != 0:
            return torch.ones_like(local) if step.reduce_op == "product" else torch.zeros_like(local)
        return local
    if kind is StepKind.SHARD_TO_PARTIAL:
        parent_shape = list(local.shape)
        parent_shape[step.from_dim] = step.joined
        parent = local.new_full(parent_shape, _reduction_identity(local.dtype, step.reduce_op))
        # avg divides the sum of contributions by the group size: contribute size * shard.
        contribution = local * step.group_size if step.reduce_op == "avg" else local
        parent.narrow(step.from_dim, step.from_offset, local.size(step.from_dim)).copy_(contribution)
        return parent
    if kind is StepKind.RELABEL:
        return local
    if kind is StepKind.SELECT_LOCAL:
        assert step.strided is not None
        return _select_runs(local, step.strided.piece_runs[0])
    raise AssertionError(f"{kind} is not a local step")


def _with_dim(shape: Sequence[int], dim: int, size: int) -> tuple[int, ...]:
    return tuple(size if d == dim else extent for d, extent in enumerate(shape))


def _traced(local: torch.Tensor) -> bool:
    """Whether ``local`` is being traced (torch.compile's fake or functional tensors): there the graph holds
    the collective and its wait, and the compiler places the wait; a pending tensor would only hide it."""
    return torch.compiler.is_compiling() or isinstance(local, (FunctionalTensor, FakeTensor))


def _arrives_finished(step: _ExecStep, pending: torch.Tensor, final_shape: tuple[int, ...]) -> bool:
    """Whether :func:`_finish` would hand the collective's output back as it is (no scaling, root,
    regrouping, trimming or local reduction)."""
    if step.joint is not None or tuple(pending.shape) != tuple(final_shape):
        return False
    if step.kind in (StepKind.ALL_REDUCE, StepKind.JOINT_ALL_REDUCE):
        return step.reduce_op in ("sum", "max", "min", "product")
    return step.kind is StepKind.ALL_GATHER and step.from_dim == 0 and step.joined == step.group_size * step.from_piece


@dataclass(frozen=True, slots=True)
class _Continuation:
    """What remains of a program once its last collective has been waited for."""

    program: _Program
    collective_index: int

    def __call__(self, received: torch.Tensor) -> torch.Tensor:
        steps = self.program.steps
        local = _finish(received, steps[self.collective_index])
        for step in steps[self.collective_index + 1 :]:
            local = _run_local(local, step)
        return local


def _program_for(src: DTensorSpec[Any], dst: DTensorSpec[Any]) -> _Program:
    key = (src, dst)
    programs = RANK_CACHES.programs
    program: _Program | None = lookup(programs, key)
    if program is SYMBOLIC:
        # Symbolic (SymInt) shapes while torch.compile traces: built for this trace, never cached.
        return _compile_program(src, dst, plan_redistribute(src, dst))
    if program is not None and program.mesh is not src.mesh and _same_groups(program, src.mesh):
        program = dataclasses.replace(program, mesh=src.mesh)
        programs[key] = program
    if program is None or program.mesh is not src.mesh:
        program = _compile_program(src, dst, plan_redistribute(src, dst))
        store(programs, key, program, _MAX_PROGRAMS)
    return program


def _same_groups(program: _Program, mesh: Any) -> bool:
    if program.group_names and program.group_names != mesh_group_names(mesh):
        return False
    return all(mesh._joint_group(dims) == group for dims, group in program.joint_groups)


class _ThisRank:
    """The executor's view of the ranks it runs a program for: this process's own rank.

    :class:`_SimulatedRanks` is the other view (every rank torch's LocalTensorMode simulates).
    Both hold one piece per rank; the executor runs the same program steps on each and issues
    each collective once through the view.
    """

    ranks: tuple[int, ...] = (0,)

    def pieces(self, local: torch.Tensor) -> list[torch.Tensor]:
        return [local]

    def join(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        return pieces[0]

    def local_work(self) -> Any:
        return _NO_CONTEXT

    def issue(self, buffers: list[torch.Tensor], steps: list[_ExecStep]) -> torch.Tensor:
        return _issue(buffers[0], steps[0])

    def received(self, waited: torch.Tensor) -> list[torch.Tensor]:
        return [waited]


class _SimulatedRanks:
    """Every rank simulated in this process: pieces are a ``LocalTensor``'s per-rank tensors, a
    collective is issued once on the ``LocalTensor`` of every rank's send buffer (per-rank sizes as
    ``LocalIntNode`` SymInts) and the mode performs it for every group of the mesh dim."""

    def __init__(self, ranks: frozenset[int]) -> None:
        self.rank_set = ranks
        self.ranks = tuple(sorted(ranks))

    def pieces(self, local: torch.Tensor) -> list[torch.Tensor]:
        with simulation.mode_disabled():
            by_rank = simulation.local_tensor_pieces(wait_local_tensor(local), self.rank_set)
        return [by_rank[rank] for rank in self.ranks]

    def join(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        return cast(torch.Tensor, simulation.join_rank_values(dict(zip(self.ranks, pieces))))

    def local_work(self) -> Any:
        return simulation.mode_disabled()

    def issue(self, buffers: list[torch.Tensor], steps: list[_ExecStep]) -> torch.Tensor:
        with simulation.mode_disabled():
            joined = self.join(buffers)
        step = steps[0]
        if step.joint is not None and step.kind is not StepKind.JOINT_REDUCE_SCATTER:
            members = range(step.group_size)
            input_splits = [self._per_rank(steps, lambda s, m=m: s.joint.input_splits[m]) for m in members]
            output_splits = [self._per_rank(steps, lambda s, m=m: s.joint.output_splits[m]) for m in members]
            return _issue(joined, step, input_splits, output_splits)
        return _issue(joined, step)

    def received(self, waited: torch.Tensor) -> list[torch.Tensor]:
        return self.pieces(waited)

    def _per_rank(self, steps: list[_ExecStep], value: Any) -> int | torch.SymInt:
        return simulation.per_rank_int({rank: value(step) for rank, step in zip(self.ranks, steps)})


class _NoContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_CONTEXT = _NoContext()
_THIS_RANK = _ThisRank()
_Ranks = _ThisRank | _SimulatedRanks


def _run_steps(ranks: _Ranks, programs: list[_Program], pieces: list[torch.Tensor], stop: int) -> list[torch.Tensor]:
    """Steps ``[0, stop)`` of every rank's program on its piece: the one executor.

    Local steps run per rank; a collective step pads and lays out each rank's send buffer, is issued
    once through ``ranks`` and waited, and each rank finishes (trims, regroups, scales) its result.
    A collective that moves nothing anywhere is skipped by every rank alike.
    """
    for index in range(stop):
        steps = [program.steps[index] for program in programs]
        with ranks.local_work():
            if not steps[0].kind.is_collective:
                pieces = [_run_local(piece, step) for piece, step in zip(pieces, steps)]
                continue
            if all(step.sends_nothing for step in steps):
                pieces = [piece.new_empty(step.shape_after) for piece, step in zip(pieces, steps)]
                continue
            buffers = [_send_buffer(piece, step) for piece, step in zip(pieces, steps)]
        received = ranks.received(wait(ranks.issue(buffers, steps)))
        with ranks.local_work():
            pieces = [
                piece.new_empty(step.shape_after) if step.sends_nothing else _finish(result, step)
                for piece, result, step in zip(pieces, received, steps)
            ]
    return pieces


def _check_local_shapes(
    ranks: _Ranks, programs: list[_Program], pieces: list[torch.Tensor], src: DTensorSpec[Any], dst: DTensorSpec[Any]
) -> None:
    for rank, program, piece in zip(ranks.ranks, programs, pieces):
        if piece.shape == program.src_local_shape:
            continue
        if isinstance(ranks, _SimulatedRanks):
            where = f"simulated rank {rank}"
        else:
            coordinate = src.mesh.get_coordinate()
            where = f"the rank at mesh coordinate {tuple(coordinate) if coordinate is not None else None}"
        raise ValueError(
            f"redistribute {src} -> {dst}: the local tensor has shape {tuple(piece.shape)} but {where} holds a "
            f"shard of shape {program.src_local_shape} for placements {src.placements} of global shape "
            f"{check_redistribute_specs(src, dst)}"
        )


def redistribute_local_tensor(
    local: torch.Tensor,
    src: DTensorSpec[Any],
    dst: DTensorSpec[Any],
    *,
    async_op: bool = False,
    is_explicit: bool = False,
) -> torch.Tensor:
    """This rank's shard of the tensor laid out as ``dst``, given its shard ``local`` laid out as ``src``.

    Runs :func:`plan_redistribute`'s plan; every rank of the mesh must call it with the
    same specs.  A rank outside the mesh takes no part and gets an empty tensor.  Raises
    before any collective when the specs disagree (mesh, global shape, missing
    tensor_meta) or ``local`` does not have this rank's shard shape for ``src``.

    Under torch's LocalTensorMode (every rank simulated here) the same executor runs every simulated
    rank's program on its piece of the ``LocalTensor``, synchronously (``async_op`` has nothing to
    overlap); inside ``run_for_each_simulated_rank`` it runs that rank's program (local steps only).

    ``async_op=True`` may return an :class:`AsyncCollectiveTensor` whose last collective
    is still in flight; it finishes on first use (or ``.wait()``). (Not while torch.compile traces: the
    graph's wait is the compiler's to place.)  The result may share
    memory with ``local`` (a no-op plan returns ``local`` itself; a local chunk along dim
    0 is a view).

    Under torch's ``DebugMode`` the call is recorded with the plan as its trace (see
    :func:`debug_trace`); ``is_explicit``: the user asked for it (``DTensor.redistribute``), not an op.
    """
    debug_mode = _active_debug_mode()
    if debug_mode is None:
        return _redistribute(local, src, dst, async_op)
    with debug_mode.record_redistribute_calls(
        local, src.placements, dst.placements, debug_trace(src, dst), is_explicit=is_explicit
    ):
        return _redistribute(local, src, dst, async_op)


def debug_trace(src: DTensorSpec[Any], dst: DTensorSpec[Any]) -> str:
    """The plan from ``src`` to ``dst`` as torch's DebugMode prints redistributions.

    Every state in mesh-dim order (``S(0)[1]``: the second mesh dim to cut tensor dim 0), ``->``
    between states for a step on one mesh dim, ``-->`` for a joint step (one collective over the
    flattened group of several mesh dims), as ``DTensorRedistributePlanner.stringify_transform_infos``.
    """
    src_layout, dst_layout = src.as_layout_spec(), dst.as_layout_spec()
    plan = plan_redistribute(src_layout, dst_layout) if src_layout != dst_layout else ()
    states = plan_states(src_layout.placements, plan)

    def spelled(placements: Sequence[Placement]) -> str:
        order = DTensorSpec._maybe_convert_StridedShard_to_shard_order(placements, src.mesh)
        if order is None:
            return "".join(str(p) for p in placements)  # strided cuts that spell no order: as they are
        plain = [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements]
        return DTensorSpec.format_shard_order_str(plain, order)

    trace = [spelled(states[0])]
    for step, state in zip(plan, states[1:]):
        trace += ["-->" if step.joint else "->", spelled(state)]
    return "".join(trace)


def _redistribute(local: torch.Tensor, src: DTensorSpec[Any], dst: DTensorSpec[Any], async_op: bool) -> torch.Tensor:
    if src.has_explicit_shard_order or dst.has_explicit_shard_order:
        # A shard order is a _StridedShard layout spelled another way: run that layout's redistribution.
        return _redistribute(local, src.as_layout_spec(), dst.as_layout_spec(), async_op)
    view = simulation.simulated_view()
    if view is None:
        program = lookup(RANK_CACHES.programs, (src, dst))
        if program is SYMBOLIC:
            program = None  # symbolic shapes (torch.compile): _program_for builds it uncached
        if program is None or program.mesh is not src.mesh:
            program = _program_for(src, dst)
        if not program.participating:
            return local.new_empty(0)  # a rank outside the mesh holds nothing (PyTorch's tensor([]))
        if local.shape != program.src_local_shape:
            _check_local_shapes(_THIS_RANK, [program], [local], src, dst)
        last = program.last_collective
        if not async_op or last < 0 or _traced(local) or program.steps[last].kind is StepKind.GATHER_WHOLE:
            # (A whole gather waits for each of its all-gathers in turn: nothing left in flight to return.)
            return _run_steps(_THIS_RANK, [program], [local], len(program.steps))[0]
        (local,) = _run_steps(_THIS_RANK, [program], [local], last)
        pending = _issue(_send_buffer(local, program.steps[last]), program.steps[last])
        if last == len(program.steps) - 1 and _arrives_finished(program.steps[last], pending, program.dst_local_shape):
            # Nothing left to do once it arrives: torch's own pending tensor, as PyTorch's DTensor returns.
            return funcol.AsyncCollectiveTensor(pending)
        return AsyncCollectiveTensor(pending, _Continuation(program, last), program.dst_local_shape)
    if isinstance(view, int):
        # One simulated rank, inside run_for_each_simulated_rank: ranks cannot communicate there.
        one = _simulated_program(src, dst, view)
        if any(step.kind.is_collective for step in one.steps):
            raise RuntimeError(
                f"redistribute {src} -> {dst} needs a collective, but it was called for one simulated rank ({view}) "
                "inside run_for_each_simulated_rank, where ranks cannot communicate; call it outside"
            )
        if not one.participating:
            return local.new_empty(one.dst_local_shape)
        return _run_steps(_THIS_RANK, [one], [local], len(one.steps))[0]
    ranks = _SimulatedRanks(view)
    programs = [_simulated_program(src, dst, rank) for rank in ranks.ranks]
    taking_part = [rank for rank, program in zip(ranks.ranks, programs) if program.participating]
    if len(taking_part) not in (0, len(ranks.ranks)):
        raise NotImplementedError(
            f"redistribute over {src.mesh!r} under LocalTensorMode: simulated ranks "
            f"{sorted(set(ranks.ranks) - set(taking_part))} are outside the mesh; simulate a world that the mesh covers"
        )
    pieces = ranks.pieces(local)
    with simulation.mode_disabled():
        if not taking_part:
            return ranks.join([piece.new_empty(program.dst_local_shape) for piece, program in zip(pieces, programs)])
        _check_local_shapes(ranks, programs, pieces, src, dst)
    pieces = _run_steps(ranks, programs, pieces, len(programs[0].steps))
    with simulation.mode_disabled():
        return ranks.join(pieces)


# -- every rank simulated in this process (torch's LocalTensorMode) ---------------------------


def _simulated_program(src: DTensorSpec[Any], dst: DTensorSpec[Any], rank: int) -> _Program:
    """Simulated ``rank``'s program, compiled with that rank pinned (see shardwise.mesh._simulation)."""
    key = (src, dst, rank)
    programs = SHARED_CACHES.simulated_programs
    program: _Program | None = programs.get(key)
    if program is None or program.mesh is not src.mesh:
        with simulation.as_simulated_rank(rank):
            program = _compile_program(src, dst, plan_redistribute(src, dst))
        store(programs, key, program, _MAX_PROGRAMS)
    return program


def gather_along_mesh_dim(
    placement: Placement, local: torch.Tensor, mesh: Any, mesh_dim: int, logical_shape: Sequence[int]
) -> torch.Tensor:
    """The ``logical_shape`` extent that ``placement`` cut along ``mesh_dim``, from each rank's ``local`` piece.

    The other mesh dims are read as replicating (each group along ``mesh_dim`` holds one extent),
    so this is one redistribution of that extent from ``placement`` to ``Replicate`` on ``mesh_dim``.
    """
    placements: list[Placement] = [Replicate()] * mesh.ndim
    placements[mesh_dim] = placement
    shape = torch.Size(logical_shape)
    meta = TensorMeta(shape, contiguous_strides(shape), local.dtype)
    src = DTensorSpec(mesh, placements, meta)
    return redistribute_local_tensor(local, src, src.with_placements([Replicate()] * mesh.ndim))
