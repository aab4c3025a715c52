"""The search: the cheapest plan between two states of one problem (plain data).

The search is uniform-cost (Dijkstra) over states; the state space is small because
mesh ndim is small.  Costs are compared as ``(bytes, joint steps, collectives, steps)`` so
that among equally cheap plans the one without joint steps, then with fewer collectives,
then fewer steps, wins.  Ties are broken by a fixed exploration order, so every rank
computes the same plan.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Any, Sequence

from shardwise.placement import Partial, Placement, Replicate, Shard

from .joint_steps import (
    _JOINT_SEARCH_MAX_RANKS,
    _all_boxes,
    _Box,
    _joint_dim_sets,
    _joint_elements,
    _joint_moves,
    joint_transition_kind,
)
from .steps import (
    _COLLECTIVE_KINDS,
    Placements,
    RedistributeStep,
    StepKind,
    StepPrice,
    _check_problem,
    _fmt,
    _kind_bytes,
    _largest_local_shape,
    local_copy_bytes,
    reduce_ops_commute,
    step_bytes_per_rank,
    transition_kind,
)

# Caches are dicts cleared when full (_caches.store): a hit must stay a plain dict lookup.
_MAX_CACHE_ENTRIES = 8192

# A planning problem as the caches key it: (mesh shape, global shape, itemsize, src, dst, joint steps, pricing).
_ProblemKey = tuple[tuple[int, ...], tuple[int, ...], int, Placements, Placements, bool, tuple[object, ...]]


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

    ``step_price`` must be a pure function: the search calls it once per distinct (kind, mesh dims,
    bytes, copied bytes).
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
    return _uniform_cost_search(global_shape, mesh_shape, src, dst, itemsize, candidates, joint_dim_sets, step_price)


def _uniform_cost_search(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    src: Placements,
    dst: Placements,
    itemsize: int,
    candidates: Sequence[Sequence[Placement]],
    joint_dim_sets: Sequence[tuple[int, ...]],
    step_price: StepPrice | None,
) -> tuple[RedistributeStep, ...]:
    """The search itself.

    Uniform-cost search from ``src`` to ``dst`` (``src != dst``, both checked) over one-dim steps to
    ``candidates`` and joint steps over ``joint_dim_sets``; see ``find_cheapest_plan``. Pure work is
    done once: a step's price once per (kind, mesh dims, bytes, copied bytes), the largest local shape once per
    state (by torch.chunk arithmetic), a step's rules only into states not yet done, a step object
    only for the plan's own steps (``tests/test_plan_search.py`` checks this against the straightforward
    search of ``tests/plan_search_helpers.py`` on random problems).
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

