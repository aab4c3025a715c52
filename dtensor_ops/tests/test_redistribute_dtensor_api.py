"""DTensor.redistribute on 4 gloo ranks: gradients (the mirrored plan, the Partial rule) and async_op.

The loss is ``sum(y * W)`` for a global weight ``W``, so the gradient of the logical
input is ``W`` whatever the layouts: every rank's local gradient must be its shard of
``W`` for the source placements, with Partial mesh dims replaced by Replicate.  The
backward must issue exactly the collectives of the plan from the target layout to that
gradient layout.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch

from redistribute_helpers import CollectiveLog, collective_name, describe, full_tensor, source_locals
from shardwise.dtensor_ops import DTensor
from shardwise.dtensor_ops._collectives import PENDING_TENSOR_TYPES
from shardwise.dtensor_ops._redistribute import grad_target_spec, plan_redistribute
from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta, select_local_shard
from shardwise.testing import multi_rank


def _spec(mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]) -> DTensorSpec[Any]:
    stride = torch.empty(tuple(shape)).stride()
    return DTensorSpec(mesh, tuple(placements), TensorMeta(torch.Size(shape), stride, torch.float32))


def _check_gradients(
    mesh: DeviceMesh,
    cases: Sequence[tuple[tuple[Placement, ...], tuple[Placement, ...]]],
    shape: tuple[int, ...],
) -> list[str]:
    mesh_shape = tuple(mesh.shape)
    coordinate = tuple(mesh.get_coordinate() or ())
    stride = torch.empty(shape).stride()
    problems: list[str] = []
    for index, (src, dst) in enumerate(cases):
        name = f"{describe(src)} -> {describe(dst)} on {mesh_shape}"
        full = full_tensor(shape, index)
        weight = full_tensor(shape, 1000 + index)
        leaf = source_locals(full, mesh_shape, src, index)[coordinate].requires_grad_()
        source = DTensor.from_local(leaf, mesh, src, run_check=False, shape=torch.Size(shape), stride=stride)
        result = source.redistribute(mesh, dst)
        loss = (result.to_local() * select_local_shard(weight, mesh_shape, coordinate, dst)).sum()
        log = CollectiveLog()
        with log:
            loss.backward()
        grad_placements = grad_target_spec(_spec(mesh, src, shape), _spec(mesh, dst, shape)).placements
        expected_grad = select_local_shard(weight, mesh_shape, coordinate, grad_placements)
        if leaf.grad is None or not torch.equal(leaf.grad, expected_grad):
            got = None if leaf.grad is None else leaf.grad.tolist()
            problems.append(f"{name}: gradient {got}, expected {expected_grad.tolist()}")
        mirrored = plan_redistribute(_spec(mesh, dst, shape), _spec(mesh, grad_placements, shape))
        planned = [collective_name(step.kind) for step in mirrored if step.kind.is_collective]
        if log.collectives != planned:
            problems.append(f"{name}: backward ran {log.collectives}, the mirrored plan has {planned}")
    return problems


@multi_rank(world_size=4)
def test_gradients_on_a_1d_mesh_go_back_to_the_source_layout() -> None:
    mesh = init_device_mesh("cpu", (4,))
    sources: list[Placement] = [Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("avg"), Partial("max")]
    targets: list[Placement] = [Shard(0), Shard(1), Replicate()]
    cases = [((src,), (dst,)) for src, dst in itertools.product(sources, targets)]
    problems = _check_gradients(mesh, cases, (7, 5))
    assert not problems, "\n".join(problems)


@multi_rank(world_size=4)
def test_gradients_on_a_2x2_mesh_including_nested_shards() -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    layouts = list(itertools.product([Shard(0), Shard(1), Replicate()], repeat=2))
    sources = layouts + [(Partial("sum"), Shard(0)), (Shard(1), Partial("max")), (Partial("sum"), Partial("sum"))]
    cases = [(src, dst) for src in sources for dst in layouts if src != dst]
    problems = _check_gradients(mesh, cases, (7, 6))
    assert not problems, "\n".join(problems[:20])


@multi_rank(world_size=4)
def test_async_redistribute_through_dtensor_defers_the_last_wait() -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    shape = (7, 5)
    stride = torch.empty(shape).stride()
    coordinate = tuple(mesh.get_coordinate() or ())
    full = full_tensor(shape, 11)
    for src, dst in [
        ((Shard(0), Shard(1)), (Replicate(), Replicate())),
        ((Partial("sum"), Shard(0)), (Shard(1), Replicate())),
        ((Shard(0), Shard(0)), (Shard(1), Shard(1))),
    ]:
        local = source_locals(full, (2, 2), src, 3)[coordinate]
        source = DTensor.from_local(local, mesh, src, run_check=False, shape=torch.Size(shape), stride=stride)
        log = CollectiveLog()
        with log:
            result = source.redistribute(mesh, dst, async_op=True)
            issued = len(log.collectives)
            waited_before_use = log.names.count("wait")
            local_result = result.to_local()
            still_pending = isinstance(local_result, PENDING_TENSOR_TYPES) and not local_result.completed
            waits_after_to_local = log.names.count("wait")
            value = local_result + 0
        assert issued >= 1 and waited_before_use == issued - 1, (src, dst, log.names)
        assert still_pending and waits_after_to_local == waited_before_use, (src, dst, type(local_result))
        assert torch.equal(value, select_local_shard(full, (2, 2), coordinate, dst)), (src, dst)


@multi_rank(world_size=4)
def test_async_result_with_nothing_left_to_do_is_torchs_pending_tensor() -> None:
    import torch.distributed._functional_collectives as funcol

    from shardwise.dtensor_ops._collectives import AsyncCollectiveTensor

    mesh = init_device_mesh("cpu", (4,))
    finished, unfinished = funcol.AsyncCollectiveTensor, AsyncCollectiveTensor
    for shape, expected_type in (((8, 3), finished), ((4, 8), finished), ((7, 3), unfinished)):
        whole = torch.arange(float(shape[0] * shape[1])).reshape(shape)
        source = DTensor.from_local(
            select_local_shard(whole, (4,), (torch.distributed.get_rank(),), (Shard(0),)),
            mesh,
            (Shard(0),),
            run_check=False,
            shape=torch.Size(shape),
            stride=(shape[1], 1),
        )
        # An even all-gather along dim 0 arrives finished (PyTorch's DTensor gives torch's tensor there);
        # an uneven one still trims the padding: shardwise's pending tensor does that on first use.
        local = source.redistribute(mesh, (Replicate(),), async_op=True).to_local()
        assert type(local) is expected_type and not local.completed, (shape, type(local))
        viewed = local.view(-1)
        assert isinstance(viewed, PENDING_TENSOR_TYPES) and not local.completed
        torch.testing.assert_close(viewed + 0, whole.reshape(-1))
    # A Partial sum's all-reduce arrives finished too.
    partial = DTensor.from_local(torch.ones(2, 2), mesh, (Partial(),), run_check=False)
    pending = partial.redistribute(mesh, (Replicate(),), async_op=True).to_local()
    assert type(pending) is funcol.AsyncCollectiveTensor
    torch.testing.assert_close(pending * 1, torch.full((2, 2), 4.0))


@multi_rank(world_size=4)
def test_torch_debug_mode_records_each_redistribution_with_its_plan() -> None:
    """torch's DebugMode shows a shardwise ``redistribute`` as it shows PyTorch's: the trace of the plan, [explicit]."""
    from torch.utils._debug_mode import DebugMode

    from shardwise.dtensor_ops import distribute_tensor
    from shardwise.dtensor_ops._plan_executor import debug_trace

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    mesh["a", "b"]._flatten("a_b")
    full = torch.arange(32.0).reshape(8, 4)
    both = distribute_tensor(full, mesh, [Shard(0), Shard(0)])
    rows = distribute_tensor(full, mesh, [Shard(0), Replicate()])
    replicated = [Replicate(), Replicate()]
    with DebugMode(record_torchfunction=False) as debug_mode:
        cut = rows.redistribute(mesh, [Shard(0), Shard(1)])
        gathered = both.redistribute(mesh, replicated)
    text = debug_mode.debug_string()
    assert torch.equal(cut.full_tensor(), full) and torch.equal(gathered.to_local(), full)
    # A local step on mesh dim 1 is "->" between the states, in mesh-dim order.
    assert "redistribute_input [explicit] (t: f32[4, 4], trace: S(0)R->S(0)S(1))" in text, text
    # Both dims in one collective over their flattened group would be "-->"; the trace is the plan run.
    expected = debug_trace(both._spec, both._spec.with_placements(replicated))
    assert expected.startswith("S(0)[0]S(0)[1]-") and expected.endswith("RR"), expected
    assert f"redistribute_input [explicit] (t: f32[2, 4], trace: {expected})" in text, text


def test_debug_trace_spells_joint_steps_with_a_double_arrow() -> None:
    from shardwise.dtensor_ops._plan_executor import debug_trace
    from shardwise.testing import FakeMesh, priced_by

    mesh = FakeMesh((2, 2))
    meta = TensorMeta(torch.Size([8, 4]), (4, 1), torch.float32)
    with priced_by("nccl"):
        trace = debug_trace(DTensorSpec(mesh, (Shard(0), Shard(0)), meta), DTensorSpec(mesh, (Replicate(), Replicate()), meta))
    assert trace in ("S(0)[0]S(0)[1]-->RR", "S(0)[0]S(0)[1]->S(0)R->RR"), trace
    assert debug_trace(DTensorSpec(mesh, (Shard(0), Replicate()), meta), DTensorSpec(mesh, (Shard(0), Replicate()), meta)) == "S(0)R"
