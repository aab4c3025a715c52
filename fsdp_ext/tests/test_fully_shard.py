"""fully_shard on a 1-D data-parallel mesh: parity with one-process training, exact collectives, errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.dtensor_ops import DTensor
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.fsdp_ext import FSDPModule, MixedPrecisionPolicy, fully_shard
from shardwise.mesh import init_device_mesh
from shardwise.placement import Replicate, Shard
from shardwise.testing import multi_rank

funcol = torch.ops.c10d_functional


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """Odd sizes on purpose: dim 0 of most parameters does not divide over 4 ranks."""

    def __init__(self, vocab: int = 13, dim: int = 6, hidden: int = 10, n_blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _shard_model(model: Net, mesh: object, **kwargs: object) -> Net:
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)  # type: ignore[arg-type]
    fully_shard(model, mesh=mesh, **kwargs)  # type: ignore[arg-type]
    return model


def _batch(step: int, batch: int = 8, seq: int = 5, vocab: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, vocab, (batch, seq), generator=generator)
    targets = torch.randint(0, vocab, (batch, seq), generator=generator)
    return tokens, targets


def _loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


@multi_rank(world_size=4)
def test_parameters_are_dim0_shards_that_hide_the_padding() -> None:
    torch.manual_seed(0)
    reference = Net()
    model = _shard_model(copy.deepcopy(reference), init_device_mesh("cpu", (4,)))
    rank = dist.get_rank()
    assert isinstance(model, FSDPModule) and isinstance(model.blocks[0], FSDPModule)
    assert type(model).__name__ == "FSDPNet"
    for (name, param), (ref_name, ref_param) in zip(model.named_parameters(), reference.named_parameters()):
        assert name == ref_name
        assert isinstance(param, DTensor) and isinstance(param, nn.Parameter)
        assert param.placements == (Shard(0),) and param.shape == ref_param.shape
        expected = list(torch.chunk(ref_param.detach(), 4, 0)) + [ref_param.detach()[:0]] * 4
        assert torch.equal(param.to_local(), expected[rank]), name
        assert torch.equal(param.full_tensor(), ref_param.detach())


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@multi_rank(world_size=4)
def test_training_matches_one_process_with_exact_collectives(reshard_after_forward: bool) -> None:
    torch.manual_seed(0)
    reference = Net()
    model = _shard_model(copy.deepcopy(reference), init_device_mesh("cpu", (4,)),
                         reshard_after_forward=reshard_after_forward)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    rank = dist.get_rank()
    units = 3  # two blocks and the root
    for step in range(3):
        tokens, targets = _batch(step)
        ref_loss = _loss(reference, tokens, targets)
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()

        local = slice(rank * 2, rank * 2 + 2)  # each rank trains on its quarter of the batch
        with CommDebugMode() as forward_comm:
            loss = _loss(model, tokens[local], targets[local])
        with CommDebugMode() as backward_comm:
            loss.backward()
        with CommDebugMode() as step_comm:
            optim.step()
            optim.zero_grad()
        # One all-gather per unit in forward, one reduce-scatter per unit in backward; backward
        # re-gathers the units freed after forward (never the root).
        assert forward_comm.get_comm_counts()[funcol.all_gather_into_tensor] == units
        assert forward_comm.get_total_counts() == units
        regathers = units - 1 if reshard_after_forward else 0
        assert backward_comm.get_comm_counts()[funcol.all_gather_into_tensor] == regathers
        assert backward_comm.get_comm_counts()[funcol.reduce_scatter_tensor] == units
        assert backward_comm.get_total_counts() == units + regathers
        assert step_comm.get_total_counts() == 0
        all_losses = [torch.zeros(()) for _ in range(4)]
        dist.all_gather(all_losses, loss.detach())
        torch.testing.assert_close(torch.stack(all_losses).mean(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.full_tensor(), ref_param.detach(), rtol=1e-5, atol=1e-6, msg=name)


@multi_rank(world_size=4)
def test_a_list_of_modules_is_one_unit() -> None:
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (4,))
    blocks = [model.blocks[0], model.blocks[1]]
    assert fully_shard(blocks, mesh=mesh) is blocks
    fully_shard(model, mesh=mesh)
    assert all(isinstance(block, FSDPModule) for block in blocks)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    for step in range(2):
        tokens, targets = _batch(step)
        ref_loss = _loss(reference, tokens, targets)
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        local = slice(rank * 2, rank * 2 + 2)
        with CommDebugMode() as forward_comm:
            loss = _loss(model, tokens[local], targets[local])
        with CommDebugMode() as backward_comm:
            loss.backward()
        optim.step()
        optim.zero_grad()
        # Two units (both blocks together, the root): one all-gather each in forward, the blocks'
        # again in backward, one reduce-scatter each.
        assert forward_comm.get_comm_counts()[funcol.all_gather_into_tensor] == 2
        assert forward_comm.get_total_counts() == 2
        assert backward_comm.get_comm_counts()[funcol.all_gather_into_tensor] == 1
        assert backward_comm.get_comm_counts()[funcol.reduce_scatter_tensor] == 2
        assert backward_comm.get_total_counts() == 3
        all_losses = [torch.zeros(()) for _ in range(4)]
        dist.all_gather(all_losses, loss.detach())
        torch.testing.assert_close(torch.stack(all_losses).mean(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.full_tensor(), ref_param.detach(), rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="already applied"):
        fully_shard([model.blocks[0]], mesh=mesh)


@multi_rank(world_size=4)
def test_hsdp_shards_within_and_replicates_across() -> None:
    torch.manual_seed(0)
    reference = Net()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _shard_model(copy.deepcopy(reference), mesh)
    replica, shard = mesh.get_coordinate()  # type: ignore[misc]
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        assert param.device_mesh == mesh and param.placements == (Replicate(), Shard(0)), name
        expected = list(torch.chunk(ref_param.detach(), 2, 0)) + [ref_param.detach()[:0]] * 2
        assert torch.equal(param.to_local(), expected[shard]), name
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    rank = dist.get_rank()
    units = 3
    for step in range(2):
        tokens, targets = _batch(step)
        ref_loss = _loss(reference, tokens, targets)
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        local = slice(rank * 2, rank * 2 + 2)  # 4 data-parallel ranks: 2 replicas x 2 shards
        with CommDebugMode() as forward_comm:
            loss = _loss(model, tokens[local], targets[local])
        with CommDebugMode() as backward_comm:
            loss.backward()
        with CommDebugMode() as step_comm:
            optim.step()
            optim.zero_grad()
        # All-gathers and reduce-scatters within a replica (2 ranks); each unit's reduced
        # gradient is all-reduced across the 2 replicas once.
        assert forward_comm.get_comm_counts()[funcol.all_gather_into_tensor] == units
        assert forward_comm.get_total_counts() == units
        counts = backward_comm.get_comm_counts()
        assert counts[funcol.all_gather_into_tensor] == units - 1
        assert counts[funcol.reduce_scatter_tensor] == units
        assert counts[funcol.all_reduce] == units
        assert backward_comm.get_total_counts() == 3 * units - 1
        assert step_comm.get_total_counts() == 0
        all_losses = [torch.zeros(()) for _ in range(4)]
        dist.all_gather(all_losses, loss.detach())
        torch.testing.assert_close(torch.stack(all_losses).mean(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.full_tensor(), ref_param.detach(), rtol=1e-5, atol=1e-6, msg=name)


@multi_rank(world_size=4)
def test_hsdp_accumulation_all_reduces_once_across_replicas() -> None:
    torch.manual_seed(0)
    reference = Net()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _shard_model(copy.deepcopy(reference), mesh)
    rank = dist.get_rank()
    local = slice(rank * 2, rank * 2 + 2)
    all_reduces = []
    for micro_batch in range(2):
        tokens, targets = _batch(micro_batch)
        _loss(reference, tokens, targets).backward()
        model.set_requires_all_reduce(micro_batch == 1)
        with CommDebugMode() as comm:
            _loss(model, tokens[local], targets[local]).backward()
        counts = comm.get_comm_counts()
        assert counts[funcol.reduce_scatter_tensor] == 3
        all_reduces.append(counts[funcol.all_reduce])
        if micro_batch == 0:
            assert all(param.grad is None for param in model.parameters())
    # Within-replica reduce-scatters every time, the all-reduce across replicas once per unit.
    assert all_reduces == [0, 3]
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        assert param.grad is not None and ref_param.grad is not None
        torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad, rtol=1e-5, atol=1e-6, msg=name)


@multi_rank(world_size=4)
def test_gradient_divide_factor_sum_reduction_and_all_reduce_hook() -> None:
    torch.manual_seed(0)
    reference = Net()
    model = _shard_model(copy.deepcopy(reference), init_device_mesh("cpu", (4,)))
    tokens, targets = _batch(0)
    _loss(reference, tokens, targets).backward()
    rank = dist.get_rank()
    local = slice(rank * 2, rank * 2 + 2)

    def grads_times(scale: float) -> None:
        _loss(model, tokens[local], targets[local]).backward()
        for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
            assert param.grad is not None and ref_param.grad is not None
            torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad * scale, rtol=1e-5, atol=1e-6,
                                       msg=name)
        model.zero_grad(set_to_none=True)

    grads_times(1.0)
    model.set_force_sum_reduction_for_comms(True)
    grads_times(4.0)  # summed over the 4 ranks
    model.set_force_sum_reduction_for_comms(False)
    model.set_gradient_divide_factor(2.0)
    grads_times(2.0)
    model.set_gradient_divide_factor(4.0)
    seen: list[int] = []

    def triple(reduced: torch.Tensor) -> None:
        seen.append(reduced.numel())
        reduced.mul_(3)

    for unit in (model, *model.blocks):
        unit.set_all_reduce_hook(triple)
    grads_times(3.0)
    assert len(seen) == 3  # once per unit
    with pytest.raises(ValueError, match="positive factor"):
        model.set_gradient_divide_factor(0.0)


class _Boom(RuntimeError):
    pass


@multi_rank(world_size=4)
def test_reset_iter_state_after_an_aborted_forward() -> None:
    torch.manual_seed(0)
    reference = Net()
    model = _shard_model(copy.deepcopy(reference), init_device_mesh("cpu", (4,)))
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    local = slice(rank * 2, rank * 2 + 2)
    abort = [True]

    def maybe_abort(module: nn.Module, args: object) -> None:
        if abort[0]:
            raise _Boom("aborted inside the second block")

    model.blocks[1].down.register_forward_pre_hook(maybe_abort)
    tokens, targets = _batch(0)
    with pytest.raises(_Boom):
        _loss(model, tokens[local], targets[local])
    with pytest.raises(RuntimeError, match="root"):
        model.blocks[0].reset_iter_state()
    model.reset_iter_state()
    assert all(not unit._fsdp_state().group.is_unsharded for unit in (model, *model.blocks))
    abort[0] = False
    for step in range(2):
        tokens, targets = _batch(step)
        _loss(reference, tokens, targets).backward()
        ref_optim.step()
        ref_optim.zero_grad()
        with CommDebugMode() as comm:
            loss = _loss(model, tokens[local], targets[local])
        assert comm.get_comm_counts()[funcol.all_gather_into_tensor] == 3
        loss.backward()
        optim.step()
        optim.zero_grad()
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.full_tensor(), ref_param.detach(), rtol=1e-5, atol=1e-6, msg=name)


def _shard_dim1_of_matrices(param: nn.Parameter) -> Shard | None:
    return Shard(1) if param.ndim == 2 else None


@multi_rank(world_size=4)
def test_shard_placement_fn_cuts_another_dim() -> None:
    torch.manual_seed(0)
    reference = Net()
    mesh = init_device_mesh("cpu", (4,))
    model = _shard_model(copy.deepcopy(reference), mesh, shard_placement_fn=_shard_dim1_of_matrices)
    rank = dist.get_rank()
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        dim = 1 if ref_param.ndim == 2 else 0
        assert param.placements == (Shard(dim),), name
        expected = list(torch.chunk(ref_param.detach(), 4, dim)) + [ref_param.detach().narrow(dim, 0, 0)] * 4
        assert torch.equal(param.to_local(), expected[rank]), name
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    for step in range(2):
        tokens, targets = _batch(step)
        ref_loss = _loss(reference, tokens, targets)
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        local = slice(rank * 2, rank * 2 + 2)
        with CommDebugMode() as comm:
            loss = _loss(model, tokens[local], targets[local])
            loss.backward()
        optim.step()
        optim.zero_grad()
        # Still one all-gather per unit in forward (and per non-root unit in backward) and one
        # reduce-scatter per unit: every parameter's pieces travel in the unit's flat buffer.
        counts = comm.get_comm_counts()
        assert counts[funcol.all_gather_into_tensor] == 3 + 2 and counts[funcol.reduce_scatter_tensor] == 3
        assert comm.get_total_counts() == 8
        all_losses = [torch.zeros(()) for _ in range(4)]
        dist.all_gather(all_losses, loss.detach())
        torch.testing.assert_close(torch.stack(all_losses).mean(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.full_tensor(), ref_param.detach(), rtol=1e-5, atol=1e-6, msg=name)


@multi_rank(world_size=4)
def test_reshard_after_forward_to_a_smaller_group() -> None:
    torch.manual_seed(0)
    reference = Net()
    mesh = init_device_mesh("cpu", (4,))
    model = _shard_model(copy.deepcopy(reference), mesh, reshard_after_forward=2)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    rank = dist.get_rank()
    for step in range(3):
        tokens, targets = _batch(step)
        ref_loss = _loss(reference, tokens, targets)
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        local = slice(rank * 2, rank * 2 + 2)
        with CommDebugMode() as forward_comm:
            loss = _loss(model, tokens[local], targets[local])
        # Between forward and backward each block keeps half of its gathered buffer (its share
        # within a group of 2 ranks): twice a dp shard, half the unsharded parameters.
        for block in model.blocks:
            group = block._fsdp_state().group
            assert not group.is_unsharded and group._post_forward_shard.numel() == 2 * group.sharded_numel
        with CommDebugMode() as backward_comm:
            loss.backward()
        optim.step()
        optim.zero_grad()
        # Forward: one all-gather over the 4 ranks per unit; backward: the blocks' all-gathers run
        # within their groups of 2; one reduce-scatter per unit.
        assert forward_comm.get_total_counts() == forward_comm.get_comm_counts()[funcol.all_gather_into_tensor] == 3
        counts = backward_comm.get_comm_counts()
        assert counts[funcol.all_gather_into_tensor] == 2 and counts[funcol.reduce_scatter_tensor] == 3
        assert backward_comm.get_total_counts() == 5
        all_losses = [torch.zeros(()) for _ in range(4)]
        dist.all_gather(all_losses, loss.detach())
        torch.testing.assert_close(torch.stack(all_losses).mean(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.full_tensor(), ref_param.detach(), rtol=1e-5, atol=1e-6, msg=name)


@multi_rank(world_size=4)
def test_gradient_accumulation_without_sync_reduces_once() -> None:
    torch.manual_seed(0)
    reference = Net()
    model = _shard_model(copy.deepcopy(reference), init_device_mesh("cpu", (4,)))
    rank = dist.get_rank()
    micro_batches = [_batch(step) for step in range(3)]
    for tokens, targets in micro_batches:
        _loss(reference, tokens, targets).backward()
    local = slice(rank * 2, rank * 2 + 2)
    model.set_requires_gradient_sync(False)
    with CommDebugMode() as no_sync_comm:
        for tokens, targets in micro_batches[:-1]:
            _loss(model, tokens[local], targets[local]).backward()
    assert no_sync_comm.get_comm_counts()[funcol.reduce_scatter_tensor] == 0
    assert all(p.grad is None for p in model.parameters())
    model.set_requires_gradient_sync(True)
    with CommDebugMode() as sync_comm:
        tokens, targets = micro_batches[-1]
        _loss(model, tokens[local], targets[local]).backward()
    assert sync_comm.get_comm_counts()[funcol.reduce_scatter_tensor] == 3
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        assert isinstance(param.grad, DTensor) and param.grad.placements == (Shard(0),)
        torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad, rtol=1e-5, atol=1e-6, msg=name)


@multi_rank(world_size=4)
def test_mixed_precision_gathers_bf16_and_reduces_fp32() -> None:
    torch.manual_seed(0)
    reference = Net()
    bf16_reference = copy.deepcopy(reference).to(torch.bfloat16)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _shard_model(copy.deepcopy(reference), init_device_mesh("cpu", (4,)), mp_policy=policy)
    rank = dist.get_rank()
    tokens, targets = _batch(0)
    _loss(bf16_reference, tokens, targets).backward()
    local = slice(rank * 2, rank * 2 + 2)
    logits = model(tokens[local])
    assert logits.dtype == torch.bfloat16
    nn.functional.cross_entropy(logits.reshape(-1, 13).float(), targets[local].reshape(-1)).backward()
    for (name, param), ref_param in zip(model.named_parameters(), bf16_reference.parameters()):
        assert param.dtype == torch.float32 and param.grad is not None and param.grad.dtype == torch.float32
        torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad.float(), rtol=2e-2, atol=2e-2, msg=name)


@multi_rank(world_size=4)
def test_explicit_unshard_and_reshard() -> None:
    torch.manual_seed(0)
    reference = Net()
    model = _shard_model(copy.deepcopy(reference), init_device_mesh("cpu", (4,)))
    block = model.blocks[0]
    assert isinstance(block, FSDPModule)
    handle = block.unshard(async_op=True)
    assert handle is not None
    handle.wait()
    tokens, _ = _batch(0)
    with CommDebugMode() as comm:
        with torch.no_grad():
            out = model(tokens)
    # The block was gathered already: only the root and the other block gather.
    assert comm.get_comm_counts()[funcol.all_gather_into_tensor] == 2
    with torch.no_grad():
        torch.testing.assert_close(out, reference(tokens), rtol=1e-5, atol=1e-6)
    block.reshard()


@multi_rank(world_size=4)
def test_bad_input_is_refused_before_any_collective() -> None:
    mesh = init_device_mesh("cpu", (4,))
    model = Net()
    fully_shard(model.blocks[0], mesh=mesh)
    with CommDebugMode() as comm:
        with pytest.raises(ValueError, match="already applied to this FSDPBlock"):
            fully_shard(model.blocks[0], mesh=mesh)
        with pytest.raises(ValueError, match="expected a 1-D data-parallel mesh"):
            fully_shard(model.blocks[1], mesh=init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c")))
        with pytest.raises(ValueError, match=r"expected None or Shard\(dim\)"):
            fully_shard(model.blocks[1], mesh=mesh, shard_placement_fn=lambda p: Replicate())
        with pytest.raises(ValueError, match=r"expected a dim in \[-2, 1\]"):
            fully_shard(model.blocks[1], mesh=mesh, shard_placement_fn=lambda p: Shard(2) if p.ndim == 2 else None)
        with pytest.raises(ValueError, match="reshard_after_forward=3 does not divide"):
            fully_shard(model.blocks[1], mesh=mesh, reshard_after_forward=3)
        with pytest.raises(ValueError, match="empty list"):
            fully_shard([], mesh=mesh)
        with pytest.raises(ValueError, match="same module twice"):
            fully_shard([model.blocks[1], model.blocks[1]], mesh=mesh)
        with pytest.raises(TypeError, match="expects an nn.Module or a list of them"):
            fully_shard([model.blocks[1], torch.ones(2)], mesh=mesh)  # type: ignore[list-item]
    assert comm.get_total_counts() == 0
    mixed = Net()
    mixed.head.to(torch.float64)
    with pytest.raises(ValueError, match="need one dtype"):
        fully_shard(mixed, mesh=mesh)


@multi_rank(world_size=4)
def test_state_dict_holds_the_sharded_parameters_and_loads_back() -> None:
    torch.manual_seed(0)
    reference = Net()
    mesh = init_device_mesh("cpu", (4,))
    model = _shard_model(copy.deepcopy(reference), mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, targets = _batch(0)
    _loss(model, tokens, targets).backward()
    optim.step()
    state = model.state_dict()
    assert list(state) == list(reference.state_dict())
    assert all(isinstance(value, DTensor) and value.placements == (Shard(0),) for value in state.values())

    torch.manual_seed(1)
    other = _shard_model(Net(), mesh)
    with CommDebugMode() as comm:
        other.load_state_dict(state)
    assert comm.get_total_counts() == 0  # same layout: local copies into the sharded storage
    with torch.no_grad():
        torch.testing.assert_close(other(tokens), model(tokens))
    full = {name: value.full_tensor() for name, value in state.items()}
    plain = Net()
    plain.load_state_dict(full)
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens), model(tokens), rtol=1e-5, atol=1e-6)


@multi_rank(world_size=4)
def test_next_units_all_gather_is_in_flight_before_it_runs() -> None:
    """Prefetch: once the first forward recorded the order, each unit starts the next unit's all-gather
    (forward) or the previous one's (backward) before that unit needs it."""
    torch.manual_seed(0)
    model = _shard_model(Net(n_blocks=3), init_device_mesh("cpu", (4,)))
    tokens, targets = _batch(0)
    _loss(model, tokens, targets).backward()  # records the forward order
    groups = [block._fsdp_state().group for block in model.blocks]
    seen_in_flight: list[tuple[str, int]] = []

    def note_forward(index: int) -> None:
        if index + 1 < len(groups) and groups[index + 1]._pending_gather is not None:
            seen_in_flight.append(("forward", index + 1))

    in_backward: list[int] = []

    def note_backward(index: int) -> None:
        previous = groups[index - 1]
        if previous._pending_gather is not None or previous.is_unsharded:
            in_backward.append(index)

    def hook_output(output: torch.Tensor, index: int) -> None:
        output.register_hook(lambda grad: (note_backward(index), grad)[1])

    for index, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda module, args, index=index: note_forward(index))
        if index > 0:
            # Runs after fully_shard's own output hook (registered first), i.e. once this block's
            # backward is about to start and its prefetch has been issued.
            block.register_forward_hook(lambda module, args, output, index=index: hook_output(output, index))
    with CommDebugMode() as comm:
        loss = _loss(model, tokens, targets)
    assert seen_in_flight == [("forward", 1), ("forward", 2)]
    assert comm.get_comm_counts()[funcol.all_gather_into_tensor] == 4  # still one per unit
    with CommDebugMode() as comm:
        loss.backward()
    assert in_backward == [2, 1]  # blocks 2 and 1 found their predecessor's all-gather issued
    assert comm.get_comm_counts()[funcol.all_gather_into_tensor] == 3
