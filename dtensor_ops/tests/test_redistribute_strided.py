"""Redistribution into and out of ``_StridedShard`` layouts, planned and priced like every other layout.

A strided piece (FSDP over tensor parallelism, any non-default shard order) is a set of index runs, so
the planner gives such layouts three step kinds of its own (strided all-gather, gather whole, select
local) and the one executor runs them. Pure planner checks first (a fake mesh, no processes), then 4
gloo ranks on 2x2 meshes: every pair of layouts against the full tensor, with uneven sizes, the exact
collectives, and the same under LocalTensorMode (every rank simulated here).
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import pytest
import torch

from shardwise.dtensor_ops import distribute_tensor
from shardwise.dtensor_ops._planner import (
    StepKind,
    plan_redistribute,
    redistribute_cost_picoseconds,
)
from shardwise.dtensor_ops._cost_model import pricer_for_mesh
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh import init_device_mesh
from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta, _StridedShard
from shardwise.testing import FakeMesh, LocalDTensorTestBase, multi_rank, with_comms

R, S0, S1 = Replicate(), Shard(0), Shard(1)
FSDP_OVER_TP = (_StridedShard(0, split_factor=2), S0)  # what FSDP over TP's row sharding leaves
_functional = torch.ops._c10d_functional


def _spec(placements: Sequence[Placement], shape: tuple[int, ...] = (8, 4), mesh: Any = None) -> DTensorSpec[Any]:
    meta = TensorMeta(torch.Size(shape), tuple(torch.empty(shape).stride()), torch.float32)
    return DTensorSpec(mesh or FakeMesh((2, 2), (0, 1)), tuple(placements), tensor_meta=meta)


def _kinds(src: Sequence[Placement], dst: Sequence[Placement], shape: tuple[int, ...] = (8, 4)) -> list[StepKind]:
    return [step.kind for step in plan_redistribute(_spec(src, shape), _spec(dst, shape))]


# -- the planner (no processes) -----------------------------------------------------------------


def test_back_to_tensor_parallel_is_one_gather_over_the_strided_mesh_dim() -> None:
    (step,) = plan_redistribute(_spec(FSDP_OVER_TP), _spec((R, S0)))
    assert step.kind is StepKind.STRIDED_ALL_GATHER and step.mesh_dim == 0
    # Each rank receives its one peer's piece: 8 rows over 4 ranks, 4 columns, float32.
    assert step.bytes_per_rank == 2 * 4 * 4


def test_other_targets_gather_the_strided_dim_first_when_that_is_exact() -> None:
    assert _kinds(FSDP_OVER_TP, (S1, S1)) == [
        StepKind.STRIDED_ALL_GATHER,
        StepKind.LOCAL_CHUNK,
        StepKind.ALL_TO_ALL,
    ]


def test_a_target_the_strided_pieces_do_not_line_up_with_goes_through_the_whole_tensor() -> None:
    assert _kinds(FSDP_OVER_TP, (S0, S0)) == [StepKind.GATHER_WHOLE, StepKind.SELECT_LOCAL]
    # Only the mesh dims that cut are gathered: the Replicate one is never a collective.
    (gather, select) = plan_redistribute(_spec((_StridedShard(0, split_factor=2), R)), _spec((S1, S0)))
    assert gather.kind is StepKind.GATHER_WHOLE and gather.mesh_dims == (0,)
    assert select.kind is StepKind.SELECT_LOCAL and select.bytes_per_rank == 0


def test_into_a_strided_layout_is_the_normal_plan_to_replicate_then_a_local_selection() -> None:
    assert _kinds((S0, S0), FSDP_OVER_TP) == [StepKind.ALL_GATHER, StepKind.ALL_GATHER, StepKind.SELECT_LOCAL]
    assert _kinds((R, R), FSDP_OVER_TP) == [StepKind.SELECT_LOCAL]


def test_a_partial_target_is_reached_from_the_gathered_tensor() -> None:
    kinds = _kinds(FSDP_OVER_TP, (Partial(), R))
    assert kinds[0] is StepKind.STRIDED_ALL_GATHER and StepKind.LOCAL_PARTIAL in kinds


def test_strided_layouts_with_a_partial_mesh_dim_are_refused_before_anything_runs() -> None:
    with pytest.raises(NotImplementedError, match="_StridedShard and a Partial"):
        plan_redistribute(_spec((_StridedShard(0, split_factor=2), Partial())), _spec((R, R)))
    with pytest.raises(NotImplementedError, match="target with _StridedShard and Partial"):
        plan_redistribute(_spec((S0, R)), _spec((_StridedShard(0, split_factor=2), Partial())))


def test_strided_plans_are_priced_by_the_cost_model_and_the_cheapest_candidate_wins() -> None:
    src, one_gather, whole = _spec(FSDP_OVER_TP), _spec((R, S0)), _spec((S0, S0))
    pricer = pricer_for_mesh(src.mesh)
    for dst in (one_gather, whole):
        plan = plan_redistribute(src, dst)
        steps_time = sum(pricer(s.kind, s.mesh_dims, s.bytes_per_rank, s.local_copy_bytes) for s in plan)
        assert redistribute_cost_picoseconds(src, dst) == steps_time > 0
    # One all-gather over one mesh dim is cheaper than an all-gather over each of two.
    assert redistribute_cost_picoseconds(src, one_gather) < redistribute_cost_picoseconds(src, whole)
    # Gathering to Replicate everywhere: the whole gather (two all-gathers, one step) against the strided
    # gather then a plain all-gather: equal collectives, so the price decides; both are valid.
    plan = plan_redistribute(src, _spec((R, R)))
    assert sum(step.kind.is_collective for step in plan) == 2


def test_uneven_pieces_still_line_up_for_the_one_dim_gather_when_every_group_agrees() -> None:
    # 10 rows: the strided pieces have 3 and 2 rows, yet each tp group's pieces are its whole row block.
    assert _kinds(FSDP_OVER_TP, (R, S0), shape=(10, 2)) == [StepKind.STRIDED_ALL_GATHER]


class _MeshWithJointGroups(FakeMesh):
    def _supports_joint_groups(self) -> bool:  # what a DeviceMesh built by init_device_mesh answers
        return True


@pytest.mark.parametrize("joint_groups", [False, True])
def test_no_detour_through_another_shard_order_is_cheaper_than_the_plan(joint_groups: bool) -> None:
    # On a 2x2x2 mesh every shard order of a 2-D tensor (most are _StridedShard layouts): the plan's time
    # from A to C is at most A to B plus B to C, for every B.
    from shardwise.testing._shard_orders import generate_shard_orders, shard_order_to_placement

    mesh = (_MeshWithJointGroups if joint_groups else FakeMesh)((2, 2, 2), (0, 1, 1))
    shape = (16, 8)
    meta = TensorMeta(torch.Size(shape), (8, 1), torch.float32)
    orders = list(generate_shard_orders(mesh, len(shape)))
    specs = [DTensorSpec(mesh, tuple(shard_order_to_placement(o, mesh)), meta, shard_order=o) for o in orders]
    assert sum(any(type(p) is _StridedShard for p in spec.as_layout_spec().placements) for spec in specs) > len(specs) // 2
    for a, c in itertools.product(specs, specs):
        direct = redistribute_cost_picoseconds(a, c)
        for b in specs:
            detour = redistribute_cost_picoseconds(a, b) + redistribute_cost_picoseconds(b, c)
            assert direct <= detour, (a.shard_order, b.shard_order, c.shard_order, direct, detour)


# -- on 4 ranks --------------------------------------------------------------------------------

LAYOUTS: list[tuple[Placement, ...]] = [
    FSDP_OVER_TP,
    (_StridedShard(0, split_factor=3), S0),
    (_StridedShard(1, split_factor=2), S1),
    (_StridedShard(0, split_factor=2), S1),
    (S0, S0),
    (R, S0),
    (S1, R),
    (S0, S1),
    (R, R),
]


def _every_pair_matches_torch(mesh: Any, full: torch.Tensor) -> list[str]:
    wrong = []
    for src, dst in itertools.product(LAYOUTS, LAYOUTS):
        moved = distribute_tensor(full, mesh, list(src)).redistribute(mesh, list(dst))
        expected_piece = distribute_tensor(full, mesh, list(dst)).to_local()
        if moved.placements != dst or not torch.equal(moved.to_local(), expected_piece):
            wrong.append(f"{src} -> {dst}")
        elif not torch.equal(moved.full_tensor(), full):
            wrong.append(f"{src} -> {dst} (full tensor)")
    return wrong


@pytest.mark.parametrize("shape", [(8, 6), (7, 5), (12, 3)])
@multi_rank(world_size=4)
def test_every_pair_of_layouts_gives_torchs_pieces(shape: tuple[int, int]) -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    assert _every_pair_matches_torch(mesh, torch.randn(shape)) == []


def _collectives(mesh: Any, src: Sequence[Placement], dst: Sequence[Placement]) -> dict[str, int]:
    moving = distribute_tensor(torch.arange(80.0).reshape(10, 8), mesh, list(src))
    with CommDebugMode() as comm:
        moving.redistribute(mesh, list(dst))
    return {str(op).split(".")[-1]: count for op, count in comm.get_comm_counts().items() if count}


@multi_rank(world_size=4)
def test_the_collectives_are_the_plans() -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    assert _collectives(mesh, FSDP_OVER_TP, (R, S0)) == {"all_gather_into_tensor": 1}
    # The strided gather back to (R, S0), then (R, S0) -> (S0, S0) as the mesh's cheapest plan does it (with
    # joint groups on gloo: one all-to-all); the whole gather would take two all-gathers.
    assert _collectives(mesh, FSDP_OVER_TP, (S0, S0)) == {"all_gather_into_tensor": 1, "all_to_all_single": 1}
    assert _collectives(mesh, FSDP_OVER_TP, (S1, S0)) == {"all_gather_into_tensor": 1}  # then a local chunk
    assert _collectives(mesh, (_StridedShard(0, split_factor=2), R), (S1, S0)) == {"all_gather_into_tensor": 1}
    assert _collectives(mesh, (R, R), FSDP_OVER_TP) == {}
    # Every pair issues exactly its plan's collectives: one per step, one per gathered mesh dim for a whole gather.
    whole_gathers = 0
    for src, dst in itertools.product(LAYOUTS, LAYOUTS):
        spec = distribute_tensor(torch.zeros(10, 8), mesh, list(src))._spec
        plan = plan_redistribute(spec, spec.with_placements(dst))
        expected = sum(len(s.mesh_dims) if s.kind is StepKind.GATHER_WHOLE else 1 for s in plan if s.kind.is_collective)
        whole_gathers += sum(s.kind is StepKind.GATHER_WHOLE for s in plan)
        assert sum(_collectives(mesh, src, dst).values()) == expected, (src, dst, [str(s) for s in plan])
    assert whole_gathers > 0


class EveryPairSimulatedTest(LocalDTensorTestBase):
    """The same pairs with every rank simulated in this process (torch's LocalTensorMode): one program per rank."""

    @property
    def world_size(self) -> int:
        return 4

    @with_comms
    def test_every_pair_of_layouts_gives_the_whole_tensor_back_on_every_rank(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        with self._get_local_tensor_mode():
            full = torch.arange(35.0).reshape(7, 5)
            expected = full.reconcile()
            for src, dst in itertools.product(LAYOUTS, LAYOUTS):
                moved = distribute_tensor(full, mesh, list(src)).redistribute(mesh, list(dst))
                self.assertEqual(moved.placements, dst)
                for rank, piece in moved.full_tensor()._local_tensors.items():
                    torch.testing.assert_close(piece, expected, msg=lambda m: f"{src} -> {dst}, simulated rank {rank}: {m}")
