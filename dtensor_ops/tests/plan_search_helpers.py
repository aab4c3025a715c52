"""The test oracle of the planner's search: a straightforward uniform-cost search, and random problems.

``straightforward_plan`` is ``find_cheapest_plan`` as it stood before its search was made faster
(verbatim, but for its name, plus the local copies priced since): it evaluates every step from every
state it expands. ``tests/test_plan_search.py`` checks the product's search against it.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from shardwise.dtensor_ops._cost_model import StepPricer
from shardwise.dtensor_ops._planner.joint_steps import (
    _JOINT_SEARCH_MAX_RANKS,
    _all_boxes,
    _Box,
    _joint_dim_sets,
    _joint_elements,
    _joint_moves,
    joint_transition_kind,
)
from shardwise.dtensor_ops._planner.search import _candidates
from shardwise.dtensor_ops._planner.steps import (
    Placements,
    RedistributeStep,
    StepKind,
    StepPrice,
    _check_problem,
    _fmt,
    _kind_bytes,
    _largest_local_shape,
    local_copy_bytes,
    transition_kind,
)
from shardwise.mesh._cost_profile import BUILTIN_PROFILES
from shardwise.placement import Partial, Placement, Replicate, Shard, _MaskPartial


def straightforward_plan(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    src: Placements,
    dst: Placements,
    itemsize: int,
    *,
    allow_joint_steps: bool = False,
    step_price: StepPrice | None = None,
) -> tuple[RedistributeStep, ...]:
    """``find_cheapest_plan`` as it was before its search was made faster (commit ee1574a^), plus the
    local copies a one-dim step makes, priced since (``local_copy_bytes``).

    ``step_price``: what a step costs (any non-negative integer unit; the time model's picoseconds,
    ``_cost_model.StepPricer.step_picoseconds``). Plans are then ranked by (total price,
    collectives, joint steps, bytes, steps): ties go to fewer collectives, then to plans without
    joint steps (PyTorch's one-dim steps), then to fewer bytes. Without it, by bytes per rank (then
    joint steps, collectives, steps): the plan when bandwidth alone counts, the lower-bound view.

    ``allow_joint_steps``: also consider steps changing several mesh dims with one collective over
    their joint group (the mesh must have those groups).
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
    all_boxes: dict[Placements, dict[tuple[int, ...], _Box]] = {}

    def boxes(state: Placements) -> dict[tuple[int, ...], _Box]:
        found = all_boxes.get(state)
        if found is None:
            found = _all_boxes(global_shape, mesh_shape, state)
            all_boxes[state] = found
        return found

    largest_shapes: dict[Placements, tuple[int, ...]] = {}

    def largest(state: Placements) -> tuple[int, ...]:
        shape = largest_shapes.get(state)
        if shape is None:
            shape = _largest_local_shape(global_shape, mesh_shape, state)
            largest_shapes[state] = shape
        return shape

    # By price: (price, collectives, joint steps, bytes, steps); by bytes: (bytes, joint steps,
    # collectives, bytes, steps). Every entry is an integer sum, so equal plans tie exactly.
    Cost = tuple[int, int, int, int, int]
    zero: Cost = (0, 0, 0, 0, 0)
    best: dict[Placements, Cost] = {src: zero}
    came_from: dict[Placements, tuple[Placements, RedistributeStep]] = {}
    order = itertools.count()
    frontier: list[tuple[Cost, int, Placements]] = [(zero, next(order), src)]
    done: set[Placements] = set()

    def relax(state: Placements, cost: Cost, new_state: Placements, step: RedistributeStep) -> None:
        collective = int(step.kind.is_collective)
        joint = int(bool(step.joint))
        if step_price is None:
            added = (step.bytes_per_rank, joint, collective, step.bytes_per_rank, 1)
        else:
            price = step_price(step.kind, step.mesh_dims, step.bytes_per_rank, step.local_copy_bytes)
            added = (price, collective, joint, step.bytes_per_rank, 1)
        new_cost = (
            cost[0] + added[0],
            cost[1] + added[1],
            cost[2] + added[2],
            cost[3] + added[3],
            cost[4] + added[4],
        )
        known = best.get(new_state)
        if known is None or new_cost < known:
            best[new_state] = new_cost
            came_from[new_state] = (state, step)
            heapq.heappush(frontier, (new_cost, next(order), new_state))

    while frontier:
        cost, _, state = heapq.heappop(frontier)
        if state in done:
            continue
        if state == dst:
            break
        done.add(state)
        for mesh_dim, options in enumerate(candidates):
            for after in options:
                kind = transition_kind(state, mesh_shape, mesh_dim, after)
                if kind is None:
                    continue
                new_state = state[:mesh_dim] + (after,) + state[mesh_dim + 1 :]
                if new_state in done:
                    continue
                moved = _kind_bytes(
                    kind, largest(state), largest(new_state), mesh_shape[mesh_dim], itemsize, after
                )
                copied = 0 if step_price is None else local_copy_bytes(
                    kind, largest(state), largest(new_state), mesh_shape[mesh_dim], itemsize, state[mesh_dim], after
                )
                step = RedistributeStep(mesh_dim, state[mesh_dim], after, kind, moved, local_copy_bytes=copied)
                relax(state, cost, new_state, step)
        for mesh_dims, afters in _joint_moves(state, src, dst, joint_dim_sets, candidates):
            kind = joint_transition_kind(state, mesh_shape, mesh_dims, afters)
            if kind is None:
                continue
            changed = list(state)
            for mesh_dim, after in zip(mesh_dims, afters):
                changed[mesh_dim] = after
            new_state = tuple(changed)
            if new_state in done:
                continue
            elements = _joint_elements(kind, state, mesh_shape, mesh_dims, new_state, boxes(state), boxes(new_state))
            if not elements:
                continue  # pieces that do not fit, or nothing to move (a local step does that)
            joint = tuple((d, state[d], after) for d, after in zip(mesh_dims, afters))
            first_dim, first_before, first_after = joint[0]
            step = RedistributeStep(first_dim, first_before, first_after, kind, elements * itemsize, joint)
            relax(state, cost, new_state, step)
    if dst not in came_from:
        # Every state reaches all-Replicate and all-Replicate reaches every state, so this
        # means a bug in the transition rules, not bad input.
        raise AssertionError(f"no redistribution path from {_fmt(src)} to {_fmt(dst)} on mesh {tuple(mesh_shape)}")
    steps: list[RedistributeStep] = []
    state = dst
    while state != src:
        state, step = came_from[state]
        steps.append(step)
    steps.reverse()
    return tuple(steps)



# -- random problems ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShapeMesh:
    shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None = None


Price = Callable[[StepKind, tuple[int, ...], int, int], int]


def prices(mesh_shape: tuple[int, ...]) -> dict[str, Price | None]:
    mesh = ShapeMesh(mesh_shape)
    return {
        "bytes": None,
        "gloo": StepPricer(mesh, BUILTIN_PROFILES["gloo-loopback"]).step_picoseconds,
        "nccl": StepPricer(mesh, BUILTIN_PROFILES["nccl"]).step_picoseconds,
        # Every collective costs the same: plans tie on price and are told apart by the later keys.
        "latency only": lambda kind, dims, nbytes, copied: 5 if kind.is_collective else 0,
        # Everything is free: collectives, bytes and step counts, then the exploration order, decide.
        "free": lambda kind, dims, nbytes, copied: 0,
        "per dim": lambda kind, dims, nbytes, copied: (dims[0] + 1) * 1000 + nbytes // 64 + copied // 512,
    }


def _random_placement(rng: random.Random, tensor_ndim: int) -> Placement:
    roll = rng.random()
    if roll < 0.25 or (tensor_ndim == 0 and roll < 0.6):
        return Replicate()
    if roll < 0.6:
        return Shard(rng.randrange(tensor_ndim))
    if roll < 0.95:
        return Partial(rng.choice(("sum", "sum", "avg", "max", "min")))
    return _MaskPartial(offset_shape=None, offset_dim=0)


def random_problem(rng: random.Random, max_ranks: int = 512) -> tuple[tuple[int, ...], tuple[int, ...], Placements, Placements, int]:
    """(global shape, mesh shape, src, dst, itemsize) with src != dst."""
    mesh_ndim = rng.randint(1, 4)
    while True:
        mesh_shape = tuple(rng.choice((1, 2, 2, 3, 4, 5, 8)) for _ in range(mesh_ndim))
        if math.prod(mesh_shape) <= max_ranks:
            break
    # Up to 3 tensor dims (2 on 4-D meshes, where the reference's state space grows as 5^4).
    tensor_ndim = rng.choice((0, 1, 2, 2, 3) if mesh_ndim < 4 else (0, 1, 2, 2))
    global_shape = tuple(rng.choice((0, 1, 2, 3, 5, 7, 8, 13, 64, 1000, 4096)) for _ in range(tensor_ndim))
    while True:
        src = tuple(_random_placement(rng, tensor_ndim) for _ in mesh_shape)
        dst = tuple(_random_placement(rng, tensor_ndim) for _ in mesh_shape)
        if src != dst:
            return global_shape, mesh_shape, src, dst, rng.choice((1, 2, 4, 8))


def assert_same_plan(
    got: tuple[RedistributeStep, ...], expected: tuple[RedistributeStep, ...], src: Placements, dst: Placements, problem: Any
) -> None:
    assert got == expected, f"{problem}:\ngot:      {[str(s) for s in got]}\nexpected: {[str(s) for s in expected]}"
    # Where the straightforward search's step holds src's or dst's own placement object (src's until
    # a dim changes), so does ours; the other placements are built per search, equal but not the same.
    for ours, reference in zip(got, expected):
        for mine, theirs in zip(ours.changes, reference.changes):
            mesh_dim = mine[0]
            for own in (src[mesh_dim], dst[mesh_dim]):
                assert (mine[1] is own) == (theirs[1] is own) and (mine[2] is own) == (theirs[2] is own), (problem, ours)
