"""FSDPModule methods torchtitan calls beyond the basics: set_unshard_in_backward, set_symm_mem_for_comm,
register_fsdp_forward_method, share_comm_ctx (4 gloo ranks, against one process)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.dtensor_ops import DTensor
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.fsdp_ext import FSDPError, fully_shard, register_fsdp_forward_method, share_comm_ctx
from shardwise.mesh import init_device_mesh
from shardwise.testing import multi_rank

funcol = torch.ops.c10d_functional


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.body = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 6))
        self.head = Head()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Another entry point reading the parameters (as a generate or a loss method would)."""
        return self.proj(x).log_softmax(-1)


def _model() -> Decoder:
    torch.manual_seed(0)
    return Decoder()


def _shard(model: Decoder) -> Decoder:
    mesh = init_device_mesh("cpu", (4,))
    for unit in (model.embed, model.body, model.head):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, 11, (8, 3), generator=torch.Generator().manual_seed(5))


def _local(batch: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return batch[rank * 2 : rank * 2 + 2]


def _assert_grads_match(model: nn.Module, reference: nn.Module) -> None:
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        assert isinstance(param.grad, DTensor) and ref_param.grad is not None, name
        torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad, rtol=1e-5, atol=1e-6, msg=name)


@multi_rank(world_size=4)
def test_unshard_in_backward_off_skips_the_embeddings_backward_gather() -> None:
    reference = _model()
    tokens = _tokens()
    reference(tokens).pow(2).mean().backward()
    counts = []
    for unshard_in_backward in (True, False):
        model = _shard(copy.deepcopy(_model()))
        model.embed.set_unshard_in_backward(unshard_in_backward)
        with CommDebugMode() as comm:
            model(_local(tokens)).pow(2).mean().backward()
        counts.append(comm.get_comm_counts()[funcol.all_gather_into_tensor])
        _assert_grads_match(model, reference)
    # Backward gathers again each non-root unit resharded after forward; off, the embedding's is skipped
    # (its backward reads only the token ids) and its gradient is still reduce-scattered exactly.
    assert counts[0] - counts[1] == 1, counts


@multi_rank(world_size=4)
def test_symm_mem_for_comm_changes_nothing() -> None:
    reference = _model()
    tokens = _tokens()
    reference(tokens).pow(2).mean().backward()
    model = _shard(copy.deepcopy(_model()))
    model.set_symm_mem_for_comm()
    model.set_force_sum_reduction_for_comms(True)  # torchtitan's enable_fsdp_symm_mem pairs the two
    model.set_gradient_divide_factor(1.0)
    model(_local(tokens)).pow(2).mean().backward()
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        assert param.grad is not None and ref_param.grad is not None
        # Summed over 4 ranks, each the mean of its quarter of the batch: 4 x the global mean's gradient.
        torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad * 4, rtol=1e-5, atol=1e-6, msg=name)


@multi_rank(world_size=4)
def test_registered_forward_method_gathers_and_frees_the_unit() -> None:
    reference = _model()
    model = _shard(copy.deepcopy(reference))
    register_fsdp_forward_method(model.head, "scores")
    register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # not an FSDP module: a no-op
    with pytest.raises(FSDPError, match="no method 'nope'"):
        register_fsdp_forward_method(model.head, "nope")
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    ref_out = reference.head.scores(x)
    ref_out.sum().backward()
    with CommDebugMode() as comm:
        out = model.head.scores(_local(x))
    assert comm.get_comm_counts()[funcol.all_gather_into_tensor] == 1
    torch.testing.assert_close(out, ref_out[dist.get_rank() * 2 : dist.get_rank() * 2 + 2])
    # Freed again: the module holds its sharded DTensor parameter, not the gathered tensor.
    assert isinstance(model.head.proj.weight, DTensor)
    out.sum().backward()
    for name in ("weight", "bias"):
        param = getattr(model.head.proj, name)
        ref_param = getattr(reference.head.proj, name)
        assert param.grad is not None and ref_param.grad is not None
        # The ranks' gradients are averaged: each rank's quarter-batch sum, over 4 ranks, is the full sum / 4.
        torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad / 4, rtol=1e-5, atol=1e-6, msg=name)


@multi_rank(world_size=4)
def test_share_comm_ctx_takes_fsdp_modules_only() -> None:
    first, second = _shard(_model()), _shard(_model())
    share_comm_ctx([first, second])
    share_comm_ctx([])
    with pytest.raises(FSDPError, match="not a fully_shard module"):
        share_comm_ctx([first, nn.Linear(2, 2)])  # type: ignore[list-item]
    with pytest.raises(FSDPError, match="containers that do not implement forward"):
        fully_shard(nn.ModuleList([nn.Linear(2, 2)]), mesh=init_device_mesh("cpu", (4,)))
    # PyTorch's default reshard_after_forward=None: reshard (the root keeps its parameters anyway).
    unit = fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (4,)), reshard_after_forward=None)
    assert unit._fsdp_state().reshard_after_forward is True
