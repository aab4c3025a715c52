"""fully_shard over a flattened data-parallel mesh dim (torchtitan's ``dp_shard_cp``), with and without TP."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardwise.dtensor_ops import DTensor, Replicate, Shard
from shardwise.fsdp_ext import FSDPError, fully_shard
from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.placement import _StridedShard
from shardwise.testing import ModelArgs, Transformer, multi_rank

BATCH, SEQ = 4, 8


def _args() -> ModelArgs:
    return ModelArgs(n_layers=2, vocab_size=16, max_seq_len=SEQ, dim=16, n_heads=4, dropout_p=0.0)


def _batches(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    text = torch.randint(0, 16, (steps, BATCH, SEQ + 1), generator=generator)
    return text[..., :-1].contiguous(), text[..., 1:].contiguous()


def _loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _train_against_one_process(model: nn.Module, reference: nn.Module, dp_mesh: DeviceMesh, steps: int = 2) -> None:
    """AdamW steps on this rank's share of the batch (by its flat dp index) against one process."""
    coordinate = dp_mesh.get_coordinate()
    assert coordinate is not None
    dp_index, dp_size = 0, 1
    for index, extent in zip(coordinate, dp_mesh.shape):
        dp_index, dp_size = dp_index * extent + index, dp_size * extent
    per_rank = BATCH // dp_size
    local = slice(dp_index * per_rank, (dp_index + 1) * per_rank)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    tokens, labels = _batches(steps)
    for step in range(steps):
        ref_loss = _loss(reference, tokens[step], labels[step])
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        loss = _loss(model, tokens[step][local], labels[step][local])
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses = [torch.zeros(()) for _ in range(dist.get_world_size())]
        dist.all_gather(losses, loss.detach())
        # Ranks of one dp index (tp peers) hold the same loss: the mean over all ranks is the dp mean.
        torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        torch.testing.assert_close(param.full_tensor(), reference_params[name].detach(), rtol=1e-4, atol=1e-5,
                                   msg=name)


@pytest.mark.parametrize("shape", [(2, 1, 2), (1, 2, 2)])
@multi_rank(world_size=4)
def test_fsdp_over_flattened_dp_shard_cp_with_tp(shape: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    reference = Transformer(_args())
    root = init_device_mesh("cpu", shape, mesh_dim_names=("dp_shard", "cp", "tp"))
    root["dp_shard", "cp"]._flatten("dp_shard_cp")
    dp_mesh = root["dp_shard_cp"]
    model = Transformer.parallelize(copy.deepcopy(reference), root["tp"], True)
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    wq = model.layers[0].attention.wq.weight
    assert wq.device_mesh == root["dp_shard_cp", "tp"]
    assert wq.placements == (_StridedShard(0, split_factor=2), Shard(0))
    _train_against_one_process(model, reference, dp_mesh)


@pytest.mark.parametrize("shape", [(2, 1, 1, 2), (1, 1, 2, 2), (2, 2, 1, 1)])
@multi_rank(world_size=4)
def test_hsdp_over_flattened_dp_shard_cp_with_tp(shape: tuple[int, int, int, int]) -> None:
    torch.manual_seed(0)
    reference = Transformer(_args())
    root = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
    root["dp_shard", "cp"]._flatten("dp_shard_cp")
    dp_mesh = root["dp_replicate", "dp_shard_cp"]
    model = Transformer.parallelize(copy.deepcopy(reference), root["tp"], True)
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    wq = model.layers[0].attention.wq.weight
    assert wq.device_mesh == root["dp_replicate", "dp_shard_cp", "tp"]
    tp_size, shard_size = shape[3], shape[1] * shape[2]
    dp_placement = _StridedShard(0, split_factor=tp_size) if tp_size > 1 else Shard(0)
    assert wq.placements == (Replicate(), dp_placement, Shard(0))
    _train_against_one_process(model, reference, dp_mesh)
    assert shard_size * shape[0] * tp_size == 4


@multi_rank(world_size=4)
def test_fsdp_over_flattened_2x2_mesh_without_tp() -> None:
    torch.manual_seed(0)
    reference = Transformer(_args())
    root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    dp_mesh = root["dp_shard", "cp"]._flatten("dp_shard_cp")
    model = copy.deepcopy(reference)
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    assert model.layers[0].attention.wq.weight.placements == (Shard(0),)
    _train_against_one_process(model, reference, dp_mesh)


@multi_rank(world_size=4)
def test_tp_on_a_dim_the_flattened_dp_dim_covers_is_refused() -> None:
    root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    dp_mesh = root["dp_shard", "cp"]._flatten("dp_shard_cp")
    model = Transformer.parallelize(Transformer(_args()), root["cp"], False)
    with pytest.raises(FSDPError, match="already laid out over the data-parallel mesh"):
        fully_shard(model.layers[0], mesh=dp_mesh)
    # Catchable both ways, as PyTorch's RuntimeError and as our ValueError.
    assert issubclass(FSDPError, RuntimeError) and issubclass(FSDPError, ValueError)


@multi_rank(world_size=4)
def test_fsdp_x_tp_on_torchtitans_unflattened_meshes() -> None:
    # torchtitan's ParallelDims.build_mesh: views of the 1-D world mesh by _unflatten (size-1 dims fake);
    # TP on the dataloading mesh's "tp", FSDP on the dense mesh's "fsdp" (two different unflattenings).
    torch.manual_seed(0)
    reference = Transformer(_args())
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    dataloading = world._unflatten(0, (1, 2, 1, 2), ("pp", "batch", "cp", "tp"),
                                   backend_override={"pp": "fake", "cp": "fake"})
    dense = world._unflatten(0, (1, 1, 2, 2), ("pp", "dp_replicate", "fsdp", "tp"),
                             backend_override={"pp": "fake", "dp_replicate": "fake"})
    dp_mesh = dense["fsdp"]
    model = Transformer.parallelize(copy.deepcopy(reference), dataloading["tp"], True)
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    wq = model.layers[0].attention.wq.weight
    assert wq.device_mesh.mesh_dim_names == ("fsdp", "tp")
    assert wq.placements == (_StridedShard(0, split_factor=2), Shard(0))
    _train_against_one_process(model, reference, dp_mesh)
