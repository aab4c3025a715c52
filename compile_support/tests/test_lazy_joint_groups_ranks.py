"""Joint process groups made when a redistribution first needs them, eager and under torch.compile.

Here rather than in dtensor_ops/tests: compiling DTensor code needs shardwise.compile_support installed
(its extension hook makes DTensor traceable), which a dtensor_ops test target does not carry.

5 gloo ranks, a 2x2 mesh over 4 of them: the joint group of both dims is then not the world, so it
is really created, by its 4 members only, at the redistribution that needs it (mesh/README.md,
"Group creation: the protocol").
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from shardwise.dtensor_ops import DTensor, Shard, distribute_tensor
from shardwise.mesh import DeviceMesh
from shardwise.testing import multi_rank, priced_by

WORLD = 5


@contextlib.contextmanager
def member_groups_created() -> Iterator[list[list[int]]]:
    """The rank lists of the c10d groups this rank constructs (as a member) while inside."""
    created: list[list[int]] = []
    original = c10d._new_process_group_helper

    def counting(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        global_ranks = args[2]  # (group_size, group_rank, global_ranks_in_group, ...)
        if isinstance(result[0], dist.ProcessGroup):
            created.append(list(global_ranks))
        return result

    c10d._new_process_group_helper = counting
    try:
        yield created
    finally:
        c10d._new_process_group_helper = original


def _columns(mesh: DeviceMesh, full: torch.Tensor) -> torch.Tensor:
    """This rank's (Shard(1), Shard(1)) piece of ``full`` on a 2x2 mesh."""
    a, b = mesh.get_coordinate()  # type: ignore[misc]
    first = 4 * a + 2 * b
    return full[:, first : first + 2]


@multi_rank(world_size=WORLD, timeout=120)
def test_a_redistribution_over_both_dims_creates_their_joint_group_on_its_members_only() -> None:
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", [[4, 3], [2, 1]], mesh_dim_names=("dp", "tp"))
    if rank != 0:
        full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
        source = distribute_tensor(full, mesh, [Shard(0), Shard(0)])
        with priced_by("nccl"), member_groups_created() as created:
            moved = source.redistribute(mesh, [Shard(1), Shard(1)])
        # (S0, S0) -> (S1, S1) is one all-to-all over the joint group, which did not exist before.
        assert created == [[1, 2, 3, 4]]
        assert torch.equal(moved.to_local(), _columns(mesh, full))
        with priced_by("nccl"), member_groups_created() as created:
            again = source.redistribute(mesh, [Shard(1), Shard(1)])
        assert created == [] and torch.equal(again.to_local(), _columns(mesh, full))
    dist.barrier()


def _compiled_redistribution(local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    source = DTensor.from_local(local, mesh, [Shard(0), Shard(0)], run_check=False)
    return source.redistribute(mesh, [Shard(1), Shard(1)]).to_local()


@multi_rank(world_size=WORLD, timeout=240)
def test_a_joint_group_first_needed_inside_torch_compile_is_created_while_tracing() -> None:
    import torch._dynamo

    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))  # rank 4 is outside
    if rank != 4:
        torch._dynamo.reset()
        full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
        a, b = mesh.get_coordinate()  # type: ignore[misc]
        local = full[4 * a + 2 * b : 4 * a + 2 * b + 2]
        compiled = torch.compile(_compiled_redistribution, backend="aot_eager", fullgraph=True)
        with priced_by("nccl"):
            with member_groups_created() as created:
                got = compiled(local, mesh)
            assert created == [[0, 1, 2, 3]]
            with member_groups_created() as created:
                again = compiled(local * 2, mesh)
        assert created == []
        assert torch.equal(got, _columns(mesh, full)) and torch.equal(again, 2 * _columns(mesh, full))
    dist.barrier()
