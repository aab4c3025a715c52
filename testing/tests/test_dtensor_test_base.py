"""DTensorTestBase (ranks as pooled processes) and DTensorOpTestBase (ranks as threads)."""

from __future__ import annotations

import threading
import unittest
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardwise.dtensor_ops import DTensor, Replicate, Shard, distribute_tensor
from shardwise.mesh import DeviceMesh
from shardwise.testing import MultiRankError
from shardwise.testing._dtensor_test_base import (
    DEVICE_TYPE,
    NUM_DEVICES,
    DTensorOpTestBase,
    DTensorTestBase,
    run_subtests,
    skip_unless_torch_gpu,
    with_comms,
)
from shardwise.testing._threaded import isolated_rank_state, run_on_threads

# ------------------------------------------------------------------------------ constants


def test_constants_follow_the_visible_devices() -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus > 1:
        assert (DEVICE_TYPE, NUM_DEVICES) == ("cuda", min(4, gpus))
    else:
        assert (DEVICE_TYPE, NUM_DEVICES) == ("cpu", 4)


def test_skip_unless_torch_gpu_skips_without_enough_gpus() -> None:
    calls: list[int] = []

    @skip_unless_torch_gpu
    def needs_gpus(value: int) -> int:
        calls.append(value)
        return value

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= NUM_DEVICES:
        assert needs_gpus(3) == 3 and calls == [3]
    else:
        with pytest.raises(unittest.SkipTest, match=f"needs {NUM_DEVICES} CUDA GPUs"):
            needs_gpus(3)
        assert calls == []


def test_run_subtests_outside_a_world_calls_every_combination_as_a_subtest() -> None:
    seen: list[tuple[Any, ...]] = []

    class Recorder(unittest.TestCase):
        def runTest(self) -> None:
            run_subtests(self, {"a": [1, 2], "b": ["x", "y", "z"]}, lambda prefix, a, b: seen.append((prefix, a, b)), "p")

    result = unittest.TestResult()
    Recorder().run(result)
    assert result.wasSuccessful(), result.errors + result.failures
    assert seen == [("p", a, b) for a in (1, 2) for b in ("x", "y", "z")]


def test_run_subtests_rejects_a_key_given_twice() -> None:
    with pytest.raises(ValueError, match="'a' is both in subtest_config and a fixed keyword argument"):
        run_subtests(unittest.TestCase(), {"a": [1]}, lambda a: None, a=2)


# ------------------------------------------------------------------------------ processes


class DTensorTestBaseOnProcesses(DTensorTestBase):
    def setUp(self) -> None:
        super().setUp()
        self.prepared_by_set_up = "set up"

    @with_comms
    def test_each_rank_has_its_world_and_comms(self) -> None:
        self.assertEqual(self.prepared_by_set_up, "set up")
        self.assertEqual((self.rank, self.world_size), (dist.get_rank(), dist.get_world_size()))
        gpu_per_rank = torch.cuda.is_available() and torch.cuda.device_count() >= NUM_DEVICES
        expected_device, expected_backend = ("cuda", "nccl") if gpu_per_rank else ("cpu", "gloo")
        self.assertEqual((self.world_size, self.device_type, self.backend), (NUM_DEVICES, expected_device, expected_backend))
        total = torch.tensor([float(self.rank)], device=self.device_type)
        dist.all_reduce(total)
        self.assertEqual(total.item(), sum(range(self.world_size)))
        mesh = self.build_device_mesh()
        self.assertEqual(mesh.mesh.tolist(), list(range(self.world_size)))
        sharded = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
        self.assertEqual(sharded.to_local().tolist(), [2.0 * self.rank, 2.0 * self.rank + 1])

    @with_comms
    def test_run_subtests_and_test_op_on_ranks(self) -> None:
        mesh = self.build_device_mesh()
        seen: list[tuple[str, int]] = []

        def round_trip(placement: Shard | Replicate, rows: int) -> None:
            seen.append((str(placement), rows))
            full = torch.arange(rows * 4.0).reshape(rows, 4)
            self.assertTrue(torch.equal(distribute_tensor(full, mesh, [placement]).full_tensor(), full))

        self.run_subtests({"placement": [Shard(0), Replicate()], "rows": [4, 8]}, round_trip)
        self.assertEqual(seen, [("S(0)", 4), ("S(0)", 8), ("R", 4), ("R", 8)])

        calls: list[bool] = []

        def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            calls.append(isinstance(a, DTensor))
            return torch.add(a, b)

        torch.manual_seed(1)  # the same inputs on every rank
        self._test_op(mesh, add, torch.randn(4, 8), torch.randn(4, 8))
        # Once on plain tensors, then R, S(0), S(1) for each of the two arguments.
        self.assertEqual(calls, [False] + [True] * 9)

    def test_methods_without_with_comms_run_on_the_ranks_too(self) -> None:
        # As PyTorch's MultiProcessTestCase: every test method runs on every rank.
        self.assertEqual((self.rank, dist.get_world_size()), (dist.get_rank(), self.world_size))


def test_rank_in_the_test_process_is_the_main_process_rank() -> None:
    case = DTensorTestBaseOnProcesses("test_methods_without_with_comms_run_on_the_ranks_too")
    assert case.rank == case.MAIN_PROCESS_RANK == -1


class FailsOnRankTwo(DTensorTestBase):
    __test__ = False  # run by the tests below, which expect it to fail

    @with_comms
    def test_rank_two_disagrees(self) -> None:
        self.assertEqual(self.rank == 2, False, "rank two disagrees")


class SkipsOnTheRanks(DTensorTestBase):
    __test__ = False

    @with_comms
    def test_skipped(self) -> None:
        self.skipTest("not meaningful on this build")


def test_a_failing_rank_fails_the_test_with_its_traceback() -> None:
    result = unittest.TestResult()
    FailsOnRankTwo("test_rank_two_disagrees").run(result)
    assert len(result.errors) == 1, result.errors + result.failures
    report = result.errors[0][1]
    assert "failed on ranks [2]" in report, report
    assert "rank 2 raised AssertionError" in report and "rank two disagrees" in report, report
    assert "in test_rank_two_disagrees" in report, report  # the rank's own traceback


def test_a_skip_on_the_ranks_skips_the_test() -> None:
    result = unittest.TestResult()
    SkipsOnTheRanks("test_skipped").run(result)
    assert result.wasSuccessful(), result.errors + result.failures
    assert [reason for _, reason in result.skipped] == ["not meaningful on this build"]


class NoDevicesToRunOn(DTensorTestBase):
    __test__ = False

    @property
    def world_size(self) -> int:
        return 0  # as torch.cuda.device_count() reads on a machine without GPUs

    @with_comms
    def test_never_runs(self) -> None:
        raise AssertionError("a test with no ranks ran")


def test_a_world_of_no_ranks_is_a_skip_not_a_failure_to_start() -> None:
    result = unittest.TestResult()
    NoDevicesToRunOn("test_never_runs").run(result)
    assert result.wasSuccessful(), result.errors + result.failures
    assert [reason for _, reason in result.skipped] == ["NoDevicesToRunOn.world_size is 0: no rank to run the test on"]


@with_comms
def test_with_comms_on_a_module_level_function() -> None:
    mesh = DeviceMesh("cpu", list(range(NUM_DEVICES)))
    gathered = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
    assert gathered.to_local().tolist() == [0.0, 1.0, 2.0, 3.0]
    assert dist.get_world_size() == NUM_DEVICES


def test_with_comms_rejects_functions_defined_in_functions() -> None:
    with pytest.raises(TypeError, match="defined inside a function"):

        @with_comms
        def local_test() -> None:
            pass


def test_with_comms_rejects_classes_defined_in_functions() -> None:
    class LocalCase(DTensorTestBase):
        @with_comms
        def test_nothing(self) -> None:
            pass

    result = unittest.TestResult()
    LocalCase("test_nothing").run(result)
    assert len(result.errors) == 1
    assert "is defined inside a function" in result.errors[0][1]


# ------------------------------------------------------------------------------ threads


class DTensorOpTestBaseOnThreads(DTensorOpTestBase):
    def test_all_reduce_across_threads(self) -> None:
        self.assertEqual((self.world_size, dist.get_world_size()), (NUM_DEVICES, NUM_DEVICES))
        self.assertEqual(self.rank, dist.get_rank())
        through_c10d = torch.tensor([1.0 + self.rank])
        dist.all_reduce(through_c10d)
        group_name = dist.group.WORLD.group_name  # type: ignore[union-attr]
        functional = torch.ops._c10d_functional.all_reduce(torch.tensor([1.0 + self.rank]), "sum", group_name)
        functional = torch.ops._c10d_functional.wait_tensor(functional)
        expected = float(sum(range(1, self.world_size + 1)))
        self.assertEqual((through_c10d.item(), functional.item()), (expected, expected))

    def test_redistribute_gives_each_rank_its_own_shard(self) -> None:
        full = torch.arange(16.0).reshape(4, 4)
        mesh = self.build_device_mesh()
        replicated = distribute_tensor(full, mesh, [Replicate()])
        rows = replicated.redistribute(mesh, [Shard(0)])
        self.assertEqual(rows.to_local().tolist(), [full[self.rank].tolist()])
        columns = rows.redistribute(mesh, [Shard(1)])
        self.assertEqual(columns.to_local().tolist(), full[:, self.rank : self.rank + 1].tolist())
        self.assertTrue(torch.equal(columns.full_tensor(), full))

    def test_two_dim_mesh_on_threads(self) -> None:
        full = torch.arange(16.0).reshape(4, 4)
        mesh = DeviceMesh(self.device_type, torch.arange(4).reshape(2, 2))
        row, column = divmod(self.rank, 2)
        blocks = distribute_tensor(full, mesh, [Replicate(), Replicate()]).redistribute(mesh, [Shard(0), Shard(1)])
        self.assertEqual(blocks.to_local().tolist(), full[2 * row : 2 * row + 2, 2 * column : 2 * column + 2].tolist())

    @with_comms
    def test_with_comms_and_test_op_on_threads(self) -> None:
        torch.manual_seed(3)
        a, b = torch.randn(4, 4), torch.randn(4)
        # Threads share one random generator: agree on rank 0's inputs.
        dist.broadcast(a, src=0)
        dist.broadcast(b, src=0)
        self._test_op(self.build_device_mesh(), torch.mul, a, b)

    def test_test_op_with_an_in_place_op(self) -> None:
        # The plain run mutates copies: every DTensor run starts from the same inputs.
        self._test_op(self.build_device_mesh(), torch.Tensor.add_, torch.ones(4, 4), torch.full((4,), 2.0))

    def test_test_op_reports_a_wrong_dtensor_result(self) -> None:
        def wrong_on_dtensors(a: torch.Tensor) -> torch.Tensor:
            return a * (3 if isinstance(a, DTensor) else 2)

        with self.assertRaisesRegex(AssertionError, r"_test_op\(wrong_on_dtensors\) output 0 with input placements \[\('R',\)\]"):
            self._test_op(self.build_device_mesh(), wrong_on_dtensors, torch.ones(4))
        with self.assertRaisesRegex(AssertionError, "no tensor argument to shard"):
            self._test_op(self.build_device_mesh(), lambda x: x, 1.0)

    def test_run_subtests_on_threads(self) -> None:
        seen: list[int] = []
        self.run_subtests({"value": [1, 2, 3]}, lambda value: seen.append(value))
        self.assertEqual(seen, [1, 2, 3])


class ThreadFailsOnRankOne(DTensorOpTestBase):
    __test__ = False

    def test_rank_one_fails(self) -> None:
        if self.rank == 1:
            raise ValueError("rank one holds the wrong shard")
        dist.barrier()  # the others wait for rank 1, which never comes


def test_a_failing_rank_thread_fails_the_test_with_its_traceback() -> None:
    result = unittest.TestResult()
    ThreadFailsOnRankOne("test_rank_one_fails").run(result)
    assert len(result.errors) == 1, result.errors + result.failures
    report = result.errors[0][1]
    assert "ThreadFailsOnRankOne.test_rank_one_fails failed on ranks [1]" in report, report
    assert "rank 1 raised ValueError: rank one holds the wrong shard" in report, report
    assert 'raise ValueError("rank one holds the wrong shard")' in report, report


def test_run_on_threads_returns_each_rank_result() -> None:
    assert run_on_threads(lambda scale: dist.get_rank() * scale, 10, world_size=3) == [0, 10, 20]


def _reduce_scatter_every_op() -> dict[str, list[float]]:
    mine = torch.tensor([1.0, 8.0, 3.0, 5.0]) * (1 + dist.get_rank()) * torch.tensor([1.0, -1.0, 1.0, -1.0])
    group = dist.group.WORLD.group_name
    return {
        op: torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.reduce_scatter_tensor(mine, op, dist.get_world_size(), group)
        ).tolist()
        for op in ("sum", "max", "min")
    }


def test_thread_ranks_reduce_scatter_with_max_and_min_as_gloo_does() -> None:
    # torch's threaded group only sums; the thread ranks stand for gloo ranks, which also take max/min.
    pieces = [torch.tensor([1.0, 8.0, 3.0, 5.0]) * (1 + r) * torch.tensor([1.0, -1.0, 1.0, -1.0]) for r in range(2)]
    stacked = torch.stack(pieces)
    expected = {
        "sum": stacked.sum(0), "max": stacked.amax(0), "min": stacked.amin(0),
    }
    results = run_on_threads(_reduce_scatter_every_op, world_size=2)
    for rank, result in enumerate(results):
        for op, values in result.items():
            assert values == expected[op][2 * rank : 2 * rank + 2].tolist(), (rank, op)
    # The world left torch's threaded group as it found it.
    from torch.testing._internal.distributed import multi_threaded_pg

    assert multi_threaded_pg.ReduceScatter.__name__ == "ReduceScatter"


def test_run_on_threads_reports_a_rank_stuck_outside_collectives() -> None:
    release = threading.Event()

    def stuck_on_rank_zero() -> None:
        if dist.get_rank() == 0:
            release.wait(10.0)

    try:
        with pytest.raises(MultiRankError, match=r"did not finish") as raised:
            run_on_threads(stuck_on_rank_zero, world_size=2, timeout=0.5)
        assert "release.wait(10.0)" in str(raised.value)
    finally:
        release.set()


def _start_a_nested_world() -> None:
    run_on_threads(lambda: None, world_size=2)


def test_thread_worlds_do_not_nest() -> None:
    with pytest.raises(MultiRankError, match="a thread world is already running in this process"):
        run_on_threads(_start_a_nested_world, world_size=2)


def test_isolated_rank_state_gives_each_thread_its_own_caches_and_restores_them() -> None:
    from shardwise.dtensor_ops._caches import RANK_CACHES

    original: Any = RANK_CACHES.programs
    original_decisions: Any = RANK_CACHES.decisions
    with isolated_rank_state() as swapped:
        assert "RANK_CACHES.programs" in swapped and "RANK_CACHES.decisions" in swapped
        assert "shardwise.mesh._process_groups._registry" in swapped
        per_thread: Any = RANK_CACHES.programs
        per_thread["key"] = "main"
        seen_in_thread: list[bool] = []
        thread = threading.Thread(target=lambda: seen_in_thread.append("key" in per_thread))
        thread.start()
        thread.join()
        assert seen_in_thread == [False] and per_thread["key"] == "main"
        # Every reader goes through the one object, so swapping its fields is all it takes.
        assert type(RANK_CACHES.decisions) is not dict
    assert RANK_CACHES.programs is original and "key" not in original
    assert RANK_CACHES.decisions is original_decisions and type(RANK_CACHES.decisions) is dict


# ------------------------------------------------------------------------------ PyTorch's assertions and decorators

from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize  # noqa: E402

from shardwise.testing import DTensorContinuousTestBase, skip_if_lt_x_gpu  # noqa: E402


class TorchAssertionsOnRanks(DTensorTestBase):
    world_size = 2  # type: ignore[assignment]

    @with_comms
    def test_tensor_and_sequence_assertions_are_torchs(self) -> None:
        mesh = self.build_device_mesh()
        sharded = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
        # Tensors compare element-wise with torch's tolerances; tuples equal lists.
        self.assertEqual(sharded.full_tensor(), torch.arange(4.0) + 1e-7)
        self.assertEqual(sharded.placements, [Shard(0)])
        self.assertNotEqual(sharded.full_tensor(), torch.zeros(4))
        self.assertNotWarn(lambda: sharded.to_local())
        self.assertEqualOnRank(sharded.to_local(), torch.tensor([0.0, 1.0]), rank=0)
        self.assertEqualOnRank(sharded.to_local(), torch.tensor([2.0, 3.0]), rank=1)
        with self.assertRaisesRegex(AssertionError, "Tensor-likes are not close"):
            self.assertEqual(sharded.full_tensor(), torch.arange(4.0) + 1)

    @with_comms()
    def test_with_comms_called_without_arguments(self) -> None:
        self.assertEqual(dist.get_world_size(), 2)

    @with_comms(eager_init=True, backend="gloo")
    def test_with_comms_with_arguments_keeps_the_harness_group(self) -> None:
        self.assertFalse(self._owns_process_group)
        self.assertEqual(dist.get_backend(), "gloo")

    @with_comms
    def test_init_pg_with_another_backend_replaces_the_group(self) -> None:
        self.destroy_pg()
        self.assertFalse(dist.is_initialized())
        self.init_pg(eager_init=False, backend="gloo")
        self.assertTrue(self._owns_process_group)
        total = torch.ones(1)
        dist.all_reduce(total)
        self.assertEqual(total, torch.tensor([2.0]))
        self.destroy_pg()

    @with_comms
    def test_bad_backend_is_refused_before_any_collective(self) -> None:
        with self.assertRaisesRegex(RuntimeError, "Backend carrier-pigeon not supported"):
            self.init_pg(eager_init=False, backend="carrier-pigeon")

    @skip_if_lt_x_gpu(2)
    @with_comms
    def test_skipped_without_two_gpus(self) -> None:
        self.assertGreaterEqual(torch.cuda.device_count(), 2)

    @parametrize("rows", [2, 6])
    @parametrize("placement", [Shard(0), Replicate()])
    @with_comms
    def test_parametrized(self, rows: int, placement: Shard | Replicate) -> None:
        full = torch.arange(rows * 3.0).reshape(rows, 3)
        self.assertEqual(distribute_tensor(full, self.build_device_mesh(), [placement]).full_tensor(), full)


instantiate_parametrized_tests(TorchAssertionsOnRanks)


def test_parametrized_names_reach_the_ranks() -> None:
    names = sorted(name for name in vars(TorchAssertionsOnRanks) if name.startswith("test_parametrized"))
    assert len(names) == 4, names
    result = unittest.TestResult()
    for name in names:
        TorchAssertionsOnRanks(name).run(result)
    assert result.wasSuccessful() and result.testsRun == 4, result.errors + result.failures


def test_skip_if_lt_x_gpu_skips_through_the_test_case() -> None:
    result = unittest.TestResult()
    TorchAssertionsOnRanks("test_skipped_without_two_gpus").run(result)
    if torch.cuda.device_count() >= 2:
        assert result.wasSuccessful() and not result.skipped
    else:
        assert [reason for _, reason in result.skipped] == ["Need at least 2 CUDA devices"], result.errors


class ContinuousOnTwoRanks(DTensorContinuousTestBase):
    world_size = 2

    def test_no_with_comms_needed(self) -> None:
        self.assertTrue(dist.is_initialized())
        self.assertEqual(self.pg.size(), 2)
        mesh = self.build_device_mesh()
        sharded = distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])
        self.assertEqual(sharded.to_local(), torch.arange(3.0) + 3 * self.rank)

    def test_another_method_in_the_same_pool(self) -> None:
        gathered = [torch.zeros(1) for _ in range(2)]
        dist.all_gather(gathered, torch.tensor([float(self.rank)]))
        self.assertEqual(gathered, [torch.tensor([0.0]), torch.tensor([1.0])])


class UnsetContinuousWorldSize(DTensorContinuousTestBase):
    def test_unset_world_size_means_num_devices(self) -> None:
        self.assertEqual(dist.get_world_size(), NUM_DEVICES)


# Last in the file: an 8-rank pool replaces the others.
class EightRanks(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 8

    @with_comms
    def test_two_dim_meshes_of_several_shapes(self) -> None:
        full = torch.arange(64.0).reshape(8, 8)
        for shape in [(2, 4), (4, 2), (8,)]:
            mesh = DeviceMesh(self.device_type, torch.arange(8).reshape(shape))
            placements = [Shard(0), Shard(1)][: len(shape)]
            sharded = distribute_tensor(full, mesh, placements)
            self.assertEqual(sharded.full_tensor(), full)
            self.assertEqual(sharded.placements, placements)


from torch.testing._internal.common_device_type import instantiate_device_type_tests  # noqa: E402


class TolerancesOnRankThreads(DTensorOpTestBase):
    """A device-type test class (as PyTorch's OpInfo sweep builds them) run on rank threads."""

    def test_each_rank_reads_and_sets_its_own_precision(self, device: str) -> None:
        self.assertEqual((self.precision, self.rel_tol), (0, 0))  # torch's defaults, on every rank thread
        self.precision = 0.5 * (self.rank + 1)
        dist.barrier()  # every rank has set its own before any reads again
        self.assertEqual(self.precision, 0.5 * (self.rank + 1))
        self.assertEqual(torch.tensor([1.0]), torch.tensor([1.0 + 0.4]))  # within this rank's atol


instantiate_device_type_tests(TolerancesOnRankThreads, globals(), only_for="cpu")
