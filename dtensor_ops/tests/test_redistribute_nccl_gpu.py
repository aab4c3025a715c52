"""Redistribution over NCCL on 4 GPUs: values against the full tensor and the exact collectives issued.

The GPU twin of test_redistribute_multi_rank.py (gloo): every 1-D transition between
Shard(0), Shard(1), Replicate, Partial(sum), Partial(avg) and Partial(max) on a mesh of 4 (even,
uneven and smaller-than-the-mesh shapes), and every pair of the 2-D placement tuples on a 2x2 mesh,
with CUDA tensors on a "cuda" mesh (NCCL with one GPU per rank; the harness sets each rank's device).
With fewer than 4 GPUs the ranks share them over gloo with CUDA tensors (shardwise.testing's
shared-GPU pool): CUDA tensors, gloo's transport. What differs from CPU: NCCL kernels for each collective (all_gather_into_tensor, reduce_scatter_tensor,
all_reduce, all_to_all_single with padding for uneven shards), the dtypes NCCL reduces in
(float16/bfloat16), and results that must stay on the rank's own device.

Bazel: tagged gpu, gpu-count=4. Without CUDA every test skips with the reason.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import pytest
import torch
import torch.distributed as dist

from redistribute_helpers import (
    PLACEMENTS_1D,
    CollectiveLog,
    check_locals,
    describe,
    expected_1d_collectives,
    full_tensor,
    placement_tuples,
    source_locals,
)
from shardwise.dtensor_ops import DTensor, distribute_tensor
from shardwise.dtensor_ops._plan_executor import redistribute_local_tensor
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta, select_local_shard
from shardwise.testing import multi_rank, priced_by

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# CommDebugMode counts under the op keys PyTorch uses (torch.ops.c10d_functional.*).
_functional = torch.ops.c10d_functional


def _spec(mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int], dtype: torch.dtype) -> DTensorSpec[DeviceMesh]:
    stride = torch.empty(tuple(shape)).stride()
    return DTensorSpec(mesh, tuple(placements), TensorMeta(torch.Size(shape), stride, dtype))


def run_cases_on(
    device: str,
    mesh: DeviceMesh,
    cases: Sequence[tuple[tuple[Placement, ...], tuple[Placement, ...], tuple[int, ...]]],
    *,
    hand_expectations: bool,
) -> list[str]:
    """Redistribute every case on this rank's device; return what went wrong (the same on every rank)."""
    coordinate = tuple(mesh.get_coordinate() or ())
    mesh_shape = tuple(mesh.shape)
    problems: list[str] = []
    partial_results: list[tuple[int, torch.Tensor]] = []
    for index, (src, dst, shape) in enumerate(cases):
        name = f"{describe(src)} -> {describe(dst)} on {mesh_shape}, shape {shape}"
        full = full_tensor(shape, index)
        local = source_locals(full, mesh_shape, src, index + 1)[coordinate].to(device)
        log = CollectiveLog()
        with log:
            result = redistribute_local_tensor(local, _spec(mesh, src, shape, full.dtype), _spec(mesh, dst, shape, full.dtype))
        if result.device != local.device:
            problems.append(f"{name}: the result is on {result.device}, the source on {local.device}")
        if log.names.count("wait") != len(log.collectives):
            problems.append(f"{name}: {log.names.count('wait')} waits for {len(log.collectives)} collectives")
        if hand_expectations and min(shape) >= 4:
            expected_collectives = expected_1d_collectives(src[0], dst[0], shape)
            if log.collectives != expected_collectives:
                problems.append(f"{name}: ran {log.collectives}, expected {expected_collectives}")
        if any(isinstance(p, Partial) for p in dst):
            partial_results.append((index, result.cpu()))
            continue
        expected = select_local_shard(full, mesh_shape, coordinate, dst)
        if result.shape != expected.shape or not torch.equal(result.cpu(), expected):
            problems.append(f"{name}: rank {dist.get_rank()} got {result.tolist()}, expected {expected.tolist()}")
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


def every_1d_transition(device: str) -> list[str]:
    mesh = init_device_mesh(device, (4,))
    cases = [
        ((src,), (dst,), shape)
        for shape in [(8, 6), (7, 5), (3, 5)]
        for src, dst in itertools.product(PLACEMENTS_1D, repeat=2)
    ]
    # The hand expectations (shared with the gloo twin) are NCCL's plans: ranks sharing one GPU run
    # gloo, whose measured default profile must not decide them, so NCCL's prices are pinned.
    with priced_by("nccl"):
        return run_cases_on(device, mesh, cases, hand_expectations=True)


def every_2d_pair(device: str) -> list[str]:
    mesh = init_device_mesh(device, (2, 2))
    cases = [(src, dst, (8, 6)) for src, dst in itertools.product(list(placement_tuples(2)), repeat=2)]
    return run_cases_on(device, mesh, cases, hand_expectations=False)


def counted_dtensor_transitions(device: str, dtype: torch.dtype) -> list[str]:
    """Through the public API with CommDebugMode: PyTorch's op keys and counts, values in a reduced dtype."""
    mesh = init_device_mesh(device, (4,))
    problems = []
    torch.manual_seed(0)
    full = torch.randn(16, 8, dtype=torch.float32).to(device=device, dtype=dtype)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    expectations: list[tuple[str, Any, list[Placement], dict[Any, int]]] = [
        ("S(0) -> R", sharded, [Replicate()], {_functional.all_gather_into_tensor: 1}),
        ("S(0) -> S(1)", sharded, [Shard(1)], {_functional.all_to_all_single: 1}),
    ]
    partial = DTensor.from_local(full / 4, mesh, [Partial()], run_check=False)
    expectations += [
        ("P -> R", partial, [Replicate()], {_functional.all_reduce: 1}),
        ("P -> S(0)", partial, [Shard(0)], {_functional.reduce_scatter_tensor: 1}),
    ]
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    for name, source, target, counts in expectations:
        with CommDebugMode() as comm:
            moved = source.redistribute(mesh, target)
        got = {key: value for key, value in comm.get_comm_counts().items() if value}
        if got != counts:
            problems.append(f"{name} ({dtype}): collectives {got}, expected {counts}")
        if moved.to_local().device.type != "cuda" and device == "cuda":
            problems.append(f"{name} ({dtype}): local tensor on {moved.to_local().device}")
        error = (moved.full_tensor().float() - full.float()).abs().max().item()
        if error > tolerance * full.float().abs().max().item():
            problems.append(f"{name} ({dtype}): max error {error}")
    return problems


@multi_rank(world_size=4, backend="nccl")
def test_every_1d_transition_on_4_gpus_even_uneven_and_smaller_than_the_mesh() -> None:
    problems = every_1d_transition("cuda")
    assert not problems, "\n".join(problems[:30])


@multi_rank(world_size=4, backend="nccl")
def test_every_2x2_pair_on_4_gpus() -> None:
    problems = every_2d_pair("cuda")
    assert not problems, "\n".join(problems[:30])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@multi_rank(world_size=4, backend="nccl")
def test_dtensor_redistribute_counts_and_values_in_nccl_dtypes(dtype: torch.dtype) -> None:
    problems = counted_dtensor_transitions("cuda", dtype)
    assert not problems, "\n".join(problems)
