"""Mesh dims of size 1 (torchtitan's 4-D/5-D meshes): planned and propagated as on the mesh without them.

A size-1 mesh dim is a group of one rank: every placement there holds the whole tensor's values, so
``plan_redistribute`` plans the problem with those dims removed and relabels them first, for free
(``_planner.size_one_dims``, "Mesh dims of size 1"), and the rule engine enumerates strategies over the
larger dims only. Here: the plans on (1, 2, 1, 2) are the (2, 2) plans plus relabels, the layout
function agrees that the relabels move nothing, an MLP's forward/backward on (1, 2, 1, 2) asks the
planner as often as on (2, 2), and values on 4 gloo ranks match plain torch.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Any, Sequence

import pytest
import torch
import torch.distributed as dist

from redistribute_helpers import PLACEMENTS_1D, check_locals, describe, full_tensor, source_locals
from shardwise.dtensor_ops._planner import search as planner  # where plan_redistribute finds its search
from shardwise.dtensor_ops._caches import clear_all_caches
from shardwise.dtensor_ops._cost_model import pricer_for_mesh
from shardwise.dtensor_ops._planner import (
    RedistributeStep,
    StepKind,
    find_cheapest_plan,
    find_cheapest_plan_without_size_one_dims,
    plan_redistribute,
    plan_states,
    transition_kind,
)
from shardwise.placement import (
    DTensorSpec,
    Partial,
    Placement,
    Replicate,
    Shard,
    TensorMeta,
    _MaskPartial,
    _StridedShard,
    compute_local_shape_and_global_offset,
    select_local_shard,
)
from shardwise.testing import FakeMesh, multi_rank

MESH = (1, 2, 1, 2)
KEPT = (1, 3)  # the dims of size 2: MESH without its size-1 dims is (2, 2)
R, S0, S1 = Replicate(), Shard(0), Shard(1)
# What a size-1 dim may hold on either end (a _MaskPartial is a pending sum with bookkeeping).
SIZE_ONE_PLACEMENTS: tuple[Placement, ...] = (
    *PLACEMENTS_1D,
    _MaskPartial(offset_shape=None, offset_dim=0),
)

Price = Any


def _on_mesh(pair: Sequence[Placement], fillers: Sequence[Placement]) -> tuple[Placement, ...]:
    """A (2, 2) layout on MESH: ``pair`` on the dims of size 2, ``fillers`` on the dims of size 1."""
    return (fillers[0], pair[0], fillers[1], pair[1])


def _expected_relabels(src: Sequence[Placement], dst: Sequence[Placement]) -> list[RedistributeStep]:
    steps = []
    for mesh_dim in (0, 2):
        before, after = src[mesh_dim], dst[mesh_dim]
        if before == after:
            continue
        same_values = isinstance(before, Partial) and isinstance(after, Partial) and before.reduce_op == after.reduce_op
        if isinstance(before, Partial) and isinstance(after, Partial) and not same_values:
            steps.append(RedistributeStep(mesh_dim, before, R, StepKind.RELABEL, 0))
            before = R
        steps.append(RedistributeStep(mesh_dim, before, after, StepKind.RELABEL, 0))
    return steps


def _lifted(plan: Sequence[RedistributeStep]) -> list[RedistributeStep]:
    return [
        RedistributeStep(
            KEPT[s.mesh_dim], s.before, s.after, s.kind, s.bytes_per_rank,
            tuple((KEPT[d], b, a) for d, b, a in s.joint), local_copy_bytes=s.local_copy_bytes,
        )
        for s in plan
    ]


def _per_dim_price(kind: StepKind, dims: tuple[int, ...], nbytes: int, copied: int) -> int:
    # Tells the mesh dims apart (dim 3 is slower than dim 1), as a pricer on a real mesh may.
    if not kind.is_collective and kind is not StepKind.LOCAL_CHUNK:
        return copied // 64
    return sum(1000 * (d + 1) for d in dims) + nbytes // 16 + copied // 64


def _reduced_per_dim_price(kind: StepKind, dims: tuple[int, ...], nbytes: int, copied: int) -> int:
    return _per_dim_price(kind, tuple(KEPT[d] for d in dims), nbytes, copied)


@pytest.mark.parametrize("shape", [(4, 6), (5, 3)])
def test_plans_on_1x2x1x2_are_the_2x2_plans_after_free_relabels(shape: tuple[int, int]) -> None:
    rng = random.Random(sum(shape))
    checked = 0
    for src_pair, dst_pair in itertools.product(itertools.product(PLACEMENTS_1D, repeat=2), repeat=2):
        src = _on_mesh(src_pair, rng.choices(SIZE_ONE_PLACEMENTS, k=2))
        dst = _on_mesh(dst_pair, rng.choices(SIZE_ONE_PLACEMENTS, k=2))
        for joint, price, reduced_price in ((False, None, None), (True, _per_dim_price, _reduced_per_dim_price)):
            got = find_cheapest_plan_without_size_one_dims(shape, MESH, src, dst, 4, allow_joint_steps=joint, step_price=price)
            reference = find_cheapest_plan(shape, (2, 2), src_pair, dst_pair, 4, allow_joint_steps=joint, step_price=reduced_price)
            expected = _expected_relabels(src, dst) + _lifted(reference)
            assert list(got) == expected, (src, dst, joint, [str(s) for s in got], [str(s) for s in expected])
            # The plan runs through the full mesh's states, each one-dim step valid there.
            states = plan_states(src, got)
            assert states[-1] == dst
            for step, state in zip(got, states):
                if not step.joint:
                    assert transition_kind(state, MESH, step.mesh_dim, step.after) is step.kind, (src, dst, step)
            checked += 1
    assert checked == 2 * len(PLACEMENTS_1D) ** 4


def test_the_reduced_plan_is_as_fast_as_the_full_search() -> None:
    # The full search (every state of the 4-D mesh) finds nothing cheaper; relabels are free and a
    # size-1 dim enables no step on another dim.
    rng = random.Random(7)
    for _ in range(30):
        src = tuple(rng.choice(SIZE_ONE_PLACEMENTS) for _ in MESH)
        dst = tuple(rng.choice(SIZE_ONE_PLACEMENTS) for _ in MESH)
        if src == dst:
            continue
        for price in (None, _per_dim_price):
            reduced = find_cheapest_plan_without_size_one_dims((6, 5), MESH, src, dst, 4, step_price=price)
            full = find_cheapest_plan((6, 5), MESH, src, dst, 4, step_price=price)

            def cost(plan: Sequence[RedistributeStep]) -> tuple[int, int]:
                if price is None:
                    return sum(s.bytes_per_rank for s in plan), sum(s.kind.is_collective for s in plan)
                return sum(price(s.kind, s.mesh_dims, s.bytes_per_rank, s.local_copy_bytes) for s in plan), sum(
                    s.kind.is_collective for s in plan
                )

            assert cost(reduced) == cost(full), (src, dst, [str(s) for s in reduced], [str(s) for s in full])


def test_the_layout_function_agrees_that_size_one_dims_hold_everything() -> None:
    # Every rank's piece on (1, 2, 1, 2) is its piece on (2, 2): a size-1 Shard cuts one piece, the whole
    # extent, also between two dims that shard the same tensor dim (nested), and leaves their pieces alone.
    options = (R, S0, S1, Partial("sum"))
    for shape in ((5, 7), (4, 1), (0, 3)):
        for placements in itertools.product(options, repeat=4):
            reduced = (placements[1], placements[3])
            for coordinate in itertools.product(range(1), range(2), range(1), range(2)):
                full_box = compute_local_shape_and_global_offset(shape, MESH, coordinate, placements)
                reduced_box = compute_local_shape_and_global_offset(shape, (2, 2), (coordinate[1], coordinate[3]), reduced)
                assert full_box == reduced_box, (shape, placements, coordinate)


def _spec(mesh_shape: tuple[int, ...], placements: Sequence[Placement], shape: Sequence[int]) -> DTensorSpec[Any]:
    stride = torch.empty(tuple(shape)).stride()
    return DTensorSpec(FakeMesh(mesh_shape, (0,) * len(mesh_shape)), tuple(placements), TensorMeta(torch.Size(shape), stride, torch.float32))


def test_plan_redistribute_searches_once_for_layouts_that_differ_on_size_one_dims(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_all_caches()
    searches: list[Any] = []
    original = planner.find_cheapest_plan

    def counted(*args: Any, **kwargs: Any) -> Any:
        searches.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(planner, "find_cheapest_plan", counted)
    shape = (8, 6)
    src_pair, dst_pair = (S0, Partial("sum")), (S1, S0)
    try:
        planned = []
        for fillers in itertools.product((R, S0, S1, Partial("max")), repeat=2):
            src = _spec(MESH, _on_mesh(src_pair, fillers), shape)
            dst = _spec(MESH, _on_mesh(dst_pair, fillers[::-1]), shape)
            planned.append((src, dst, plan_redistribute(src, dst)))
        assert len(searches) == 1, searches
        plans = []
        for src, dst, plan in planned:
            assert plan == find_cheapest_plan_without_size_one_dims(
                shape, MESH, src.placements, dst.placements, 4, step_price=pricer_for_mesh(src.mesh)
            )
            assert all(step.kind is StepKind.RELABEL for step in plan if step.mesh_dim in (0, 2))
            plans.append([step for step in plan if step.kind is not StepKind.RELABEL])
        assert all(p == plans[0] for p in plans)
        # A mesh without size-1 dims is planned as before: by find_cheapest_plan itself.
        searches.clear()
        flat = plan_redistribute(_spec((2, 2), src_pair, shape), _spec((2, 2), dst_pair, shape))
        assert len(searches) == 1 and searches[0][1] == (2, 2)
        assert [(s.kind, s.bytes_per_rank) for s in flat] == [(s.kind, s.bytes_per_rank) for s in plans[0]]
    finally:
        clear_all_caches()


def test_a_strided_shard_on_a_size_one_dim_is_relabelled_where_the_layout_function_says_so() -> None:
    clear_all_caches()
    strided = _StridedShard(0, split_factor=2)
    src = _spec(MESH, (strided, S0, R, S0), (8, 6))
    dst = _spec(MESH, (R, S1, strided, R), (8, 6))
    plan = plan_redistribute(src, dst)
    assert [s.kind for s in plan if s.mesh_dim in (0, 2)] == [StepKind.RELABEL, StepKind.RELABEL]
    assert plan[2:] == find_cheapest_plan_without_size_one_dims(
        (8, 6), MESH, (R, S0, R, S0), (R, S1, R, R), 4, step_price=pricer_for_mesh(src.mesh)
    )
    # On a dim of size 2 it is a strided layout: the strided steps plan it.
    fsdp_over_tp = _spec((1, 2, 1, 2), (R, _StridedShard(0, split_factor=2), R, S0), (8, 6))
    assert any(s.kind.is_strided for s in plan_redistribute(fsdp_over_tp, _spec(MESH, (R, R, R, S0), (8, 6))))


def test_the_reduced_problem_is_priced_on_the_full_mesh_dims() -> None:
    # The reduced problem's steps are priced on the full mesh's dims they lift to (the kept dims).
    from shardwise.dtensor_ops._cost_model import StepPricer
    from shardwise.mesh._cost_profile import BUILTIN_PROFILES

    rng = random.Random(3)
    mesh_shape = (1, 4, 1, 2)
    pricer = StepPricer(FakeMesh(mesh_shape, (0, 0, 0, 0)), BUILTIN_PROFILES["gloo-loopback"])
    for _ in range(40):
        src = tuple(rng.choice(SIZE_ONE_PLACEMENTS) for _ in mesh_shape)
        dst = tuple(rng.choice(SIZE_ONE_PLACEMENTS) for _ in mesh_shape)
        planned = find_cheapest_plan_without_size_one_dims((64, 48), mesh_shape, src, dst, 4, step_price=pricer)
        reference = find_cheapest_plan(
            (64, 48), (4, 2), (src[1], src[3]), (dst[1], dst[3]), 4,
            step_price=lambda kind, dims, nbytes, copied: pricer(kind, tuple((1, 3)[d] for d in dims), nbytes, copied),
        )
        assert [s for s in planned if s.kind is not StepKind.RELABEL] == [
            dataclasses.replace(s, mesh_dim=(1, 3)[s.mesh_dim]) for s in reference
        ], (src, dst)


def _decision_placements(decision: Any) -> tuple[Any, Any]:
    outputs = decision.output_specs
    flat = outputs if isinstance(outputs, tuple) else (outputs,)
    return (
        tuple(spec.placements for spec in decision.input_specs),
        tuple(None if spec is None else spec.placements for spec in flat),
    )


def test_strategies_over_the_larger_dims_choose_what_the_full_product_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.dtensor_ops import _propagation
    from shardwise.dtensor_ops._decision_pipeline import decide_from_specs

    aten = torch.ops.aten
    rng = random.Random(11)
    options: tuple[Placement, ...] = (R, S0, S1, Partial("sum"), Partial("max"), Partial("avg"))

    def spec_of(placements: Sequence[Placement], shape: tuple[int, ...], mesh_shape: tuple[int, ...] = MESH) -> DTensorSpec[Any]:
        placements = tuple(R if isinstance(p, Shard) and p.dim >= len(shape) else p for p in placements)
        return _spec(mesh_shape, placements, shape)

    calls = [
        (aten.mm.default, [(6, 4), (4, 5)], []),
        (aten.addmm.default, [(5,), (6, 4), (4, 5)], []),
        (aten.add.Tensor, [(6, 4), (6, 4)], []),
        (aten.mul.Tensor, [(6, 4), (4,)], []),
        (aten.sum.dim_IntList, [(6, 4)], [[1]]),
        (aten.mean.dim, [(5, 4)], [[0]]),
        (aten.amax.default, [(6, 4)], [[1]]),
        (aten.relu.default, [(6, 4)], []),
        (aten.t.default, [(6, 4)], []),
        (aten._softmax.default, [(6, 4)], [1, False]),
    ]
    fast_path = [0]
    over_larger_dims = _propagation._cheapest_combination_over_larger_dims

    def counted(*args: Any) -> Any:
        fast_path[0] += 1
        return over_larger_dims(*args)

    monkeypatch.setattr(_propagation, "_cheapest_combination_over_larger_dims", counted)
    checked = 0
    for op, shapes, extra in calls:
        for _ in range(12):
            chosen = [tuple(rng.choice(options) for _ in MESH) for _ in shapes]
            if op in (aten.relu.default, aten._softmax.default, aten.t.default, aten.mean.dim, aten.amax.default):
                # ops whose rules take only some Partial kinds through: keep the inputs' Partials to sums
                chosen = [tuple(Partial("sum") if isinstance(p, Partial) else p for p in c) for c in chosen]
            args = [spec_of(c, shape) for c, shape in zip(chosen, shapes)] + list(extra)
            clear_all_caches()
            fast = _decision_placements(decide_from_specs(op, args, {}))
            with monkeypatch.context() as patched:
                patched.setattr(_propagation, "_size_one_dims_choose_freely", lambda call, per_mesh_dim: False)
                clear_all_caches()
                full = _decision_placements(decide_from_specs(op, args, {}))
            assert fast == full, (op, chosen, fast, full)
            # ... and, on the larger dims, what the mesh without the size-1 dims chooses.
            flat_args = [spec_of((c[1], c[3]), shape, (2, 2)) for c, shape in zip(chosen, shapes)] + list(extra)
            flat = _decision_placements(decide_from_specs(op, flat_args, {}))
            reduced = tuple(
                tuple(None if p is None else (p[1], p[3]) for p in group) for group in fast
            )
            assert reduced == flat, (op, chosen, fast, flat)
            checked += 1
    assert checked == 12 * len(calls)
    assert fast_path[0] == checked, fast_path  # every (1, 2, 1, 2) decision took the product over the larger dims
    clear_all_caches()


# -- 4 gloo ranks -----------------------------------------------------------------------------------


def _redistribution_problems(mesh: Any) -> list[str]:
    from shardwise.dtensor_ops._plan_executor import redistribute_local_tensor

    mesh_shape = tuple(mesh.shape)
    coordinate = tuple(mesh.get_coordinate())
    P_SUM, P_MAX, P_AVG = Partial("sum"), Partial("max"), Partial("avg")
    cases = [
        # nested: S(0) on dims 1 and 3 with a size-1 S(0) between them
        ((R, S0, S0, S0), (S1, S1, R, S1)),
        ((S0, S0, S1, S0), (R, R, R, R)),
        ((P_SUM, P_SUM, R, S0), (S0, S1, S1, S1)),
        ((P_MAX, S0, P_SUM, P_SUM), (R, S1, P_AVG, S0)),
        ((R, P_MAX, S1, P_SUM), (P_MAX, S1, S1, S1)),
        ((S1, S0, P_AVG, S1), (P_SUM, S1, S0, S0)),
        ((P_SUM, S0, P_MAX, P_SUM), (P_MAX, S1, S1, R)),
        ((R, P_SUM, R, P_SUM), (S0, R, P_SUM, S0)),
        # a _StridedShard on a size-1 dim: one piece of every index, relabelled
        ((_StridedShard(0, split_factor=2), S0, R, S0), (R, S1, _StridedShard(1, split_factor=2), R)),
        ((R, S1, _StridedShard(1, split_factor=2), P_SUM), (_StridedShard(0, split_factor=2), S0, S1, S0)),
    ]
    problems = []
    partial_results = []
    for index, (src, dst) in enumerate(cases):
        shape = (6, 5) if index % 2 else (4, 8)
        full = full_tensor(shape, index)
        local = source_locals(full, mesh_shape, src, index + 1)[coordinate]
        stride = torch.empty(shape).stride()
        meta = TensorMeta(torch.Size(shape), stride, torch.float32)
        result = redistribute_local_tensor(local, DTensorSpec(mesh, src, meta), DTensorSpec(mesh, dst, meta))
        if any(isinstance(p, Partial) for p in dst):
            partial_results.append((index, result))
            continue
        expected = select_local_shard(full, mesh_shape, coordinate, dst)
        if result.shape != expected.shape or not torch.equal(result, expected):
            problems.append(f"{describe(src)} -> {describe(dst)}: rank {dist.get_rank()} got {result}, expected {expected}")
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (coordinate, partial_results))
    by_case: dict[int, dict[tuple[int, ...], torch.Tensor]] = {}
    for rank_coordinate, rank_results in gathered:
        for index, tensor in rank_results:
            by_case.setdefault(index, {})[rank_coordinate] = tensor
    for index, locals_by_coordinate in by_case.items():
        src, dst = cases[index]
        shape = (6, 5) if index % 2 else (4, 8)
        problems += [
            f"{describe(src)} -> {describe(dst)}: {p}"
            for p in check_locals(full_tensor(shape, index), mesh_shape, dst, locals_by_coordinate)
        ]
    return problems


def _mlp_forward_backward(mesh_shape: tuple[int, ...]) -> tuple[int, list[str]]:
    """Planner searches for a 5-layer MLP's forward and backward, and what differs from plain torch."""
    from shardwise.dtensor_ops import distribute_tensor
    from shardwise.mesh import init_device_mesh

    clear_all_caches()
    searches = [0]
    original = planner.find_cheapest_plan

    def counted(*args: Any, **kwargs: Any) -> Any:
        searches[0] += 1
        return original(*args, **kwargs)

    planner.find_cheapest_plan = counted
    try:
        mesh = init_device_mesh("cpu", mesh_shape)
        dp, tp = [d for d, size in enumerate(mesh_shape) if size > 1]

        def placements(dp_placement: Placement, tp_placement: Placement, fillers: Sequence[Placement]) -> list[Placement]:
            # On the 4-D mesh the size-1 dims 0 and 2 hold ``fillers``.
            chosen: list[Placement] = [fillers[0], R, fillers[1], R] if len(mesh_shape) == 4 else [R, R]
            chosen[dp], chosen[tp] = dp_placement, tp_placement
            return chosen

        torch.manual_seed(0)
        width, layers = 8, 5
        full_weights = [torch.randn(width, width, dtype=torch.float64) / 3 for _ in range(layers)]
        full_x = torch.randn(6, width, dtype=torch.float64)
        weights = [
            distribute_tensor(w, mesh, placements(R, S0 if i % 2 == 0 else S1, (S1, R) if i % 2 else (R, S0))).requires_grad_()
            for i, w in enumerate(full_weights)
        ]
        # On the 4-D mesh the batch is cut by dp and (one piece: the whole) by the size-1 dim 2 inside it.
        x = distribute_tensor(full_x, mesh, placements(S0, R, (R, S0)))
        h: Any = x
        for w in weights:
            h = torch.relu(h @ w.t())
        loss: Any = (h * h).sum()
        loss.backward()

        plain_weights = [w.clone().requires_grad_() for w in full_weights]
        plain_h = full_x
        for w in plain_weights:
            plain_h = torch.relu(plain_h @ w.t())
        plain_loss = (plain_h * plain_h).sum()
        plain_loss.backward()

        problems = []
        if not torch.allclose(loss.full_tensor(), plain_loss):
            problems.append(f"loss {loss.full_tensor()} != {plain_loss}")
        if not torch.allclose(h.full_tensor(), plain_h):
            problems.append("output differs")
        for i, (w, plain) in enumerate(zip(weights, plain_weights)):
            grad: Any = w.grad
            assert grad is not None and plain.grad is not None
            if not torch.allclose(grad.full_tensor(), plain.grad):
                problems.append(f"gradient of weight {i} differs")
        return searches[0], problems
    finally:
        planner.find_cheapest_plan = original
        clear_all_caches()


@multi_rank(world_size=4)
def test_on_four_ranks_size_one_dims_match_plain_torch_and_search_as_2x2() -> None:
    from shardwise.mesh import init_device_mesh

    problems = _redistribution_problems(init_device_mesh("cpu", MESH))
    assert not problems, "\n".join(problems)
    flat_searches, flat_problems = _mlp_forward_backward((2, 2))
    searches, mlp_problems = _mlp_forward_backward(MESH)
    assert not flat_problems and not mlp_problems, flat_problems + mlp_problems
    # Searches counted, not timed: (1, 2, 1, 2) asks the planner as often as (2, 2) (before: ~10x).
    assert 0 < searches <= flat_searches, (searches, flat_searches)
