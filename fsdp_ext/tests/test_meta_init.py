"""Deferred initialisation: fully_shard on the meta device, module.to_empty(device=...), in-place init.

torchtitan's order: build on meta, tensor parallelism, fully_shard per block and the root, to_empty("cpu"),
init_weights under no_grad (in place on the DTensor parameters), optimizer, train.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardwise.dtensor_ops import DTensor, distribute_tensor
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.fsdp_ext import FSDPError, fully_shard
from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.placement import Replicate, Shard, _StridedShard
from shardwise.testing import ModelArgs, Transformer, multi_rank

BATCH, SEQ = 4, 8
LAYOUTS = ["fsdp", "fsdp_tp", "hsdp"]


def _args() -> ModelArgs:
    return ModelArgs(n_layers=2, vocab_size=16, max_seq_len=SEQ, dim=16, n_heads=4, dropout_p=0.0)


def _sharded_on_meta(layout: str) -> tuple[Transformer, DeviceMesh, int, int]:
    """A Transformer built on meta and sharded in ``layout``, with this rank's batch slice (start, stop)."""
    with torch.device("meta"):
        model = Transformer(_args())
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        dp_mesh, dp_rank, dp_size = mesh, mesh.get_local_rank(), 4
    elif layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        Transformer.parallelize(model, mesh["tp"], use_seq_parallel=True)
        dp_mesh, dp_rank, dp_size = mesh["dp"], mesh.get_local_rank("dp"), 2
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        dp_mesh, dp_rank, dp_size = mesh, dist.get_rank(), 4
    with CommDebugMode() as comm:
        for block in model.layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    assert comm.get_total_counts() == 0
    per_rank = BATCH // dp_size
    return model, mesh, dp_rank * per_rank, (dp_rank + 1) * per_rank


def _batches(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    text = torch.randint(0, 16, (steps, BATCH, SEQ + 1), generator=generator)
    return text[..., :-1].contiguous(), text[..., 1:].contiguous()


def _loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


@pytest.mark.parametrize("layout", LAYOUTS)
@multi_rank(world_size=4)
def test_sharded_on_meta_then_to_empty_and_copied_in_trains_like_one_process(layout: str) -> None:
    torch.manual_seed(0)
    reference = Transformer(_args())
    model, mesh, start, stop = _sharded_on_meta(layout)
    params_before = dict(model.named_parameters())
    for name, param in params_before.items():
        assert isinstance(param, DTensor) and param.device.type == "meta", name
        assert param._local_tensor.is_meta, name
        assert param.shape == reference.get_parameter(name).shape, name
        if layout == "fsdp_tp" and param.placements[1] == Shard(0):
            assert param.placements[0] == _StridedShard(0, split_factor=2), name
        elif layout == "hsdp":
            assert param.placements == (Replicate(), Shard(0)), name

    model.to_empty(device="cpu")
    full = reference.state_dict()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # The optimizer's parameter objects are the ones fully_shard registered (swapped in place).
            assert param is params_before[name], name
            assert isinstance(param, DTensor) and param._local_tensor.device.type == "cpu", name
            param.copy_(distribute_tensor(full[name], param.device_mesh, param.placements))

    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    tokens, labels = _batches(2)
    for step in range(2):
        ref_loss = _loss(reference, tokens[step], labels[step])
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        loss = _loss(model, tokens[step][start:stop], labels[step][start:stop])
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses = [torch.zeros(()) for _ in range(4)]
        dist.all_gather(losses, loss.detach())
        torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.full_tensor(), reference_params[name].detach(), rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "layout",
    [
        "fsdp",
        "fsdp_tp",
        "hsdp",
    ],
)
@multi_rank(world_size=4)
def test_random_init_through_dtensor_is_what_forward_gathers(layout: str) -> None:
    model, mesh, start, stop = _sharded_on_meta(layout)
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            nn.init.trunc_normal_(param, std=0.5, a=-1.0, b=1.0)
    full = {name: param.full_tensor() for name, param in model.named_parameters()}
    for name, value in full.items():
        # Really initialised (not to_empty's garbage, not zeros), within trunc_normal_'s bounds.
        assert value.abs().max() <= 1.0 and value.std() > 0.2, name
    reference = Transformer(_args())
    reference.load_state_dict({name: value.full_tensor() for name, value in model.state_dict().items()})
    tokens, _ = _batches(1)
    with torch.no_grad():
        logits = model(tokens[0][start:stop])
        expected = reference(tokens[0][start:stop])
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    # And with gradients (the all-gather of the training path).
    logits = model(tokens[0][start:stop])
    torch.testing.assert_close(logits.detach(), expected, rtol=1e-5, atol=1e-5)


@multi_rank(world_size=4)
def test_forward_before_to_empty_is_refused_before_any_collective() -> None:
    model, _, start, stop = _sharded_on_meta("fsdp")
    tokens, _ = _batches(1)
    with CommDebugMode() as comm, pytest.raises(FSDPError, match="to_empty"):
        model(tokens[0][start:stop])
    assert comm.get_total_counts() == 0
    with CommDebugMode() as comm, pytest.raises(FSDPError, match="meta"):
        model.layers[0].unshard()  # type: ignore[operator]
    assert comm.get_total_counts() == 0


@multi_rank(world_size=4)
def test_to_empty_of_a_list_unit_and_plain_fully_shard_of_a_cpu_model_unchanged() -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    fully_shard([model[0], model[2]])
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = reference.get_parameter(name).detach()
            param.copy_(distribute_tensor(full, param.device_mesh, param.placements))
    inputs = torch.randn(5, 6, generator=torch.Generator().manual_seed(3))
    model(inputs).sum().backward()
    reference(inputs).sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None
        # Each rank computed the same batch: the averaged gradient is the reference's.
        torch.testing.assert_close(param.grad.full_tensor(), reference.get_parameter(name).grad, msg=name)
