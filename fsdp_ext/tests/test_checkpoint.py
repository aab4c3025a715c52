"""torch.distributed.checkpoint with shardwise DTensors: a checkpoint written with one mesh shape and
placements loads exactly onto another (FSDP x TP 2x2 -> TP of 4 -> FSDP of 4 -> plain tensors)."""

from __future__ import annotations

import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from shardwise.dtensor_ops import DTensor
from shardwise.fsdp_ext import fully_shard
from shardwise.mesh import init_device_mesh
from shardwise.placement import Shard, _StridedShard
from shardwise.testing import ModelArgs, Transformer, multi_rank


def _args() -> ModelArgs:
    return ModelArgs(n_layers=2, vocab_size=16, max_seq_len=8, dim=16, n_heads=4, dropout_p=0.0)


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value.detach()


def _shared_directory() -> str:
    name = [tempfile.mkdtemp(prefix="shardwise_dcp_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    assert name[0] is not None
    return name[0]


@multi_rank(world_size=4)
def test_checkpoint_reshards_on_load_across_mesh_shapes() -> None:
    torch.manual_seed(0)
    source = Transformer(_args())
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    Transformer.parallelize(source, mesh_2d["tp"], True)
    for block in source.layers:
        fully_shard(block, mesh=mesh_2d["dp"])
    fully_shard(source, mesh=mesh_2d["dp"])
    tokens = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(source(tokens).flatten(0, 1), tokens.flatten()).backward()
    torch.optim.AdamW(source.parameters(), lr=1e-2).step()
    assert any(isinstance(p.placements[0], _StridedShard) for p in source.parameters())
    expected = {name: _full(value) for name, value in source.state_dict().items()}
    directory = _shared_directory()
    dcp.save(source.state_dict(), checkpoint_id=directory)

    mesh_1d = init_device_mesh("cpu", (4,))
    torch.manual_seed(5)  # other initial values: the load must overwrite them all
    tp_only = Transformer.parallelize(Transformer(_args()), mesh_1d, True)
    fsdp_only = Transformer(_args())
    for block in fsdp_only.layers:
        fully_shard(block, mesh=mesh_1d)
    fully_shard(fsdp_only, mesh=mesh_1d)
    plain = Transformer(_args())
    for target in (tp_only, fsdp_only, plain):
        state = target.state_dict()
        dcp.load(state, checkpoint_id=directory)
        target.load_state_dict(state)
        for name, value in target.state_dict().items():
            torch.testing.assert_close(_full(value), expected[name], rtol=0, atol=0, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(fsdp_only(tokens), plain(tokens))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory)


def _dim1_of_matrices(param: torch.nn.Parameter) -> Shard | None:
    return Shard(1) if param.ndim == 2 else None


@multi_rank(world_size=4)
def test_checkpoint_from_hsdp_over_tp_and_dim_1_shards_loads_onto_fsdp() -> None:
    torch.manual_seed(0)
    source = Transformer(_args())
    mesh_3d = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    Transformer.parallelize(source, mesh_3d["tp"], True)
    for block in source.layers:
        fully_shard(block, mesh=mesh_3d["replicate", "shard"], shard_placement_fn=_dim1_of_matrices)
    fully_shard(source, mesh=mesh_3d["replicate", "shard"], shard_placement_fn=_dim1_of_matrices)
    assert source.layers[0].attention.wo.weight.device_mesh.ndim == 3
    expected = {name: _full(value) for name, value in source.state_dict().items()}
    directory = _shared_directory()
    dcp.save(source.state_dict(), checkpoint_id=directory)
    mesh_1d = init_device_mesh("cpu", (4,))
    torch.manual_seed(5)
    target = Transformer(_args())
    for block in target.layers:
        fully_shard(block, mesh=mesh_1d)
    fully_shard(target, mesh=mesh_1d)
    state = target.state_dict()
    dcp.load(state, checkpoint_id=directory)
    target.load_state_dict(state)
    for name, value in target.state_dict().items():
        torch.testing.assert_close(_full(value), expected[name], rtol=0, atol=0, msg=name)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory)
