"""Redistribution: move a DTensor's local shard from one placement tuple to another.

Three layers:

1. ``_planner.plan_redistribute`` — the cheapest plan, plain data, cached by
   ``(source spec, target spec)`` and by the underlying problem
   ``(mesh shape, global shape, item size, placements)``.
2. A per-rank *program*: the plan with this rank's group names, padded sizes, offsets
   and trims worked out once (each step one of ``_executor_steps``' three classes, compiled
   against one ``StepCompileContext`` built for the whole plan), cached by
   ``(source spec, target spec)``.
3. Execution (:func:`_run_steps`, the one executor): a loop over the program's steps, each
   prepared, issued (a ``torch.ops._c10d_functional`` collective, none for a local step) and
   finished alike, for this rank or, under
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
from dataclasses import dataclass
from typing import Any, Sequence, cast

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
    contiguous_strides,
)

from shardwise.mesh import _simulation as simulation

try:
    from torch.utils._debug_mode import get_active_debug_mode as _active_debug_mode
except ImportError:  # a torch without DebugMode records nothing

    def _active_debug_mode() -> Any:  # type: ignore[misc]
        return None


from ._caches import RANK_CACHES, SHARED_CACHES, SYMBOLIC, lookup, store
from ._collectives import AsyncCollectiveTensor, mesh_group_names, wait, wait_local_tensor
from ._planner import (
    RedistributeStep,
    StepKind,
    check_redistribute_specs,
    plan_bytes_per_rank,
    plan_redistribute,
    plan_states,
    redistribute_cost_bytes,
    redistribute_lower_bound_bytes,
)
from ._executor_steps import ExecStep, StepCompileContext, compile_step

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


@dataclass(frozen=True, slots=True)
class _Program:
    src_local_shape: tuple[int, ...]
    dst_local_shape: tuple[int, ...]
    steps: tuple[ExecStep, ...]
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
    # Built once for the whole plan: every step compiles against it.
    context = StepCompileContext(
        mesh=mesh,
        mesh_shape=mesh_shape,
        coordinate=tuple(coordinate_or_none),
        global_shape=global_shape,
        group_names=mesh_group_names(mesh) if any(step.kind.is_collective for step in plan) else (),
        joint_groups={},
        local_shapes={},
    )
    states = plan_states(src.placements, plan)
    steps = [
        compile_step(context, step, before_state, after_state)
        for step, before_state, after_state in zip(plan, states, states[1:])
    ]
    last_collective = -1
    for index, exec_step in enumerate(steps):
        if exec_step.communicates and not exec_step.sends_nothing:
            last_collective = index
    return _Program(
        src_local_shape=context.local_shape(src.placements),
        dst_local_shape=context.local_shape(dst.placements),
        steps=tuple(steps),
        last_collective=last_collective,
        participating=True,
        mesh=mesh,
        group_names=context.group_names,
        joint_groups=tuple(context.joint_groups.items()),
    )


# -- execution -----------------------------------------------------------------------------


def _traced(local: torch.Tensor) -> bool:
    """Whether ``local`` is being traced (torch.compile's fake or functional tensors): there the graph holds
    the collective and its wait, and the compiler places the wait; a pending tensor would only hide it."""
    return torch.compiler.is_compiling() or isinstance(local, (FunctionalTensor, FakeTensor))


@dataclass(frozen=True, slots=True)
class _Continuation:
    """What remains of a program once its last collective has been waited for."""

    program: _Program
    collective_index: int

    def __call__(self, received: torch.Tensor) -> torch.Tensor:
        steps = self.program.steps
        local = steps[self.collective_index].finish(received)
        # The steps after the last collective that moves anything: local ones, or collectives that skip.
        for step in steps[self.collective_index + 1 :]:
            local = local.new_empty(step.shape_after) if step.communicates else step.finish(step.prepare(local))
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

    def issue(self, buffers: list[torch.Tensor], steps: list[ExecStep]) -> torch.Tensor:
        return steps[0].issue(buffers[0])

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

    def issue(self, buffers: list[torch.Tensor], steps: list[ExecStep]) -> torch.Tensor:
        with simulation.mode_disabled():
            joined = self.join(buffers)
        step = steps[0]
        if step.exact_splits is None:
            return step.issue(joined)
        # Every simulated rank sends and receives its own sizes: one SymInt per member, per-rank values.
        members = range(len(step.exact_splits[0]))
        input_splits = [self._per_rank(steps, lambda s, m=m: s.exact_splits[0][m]) for m in members]
        output_splits = [self._per_rank(steps, lambda s, m=m: s.exact_splits[1][m]) for m in members]
        return step.issue(joined, input_splits, output_splits)

    def received(self, waited: torch.Tensor) -> list[torch.Tensor]:
        return self.pieces(waited)

    def _per_rank(self, steps: list[ExecStep], value: Any) -> int | torch.SymInt:
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
            if all(step.sends_nothing for step in steps):
                pieces = [piece.new_empty(step.shape_after) for piece, step in zip(pieces, steps)]
                continue
            prepared = [step.prepare(piece) for piece, step in zip(pieces, steps)]
        received = ranks.received(wait(ranks.issue(prepared, steps))) if steps[0].communicates else prepared
        with ranks.local_work():
            pieces = [
                piece.new_empty(step.shape_after) if step.sends_nothing else step.finish(result)
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
        final = program.steps[last] if last >= 0 else None
        if final is None or not async_op or _traced(local) or final.waits_in_issue:
            return _run_steps(_THIS_RANK, [program], [local], len(program.steps))[0]
        (local,) = _run_steps(_THIS_RANK, [program], [local], last)
        pending = final.issue(final.prepare(local))
        if (
            last == len(program.steps) - 1
            and final.arrives_finished
            and tuple(pending.shape) == tuple(program.dst_local_shape)
        ):
            # Nothing left to do once it arrives: torch's own pending tensor, as PyTorch's DTensor returns.
            return funcol.AsyncCollectiveTensor(pending)
        return AsyncCollectiveTensor(pending, _Continuation(program, last), program.dst_local_shape)
    if isinstance(view, int):
        # One simulated rank, inside run_for_each_simulated_rank: ranks cannot communicate there.
        one = _simulated_program(src, dst, view)
        if any(step.communicates for step in one.steps):
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
