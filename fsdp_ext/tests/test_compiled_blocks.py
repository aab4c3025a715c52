"""Units whose own call is compiled (``module.compile()``, torchtitan's per-block compile, before or after
``fully_shard``): the graph is the block's forward, FSDP's hooks run eagerly around it with every option."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.fsdp_ext import fully_shard
from shardwise.mesh import init_device_mesh
from shardwise.testing import multi_rank

WIDTH, BATCH = 8, 4


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3)))


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(100 + rank))


@pytest.mark.parametrize("compile_first", [True, False])
@multi_rank(world_size=4)
def test_compiled_blocks_train_like_one_process_with_eager_fsdp_options(compile_first: bool) -> None:
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model = _model()
    reference = _model()
    if compile_first:  # torchtitan's order: compile each block, then fully_shard it
        for block in model:
            block.compile(backend="aot_eager", fullgraph=True)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not compile_first:
        for block in model:
            block.compile(backend="aot_eager", fullgraph=True)
    # An option the traced (whole-model) path cannot honour: the blocks' hooks run eagerly, so it holds.
    for block in model:
        block.set_gradient_divide_factor(1.0)  # type: ignore[operator]
    model.set_gradient_divide_factor(1.0)  # type: ignore[operator]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    rank = dist.get_rank()
    for _ in range(2):
        model(_batch(rank)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        # One process: the sum of every rank's loss (divide factor 1: gradients summed over dp).
        sum(reference(_batch(r)).square().sum() for r in range(4)).backward()  # type: ignore[union-attr]
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    for (name, param), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.full_tensor(), want.detach(), rtol=1e-5, atol=1e-5, msg=name)
    torch._dynamo.reset()
