"""Redistribution on 4 gloo ranks: values against the full tensor and the exact collectives issued.

Each test runs a whole batch of transitions in one call on the ranks (starting ranks is
the expensive part).  Every rank builds the same full tensor and the same per-rank
source values (Partial sources get contributions whose reduction is the full tensor),
redistributes its own shard, and checks it.  Results with a Partial target are gathered
once per batch and reduced here before comparing.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch
import torch.distributed as dist

from redistribute_helpers import (
    PLACEMENTS_1D,
    CollectiveLog,
    check_locals,
    collective_name,
    describe,
    expected_1d_collectives,
    full_tensor,
    placement_tuples,
    source_locals,
)
from shardwise.dtensor_ops._collectives import PENDING_TENSOR_TYPES
from shardwise.dtensor_ops._plan_executor import _program_for, plan_redistribute, redistribute_local_tensor
from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta, select_local_shard
from shardwise.testing import multi_rank

_functional = torch.ops._c10d_functional


def make_spec(mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]) -> DTensorSpec[DeviceMesh]:
    stride = torch.empty(tuple(shape)).stride()
    return DTensorSpec(mesh, tuple(placements), TensorMeta(torch.Size(shape), stride, torch.float32))


def run_cases(
    mesh: DeviceMesh,
    cases: Sequence[tuple[tuple[Placement, ...], tuple[Placement, ...], tuple[int, ...]]],
    *,
    hand_expectations: bool = False,
    async_op: bool = False,
) -> list[str]:
    """Run every case on this rank; return what went wrong (the same list on every rank)."""
    coordinate = tuple(mesh.get_coordinate() or ())
    mesh_shape = tuple(mesh.shape)
    problems: list[str] = []
    partial_results: list[tuple[int, torch.Tensor]] = []
    for index, (src, dst, shape) in enumerate(cases):
        name = f"{describe(src)} -> {describe(dst)} on {mesh_shape}, shape {shape}"
        full = full_tensor(shape, index)
        local = source_locals(full, mesh_shape, src, index + 1)[coordinate]
        src_spec, dst_spec = make_spec(mesh, src, shape), make_spec(mesh, dst, shape)
        plan = plan_redistribute(src_spec, dst_spec)
        planned = [collective_name(step.kind) for step in plan if step.kind.is_collective]
        # A group whose padded pieces are all empty skips its collective (other groups may not).
        program = _program_for(src_spec, dst_spec)
        issued = [
            collective_name(step.kind) for step in program.steps if step.kind.is_collective and not step.sends_nothing
        ]
        if [step.kind for step in program.steps] != [step.kind for step in plan] or (
            issued != planned and min(shape) >= 4
        ):
            problems.append(f"{name}: the program {program.steps} does not follow the plan {plan}")
        log = CollectiveLog()
        with log:
            result = redistribute_local_tensor(local, src_spec, dst_spec, async_op=async_op)
            if async_op:
                waits_before_use = log.names.count("wait")
                if issued and not isinstance(result, PENDING_TENSOR_TYPES):
                    problems.append(f"{name}: async result is a {type(result).__name__}, not an AsyncCollectiveTensor")
                if isinstance(result, PENDING_TENSOR_TYPES):
                    if waits_before_use != len(issued) - 1:
                        problems.append(f"{name}: {waits_before_use} waits before first use, {len(issued)} collectives")
                    pending = result
                    result = result + 0  # first use; its wait runs inside the tensor, out of this mode's sight
                    if not pending.completed or type(result) is not torch.Tensor:
                        problems.append(f"{name}: first use did not finish the asynchronous result")
        if log.collectives != issued:
            problems.append(f"{name}: ran {log.collectives}, the program issues {issued}")
        if not async_op and log.names.count("wait") != len(log.collectives):
            problems.append(f"{name}: {log.names.count('wait')} waits for {len(log.collectives)} collectives")
        if hand_expectations and log.collectives != expected_1d_collectives(src[0], dst[0], shape):
            problems.append(f"{name}: ran {log.collectives}, expected {expected_1d_collectives(src[0], dst[0], shape)}")
        if any(isinstance(p, Partial) for p in dst):
            partial_results.append((index, result))
            continue
        expected = select_local_shard(full, mesh_shape, coordinate, dst)
        if result.shape != expected.shape or not torch.equal(result, expected):
            problems.append(f"{name}: rank {dist.get_rank()} got {result.tolist()}, expected {expected.tolist()}")
    # One gather for every Partial-target result of the batch.
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (coordinate, partial_results))
    by_case: dict[int, dict[tuple[int, ...], torch.Tensor]] = {}
    for rank_coordinate, rank_results in gathered:
        for index, tensor in rank_results:
            by_case.setdefault(index, {})[rank_coordinate] = tensor
    for index, locals_by_coordinate in by_case.items():
        src, dst, shape = cases[index]
        prefix = f"{describe(src)} -> {describe(dst)} on {mesh_shape}, shape {shape}: "
        problems += [prefix + p for p in check_locals(full_tensor(shape, index), mesh_shape, dst, locals_by_coordinate)]
    return problems


@multi_rank(world_size=4)
def test_every_1d_pair_on_4_ranks_even_uneven_and_smaller_than_the_mesh() -> None:
    mesh = init_device_mesh("cpu", (4,))
    cases = [
        ((src,), (dst,), shape)
        for shape in [(8, 6), (7, 5), (3, 5)]
        for src, dst in itertools.product(PLACEMENTS_1D, repeat=2)
    ]
    problems = run_cases(mesh, cases, hand_expectations=True)
    assert not problems, "\n".join(problems[:30])


@multi_rank(world_size=4)
def test_every_2x2_pair_on_an_even_shape() -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    tuples = list(placement_tuples(2))
    cases = [(src, dst, (8, 6)) for src, dst in itertools.product(tuples, repeat=2)]
    problems = run_cases(mesh, cases)
    assert not problems, "\n".join(problems[:30])


@multi_rank(world_size=4)
def test_every_2x2_pair_on_an_uneven_shape() -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    tuples = list(placement_tuples(2))
    cases = [(src, dst, (7, 5)) for src, dst in itertools.product(tuples, repeat=2)]
    problems = run_cases(mesh, cases)
    assert not problems, "\n".join(problems[:30])


@multi_rank(world_size=4)
def test_2x2_pairs_with_dims_smaller_than_the_mesh_and_nested_shards() -> None:
    # 3 rows over (S(0), S(0)) leave the last of the 4 nested pieces empty; 1 column
    # over S(1) leaves a whole mesh dim's second piece empty.
    mesh = init_device_mesh("cpu", (2, 2))
    layouts: list[tuple[Placement, ...]] = [
        (Shard(0), Shard(0)),
        (Shard(1), Shard(1)),
        (Shard(0), Shard(1)),
        (Shard(1), Shard(0)),
        (Replicate(), Shard(0)),
        (Shard(0), Replicate()),
        (Partial("sum"), Shard(0)),
        (Shard(1), Partial("max")),
        (Partial("avg"), Partial("sum")),
        (Replicate(), Replicate()),
    ]
    cases = [
        (src, dst, shape)
        for shape in [(3, 5), (5, 1)]
        for src, dst in itertools.product(layouts, repeat=2)
    ]
    problems = run_cases(mesh, cases)
    assert not problems, "\n".join(problems[:30])


@multi_rank(world_size=4)
def test_async_redistribution_waits_at_first_use() -> None:
    mesh_1d = init_device_mesh("cpu", (4,))
    cases_1d = [((src,), (dst,), (7, 5)) for src, dst in itertools.product(PLACEMENTS_1D, repeat=2)]
    problems = run_cases(mesh_1d, cases_1d, async_op=True)
    mesh_2d = init_device_mesh("cpu", (2, 2))
    cases_2d = [
        ((Shard(0), Shard(0)), (Replicate(), Shard(1)), (7, 5)),
        ((Partial("sum"), Partial("max")), (Replicate(), Replicate()), (8, 6)),
        ((Replicate(), Shard(0)), (Shard(0), Shard(1)), (7, 5)),
        ((Shard(1), Partial("avg")), (Shard(0), Shard(0)), (3, 5)),
    ]
    problems += run_cases(mesh_2d, cases_2d, async_op=True)
    assert not problems, "\n".join(problems[:30])


@multi_rank(world_size=4)
def test_ranks_outside_the_mesh_get_an_empty_tensor_and_stay_silent() -> None:
    mesh = DeviceMesh("cpu", [0, 1])
    rank = dist.get_rank()
    shape = (6, 4)
    full = full_tensor(shape, 3)
    src, dst = make_spec(mesh, (Shard(0),), shape), make_spec(mesh, (Replicate(),), shape)
    coordinate = mesh.get_coordinate()
    local = select_local_shard(full, (2,), coordinate, (Shard(0),)).clone()
    log = CollectiveLog()
    with log:
        result = redistribute_local_tensor(local, src, dst)
    if rank < 2:
        assert log.collectives == ["all_gather"]
        assert torch.equal(result, full)
    else:
        assert log.names == []
        assert result.shape == (0,)  # PyTorch's tensor([]) for a rank that holds nothing


@multi_rank(world_size=4)
def test_the_project_comm_debug_mode_counts_the_same_collectives() -> None:
    from shardwise.dtensor_ops.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (2, 2))
    shape = (8, 6)
    full = full_tensor(shape, 5)
    coordinate = tuple(mesh.get_coordinate() or ())
    transitions = [
        # One all-to-all over both dims (one latency, the same bytes) rather than two all-gathers.
        ((Shard(0), Shard(0)), (Replicate(), Replicate()), {_functional.all_to_all_single: 1}),
        # One all-to-all whose receivers add the contributions: gloo's all-to-all latency is below its
        # reduce-scatter's (mesh/_cost_profile.py).
        ((Partial("sum"), Shard(1)), (Shard(0), Shard(1)), {_functional.all_to_all_single: 1}),
        ((Replicate(), Shard(0)), (Shard(0), Shard(1)), {_functional.all_to_all_single: 1}),
        # Likewise an all-to-all of the contributions over both dims, reduced on arrival (the same
        # bytes as the all-reduce over the partial dim, a lower latency on gloo).
        ((Partial("max"), Replicate()), (Replicate(), Replicate()), {_functional.all_to_all_single: 1}),
    ]
    for src, dst, expected in transitions:
        local = source_locals(full, (2, 2), src, 9)[coordinate]
        comm_mode = CommDebugMode()
        with comm_mode:
            redistribute_local_tensor(local, make_spec(mesh, src, shape), make_spec(mesh, dst, shape))
        counts = comm_mode.get_comm_counts()
        assert {op: counts[op] for op in expected} == expected, (src, dst, dict(counts))
        assert comm_mode.get_total_counts() == sum(expected.values()), (src, dst, dict(counts))
