"""Activation checkpointing with fully_shard: backward's recomputation computes with the unsharded parameters.

torchtitan wraps each block in ``checkpoint_wrapper`` and then applies ``fully_shard`` to the wrapper, so the
recomputation in backward calls the inner block directly, without the unit's forward hooks: the unit's
pre-backward must put the unsharded parameters on the modules (as PyTorch's FSDP2 does) and its post-backward
the sharded ones back. ``checkpoint(fsdp_block)`` (the checkpoint outside the unit) runs the unit's forward
hooks again in the recomputation.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from shardwise.dtensor_ops import DTensor
from shardwise.fsdp_ext import fully_shard
from shardwise.mesh import init_device_mesh
from shardwise.testing import ModelArgs, Transformer, multi_rank

BATCH, SEQ = 4, 8


def _args(checkpoint_activations: bool) -> ModelArgs:
    return ModelArgs(
        n_layers=2, vocab_size=16, max_seq_len=SEQ, dim=16, n_heads=4, dropout_p=0.0,
        checkpoint_activations=checkpoint_activations,
    )


def _batches(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    text = torch.randint(0, 16, (steps, BATCH, SEQ + 1), generator=generator)
    return text[..., :-1].contiguous(), text[..., 1:].contiguous()


def _loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


@pytest.mark.parametrize("where", ["wrapper_inside_unit", "checkpoint_outside_unit"])
@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp"])
@multi_rank(world_size=4)
def test_checkpointed_blocks_train_like_one_process(where: str, layout: str) -> None:
    torch.manual_seed(0)
    reference = Transformer(_args(checkpoint_activations=False))
    model = copy.deepcopy(reference)
    if where == "checkpoint_outside_unit":
        model.checkpoint_activations = True
    if layout == "fsdp":
        dp_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        dp_rank, dp_size = dp_mesh.get_local_rank(), 4
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        Transformer.parallelize(model, mesh["tp"], use_seq_parallel=True)
        dp_mesh, dp_rank, dp_size = mesh["dp"], mesh.get_local_rank("dp"), 2
    for index, block in enumerate(model.layers):
        if where == "wrapper_inside_unit":
            block = checkpoint_wrapper(block)
            model.layers[index] = block
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    sharded_before = dict(model.named_parameters())
    per_rank = BATCH // dp_size
    local = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    tokens, labels = _batches(2)
    for step in range(2):
        ref_loss = _loss(reference, tokens[step], labels[step])
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        loss = _loss(model, tokens[step][local], labels[step][local])
        loss.backward()
        # After backward the modules hold the sharded parameters again (what the optimizer steps).
        for name, param in model.named_parameters():
            assert param is sharded_before[name], name
        optim.step()
        optim.zero_grad()
        losses = [torch.zeros(()) for _ in range(4)]
        dist.all_gather(losses, loss.detach())
        torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    reference_params = {
        name.replace("._checkpoint_wrapped_module", ""): p for name, p in reference.named_parameters()
    }
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        expected = reference_params[name.replace("._checkpoint_wrapped_module", "")]
        torch.testing.assert_close(param.full_tensor(), expected.detach(), rtol=1e-4, atol=1e-5, msg=name)
