"""replicate(): every rank keeps whole parameters and gradients are averaged, as one process on the whole batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.dtensor_ops import DTensor
from shardwise.fsdp_ext import FSDPModule
from shardwise.fsdp_ext._replicate import ReplicateModule, replicate
from shardwise.mesh import init_device_mesh
from shardwise.testing import multi_rank


@multi_rank(world_size=4)
def test_replicated_training_equals_one_process_on_the_whole_batch() -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    replicate(model, mesh=mesh)
    assert isinstance(model, ReplicateModule) and isinstance(model, FSDPModule)
    assert all(isinstance(p, DTensor) and p.to_local().shape == p.shape for p in model.parameters())
    batch = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    rank = dist.get_rank()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        model(batch[2 * rank:2 * rank + 2]).sum().backward()
        (reference(batch).sum() / 4).backward()
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.full_tensor(), theirs.detach())


@multi_rank(world_size=4)
def test_replicate_refuses_a_2d_mesh_before_any_collective() -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    with pytest.raises(ValueError, match="1-D mesh"):
        replicate(nn.Linear(2, 2), mesh=mesh)
