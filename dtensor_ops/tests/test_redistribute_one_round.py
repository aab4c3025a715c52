"""SHARDWISE_GLOO_ALL_TO_ALL=1: redistribution's reduce-scatters and all-gathers on gloo as one all-to-all each.

On 4 gloo ranks: every 1-D transition (even, uneven and smaller-than-the-mesh shapes) and the 2x2
transitions give exactly the values of the full tensor (small integers: sums are exact in any order),
with the planner's collectives except that each reduce-scatter and all-gather is one
``all_to_all_single``; the gradients of a sequence-parallel style redistribution match plain torch;
the asynchronous path finishes the reduction on first use; and with the switch off (the default)
nothing changes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from typing import Iterator, Sequence

import torch

from redistribute_helpers import (
    PLACEMENTS_1D,
    CollectiveLog,
    check_locals,
    collective_name,
    describe,
    full_tensor,
    placement_tuples,
    source_locals,
)
from shardwise.dtensor_ops import DTensor, Partial, Replicate, Shard
from shardwise.dtensor_ops._caches import clear_all_caches
from shardwise.dtensor_ops._collectives import ONE_ROUND_SWITCH, PENDING_TENSOR_TYPES
from shardwise.dtensor_ops._plan_executor import plan_redistribute, redistribute_local_tensor
from shardwise.dtensor_ops._planner import StepKind
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.placement import DTensorSpec, Placement, TensorMeta, select_local_shard
from shardwise.testing import multi_rank

import torch.distributed as dist

_functional = torch.ops._c10d_functional


@contextlib.contextmanager
def one_round(enabled: bool) -> Iterator[None]:
    """The switch set (or unset) for the body; compiled programs are dropped on the way in and out."""
    previous = os.environ.get(ONE_ROUND_SWITCH)
    os.environ[ONE_ROUND_SWITCH] = "1" if enabled else "0"
    clear_all_caches()
    try:
        yield
    finally:
        if previous is None:
            del os.environ[ONE_ROUND_SWITCH]
        else:
            os.environ[ONE_ROUND_SWITCH] = previous
        clear_all_caches()


def make_spec(mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]) -> DTensorSpec[DeviceMesh]:
    stride = torch.empty(tuple(shape)).stride()
    return DTensorSpec(mesh, tuple(placements), TensorMeta(torch.Size(shape), stride, torch.float32))


def one_round_name(kind: StepKind) -> str:
    if kind in (StepKind.REDUCE_SCATTER, StepKind.ALL_GATHER, StepKind.JOINT_REDUCE_SCATTER):
        return "all_to_all"
    return collective_name(kind)


def run_cases(
    mesh: DeviceMesh,
    cases: Sequence[tuple[tuple[Placement, ...], tuple[Placement, ...], tuple[int, ...]]],
    *,
    async_op: bool = False,
) -> list[str]:
    """Every case on this rank with the switch on; what went wrong (the same list on every rank)."""
    coordinate = tuple(mesh.get_coordinate() or ())
    mesh_shape = tuple(mesh.shape)
    problems: list[str] = []
    partial_results: list[tuple[int, torch.Tensor]] = []
    for index, (src, dst, shape) in enumerate(cases):
        name = f"{describe(src)} -> {describe(dst)} on {mesh_shape}, shape {shape}"
        full = full_tensor(shape, index)
        local = source_locals(full, mesh_shape, src, index + 1)[coordinate]
        src_spec, dst_spec = make_spec(mesh, src, shape), make_spec(mesh, dst, shape)
        planned = [one_round_name(step.kind) for step in plan_redistribute(src_spec, dst_spec) if step.kind.is_collective]
        log = CollectiveLog()
        with log:
            result = redistribute_local_tensor(local, src_spec, dst_spec, async_op=async_op)
            if isinstance(result, PENDING_TENSOR_TYPES):
                result = result + 0  # first use: the pending all-to-all is waited for and reduced
        # Pieces that are empty on every rank of a group skip their collective: compare where all are non-empty.
        if min(shape) >= 4 and log.collectives != planned:
            problems.append(f"{name}: ran {log.collectives}, expected {planned}")
        if any(kind in log.collectives for kind in ("reduce_scatter", "all_gather")):
            problems.append(f"{name}: ran {log.collectives} with the switch on")
        if any(isinstance(p, Partial) for p in dst):
            partial_results.append((index, result))
            continue
        expected = select_local_shard(full, mesh_shape, coordinate, dst)
        if result.shape != expected.shape or not torch.equal(result, expected):
            problems.append(f"{name}: rank {dist.get_rank()} got {result.tolist()}, expected {expected.tolist()}")
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (coordinate, partial_results))
    by_case: dict[int, dict[tuple[int, ...], torch.Tensor]] = {}
    for rank_coordinate, rank_results in gathered:  # type: ignore[misc]
        for index, tensor in rank_results:
            by_case.setdefault(index, {})[rank_coordinate] = tensor
    for index, locals_by_coordinate in by_case.items():
        src, dst, shape = cases[index]
        prefix = f"{describe(src)} -> {describe(dst)} on {mesh_shape}, shape {shape}: "
        problems += [prefix + p for p in check_locals(full_tensor(shape, index), mesh_shape, dst, locals_by_coordinate)]
    return problems


@multi_rank(world_size=4)
def test_every_1d_pair_gives_the_same_values_with_all_to_alls_only() -> None:
    mesh = init_device_mesh("cpu", (4,))
    cases = [
        ((src,), (dst,), shape)
        for shape in [(8, 6), (7, 5), (3, 5)]
        for src, dst in itertools.product(PLACEMENTS_1D, repeat=2)
    ]
    with one_round(True):
        problems = run_cases(mesh, cases)
        problems += run_cases(mesh, [case for case in cases if case[2] == (7, 5)], async_op=True)
    assert not problems, "\n".join(problems[:30])


@multi_rank(world_size=4)
def test_2x2_pairs_give_the_same_values_with_all_to_alls_only() -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    tuples = list(placement_tuples(2))
    cases = [(src, dst, (8, 6)) for src, dst in itertools.product(tuples, repeat=2)]
    with one_round(True):
        problems = run_cases(mesh, cases)
    assert not problems, "\n".join(problems[:30])


def _sequence_parallel_step(mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """Rowwise output Partial -> Shard(1) (reduce-scatter), then Shard(1) -> Replicate (all-gather); fwd + bwd."""
    torch.manual_seed(0)
    full_x = torch.randn(2, 8, 6)
    contributions = [torch.randn(2, 8, 6) for _ in range(3)]
    contributions.append(full_x - sum(contributions))
    local = contributions[mesh.get_local_rank()].clone().requires_grad_(True)
    with CommDebugMode() as comm:
        partial = DTensor.from_local(local, mesh, [Partial()])
        sequence_sharded = partial.redistribute(mesh, [Shard(1)])
        replicated = sequence_sharded.redistribute(mesh, [Replicate()])
        (replicated.to_local() * torch.arange(6.0)).sum().backward()
    counts = {str(key).rsplit(".", 1)[-1]: int(count) for key, count in comm.get_comm_counts().items() if count}
    assert local.grad is not None
    return replicated.to_local().detach(), local.grad, counts


@multi_rank(world_size=4)
def test_a_sequence_parallel_round_trip_matches_plain_torch_with_and_without_the_switch() -> None:
    mesh = init_device_mesh("cpu", (4,))
    with one_round(False):
        native_value, native_grad, native_counts = _sequence_parallel_step(mesh)
    with one_round(True):
        value, grad, counts = _sequence_parallel_step(mesh)
    torch.manual_seed(0)
    full_x = torch.randn(2, 8, 6)
    torch.testing.assert_close(value, full_x)
    torch.testing.assert_close(native_value, full_x)
    # d/d(local) of sum(x * w) for a Partial input: every rank's contribution gets the whole gradient w.
    torch.testing.assert_close(grad, torch.arange(6.0).expand(2, 8, 6))
    torch.testing.assert_close(native_grad, grad)
    # Forward: reduce-scatter, all-gather; backward: the all-gather's gradient is a local chunk and the
    # reduce-scatter's an all-gather (Partial gradients go back Replicate).
    assert native_counts == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 1}, native_counts
    assert counts == {"all_to_all_single": 3}, counts
