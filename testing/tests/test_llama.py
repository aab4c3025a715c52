"""The model zoo's Llama: torchtitan's debug sizes, and context parallel (alone and with tensor parallel) equal to one process.

Under ``context_parallel`` the tokens, targets and positions are sharded by the head-tail load
balancer; rotary embeddings take the permuted positions; each rank's loss is its tokens' share of
the global mean, and gradients of the cp-replicated weights are summed over cp.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.dtensor_ops import DTensor, init_device_mesh
from shardwise.dtensor_ops.experimental._attention import _cp_options, context_parallel, set_rotate_method
from shardwise.testing import Llama, LlamaArgs, multi_rank

SMALL = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden_dim=48)


def test_default_config_is_torchtitans_debug_model() -> None:
    model = Llama()
    args = model.args
    assert (args.dim, args.n_layers, args.n_heads, args.vocab_size, args.ffn_hidden_dim) == (256, 6, 16, 2048, 768)
    assert model(torch.randint(0, 2048, (1, 8))).shape == (1, 8, 2048)


def test_gqa_rotary_and_bad_positions() -> None:
    torch.manual_seed(0)
    model = Llama(SMALL)
    tokens = torch.randint(0, 64, (2, 10))
    logits = model(tokens)
    torch.testing.assert_close(model(tokens, torch.arange(10)), logits)
    # Rotary makes the output depend on positions: shifting every position leaves attention
    # (relative) unchanged, a different spacing does not.
    torch.testing.assert_close(model(tokens, torch.arange(10) + 5), logits, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(model(tokens, torch.arange(10) * 2), logits, atol=1e-3)
    with pytest.raises(ValueError, match="positions must have shape \\(10,\\)"):
        model(tokens, torch.arange(9))
    with pytest.raises(ValueError, match="n_heads 4 must be a multiple of n_kv_heads 3"):
        Llama(LlamaArgs(dim=32, n_heads=4, n_kv_heads=3))


def _reference(tokens: torch.Tensor, targets: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    model = Llama(SMALL).double()
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    return float(loss), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _cp_loss_and_grads(cp_mesh: Any, tp_mesh: Any | None, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    model = Llama(SMALL).double()
    if tp_mesh is not None:
        Llama.parallelize(model, tp_mesh)
    total_tokens = targets.numel()
    positions = torch.arange(tokens.size(1))
    local_tokens, local_targets = tokens.clone(), targets.clone()
    with context_parallel(cp_mesh, buffers=[local_tokens, local_targets, positions], buffer_seq_dims=[1, 1, 0]):
        logits = model(local_tokens, positions)
        # This rank's tokens' share of the global mean: the cp ranks' losses add up to it.
        loss = F.cross_entropy(logits.flatten(0, 1), local_targets.flatten(), reduction="sum") / total_tokens
        loss.backward()
    summed = loss.detach().clone()
    dist.all_reduce(summed, group=cp_mesh.get_group())
    grads: dict[str, torch.Tensor] = {}
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        grad = parameter.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        dist.all_reduce(local, group=cp_mesh.get_group())  # weights are replicated over cp
        grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else local
    return float(summed), grads


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    sequence = torch.randint(0, 64, (2, 23), generator=generator)  # 22 tokens: not a multiple of 2 * cp
    return sequence[:, :-1], sequence[:, 1:]


@multi_rank
def test_context_parallel_llama_equals_one_process() -> None:
    _cp_options.enable_load_balance = True
    set_rotate_method("alltoall")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tokens, targets = _batch()
    expected_loss, expected_grads = _reference(tokens, targets)
    loss, grads = _cp_loss_and_grads(mesh, None, tokens, targets)
    assert abs(loss - expected_loss) < 1e-12, (loss, expected_loss)
    for name, expected in expected_grads.items():
        torch.testing.assert_close(grads[name], expected, rtol=1e-9, atol=1e-11, msg=name)
    set_rotate_method("allgather")


@multi_rank
def test_context_parallel_with_tensor_parallel_llama_equals_one_process() -> None:
    _cp_options.enable_load_balance = True
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    tokens, targets = _batch()
    expected_loss, expected_grads = _reference(tokens, targets)
    loss, grads = _cp_loss_and_grads(mesh["cp"], mesh["tp"], tokens, targets)
    assert abs(loss - expected_loss) < 1e-12, (loss, expected_loss)
    for name, expected in expected_grads.items():
        torch.testing.assert_close(grads[name], expected, rtol=1e-9, atol=1e-11, msg=name)
