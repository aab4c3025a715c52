"""Benchmark the pooled multi-rank test harness against spawning fresh rank processes per test.

Runs N small tests (each one all_reduce on ``world_size`` ranks, gloo on CPU) twice:
  * pooled: ``shardwise.testing.run_on_ranks``, one pool started once and reused;
  * fresh: for every test, spawn ``world_size`` processes (multiprocessing "spawn", as
    torch's MultiProcessTestCase does), initialise a process group from a FileStore, run, exit.
Both figures include starting processes. Usage (from the repo root):
    PYTHONPATH=mesh:placement:dtensor_ops:testing:tools python -m shardwise.tools.bench_harness_pool [--tests 20]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time

import torch
import torch.distributed as dist

from shardwise.testing import run_on_ranks, shutdown_pools


def all_reduce_once() -> float:
    summed = torch.ones(4)
    dist.all_reduce(summed)
    return float(summed[0].item())


def _fresh_rank_main(rank: int, world_size: int, store_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size
    )
    try:
        result = all_reduce_once()
        if result != world_size:
            raise AssertionError(f"rank {rank}: all_reduce of ones gave {result}, expected {world_size}")
    finally:
        dist.destroy_process_group()


def run_fresh_spawn_test(world_size: int) -> None:
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-harness-") as store_dir:
        store_path = os.path.join(store_dir, "store")
        processes = [
            context.Process(target=_fresh_rank_main, args=(rank, world_size, store_path))
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        failed = {p.pid: p.exitcode for p in processes if p.exitcode != 0}
        if failed:
            raise RuntimeError(f"fresh-spawn ranks failed (pid: exit code): {failed}")


def time_pooled(tests: int, world_size: int) -> tuple[float, float]:
    """Total seconds for ``tests`` tests, and seconds of the first one (which starts the pool)."""
    shutdown_pools()
    started = time.perf_counter()
    first_test_s = 0.0
    for index in range(tests):
        results = run_on_ranks(all_reduce_once, world_size=world_size)
        if results != [float(world_size)] * world_size:
            raise AssertionError(f"pooled all_reduce gave {results}, expected {world_size} on every rank")
        if index == 0:
            first_test_s = time.perf_counter() - started
    total = time.perf_counter() - started
    shutdown_pools()
    return total, first_test_s


def time_fresh_spawn(tests: int, world_size: int) -> float:
    started = time.perf_counter()
    for _ in range(tests):
        run_fresh_spawn_test(world_size)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", type=int, default=20, help="number of small tests (default 20)")
    parser.add_argument("--world-size", type=int, default=4, help="ranks per test (default 4)")
    options = parser.parse_args()
    if options.tests < 1 or options.world_size < 1:
        parser.error(f"--tests and --world-size must be positive, got {options.tests} and {options.world_size}")

    pooled_s, first_pooled_s = time_pooled(options.tests, options.world_size)
    fresh_s = time_fresh_spawn(options.tests, options.world_size)
    steady_pooled_ms = (pooled_s - first_pooled_s) / max(options.tests - 1, 1) * 1e3
    print(f"{options.tests} tests x {options.world_size} ranks, one all_reduce each (gloo, CPU, {os.cpu_count()} cores)")
    print(f"  pooled harness : {pooled_s:7.2f} s total ({first_pooled_s:.2f} s first test incl. pool start, "
          f"then {steady_pooled_ms:.1f} ms per test)")
    print(f"  fresh spawn    : {fresh_s:7.2f} s total ({fresh_s / options.tests:.2f} s per test)")
    print(f"  fresh / pooled : {fresh_s / pooled_s:7.1f}x")


if __name__ == "__main__":
    main()
