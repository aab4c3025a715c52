"""Mesh dims of size 1: planned on the mesh without them, relabelled for free.

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
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from shardwise.placement import Partial, Replicate, holds_same_values

from .._caches import SHARED_CACHES, store
from .._cost_model import StepPricer
from . import search
from .search import _MAX_CACHE_ENTRIES, _ProblemKey
from .steps import Placements, RedistributeStep, StepKind, StepPrice, _check_problem

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
        return search.find_cheapest_plan(
            global_shape, mesh_shape, src, dst, itemsize, allow_joint_steps=allow_joint_steps, step_price=step_price
        )
    kept_dims = tuple(d for d, size in enumerate(mesh_shape) if size != 1)
    reduced_price: StepPrice | None = None
    if step_price is not None:
        reduced_price = _PriceOnKeptDims(step_price, kept_dims)
    reduced = search.find_cheapest_plan(
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
        reduced = search.find_cheapest_plan(
            global_shape,
            reduced_mesh,
            reduced_src,
            reduced_dst,
            itemsize,
            allow_joint_steps=joint,
            step_price=_PriceOnKeptDims(pricer, kept_dims),
        )
        store(SHARED_CACHES.plans_by_problem, problem, reduced, _MAX_CACHE_ENTRIES)
    return relabel_size_one_dims(mesh_shape, src, dst) + lift_plan(reduced, kept_dims)


