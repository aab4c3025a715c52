"""Plans for specs: ``plan_redistribute`` (cached by the specs and by the problem) and what prices a redistribution."""

from __future__ import annotations

from typing import Any

from shardwise.placement import (
    DTensorSpec,
    Partial,
    Replicate,
    _StridedShard,
    compute_local_shape_and_global_offset,
    local_index_runs,
)

from .._caches import SHARED_CACHES, SYMBOLIC, lookup, store
from .._cost_model import StepPricer, pricer_for_mesh
from . import search
from .lower_bound import lower_bound_bytes_per_rank
from .search import _MAX_CACHE_ENTRIES, _ProblemKey
from .size_one_dims import _plan_without_size_one_dims
from .steps import RedistributeStep, _all_coordinates, plan_bytes_per_rank
from .strided_steps import (
    _gather_whole_step,
    _is_strided,
    _select_local_step,
    _strided_all_gather_step,
    strided_gather_dim,
)

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
            plan = search.find_cheapest_plan(
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
