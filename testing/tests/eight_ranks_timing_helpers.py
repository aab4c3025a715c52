"""The same 8-rank class three ways: rank processes, rank threads, LocalTensorMode (a timing, not a test target).

Run one variant at a time from the repository root (see testing/README.md, "Local-tensor variants"):

    python -m pytest -q --durations=0 testing/tests/eight_ranks_timing_helpers.py -k EightRanksWithLocalTensor
    python -m pytest -q --durations=0 testing/tests/eight_ranks_timing_helpers.py -k EightRanksOnThreads
    python -m pytest -q --durations=0 testing/tests/eight_ranks_timing_helpers.py -k "EightRanks and not With and not On"
"""
import torch
from shardwise.dtensor_ops import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.testing import DTensorTestBase, ThreadedLocalDTensorTestBase, create_local_tensor_test_class, with_comms


class EightRanks(DTensorTestBase):
    @property
    def world_size(self):
        return 8

    @with_comms
    def test_shard_round_trips(self):
        mesh = init_device_mesh("cpu", (8,))
        full = torch.arange(99.0).reshape(11, 9)
        for source, target in ((Shard(0), Replicate()), (Shard(0), Shard(1)), (Shard(1), Shard(0))):
            moved = distribute_tensor(full, mesh, [source]).redistribute(mesh, [target])
            self.assertEqual(moved.full_tensor(), full)

    @with_comms
    def test_two_by_four_matmul(self):
        mesh = init_device_mesh("cpu", (2, 4))
        a_full = torch.arange(66.0).reshape(11, 6) / 10
        b_full = torch.arange(30.0).reshape(6, 5) / 10
        product = distribute_tensor(a_full, mesh, [Shard(0), Shard(1)]) @ distribute_tensor(b_full, mesh, [Replicate(), Shard(0)])
        self.assertEqual(product.full_tensor(), a_full @ b_full)
        self.assertEqual(product.redistribute(mesh, [Shard(1), Shard(1)]).full_tensor(), a_full @ b_full)

    @with_comms
    def test_partial_reductions(self):
        mesh = init_device_mesh("cpu", (2, 4))
        full = torch.arange(40.0).reshape(8, 5)
        for placements in ([Partial(), Shard(0)], [Shard(1), Partial()], [Partial(), Partial()]):
            self.assertEqual(distribute_tensor(full, mesh, placements).full_tensor(), full)

    @with_comms
    def test_linear_backward(self):
        mesh = init_device_mesh("cpu", (8,))
        x = distribute_tensor(torch.arange(48.0).reshape(16, 3) / 10, mesh, [Shard(0)]).requires_grad_()
        w = distribute_tensor(torch.ones(4, 3), mesh, [Replicate()]).requires_grad_()
        torch.nn.functional.linear(x, w).sum().backward()
        self.assertEqual(w.grad.full_tensor(), torch.full((4, 3), 1.0) * (torch.arange(48.0).reshape(16, 3) / 10).sum(0))


EightRanksWithLocalTensor = create_local_tensor_test_class(EightRanks)
EightRanksOnThreads = create_local_tensor_test_class(EightRanks, base_class=ThreadedLocalDTensorTestBase)
