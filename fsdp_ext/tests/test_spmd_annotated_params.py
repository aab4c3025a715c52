"""fully_shard(dp_mesh_dims=...) on plain parameters annotated with spmd_types' per-mesh-axis types.

The module computes with plain local pieces (torchtitan's default ``spmd_types`` backend): FSDP keeps their
storage as DTensors on the full (dp, tp) mesh, hands the module the annotated plain piece in forward, sums an
``R``-typed parameter's gradient over tp and reduce-scatters over dp. Checked against one process.
"""

from __future__ import annotations

import pytest
import spmd_types as spmd
import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.dtensor_ops import DTensor
from shardwise.fsdp_ext import DataParallelMeshDims, FSDPError, fully_shard
from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.placement import Replicate, Shard, _StridedShard
from shardwise.testing import multi_rank

IN, HIDDEN, BATCH = 6, 8, 4


def _full_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "norm": torch.rand(IN, generator=generator) + 0.5,
        "up": torch.randn(HIDDEN, IN, generator=generator),
        "down": torch.randn(IN, HIDDEN, generator=generator),
    }


def _batches(dp: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(BATCH, IN, generator=generator) for _ in range(dp)]


class _TensorParallelBlock(nn.Module):
    """norm (replicated over tp, its gradient a partial sum: R), up cut by rows, down by columns (V).

    Forward returns this rank's partial sum over tp of the block's output: the sum over tp ranks is the
    whole block, so a loss summed over the ranks is the one process' loss."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        tp_rank = mesh.get_local_rank("tp")
        tp = mesh.size(mesh.mesh_dim_names.index("tp"))  # type: ignore[union-attr]
        full = _full_weights()
        dp_axis = spmd.normalize_axis(mesh.get_group("dp"))
        tp_axis = spmd.normalize_axis(mesh.get_group("tp"))
        self.norm = nn.Parameter(full["norm"].clone())
        self.up = nn.Parameter(full["up"].chunk(tp, 0)[tp_rank].clone())
        self.down = nn.Parameter(full["down"].chunk(tp, 1)[tp_rank].clone())
        spmd.assert_type(self.norm, {dp_axis: spmd.R, tp_axis: spmd.R})
        spmd.assert_type(self.up, {dp_axis: spmd.R, tp_axis: spmd.S(0)})
        spmd.assert_type(self.down, {dp_axis: spmd.R, tp_axis: spmd.S(1)})
        self.seen: list[tuple[type, dict]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for param in (self.norm, self.up, self.down):
            self.seen.append((type(param), spmd.get_local_type(param)))
        return torch.relu((x * self.norm) @ self.up.T) @ self.down.T


def _one_process_grads(dp: int) -> dict[str, torch.Tensor]:
    weights = {name: w.clone().requires_grad_() for name, w in _full_weights().items()}
    loss = sum(
        (torch.relu((x * weights["norm"]) @ weights["up"].T) @ weights["down"].T).square().sum() for x in _batches(dp)
    )
    # FSDP averages over the dp ranks by default; each rank's loss is its batch's.
    (loss / dp).backward()  # type: ignore[union-attr]
    return {name: w.grad for name, w in weights.items()}  # type: ignore[misc]


@multi_rank(world_size=4)
def test_annotated_plain_params_train_like_one_process() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    block = _TensorParallelBlock(mesh)
    original_types = {name: spmd.get_local_type(p) for name, p in block.named_parameters()}
    fully_shard(block, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))

    # Storage: DTensors on the full mesh, FSDP's dim-0 cut nested inside TP's where both cut dim 0.
    assert all(isinstance(p, DTensor) and p.device_mesh == mesh for p in block.parameters())
    assert tuple(block.up.placements) == (_StridedShard(0, split_factor=2), Shard(0))
    assert tuple(block.down.placements) == (Shard(0), Shard(1))
    assert tuple(block.norm.placements) == (Shard(0), Replicate())
    full = _full_weights()
    for name, param in block.named_parameters():
        torch.testing.assert_close(param.full_tensor(), full[name])

    x = _batches(2)[mesh.get_local_rank("dp")]
    partial = block(x)
    # Each tp rank's output is a partial sum: the loss of the whole output is summed over tp first.
    output = partial.detach().clone()
    dist.all_reduce(output, group=mesh.get_group("tp"))
    # d(sum(out^2))/d(partial) = 2 * out on every tp rank: backward through the local piece.
    partial.backward(2 * output)

    # Compute saw plain pieces with the annotations it declared.
    assert len(block.seen) == 3 and not any(issubclass(kind, DTensor) for kind, _ in block.seen)
    assert [types for _, types in block.seen] == list(original_types.values())
    expected = _one_process_grads(2)
    for name, param in block.named_parameters():
        assert isinstance(param.grad, DTensor) and param.grad.placements == param.placements, name
        torch.testing.assert_close(param.grad.full_tensor(), expected[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("case", ["unannotated", "partial", "varying_without_dim"])
@multi_rank(world_size=4)
def test_annotations_that_are_no_layout_are_refused_before_any_collective(case: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_axis = spmd.normalize_axis(mesh.get_group("dp"))
    tp_axis = spmd.normalize_axis(mesh.get_group("tp"))
    module = nn.Linear(IN, HIDDEN, bias=False)
    if case == "partial":
        spmd.assert_type(module.weight, {dp_axis: spmd.R, tp_axis: spmd.P})
        match = "'tp' is P; expected R, I or V"
    elif case == "varying_without_dim":
        spmd.assert_type(module.weight, {dp_axis: spmd.R, tp_axis: spmd.V})
        match = "'tp' is V but the partition spec names it nowhere"
    else:
        match = "plain tensor without annotation for 'weight'"
    with pytest.raises(FSDPError, match=match):
        fully_shard(module, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    assert type(module.weight) is nn.Parameter and not isinstance(module.weight, DTensor)
