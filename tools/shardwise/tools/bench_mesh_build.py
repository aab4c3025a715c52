"""Measure mesh construction on 4 gloo ranks: shardwise.mesh vs PyTorch's DeviceMesh.

A benchmark, not a test (these machines are noisy). Run from the repo root:

    PYTHONPATH=mesh:placement:dtensor_ops:testing:tools python -m shardwise.tools.bench_mesh_build [repetitions]

Each repetition gets a fresh default process group, builds each mesh cold (no group exists yet)
and then again warm, and records per rank the wall time and the c10d group constructions
(``distributed_c10d._new_process_group_helper`` calls, where both ``new_group`` and shardwise's
member-only creation end: all calls, and those creating a group the rank is in). A mesh is ready when its slowest rank is, so
times are the max over ranks; the table shows the median over repetitions. PyTorch's DeviceMesh
is imported here only as the point of comparison.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.device_mesh as torch_device_mesh
import torch.distributed.distributed_c10d as c10d

from shardwise.mesh import init_device_mesh
from shardwise.testing import run_on_ranks

Record = dict[str, tuple[float, int, int]]


def _timed(build: Callable[[], Any]) -> tuple[float, int, int]:
    dist.barrier()
    calls = created = 0
    original = c10d._new_process_group_helper

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls, created
        result = original(*args, **kwargs)
        calls += 1
        created += isinstance(result[0], dist.ProcessGroup)
        return result

    c10d._new_process_group_helper = counting
    try:
        start = time.perf_counter()
        build()
        elapsed = time.perf_counter() - start
    finally:
        c10d._new_process_group_helper = original
    return elapsed, calls, created


def _build_own_groups_with_local_synchronization() -> None:
    # c10d's own member-only option, which can hang after asymmetric histories (see _process_groups.py).
    rank = dist.get_rank()
    row, column = divmod(rank, 2)
    dist.new_group([column, column + 2], use_local_synchronization=True)
    dist.new_group([2 * row, 2 * row + 1], use_local_synchronization=True)


def _measure(shardwise_first: bool) -> Record:
    warnings.simplefilter("ignore")
    builders: dict[str, Callable[[str, tuple[int, ...], tuple[str, ...] | None], Any]] = {
        "shardwise": lambda device, shape, names: init_device_mesh(device, shape, mesh_dim_names=names),
        "pytorch": lambda device, shape, names: torch_device_mesh.init_device_mesh(device, shape, mesh_dim_names=names),
    }
    order = ["shardwise", "pytorch"] if shardwise_first else ["pytorch", "shardwise"]
    # Untimed: the first shardwise mesh after a new default process group drops the groups of the
    # previous one, and freeing those gloo groups (~10 ms each) is the previous world's cost.
    init_device_mesh("cpu", (4,), mesh_dim_names=("warm_up",))
    record: Record = {}
    for implementation in order:
        build = builders[implementation]
        record[f"{implementation} 2x2 cold"] = _timed(lambda: build("cpu", (2, 2), ("dp", "tp")))
        record[f"{implementation} 2x2 warm"] = _timed(lambda: build("cpu", (2, 2), ("dp", "tp")))
        record[f"{implementation} 1-D of 4"] = _timed(lambda: build("cpu", (4,), ("world",)))
    record["2x2 groups via c10d use_local_synchronization (not used)"] = _timed(_build_own_groups_with_local_synchronization)
    return record


def main() -> None:
    repetitions = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    rows: dict[str, list[tuple[float, list[int], list[int]]]] = {}
    for repetition in range(repetitions):
        per_rank = run_on_ranks(_measure, repetition % 2 == 0)
        for key in per_rank[0]:
            slowest = max(record[key][0] for record in per_rank)
            rows.setdefault(key, []).append(
                (slowest, [record[key][1] for record in per_rank], [record[key][2] for record in per_rank])
            )
    print(f"{'mesh (4 gloo ranks)':<52} {'median ms':>9} {'c10d constructions/rank':>23} {'groups joined/rank':>19}")
    for key, samples in rows.items():
        median_ms = statistics.median(sample[0] for sample in samples) * 1e3
        calls = sorted({tuple(sample[1]) for sample in samples})
        created = sorted({tuple(sample[2]) for sample in samples})
        print(f"{key:<52} {median_ms:>9.2f} {str(calls[0] if len(calls) == 1 else calls):>23} "
              f"{str(created[0] if len(created) == 1 else created):>19}")


if __name__ == "__main__":
    main()
