"""PyTorch's FSDP1 (``FullyShardedDataParallel``) over shardwise tensor parallelism, via DTensorExtensions.

FSDP1 runs on CPU/gloo when given ``device_id=torch.device("cpu")``. Its ``chunk_dtensor`` and
``all_gather_dtensor`` hooks are only reached when an FSDP instance has a ``device_mesh``, which
FSDP1 requires to be PyTorch's own DeviceMesh: those two are tested through the hooks directly.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, StateDictType
from torch.distributed.fsdp._fsdp_extensions import _set_fsdp_extensions

from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor
from shardwise.dtensor_ops._caches import clear_all_caches
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.fsdp_ext import DTensorExtensions
from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.testing import ModelArgs, Transformer, multi_rank

BATCH, SEQ = 4, 8
PREFIX = "_fsdp_wrapped_module."


def _args(weight_tying: bool = False) -> ModelArgs:
    # FSDP1 cannot keep a DTensor parameter tied (see the test of the error): untied by default.
    return ModelArgs(
        n_layers=2, vocab_size=16, max_seq_len=SEQ, dim=16, n_heads=4, dropout_p=0.0, weight_tying=weight_tying
    )


def _mesh() -> DeviceMesh:
    # Each test gets a fresh process group: decisions cached for the previous test's (equal) mesh
    # would hand back DTensors on its destroyed groups.
    clear_all_caches()
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _fsdp1_over_tp(
    reference: Transformer, mesh: DeviceMesh, use_seq_parallel: bool, mixed_precision: MixedPrecision | None = None
) -> nn.Module:
    """Each block its own FSDP1 instance, then the root, all over the dp group of a TP model."""
    _set_fsdp_extensions(DTensorExtensions())
    model = Transformer.parallelize(copy.deepcopy(reference), mesh["tp"], use_seq_parallel)
    kwargs = dict(
        process_group=mesh["dp"].get_group(),
        use_orig_params=True,
        device_id=torch.device("cpu"),
        mixed_precision=mixed_precision,
    )
    for index, block in enumerate(model.layers):
        model.layers[index] = FSDP(block, **kwargs)  # type: ignore[arg-type]
    return FSDP(model, **kwargs)  # type: ignore[arg-type]


def _batches(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    text = torch.randint(0, 16, (steps, BATCH, SEQ + 1), generator=generator)
    return text[..., :-1].contiguous(), text[..., 1:].contiguous()


def _loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _local_batch(mesh: DeviceMesh) -> slice:
    dp_rank = mesh.get_local_rank("dp")
    return slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2)


def _clean(name: str) -> str:
    return name.replace(PREFIX, "")


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """FSDP1's full state dict, each tp DTensor gathered over tp too."""
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        state = model.state_dict()
    return {_clean(k): v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


@pytest.mark.parametrize("use_seq_parallel", [False, True])
@multi_rank(world_size=4)
def test_fsdp1_over_tensor_parallelism_trains_like_one_process(use_seq_parallel: bool) -> None:
    torch.manual_seed(0)
    reference = Transformer(_args())
    mesh = _mesh()
    model = _fsdp1_over_tp(reference, mesh, use_seq_parallel)
    # FSDP1 with use_orig_params exposes each parameter as a flat view of this rank's dp shard.
    assert all(type(p) is nn.Parameter and p.ndim == 1 for p in model.parameters())
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    tokens, labels = _batches(3)
    local = _local_batch(mesh)
    for step in range(3):
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
    full = _full_state(model)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(full[name], param.detach(), rtol=1e-4, atol=1e-5, msg=name)


@multi_rank(world_size=4)
def test_fsdp1_mixed_precision_over_tensor_parallelism() -> None:
    torch.manual_seed(0)
    reference = Transformer(_args())
    bf16_reference = copy.deepcopy(reference).to(torch.bfloat16)
    mesh = _mesh()
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _fsdp1_over_tp(reference, mesh, use_seq_parallel=True, mixed_precision=policy)
    tokens, labels = _batches(1)
    local = _local_batch(mesh)
    ref_loss = _loss(bf16_reference, tokens[0], labels[0])
    ref_loss.backward()
    loss = _loss(model, tokens[0][local], labels[0][local])
    loss.backward()
    losses = [torch.zeros(()) for _ in range(4)]
    dist.all_gather(losses, loss.detach())
    torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach().float(), rtol=2e-2, atol=2e-2)
    reference_grads = {name: p.grad for name, p in bf16_reference.named_parameters()}
    with FSDP.summon_full_params(model, with_grads=True):
        for name, param in model.named_parameters():
            assert param.grad is not None, name
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            expected = reference_grads[_clean(name)]
            assert expected is not None
            torch.testing.assert_close(grad.float(), expected.float(), rtol=5e-2, atol=5e-2, msg=name)


@multi_rank(world_size=4)
def test_fsdp1_adds_no_shardwise_collective_to_tensor_parallelism() -> None:
    torch.manual_seed(0)
    reference = Transformer(_args())
    mesh = _mesh()
    tp_only = Transformer.parallelize(copy.deepcopy(reference), mesh["tp"], False)
    model = _fsdp1_over_tp(reference, mesh, use_seq_parallel=False)
    tokens, labels = _batches(1)
    local = _local_batch(mesh)
    counts = []
    for net in (tp_only, model):
        with CommDebugMode() as comm:
            _loss(net, tokens[0][local], labels[0][local]).backward()
        # FSDP1's own all-gathers and reduce-scatters are c10d calls, not functional collectives.
        counts.append({op: n for op, n in comm.get_comm_counts().items() if "functional" in str(op)})
    # Rebuilding the DTensors around FSDP1's gathered buffers and sending their gradients back is
    # communication-free: the only shardwise collectives are tensor parallelism's own.
    assert counts[0] == counts[1] and sum(counts[0].values()) > 0, counts


def _expected_piece(whole: torch.Tensor, value: ShardedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's innermost local shard of a (nested) sharded state-dict entry, and the slice of
    ``whole`` its metadata says it holds."""
    (outer,) = value.local_shards()
    box = whole
    for dim, (offset, size) in enumerate(zip(outer.metadata.shard_offsets, outer.metadata.shard_sizes)):
        box = box.narrow(dim, offset, size)
    if not isinstance(outer.tensor, ShardedTensor):
        return outer.tensor, box
    inner_shards = outer.tensor.local_shards()
    if not inner_shards:
        return torch.empty(0), torch.empty(0)
    (inner,) = inner_shards
    offset, size = inner.metadata.shard_offsets[0], inner.metadata.shard_sizes[0]
    return inner.tensor, box.narrow(0, offset, size)


@multi_rank(world_size=4)
def test_fsdp1_sharded_state_dict_holds_each_ranks_piece_and_loads_back() -> None:
    torch.manual_seed(0)
    reference = Transformer(_args())
    mesh = _mesh()
    model = _fsdp1_over_tp(reference, mesh, use_seq_parallel=True)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = model.state_dict()
    reference_params = dict(reference.named_parameters())
    assert {_clean(k) for k in sharded} == set(reference_params)
    pieces, expected_pieces = 0, 0
    for key, value in sharded.items():
        whole = reference_params[_clean(key)].detach()
        assert isinstance(value, ShardedTensor) and value.shape == whole.shape, key
        local, expected = _expected_piece(whole, value)
        torch.testing.assert_close(local, expected, msg=key)
        pieces += local.numel()
        # A parameter cut over tp has one box per tp rank; a replicated one, one box on each.
        tp_copies = 1 if len(value.metadata().shards_metadata) > 1 else 2
        expected_pieces += whole.numel() * tp_copies
    # The 4 ranks' pieces cover every parameter exactly once per tp copy: dp cuts without overlap.
    counts = [torch.zeros((), dtype=torch.long) for _ in range(4)]
    dist.all_gather(counts, torch.tensor(pieces))
    assert int(sum(counts)) == expected_pieces
    # Loading unwraps the tp ShardedTensor down to the dp chunk FSDP1 all-gathers.
    extensions = DTensorExtensions()
    for key, value in sharded.items():
        inner, shards = extensions.pre_load_state_dict_transform(value)
        local, _ = _expected_piece(reference_params[_clean(key)].detach(), value)
        assert len(shards) <= 1 and inner.shape[1:] == local.shape[1:], key
        if shards:
            assert torch.equal(shards[0].tensor, local), key
    # Train one step away from the saved values, then load them back.
    saved = _full_state(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    tokens, labels = _batches(1)
    local_batch = _local_batch(mesh)
    _loss(model, tokens[0][local_batch], labels[0][local_batch]).backward()
    optim.step()
    assert any(not torch.equal(value, saved[key]) for key, value in _full_state(model).items())
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(sharded)
    for key, value in _full_state(model).items():
        torch.testing.assert_close(value, saved[key], msg=key)


@multi_rank(world_size=4)
def test_fsdp1_full_state_dict_loads_back() -> None:
    torch.manual_seed(0)
    reference = Transformer(_args())
    mesh = _mesh()
    model = _fsdp1_over_tp(reference, mesh, use_seq_parallel=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        state = model.state_dict()
    wq = state["layers.0.attention.wq.weight"]
    assert isinstance(wq, DTensor) and wq.device_mesh == mesh["tp"] and wq.placements == (Shard(0),)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        model.load_state_dict(state)
    full = _full_state(model)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(full[name], param.detach(), msg=name)
    # summon_full_params shows the tp DTensors, gathered over dp.
    with FSDP.summon_full_params(model):
        summoned = model.layers[0].attention.wq.weight
        assert isinstance(summoned, DTensor) and summoned.placements == (Shard(0),)
        torch.testing.assert_close(summoned.full_tensor(), reference.layers[0].attention.wq.weight.detach())


@multi_rank(world_size=4)
def test_fsdp1_optimizer_state_dicts() -> None:
    torch.manual_seed(0)
    reference = Transformer(_args())
    mesh = _mesh()
    model = _fsdp1_over_tp(reference, mesh, use_seq_parallel=False)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, labels = _batches(2)
    local = _local_batch(mesh)
    _loss(reference, tokens[0], labels[0]).backward()
    ref_optim.step()
    _loss(model, tokens[0][local], labels[0][local]).backward()
    optim.step()
    optim.zero_grad()
    # Full: every state whole over dp; a tp parameter's state is a DTensor with its layout.
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = FSDP.optim_state_dict(model, optim)
    wq_state = full["state"]["layers.0.attention.wq.weight"]["exp_avg"]
    assert isinstance(wq_state, DTensor) and wq_state.placements == (Shard(0),)
    for name, param in reference.named_parameters():
        for state_name in ("exp_avg", "exp_avg_sq"):
            value = full["state"][name][state_name]
            value = value.full_tensor() if isinstance(value, DTensor) else value
            torch.testing.assert_close(value, ref_optim.state[param][state_name], rtol=1e-4, atol=1e-6, msg=name)
    # Sharded: each rank's pieces; trained one step further and loaded back, the state is the saved one.
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = FSDP.optim_state_dict(model, optim)
    assert isinstance(sharded["state"]["layers.0.attention.wq.weight"]["exp_avg"], ShardedTensor)
    saved = {k: {n: v.clone() for n, v in states.items()} for k, states in optim.state_dict()["state"].items()}
    _loss(model, tokens[1][local], labels[1][local]).backward()
    optim.step()
    optim.zero_grad()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, sharded))
    restored = optim.state_dict()["state"]
    for key, states in saved.items():
        for state_name, value in states.items():
            assert torch.equal(restored[key][state_name], value), (key, state_name)


@multi_rank(world_size=4)
def test_chunk_dtensor_and_all_gather_dtensor_hooks() -> None:
    mesh = _mesh()
    extensions = DTensorExtensions()
    torch.manual_seed(0)
    whole = torch.randn(6, 4)
    for tp_placement in (Shard(0), Shard(1), Replicate()):
        tp_tensor = distribute_tensor(whole, mesh["tp"], [tp_placement])
        with CommDebugMode() as comm:
            chunked = extensions.chunk_dtensor(tp_tensor, dist.get_rank(), mesh["dp"])
        # dp cuts the whole tensor before tp: rows move between tp ranks only when both cut dim 0.
        assert (comm.get_total_counts() == 0) == (tp_placement != Shard(0)), tp_placement
        assert isinstance(chunked, DTensor) and chunked.device_mesh == mesh
        assert chunked.placements == (Shard(0), tp_placement)
        torch.testing.assert_close(chunked.full_tensor(), whole)
        gathered = extensions.all_gather_dtensor(chunked, mesh)
        torch.testing.assert_close(gathered, tp_tensor.to_local())
    plain = extensions.chunk_dtensor(whole, dist.get_rank(), mesh["dp"])
    assert isinstance(plain, DTensor) and plain.placements == (Shard(0), Replicate())
    torch.testing.assert_close(plain.to_local(), whole.chunk(2)[mesh.get_local_rank("dp")])


@multi_rank(world_size=4)
def test_extensions_refuse_what_they_cannot_describe() -> None:
    mesh = _mesh()
    extensions = DTensorExtensions()
    on_2d = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Shard(1)])
    with CommDebugMode() as comm:
        with pytest.raises(ValueError, match="1-D mesh"):
            extensions.pre_flatten_transform(on_2d)
        with pytest.raises(TypeError, match="TensorParallelLayout"):
            extensions.post_unflatten_transform(torch.ones(2), object())
        with pytest.raises(ValueError, match="at least 2 dims"):
            extensions.chunk_dtensor(torch.ones(4), 0, init_device_mesh("cpu", (4,)))
        with pytest.raises(TypeError, match="ShardedTensor"):
            extensions.pre_load_state_dict_transform(torch.ones(4))
        with pytest.raises(TypeError, match="shardwise DTensor"):
            extensions.all_gather_dtensor(torch.ones(4), None)
    assert comm.get_total_counts() == 0
    # A tied DTensor parameter would be flattened twice by FSDP1 (and its copies trained apart).
    _set_fsdp_extensions(extensions)
    tied = Transformer.parallelize(Transformer(_args(weight_tying=True)), mesh["tp"], False)
    assert tied.output.weight is tied.tok_embeddings.weight
    with pytest.raises(ValueError, match="cannot share"):
        FSDP(tied, process_group=mesh["dp"].get_group(), use_orig_params=True, device_id=torch.device("cpu"))
    # Installed with FSDP1's own setter, the extensions reach instances built with process_group=.
    _set_fsdp_extensions(extensions)
    wrapped = FSDP(nn.Linear(4, 4), process_group=mesh["dp"].get_group(), device_id=torch.device("cpu"))
    assert wrapped._fsdp_extension is extensions
