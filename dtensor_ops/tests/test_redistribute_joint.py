"""Joint redistribution steps: several mesh dims changed by one collective over their joint group.

Pure planner checks run here without processes; the rest runs on 4 gloo ranks (one pool for the
file) on 2x2 meshes, checking values against the full tensor, the exact collectives (through
CommDebugMode), the bytes each rank receives against the planner and the lower bound, the
gradient's own plan, and meshes without joint groups.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from redistribute_helpers import full_tensor, priced_by, source_locals
from shardwise.dtensor_ops import DTensor, distribute_tensor
from shardwise.dtensor_ops._plan_executor import plan_redistribute, redistribute_local_tensor
from shardwise.dtensor_ops._planner import (
    StepKind,
    find_cheapest_plan,
    joint_step_bytes_per_rank,
    lower_bound_bytes_per_rank,
    plan_bytes_per_rank,
    redistribute_lower_bound_bytes,
)
from shardwise.dtensor_ops._cost_model import StepPricer
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh._cost_profile import BUILTIN_PROFILES
from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta, select_local_shard
from shardwise.testing import FakeMesh, multi_rank

S0, S1, R = Shard(0), Shard(1), Replicate()
P_SUM, P_MAX = Partial("sum"), Partial("max")
FLOAT = 4
_functional = torch.ops._c10d_functional
_c10d = torch.ops.c10d_functional


# -- planner, no processes ---------------------------------------------------------------------


def test_one_all_to_all_over_both_dims_reaches_the_lower_bound() -> None:
    src, dst = (S0, S0), (S1, S1)
    one_dim = find_cheapest_plan((256, 256), (2, 2), src, dst, FLOAT)
    joint = find_cheapest_plan((256, 256), (2, 2), src, dst, FLOAT, allow_joint_steps=True)
    assert plan_bytes_per_rank(one_dim) == 131072
    assert [step.kind for step in joint] == [StepKind.JOINT_ALL_TO_ALL]
    assert joint[0].mesh_dims == (0, 1) and joint[0].changes == ((0, S0, S1), (1, S0, S1))
    assert plan_bytes_per_rank(joint) == lower_bound_bytes_per_rank((256, 256), (2, 2), src, dst, FLOAT) == 49152


def test_a_dim_that_keeps_its_placement_may_join_when_its_pieces_move() -> None:
    # (S0, S0) -> (S1, S0): mesh dim 1 stays S(0) but now splits the rows of a column half.
    plan = find_cheapest_plan((256, 256), (2, 2), (S0, S0), (S1, S0), FLOAT, allow_joint_steps=True)
    assert [step.kind for step in plan] == [StepKind.JOINT_ALL_TO_ALL]
    assert plan_bytes_per_rank(plan) == lower_bound_bytes_per_rank((256, 256), (2, 2), (S0, S0), (S1, S0), FLOAT)


def test_a_dim_that_keeps_its_placement_and_moves_nothing_does_not_join() -> None:
    # (S1, S1) -> (S1, R): only mesh dim 1's pairs exchange. Priced by time on the gloo profile, where
    # an all-to-all is cheaper than an all-gather, the 4-rank "joint" all-to-all used to win: a larger
    # group and a send buffer assembled from both halves, for the bytes of a one-dim all-gather.
    pricer = StepPricer(FakeMesh((2, 2)), BUILTIN_PROFILES["gloo-loopback"])
    for shape in ((1, 64, 48), (1, 1024, 256), (4, 1024, 256)):
        plan = find_cheapest_plan(shape, (2, 2), (S1, S1), (S1, R), FLOAT, allow_joint_steps=True, step_price=pricer)
        assert not any((0, S1, S1) in step.changes for step in plan if step.joint), plan
        if shape[1] >= 1024:  # (latency-bound, a 4-rank all-to-all to (R, R) then a chunk is cheaper here)
            assert [(step.kind, step.mesh_dims) for step in plan] == [(StepKind.ALL_GATHER, (1,))]


def test_joint_steps_only_where_they_move_fewer_bytes() -> None:
    # Gathering telescopes: two all-gathers move what one joint step would; the one-dim plan stays.
    for src, dst in [((S0, S1), (R, R)), ((P_SUM, P_SUM), (R, R)), ((P_SUM, P_SUM), (S0, S1)), ((R, S0), (S0, S1))]:
        one_dim = find_cheapest_plan((8, 12), (2, 2), src, dst, FLOAT)
        joint = find_cheapest_plan((8, 12), (2, 2), src, dst, FLOAT, allow_joint_steps=True)
        assert joint == one_dim, (src, dst, joint)


def test_a_replicated_dim_picks_pieces_for_a_reduce_scatter_over_the_partial_dim() -> None:
    # (P, R) -> (S0, S0): reduce-scatter over mesh dim 0 only, each rank's quarter picked by its dim-1 index.
    plan = find_cheapest_plan((256, 256), (2, 2), (P_SUM, R), (S0, S0), FLOAT, allow_joint_steps=True)
    assert [step.kind for step in plan] == [StepKind.JOINT_REDUCE_SCATTER]
    assert plan_bytes_per_rank(plan) == 65536 == lower_bound_bytes_per_rank((256, 256), (2, 2), (P_SUM, R), (S0, S0), FLOAT)


def test_pieces_that_do_not_fit_rule_a_joint_step_out() -> None:
    mesh = (2, 2, 2)
    # Mesh dim 2 splits rows innermost: after (S0, S0, S0) a rank's eighth is not inside its half.
    assert joint_step_bytes_per_rank((8, 4), mesh, (P_SUM, P_SUM, S0), (0, 1), (S0, S0), FLOAT) is None
    assert joint_step_bytes_per_rank((8, 4), mesh, (R, R, S0), (0, 1), (S0, S0), FLOAT) is None
    assert joint_step_bytes_per_rank((8, 4), mesh, (P_SUM, P_SUM, S0), (0, 1), (S1, S1), FLOAT) == 3 * 4 * 1 * FLOAT
    # Mixed reduce ops: one all-to-all of the raw contributions, reduced on arrival (a rank's 4x2 piece has
    # 4 contributions, 3 of them elsewhere).  A Partial target is no joint step.
    assert joint_step_bytes_per_rank((8, 4), (2, 2), (P_SUM, P_MAX), (0, 1), (S0, S1), FLOAT) == 3 * 8 * FLOAT
    assert joint_step_bytes_per_rank((8, 4), (2, 2), (S0, S1), (0, 1), (P_SUM, R), FLOAT) is None
    # A Partial mesh dim outside the step would have to be reduced after it: no joint reduction then.
    assert joint_step_bytes_per_rank((8, 4), mesh, (P_SUM, S0, P_MAX), (0, 1), (S0, S1), FLOAT) is None


def test_one_all_to_all_reducing_on_arrival_where_it_moves_fewer_bytes() -> None:
    shape, mesh = (256, 256), (2, 2)
    # Mixed Partial ops: one collective at the lower bound (three one-dim steps moved 229376 B).
    for src, dst in [((P_SUM, P_MAX), (S0, S0)), ((P_MAX, P_SUM), (S1, S1))]:
        plan = find_cheapest_plan(shape, mesh, src, dst, FLOAT, allow_joint_steps=True)
        assert [step.kind for step in plan] == [StepKind.JOINT_ALL_TO_ALL_REDUCE], plan
        assert plan_bytes_per_rank(plan) == 196608 == lower_bound_bytes_per_rank(shape, mesh, src, dst, FLOAT)
    # A Shard and a Partial dim: each rank gets its column quarter's three missing half-contributions.
    plan = find_cheapest_plan(shape, mesh, (S0, P_SUM), (S1, S1), FLOAT, allow_joint_steps=True)
    assert [step.kind for step in plan] == [StepKind.JOINT_ALL_TO_ALL_REDUCE]
    assert plan_bytes_per_rank(plan) == 98304


def test_uneven_and_nested_joint_steps_cost_exactly_what_they_move() -> None:
    # No padding in a joint all-to-all: (S0, S0) -> (S1, S1) on 7x5 costs the most a rank lacks.
    for shape in [(7, 5), (5, 3), (3, 5)]:
        plan = find_cheapest_plan(shape, (2, 2), (S0, S0), (S1, S1), FLOAT, allow_joint_steps=True)
        assert plan and all(step.kind is StepKind.JOINT_ALL_TO_ALL for step in plan), (shape, plan)
        assert plan_bytes_per_rank(plan) <= plan_bytes_per_rank(find_cheapest_plan(shape, (2, 2), (S0, S0), (S1, S1), FLOAT))


# -- on ranks --------------------------------------------------------------------------------


class ReceivedBytes(TorchDispatchMode):
    """Bytes this rank receives from others in the collectives run inside it (as the planner counts them)."""

    def __init__(self) -> None:
        super().__init__()
        self.received = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        packet = func.overloadpacket
        if packet is _functional.all_to_all_single:
            tensor, output_splits, group_name = args[0], args[1], args[3]
            group = torch.distributed.distributed_c10d._resolve_process_group(group_name)
            own = dist.get_group_rank(group, dist.get_rank())
            row = math.prod(tensor.shape[1:]) * tensor.element_size()  # from the shape: an empty send is fine
            self.received += sum(int(size) for index, size in enumerate(output_splits) if index != own) * row
        elif packet is _functional.all_gather_into_tensor:
            self.received += (int(args[1]) - 1) * args[0].numel() * args[0].element_size()
        elif packet is _functional.reduce_scatter_tensor:
            size = int(args[2])
            self.received += (size - 1) * (args[0].numel() // size) * args[0].element_size()
        elif packet is _functional.all_reduce:
            group = torch.distributed.distributed_c10d._resolve_process_group(args[2])
            size = group.size()
            self.received += 2 * (size - 1) * -(-args[0].numel() // size) * args[0].element_size()
        return func(*args, **(kwargs or {}))


def make_spec(mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]) -> DTensorSpec[DeviceMesh]:
    stride = torch.empty(tuple(shape)).stride()
    return DTensorSpec(mesh, tuple(placements), TensorMeta(torch.Size(shape), stride, torch.float32))


_EXPECTED_KEY = {
    StepKind.JOINT_ALL_TO_ALL: _c10d.all_to_all_single,
    StepKind.JOINT_REDUCE_SCATTER: _c10d.reduce_scatter_tensor,
    StepKind.JOINT_ALL_TO_ALL_REDUCE: _c10d.all_to_all_single,
    StepKind.ALL_TO_ALL: _c10d.all_to_all_single,
    StepKind.REDUCE_SCATTER: _c10d.reduce_scatter_tensor,
    StepKind.ALL_GATHER: _c10d.all_gather_into_tensor,
    StepKind.ALL_REDUCE: _c10d.all_reduce,
}

_JOINT_CASES: list[tuple[tuple[Placement, ...], tuple[Placement, ...]]] = [
    ((S0, S0), (S1, S1)),
    ((S1, S1), (S0, S0)),
    ((S0, S1), (S1, S0)),
    ((S0, S0), (S1, S0)),
    ((S0, S0), (R, S0)),
    ((R, S0), (S0, S0)),
    ((P_SUM, R), (S0, S0)),
    ((P_MAX, R), (S1, S1)),
    ((S0, P_SUM), (S1, R)),
    ((P_SUM, S0), (S0, S0)),
    ((Partial("avg"), R), (S0, S0)),
    ((S0, P_SUM), (S1, S1)),
    ((S1, P_MAX), (S0, S0)),
    ((P_SUM, P_MAX), (S0, S0)),
    ((P_MAX, Partial("avg")), (S1, S1)),
    ((Partial("min"), P_SUM), (S0, S1)),
]


def _run_joint_cases(mesh: DeviceMesh, shapes: Sequence[tuple[int, ...]]) -> list[str]:
    coordinate = tuple(mesh.get_coordinate() or ())
    problems: list[str] = []
    joint_seen = 0
    for shape in shapes:
        for index, (src, dst) in enumerate(_JOINT_CASES):
            name = f"{src} -> {dst} on {tuple(mesh.shape)}, shape {shape}"
            full = full_tensor(shape, index)
            local = source_locals(full, tuple(mesh.shape), src, index + 7)[coordinate]
            src_spec, dst_spec = make_spec(mesh, src, shape), make_spec(mesh, dst, shape)
            plan = plan_redistribute(src_spec, dst_spec)
            joint_seen += sum(1 for step in plan if step.joint)
            received = ReceivedBytes()
            with CommDebugMode() as comm, received:
                result = redistribute_local_tensor(local, src_spec, dst_spec)
            expected = select_local_shard(full, tuple(mesh.shape), coordinate, dst)
            if result.shape != expected.shape or not torch.allclose(result, expected, atol=1e-5):
                problems.append(f"{name}: rank {dist.get_rank()} got {result.tolist()}, expected {expected.tolist()}")
            wanted: dict[Any, int] = {}
            for step in plan:
                if step.kind.is_collective:
                    wanted[_EXPECTED_KEY[step.kind]] = wanted.get(_EXPECTED_KEY[step.kind], 0) + 1
            counts = {key: value for key, value in comm.get_comm_counts().items() if value}
            if min(shape) >= 4 and counts != wanted:
                problems.append(f"{name}: collectives {counts}, the plan {[str(s) for s in plan]} wants {wanted}")
            # The plan's figure is the most loaded rank's: no rank receives more, and for one-step plans
            # (every rank moves in the same collective) the most loaded one receives exactly that.
            rank_bytes = [0] * dist.get_world_size()
            dist.all_gather_object(rank_bytes, received.received)
            planned_bytes = plan_bytes_per_rank(plan)
            if max(rank_bytes) > planned_bytes or (len(plan) == 1 and max(rank_bytes) != planned_bytes):
                problems.append(f"{name}: ranks received {rank_bytes} B, the plan says {plan_bytes_per_rank(plan)}")
    if joint_seen == 0:
        problems.append("no plan used a joint step")
    return problems


@multi_rank(world_size=4)
def test_joint_steps_give_the_full_tensors_shards_with_the_planned_collectives() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with priced_by("nccl"):  # where joint steps pay (see priced_by)
        problems = _run_joint_cases(mesh, [(8, 12), (7, 5), (3, 5)])
        # Coordinates and ranks in another order: the joint group's ranks are sorted, the pieces follow.
        transposed = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("a", "b"))
        problems += _run_joint_cases(transposed, [(8, 12), (7, 5)])
    assert not problems, "\n".join(problems[:20])


@multi_rank(world_size=4)
def test_one_all_to_all_moves_the_lower_bound_on_2x2() -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    shape = (16, 16)
    full = full_tensor(shape, 3)
    coordinate = tuple(mesh.get_coordinate() or ())
    src_spec, dst_spec = make_spec(mesh, (S0, S0), shape), make_spec(mesh, (S1, S1), shape)
    local = select_local_shard(full, (2, 2), coordinate, (S0, S0)).clone()
    received = ReceivedBytes()
    with priced_by("nccl"), CommDebugMode() as comm, received:
        result = redistribute_local_tensor(local, src_spec, dst_spec)
    assert comm.get_total_counts() == 1 and comm.get_comm_counts()[_c10d.all_to_all_single] == 1
    # 16x16 fp32: a rank holds 4 rows, needs 4 columns, shares a 4x4 block: 48 elements arrive.
    assert received.received == 48 * FLOAT == redistribute_lower_bound_bytes(src_spec, dst_spec)
    assert torch.equal(result, select_local_shard(full, (2, 2), coordinate, (S1, S1)))


@multi_rank(world_size=4)
def test_the_gradient_of_a_joint_redistribution_plans_its_own_joint_step() -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    full = full_tensor((8, 12), 5)
    weight = full_tensor((8, 12), 6)
    coordinate = tuple(mesh.get_coordinate() or ())
    local = select_local_shard(full, (2, 2), coordinate, (S0, S0)).clone().requires_grad_(True)
    with priced_by("nccl"):
        source = DTensor.from_local(local, mesh, [S0, S0])
        moved = source.redistribute(mesh, [S1, S1])
        assert moved.placements == (S1, S1)
        loss = (moved.to_local() * select_local_shard(weight, (2, 2), coordinate, (S1, S1))).sum()
        with CommDebugMode() as comm:
            loss.backward()
    # The gradient comes back (S1, S1) -> (S0, S0): one joint all-to-all, nothing else.
    assert comm.get_total_counts() == 1 and comm.get_comm_counts()[_c10d.all_to_all_single] == 1
    assert local.grad is not None
    assert torch.equal(local.grad, select_local_shard(weight, (2, 2), coordinate, (S0, S0)))


@multi_rank(world_size=4)
def test_a_mesh_without_joint_groups_keeps_to_one_dim_steps() -> None:
    rank = dist.get_rank()
    world = init_device_mesh("cpu", (2, 2))
    mesh = DeviceMesh.from_group(
        [world.get_group(0), world.get_group(1)], "cpu", [[0, 1], [2, 3]], mesh_dim_names=("x", "y")
    )
    assert not mesh._supports_joint_groups() and world._supports_joint_groups()
    shape = (8, 12)
    full = full_tensor(shape, 11)
    coordinate = (rank // 2, rank % 2)
    src_spec, dst_spec = make_spec(mesh, (S0, S0), shape), make_spec(mesh, (S1, S1), shape)
    plan = plan_redistribute(src_spec, dst_spec)
    assert plan and not any(step.joint for step in plan)
    result = redistribute_local_tensor(
        select_local_shard(full, (2, 2), coordinate, (S0, S0)).clone(), src_spec, dst_spec
    )
    assert torch.equal(result, select_local_shard(full, (2, 2), coordinate, (S1, S1)))


@multi_rank(world_size=4)
def test_the_gradient_of_a_joint_reduction_goes_back_replicated_over_the_partial_dim() -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    shape = (8, 12)
    full = full_tensor(shape, 8)
    weight = full_tensor(shape, 9)
    coordinate = tuple(mesh.get_coordinate() or ())
    local = source_locals(full, (2, 2), (S0, P_SUM), 10)[coordinate].clone().requires_grad_(True)
    source = DTensor.from_local(local, mesh, [S0, P_SUM])
    with priced_by("nccl"), CommDebugMode() as forward:
        moved = source.redistribute(mesh, [S1, S1])
    # Forward: one all-to-all whose receivers add the two contributions.
    assert forward.get_total_counts() == 1 and forward.get_comm_counts()[_c10d.all_to_all_single] == 1
    assert torch.equal(moved.to_local(), select_local_shard(full, (2, 2), coordinate, (S1, S1)))
    loss = (moved.to_local() * select_local_shard(weight, (2, 2), coordinate, (S1, S1))).sum()
    loss.backward()
    # Each contribution's gradient is the whole gradient: rank (i, j) gets row block i of the weight.
    assert local.grad is not None
    assert torch.equal(local.grad, select_local_shard(weight, (2, 2), coordinate, (S0, R)))


class RecordedOps(TorchDispatchMode):
    """The aten ops dispatched inside, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@multi_rank(world_size=4)
def test_an_all_gather_behind_dims_of_size_one_is_a_view_of_what_arrives() -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    # (large enough for one-dim all-gathers to be the plan on the gloo profile, see above)
    cases = (((1, 1024, 256), 1, False), ((3, 1024, 256), 1, True), ((1, 256, 1024), 2, True), ((1, 1023, 256), 1, False))
    for shape, gather_dim, copies in cases:
        whole = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        shard = Shard(gather_dim)
        dtensor = distribute_tensor(whole, mesh, (shard, shard))
        with RecordedOps() as recorded:
            gathered = dtensor.redistribute(mesh, (shard, R))
        torch.testing.assert_close(gathered.to_local(), distribute_tensor(whole, mesh, (shard, R)).to_local())
        assert gathered.to_local().is_contiguous()
        # Where dims of size > 1 precede the gathered dim, the blocks are joined along it (one copy).
        assert ("aten::cat" in recorded.names) == copies, (shape, gather_dim, recorded.names)
