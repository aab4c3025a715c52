"""Tests of the multi-rank harness: results, failures, hangs, crashes and per-test isolation."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from shardwise.testing import (
    DEFAULT_TIMEOUT_S,
    TIMEOUT_ENV_VAR,
    MultiRankError,
    MultiRankTimeout,
    multi_rank,
    run_on_ranks,
)
from shardwise.testing._multi_rank import function_ref, resolve_timeout
from shardwise.testing._protocol import FunctionRef
from shardwise.testing._rank_worker import resolve_function

# --- bodies run on the ranks (module level, so the ranks can find them) ---


def rank_and_world_size() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def scaled_rank(scale: float, *, offset: float = 0.0) -> float:
    return dist.get_rank() * scale + offset


def raise_on_rank(bad_rank: int) -> None:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"shape (3, 5) is not divisible on rank {bad_rank}")
    dist.barrier()


def assert_on_every_rank() -> None:
    assert dist.get_rank() == -1, f"rank {dist.get_rank()} is not -1"


def sleep_on_rank(slow_rank: int, seconds: float) -> None:
    if dist.get_rank() == slow_rank:
        time.sleep(seconds)


def ops_on_a_new_mesh() -> list[float]:
    from shardwise.dtensor_ops import Replicate, Shard, distribute_tensor
    from shardwise.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    sharded = distribute_tensor(torch.arange(8.0), mesh, [Replicate(), Shard(0)])
    doubled = sharded.detach() * 2
    assert doubled.device_mesh.get_group("tp") is mesh.get_group("tp")
    return doubled.redistribute(mesh, [Replicate(), Replicate()]).to_local().tolist()


def start_ranks_from_a_rank() -> None:
    run_on_ranks(rank_and_world_size, world_size=2)


def exit_on_rank(dying_rank: int) -> None:
    if dist.get_rank() == dying_rank:
        print(f"rank {dying_rank} is about to exit", flush=True)
        os._exit(3)
    dist.barrier()


# Per-rank-process memory across calls: lets one call inspect what an earlier call left behind.
_groups_seen_by_earlier_call: dict[str, Any] = {}


def create_subgroup_and_remember_groups() -> str:
    subgroup = dist.new_group([0, 1])
    _groups_seen_by_earlier_call["default"] = dist.group.WORLD
    _groups_seen_by_earlier_call["subgroup"] = subgroup
    return distributed_c10d._get_process_group_name(subgroup)


def describe_process_group_state() -> dict[str, Any]:
    known_groups = list(distributed_c10d._world.pg_map)
    return {
        "group_count": len(known_groups),
        "default_is_new": dist.group.WORLD is not _groups_seen_by_earlier_call.get("default"),
        "old_subgroup_known": _groups_seen_by_earlier_call.get("subgroup") in known_groups,
        "world_size": dist.get_world_size(),
    }


def random_numbers() -> list[float]:
    return torch.rand(3).tolist()


def set_environment_and_grad_mode() -> None:
    os.environ["SHARDWISE_LEAKED_VARIABLE"] = "1"
    torch.set_grad_enabled(False)
    torch.set_default_dtype(torch.float64)


def environment_and_grad_mode() -> tuple[str | None, str | None, bool, torch.dtype]:
    return (
        os.environ.get("SHARDWISE_LEAKED_VARIABLE"),
        os.environ.get("SHARDWISE_SET_BY_THE_TEST_PROCESS"),
        torch.is_grad_enabled(),
        torch.get_default_dtype(),
    )


def rank_process_settings() -> dict[str, Any]:
    return {"threads": torch.get_num_threads(), "sys_path": list(sys.path), "pid": os.getpid()}


def return_unpicklable() -> object:
    return lambda: None


def skip_on_every_rank() -> None:
    pytest.skip("nothing to check on this configuration")


def tensor_parallel_steps_where_one_rank_raises(failing_rank: int, failing_step: int) -> None:
    """A toy Transformer trained with TP + SP; ``failing_rank`` raises between forward and backward of
    ``failing_step`` while the others go on into the backward's collectives with it."""
    from shardwise.testing import ModelArgs, Transformer
    from shardwise.mesh import init_device_mesh

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Transformer(ModelArgs(n_layers=1, vocab_size=16, max_seq_len=8, dim=16, n_heads=4, dropout_p=0.0))
    model = Transformer.parallelize(model, mesh, True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, failing_step + 2):
        tokens = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(step))
        output = model(tokens)
        loss = output.to_local().sum() if hasattr(output, "to_local") else output.sum()
        if dist.get_rank() == failing_rank and step == failing_step:
            raise ValueError(f"rank {failing_rank} fails in step {step}, after its forward")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


# --- the tests ---


@multi_rank(world_size=4)
def test_all_reduce_and_all_gather_work() -> None:
    rank = dist.get_rank()
    summed = torch.full((2,), float(rank))
    dist.all_reduce(summed)
    assert summed.tolist() == [6.0, 6.0]
    gathered = [torch.empty(1) for _ in range(4)]
    dist.all_gather(gathered, torch.tensor([rank * 10.0]))
    assert [t.item() for t in gathered] == [0.0, 10.0, 20.0, 30.0]


def test_run_on_ranks_returns_each_ranks_value_in_rank_order() -> None:
    assert run_on_ranks(rank_and_world_size) == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert run_on_ranks(scaled_rank, 2.0, offset=0.5) == [0.5, 2.5, 4.5, 6.5]


def test_run_on_ranks_with_another_world_size() -> None:
    assert run_on_ranks(rank_and_world_size, world_size=2) == [(0, 2), (1, 2)]


@pytest.mark.parametrize("shape", [(2, 3), (4,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
@multi_rank(world_size=4)
def test_parametrized_arguments_reach_every_rank(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    local = torch.ones(shape, dtype=dtype)
    dist.all_reduce(local)
    assert local.dtype == dtype
    assert local.shape == torch.Size(shape)
    assert bool((local == 4).all())


def test_raising_rank_fails_with_its_traceback() -> None:
    with pytest.raises(MultiRankError) as failure:
        run_on_ranks(raise_on_rank, 2)
    report = str(failure.value)
    assert "rank 2 raised ValueError: shape (3, 5) is not divisible on rank 2" in report
    assert "in raise_on_rank" in report and os.path.basename(__file__) in report
    assert failure.value.errors[2].exception_type == "ValueError"
    assert 2 in failure.value.failed_ranks
    assert not isinstance(failure.value, MultiRankTimeout)


def test_a_rank_failing_mid_step_fails_the_test_with_its_traceback_and_leaves_no_rank_hung() -> None:
    # After a DTensor step a failed rank's process groups can outlive destroy_process_group (held below
    # Python), keeping their connections open: the peers, blocked in the backward's collectives with it,
    # used to wait until the grace period ran out and were killed as unfinished. Now the failed rank's
    # process is ended once it has reported (and peers have not, 0.5 s later): every peer's collective fails
    # and reports at once.
    with pytest.raises(MultiRankError) as failure:
        run_on_ranks(tensor_parallel_steps_where_one_rank_raises, 1, 2)
    error = failure.value
    assert not isinstance(error, MultiRankTimeout)
    report = str(error)
    assert report.splitlines()[2] == "rank 1 raised ValueError: rank 1 fails in step 2, after its forward"
    assert report.index("rank 1 raised") < report.index("Traceback (most recent call last)") < report.index("also raised")
    assert "in tensor_parallel_steps_where_one_rank_raises" in report
    assert error.unfinished_ranks == ()  # no rank was left waiting in a collective
    assert sorted(error.errors) == [0, 1, 2, 3]
    assert run_on_ranks(rank_and_world_size)[3] == (3, 4)  # and the next test gets working ranks


def test_dtensor_decisions_of_an_earlier_call_do_not_carry_its_dead_mesh() -> None:
    # Cached decisions hold their outputs' mesh; the next call's equal-looking mesh lives in a new
    # world (new process groups), so the old decisions must not be reused for it.
    for _ in range(2):
        assert run_on_ranks(ops_on_a_new_mesh, world_size=4) == [[2.0 * i for i in range(8)]] * 4


def test_a_rank_asked_to_start_ranks_refuses_instead_of_multiplying() -> None:
    # What a body module that calls run_on_ranks at import does to each rank importing it.
    with pytest.raises(MultiRankError, match="rank processes cannot start ranks"):
        run_on_ranks(start_ranks_from_a_rank, world_size=2)
    assert run_on_ranks(rank_and_world_size, world_size=2) == [(0, 2), (1, 2)]


def test_failures_on_several_ranks_are_all_reported() -> None:
    with pytest.raises(MultiRankError) as failure:
        run_on_ranks(assert_on_every_rank)
    report = str(failure.value)
    assert sorted(failure.value.errors) == [0, 1, 2, 3]
    assert report.count("Traceback (most recent call last)") == 1
    for rank in range(4):
        assert f"rank {rank} is not -1" in report
    # The pool survives a failure that every rank reported cleanly.
    assert run_on_ranks(rank_and_world_size)[3] == (3, 4)


def test_hanging_rank_fails_within_the_timeout_with_its_stack() -> None:
    run_on_ranks(rank_and_world_size)  # start the pool outside the measured time
    timeout_s = 2.0
    started = time.monotonic()
    with pytest.raises(MultiRankTimeout) as failure:
        run_on_ranks(sleep_on_rank, 1, 600.0, timeout=timeout_s)
    elapsed = time.monotonic() - started
    # The hang (a 600 s sleep) ends at the timeout; collecting the rank's stack and restarting it takes
    # seconds more, tens on a loaded 2-core machine (13.4 s seen in CI), so the bound is far below 600 s
    # but not tight.
    assert timeout_s <= elapsed < timeout_s + 60.0
    assert failure.value.unfinished_ranks == (1,)
    report = str(failure.value)
    assert "ranks [1] did not answer" in report
    assert "in sleep_on_rank" in report  # rank 1's Python stack
    assert run_on_ranks(rank_and_world_size) == [(0, 4), (1, 4), (2, 4), (3, 4)]


def test_dying_rank_fails_with_its_exit_code_and_output() -> None:
    with pytest.raises(MultiRankError) as failure:
        run_on_ranks(exit_on_rank, 3)
    assert failure.value.exit_codes == {3: 3}
    report = str(failure.value)
    assert "rank 3 died: its process" in report and "exited with code 3 while running the test" in report
    assert "rank 3 is about to exit" in report
    assert run_on_ranks(rank_and_world_size) == [(0, 4), (1, 4), (2, 4), (3, 4)]


@multi_rank(world_size=4)
def test_a_test_after_a_hang_and_a_crash_still_runs() -> None:
    flag = torch.tensor([1.0])
    dist.all_reduce(flag)
    assert flag.item() == 4.0


def test_each_call_gets_a_fresh_default_process_group() -> None:
    subgroup_names = run_on_ranks(create_subgroup_and_remember_groups)
    assert subgroup_names[0] == subgroup_names[1] != "None"
    states = run_on_ranks(describe_process_group_state)
    assert states == [
        {"group_count": 1, "default_is_new": True, "old_subgroup_known": False, "world_size": 4}
    ] * 4


def test_random_seed_and_global_state_are_reset_for_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = run_on_ranks(random_numbers), run_on_ranks(random_numbers)
    assert first == second
    assert all(numbers == first[0] for numbers in first)
    run_on_ranks(set_environment_and_grad_mode)
    assert run_on_ranks(environment_and_grad_mode) == [(None, None, True, torch.float32)] * 4
    monkeypatch.setenv("SHARDWISE_SET_BY_THE_TEST_PROCESS", "yes")
    assert run_on_ranks(environment_and_grad_mode) == [(None, "yes", True, torch.float32)] * 4


def test_ranks_use_one_thread_and_the_test_processes_sys_path() -> None:
    settings = run_on_ranks(rank_process_settings)
    expected_path = [os.path.abspath(entry) for entry in sys.path]
    assert len({s["pid"] for s in settings}) == 4
    for rank_settings in settings:
        assert rank_settings["threads"] == 1
        assert rank_settings["sys_path"] == expected_path


def test_unpicklable_return_value_is_reported() -> None:
    with pytest.raises(MultiRankError, match="cannot be pickled back to the test process"):
        run_on_ranks(return_unpicklable)


def test_pytest_skip_on_the_ranks_skips_the_test() -> None:
    with pytest.raises(pytest.skip.Exception, match="nothing to check on this configuration"):
        run_on_ranks(skip_on_every_rank)


def test_bad_calls_are_rejected_before_any_rank_runs() -> None:
    def local_function() -> None:
        pass

    with pytest.raises(TypeError, match="not defined at module level"):
        run_on_ranks(local_function)
    with pytest.raises(TypeError, match="not defined at module level"):
        run_on_ranks(lambda: None)
    with pytest.raises(TypeError, match="must be picklable"):
        run_on_ranks(scaled_rank, lambda: 1.0)
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        run_on_ranks(rank_and_world_size, world_size=0)
    with pytest.raises(ValueError, match="backend must be one of"):
        run_on_ranks(rank_and_world_size, backend="mpi")
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        multi_rank(world_size=2, timeout=0)


def test_timeout_comes_from_argument_then_environment_then_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV_VAR, raising=False)
    assert resolve_timeout(None) == DEFAULT_TIMEOUT_S
    monkeypatch.setenv(TIMEOUT_ENV_VAR, "7.5")
    assert resolve_timeout(None) == 7.5
    assert resolve_timeout(3) == 3.0
    monkeypatch.setenv(TIMEOUT_ENV_VAR, "soon")
    with pytest.raises(ValueError, match=f"{TIMEOUT_ENV_VAR} must be a positive number of seconds, got 'soon'"):
        resolve_timeout(None)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_nccl_runs_with_one_gpu_per_rank_else_shares_the_gpus_over_gloo(world_size: int) -> None:
    if not torch.cuda.is_available():
        with pytest.raises(pytest.skip.Exception, match="nccl"):
            run_on_ranks(nccl_all_reduce, world_size=world_size, backend="nccl")
        return
    gpus = torch.cuda.device_count()
    expected_backend = "nccl" if gpus >= world_size else "gloo"
    assert run_on_ranks(nccl_all_reduce, world_size=world_size, backend="nccl") == [
        (rank % gpus, float(world_size), expected_backend) for rank in range(world_size)
    ]


def test_a_test_asking_for_nccl_gets_the_pool_the_gpus_allow(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.testing import _multi_rank

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv(_multi_rank.SHARE_GPUS_ENV_VAR, raising=False)
    assert _multi_rank._pool_backend_for("nccl", 2) == "nccl"
    assert _multi_rank._pool_backend_for("nccl", 4) == _multi_rank.SHARED_GPU_POOL
    assert _multi_rank._pool_backend_for("gloo", 4) == "gloo"
    monkeypatch.setenv(_multi_rank.SHARE_GPUS_ENV_VAR, "0")
    with pytest.raises(pytest.skip.Exception, match="needs one GPU per rank: world_size=4 but 2 GPUs"):
        _multi_rank._pool_backend_for("nccl", 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(pytest.skip.Exception, match="needs CUDA"):
        _multi_rank._pool_backend_for("nccl", 1)


def nccl_all_reduce() -> tuple[int, float, str]:
    ones = torch.ones(2, device="cuda")
    dist.all_reduce(ones)
    return torch.cuda.current_device(), ones[0].item(), str(dist.get_backend())


SOURCE_OF_A_MODULE_PYTEST_IMPORTED_UNDER_ITS_OWN_NAME = """
def compare(a, b):
    assert a == b
"""


def test_ranks_load_a_test_file_whose_module_name_is_not_importable(tmp_path: Path) -> None:
    test_file = tmp_path / "test_unimportable.py"
    test_file.write_text(SOURCE_OF_A_MODULE_PYTEST_IMPORTED_UNDER_ITS_OWN_NAME)
    module_name = "no_such_package.tests.test_unimportable"
    try:
        plain = resolve_function(FunctionRef(module_name, "compare", str(test_file)))
        with pytest.raises(AssertionError) as plain_failure:
            plain(1, 2)
        assert str(plain_failure.value) == ""
        del sys.modules[module_name]
        rewritten = resolve_function(FunctionRef(module_name, "compare", str(test_file), assert_rewrite=True))
        with pytest.raises(AssertionError, match="assert 1 == 2"):
            rewritten(1, 2)
    finally:
        sys.modules.pop(module_name, None)


def test_ranks_prefer_the_test_processes_file_over_a_same_named_module(tmp_path: Path) -> None:
    test_file = tmp_path / "json.py"  # same name as an importable standard module
    test_file.write_text("def marker() -> str:\n    return 'from the test file'\n")
    standard_json = sys.modules["json"]
    try:
        assert resolve_function(FunctionRef("json", "marker", str(test_file)))() == "from the test file"
    finally:
        sys.modules["json"] = standard_json


def test_function_reference_names_the_module_and_file_of_the_body() -> None:
    reference = function_ref(rank_and_world_size)
    assert reference.qualname == "rank_and_world_size"
    assert reference.file == os.path.realpath(__file__)
    assert reference.assert_rewrite  # pytest rewrote this module, so the ranks rewrite it too
    decorated = function_ref(test_all_reduce_and_all_gather_work)
    assert decorated.qualname == "test_all_reduce_and_all_gather_work"


def parent_of_this_rank() -> int:
    return os.getppid()


def test_gloo_ranks_can_be_forked_from_one_process_that_imported_torch_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.testing import _rank_pool

    _rank_pool.shutdown_pools()
    monkeypatch.setenv(_rank_pool.FORK_RANKS_ENV_VAR, "1")
    forked_parents = run_on_ranks(parent_of_this_rank, world_size=3)
    # One parent for every rank, and not this process: the zygote.
    assert len(set(forked_parents)) == 1 and forked_parents[0] != os.getpid()
    _rank_pool.shutdown_pools()
    monkeypatch.setenv(_rank_pool.FORK_RANKS_ENV_VAR, "0")
    assert run_on_ranks(parent_of_this_rank, world_size=3) == [os.getpid()] * 3  # each its own interpreter
    _rank_pool.shutdown_pools()
