"""PyTorch's planner and strategy vocabulary over shardwise's planner and rules: transform infos are
our plan, the flattening pass merges only what a flattened mesh can run exactly, and the modules
exist at PyTorch's paths."""

from __future__ import annotations

import logging

import pytest
import torch

from shardwise.testing import multi_rank


def test_modules_at_pytorch_paths_bind_the_compat_modules() -> None:
    import shardwise.dtensor_ops._dtensor_spec as spec_module
    import shardwise.dtensor_ops._ops._matrix_ops as matrix_ops
    import shardwise.dtensor_ops._redistribute as redistribute_module
    import shardwise.dtensor_ops._utils as utils_module
    import shardwise.dtensor_ops.device_mesh as device_mesh_module
    from shardwise.mesh import DeviceMesh
    from shardwise.placement import Partial, Replicate, Shard, ShardOrderEntry

    assert spec_module.ShardOrderEntry is ShardOrderEntry and device_mesh_module.DeviceMesh is DeviceMesh
    assert callable(utils_module._compute_local_shape_and_global_offset)
    assert utils_module._compute_local_shape_and_global_offset((5, 2), (2,), [1], [Shard(0)]) == ((2, 2), (3, 0))
    rows = matrix_ops.gen_single_dim_einsum_strategies("bmk,bkn->bmn", bias_shape=torch.Size([4]))
    # batch, contraction, lhs free, rhs free, then linearity in each input for sum and avg
    assert len(rows) == 1 + 1 + 1 + 1 + 4 and all(len(row) == 4 for row in rows)
    assert rows[1][0] == Partial() and rows[1][1] == Partial()
    assert rows[2][1] == Replicate()  # the bias broadcasts over the lhs free dim m
    info = redistribute_module._TransformInfo(0, (Shard(0), Replicate()), [8])
    assert info._comm_type_key() == "all_gather"
    with pytest.raises(AssertionError):
        redistribute_module._TransformInfo(0, (Replicate(), Replicate()), [8])


@multi_rank(world_size=4)
def test_transform_infos_are_our_plan_and_flattening_needs_a_flattened_mesh() -> None:
    from shardwise.dtensor_ops._redistribute import (
        _FlattenedTransformInfo,
        _gen_transform_infos,
        _optimize_transform_infos,
        _TransformInfo,
        disable_redistribute_transform_optimization,
        plan_redistribute,
    )
    from shardwise.mesh import init_device_mesh
    from shardwise.placement import DTensorSpec, Partial, Replicate, Shard, TensorMeta

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    # Planned on a mesh of its own: a joint step's group may flatten that mesh, and the checks below
    # need a mesh without a flattened one first.
    planned_on = init_device_mesh("cpu", (2, 2), mesh_dim_names=("c", "d"))
    meta = TensorMeta(torch.Size([8, 4]), (4, 1), torch.float32)
    src = DTensorSpec(planned_on, (Shard(0), Shard(1)), meta)
    dst = DTensorSpec(planned_on, (Replicate(), Replicate()), meta)
    infos = _gen_transform_infos(src, dst)
    plan = plan_redistribute(src, dst)
    assert [(i.mesh_dim, i.src_dst_placements) for i in infos] == [(s.mesh_dim, (s.before, s.after)) for s in plan]

    reduce = [
        _TransformInfo(0, (Partial("sum"), Replicate()), [8, 4]),
        _TransformInfo(1, (Partial("avg"), Replicate()), [8, 4]),
    ]
    placements = ((Partial("sum"), Partial("avg")), (Replicate(), Replicate()))
    logger = logging.getLogger("shardwise.dtensor_ops._redistribute")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        assert _optimize_transform_infos(reduce, mesh, *placements) == reduce  # no flattened mesh yet
        assert len(records) == 1 and "suboptimal" in records[0].getMessage()
        mesh["a", "b"]._flatten("ab")
        merged = _optimize_transform_infos(reduce, mesh, *placements)
        assert len(merged) == 1 and isinstance(merged[0], _FlattenedTransformInfo)
        assert merged[0].original_mesh_dims == (0, 1) and merged[0].avg_scale == 2
        with disable_redistribute_transform_optimization():
            assert _optimize_transform_infos(reduce, mesh, *placements) is reduce
        # A reduce-scatter cut outermost last is not what the flattened group lays out: kept apart.
        backwards = [
            _TransformInfo(1, (Partial(), Shard(0)), [8, 4]),
            _TransformInfo(0, (Partial(), Shard(0)), [4, 4]),
        ]
        assert _optimize_transform_infos(backwards, mesh, (Partial(), Partial()), (Shard(0), Shard(0))) == backwards
        assert any("non-ascending" in r.getMessage() for r in records)
    finally:
        logger.removeHandler(handler)


def test_joint_all_reduce_is_planned_where_it_moves_fewest_bytes() -> None:
    from shardwise.dtensor_ops._planner import StepKind, find_cheapest_plan
    from shardwise.placement import Partial, Replicate

    partials, replicated = (Partial(), Partial()), (Replicate(), Replicate())
    # 15 elements: reduce-scatter pieces would be padded, so one all-reduce over both dims is cheapest.
    plan = find_cheapest_plan((3, 5), (2, 2), partials, replicated, 4, allow_joint_steps=True)
    assert [step.kind for step in plan] == [StepKind.JOINT_ALL_REDUCE] and plan[0].mesh_dims == (0, 1)
    mixed = find_cheapest_plan((3, 5), (2, 2), (Partial("sum"), Partial("max")), replicated, 4, allow_joint_steps=True)
    assert StepKind.JOINT_ALL_REDUCE not in [step.kind for step in mixed]


@multi_rank(world_size=4)
def test_joint_all_reduce_runs_one_collective_with_torch_values() -> None:
    import torch.distributed as dist

    from shardwise.dtensor_ops import DTensor, Partial, Replicate
    from shardwise.dtensor_ops.debug import CommDebugMode
    from shardwise.mesh import init_device_mesh

    from redistribute_helpers import priced_by

    mesh = init_device_mesh("cpu", (2, 2))
    rank = dist.get_rank()
    local = torch.arange(15.0).reshape(3, 5) + rank
    for reduce_op, expected in (("sum", 4 * torch.arange(15.0).reshape(3, 5) + 6), ("avg", torch.arange(15.0).reshape(3, 5) + 1.5)):
        partial = DTensor.from_local(local, mesh, [Partial(reduce_op), Partial(reduce_op)])
        # One collective over the joint group where latency barely grows with the group (NCCL's profile,
        # pinned so the test does not depend on the default profile's figures).
        with priced_by("nccl"), CommDebugMode() as comms:
            replicated = partial.redistribute(mesh, [Replicate(), Replicate()])
        assert comms.get_total_counts() == 1
        torch.testing.assert_close(replicated.to_local(), expected)


def test_cost_of_shard_orders_follows_the_whole_tensor_path_and_keeps_the_triangle_inequality() -> None:
    import itertools

    from shardwise.dtensor_ops._collective_utils import redistribute_cost
    from shardwise.placement import DTensorSpec, Shard, ShardOrderEntry, TensorMeta
    from shardwise.testing import FakeMesh, generate_shard_orders, shard_order_to_placement

    mesh = FakeMesh((2, 2, 2))
    meta = TensorMeta(torch.Size([13, 2, 13]), (26, 13, 1), torch.float32)
    orders = list(generate_shard_orders(mesh, 3))[::9]
    specs = [DTensorSpec(mesh, shard_order_to_placement(o, mesh), meta, shard_order=o) for o in orders]
    for a, b, c in itertools.product(specs, specs, specs[::2]):
        assert redistribute_cost(a, b) <= redistribute_cost(a, c) + redistribute_cost(c, b)
    ordered = DTensorSpec(mesh, (Shard(0),) * 3, meta, shard_order=(ShardOrderEntry(0, (2, 1, 0)),))
    assert redistribute_cost(ordered, ordered.with_shard_order(None)) > 0  # same placements, other layout


@multi_rank(world_size=4)
def test_pytorch_planner_object_gives_our_plan_and_the_partials_it_passes_through() -> None:
    from shardwise.dtensor_ops._redistribute import _gen_transform_infos, get_redistribute_planner
    from shardwise.mesh import init_device_mesh
    from shardwise.placement import DTensorSpec, Partial, Replicate, Shard, TensorMeta

    mesh = init_device_mesh("cpu", (2, 2))
    meta = TensorMeta(torch.Size([12, 3]), (3, 1), torch.float32)
    planner = get_redistribute_planner(mesh, meta)
    assert get_redistribute_planner(mesh, meta) is planner
    src = DTensorSpec(mesh, (Partial("sum"), Shard(0)), meta)
    dst = DTensorSpec(mesh, (Replicate(), Partial("avg")), meta)
    infos = planner.generate_graph_based_transform_infos(src, dst, (12, 3))
    assert [(i.mesh_dim, i.src_dst_placements) for i in infos] == [
        (i.mesh_dim, i.src_dst_placements) for i in _gen_transform_infos(src, dst)
    ]
    assert planner.partial_reduce_ops_in_target == {"sum", "avg"}
    assert planner.generate_greedy_transform_infos(src, dst) == infos
    with pytest.raises(ValueError, match="full_tensor_shape"):
        planner.generate_graph_based_transform_infos(src, dst, (6, 3))
