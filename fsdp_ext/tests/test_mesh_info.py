"""FSDP2's semi-private mesh-info names (``_fully_shard_compat``) and per-parameter meshes through
``shard_placement_fn`` returning ``ShardPlacementResult`` (torchtitan's expert-parallel pattern)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.dtensor_ops import DTensor
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.fsdp_ext import DataParallelMeshDims, FSDPError, fully_shard
from shardwise.fsdp_ext._fully_shard_compat._fsdp_common import (
    DDPMeshInfo,
    FSDPMeshInfo,
    HSDPMeshInfo,
    ShardPlacementResult,
)
from shardwise.fsdp_ext._fully_shard_compat._fsdp_init import _get_mesh_info
from shardwise.mesh import init_device_mesh
from shardwise.placement import Replicate, Shard
from shardwise.testing import multi_rank

funcol = torch.ops.c10d_functional


@multi_rank(world_size=4)
def test_get_mesh_info_of_plain_and_spmd_meshes() -> None:
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    info = _get_mesh_info(flat)
    assert type(info) is FSDPMeshInfo and info.shard_mesh_size == 4 and not info.is_spmd_mesh
    assert info.shard_mesh_rank == dist.get_rank()
    hsdp = _get_mesh_info(init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard")))
    assert type(hsdp) is HSDPMeshInfo and hsdp.shard_mesh_size == 2 and hsdp.replicate_mesh_size == 2
    full = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "cp"))
    spmd = _get_mesh_info(full, DataParallelMeshDims(shard=("dp_shard", "cp"), replicate="dp_replicate"))
    assert type(spmd) is HSDPMeshInfo and spmd.is_spmd_mesh and spmd.spmd_mesh == full
    assert spmd.mesh.mesh_dim_names == ("dp_replicate", "dp_shard_cp") and spmd.shard_mesh_size == 2
    ddp = _get_mesh_info(full, DataParallelMeshDims(replicate="dp_replicate"))
    assert type(ddp) is DDPMeshInfo and ddp.replicate_mesh_size == 2
    with pytest.raises(FSDPError, match="shard_mesh_dim or replicate_mesh_dim"):
        FSDPMeshInfo(flat)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(6, 8)
        self.experts = nn.Parameter(torch.randn(2, 8, 6) * 0.3)  # (experts, in, out): dim 1 sharded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.dense(x))
        return torch.einsum("bi,eio->bo", h, self.experts)


@multi_rank(world_size=4)
def test_parameters_of_one_unit_on_two_meshes_match_one_process() -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(Block(), Block())
    model = copy.deepcopy(reference)
    dp_info = _get_mesh_info(init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
    edp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp_replicate", "efsdp"))
    edp_info = _get_mesh_info(edp_mesh)
    assert isinstance(dp_info, FSDPMeshInfo) and isinstance(edp_info, FSDPMeshInfo)

    def placement_fn(param: nn.Parameter) -> ShardPlacementResult:
        if param.dim() == 3:
            return ShardPlacementResult(placement=Shard(1), mesh_info=edp_info)
        return ShardPlacementResult(placement=Shard(0), mesh_info=dp_info)

    for block in model:
        fully_shard(block, mesh=dp_info.mesh, shard_placement_fn=placement_fn)
    fully_shard(model, mesh=dp_info.mesh)
    experts = model[0].experts
    assert isinstance(experts, DTensor) and experts.device_mesh == edp_mesh
    assert experts.placements == (Replicate(), Shard(1))
    assert model[0].dense.weight.device_mesh == dp_info.mesh and model[0].dense.weight.placements == (Shard(0),)

    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(2)
    rank = dist.get_rank()
    for step in range(2):
        x = torch.randn(8, 6, generator=generator)
        reference(x).pow(2).mean().backward()
        with CommDebugMode() as comm:
            model(x[rank * 2 : rank * 2 + 2]).pow(2).mean().backward()
        counts = comm.get_comm_counts()
        # Two blocks of two groups each: forward 4 all-gathers, backward 4 more (neither block is the root,
        # which has no parameters: both were resharded), 4 reduce-scatters, and the experts' HSDP all-reduce
        # across replicas (2).
        assert counts[funcol.all_gather_into_tensor] == 8 and counts[funcol.reduce_scatter_tensor] == 4, counts
        assert counts[funcol.all_reduce] == 2, counts
        for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
            assert param.grad is not None and ref_param.grad is not None
            torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad, rtol=1e-5, atol=1e-6, msg=name)
        ref_optim.step()
        optim.step()
        ref_optim.zero_grad()
        optim.zero_grad()
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.full_tensor(), ref_param.detach(), rtol=1e-5, atol=1e-6, msg=name)


@multi_rank(world_size=4)
def test_bad_shard_placement_result_is_refused() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    ddp = _get_mesh_info(mesh, DataParallelMeshDims(replicate="a"))
    with CommDebugMode() as comm:
        with pytest.raises(FSDPError, match="expected an FSDPMeshInfo"):
            fully_shard(Block(), mesh=mesh["b"],
                        shard_placement_fn=lambda p: ShardPlacementResult(None, ddp))  # type: ignore[arg-type]
        with pytest.raises(FSDPError, match=r"expected None or Shard\(dim\)"):
            fully_shard(Block(), mesh=mesh["b"], shard_placement_fn=lambda p: Replicate())  # type: ignore[arg-type,return-value]
    assert comm.get_total_counts() == 0


def test_compat_package_has_the_names_torch_imports_from_fsdp2() -> None:
    # What torch.distributed.fsdp's __init__ and torchtitan import from torch.distributed.fsdp._fully_shard,
    # which the switch (shardwise.torch_switch) resolves to this package. FSDP2's internals
    # (_fsdp_param_group, _fsdp_state) stay absent: dynamo probes for them and expects ModuleNotFoundError.
    import importlib

    import shardwise.fsdp_ext as fsdp_ext
    import shardwise.fsdp_ext._fully_shard_compat as compat

    for name in ("CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule", "fully_shard", "MixedPrecisionPolicy",
                 "OffloadPolicy", "register_fsdp_forward_method", "share_comm_ctx", "UnshardHandle"):
        assert getattr(compat, name) is getattr(fsdp_ext, name), name
    common = importlib.import_module("shardwise.fsdp_ext._fully_shard_compat._fsdp_common")
    assert common.FSDPMeshInfo is FSDPMeshInfo and common.ShardPlacementResult is ShardPlacementResult
    assert importlib.import_module("shardwise.fsdp_ext._fully_shard_compat._fsdp_init")._get_mesh_info is _get_mesh_info
    assert importlib.import_module("shardwise.fsdp_ext._fully_shard_compat._fully_shard").fully_shard is fully_shard
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("shardwise.fsdp_ext._fully_shard_compat._fsdp_param_group")
