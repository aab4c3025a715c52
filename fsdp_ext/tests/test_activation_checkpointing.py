"""Activation checkpointing with fully_shard: backward's recomputation computes with the unsharded parameters.

torchtitan wraps each block in ``checkpoint_wrapper`` and then applies ``fully_shard`` to the wrapper, so the
recomputation in backward calls the inner block directly, without the unit's forward hooks: the unit's
pre-backward must put the unsharded parameters on the modules (as PyTorch's FSDP2 does) and its post-backward
the sharded ones back. ``checkpoint(fsdp_block)`` (the checkpoint outside the unit) runs the unit's forward
hooks again in the recomputation.
"""

from __future__ import annotations

import copy
from typing import Any

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


class _Trunk(nn.Module):
    """Embedding, one block, a final norm; the output head is called apart (torchtitan's chunked loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.block = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.norm(h + self.block(h))


def _chunked_loss_backward(model: _Trunk, tokens: torch.Tensor, labels: torch.Tensor, fsdp: bool) -> None:
    """torchtitan's ChunkedLossWrapper: head forward and backward per chunk of detached hidden states, the
    accumulated hidden-state gradient sent through the trunk last."""
    hidden = model(tokens)
    chunks = [c.detach().requires_grad_(True) for c in hidden.chunk(2, dim=1)]
    label_chunks = labels.chunk(2, dim=1)
    head: Any = model.head
    if fsdp:
        head.set_reshard_after_forward(False)
        head.set_reshard_after_backward(False)
        head.set_requires_gradient_sync(False, recurse=False)
        head.unshard()
    grads = []
    for index, (chunk, label_chunk) in enumerate(zip(chunks, label_chunks)):
        if fsdp and index == len(chunks) - 1:
            head.set_requires_gradient_sync(True, recurse=False)
        logits = head(chunk)
        F.cross_entropy(logits.flatten(0, 1), label_chunk.flatten()).backward()
        grads.append(chunk.grad)
    if fsdp:
        head.set_reshard_after_forward(True)
        head.set_reshard_after_backward(True)
        head.reshard()
    hidden.backward(torch.cat(grads, dim=1))


@multi_rank(world_size=4)
def test_list_unit_with_backwards_between_its_modules_as_torchtitans_chunked_loss() -> None:
    torch.manual_seed(0)
    reference = _Trunk()
    model = copy.deepcopy(reference)
    fully_shard(model.block)
    fully_shard([model.norm, model.head])  # torchtitan: the final norm and the output head, one unit
    fully_shard(model)
    sharded_before = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 16, (4, 6), generator=generator)
    labels = torch.randint(0, 16, (4, 6), generator=generator)
    rank = dist.get_rank()
    for _ in range(2):
        _chunked_loss_backward(reference, tokens, labels, fsdp=False)
        _chunked_loss_backward(model, tokens[rank : rank + 1], labels[rank : rank + 1], fsdp=True)
        for name, param in model.named_parameters():
            assert param is sharded_before[name], name
            expected = reference.get_parameter(name).grad
            assert param.grad is not None and expected is not None, name
            # The reference averages its loss over 4 rows, each rank over its one row and FSDP over the 4 ranks.
            torch.testing.assert_close(param.grad.full_tensor(), expected, rtol=1e-5, atol=1e-6, msg=name)
        reference.zero_grad()
        model.zero_grad()
