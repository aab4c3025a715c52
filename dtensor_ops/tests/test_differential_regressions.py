"""Named regression cases: every failure the differential tests (``test_differential_*.py``) found.

Each is a fixed case, run under LocalTensorMode (every rank simulated) and, where the bug was in what
travels, on 4 gloo ranks too. The comments say what was wrong and why.
"""

from __future__ import annotations

from typing import cast

import pytest
import torch
import torch.distributed as dist
from differential_helpers import RedistributeCase, check_redistribute_case, simulated_world

from shardwise.dtensor_ops import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.dtensor_ops._options import use_options
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.placement import Placement, _StridedShard
from shardwise.testing import multi_rank

# A Partial(sum) on one mesh dim of a 2x2 mesh: the plan to Replicate went through the joint all-to-all
# with reduction, whose receivers summed the contributions with torch's sum, which promotes bool and small
# integers to int64: full_tensor() gave int64 counts ([2, 0, 1, 0]) where PyTorch gives bool (a bool sum is
# a logical or). A 1-D mesh and [Partial, Partial] took an all-reduce, which keeps the dtype.
ONE_PARTIAL_DIM_OF_2X2: list[tuple[Placement, ...]] = [
    (Replicate(), Partial("sum")),
    (Partial("sum"), Replicate()),
    (Shard(0), Partial("sum")),
]


@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.int16, torch.int32])
@pytest.mark.parametrize("placements", ONE_PARTIAL_DIM_OF_2X2, ids=str)
def test_partial_sum_on_one_dim_of_a_2x2_mesh_keeps_its_dtype(placements: tuple[Placement, ...], dtype: torch.dtype) -> None:
    with simulated_world() as world:
        for target in [(Replicate(), Replicate()), (Shard(0), Replicate()), (Replicate(), Shard(0))]:
            case = RedistributeCase((2, 2), dtype, (4,), placements, target, seed=7)
            assert check_redistribute_case(world, case) == "ok", case


def test_bool_partial_sum_is_a_logical_or_with_full_tensor_and_redistribute() -> None:
    """The issue's example by hand: ranks (0, 0) and (0, 1) of a 2x2 mesh hold [T, F, F, F] and [T, F, T, F]."""
    with simulated_world() as world:
        mesh, _ = world.meshes((2, 2))
        with world.mode() as mode:
            local = mode.rank_map(lambda rank: torch.tensor([True, False, rank % 2 == 1, False]))
            dtensor = DTensor.from_local(local, mesh, [Replicate(), Partial("sum")])
            for result in (dtensor.full_tensor(), dtensor.redistribute(mesh, [Replicate(), Replicate()]).to_local()):
                assert result.dtype == torch.bool
                for piece in result._local_tensors.values():  # type: ignore[attr-defined]
                    assert piece.tolist() == [True, False, True, False]


# Complex Partial(product) (and max/min) was reduced elementwise on the (real, imag) pairs complex tensors
# travel as: (a + bi)(c + di) came back as ac + bdi, silently. Now refused before any collective.
@pytest.mark.parametrize("reduce_op", ["product", "max", "min"])
def test_complex_partial_product_max_min_are_refused_before_any_collective(reduce_op: str) -> None:
    with simulated_world() as world:
        mesh, _ = world.meshes((2,))
        with world.mode() as mode:
            local = mode.rank_map(lambda rank: torch.full((3,), 1 + 1j * (rank + 1), dtype=torch.complex64))
            dtensor = DTensor.from_local(local, mesh, [Partial(reduce_op)])
            with CommDebugMode() as comm, pytest.raises(ValueError, match="not a reduction defined for complex"):
                dtensor.full_tensor()
            assert comm.get_total_counts() == 0


def test_complex_partial_product_case() -> None:
    with simulated_world() as world:
        case = RedistributeCase((2,), torch.complex128, (), (Partial("product"),), (Replicate(),), seed=2018)
        assert check_redistribute_case(world, case) == "refused: ValueError"


@multi_rank(world_size=4)
def test_bool_and_int8_partial_sum_on_4_gloo_ranks_keep_their_dtype() -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    rank = dist.get_rank()
    for one_round in (False, True):  # also gloo's one-round reduce-scatter (local reduction of the blocks)
        with use_options(gloo_all_to_all=one_round):
            for placements in ONE_PARTIAL_DIM_OF_2X2:
                # Values depend only on the Partial coordinate, so Replicate and Shard dims hold a consistent layout.
                partial_index = rank // 2 if isinstance(placements[0], Partial) else rank % 2
                flags = torch.tensor([True, False, partial_index == 1, False])
                whole = 8 if placements[0] == Shard(0) else 4
                dtensor = DTensor.from_local(flags, mesh, list(placements), shape=torch.Size([whole]), stride=(1,))
                full = dtensor.full_tensor()
                assert full.dtype == torch.bool, (placements, full)
                assert full.tolist() == [True, False, True, False] * (whole // 4), (placements, full)
                counts = DTensor.from_local(torch.full((4,), 100, dtype=torch.int8), mesh, list(placements))
                moved = counts.redistribute(mesh, [Shard(0), Replicate()] if placements[0] != Shard(0) else [Shard(0), Shard(0)])
                assert moved.to_local().dtype == torch.int8, (placements, moved)
                assert moved.full_tensor().dtype == torch.int8


# Sharding propagation relabelled bmm's sharded-contraction strategy to the strided inputs' layout and gave
# an output laid out (Partial(sum), Shard(1), _StridedShard(1, 2)): redistribution refuses layouts mixing
# _StridedShard and Partial, so full_tensor() of the result raised. Such combinations are no longer candidates.
STRIDED_BATCH_LAYOUT = (Shard(-1), Shard(1), _StridedShard(1, split_factor=2))


def test_bmm_of_strided_inputs_gives_an_output_that_can_be_gathered() -> None:
    with simulated_world() as world:
        mesh, _ = world.meshes((2, 2, 2))
        generator = torch.Generator().manual_seed(0)
        left, right = (torch.randn(10, 5, 5, generator=generator, dtype=torch.float64) for _ in range(2))
        with world.mode():
            left_dt, right_dt = (
                distribute_tensor(t.clone().requires_grad_(True), mesh, list(STRIDED_BATCH_LAYOUT)) for t in (left, right)
            )
            result = cast(DTensor, torch.bmm(left_dt, right_dt))
            placements = tuple(result.placements)
            assert not (any(isinstance(p, _StridedShard) for p in placements) and any(isinstance(p, Partial) for p in placements)), placements
            for piece in result.full_tensor()._local_tensors.values():  # type: ignore[attr-defined]
                torch.testing.assert_close(piece, torch.bmm(left, right))
            result.full_tensor().sum().backward()
            assert left_dt.grad is not None
            for piece in cast(DTensor, left_dt.grad).full_tensor()._local_tensors.values():  # type: ignore[attr-defined]
                torch.testing.assert_close(piece, torch.ones(10, 5, 5, dtype=torch.float64) @ right.transpose(1, 2))
