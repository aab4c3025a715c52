"""The planner's search returns exactly the plans of the straightforward search it replaced.

``plan_search_helpers.straightforward_plan`` (the oracle) evaluates every step from every state it
expands; ``find_cheapest_plan`` does pure work once (prices, local shapes, step objects). On random
problems (meshes of 1 to 4 dims with dims of size 1, uneven and empty tensor dims, 0-d tensors, every
Partial kind and ``_MaskPartial``, joint steps on small meshes) and under several prices (bytes, the
gloo and NCCL profiles, prices built to tie), both return the same steps: same order, kinds, bytes and
placement objects, so ties are broken alike.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from plan_search_helpers import assert_same_plan, prices, random_problem, straightforward_plan
from shardwise.dtensor_ops._planner.joint_steps import _JOINT_SEARCH_MAX_RANKS
from shardwise.dtensor_ops._planner.search import _candidates, _uniform_cost_search, find_cheapest_plan
from shardwise.dtensor_ops._planner.steps import StepKind
from shardwise.placement import Shard


@pytest.mark.parametrize("seed", range(4))
def test_random_problems_get_the_straightforward_plans(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        global_shape, mesh_shape, src, dst, itemsize = random_problem(rng)
        for price in prices(mesh_shape).values():
            expected = straightforward_plan(global_shape, mesh_shape, src, dst, itemsize, step_price=price)
            problem = (global_shape, mesh_shape, src, dst, itemsize)
            assert_same_plan(find_cheapest_plan(global_shape, mesh_shape, src, dst, itemsize, step_price=price), expected, src, dst, problem)


@pytest.mark.parametrize("seed", range(2))
def test_random_problems_with_joint_steps_get_the_straightforward_plans(seed: int) -> None:
    # Joint steps are searched on meshes of at most 16 ranks.
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


def test_each_distinct_price_is_asked_once() -> None:
    asked: list[tuple[StepKind, tuple[int, ...], int, int]] = []

    def price(kind: StepKind, dims: tuple[int, ...], nbytes: int, copied: int) -> int:
        asked.append((kind, dims, nbytes, copied))
        return 1000 + nbytes + copied // 8

    src, dst = (Shard(0), Shard(1), Shard(0)), (Shard(1), Shard(0), Shard(1))
    candidates = _candidates(src, dst, 2)
    plan = _uniform_cost_search((64, 64), (4, 4, 4), src, dst, 4, candidates, [], price)
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
