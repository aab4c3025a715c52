"""The executor's steps: one plan step compiled for this rank, with everything it needs precomputed.

Three classes, one interface (``prepare`` -> ``issue`` -> ``finish``), so the executor
(``_plan_executor._run_steps``) runs every step alike and never asks what kind it is:

* :class:`LocalStep` (chunk, R -> P, S -> P, relabel, selecting a strided layout's indices): ``prepare``
  does the work, there is nothing to issue, ``finish`` hands it back;
* :class:`CollectiveStep` (a one-dim all-gather, all-reduce, reduce-scatter or all-to-all, and the
  all-reduce over a joint group): its tensor dim's pieces are padded to the group's largest, sent as
  dim-0 blocks, trimmed after;
* :class:`PieceStep` (joint all-to-alls and reduce-scatters, strided all-gathers, whole gathers):
  pieces placed by regions (``_JointLayout``) or index runs (``_StridedLayout``).

``communicates`` says whether ``issue`` runs a collective (the executor issues it once for all the ranks
it runs, then waits); ``sends_nothing`` that every member of the group would move nothing (all skip it).
:func:`compile_step` is the one place that picks the class from the planner's step.  Every builder takes
a :class:`StepCompileContext` (what all the steps of one plan share on this rank, built once per
compiled program by ``_plan_executor``) and the step's own data (the planner's step, the placements
before and after it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product as _product
from typing import Any, ClassVar, Sequence, cast

import torch

from shardwise.placement import (
    Partial,
    Replicate,
    Shard,
    _StridedShard,
    chunk_size_and_offset,
    compute_local_shape_and_global_offset,
    local_index_runs,
    norm_order_of,
    pad_dim,
    shard_sizes_along_mesh_dim,
)

from ._collectives import (
    c10d_reduce_op,
    from_reduced,
    launch_all_gather,
    launch_all_gather_one_round,
    launch_all_reduce,
    launch_all_to_all,
    launch_all_to_all_exact,
    launch_reduce_scatter,
    launch_reduce_scatter_one_round,
    mark_arrived,
    one_round_collectives,
    reduce_in_dtype,
    reduce_received_blocks,
    to_reducible,
    wait,
)
from ._planner import Placements, RedistributeStep, StepKind, joint_collective_dims, largest_piece_shape, run_indices, run_length

__all__ = ["CollectiveStep", "ExecStep", "LocalStep", "PieceStep", "StepCompileContext", "compile_step"]

Splits = Sequence[int | torch.SymInt]


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
class LocalStep:
    """A step without communication. ``to_dim``/``to_offset``/``kept``: the chunk of an R -> S step;
    ``from_dim``/``from_offset``/``joined``: where an S -> P step's shard sits in its parent;
    ``piece_runs``: a strided selection's index runs (per tensor dim)."""

    communicates: ClassVar[bool] = False
    sends_nothing: ClassVar[bool] = False
    arrives_finished: ClassVar[bool] = False
    waits_in_issue: ClassVar[bool] = False
    exact_splits: ClassVar[tuple[tuple[int, ...], tuple[int, ...]] | None] = None

    kind: StepKind
    shape_before: tuple[int, ...]
    shape_after: tuple[int, ...]
    reduce_op: str = ""
    group_size: int = 1
    index_in_group: int = 0
    from_dim: int = -1
    to_dim: int = -1
    joined: int = 0
    kept: int = 0
    from_offset: int = 0
    to_offset: int = 0
    piece_runs: tuple[IndexRuns, ...] | None = None

    def prepare(self, local: torch.Tensor) -> torch.Tensor:
        kind = self.kind
        if self.piece_runs is not None:
            return _select_runs(local, self.piece_runs)
        if kind is StepKind.LOCAL_CHUNK:
            return local.narrow(self.to_dim, self.to_offset, self.kept).contiguous()
        if kind is StepKind.LOCAL_PARTIAL:
            # avg/max/min of identical values is that value. A sum needs the value once in total: floating
            # and complex values are split evenly (each rank holds value / n, as PyTorch), integers, which
            # cannot be split exactly, are kept whole by the group's first rank. A product keeps the value
            # on the first rank and ones on the others (exact; PyTorch refuses, an n-th root is not).
            # A p-norm's pending value (non-negative: a norm) stays on the first rank, zeros elsewhere.
            is_norm = norm_order_of(self.reduce_op) is not None
            if self.reduce_op not in ("sum", "product") and not is_norm:
                return local
            if self.reduce_op == "sum" and (local.dtype.is_floating_point or local.dtype.is_complex):
                return local / self.group_size
            if self.index_in_group != 0:
                return torch.ones_like(local) if self.reduce_op == "product" else torch.zeros_like(local)
            return local
        if kind is StepKind.SHARD_TO_PARTIAL:
            parent_shape = list(local.shape)
            parent_shape[self.from_dim] = self.joined
            parent = local.new_full(parent_shape, _reduction_identity(local.dtype, self.reduce_op))
            # avg divides the sum of contributions by the group size: contribute size * shard.
            contribution = local * self.group_size if self.reduce_op == "avg" else local
            parent.narrow(self.from_dim, self.from_offset, local.size(self.from_dim)).copy_(contribution)
            return parent
        return local  # a relabel

    def issue(self, buffer: torch.Tensor, input_splits: Splits = (), output_splits: Splits = ()) -> torch.Tensor:
        raise AssertionError(f"{self.kind} is a local step: nothing to issue")

    def finish(self, received: torch.Tensor) -> torch.Tensor:
        return received


@dataclass(frozen=True, slots=True)
class CollectiveStep:
    """A collective over one group whose pieces are the cuts of one tensor dim (or, for an all-reduce,
    the whole local tensor).

    ``from_dim`` is the tensor dim a step un-shards (all-gather, all-to-all) and ``to_dim`` the one it
    shards (reduce-scatter, all-to-all), -1 where there is none.  Along ``from_dim``: ``from_piece`` is
    the padded piece every member sends and ``joined`` the real size once un-sharded.  Along ``to_dim``:
    ``to_piece`` is the padded piece each member receives and ``kept`` this rank's real size once sharded.
    """

    communicates: ClassVar[bool] = True
    waits_in_issue: ClassVar[bool] = False
    exact_splits: ClassVar[tuple[tuple[int, ...], tuple[int, ...]] | None] = None

    kind: StepKind
    group_name: str
    group_size: int
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
    # A reduce-scatter or all-gather run as one all-to-all (_collectives.one_round_collectives).
    one_round: bool = False

    @property
    def arrives_finished(self) -> bool:
        """Whether ``finish`` hands the collective's output back as it is (no scaling, root, regrouping,
        trimming or local reduction), where the output has the final shape."""
        if self.kind in (StepKind.ALL_REDUCE, StepKind.JOINT_ALL_REDUCE):
            return self.reduce_op in ("sum", "max", "min", "product")
        return self.kind is StepKind.ALL_GATHER and self.from_dim == 0 and self.joined == self.group_size * self.from_piece

    def prepare(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` padded and laid out for the collective (no communication)."""
        kind, group_size = self.kind, self.group_size
        if kind in (StepKind.ALL_REDUCE, StepKind.JOINT_ALL_REDUCE):
            return to_reducible(local, self.reduce_op)
        if kind is StepKind.ALL_GATHER:
            return pad_dim(local, self.from_dim, self.from_piece)
        if kind is StepKind.REDUCE_SCATTER:
            to_dim = self.to_dim
            padded = pad_dim(to_reducible(local, self.reduce_op), to_dim, self.to_piece * group_size)
            if to_dim != 0:
                # Put the group's pieces outermost so that member i's piece is dim-0 block i.
                padded = padded.unflatten(to_dim, (group_size, self.to_piece)).movedim(to_dim, 0).flatten(0, 1)
            return padded
        # all-to-all: block i (this rank's piece of to_dim i) goes to member i
        to_dim = self.to_dim
        padded = pad_dim(pad_dim(local, self.from_dim, self.from_piece), to_dim, self.to_piece * group_size)
        return padded.unflatten(to_dim, (group_size, self.to_piece)).movedim(to_dim, 0).flatten(0, 1)

    def issue(self, buffer: torch.Tensor, input_splits: Splits = (), output_splits: Splits = ()) -> torch.Tensor:
        """Start the collective on the send buffer (unwaited)."""
        kind, group_size = self.kind, self.group_size
        if kind in (StepKind.ALL_REDUCE, StepKind.JOINT_ALL_REDUCE):
            return launch_all_reduce(buffer, self.reduce_op, self.group_name)
        if kind is StepKind.ALL_GATHER:
            if self.one_round:
                return launch_all_gather_one_round(buffer, group_size, self.group_name)
            return launch_all_gather(buffer, group_size, self.group_name)
        if kind is StepKind.REDUCE_SCATTER:
            if self.one_round:
                return launch_reduce_scatter_one_round(buffer, group_size, self.group_name)
            return launch_reduce_scatter(buffer, self.reduce_op, group_size, self.group_name)
        return launch_all_to_all(buffer, group_size, self.group_name)

    def finish(self, received: torch.Tensor) -> torch.Tensor:
        """Turn the waited collective's result into the step's local tensor (trim, regroup, scale)."""
        kind, group_size = self.kind, self.group_size
        if kind in (StepKind.ALL_REDUCE, StepKind.JOINT_ALL_REDUCE):
            return _divide(received, group_size) if self.reduce_op == "avg" else from_reduced(received, self.reduce_op)
        if kind is StepKind.REDUCE_SCATTER:
            if self.one_round:
                received = reduce_received_blocks(received, self.reduce_op, group_size)
            if self.reduce_op == "avg":
                received = _divide(received, group_size)
            received = from_reduced(received, self.reduce_op)
            # The pieces were laid out with the group outermost, so the received piece is
            # already in local dim order.
            return received.narrow(self.to_dim, 0, self.kept).contiguous()
        if kind is StepKind.ALL_GATHER:
            from_dim = self.from_dim
            piece_shape = list(self.shape_before)
            piece_shape[from_dim] = self.from_piece
            if all(size == 1 for size in piece_shape[:from_dim]):
                # Member i's block is already the i-th run of dim from_dim: a view, and trimming the
                # padding off the outermost dim of size > 1 keeps it contiguous (no copy).
                joined_shape = list(piece_shape)
                joined_shape[from_dim] = group_size * self.from_piece
                return received.view(joined_shape).narrow(from_dim, 0, self.joined)
            blocks = received.split(piece_shape[0], dim=0)
            return torch.cat([block.view(piece_shape) for block in blocks], dim=from_dim).narrow(
                from_dim, 0, self.joined
            ).contiguous()
        # all-to-all: block i came from member i and holds its piece of from_dim
        from_dim, to_dim = self.from_dim, self.to_dim
        block_shape = list(self.shape_before)
        block_shape[from_dim] = self.from_piece
        block_shape[to_dim] = self.to_piece
        joined = received.unflatten(0, (group_size, block_shape[0])).movedim(0, from_dim).flatten(from_dim, from_dim + 1)
        return joined.narrow(from_dim, 0, self.joined).narrow(to_dim, 0, self.kept).contiguous()


@dataclass(frozen=True, slots=True)
class PieceStep:
    """A collective whose pieces are placed by this rank's layout: regions of a joint step
    (``joint``) or index runs of a strided one (``strided``); exactly one of them is set."""

    communicates: ClassVar[bool] = True
    arrives_finished: ClassVar[bool] = False

    kind: StepKind
    group_name: str
    group_size: int
    reduce_op: str
    sends_nothing: bool
    shape_before: tuple[int, ...]
    shape_after: tuple[int, ...]
    joint: _JointLayout | None = None
    strided: _StridedLayout | None = None
    # A joint reduce-scatter run as one all-to-all (_collectives.one_round_collectives).
    one_round: bool = False

    @property
    def waits_in_issue(self) -> bool:
        """A whole gather waits for each of its all-gathers in turn: nothing is left in flight."""
        return self.kind is StepKind.GATHER_WHOLE

    @property
    def exact_splits(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(elements sent to, elements received from) each member, for an all-to-all of exact pieces."""
        if self.joint is None or self.kind is StepKind.JOINT_REDUCE_SCATTER:
            return None
        return self.joint.input_splits, self.joint.output_splits

    def prepare(self, local: torch.Tensor) -> torch.Tensor:
        if self.strided is not None:
            return _pad_to(local, self.strided.padded_shape)
        layout = self.joint
        assert layout is not None
        if self.kind is not StepKind.JOINT_REDUCE_SCATTER:
            parts = [_cut(local, region).reshape(-1) for region in layout.send_regions if region is not None]
            return torch.cat(parts) if parts else local.new_empty((0,))
        # reduce-scatter: member i's piece, padded, is dim-0 block i (padding is reduced and dropped)
        local = to_reducible(local, self.reduce_op)
        buffer = local.new_zeros((self.group_size, *layout.padded_shape))
        for member, region in enumerate(layout.send_regions):
            if region is not None:
                _cut(buffer[member], ((0,) * len(region[1]), region[1])).copy_(_cut(local, region))
        return buffer.flatten(0, 1)

    def issue(self, buffer: torch.Tensor, input_splits: Splits = (), output_splits: Splits = ()) -> torch.Tensor:
        """Start the collective (unwaited; a whole gather's are waited in turn). An all-to-all sends
        ``input_splits`` and receives ``output_splits`` elements per member (its layout's, unless given)."""
        kind, group_size = self.kind, self.group_size
        if self.strided is not None:
            if kind is StepKind.GATHER_WHOLE:
                return mark_arrived(_issue_gather_whole(buffer, self.strided))
            return launch_all_gather(buffer, group_size, self.group_name)
        assert self.joint is not None
        if kind is StepKind.JOINT_REDUCE_SCATTER:
            if self.one_round:
                return launch_reduce_scatter_one_round(buffer, group_size, self.group_name)
            return launch_reduce_scatter(buffer, self.reduce_op, group_size, self.group_name)
        return launch_all_to_all_exact(
            buffer,
            output_splits or self.joint.output_splits,  # type: ignore[arg-type]
            input_splits or self.joint.input_splits,  # type: ignore[arg-type]
            self.group_name,
        )

    def finish(self, received: torch.Tensor) -> torch.Tensor:
        if self.strided is not None:
            layout = self.strided
            if self.kind is StepKind.GATHER_WHOLE:
                return _assemble_whole(received, layout)
            # Strided all-gather: member i's block, trimmed to its real extent, in member order.
            blocks = received.view(self.group_size, *layout.padded_shape)
            trimmed = [
                _select_runs(block, tuple(((0, size),) for size in _with_dim(self.shape_after, layout.tensor_dim, member)))
                for block, member in zip(blocks, layout.member_sizes)
            ]
            return torch.cat(trimmed, dim=layout.tensor_dim).contiguous()
        joint = self.joint
        assert joint is not None
        if self.kind is StepKind.JOINT_REDUCE_SCATTER:
            if self.one_round:
                received = reduce_received_blocks(received, self.reduce_op, self.group_size)
            if self.reduce_op == "avg":
                received = _divide(received, self.group_size)
            received = from_reduced(received, self.reduce_op)
            return _cut(received, ((0,) * len(self.shape_after), self.shape_after)).contiguous()
        if self.kind is StepKind.JOINT_ALL_TO_ALL_REDUCE:
            return _reduce_contributions(received, self, joint)
        result = received.new_empty(self.shape_after)
        start = 0
        for region, count in zip(joint.receive_regions, joint.output_splits):
            if region is not None:
                _cut(result, region).copy_(received.narrow(0, start, count).view(region[1]))
            start += count
        return result


ExecStep = LocalStep | CollectiveStep | PieceStep


# -- compiling a plan step for this rank ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepCompileContext:
    """What every step of one plan is compiled against on this rank: built once per program, not per step.

    ``group_names``: the c10d group of every mesh dim (empty when the plan has no collective).
    The fields never change; two of them are dicts filled as the steps compile (pass them empty):
    ``joint_groups``, the joint group (name, member order) of every set of mesh dims a joint step runs
    over, which the program keeps to tell whether another mesh has its groups; ``local_shapes``, this
    rank's local shape of every state asked for (see :meth:`local_shape`).
    """

    mesh: Any
    mesh_shape: tuple[int, ...]
    coordinate: tuple[int, ...]
    global_shape: tuple[int, ...]
    group_names: tuple[str, ...]
    joint_groups: dict[tuple[int, ...], tuple[str, tuple[int, ...]]]
    local_shapes: dict[Placements, tuple[int, ...]]

    def local_shape(self, state: Placements) -> tuple[int, ...]:
        """This rank's local shape under the placements ``state``.  Worked out once per state: a step's
        after-state is the next one's before-state, and the program asks again for the first and last."""
        shape = self.local_shapes.get(state)
        if shape is None:
            shape = compute_local_shape_and_global_offset(self.global_shape, self.mesh_shape, self.coordinate, state)[0]
            self.local_shapes[state] = shape
        return shape


def compile_step(
    context: StepCompileContext, step: RedistributeStep, before_state: Placements, after_state: Placements
) -> ExecStep:
    """This rank's step for the plan's ``step`` from ``before_state`` to ``after_state`` (the one place that
    chooses a step class); a joint step records its group in ``context.joint_groups``."""
    if step.kind.is_strided:
        return _strided_step(context, step, before_state, after_state)
    if step.kind is StepKind.JOINT_ALL_REDUCE:
        return _joint_all_reduce(context, step, before_state)
    if step.joint:
        return _joint_step(context, step, before_state, after_state)
    return _one_dim_step(context, step, before_state, after_state)


def _one_dim_step(
    context: StepCompileContext, step: RedistributeStep, before_state: Placements, after_state: Placements
) -> LocalStep | CollectiveStep:
    global_shape = context.global_shape
    mesh_shape = context.mesh_shape
    coordinate = context.coordinate
    mesh_dim = step.mesh_dim
    group_size = mesh_shape[mesh_dim]
    index_in_group = coordinate[mesh_dim]
    before, after = step.before, step.after
    shape_before, shape_after = context.local_shape(before_state), context.local_shape(after_state)
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
    if not step.kind.is_collective:
        return LocalStep(
            kind=step.kind,
            shape_before=shape_before,
            shape_after=shape_after,
            reduce_op=reduce_op,
            group_size=group_size,
            index_in_group=index_in_group,
            from_dim=from_dim,
            to_dim=to_dim,
            joined=joined,
            kept=kept,
            from_offset=from_offset,
            to_offset=to_offset,
        )
    # Every member of the group sends the same padded shape, so all of them agree on
    # skipping a collective that would move nothing.
    sent = list(shape_before)
    if step.kind in (StepKind.ALL_GATHER, StepKind.ALL_TO_ALL):
        sent[from_dim] = from_piece
    if step.kind in (StepKind.REDUCE_SCATTER, StepKind.ALL_TO_ALL):
        sent[to_dim] = to_piece * group_size
    return CollectiveStep(
        kind=step.kind,
        group_name=context.group_names[mesh_dim] if context.group_names else "",
        group_size=group_size,
        reduce_op=reduce_op,
        sends_nothing=math.prod(sent) == 0,
        shape_before=shape_before,
        shape_after=shape_after,
        from_dim=from_dim,
        to_dim=to_dim,
        from_piece=from_piece,
        to_piece=to_piece,
        joined=joined,
        kept=kept,
        one_round=step.kind in (StepKind.REDUCE_SCATTER, StepKind.ALL_GATHER) and one_round_collectives(context.mesh, mesh_dim),
    )


def _strided_step(
    context: StepCompileContext, step: RedistributeStep, before_state: Placements, after_state: Placements
) -> LocalStep | PieceStep:
    """A step into or out of a ``_StridedShard`` layout (see ``_StridedLayout``)."""
    global_shape = context.global_shape
    mesh_shape = context.mesh_shape
    coordinate = context.coordinate
    shape_before, shape_after = context.local_shape(before_state), context.local_shape(after_state)
    if step.kind is StepKind.SELECT_LOCAL:
        runs = local_index_runs(global_shape, mesh_shape, coordinate, after_state)
        return LocalStep(kind=step.kind, shape_before=shape_before, shape_after=shape_after, piece_runs=runs)
    # What every rank sends: its piece padded to the largest any rank has.
    padded = largest_piece_shape(global_shape, mesh_shape, before_state)
    if step.kind is StepKind.STRIDED_ALL_GATHER:
        mesh_dim = step.mesh_dim
        group_name, group_size = context.group_names[mesh_dim], mesh_shape[mesh_dim]
        tensor_dim = cast(_StridedShard, step.before).dim % len(global_shape)
        members = (coordinate[:mesh_dim] + (index,) + coordinate[mesh_dim + 1 :] for index in range(group_size))
        sizes = tuple(
            run_length(local_index_runs(global_shape, mesh_shape, member, before_state)[tensor_dim]) for member in members
        )
        layout = _StridedLayout(padded_shape=padded, tensor_dim=tensor_dim, member_sizes=sizes)
    else:  # a whole gather
        gathered = step.mesh_dims
        group_name, group_size = "", math.prod(mesh_shape[m] for m in gathered)
        # Row-major over the gathered dims, the others at this rank's coordinate (Replicate there).
        ranks = [
            tuple(dict(zip(gathered, choice)).get(m, c) for m, c in enumerate(coordinate))
            for choice in _product(*(range(mesh_shape[m]) for m in gathered))
        ]
        layout = _StridedLayout(
            padded_shape=padded,
            gather_groups=tuple((context.group_names[m], mesh_shape[m]) for m in reversed(gathered) if mesh_shape[m] > 1),
            piece_runs=tuple(local_index_runs(global_shape, mesh_shape, rank, before_state) for rank in ranks),
            global_shape=global_shape,
        )
    return PieceStep(
        kind=step.kind,
        group_name=group_name,
        group_size=group_size,
        reduce_op="",
        sends_nothing=math.prod(padded) == 0,
        shape_before=shape_before,
        shape_after=shape_after,
        strided=layout,
    )


def _joint_all_reduce(context: StepCompileContext, step: RedistributeStep, before_state: Placements) -> CollectiveStep:
    """A joint all-reduce runs as one all-reduce, over the joint group of its mesh dims."""
    local_shape = context.local_shape(before_state)
    mesh = context.mesh
    joint_group = mesh._joint_group(step.mesh_dims)
    if joint_group is None:
        raise AssertionError(f"the plan uses a joint all-reduce over mesh dims {step.mesh_dims} but {mesh!r} has no group for them")
    context.joint_groups[step.mesh_dims] = joint_group
    assert isinstance(step.before, Partial)
    return CollectiveStep(
        kind=StepKind.JOINT_ALL_REDUCE,
        group_name=joint_group[0],
        group_size=math.prod(context.mesh_shape[d] for d in step.mesh_dims),
        reduce_op=step.before.reduce_op,
        sends_nothing=math.prod(local_shape) == 0,
        shape_before=local_shape,
        shape_after=local_shape,
    )


def _joint_step(
    context: StepCompileContext, step: RedistributeStep, before_state: Placements, after_state: Placements
) -> PieceStep:
    """A step over the joint group of several mesh dims (see ``_JointLayout``)."""
    mesh = context.mesh
    global_shape = context.global_shape
    mesh_shape = context.mesh_shape
    coordinate = context.coordinate
    group_dims = joint_collective_dims(step.kind, before_state, step.mesh_dims)
    joint_group = mesh._joint_group(group_dims)
    if joint_group is None:
        raise AssertionError(f"the plan uses a joint step over mesh dims {group_dims} but {mesh!r} has no group for them")
    context.joint_groups[group_dims] = joint_group
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
    return PieceStep(
        kind=step.kind,
        group_name=group_name,
        group_size=len(group),
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



# -- tensor helpers ------------------------------------------------------------------------


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


def _reduce_contributions(received: torch.Tensor, step: PieceStep, layout: _JointLayout) -> torch.Tensor:
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


def _with_dim(shape: Sequence[int], dim: int, size: int) -> tuple[int, ...]:
    return tuple(size if d == dim else extent for d, extent in enumerate(shape))


