"""CommDebugMode around DTensor: the collectives DTensor issues internally, DTensor ops, parameters."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.dtensor_ops import DTensor, distribute_tensor, init_device_mesh
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh import DeviceMesh
from shardwise.placement import Partial, Replicate, Shard
from shardwise.testing import multi_rank

LEGACY = torch.ops.c10d_functional  # registered by importing shardwise.dtensor_ops.debug
NEW = torch.ops._c10d_functional
WORLD = 2


@multi_rank(world_size=WORLD)
def test_redistributions_are_counted_by_the_collective_they_issue() -> None:
    mesh = init_device_mesh("cpu", (WORLD,))
    rank = dist.get_rank()
    full = torch.arange(8.0).reshape(4, 2)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    partial = DTensor.from_local(torch.full((2, 2), rank + 1.0), mesh, [Partial()])

    mode = CommDebugMode()
    with mode:
        replicated = sharded.redistribute(mesh, [Replicate()])
        reduced = partial.redistribute(mesh, [Replicate()])
        scattered = partial.redistribute(mesh, [Shard(0)])

    assert torch.equal(replicated.to_local(), full)
    assert torch.equal(reduced.to_local(), torch.full((2, 2), 3.0))
    assert torch.equal(scattered.to_local(), torch.full((1, 2), 3.0))
    assert mode.get_comm_counts() == {
        LEGACY.all_gather_into_tensor: 1,
        LEGACY.all_reduce: 1,
        LEGACY.reduce_scatter_tensor: 1,
    }
    assert mode.get_comm_counts()[NEW.all_reduce] == 1
    assert mode.get_total_counts() == 3


@multi_rank(world_size=WORLD)
def test_dtensor_ops_pass_through_the_mode_and_are_traced_with_placements() -> None:
    mesh = init_device_mesh("cpu", (WORLD,))
    left_full = torch.arange(8.0).reshape(2, 4)
    right_full = torch.arange(12.0).reshape(4, 3)
    left = distribute_tensor(left_full, mesh, [Shard(1)])
    right = distribute_tensor(right_full, mesh, [Shard(0)])

    mode = CommDebugMode()
    with mode:
        product = left @ right  # contracting dim sharded on both sides: partial sums, no collective
        assert isinstance(product, DTensor)
        assert mode.get_total_counts() == 0
        full_product = product.full_tensor()

    assert tuple(product.placements) == (Partial(),)
    assert torch.equal(full_product, left_full @ right_full)
    assert mode.get_comm_counts() == {LEGACY.all_reduce: 1}

    level1 = mode.generate_comm_debug_tracing_table(noise_level=1)
    mm_entry = (
        "    **aten.mm.default\n"
        "      shape: [torch.Size([2, 4]), torch.Size([4, 3])]\n"
        "      sharding: [(Shard(dim=1),), (Shard(dim=0),)]\n"
        f"      device mesh: {mesh}\n"
    )
    assert mm_entry in level1
    # The local mm on the shards is a plain-tensor op: shown from level 2 on, with local shapes.
    assert "**aten.mm.default\n      shape: [torch.Size([2, 2]), torch.Size([2, 3])]\n" not in level1
    level2 = mode.generate_comm_debug_tracing_table(noise_level=2)
    assert "**aten.mm.default\n      shape: [torch.Size([2, 2]), torch.Size([2, 3])]\n" in level2


class ColwiseProjection(nn.Module):
    """Column-sharded linear layer that takes and returns plain tensors (like a colwise TP layer
    followed by gathering its output): forward all-gathers the output, backward all-reduces the
    input gradient."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        torch.manual_seed(0)
        dense = nn.Linear(4, 6)
        self.mesh = mesh
        self.weight = nn.Parameter(distribute_tensor(dense.weight.detach(), mesh, [Shard(0)]))
        self.bias = nn.Parameter(distribute_tensor(dense.bias.detach(), mesh, [Shard(0)]))
        self.dense_reference = dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        replicated_input = DTensor.from_local(x, self.mesh, [Replicate()])
        out = nn.functional.linear(replicated_input, self.weight, self.bias)
        assert isinstance(out, DTensor)
        return out.redistribute(self.mesh, [Replicate()]).to_local()


class Model(nn.Module):
    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.proj = ColwiseProjection(mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).relu()


@multi_rank(world_size=WORLD)
def test_dtensor_parameters_and_per_module_collectives(tmp_path: Path) -> None:
    mesh = init_device_mesh("cpu", (WORLD,))
    model = Model(mesh)
    x = torch.ones(3, 4, requires_grad=True)
    mode = CommDebugMode()
    with mode:
        model(x).sum().backward()

    reference_x = torch.ones(3, 4, requires_grad=True)
    model.proj.dense_reference(reference_x).relu().sum().backward()
    assert x.grad is not None and reference_x.grad is not None
    assert torch.allclose(x.grad, reference_x.grad)

    gather_forward = {"forward": {LEGACY.all_gather_into_tensor: 1}, "backward": {LEGACY.all_reduce: 1}}
    per_module = mode.get_per_module_comm_counts()
    assert list(per_module) == ["Global", "Model", "Model.proj"]
    for fqn in per_module:
        assert per_module[fqn] == gather_forward, fqn

    parameters = mode.get_parameter_info()
    assert list(parameters) == ["Model.proj"]
    assert parameters["Model.proj"]["weight"] is model.proj.weight
    assert parameters["Model.proj"]["bias"] is model.proj.bias
    assert mode.get_sharding_info() == {"Model.proj.weight": (Shard(0),), "Model.proj.bias": (Shard(0),)}

    table = mode.generate_comm_debug_tracing_table(noise_level=1)
    assert (
        "        Model.proj\n"
        "        *module type: test_comm_mode_dtensor.ColwiseProjection\n"
        "        *Parameter List\n"
        "         *weight: (Shard(dim=0),)\n"
        "         *bias: (Shard(dim=0),)\n"
    ) in table
    assert "*Parameter List" not in mode.generate_comm_debug_tracing_table(noise_level=0)

    # PyTorch's summary of the modules seen (every module called, its type and depth below "Global").
    helper = mode.advanced_module_tracker.module_helper_dict
    assert list(helper) == ["Global", "Model", "Model.proj"]
    assert helper["Global"] == {"depth": 0}
    assert helper["Model"] == {"module_type": "class 'test_comm_mode_dtensor.Model'", "depth": 1}
    assert helper["Model.proj"]["depth"] == 2
    assert helper["Model.proj"]["parameters"] == {"weight": "(Shard(dim=0),)", "bias": "(Shard(dim=0),)"}

    dump = tmp_path / f"rank{dist.get_rank()}.json"
    mode.generate_json_dump(str(dump), noise_level=1)
    proj = json.loads(dump.read_text())["children"][0]["children"][0]
    assert proj["fqn"] == "Model.proj"
    assert proj["parameters"] == [["weight", "(Shard(dim=0),)"], ["bias", "(Shard(dim=0),)"]]
    addmm = next(op for op in proj["operations_forward"] if op["name"] == "aten.addmm.default")
    assert addmm["kind"] == "dtensor_op"
    assert addmm["input_sharding"] == ["(Shard(dim=0),)", "(Replicate(),)", "(Shard(dim=1),)"]
    assert addmm["input_shape"] == [[6], [3, 4], [4, 6]]
    assert proj["collectives_backward"] == [["c10d_functional.all_reduce", 1]]
