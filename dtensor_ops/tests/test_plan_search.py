"""The planner's search returns exactly the plans of the straightforward search it replaced.

``straightforward_plan`` below is ``find_cheapest_plan`` as it stood before its search was made
faster (verbatim, but for its name): a uniform-cost search that evaluates every step from every state
it expands. ``find_cheapest_plan`` now does pure work once (prices, local shapes, step objects) and,
where the optional C++ module is built (``dtensor_ops/csrc``), runs its one-dim search in C++. On
random problems (meshes of 1 to 4 dims with dims of size 1, uneven and empty tensor dims, 0-d
tensors, every Partial kind and ``_MaskPartial``, joint steps on small meshes) and under several
prices (bytes, the gloo and NCCL profiles, prices built to tie), both return the same steps: same
order, kinds, bytes and placement objects, so ties are broken alike.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import pytest

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
from shardwise.dtensor_ops._planner.search import _candidates, _search_in_python, find_cheapest_plan
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


@pytest.mark.parametrize("seed", range(4))
def test_random_problems_get_the_straightforward_plans(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        global_shape, mesh_shape, src, dst, itemsize = random_problem(rng)
        for price in prices(mesh_shape).values():
            expected = straightforward_plan(global_shape, mesh_shape, src, dst, itemsize, step_price=price)
            problem = (global_shape, mesh_shape, src, dst, itemsize)
            candidates = _candidates(src, dst, len(global_shape))
            # The Python search (the reference and fallback of the C++ one) and whatever
            # find_cheapest_plan runs here (C++ where the module is built).
            assert_same_plan(_search_in_python(global_shape, mesh_shape, src, dst, itemsize, candidates, [], price), expected, src, dst, problem)
            assert_same_plan(find_cheapest_plan(global_shape, mesh_shape, src, dst, itemsize, step_price=price), expected, src, dst, problem)


@pytest.mark.parametrize("seed", range(2))
def test_random_problems_with_joint_steps_get_the_straightforward_plans(seed: int) -> None:
    # Joint steps are searched on meshes of at most 16 ranks, in Python only.
    rng = random.Random(100 + seed)
    for _ in range(25):
        global_shape, mesh_shape, src, dst, itemsize = random_problem(rng, max_ranks=_JOINT_SEARCH_MAX_RANKS)
        for name in ("bytes", "nccl", "latency only"):
            price = prices(mesh_shape)[name]
            expected = straightforward_plan(global_shape, mesh_shape, src, dst, itemsize, allow_joint_steps=True, step_price=price)
            got = find_cheapest_plan(global_shape, mesh_shape, src, dst, itemsize, allow_joint_steps=True, step_price=price)
            assert_same_plan(got, expected, src, dst, (global_shape, mesh_shape, src, dst, itemsize, name))


@pytest.mark.parametrize("mesh_shape", [(4, 4, 4), (8, 8, 8, 8), (4, 4, 2, 2)])
def test_the_benchmark_problems_get_the_straightforward_plans(mesh_shape: tuple[int, ...]) -> None:
    # bench_mesh_scale's move: every mesh dim changes, Shard(i % 2) -> Shard((i + 1) % 2) of 4096x4096 fp32.
    src = tuple(Shard(i % 2) for i in range(len(mesh_shape)))
    dst = tuple(Shard((i + 1) % 2) for i in range(len(mesh_shape)))
    for price in prices(mesh_shape).values():
        expected = straightforward_plan((4096, 4096), mesh_shape, src, dst, 4, step_price=price)
        assert_same_plan(find_cheapest_plan((4096, 4096), mesh_shape, src, dst, 4, step_price=price), expected, src, dst, mesh_shape)
        candidates = _candidates(src, dst, 2)
        assert_same_plan(_search_in_python((4096, 4096), mesh_shape, src, dst, 4, candidates, [], price), expected, src, dst, mesh_shape)


def test_each_distinct_price_is_asked_once() -> None:
    asked: list[tuple[StepKind, tuple[int, ...], int, int]] = []

    def price(kind: StepKind, dims: tuple[int, ...], nbytes: int, copied: int) -> int:
        asked.append((kind, dims, nbytes, copied))
        return 1000 + nbytes + copied // 8

    src, dst = (Shard(0), Shard(1), Shard(0)), (Shard(1), Shard(0), Shard(1))
    candidates = _candidates(src, dst, 2)
    plan = _search_in_python((64, 64), (4, 4, 4), src, dst, 4, candidates, [], price)
    ours = list(asked)
    asked.clear()
    assert plan == straightforward_plan((64, 64), (4, 4, 4), src, dst, 4, step_price=price)
    assert len(set(ours)) == len(ours) and set(ours) == set(asked) and len(ours) < len(asked)


def test_symbolic_shapes_are_planned_once_per_example_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under torch.compile with dynamic shapes a spec's sizes are SymInts (unhashable: specs are not
    # cached); the plan only depends on the example sizes, so the search runs once for them.
    import torch
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from shardwise.dtensor_ops import _planner
    from shardwise.dtensor_ops._planner import search as planner
    from shardwise.dtensor_ops._caches import clear_all_caches
    from shardwise.placement import DTensorSpec, TensorMeta
    from shardwise.testing import FakeMesh

    searches: list[object] = []
    real_search = planner.find_cheapest_plan

    def counted(*args: Any, **kwargs: Any) -> Any:
        searches.append(args)
        return real_search(*args, **kwargs)

    monkeypatch.setattr(planner, "find_cheapest_plan", counted)
    clear_all_caches()
    env = ShapeEnv()
    rows = env.create_symintnode(env.create_symbol(66, ConstantSource("rows")), hint=66)
    mesh = FakeMesh((4,))

    def specs(size: Any) -> tuple[DTensorSpec[Any], DTensorSpec[Any]]:
        meta = TensorMeta(torch.Size([size, 8]), (8, 1), torch.float32)
        return DTensorSpec(mesh, (Shard(0),), meta), DTensorSpec(mesh, (Shard(1),), meta)

    symbolic = _planner.plan_redistribute(*specs(rows))
    assert _planner.plan_redistribute(*specs(rows)) == symbolic  # retraced: no new search
    assert _planner.plan_redistribute(*specs(66)) == symbolic  # the concrete example: the same problem
    assert len(searches) == 1
    assert [step.kind for step in symbolic] == [StepKind.ALL_TO_ALL]
    clear_all_caches()
