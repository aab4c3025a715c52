"""fully_shard over tensor parallelism on a 2-D (dp, tp) mesh: layouts, parity, collectives, errors."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.fsdp_ext import MixedPrecisionPolicy, fully_shard
from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.placement import _StridedShard
from shardwise.testing import ModelArgs, Transformer, multi_rank

funcol = torch.ops.c10d_functional
BATCH, SEQ = 4, 8


def _args() -> ModelArgs:
    return ModelArgs(n_layers=2, vocab_size=16, max_seq_len=SEQ, dim=16, n_heads=4, dropout_p=0.0)


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _fsdp_tp(model: Transformer, mesh: DeviceMesh, use_seq_parallel: bool, **kwargs: object) -> Transformer:
    Transformer.parallelize(model, mesh["tp"], use_seq_parallel)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"], **kwargs)  # type: ignore[arg-type]
    fully_shard(model, mesh=mesh["dp"], **kwargs)  # type: ignore[arg-type]
    return model


def _batches(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    text = torch.randint(0, 16, (steps, BATCH, SEQ + 1), generator=generator)
    return text[..., :-1].contiguous(), text[..., 1:].contiguous()


def _loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


@multi_rank(world_size=4)
def test_parameters_live_on_the_2d_mesh_with_strided_dp_shards() -> None:
    torch.manual_seed(0)
    reference = Transformer(_args())
    mesh = _mesh()
    model = _fsdp_tp(copy.deepcopy(reference), mesh, use_seq_parallel=True)
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.device_mesh == mesh, name
        dp_placement, tp_placement = param.placements
        if tp_placement == Shard(0):
            assert dp_placement == _StridedShard(0, split_factor=2), name
        else:
            assert dp_placement == Shard(0), name
        torch.testing.assert_close(param.full_tensor(), reference_params[name].detach(), msg=name)


@pytest.mark.parametrize("use_seq_parallel", [False, True])
@multi_rank(world_size=4)
def test_fsdp_x_tp_training_matches_one_process(use_seq_parallel: bool) -> None:
    torch.manual_seed(0)
    reference = Transformer(_args())
    mesh = _mesh()
    model = _fsdp_tp(copy.deepcopy(reference), mesh, use_seq_parallel)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    dp_rank = mesh.get_local_rank("dp")
    local = slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2)
    tokens, labels = _batches(3)
    units = 3
    for step in range(3):
        ref_loss = _loss(reference, tokens[step], labels[step])
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        with CommDebugMode() as comm:
            loss = _loss(model, tokens[step][local], labels[step][local])
            loss.backward()
        counts = comm.get_comm_counts()
        # FSDP's own collectives: one all-gather per unit in forward, one more per non-root unit
        # in backward, one reduce-scatter per unit; the rest is tensor parallelism.
        assert counts[funcol.reduce_scatter_tensor] >= units
        optim.step()
        optim.zero_grad()
        losses = [torch.zeros(()) for _ in range(4)]
        dist.all_gather(losses, loss.detach())
        torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.full_tensor(), reference_params[name].detach(), rtol=1e-4, atol=1e-5,
                                   msg=name)


def _comm_counts(mode: CommDebugMode) -> dict[str, int]:
    counts = mode.get_comm_counts()
    names = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
    return {name: int(counts[getattr(funcol, name)]) for name in names} | {"total": mode.get_total_counts()}


@multi_rank(world_size=4)
def test_fsdp_adds_exactly_its_own_collectives_to_tensor_parallelism() -> None:
    torch.manual_seed(0)
    reference = Transformer(_args())
    mesh = _mesh()
    tp_only = Transformer.parallelize(copy.deepcopy(reference), mesh["tp"], True)
    model = _fsdp_tp(copy.deepcopy(reference), mesh, use_seq_parallel=True)
    tokens, labels = _batches(1)
    local = slice(0, 2) if mesh.get_local_rank("dp") == 0 else slice(2, 4)
    counts = []
    for net in (tp_only, model):
        with CommDebugMode() as comm:
            _loss(net, tokens[0][local], labels[0][local]).backward()
        counts.append(_comm_counts(comm))
    added = {name: counts[1][name] - counts[0][name] for name in counts[0]}
    # 3 units: 3 all-gathers in forward, 2 in backward (not the root), 3 reduce-scatters. The
    # sequence-parallel norms' gradients (10 parameters, in every unit) arrive Partial over tp;
    # FSDP needs true gradients to reduce-scatter, so each unit all-reduces its norms' gradients
    # over tp together, once, in backward (TP alone leaves them Partial and its optimizer step
    # reduces them, more than once per parameter).
    norm_params = sum(1 for name, _ in model.named_parameters() if "norm" in name)
    assert norm_params == 10
    units = 3
    assert added == {"all_reduce": units, "all_gather_into_tensor": 5, "reduce_scatter_tensor": 3,
                     "all_to_all_single": 0, "total": 8 + units}, counts
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    with CommDebugMode() as step_comm:
        optim.step()
    assert step_comm.get_total_counts() == 0
    with CommDebugMode() as clip_comm:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0, foreach=True)
    assert clip_comm.get_total_counts() >= 1
    assert isinstance(norm, DTensor)


@pytest.mark.parametrize("replicas, shards", [(2, 1), (1, 2)])
@multi_rank(world_size=4)
def test_hsdp_over_tensor_parallelism(replicas: int, shards: int) -> None:
    torch.manual_seed(0)
    reference = Transformer(_args())
    mesh = init_device_mesh("cpu", (replicas, shards, 2), mesh_dim_names=("replicate", "shard", "tp"))
    tp_only = Transformer.parallelize(copy.deepcopy(reference), mesh["tp"], True)
    model = Transformer.parallelize(copy.deepcopy(reference), mesh["tp"], True)
    dp_mesh = mesh["replicate", "shard"]
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    wq = model.layers[0].attention.wq.weight
    assert wq.device_mesh == mesh
    assert wq.placements == (Replicate(), _StridedShard(0, split_factor=2), Shard(0))
    torch.testing.assert_close(wq.full_tensor(), reference.layers[0].attention.wq.weight.detach())
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    replica, shard, _ = mesh.get_coordinate()  # type: ignore[misc]
    dp_index = replica * shards + shard
    local = slice(dp_index * BATCH // 2, (dp_index + 1) * BATCH // 2)
    tokens, labels = _batches(2)
    for step in range(2):
        ref_loss = _loss(reference, tokens[step], labels[step])
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        counts = []
        for net in (tp_only, model):
            with CommDebugMode() as comm:
                loss = _loss(net, tokens[step][local], labels[step][local])
                loss.backward()
            counts.append(_comm_counts(comm))
        tp_only.zero_grad()
        optim.step()
        optim.zero_grad()
        added = {name: counts[1][name] - counts[0][name] for name in counts[0]}
        # 3 units: all-gathers 3 + 2 and reduce-scatters 3 over the shard dim, one all-reduce per
        # unit for its SP norms over tp and, with 2 replicas, one per unit across them.
        all_reduces = 3 + (3 if replicas > 1 else 0)
        assert added == {"all_reduce": all_reduces, "all_gather_into_tensor": 5, "reduce_scatter_tensor": 3,
                         "all_to_all_single": 0, "total": 8 + all_reduces}, counts
        losses = [torch.zeros(()) for _ in range(4)]
        dist.all_gather(losses, loss.detach())
        torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.full_tensor(), reference_params[name].detach(), rtol=1e-4, atol=1e-5,
                                   msg=name)


def _shard_dim1_of_matrices(param: nn.Parameter) -> Shard | None:
    return Shard(1) if param.ndim == 2 else None


@multi_rank(world_size=4)
def test_fsdp_on_dim_1_over_tensor_parallelism() -> None:
    torch.manual_seed(0)
    reference = Transformer(_args())
    mesh = _mesh()
    model = _fsdp_tp(copy.deepcopy(reference), mesh, use_seq_parallel=True, shard_placement_fn=_shard_dim1_of_matrices)
    layer = model.layers[0]
    # Column-wise weights (TP cuts dim 0): FSDP's dim 1 is plain; row-wise (TP cuts dim 1): strided.
    assert layer.attention.wq.weight.placements == (Shard(1), Shard(0))
    assert layer.attention.wo.weight.placements == (_StridedShard(1, split_factor=2), Shard(1))
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    local = slice(0, 2) if mesh.get_local_rank("dp") == 0 else slice(2, 4)
    tokens, labels = _batches(2)
    for step in range(2):
        ref_loss = _loss(reference, tokens[step], labels[step])
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        loss = _loss(model, tokens[step][local], labels[step][local])
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses = [torch.zeros(()) for _ in range(4)]
        dist.all_gather(losses, loss.detach())
        torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.full_tensor(), reference_params[name].detach(), rtol=1e-4, atol=1e-5,
                                   msg=name)


def _mlp(hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, hidden), nn.ReLU(), nn.Linear(hidden, 5))


@pytest.mark.parametrize("hidden", [8, 6])
@multi_rank(world_size=4)
def test_layouts_match_pytorchs_fully_shard_over_tp(hidden: int) -> None:
    """Same model, plan and mesh: every parameter's placements and local piece as PyTorch's FSDP2 gives."""
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    torch_mesh = torch_init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    theirs = torch_parallelize(_mlp(hidden), torch_mesh["tp"], {"0": TorchColwise(), "2": TorchRowwise()})
    torch_fully_shard(theirs, mesh=torch_mesh["dp"])
    mesh = _mesh()
    # The parameters as shardwise's ColwiseParallel / RowwiseParallel lay them out (only layouts matter).
    ours = _mlp(hidden)
    layouts = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1), "2.bias": Replicate()}
    for name, placement in layouts.items():
        module_name, attribute = name.split(".")
        module = ours.get_submodule(module_name)
        value = getattr(module, attribute).detach()
        setattr(module, attribute, nn.Parameter(distribute_tensor(value, mesh["tp"], [placement])))
    fully_shard(ours, mesh=mesh["dp"])
    for (name, mine), (_, reference) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert repr(tuple(mine.placements)) == repr(tuple(reference.placements)), (name, mine.placements)
        assert torch.equal(mine.to_local(), reference.to_local()), name
        assert mine.shape == reference.shape and mine.stride() == reference.stride(), name


@multi_rank(world_size=4)
def test_mixed_precision_over_tensor_parallelism() -> None:
    torch.manual_seed(0)
    reference = Transformer(_args())
    bf16_reference = copy.deepcopy(reference).to(torch.bfloat16)
    mesh = _mesh()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _fsdp_tp(copy.deepcopy(reference), mesh, use_seq_parallel=True, mp_policy=policy)
    tokens, labels = _batches(1)
    _loss(bf16_reference, tokens[0], labels[0]).backward()
    local = slice(0, 2) if mesh.get_local_rank("dp") == 0 else slice(2, 4)
    _loss(model, tokens[0][local], labels[0][local]).backward()
    reference_params = dict(bf16_reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32 and param.grad is not None and param.grad.dtype == torch.float32
        expected = reference_params[name].grad
        assert expected is not None
        torch.testing.assert_close(param.grad.full_tensor(), expected.float(), rtol=5e-2, atol=5e-2, msg=name)


def _rows(rows: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, rows, bias=False))


def _colwise(model: nn.Sequential, tp_mesh: DeviceMesh) -> nn.Sequential:
    """The weight laid out as ColwiseParallel lays it out (only layouts matter here)."""
    model[0].weight = nn.Parameter(distribute_tensor(model[0].weight.detach(), tp_mesh, [Shard(0)]))
    return model


@multi_rank(world_size=4)
def test_bad_2d_input_is_refused_before_any_collective() -> None:
    mesh = _mesh()
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    unrelated = _colwise(_rows(8), other["b"])
    on_dp = _colwise(_rows(8), mesh["dp"])
    uneven = _colwise(_rows(7), mesh["tp"])
    with CommDebugMode() as comm:
        # TP on a mesh unrelated to the dp mesh.
        with pytest.raises(ValueError, match="not a named dim of the same mesh"):
            fully_shard(unrelated, mesh=mesh["dp"])
        # A parameter already laid out over the dp dim.
        with pytest.raises(ValueError, match="already laid out over the data-parallel mesh dim"):
            fully_shard(on_dp, mesh=mesh["dp"])
        # Uneven rows over dp=2 x tp=2 always have an exact _StridedShard layout (checked at
        # fully_shard); the refused sizes need more ranks (9 rows on dp=4 x tp=2).
        fully_shard(uneven, mesh=mesh["dp"])
        assert uneven[0].weight.placements == (_StridedShard(0, split_factor=2), Shard(0))
    assert comm.get_total_counts() == 0
    # Tensor parallelism after fully_shard: refused at the first forward, before its all-gather.
    model = fully_shard(_rows(8), mesh=mesh["dp"])
    model[0].weight = nn.Parameter(torch.randn(8, 3))
    with CommDebugMode() as comm:
        with pytest.raises(RuntimeError, match="Apply tensor parallelism .* before fully_shard"):
            model(torch.randn(2, 3))
    assert comm.get_total_counts() == 0


def _local_numel(tensor: torch.Tensor) -> int:
    return tensor._local_tensor.numel() if isinstance(tensor, DTensor) else tensor.numel()


@multi_rank(world_size=4)
def test_training_state_per_rank_is_a_quarter_of_the_model() -> None:
    """Parameters + gradients + AdamW state held per rank, measured after a step, against the model."""
    torch.manual_seed(0)
    args = ModelArgs(n_layers=2, vocab_size=32, max_seq_len=SEQ, dim=32, n_heads=4, dropout_p=0.0)
    reference = Transformer(args)
    model = _fsdp_tp(copy.deepcopy(reference), _mesh(), use_seq_parallel=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 32, (2, SEQ), generator=torch.Generator().manual_seed(3))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    optim.step()
    model_numel = sum(p.numel() for p in reference.parameters())
    held = 0
    for param in model.parameters():
        assert param.grad is not None
        held += _local_numel(param) + _local_numel(param.grad)
        state = optim.state[param]
        held += _local_numel(state["exp_avg"]) + _local_numel(state["exp_avg_sq"])
    per_rank = torch.tensor([held / (4 * model_numel)])
    fractions = [torch.zeros(1) for _ in range(4)]
    dist.all_gather(fractions, per_rank)
    # 4 copies (parameter, gradient, two moments) of 1/(dp * tp) of the model, up to uneven pieces.
    assert all(0.95 / 4 < float(f) < 1.1 / 4 for f in fractions), fractions
    # Every element is held once over the ranks, except parameters replicated over tp (norms, the
    # row-parallel biases), which FSDP shards over dp only: held by both tp ranks.
    copies = sum(p.numel() * (2 if p.placements[1] == Replicate() else 1) for p in model.parameters())
    assert abs(sum(float(f) for f in fractions) - copies / model_numel) < 1e-6
    assert copies / model_numel < 1.02
