"""List ops whose elements live on different meshes (expert parameters beside dense ones in one optimizer)."""

from __future__ import annotations

import pytest
import torch

from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh import MeshError, init_device_mesh
from shardwise.testing import multi_rank


def _full(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("optimizer_kind", ["fused", "foreach"])
@multi_rank(world_size=4)
def test_one_optimizer_over_parameters_on_two_meshes_matches_plain_torch(optimizer_kind: str) -> None:
    dense_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    expert_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    full = [_full(0, 8, 3), _full(1, 4, 6), _full(2, 5)]
    grads = [_full(10, 8, 3), _full(11, 4, 6), _full(12, 5)]
    layouts = [(dense_mesh, [Shard(0)]), (expert_mesh, [Shard(1), Shard(0)]), (dense_mesh, [Replicate()])]
    params = [
        torch.nn.Parameter(distribute_tensor(value, mesh, placements)) for value, (mesh, placements) in zip(full, layouts)
    ]
    for param, grad, (mesh, placements) in zip(params, grads, layouts):
        param.grad = distribute_tensor(grad, mesh, placements)
    reference = [torch.nn.Parameter(value.clone()) for value in full]
    for param, grad in zip(reference, grads):
        param.grad = grad.clone()
    options = {"fused": True} if optimizer_kind == "fused" else {"foreach": True}
    optimizer = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01, **options)  # type: ignore[arg-type]
    expected = torch.optim.AdamW(reference, lr=0.1, weight_decay=0.01)
    with CommDebugMode() as comm:
        for _ in range(2):
            optimizer.step()
            expected.step()
    assert comm.get_total_counts() == 0  # each element steps on its own shards
    for index, (param, want) in enumerate(zip(params, reference)):
        assert isinstance(param, DTensor) and param.placements == tuple(layouts[index][1])
        torch.testing.assert_close(param.full_tensor(), want.detach(), msg=f"parameter {index}")


@multi_rank(world_size=4)
def test_foreach_ops_across_meshes_keep_each_elements_layout() -> None:
    mesh_a = init_device_mesh("cpu", (4,))
    mesh_b = init_device_mesh("cpu", (2, 2))
    xs = [distribute_tensor(_full(0, 8), mesh_a, [Shard(0)]), distribute_tensor(_full(1, 4, 2), mesh_b, [Shard(0), Shard(1)])]
    ys = [distribute_tensor(_full(2, 8), mesh_a, [Shard(0)]), distribute_tensor(_full(3, 4, 2), mesh_b, [Shard(0), Shard(1)])]
    sums = torch._foreach_add(xs, ys, alpha=2.0)
    for out, x, y in zip(sums, xs, ys):
        assert isinstance(out, DTensor) and out.device_mesh == x.device_mesh and out.placements == x.placements
        torch.testing.assert_close(out.full_tensor(), x.full_tensor() + 2.0 * y.full_tensor())
    torch._foreach_mul_(xs, 3.0)
    torch.testing.assert_close(xs[1].full_tensor(), 3.0 * _full(1, 4, 2))
    norms = torch._foreach_norm(xs)
    torch.testing.assert_close(norms[0].full_tensor(), (3.0 * _full(0, 8)).norm())


@multi_rank(world_size=4)
def test_elements_at_one_index_on_two_meshes_are_refused() -> None:
    mesh_a = init_device_mesh("cpu", (4,))
    mesh_b = init_device_mesh("cpu", (2, 2))
    xs = [distribute_tensor(_full(0, 8), mesh_a, [Shard(0)]), distribute_tensor(_full(1, 4), mesh_b, [Shard(0), Replicate()])]
    ys = [distribute_tensor(_full(2, 4), mesh_b, [Shard(0), Replicate()]), distribute_tensor(_full(3, 4), mesh_b, [Shard(0), Replicate()])]
    with pytest.raises(MeshError, match="element 0 of its lists"):
        torch._foreach_add(xs, ys)
