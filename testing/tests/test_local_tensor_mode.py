"""shardwise's DTensor under torch's LocalTensorMode: every rank simulated in the test process.

Each test compares every simulated rank's piece with plain torch on the full tensor (computed
with the mode disabled), and checks that the ranks really were simulated: local tensors are
``LocalTensor``s holding one piece per rank, each rank's piece being that rank's shard.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensor

import shardwise.dtensor_ops as dtensor_ops
from shardwise.dtensor_ops import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from shardwise.placement import _MaskPartial
from shardwise.dtensor_ops.debug import CommDebugMode
from shardwise.mesh._simulation import mode_disabled
from shardwise.testing import (
    DTensorContinuousTestBase,
    DTensorConverter,
    DTensorOpTestBase,
    DTensorTestBase,
    LocalDTensorContinuousTestBase,
    LocalDTensorOpTestBase,
    LocalDTensorTestBase,
    MLPModule,
    ThreadedLocalDTensorTestBase,
    create_local_tensor_test_class,
    map_local_for_rank,
    priced_by,
    with_comms,
)
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize


funcol = torch.ops.c10d_functional  # CommDebugMode counts under these keys, as PyTorch's


def pieces(tensor: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each simulated rank's tensor (a LocalTensor's pieces)."""
    assert isinstance(tensor, LocalTensor), f"expected a LocalTensor (one piece per simulated rank), got {type(tensor)}"
    return dict(tensor._local_tensors)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor every simulated rank holds alike, as one plain tensor (``torch.tensor`` data stays plain)."""
    return tensor.reconcile() if isinstance(tensor, LocalTensor) else tensor


def plain(function: Any, *args: Any) -> Any:
    """``function(*args)`` on plain tensors, outside the mode (the reference)."""
    with mode_disabled():
        return function(*args)


class _Checks(LocalDTensorTestBase):
    def assert_every_rank_equals(self, tensor: torch.Tensor, expected: torch.Tensor) -> None:
        by_rank = pieces(tensor)
        self.assertEqual(sorted(by_rank), list(range(self.world_size)))
        for rank, piece in by_rank.items():
            torch.testing.assert_close(piece, expected, msg=lambda m, rank=rank: f"simulated rank {rank}: {m}")

    def assert_shards(self, dtensor: DTensor, full: torch.Tensor, dim: int) -> None:
        """Rank r holds torch.chunk piece r of ``full`` along ``dim`` (empty past the last chunk)."""
        chunks = plain(lambda: full.chunk(self.world_size, dim))
        for rank, piece in pieces(dtensor.to_local()).items():
            expected = chunks[rank] if rank < len(chunks) else plain(lambda: full.narrow(dim, 0, 0))
            torch.testing.assert_close(piece, expected, msg=lambda m, rank=rank: f"simulated rank {rank}: {m}")


class SimulatedRanksTest(_Checks):
    @property
    def world_size(self) -> int:
        return 4

    @with_comms
    def test_mesh_reports_each_simulated_rank(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with self._get_local_tensor_mode():
            coordinate = mesh.get_coordinate()
            self.assertEqual([c.node._local_ints for c in coordinate], [{0: 0, 1: 0, 2: 1, 3: 1}, {0: 0, 1: 1, 2: 0, 3: 1}])
            self.assertEqual(mesh.get_rank().node._local_ints, {0: 0, 1: 1, 2: 2, 3: 3})
            self.assertEqual(mesh["tp"].get_local_rank().node._local_ints, {0: 0, 1: 1, 2: 0, 3: 1})
        # Outside the mode the process is rank 0 of the fake world.
        self.assertEqual(mesh.get_coordinate(), (0, 0))

    @with_comms
    def test_assert_equal_on_rank_reads_that_ranks_values(self) -> None:
        with self._get_local_tensor_mode() as mode:
            per_rank = mode.rank_map(lambda rank: torch.full((2,), float(rank)))
            self.assertEqualOnRank(per_rank, torch.full((2,), 2.0), rank=2)
            self.assertNotEqualOnRank(per_rank, torch.full((2,), 2.0), rank=1)
            with self.assertRaises(AssertionError):
                self.assertEqualOnRank(per_rank, torch.full((2,), 2.0), rank=1)

    @with_comms
    def test_sharded_linear_matches_torch_without_communication(self) -> None:
        mesh = self.build_device_mesh()
        with self._get_local_tensor_mode():
            x_full = torch.arange(30.0).reshape(10, 3) / 7
            weight_full = torch.arange(15.0).reshape(5, 3) / 5
            x = distribute_tensor(x_full, mesh, [Shard(0)])
            weight = distribute_tensor(weight_full, mesh, [Replicate()])
            with CommDebugMode() as comm_mode:
                out = F.linear(x, weight)
            self.assertEqual(comm_mode.get_total_counts(), 0)
            self.assertEqual(out.placements, (Shard(0),))
            expected = plain(F.linear, x_full.reconcile(), weight_full.reconcile())
            self.assert_shards(out, expected, 0)
            self.assert_every_rank_equals(out.full_tensor(), expected)

    @with_comms
    def test_shard_to_replicate_uneven(self) -> None:
        mesh = self.build_device_mesh()
        with self._get_local_tensor_mode():
            for rows in (8, 6, 3):
                full = torch.arange(rows * 2.0).reshape(rows, 2)
                sharded = distribute_tensor(full, mesh, [Shard(0)])
                self.assert_shards(sharded, full.reconcile(), 0)
                with CommDebugMode() as comm_mode:
                    replicated = sharded.redistribute(mesh, [Replicate()])
                self.assertEqual(comm_mode.get_comm_counts(), {funcol.all_gather_into_tensor: 1})
                self.assert_every_rank_equals(replicated.to_local(), full.reconcile())

    @with_comms
    def test_partial_to_shard_reduce_scatters(self) -> None:
        mesh = self.build_device_mesh()
        with self._get_local_tensor_mode() as mode:
            contributions = mode.rank_map(lambda rank: torch.arange(14.0).reshape(7, 2) * (rank + 1))
            partial = DTensor.from_local(contributions, mesh, [Partial()])
            with CommDebugMode() as comm_mode:
                sharded = partial.redistribute(mesh, [Shard(0)])
            self.assertEqual(comm_mode.get_comm_counts(), {funcol.reduce_scatter_tensor: 1})
            self.assert_shards(sharded, plain(lambda: torch.arange(14.0).reshape(7, 2) * 10), 0)

    @with_comms
    def test_shard0_to_shard1_is_one_all_to_all(self) -> None:
        mesh = self.build_device_mesh()
        with self._get_local_tensor_mode():
            full = torch.arange(35.0).reshape(7, 5)
            rows = distribute_tensor(full, mesh, [Shard(0)])
            with CommDebugMode() as comm_mode:
                columns = rows.redistribute(mesh, [Shard(1)])
            self.assertEqual(comm_mode.get_comm_counts(), {funcol.all_to_all_single: 1})
            self.assert_shards(columns, full.reconcile(), 1)
            self.assert_every_rank_equals(columns.full_tensor(), full.reconcile())

    @with_comms
    def test_two_dim_mesh_redistributions(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        with self._get_local_tensor_mode():
            full = torch.arange(45.0).reshape(9, 5)
            expected = full.reconcile()
            for source, target in (
                ([Shard(0), Shard(1)], [Shard(1), Shard(0)]),
                ([Shard(0), Shard(0)], [Replicate(), Shard(1)]),
                ([Partial(), Shard(1)], [Shard(0), Replicate()]),
                ([Replicate(), Partial("max")], [Shard(1), Shard(0)]),
                ([Partial(), Partial("max")], [Shard(0), Shard(0)]),
                ([Shard(0), Partial()], [Shard(1), Shard(1)]),
            ):
                moved = distribute_tensor(full, mesh, source).redistribute(mesh, target)
                self.assertEqual(moved.placements, tuple(target))
                self.assert_every_rank_equals(moved.full_tensor(), expected)

    @with_comms
    def test_from_local_run_check_infers_uneven_shape(self) -> None:
        mesh = self.build_device_mesh()
        with self._get_local_tensor_mode() as mode:
            local = mode.rank_map(lambda rank: torch.full((3 if rank < 3 else 1, 2), float(rank)))
            dtensor = DTensor.from_local(local, mesh, [Shard(0)], run_check=True)
            self.assertEqual(tuple(dtensor.shape), (10, 2))
            expected = plain(lambda: torch.cat([torch.full((3 if r < 3 else 1, 2), float(r)) for r in range(4)]))
            self.assert_every_rank_equals(dtensor.full_tensor(), expected)
            wrong = mode.rank_map(lambda rank: torch.zeros(2 if rank == 2 else 3, 2))
            with self.assertRaisesRegex(ValueError, "mesh coordinate \\(2,\\)"):
                DTensor.from_local(wrong, mesh, [Shard(0)], shape=(12, 2), stride=(2, 1))

    @with_comms
    def test_from_local_run_check_broadcasts_replicas_from_the_first_rank(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        with self._get_local_tensor_mode() as mode:
            local = mode.rank_map(lambda rank: torch.full((2,), float(rank)))
            with CommDebugMode() as comm_mode:
                dtensor = DTensor.from_local(local, mesh, [Shard(0), Replicate()], run_check=True)
            self.assertEqual(comm_mode.get_comm_counts(), {funcol.broadcast: 1})
            # Along mesh dim 1 every rank takes the value of index 0 there: ranks 0 and 2.
            by_rank = pieces(dtensor.to_local())
            self.assertEqual({rank: piece.tolist() for rank, piece in by_rank.items()}, {0: [0.0, 0.0], 1: [0.0, 0.0], 2: [2.0, 2.0], 3: [2.0, 2.0]})

    @with_comms
    def test_joint_all_to_all_and_sub_meshes(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with self._get_local_tensor_mode():
            full = torch.arange(64.0).reshape(8, 8)
            expected = whole(full)
            nested = distribute_tensor(full, mesh, [Shard(0), Shard(0)])
            with priced_by("nccl"), CommDebugMode() as comm_mode:
                moved = nested.redistribute(mesh, [Shard(1), Shard(1)])
            self.assertEqual(comm_mode.get_comm_counts(), {funcol.all_to_all_single: 1})
            self.assert_every_rank_equals(moved.full_tensor(), expected)
            for name in ("dp", "tp"):
                rows = distribute_tensor(full, mesh[name], [Shard(0)])
                self.assert_every_rank_equals(rows.redistribute(mesh[name], [Shard(1)]).full_tensor(), expected)

    @with_comms
    def test_tensor_parallel_mlp_forward_and_backward(self) -> None:
        from shardwise.tp_styles import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.build_device_mesh()
        torch.manual_seed(3)
        reference = MLPModule("cpu")
        model = copy.deepcopy(reference)
        inputs = torch.randn(5, 10)
        reference(inputs).sum().backward()
        with self._get_local_tensor_mode():
            parallelize_module(model, mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()})
            with CommDebugMode() as comm_mode:
                output = model(inputs)
            self.assertEqual(comm_mode.get_comm_counts(), {funcol.all_reduce: 1})
            self.assert_every_rank_equals(output, plain(reference, inputs))
            output.sum().backward()
            for name in ("net1.weight", "net1.bias", "net2.weight", "net2.bias"):
                grad = model.get_parameter(name).grad
                self.assert_every_rank_equals(grad.full_tensor(), reference.get_parameter(name).grad)

    @with_comms
    def test_random_ops_draw_per_shard(self) -> None:
        mesh = self.build_device_mesh()
        with self._get_local_tensor_mode():
            torch.manual_seed(5)
            values = dtensor_ops.rand(8, 3, device_mesh=mesh, placements=[Shard(0)]).full_tensor()
            by_rank = pieces(values)
            for piece in by_rank.values():
                torch.testing.assert_close(piece, by_rank[0])
            shards = by_rank[0].chunk(4)
            self.assertEqual(len({tuple(shard.flatten().tolist()) for shard in shards}), 4)
            kept = F.dropout(distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)]), 0.5).full_tensor()
            by_rank = pieces(kept)
            for piece in by_rank.values():
                torch.testing.assert_close(piece, by_rank[0])
            self.assertTrue(set(by_rank[0].unique().tolist()) <= {0.0, 2.0})
            replicated = F.dropout(distribute_tensor(torch.ones(6, 4), mesh, [Replicate()]), 0.5).to_local()
            by_rank = pieces(replicated)
            for piece in by_rank.values():
                torch.testing.assert_close(piece, by_rank[0])

    @with_comms
    def test_random_decision_made_with_the_mode_off_is_refused_under_it(self) -> None:
        mesh = self.build_device_mesh()
        # With the mode off the process is rank 0 of the fake world: its decision holds rank 0's stream.
        F.dropout(DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)]), 0.5)
        with self._get_local_tensor_mode():
            rows = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)])
            with self.assertRaisesRegex(RuntimeError, "decision made with the mode off"):
                F.dropout(rows, 0.5)

    @with_comms
    def test_factories_allocate_each_ranks_shard(self) -> None:
        mesh = self.build_device_mesh()
        with self._get_local_tensor_mode():
            ones = dtensor_ops.ones(9, 2, device_mesh=mesh, placements=[Shard(0)])
            self.assertEqual({rank: tuple(p.shape) for rank, p in pieces(ones.to_local()).items()}, {0: (3, 2), 1: (3, 2), 2: (3, 2), 3: (0, 2)})
            summed = dtensor_ops.full((2, 2), 3.0, device_mesh=mesh, placements=[Partial()])
            self.assert_every_rank_equals(summed.full_tensor(), plain(lambda: torch.full((2, 2), 3.0)))


class CoordinateDependentKernelsTest(_Checks):
    """Decisions whose local kernel depends on the coordinate get one kernel per simulated rank."""

    @property
    def world_size(self) -> int:
        return 4

    @with_comms
    def test_row_sharded_embedding_lookup(self) -> None:
        mesh = self.build_device_mesh()
        with self._get_local_tensor_mode():
            table = torch.arange(40.0).reshape(10, 4)
            ids = torch.tensor([[0, 9, 3], [7, 4, 4]])
            rows = distribute_tensor(table, mesh, [Shard(0)])
            looked_up = F.embedding(distribute_tensor(ids, mesh, [Replicate()]), rows)
            # the rows held elsewhere are zeros: a pending sum, under PyTorch's name
            self.assertEqual(looked_up.placements, (_MaskPartial(offset_shape=torch.Size([10, 4]), offset_dim=0),))
            self.assert_every_rank_equals(looked_up.full_tensor(), plain(F.embedding, whole(ids), whole(table)))

    @with_comms
    def test_masked_fill_of_partial_values_fills_once(self) -> None:
        mesh = self.build_device_mesh()
        with self._get_local_tensor_mode() as mode:
            partial = DTensor.from_local(mode.rank_map(lambda rank: torch.full((2, 3), float(rank))), mesh, [Partial()])
            mask = torch.tensor([[True, False, True], [False, False, True]])
            filled = partial.masked_fill(distribute_tensor(mask, mesh, [Replicate()]), 5.0)
            self.assertEqual(filled.placements, (Partial(),))
            expected = plain(lambda: torch.full((2, 3), 6.0).masked_fill(whole(mask), 5.0))
            self.assert_every_rank_equals(filled.full_tensor(), expected)

    @with_comms
    def test_sequence_parallel_transformer_forward_and_backward(self) -> None:
        from shardwise.testing import ModelArgs, Transformer

        mesh = self.build_device_mesh()
        torch.manual_seed(0)
        args = ModelArgs(n_layers=1, vocab_size=16, max_seq_len=8, dim=8, n_heads=4, dropout_p=0.0)
        reference = Transformer(args)
        model = copy.deepcopy(reference)
        tokens = torch.randint(0, 16, (2, 8))
        expected = reference(tokens)
        expected.sum().backward()
        with self._get_local_tensor_mode():
            model = Transformer.parallelize(model, mesh, use_seq_parallel=True)
            output = model(tokens)
            self.assert_every_rank_equals(output, expected.detach())
            output.sum().backward()
            for name, parameter in reference.named_parameters():
                grad = model.get_parameter(name).grad
                got = grad.full_tensor() if isinstance(grad, DTensor) else grad
                self.assert_every_rank_equals(got, parameter.grad)

    @with_comms
    def test_spatially_sharded_convolution_exchanges_halos(self) -> None:
        mesh = self.build_device_mesh()
        torch.manual_seed(0)
        image, weight, bias = torch.randn(1, 2, 10, 7), torch.randn(3, 2, 3, 3), torch.randn(3)
        with self._get_local_tensor_mode():
            for options in ({"padding": 1}, {"stride": 2, "padding": 2, "dilation": 2}):
                rows = distribute_tensor(image, mesh, [Shard(2)])
                with CommDebugMode() as comm_mode:
                    out = F.conv2d(
                        rows, distribute_tensor(weight, mesh, [Replicate()]), distribute_tensor(bias, mesh, [Replicate()]), **options
                    )
                self.assertEqual(comm_mode.get_comm_counts(), {funcol.all_to_all_single: 1})
                self.assertEqual(out.placements, (Shard(2),))
                expected = plain(lambda: F.conv2d(image, weight, bias, **options))
                self.assert_shards(out, expected, 2)

    @with_comms
    def test_view_of_uneven_shards_takes_each_ranks_local_size(self) -> None:
        mesh = self.build_device_mesh()
        with self._get_local_tensor_mode():
            full = torch.arange(42.0).reshape(7, 6)
            viewed = distribute_tensor(full, mesh, [Shard(0)]).view(7, 2, 3)
            self.assertEqual(viewed.placements, (Shard(0),))
            expected = plain(lambda: torch.arange(42.0).reshape(7, 2, 3))
            self.assert_shards(viewed, expected, 0)
            self.assert_every_rank_equals(viewed.full_tensor(), expected)

    @with_comms
    def test_semi_private_local_shape_is_per_rank(self) -> None:
        from shardwise.dtensor_ops._utils import compute_local_shape_and_global_offset

        mesh = self.build_device_mesh()
        with self._get_local_tensor_mode():
            shape, offset = compute_local_shape_and_global_offset((10, 3), mesh, [Shard(0)])
            self.assertEqual((shape[0].node._local_ints, shape[1]), ({0: 3, 1: 3, 2: 3, 3: 1}, 3))
            self.assertEqual((offset[0].node._local_ints, offset[1]), ({0: 0, 1: 3, 2: 6, 3: 9}, 0))
            # The placement's own layout math, given the mesh's per-rank coordinate or rank.
            spec_shape, spec_offset = distribute_tensor(torch.ones(10, 3), mesh, [Shard(0)])._spec.local_shape_and_offset()
            self.assertEqual(spec_shape[0].node._local_ints, {0: 3, 1: 3, 2: 3, 3: 1})
            self.assertEqual(spec_offset[0].node._local_ints, {0: 0, 1: 3, 2: 6, 3: 9})
            size, start = Shard.local_shard_size_and_offset(10, 4, mesh.get_local_rank())
            self.assertEqual((size.node._local_ints, start.node._local_ints), ({0: 3, 1: 3, 2: 3, 3: 1}, {0: 0, 1: 3, 2: 6, 3: 9}))


class StridedLayoutsTest(LocalDTensorTestBase):
    @property
    def world_size(self) -> int:
        return 4

    @with_comms
    def test_fsdp_over_tp_layout_gathers_exactly(self) -> None:
        from shardwise.placement import _StridedShard

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with self._get_local_tensor_mode():
            full = torch.arange(20.0).reshape(10, 2)
            expected = full.reconcile()
            strided = distribute_tensor(full, mesh, [_StridedShard(0, split_factor=2), Shard(0)])
            for target in ([Replicate(), Replicate()], [Replicate(), Shard(0)], [Shard(1), Shard(0)]):
                moved = strided.redistribute(mesh, target)
                self.assertEqual(moved.placements, tuple(target))
                for rank, piece in pieces(moved.full_tensor()).items():
                    torch.testing.assert_close(piece, expected, msg=lambda m, rank=rank: f"simulated rank {rank}: {m}")

    @with_comms
    def test_flattening_view_of_column_shards(self) -> None:
        from shardwise.placement import _StridedShard

        mesh = self.build_device_mesh()
        with self._get_local_tensor_mode():
            full = torch.arange(32.0).reshape(8, 4)
            flat = distribute_tensor(full, mesh, [Shard(1)]).reshape(32)
            self.assertIsInstance(flat.placements[0], _StridedShard)
            expected = plain(lambda: torch.arange(32.0))
            for rank, piece in pieces(flat.full_tensor()).items():
                torch.testing.assert_close(piece, expected, msg=lambda m, rank=rank: f"simulated rank {rank}: {m}")


class EightRanksTest(LocalDTensorOpTestBase):
    @property
    def world_size(self) -> int:
        return 8

    def test_two_by_four_mesh_matches_torch(self) -> None:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        with self._get_local_tensor_mode():
            a_full = torch.arange(66.0).reshape(11, 6) / 10
            b_full = torch.arange(30.0).reshape(6, 5) / 10
            a = distribute_tensor(a_full, mesh, [Shard(0), Shard(1)])
            b = distribute_tensor(b_full, mesh, [Replicate(), Shard(0)])
            product = a @ b
            self.assertEqual(product.placements, (Shard(0), Partial()))
            expected = plain(torch.mm, a_full.reconcile(), b_full.reconcile())
            for rank, piece in pieces(product.full_tensor()).items():
                torch.testing.assert_close(piece, expected, msg=lambda m, rank=rank: f"simulated rank {rank}: {m}")
            columns = product.redistribute(mesh, [Shard(1), Shard(1)])
            for rank, piece in pieces(columns.full_tensor()).items():
                torch.testing.assert_close(piece, expected, msg=lambda m, rank=rank: f"simulated rank {rank}: {m}")


    def test_three_dim_mesh_slices_and_flattened_dims(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        flat = mesh["dp", "tp"]._flatten("dp_tp")
        with self._get_local_tensor_mode():
            self.assertEqual(flat.get_local_rank().node._local_ints, {r: r % 4 for r in range(8)})
            full = torch.arange(96.0).reshape(12, 8)
            expected = whole(full)
            gloo, nccl = contextlib.nullcontext, lambda: priced_by("nccl")
            for submesh, source, target, pricing, collectives in (
                # One all-to-all over both dims of the slice (one latency rather than two collectives).
                (mesh["dp", "tp"], [Shard(0), Shard(1)], [Shard(1), Replicate()], gloo, {funcol.all_to_all_single: 1}),
                (flat, [Shard(0)], [Shard(1)], gloo, {funcol.all_to_all_single: 1}),
                # Likewise one all-to-all of the contributions, reduced where they arrive.
                (mesh["pp", "tp"], [Partial(), Shard(0)], [Shard(1), Replicate()], gloo, {funcol.all_to_all_single: 1}),
                # One all-to-all over all 8 ranks where latency barely grows with the group.
                (mesh, [Shard(0), Shard(1), Shard(0)], [Replicate(), Shard(0), Shard(1)], nccl, {funcol.all_to_all_single: 1}),
            ):
                laid_out = distribute_tensor(full, submesh, source)
                with pricing(), CommDebugMode() as comm_mode:
                    moved = laid_out.redistribute(submesh, target)
                self.assertEqual(
                    {str(op): count for op, count in comm_mode.get_comm_counts().items()},
                    {str(op): count for op, count in collectives.items()},
                    msg=f"{source} -> {target}",
                )
                for rank, piece in pieces(moved.full_tensor()).items():
                    torch.testing.assert_close(piece, expected, msg=lambda m, rank=rank: f"simulated rank {rank}: {m}")


# PyTorch-style: a class written for processes, copied to run under LocalTensorMode.
class PortedToLocalTensor(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 4

    @parametrize("placement", [Shard(0), Shard(1), Replicate()])
    @with_comms
    def test_rows_of_each_rank(self, placement: Any) -> None:
        mesh = self.build_device_mesh()
        full = torch.arange(32.0).reshape(8, 4)
        dtensor = distribute_tensor(full, mesh, [placement])
        expected = map_local_for_rank(
            self.rank,
            lambda rank: full.chunk(4, placement.dim)[rank] if isinstance(placement, Shard) else full,
        )
        self.assertEqual(dtensor.to_local(), expected)
        self.assertEqual((dtensor * 2).full_tensor(), full * 2)

    @with_comms
    def test_really_simulated(self) -> None:
        self.assertTrue(self.is_local_tensor_enabled)
        self.assertIsInstance(self.rank, torch.SymInt)
        mesh = self.build_device_mesh()
        self.assertIsInstance(distribute_tensor(torch.ones(4), mesh, [Shard(0)]).to_local(), LocalTensor)


class ContinuousPorted(DTensorContinuousTestBase):
    world_size = 4

    def test_partial_to_replicate_sums_every_rank(self) -> None:
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        local = torch.ones(2, 2) * (self.rank + 1)
        with CommDebugMode() as comm_mode:
            full = DTensor.from_local(local, mesh, [Partial()]).full_tensor()
        self.assertEqual(comm_mode.get_comm_counts()[funcol.all_reduce], 1)
        self.assertEqual(full, torch.full((2, 2), 10.0))


class ConverterPorted(DTensorOpTestBase):
    @property
    def world_size(self) -> int:
        return 4

    def test_mul_on_every_sharding(self) -> None:
        mesh = self.build_device_mesh()
        a, b = torch.arange(16.0).reshape(4, 4), torch.arange(4.0) + 1
        converter = DTensorConverter(mesh, (a, b), {})
        combinations = 0
        for d_args, d_kwargs in converter:
            self.assertTrue(converter.successful())
            self.assertEqual(torch.mul(*d_args, **d_kwargs).full_tensor(), torch.mul(a, b))
            combinations += 1
        self.assertEqual(combinations, 6)


instantiate_parametrized_tests(PortedToLocalTensor)
ContinuousPortedWithLocalTensor = create_local_tensor_test_class(ContinuousPorted, base_class=LocalDTensorContinuousTestBase)
ConverterPortedWithLocalTensor = create_local_tensor_test_class(ConverterPorted, base_class=LocalDTensorOpTestBase)
del ContinuousPorted, ConverterPorted
PortedToLocalTensorWithLocalTensor = create_local_tensor_test_class(PortedToLocalTensor)
PortedToThreadsWithLocalTensor = create_local_tensor_test_class(
    PortedToLocalTensor, skipped_tests=["test_really_simulated"], base_class=ThreadedLocalDTensorTestBase
)
# The process-based original is only the template here: its ranks would need a pool of processes.
del PortedToLocalTensor
