# Test classes written the way PyTorch's own DTensor tests are written, against
# torch.testing._internal.distributed._tensor.common_dtensor, then ported to shardwise by
# swapping the imports below (and nothing else). The PyTorch spelling of each import is
# given next to it; with those imports the file runs on PyTorch's DTensor too.

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize, run_tests

# from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.dtensor_ops import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh

# from torch.distributed.tensor.debug import CommDebugMode
from shardwise.dtensor_ops.debug import CommDebugMode

# from torch.distributed.tensor.experimental import local_map
from shardwise.dtensor_ops.experimental import local_map

# from torch.testing._internal.distributed._tensor.common_dtensor import (
from shardwise.testing import (
    DTensorContinuousTestBase,
    DTensorConverter,
    DTensorOpTestBase,
    DTensorTestBase,
    create_local_tensor_test_class,
    map_local_for_rank,
    skip_unless_torch_gpu,
    with_comms,
)

funcol = torch.ops.c10d_functional


class RedistributeAndOpsTest(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 4

    @with_comms
    def test_shard_to_replicate_all_gathers_once(self):
        mesh = self.build_device_mesh()
        full = torch.arange(12.0).reshape(12, 1) * torch.ones(12, 3)
        sharded = distribute_tensor(full, mesh, [Shard(0)])
        self.assertEqual(sharded.placements, [Shard(0)])
        expected_rows = map_local_for_rank(self.rank, lambda rank: full[3 * rank : 3 * rank + 3])
        self.assertEqual(sharded.to_local(), expected_rows)
        with CommDebugMode() as comm_mode:
            replicated = sharded.redistribute(mesh, [Replicate()])
        self.assertEqual(comm_mode.get_total_counts(), 1)
        self.assertEqual(comm_mode.get_comm_counts()[funcol.all_gather_into_tensor], 1)
        self.assertEqual(replicated.to_local(), full)

    @with_comms
    def test_partial_to_replicate_sums(self):
        mesh = self.build_device_mesh()
        local = torch.ones(2, 2) * (self.rank + 1)
        partial = DTensor.from_local(local, mesh, [Partial()])
        with CommDebugMode() as comm_mode:
            full = partial.full_tensor()
        self.assertEqual(comm_mode.get_comm_counts()[funcol.all_reduce], 1)
        self.assertEqual(full, torch.full((2, 2), 10.0))

    @with_comms
    def test_linear_on_row_shards_keeps_rows_sharded(self):
        mesh = self.build_device_mesh()
        x_full = torch.arange(24.0).reshape(8, 3) / 10
        weight_full = torch.arange(15.0).reshape(5, 3) / 10
        x = distribute_tensor(x_full, mesh, [Shard(0)])
        weight = distribute_tensor(weight_full, mesh, [Replicate()])
        with CommDebugMode() as comm_mode:
            out = F.linear(x, weight)
        self.assertEqual(comm_mode.get_total_counts(), 0)
        self.assertEqual(out.placements, (Shard(0),))
        self.assertEqual(out.full_tensor(), F.linear(x_full, weight_full))

    @with_comms
    def test_local_map_runs_on_local_shards(self):
        mesh = self.build_device_mesh()

        def double(t):
            return t * 2

        mapped = local_map(double, out_placements=[Shard(0)], in_placements=([Shard(0)],), device_mesh=mesh)
        x = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
        self.assertEqual(mapped(x).full_tensor(), torch.arange(8.0) * 2)

    @parametrize("placement", [Shard(0), Shard(1), Replicate()])
    @with_comms
    def test_sum_over_every_layout(self, placement):
        mesh = self.build_device_mesh()
        full = torch.arange(32.0).reshape(8, 4)
        dtensor = distribute_tensor(full, mesh, [placement])
        self.assertEqual(dtensor.sum().full_tensor(), full.sum())
        self.assertEqual(dtensor.sum(dim=0).full_tensor(), full.sum(dim=0))

    @skip_unless_torch_gpu
    @with_comms
    def test_needs_gpus(self):
        self.assertEqual(self.device_type, "cuda")


instantiate_parametrized_tests(RedistributeAndOpsTest)


class SubtestsTest(DTensorTestBase):
    @with_comms
    def test_redistribute_round_trips(self):
        mesh = init_device_mesh(self.device_type, (2, 2))
        self.run_subtests(
            {
                "source": [[Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Replicate()]],
                "target": [[Replicate(), Replicate()], [Shard(1), Shard(0)]],
            },
            self._round_trip,
            mesh,
        )

    def _round_trip(self, mesh, source, target):
        full = torch.arange(64.0).reshape(8, 8)
        moved = distribute_tensor(full, mesh, source).redistribute(mesh, target)
        self.assertEqual(moved.placements, target)
        self.assertEqual(moved.full_tensor(), full)


class ContinuousRedistributeTest(DTensorContinuousTestBase):
    world_size = 4

    def test_shard_to_shard_is_one_all_to_all(self):
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        full = torch.arange(64.0).reshape(8, 8)
        rows = distribute_tensor(full, mesh, [Shard(0)])
        with CommDebugMode() as comm_mode:
            columns = rows.redistribute(mesh, [Shard(1)])
        self.assertEqual(comm_mode.get_total_counts(), 1)
        self.assertEqual(columns.full_tensor(), full)

    def test_backward_through_redistribute(self):
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        x = distribute_tensor(torch.ones(8, 2), mesh, [Shard(0)]).requires_grad_()
        x.redistribute(mesh, [Replicate()]).to_local().sum().backward()
        self.assertEqual(x.grad.placements, (Shard(0),))
        self.assertEqual(x.grad.full_tensor(), torch.ones(8, 2))


class PointwiseOpsTest(DTensorOpTestBase):
    @property
    def world_size(self) -> int:
        return 4

    def test_mul_on_every_sharding(self):
        mesh = self.build_device_mesh()
        a = torch.arange(16.0).reshape(4, 4)
        b = torch.arange(4.0) + 1
        expected = torch.mul(a, b)
        converter = DTensorConverter(mesh, (a, b), {})
        for d_args, d_kwargs in converter:
            self.assertTrue(converter.successful())
            self.assertEqual(torch.mul(*d_args, **d_kwargs).full_tensor(), expected)

    def test_all_reduce_across_ranks(self):
        t = torch.ones(1) * self.rank
        dist.all_reduce(t)
        self.assertEqual(t, torch.tensor([6.0]))


# Every rank simulated in this process under LocalTensorMode (as PyTorch's).
RedistributeAndOpsTestWithLocalTensor = create_local_tensor_test_class(
    RedistributeAndOpsTest, skipped_tests=["test_needs_gpus"]
)


if __name__ == "__main__":
    run_tests()
