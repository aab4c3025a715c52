"""fully_shard(mesh=<full SPMD mesh>, dp_mesh_dims=...) on DTensor parameters of the whole mesh."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor
from shardwise.fsdp_ext import DataParallelMeshDims, FSDPError, fully_shard
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.placement import Placement, _StridedShard
from shardwise.testing import multi_rank

NAMES = ("dp_replicate", "dp_shard", "cp", "tp")
# Meshes of 2 or 3 dims in the tests: dtensor_ops' redistribution planner takes minutes per step on 4-D ones
# (even with dims of size 1) on these machines.
BATCH = 8


def test_data_parallel_mesh_dims_names() -> None:
    dims = DataParallelMeshDims(shard=("dp_shard", "cp"), replicate="dp_replicate")
    assert dims.shard_names == ("dp_shard", "cp") and dims.replicate_names == ("dp_replicate",)
    assert DataParallelMeshDims(shard="dp_shard").replicate_names == ()
    assert DataParallelMeshDims(replicate=("a", "b")).shard_names == ()
    with pytest.raises(ValueError, match="At least one of shard or replicate"):
        DataParallelMeshDims()


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))


def _tp_placements(name: str) -> Placement:
    # Column-wise first layer, row-wise second, the last replicated over tp.
    return {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1)}.get(name, Replicate())


def _distribute(model: nn.Sequential, mesh: DeviceMesh) -> nn.Sequential:
    """Every parameter a DTensor on the whole mesh: Replicate on the dp dims, TP's placement on "tp"."""
    names = mesh.mesh_dim_names
    assert names is not None
    for module_name, module in model.named_children():
        for name, param in list(module.named_parameters(recurse=False)):
            placements = [Replicate()] * mesh.ndim
            if "tp" in names:
                placements[names.index("tp")] = _tp_placements(f"{module_name}.{name}")
            module.register_parameter(name, nn.Parameter(distribute_tensor(param.detach(), mesh, placements)))
    return model


def _shard(model: nn.Sequential, mesh: DeviceMesh, dims: DataParallelMeshDims) -> nn.Sequential:
    fully_shard(model[0], mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model[2], mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    return model


def _batch_placements(mesh: DeviceMesh, dims: DataParallelMeshDims) -> list[Placement]:
    names = mesh.mesh_dim_names
    assert names is not None
    dp = set(dims.shard_names) | set(dims.replicate_names)
    return [Shard(0) if name in dp else Replicate() for name in names]


@pytest.mark.parametrize(
    "names, shape, shard, replicate",
    [
        (("dp_shard", "cp", "tp"), (1, 2, 2), ("dp_shard", "cp"), None),
        (("dp_shard", "cp", "tp"), (2, 1, 2), "dp_shard", None),  # cp a non-dp dim, left as it is
        (("dp_replicate", "dp_shard", "tp"), (2, 1, 2), "dp_shard", "dp_replicate"),
        (("dp_replicate", "dp_shard", "cp"), (2, 1, 2), ("dp_shard", "cp"), "dp_replicate"),
        (("dp_replicate", "dp_shard", "cp"), (1, 2, 2), ("dp_shard", "cp"), "dp_replicate"),
    ],
)
@multi_rank(world_size=4)
def test_training_on_the_full_spmd_mesh_matches_one_process(
    names: tuple[str, ...], shape: tuple[int, ...], shard: str | tuple[str, ...], replicate: str | None
) -> None:
    reference = _mlp()
    spmd_mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dims = DataParallelMeshDims(shard=shard, replicate=replicate)
    model = _shard(_distribute(copy.deepcopy(reference), spmd_mesh), spmd_mesh, dims)
    model.set_gradient_divide_factor(1.0)  # the loss is the global batch's mean already (as torchtitan does)

    # Where the sharded parameters live: the shard dims flattened into one (in their place), other dims kept.
    shard_names = dims.shard_names
    shard_dim_name = "_".join(shard_names)
    expected_names: list[str] = []
    for name in names:
        if name in shard_names:
            if shard_dim_name not in expected_names:
                expected_names.append(shard_dim_name)
        else:
            expected_names.append(name)
    weight = model[0].weight
    assert isinstance(weight, DTensor) and weight.device_mesh.mesh_dim_names == tuple(expected_names)
    placements = dict(zip(expected_names, weight.placements))
    tp_size = shape[names.index("tp")] if "tp" in names else 1
    assert placements[shard_dim_name] == (_StridedShard(0, split_factor=tp_size) if tp_size > 1 else Shard(0))
    for name in expected_names:
        if name != shard_dim_name:
            assert placements[name] == (Shard(0) if name == "tp" else Replicate()), name
    assert model[2].weight.placements[expected_names.index(shard_dim_name)] == Shard(0)

    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(3)
    for _ in range(1):
        x = torch.randn(BATCH, 8, generator=generator)
        ref_loss = reference(x).pow(2).mean()
        ref_loss.backward()
        x_dt = distribute_tensor(x, spmd_mesh, _batch_placements(spmd_mesh, dims))
        out = model(x_dt)
        assert isinstance(out, DTensor) and out.device_mesh == spmd_mesh
        loss = out.pow(2).mean()
        loss.backward()
        torch.testing.assert_close(loss.full_tensor(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
            assert isinstance(param.grad, DTensor) and param.grad.placements == param.placements, name
            assert ref_param.grad is not None
            torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad, rtol=1e-5, atol=1e-6, msg=name)
        ref_optim.step()
        ref_optim.zero_grad()
        optim.step()
        optim.zero_grad()
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.full_tensor(), ref_param.detach(), rtol=1e-5, atol=1e-6, msg=name)


@multi_rank(world_size=4)
def test_default_divide_factor_averages_over_the_dp_ranks() -> None:
    # The gradients that arrive are Partial sums over the batch dims; FSDP sums them in its
    # reduce-scatter and by default divides by the dp size (as PyTorch's FSDP2 does).
    reference = _mlp()
    root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    dims = DataParallelMeshDims(shard="dp_shard")
    model = _shard(_distribute(copy.deepcopy(reference), root), root, dims)
    x = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(3))
    reference(x).pow(2).mean().backward()
    model(distribute_tensor(x, root, _batch_placements(root, dims))).pow(2).mean().backward()
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        assert ref_param.grad is not None and param.grad is not None
        torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad / 2, rtol=1e-5, atol=1e-6, msg=name)


@multi_rank(world_size=4)
def test_bad_dp_mesh_dims_input_is_refused_before_any_collective() -> None:
    root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    models = [_distribute(_mlp(), root) for _ in range(5)]
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    with CommDebugMode() as comm:
        with pytest.raises(FSDPError, match="not in the mesh's mesh_dim_names"):
            fully_shard(models[0], mesh=root, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
        with pytest.raises(FSDPError, match="got a plain tensor"):
            fully_shard(_mlp(), mesh=root, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))
        with pytest.raises(FSDPError, match="expected Replicate"):
            # TP's placement on the dp dim: not replicated there.
            fully_shard(models[1], mesh=root, dp_mesh_dims=DataParallelMeshDims(shard="tp"))
        with pytest.raises(FSDPError, match="on the mesh given to fully_shard"):
            fully_shard(models[2], mesh=other, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))
        with pytest.raises(NotImplementedError, match="int"):
            fully_shard(models[3], mesh=root, reshard_after_forward=2,
                        dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))
        with pytest.raises(NotImplementedError, match="DDP only"):
            fully_shard(models[4], mesh=root, dp_mesh_dims=DataParallelMeshDims(replicate="dp_shard"))
        with pytest.raises(RuntimeError):  # catchable as PyTorch's error class too
            fully_shard(_mlp(), mesh=root, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))
    assert comm.get_total_counts() == 0


@multi_rank(world_size=4)
def test_shard_placement_result_with_an_spmd_mesh_info() -> None:
    # torchtitan's expert-parallel pattern under full_dtensor: the mesh info comes from _get_mesh_info with
    # the dims (which flattens them once), and shard_placement_fn hands it out per parameter.
    from shardwise.fsdp_ext import ShardPlacementResult
    from shardwise.fsdp_ext._fully_shard_compat._fsdp_init import _get_mesh_info

    reference = _mlp()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    dims = DataParallelMeshDims(shard=("dp_shard", "cp"))
    info = _get_mesh_info(mesh, dims)
    model = _distribute(copy.deepcopy(reference), mesh)
    for child in (model[0], model[2]):
        fully_shard(child, mesh=mesh, dp_mesh_dims=dims,
                    shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), info))  # type: ignore[arg-type]
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    model.set_gradient_divide_factor(1.0)
    weight = model[0].weight
    assert weight.device_mesh == info.mesh and weight.placements == (Shard(0),)
    x = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(3))
    reference(x).pow(2).mean().backward()
    model(distribute_tensor(x, mesh, _batch_placements(mesh, dims))).pow(2).mean().backward()
    _assert_grads(model, reference)


def _assert_grads(model: nn.Module, reference: nn.Module) -> None:
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        assert param.grad is not None and ref_param.grad is not None, name
        torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("dp_replicate, dp_shard, cp", [(1, 2, 1), (1, 1, 2), (2, 1, 1)])
@multi_rank(world_size=4)
def test_full_dtensor_on_torchtitans_unflattened_storage_mesh(dp_replicate: int, dp_shard: int, cp: int) -> None:
    # torchtitan's full_dtensor backend: the dense mesh is an _unflatten of the 1-D world mesh (size-1 dims
    # fake, dp_shard always real), the storage mesh its active dims, dp_mesh_dims as resolve_fsdp_mesh makes it.
    reference = _mlp()
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    sizes = (1, dp_replicate, dp_shard, cp, 2)
    fake = {name: "fake" for name, size in zip(names, sizes) if size == 1 and name != "dp_shard"}
    dense = world._unflatten(0, sizes, names, backend_override=fake)
    active = tuple(name for name, size in zip(names, sizes) if size > 1 or name == "dp_shard")
    storage = dense[active]
    dims = DataParallelMeshDims(
        shard=("dp_shard", "cp") if cp > 1 else "dp_shard", replicate="dp_replicate" if dp_replicate > 1 else None
    )
    model = _shard(_distribute(copy.deepcopy(reference), storage), storage, dims)
    model.set_gradient_divide_factor(1.0)
    weight = model[0].weight
    shard_name = "dp_shard_cp" if cp > 1 else "dp_shard"
    expected = (("dp_replicate",) if dp_replicate > 1 else ()) + (shard_name, "tp")
    assert weight.device_mesh.mesh_dim_names == expected
    assert weight.placements[-2:] == (_StridedShard(0, split_factor=2), Shard(0))
    x = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(3))
    reference(x).pow(2).mean().backward()
    model(distribute_tensor(x, storage, _batch_placements(storage, dims))).pow(2).mean().backward()
    _assert_grads(model, reference)
