"""Redistribution planner and per-rank programs, without processes.

Programs are run for every coordinate of the mesh in lockstep, with each collective
emulated here from its c10d definition (all-gather = concatenate along dim 0, ...), so
the padding / regrouping / trimming logic is checked exhaustively on every pair of
layouts while the multi-rank tests check the real collectives.
"""

from __future__ import annotations

import itertools
import pickle
import random
from typing import Any, Sequence

import pytest
import torch

import shardwise.dtensor_ops._plan_executor as executor_module  # where the executor waits
import shardwise.dtensor_ops._executor_steps as redistribute_module  # where the steps launch collectives
from redistribute_helpers import (
    PLACEMENTS_1D,
    Coordinate,
    all_coordinates,
    check_locals,
    describe,
    expected_1d_collectives,
    full_tensor,
    placement_tuples,
    source_locals,
)
from shardwise.dtensor_ops._collectives import AsyncCollectiveTensor, wait_local_tensor
from shardwise.dtensor_ops._caches import clear_all_caches
from shardwise.mesh import MeshError
from shardwise.dtensor_ops._plan_executor import (
    _compile_program,
    gradient_placements,
    grad_target_spec,
    plan_redistribute,
    redistribute_cost_bytes,
    redistribute_local_tensor,
    redistribute_lower_bound_bytes,
)
from shardwise.dtensor_ops._planner import (
    RedistributeStep,
    StepKind,
    find_cheapest_plan,
    lower_bound_bytes_per_rank,
    naive_greedy_plan,
    plan_bytes_per_rank,
    plan_states,
    step_bytes_per_rank,
    transition_kind,
)
from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta
from shardwise.testing import FakeMesh

S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()
P_SUM, P_AVG, P_MAX, P_MIN = Partial("sum"), Partial("avg"), Partial("max"), Partial("min")
FLOAT = 4  # float32 itemsize


def spec(
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    shape: Sequence[int],
    coordinate: Coordinate | None = None,
    dtype: torch.dtype = torch.float32,
) -> DTensorSpec[Any]:
    if coordinate is None:
        coordinate = (0,) * len(mesh_shape)
    stride = torch.empty(tuple(shape)).stride()
    return DTensorSpec(
        FakeMesh(mesh_shape, coordinate), tuple(placements), TensorMeta(torch.Size(shape), stride, dtype)
    )


# -- emulated collectives ---------------------------------------------------------------------------


def _reduce(tensors: list[torch.Tensor], c10d_op: str) -> torch.Tensor:
    stacked = torch.stack(tensors)
    if c10d_op == "sum":
        return stacked.sum(0)
    if c10d_op == "max":
        return stacked.amax(0)
    assert c10d_op == "min", c10d_op
    return stacked.amin(0)


def _emulate(kind: str, inputs: list[torch.Tensor], c10d_op: str) -> list[torch.Tensor]:
    """What each group member receives, straight from the collective's definition."""
    members = len(inputs)
    assert len({tuple(t.shape) for t in inputs}) == 1, f"{kind}: members send different shapes"
    if kind == "all_gather":
        return [torch.cat(inputs, 0)] * members
    if kind == "all_reduce":
        return [_reduce(inputs, c10d_op)] * members
    if kind == "reduce_scatter":
        return list(_reduce(inputs, c10d_op).chunk(members, 0))
    assert kind == "all_to_all"
    pieces = [t.chunk(members, 0) for t in inputs]
    return [torch.cat([pieces[sender][receiver] for sender in range(members)], 0) for receiver in range(members)]


class _Recorder:
    """Stands in for the launch helpers: records what would be sent instead of sending it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, torch.Tensor, str]] = []
        self.groups: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def gather(t: torch.Tensor, size: int, group: str) -> torch.Tensor:
            self.groups.append(group)
            return self._record("all_gather", t, "")

        def scatter(t: torch.Tensor, op: str, size: int, group: str) -> torch.Tensor:
            return self._record("reduce_scatter", t, op)

        def reduce(t: torch.Tensor, op: str, group: str) -> torch.Tensor:
            return self._record("all_reduce", t, op)

        def exchange(t: torch.Tensor, size: int, group: str) -> torch.Tensor:
            assert t.size(0) % size == 0
            return self._record("all_to_all", t, "")

        monkeypatch.setattr(redistribute_module, "launch_all_gather", gather)
        monkeypatch.setattr(redistribute_module, "launch_reduce_scatter", scatter)
        monkeypatch.setattr(redistribute_module, "launch_all_reduce", reduce)
        monkeypatch.setattr(redistribute_module, "launch_all_to_all", exchange)

    def _record(self, kind: str, tensor: torch.Tensor, op: str) -> torch.Tensor:
        self.calls.append((kind, tensor.contiguous(), {"sum": "sum", "avg": "sum"}.get(op, op)))
        return tensor


def simulate(
    recorder: _Recorder,
    mesh_shape: Sequence[int],
    global_shape: Sequence[int],
    src: Sequence[Placement],
    dst: Sequence[Placement],
    locals_by_coordinate: dict[Coordinate, torch.Tensor],
    dtype: torch.dtype = torch.float32,
) -> tuple[dict[Coordinate, torch.Tensor], list[str]]:
    """Run the program of every coordinate in lockstep; returns the results and the collective kinds."""
    coordinates = all_coordinates(mesh_shape)

    def layout(placements: Sequence[Placement], c: Coordinate | None = None) -> DTensorSpec[Any]:
        return spec(mesh_shape, placements, global_shape, c, dtype)

    plan = plan_redistribute(layout(src), layout(dst))
    programs = {c: _compile_program(layout(src, c), layout(dst, c), plan) for c in coordinates}
    values = dict(locals_by_coordinate)
    for c in coordinates:
        assert tuple(values[c].shape) == programs[c].src_local_shape
    kinds: list[str] = []
    step_count = len(programs[coordinates[0]].steps)
    for index in range(step_count):
        steps = {c: programs[c].steps[index] for c in coordinates}
        first = steps[coordinates[0]]
        if not first.communicates:
            values = {c: steps[c].finish(steps[c].prepare(values[c])) for c in coordinates}
            continue
        mesh_dim = plan[index].mesh_dim
        # Groups skip independently, but every member of a group must agree.
        received: dict[Coordinate, torch.Tensor] = {}
        step_kinds: set[str] = set()
        for c in coordinates:
            if c[mesh_dim] != 0:
                continue
            group = [c[:mesh_dim] + (i,) + c[mesh_dim + 1 :] for i in range(mesh_shape[mesh_dim])]
            if {steps[m].sends_nothing for m in group} != {steps[c].sends_nothing}:
                raise AssertionError(f"group {group} disagrees about skipping step {index}")
            if steps[c].sends_nothing:
                for member in group:
                    received[member] = values[member].new_empty(steps[member].shape_after)
                continue
            recorder.calls.clear()
            for member in group:
                steps[member].issue(steps[member].prepare(values[member]))
            kind_names = {call[0] for call in recorder.calls}
            assert len(recorder.calls) == len(group) and len(kind_names) == 1
            step_kinds.add(recorder.calls[0][0])
            outputs = _emulate(recorder.calls[0][0], [call[1] for call in recorder.calls], recorder.calls[0][2])
            for member, output in zip(group, outputs):
                received[member] = steps[member].finish(output.clone())
        assert len(step_kinds) <= 1, f"step {index}: groups ran different collectives {step_kinds}"
        kinds.extend(step_kinds)
        values = received
    return values, kinds


def run_case(
    monkeypatch: pytest.MonkeyPatch,
    mesh_shape: Sequence[int],
    src: Sequence[Placement],
    dst: Sequence[Placement],
    shape: Sequence[int],
    seed: int,
    *,
    dtype: torch.dtype = torch.float32,
    transposed_locals: bool = False,
) -> tuple[list[str], list[str]]:
    recorder = _Recorder()
    recorder.install(monkeypatch)
    full = full_tensor(shape, seed).to(dtype)
    locals_by_coordinate = source_locals(full, mesh_shape, src, seed + 1)
    if transposed_locals:
        # Same values, column-major strides.
        locals_by_coordinate = {c: t.t().contiguous().t() for c, t in locals_by_coordinate.items()}
    results, kinds = simulate(recorder, mesh_shape, shape, src, dst, locals_by_coordinate, dtype)
    problems = check_locals(full, mesh_shape, dst, results)
    prefix = f"{describe(src)} -> {describe(dst)} on mesh {tuple(mesh_shape)}, shape {tuple(shape)}: "
    return [prefix + p for p in problems], kinds


def planned_collectives(mesh_shape: Sequence[int], src: Sequence[Placement], dst: Sequence[Placement], shape: Sequence[int]) -> list[str]:
    plan = plan_redistribute(spec(mesh_shape, src, shape), spec(mesh_shape, dst, shape))
    return [step.kind.value for step in plan if step.kind.is_collective]


# -- 1-D: hand-derived expectations ----------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8, 6), (7, 5), (3, 5)])
def test_every_1d_pair_gives_the_full_tensor_with_the_expected_collectives(
    monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int]
) -> None:
    problems: list[str] = []
    for seed, (src, dst) in enumerate(itertools.product(PLACEMENTS_1D, repeat=2)):
        case_problems, kinds = run_case(monkeypatch, (4,), (src,), (dst,), shape, seed)
        problems += case_problems
        if kinds != expected_1d_collectives(src, dst, shape):
            problems.append(f"{src} -> {dst} {shape}: collectives {kinds}, expected {expected_1d_collectives(src, dst, shape)}")
    assert not problems, "\n".join(problems)


def test_single_step_costs_on_1d_mesh_of_4() -> None:
    mesh, shape = (4,), (8, 6)
    local_rows = 2 * 6  # an S(0) shard of 8x6 over 4

    def cost(src: Placement, dst: Placement) -> int:
        return plan_bytes_per_rank(plan_redistribute(spec(mesh, (src,), shape), spec(mesh, (dst,), shape)))

    assert cost(S0, R) == 3 * local_rows * FLOAT
    assert cost(P_SUM, S0) == 3 * local_rows * FLOAT
    assert cost(P_SUM, R) == 2 * 3 * (48 // 4) * FLOAT
    # S(0) -> S(1): each rank keeps one 2x2 block of its 2x6 shard and swaps three.
    assert cost(S0, S1) == 3 * (2 * 2) * FLOAT
    assert cost(R, S1) == cost(R, P_SUM) == cost(S0, P_MAX) == 0
    # Uneven: 7 rows over 4 ranks pad to 2 rows per piece.
    assert plan_bytes_per_rank(
        plan_redistribute(spec(mesh, (S0,), (7, 5)), spec(mesh, (R,), (7, 5)))
    ) == 3 * 2 * 5 * FLOAT


# -- 2-D and 3-D --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8, 6), (7, 5), (3, 5)])
def test_every_2x2_pair_gives_the_full_tensor(monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int]) -> None:
    problems: list[str] = []
    tuples = list(placement_tuples(2))
    for seed, (src, dst) in enumerate(itertools.product(tuples, repeat=2)):
        case_problems, kinds = run_case(monkeypatch, (2, 2), src, dst, shape, seed)
        problems += case_problems
        planned = planned_collectives((2, 2), src, dst, shape)
        if kinds != planned:
            problems.append(f"{describe(src)} -> {describe(dst)} {shape}: ran {kinds}, planned {planned}")
        if len(problems) > 20:
            break
    assert not problems, "\n".join(problems)


def test_random_pairs_on_a_3d_mesh_and_3d_tensor_give_the_full_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    chooser = random.Random(7)
    options: list[Placement] = [S0, S1, S2, R, P_SUM, P_MAX, P_AVG]
    problems: list[str] = []
    for seed in range(120):
        src = tuple(chooser.choice(options) for _ in range(3))
        dst = tuple(chooser.choice(options) for _ in range(3))
        shape = chooser.choice([(4, 4, 4), (5, 3, 6), (3, 2, 5)])
        case_problems, _ = run_case(monkeypatch, (2, 2, 2), src, dst, shape, seed)
        problems += case_problems
    assert not problems, "\n".join(problems)


def test_uneven_mesh_shapes_and_size_one_mesh_dims(monkeypatch: pytest.MonkeyPatch) -> None:
    problems: list[str] = []
    for mesh_shape in [(1, 4), (4, 1), (3, 2)]:
        for seed, (src, dst) in enumerate(
            itertools.product([(S0, S0), (S1, R), (P_SUM, S0), (R, P_MAX), (S0, S1), (P_AVG, P_SUM)], repeat=2)
        ):
            case_problems, _ = run_case(monkeypatch, mesh_shape, src, dst, (7, 5), seed)
            problems += case_problems
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.bfloat16])
def test_other_dtypes_and_non_contiguous_locals(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    # Integers exercise the identity fill of max/min (iinfo, not inf); Partial('avg') refuses them (an
    # integer average would be truncated), so they skip it.
    problems: list[str] = []
    layouts = [(S0, S0), (S1, R), (P_SUM, S1), (P_AVG, R), (P_MAX, S0), (R, P_MIN), (S1, S0)]
    if not dtype.is_floating_point:
        layouts.remove((P_AVG, R))
        with pytest.raises(ValueError, match=r"Partial\('avg'\).*needs a floating-point or complex dtype"):
            spec((2, 2), (P_AVG, R), (7, 5), dtype=dtype)
    for seed, (src, dst) in enumerate(itertools.product(layouts, repeat=2)):
        case_problems, _ = run_case(monkeypatch, (2, 2), src, dst, (7, 5), seed, dtype=dtype, transposed_locals=True)
        problems += case_problems
    assert not problems, "\n".join(problems)


def test_mesh_dims_of_size_one_never_communicate() -> None:
    for src, dst in itertools.product(placement_tuples(2), repeat=2):
        plan = plan_redistribute(spec((1, 4), src, (8, 6)), spec((1, 4), dst, (8, 6)))
        assert all(step.kind is StepKind.RELABEL for step in plan if step.mesh_dim == 0), plan


def test_empty_global_dims_move_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    problems: list[str] = []
    for seed, (src, dst) in enumerate(itertools.product([(S0, S1), (R, S0), (P_SUM, R), (S1, S0)], repeat=2)):
        case_problems, kinds = run_case(monkeypatch, (2, 2), src, dst, (0, 5), seed)
        problems += case_problems
        assert kinds == [], (src, dst, kinds)
    assert not problems, "\n".join(problems)


# -- search quality -----------------------------------------------------------------------------------


def test_search_moves_less_than_a_left_to_right_greedy_plan() -> None:
    # (R, S(0)) -> (S(0), S(1)): mesh dim 0 cannot shard rows while mesh dim 1 (inner)
    # still does, so a left-to-right planner first gathers mesh dim 1 back to full
    # rows and goes through a fully replicated state.  The search swaps mesh dim 1 to
    # columns with one all-to-all and then chunks rows locally.
    mesh, shape = (2, 2), (8, 6)
    src, dst = (R, S0), (S0, S1)
    ours = find_cheapest_plan(shape, mesh, src, dst, FLOAT)
    greedy = naive_greedy_plan(shape, mesh, src, dst, FLOAT)
    assert [s.kind for s in ours] == [StepKind.ALL_TO_ALL, StepKind.LOCAL_CHUNK]
    assert (R, R) in plan_states(src, greedy)
    assert plan_bytes_per_rank(ours) == 4 * 3 * FLOAT  # one 4x3 block to the one peer
    assert plan_bytes_per_rank(greedy) == 4 * 6 * FLOAT  # a whole 4x6 shard
    assert plan_bytes_per_rank(ours) == lower_bound_bytes_per_rank(shape, mesh, src, dst, FLOAT)


def test_search_parks_an_inner_shard_on_another_tensor_dim_to_unshard_an_outer_one() -> None:
    # (S(0), S(0)) -> (R, S(0)): gathering the outer mesh dim needs the inner one out of
    # the way; moving it to columns (all-to-all on a quarter) beats gathering it.
    mesh, shape = (2, 2), (8, 8)
    ours = find_cheapest_plan(shape, mesh, (S0, S0), (R, S0), FLOAT)
    greedy = naive_greedy_plan(shape, mesh, (S0, S0), (R, S0), FLOAT)
    assert plan_bytes_per_rank(ours) < plan_bytes_per_rank(greedy)
    assert any(step.after == S1 for step in ours)


def test_search_is_never_worse_than_greedy_nor_below_the_lower_bound() -> None:
    for mesh_shape, shape in [((2, 2), (8, 6)), ((2, 2), (7, 5)), ((4,), (7, 5))]:
        tuples = list(placement_tuples(len(mesh_shape)))
        for src, dst in itertools.product(tuples, repeat=2):
            ours = plan_bytes_per_rank(find_cheapest_plan(shape, mesh_shape, src, dst, FLOAT))
            greedy = plan_bytes_per_rank(naive_greedy_plan(shape, mesh_shape, src, dst, FLOAT))
            floor = lower_bound_bytes_per_rank(shape, mesh_shape, src, dst, FLOAT)
            assert floor <= ours <= greedy, (describe(src), describe(dst), shape, floor, ours, greedy)


@pytest.mark.parametrize(
    ("src", "dst"),
    [(S0, R), (S1, R), (P_SUM, R), (P_MAX, R), (P_SUM, S0), (P_MIN, S1), (S0, S1), (S1, S0)],
)
def test_lower_bound_is_met_by_single_collectives_on_even_shapes(src: Placement, dst: Placement) -> None:
    shape, mesh = (8, 12), (4,)
    plan = find_cheapest_plan(shape, mesh, (src,), (dst,), FLOAT)
    assert len(plan) == 1
    assert plan_bytes_per_rank(plan) == lower_bound_bytes_per_rank(shape, mesh, (src,), (dst,), FLOAT)


def test_every_step_of_every_plan_is_valid_where_it_runs() -> None:
    for src, dst in itertools.product(placement_tuples(2), repeat=2):
        plan = find_cheapest_plan((7, 5), (2, 2), src, dst, FLOAT)
        for state, step in zip(plan_states(src, plan), plan):
            assert transition_kind(state, (2, 2), step.mesh_dim, step.after) is step.kind
            assert step.bytes_per_rank == step_bytes_per_rank((7, 5), (2, 2), state, step.mesh_dim, step.after, FLOAT)


def test_nested_shards_unshard_inner_mesh_dims_first() -> None:
    # Outer mesh dim 0 cannot gather rows while mesh dim 1 splits its pieces.
    assert transition_kind((S0, S0), (2, 2), 0, R) is None
    assert transition_kind((S0, S0), (2, 2), 1, R) is StepKind.ALL_GATHER
    # Nor can it start sharding rows under an inner shard of rows.
    assert transition_kind((R, S0), (2, 2), 0, S0) is None
    assert transition_kind((S0, R), (2, 2), 1, S0) is StepKind.LOCAL_CHUNK
    plan = find_cheapest_plan((8, 6), (2, 2), (S0, S0), (R, R), FLOAT)
    assert [(s.mesh_dim, s.kind) for s in plan] == [(1, StepKind.ALL_GATHER), (0, StepKind.ALL_GATHER)]


def test_partial_ops_change_only_through_a_non_partial_state() -> None:
    assert transition_kind((P_SUM,), (4,), 0, P_MAX) is None
    for src, dst in itertools.permutations([P_SUM, P_AVG, P_MAX, P_MIN], 2):
        states = plan_states((src,), find_cheapest_plan((8, 6), (4,), (src,), (dst,), FLOAT))
        assert any(not isinstance(state[0], Partial) for state in states[1:-1]), states


def test_mixed_partials_reduce_the_last_mesh_dim_first() -> None:
    # sum over mesh dim 0 of max over mesh dim 1: max must be reduced first.
    assert transition_kind((P_SUM, P_MAX), (2, 2), 0, R) is None
    assert transition_kind((P_SUM, P_MAX), (2, 2), 1, R) is StepKind.ALL_REDUCE
    # Linear ops commute: either order is fine.
    assert transition_kind((P_SUM, P_AVG), (2, 2), 0, R) is StepKind.ALL_REDUCE
    assert transition_kind((P_MAX, P_MAX), (2, 2), 0, S0) is StepKind.REDUCE_SCATTER


# -- caching, plain data, API ------------------------------------------------------------------------


def test_plans_are_cached_plain_data() -> None:
    clear_all_caches()
    src, dst = spec((2, 2), (S0, P_SUM), (8, 6)), spec((2, 2), (R, S1), (8, 6))
    plan = plan_redistribute(src, dst)
    assert plan_redistribute(src, dst) is plan
    # Another coordinate (another rank) shares the plan of the same problem.
    other = plan_redistribute(spec((2, 2), (S0, P_SUM), (8, 6), (1, 1)), spec((2, 2), (R, S1), (8, 6), (1, 1)))
    assert other is plan
    assert isinstance(plan, tuple) and all(isinstance(step, RedistributeStep) for step in plan)
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert hash(plan) == hash(pickle.loads(pickle.dumps(plan)))
    with pytest.raises(AttributeError):
        plan[0].mesh_dim = 1  # type: ignore[misc]
    assert redistribute_cost_bytes(src, dst) == plan_bytes_per_rank(plan)
    assert redistribute_lower_bound_bytes(src, dst) <= redistribute_cost_bytes(src, dst)


def test_identical_specs_need_no_steps_and_return_the_input() -> None:
    same = spec((4,), (S0,), (8, 6))
    assert plan_redistribute(same, same) == ()
    local = torch.ones(2, 6)
    assert redistribute_local_tensor(local, same, same) is local


def test_plan_depends_on_item_size_only_through_costs() -> None:
    small = plan_redistribute(spec((4,), (S0,), (8, 6), dtype=torch.float16), spec((4,), (R,), (8, 6), dtype=torch.float16))
    large = plan_redistribute(spec((4,), (S0,), (8, 6), dtype=torch.float64), spec((4,), (R,), (8, 6), dtype=torch.float64))
    assert [s.kind for s in small] == [s.kind for s in large]
    assert plan_bytes_per_rank(large) == 4 * plan_bytes_per_rank(small)


def test_bad_specs_and_locals_are_refused_before_any_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = _Recorder()
    recorder.install(monkeypatch)
    src = spec((4,), (S0,), (8, 6))
    with pytest.raises(ValueError, match=r"local tensor has shape \(3, 6\).*\(2, 6\)"):
        redistribute_local_tensor(torch.ones(3, 6), src, spec((4,), (R,), (8, 6)))
    with pytest.raises(ValueError, match=r"global shape \(8, 6\).*\(8, 7\)"):
        plan_redistribute(src, spec((4,), (R,), (8, 7)))
    with pytest.raises(ValueError, match="between meshes"):
        plan_redistribute(src, DTensorSpec(FakeMesh((2, 2), (0, 0)), (R, R), src.tensor_meta))
    with pytest.raises(ValueError, match="no tensor_meta"):
        plan_redistribute(DTensorSpec(src.mesh, (S0,)), src)
    no_groups = DTensorSpec(FakeMesh((4,), (0,), ()), (S0,), src.tensor_meta)
    with pytest.raises(MeshError, match="without process group names"):
        redistribute_local_tensor(torch.ones(2, 6), no_groups, DTensorSpec(no_groups.mesh, (R,), src.tensor_meta))
    assert recorder.calls == []


def test_a_rank_outside_the_mesh_gets_an_empty_tensor_without_communicating(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = _Recorder()
    recorder.install(monkeypatch)
    outside = FakeMesh((4,), None, ())
    meta = TensorMeta(torch.Size((8, 6)), (6, 1), torch.float32)
    result = redistribute_local_tensor(
        torch.empty(0), DTensorSpec(outside, (S0,), meta), DTensorSpec(outside, (R,), meta)
    )
    assert result.shape == (0,)  # PyTorch's tensor([]) for a rank that holds nothing
    assert recorder.calls == []


# -- autograd rule ---------------------------------------------------------------------------------


def test_gradient_goes_back_to_the_source_layout_with_partials_replicated() -> None:
    cases = [
        ((S0, S1), (R, R), (S0, S1)),
        ((P_SUM, S0), (R, S0), (R, S0)),
        ((P_MAX, P_AVG), (S0, R), (R, R)),
        ((R, S0), (P_SUM, S0), (R, S0)),  # a Partial target changes nothing
    ]
    for src, dst, grad in cases:
        src_spec, dst_spec = spec((2, 2), src, (8, 6)), spec((2, 2), dst, (8, 6))
        assert grad_target_spec(src_spec, dst_spec).placements == grad
        assert gradient_placements(src_spec.placements) == grad
    half = spec((2, 2), (S0, S1), (8, 6), dtype=torch.float16)
    assert grad_target_spec(spec((2, 2), (P_SUM, S1), (8, 6)), half, half).tensor_meta == half.tensor_meta


# -- AsyncCollectiveTensor, without communication -------------------------------------------------------


def test_async_collective_tensor_finishes_on_first_use_only() -> None:
    finished: list[int] = []

    def finish(received: torch.Tensor) -> torch.Tensor:
        finished.append(1)
        return received.narrow(0, 0, 2).contiguous()

    pending = torch.arange(6.0).reshape(3, 2)
    result = AsyncCollectiveTensor(pending, finish, (2, 2))
    assert result.shape == (2, 2) and result.dtype == torch.float32 and not result.completed
    assert finished == []
    doubled = result * 2
    assert type(doubled) is torch.Tensor
    assert doubled.tolist() == [[0.0, 2.0], [4.0, 6.0]]
    assert (result + 1).tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert finished == [1] and result.completed
    assert wait_local_tensor(result).tolist() == [[0.0, 1.0], [2.0, 3.0]]
    plain = torch.ones(2)
    assert wait_local_tensor(plain) is plain


def test_views_of_a_pending_result_stay_pending() -> None:
    finished: list[int] = []

    def finish(received: torch.Tensor) -> torch.Tensor:
        finished.append(1)
        return received * 10

    result = AsyncCollectiveTensor(torch.arange(4.0), finish, (4,))
    reshaped = result.view(2, 2)
    detached = result.detach()
    assert isinstance(reshaped, AsyncCollectiveTensor) and reshaped.shape == (2, 2)
    assert isinstance(detached, AsyncCollectiveTensor) and not detached.completed
    assert finished == []
    assert reshaped.wait().tolist() == [[0.0, 10.0], [20.0, 30.0]]
    assert finished == [1] and result.completed  # waiting the view waited its source once
    assert (detached + 1).tolist() == [1.0, 11.0, 21.0, 31.0]
    assert finished == [1]
    # Once finished, a view is an ordinary view of the result.
    assert type(result.view(2, 2)) is torch.Tensor


def test_an_equal_mesh_with_other_process_groups_gets_its_own_program(monkeypatch: pytest.MonkeyPatch) -> None:
    # Meshes compare by ranks; after the process groups are rebuilt, an equal mesh has
    # other group names and a cached program must not send to the old groups.
    recorder = _Recorder()
    recorder.install(monkeypatch)
    # What the all-gather of four equal pieces would deliver.
    monkeypatch.setattr(executor_module, "wait", lambda t: torch.cat([t] * 4))
    meta = TensorMeta(torch.Size((8, 6)), (6, 1), torch.float32)
    first, second = FakeMesh((4,), (0,), ("first",)), FakeMesh((4,), (0,), ("second",))
    assert first == second
    for mesh in (first, second, first):
        src, dst = DTensorSpec(mesh, (S0,), meta), DTensorSpec(mesh, (R,), meta)
        redistribute_local_tensor(torch.ones(2, 6), src, dst)
    assert recorder.groups == ["first", "second", "first"]


# -- 2x2 mixed Partial/Shard transitions: no single collective reaches the bound --------------------------------
#
# The README's table ("Redistribution": mixed Partial/Shard on 2x2) says which collectives could do these
# transitions in one go and what each would move.  Computed here from the layouts alone, as a necessary condition
# on ANY one collective: it must reduce (a source Partial dim is not kept), so it is a reduce-scatter, an
# all-reduce, or an all-to-all whose receivers reduce what arrives; its group G must hold every contribution of
# every element of each member's target piece; a one-round all-to-all can only move raw contributions, so a rank
# receives every contribution of its piece that it does not hold itself.

_Box = tuple[tuple[int, ...], tuple[int, ...]]


def _cells(shape: Sequence[int], boxes: Sequence[_Box]) -> list[tuple[tuple[int, int], ...]]:
    cuts = []
    for tensor_dim, extent in enumerate(shape):
        points = {0, extent}
        for size, offset in boxes:
            points.update((offset[tensor_dim], offset[tensor_dim] + size[tensor_dim]))
        ordered = sorted(points)
        cuts.append([(a, b) for a, b in zip(ordered, ordered[1:]) if b > a])
    return list(itertools.product(*cuts))


def _holds(box: _Box, cell: Sequence[tuple[int, int]]) -> bool:
    size, offset = box
    return all(offset[d] <= a and b <= offset[d] + size[d] for d, (a, b) in enumerate(cell))


def cast_partial(placement: Placement) -> Partial:
    assert isinstance(placement, Partial)
    return placement


def _cheapest_single_collective_bytes(
    shape: Sequence[int], mesh: Sequence[int], src: tuple[Placement, ...], dst: tuple[Placement, ...]
) -> dict[str, int]:
    """What each conceivable single collective (kind over group) would move per rank, for the valid ones."""
    from shardwise.placement import compute_local_shape_and_global_offset

    coordinates = all_coordinates(tuple(mesh))
    src_boxes = {c: compute_local_shape_and_global_offset(shape, mesh, c, src) for c in coordinates}
    dst_boxes = {c: compute_local_shape_and_global_offset(shape, mesh, c, dst) for c in coordinates}
    reduced = [d for d, p in enumerate(src) if isinstance(p, Partial)]
    assert reduced and not any(isinstance(p, Partial) for p in dst)
    reduce_ops = {cast_partial(src[d]).reduce_op for d in reduced}
    cells = _cells(shape, list(src_boxes.values()) + list(dst_boxes.values()))
    piece = max(int(torch.Size(dst_boxes[c][0]).numel()) for c in coordinates)
    found: dict[str, int] = {}
    for group_size in range(1, len(mesh) + 1):
        for group in itertools.combinations(range(len(mesh)), group_size):
            members = 1
            for d in group:
                members *= mesh[d]

            def same_group(a: Coordinate, b: Coordinate, group: tuple[int, ...] = group) -> bool:
                return all(a[d] == b[d] for d in range(len(mesh)) if d not in group)

            valid, all_to_all = True, 0
            for rank in coordinates:
                received = 0
                for cell in cells:
                    if not _holds(dst_boxes[rank], cell):
                        continue
                    elements = 1
                    for a, b in cell:
                        elements *= b - a
                    holders: dict[tuple[int, ...], list[Coordinate]] = {}
                    for sender in coordinates:
                        if _holds(src_boxes[sender], cell):
                            holders.setdefault(tuple(sender[d] for d in reduced), []).append(sender)
                    for contribution in holders.values():
                        if rank in contribution:
                            continue
                        valid = valid and any(same_group(rank, sender) for sender in contribution)
                        received += elements
                all_to_all = max(all_to_all, received)
            if not valid:
                continue
            name = "x".join(str(d) for d in group)
            found[f"all_to_all+reduce/{name}"] = all_to_all * FLOAT
            if len(reduce_ops) == 1:
                found[f"reduce_scatter/{name}"] = (members - 1) * piece * FLOAT
    return found


# (source, target) with Partial("sum") and the S(0) side; Partial("max") and the S(1) mirror move the same:
# (ours, lower bound, the cheapest single collective).  256 x 256 float32: a quarter is 65536 B.
MIXED_PARTIAL_SHARD_2X2 = {
    ((S0, P_SUM), (S1, S0)): (131072, 65536, 131072),
    ((S0, P_SUM), (S1, S1)): (98304, 65536, 98304),
    ((S0, P_SUM), (S1, R)): (163840, 131072, 196608),
    ((S0, P_SUM), (R, S0)): (196608, 131072, 262144),
    ((P_SUM, S0), (S0, S0)): (131072, 65536, 131072),
    ((P_SUM, S0), (S0, S1)): (131072, 65536, 131072),
    ((P_SUM, S0), (S0, R)): (196608, 131072, 262144),
    ((P_SUM, S0), (S1, S1)): (98304, 65536, 98304),
    ((P_SUM, S0), (R, S1)): (196608, 131072, 196608),
}


def test_no_single_collective_reaches_the_bound_on_the_mixed_partial_shard_2x2_transitions() -> None:
    shape, mesh = (256, 256), (2, 2)
    mirror = {S0: S1, S1: S0, R: R, P_SUM: P_SUM}
    above: list[tuple[tuple[Placement, ...], tuple[Placement, ...]]] = []
    for partial in (P_SUM, P_MAX):
        for shard in (S0, S1):
            for src in ((shard, partial), (partial, shard)):
                for dst in itertools.product((S0, S1, R), repeat=2):
                    ours = plan_bytes_per_rank(find_cheapest_plan(shape, mesh, src, dst, FLOAT, allow_joint_steps=True))
                    bound = lower_bound_bytes_per_rank(shape, mesh, src, dst, FLOAT)
                    if ours > bound:
                        above.append((src, dst))
    covered = set()
    for (src, dst), (ours, bound, single) in MIXED_PARTIAL_SHARD_2X2.items():
        variants = [(src, dst), (tuple(mirror[p] for p in src), tuple(mirror[p] for p in dst))]
        variants += [(tuple(P_MAX if p == P_SUM else p for p in s), d) for s, d in variants]
        for variant_src, variant_dst in variants:
            covered.add((variant_src, variant_dst))
            plan = find_cheapest_plan(shape, mesh, variant_src, variant_dst, FLOAT, allow_joint_steps=True)
            assert plan_bytes_per_rank(plan) == ours
            assert lower_bound_bytes_per_rank(shape, mesh, variant_src, variant_dst, FLOAT) == bound
            costs = _cheapest_single_collective_bytes(shape, mesh, variant_src, variant_dst)
            # Only the joint group of both mesh dims can do it at all (one mesh dim's collective leaves the other
            # mesh dim's Shard where it is, and every target moves it), and none of them reaches the bound.
            assert costs and all(name.endswith("/0x1") for name in costs), costs
            assert min(costs.values()) == single > bound, costs
    # The 36 transitions above the bound are exactly the table's rows and their mirrors.
    assert len(above) == 36 and set(above) == covered
