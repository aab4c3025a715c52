"""Mesh set-up and redistribution planning as the mesh grows: shardwise vs PyTorch, one process.

    PYTHONPATH=mesh:placement:dtensor_ops:testing:tools \\
        python -m shardwise.tools.bench_mesh_scale [--repeats 3] [--plan-repeats 20] [--max-ranks 16384] \\
            [--json out.json] [--png mesh_scale.png]

Every measurement runs as rank 0 of a simulated world (torch's fake process group: ``FakeStore``,
backend ``"fake"``; collectives and group creation do no communication), so what is timed is each
stack's own work per rank: which groups it creates and how, and what it computes. Worlds of 64 to
16,384 ranks, meshes of 1 to 4 dims (``SHAPES``).

1. **Mesh init**: ``init_device_mesh`` of shardwise and of PyTorch (``torch.distributed.device_mesh``)
   alternately, each on a fresh fake default group (so both start cold: no group exists), median
   of ``--repeats``. Also per stack: c10d group constructions on rank 0 (``_new_process_group_helper``
   calls, members or not) and groups rank 0 ends up holding, and the Python memory the mesh
   retains (``tracemalloc``, measured in a separate untimed pass).
2. **Planning**: one redistribution whose every mesh dim changes (``Shard(i % 2) -> Shard((i + 1) % 2)``
   per dim) of a 4096x4096 float32 tensor; cold = every plan cache cleared (shardwise:
   ``clear_all_caches``; PyTorch: ``_gen_transform_infos.cache_clear`` and its planner cache), warm =
   the same call again; medians of ``--plan-repeats``. PyTorch's planner here is its default greedy one.

Ratios are shardwise / PyTorch (below 1: shardwise faster or smaller). Clock: wall time
(``time.perf_counter``); the machine is shared, so compare ratios within one run, not absolute times.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

# World sizes 64 .. 16,384, each as 1-, 2-, 3- and 4-D meshes.
SHAPES: dict[int, tuple[tuple[int, ...], ...]] = {
    1: ((64,), (256,), (1024,), (4096,), (16384,)),
    2: ((8, 8), (16, 16), (32, 32), (64, 64), (128, 128)),
    3: ((4, 4, 4), (8, 8, 4), (16, 16, 4), (32, 32, 4), (64, 64, 4)),
    4: ((4, 4, 2, 2), (4, 4, 4, 4), (8, 8, 4, 4), (8, 8, 8, 8), (16, 16, 8, 8)),
}
PLANNED_SHAPE = (4096, 4096)


@dataclass
class InitResult:
    shape: tuple[int, ...]
    world_size: int
    shardwise_ms: float
    torch_ms: float
    shardwise_group_calls: int
    torch_group_calls: int
    shardwise_groups_held: int
    torch_groups_held: int
    shardwise_retained_kib: float
    torch_retained_kib: float

    @property
    def time_ratio(self) -> float:
        return self.shardwise_ms / self.torch_ms


@dataclass
class PlanResult:
    shape: tuple[int, ...]
    world_size: int
    shardwise_cold_us: float
    torch_cold_us: float
    shardwise_warm_us: float
    torch_warm_us: float


def _fresh_fake_world(world_size: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


class _GroupConstructionCounter:
    """Counts c10d group constructions (members or not) while active; both stacks end up in the helper."""

    def __init__(self) -> None:
        self.calls = 0
        self._original: Callable[..., Any] = c10d._new_process_group_helper

    def __enter__(self) -> _GroupConstructionCounter:
        original = self._original

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        c10d._new_process_group_helper = counting
        return self

    def __exit__(self, *exc_info: object) -> None:
        c10d._new_process_group_helper = self._original


def _init_shardwise(shape: tuple[int, ...]) -> Any:
    from shardwise.mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=tuple(f"d{dim}" for dim in range(len(shape))))


def _init_torch(shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=tuple(f"d{dim}" for dim in range(len(shape))))


_INITS: dict[str, Callable[[tuple[int, ...]], Any]] = {"shardwise": _init_shardwise, "torch": _init_torch}


def _timed_init(stack: str, shape: tuple[int, ...]) -> tuple[float, int, int]:
    """(ms, group constructions, groups held by rank 0 afterwards) of one cold init."""
    _fresh_fake_world(math.prod(shape))
    gc.collect()
    held_before = len(c10d._world.pg_names)
    with _GroupConstructionCounter() as counter:
        start = time.perf_counter()
        mesh = _INITS[stack](shape)
        elapsed = time.perf_counter() - start
    held = len(c10d._world.pg_names) - held_before
    del mesh
    return elapsed * 1e3, counter.calls, held


def _retained_kib(stack: str, shape: tuple[int, ...]) -> float:
    """Python memory still allocated after the init, with the mesh alive (tracemalloc)."""
    _fresh_fake_world(math.prod(shape))
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    mesh = _INITS[stack](shape)
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    retained = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    del mesh
    return retained / 1024


def measure_init(shape: tuple[int, ...], repeats: int) -> InitResult:
    times: dict[str, list[float]] = {"shardwise": [], "torch": []}
    calls: dict[str, int] = {}
    held: dict[str, int] = {}
    for _ in range(repeats):
        for stack in ("shardwise", "torch"):  # alternating, so load drifts hit both alike
            elapsed, constructions, groups = _timed_init(stack, shape)
            times[stack].append(elapsed)
            calls[stack], held[stack] = constructions, groups
    retained = {stack: _retained_kib(stack, shape) for stack in ("shardwise", "torch")}
    return InitResult(
        shape=shape,
        world_size=math.prod(shape),
        shardwise_ms=statistics.median(times["shardwise"]),
        torch_ms=statistics.median(times["torch"]),
        shardwise_group_calls=calls["shardwise"],
        torch_group_calls=calls["torch"],
        shardwise_groups_held=held["shardwise"],
        torch_groups_held=held["torch"],
        shardwise_retained_kib=retained["shardwise"],
        torch_retained_kib=retained["torch"],
    )


def _placements(ndim: int, shift: int, shard: Callable[[int], Any]) -> tuple[Any, ...]:
    return tuple(shard((dim + shift) % 2) for dim in range(ndim))


def _median_us(samples: Sequence[float]) -> float:
    return statistics.median(samples) * 1e6


def measure_planning(shape: tuple[int, ...], repeats: int) -> PlanResult:
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec as TorchSpec
    from torch.distributed.tensor._dtensor_spec import TensorMeta as TorchMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache

    from shardwise.dtensor_ops._caches import clear_all_caches
    from shardwise.dtensor_ops._planner import plan_redistribute
    from shardwise.placement import DTensorSpec, Shard, TensorMeta

    ndim = len(shape)
    stride = (PLANNED_SHAPE[1], 1)
    _fresh_fake_world(math.prod(shape))
    ours_mesh = _init_shardwise(shape)
    torch_mesh = _init_torch(shape)
    ours_meta = TensorMeta(torch.Size(PLANNED_SHAPE), stride, torch.float32)
    torch_meta = TorchMeta(torch.Size(PLANNED_SHAPE), stride, torch.float32)
    ours_src = DTensorSpec(ours_mesh, _placements(ndim, 0, Shard), ours_meta)
    ours_dst = DTensorSpec(ours_mesh, _placements(ndim, 1, Shard), ours_meta)
    torch_src = TorchSpec(torch_mesh, _placements(ndim, 0, TorchShard), torch_meta)
    torch_dst = TorchSpec(torch_mesh, _placements(ndim, 1, TorchShard), torch_meta)

    def ours_cold() -> None:
        clear_all_caches()
        plan_redistribute(ours_src, ours_dst)

    def torch_cold() -> None:
        _gen_transform_infos.cache_clear()
        clear_redistribute_planner_cache()
        _gen_transform_infos(torch_src, torch_dst)

    def timed(call: Callable[[], object]) -> float:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    samples: dict[str, list[float]] = {"ours_cold": [], "torch_cold": [], "ours_warm": [], "torch_warm": []}
    ours_cold()  # imports and first-use costs count in neither figure
    torch_cold()
    for _ in range(repeats):
        samples["ours_cold"].append(timed(ours_cold))
        samples["ours_warm"].append(timed(lambda: plan_redistribute(ours_src, ours_dst)))
        samples["torch_cold"].append(timed(torch_cold))
        samples["torch_warm"].append(timed(lambda: _gen_transform_infos(torch_src, torch_dst)))
    return PlanResult(
        shape=shape,
        world_size=math.prod(shape),
        shardwise_cold_us=_median_us(samples["ours_cold"]),
        torch_cold_us=_median_us(samples["torch_cold"]),
        shardwise_warm_us=_median_us(samples["ours_warm"]),
        torch_warm_us=_median_us(samples["torch_warm"]),
    )


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def format_init(results: Sequence[InitResult]) -> Iterator[str]:
    yield "mesh init (fake process group, rank 0; median ms; ratio = shardwise / torch)"
    yield (
        f"{'mesh':>12} {'ranks':>6} {'shardwise':>10} {'torch':>9} {'ratio':>6} "
        f"{'c10d calls sw/pt':>17} {'groups held sw/pt':>18} {'retained KiB sw/pt':>19}"
    )
    for result in results:
        yield (
            f"{_shape_text(result.shape):>12} {result.world_size:>6} {result.shardwise_ms:>10.2f} "
            f"{result.torch_ms:>9.2f} {result.time_ratio:>6.2f} "
            f"{result.shardwise_group_calls:>8}/{result.torch_group_calls:<8} "
            f"{result.shardwise_groups_held:>9}/{result.torch_groups_held:<8} "
            f"{result.shardwise_retained_kib:>9.0f}/{result.torch_retained_kib:<9.0f}"
        )


def format_planning(results: Sequence[PlanResult]) -> Iterator[str]:
    yield "redistribution planning, every mesh dim changes (median us; ratio = shardwise / torch)"
    yield f"{'mesh':>12} {'ranks':>6} {'cold sw':>9} {'cold pt':>9} {'ratio':>6} {'warm sw':>8} {'warm pt':>8} {'ratio':>6}"
    for result in results:
        yield (
            f"{_shape_text(result.shape):>12} {result.world_size:>6} {result.shardwise_cold_us:>9.1f} "
            f"{result.torch_cold_us:>9.1f} {result.shardwise_cold_us / result.torch_cold_us:>6.2f} "
            f"{result.shardwise_warm_us:>8.2f} {result.torch_warm_us:>8.2f} "
            f"{result.shardwise_warm_us / result.torch_warm_us:>6.2f}"
        )


def write_plot(init: Sequence[InitResult], planning: Sequence[PlanResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (init_axes, plan_axes) = plt.subplots(1, 2, figsize=(13, 5))
    colors = {1: "tab:blue", 2: "tab:orange", 3: "tab:green", 4: "tab:red"}
    for ndim, color in colors.items():
        rows = [result for result in init if len(result.shape) == ndim]
        if rows:
            sizes = [result.world_size for result in rows]
            init_axes.plot(sizes, [r.shardwise_ms for r in rows], "o-", color=color, label=f"shardwise {ndim}-D")
            init_axes.plot(sizes, [r.torch_ms for r in rows], "x--", color=color, label=f"torch {ndim}-D")
        plans = [result for result in planning if len(result.shape) == ndim]
        if plans:
            sizes = [result.world_size for result in plans]
            plan_axes.plot(sizes, [r.shardwise_cold_us for r in plans], "o-", color=color, label=f"shardwise cold {ndim}-D")
            plan_axes.plot(sizes, [r.torch_cold_us for r in plans], "x--", color=color, label=f"torch cold {ndim}-D")
            plan_axes.plot(sizes, [r.shardwise_warm_us for r in plans], "o:", color=color, alpha=0.5)
    for axes, title, unit in ((init_axes, "init_device_mesh (rank 0, fake PG)", "ms"),
                              (plan_axes, "redistribution planning (dotted: shardwise warm)", "us")):
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("world size (ranks)")
        axes.set_ylabel(unit)
        axes.set_title(title)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="mesh inits per stack and shape (median)")
    parser.add_argument("--plan-repeats", type=int, default=20, help="cold and warm plans per stack and shape")
    parser.add_argument("--max-ranks", type=int, default=16384, help="skip worlds larger than this")
    parser.add_argument("--ndims", default="1,2,3,4", help="comma-separated mesh dim counts to run")
    parser.add_argument("--skip-planning", action="store_true")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--png", default="mesh_scale.png", help="plot path ('' for none)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.plan_repeats < 1:
        parser.error("--repeats and --plan-repeats must be at least 1")
    ndims = [int(text) for text in args.ndims.split(",")]
    shapes = [shape for ndim in ndims for shape in SHAPES[ndim] if math.prod(shape) <= args.max_ranks]

    for stack in ("shardwise", "torch"):  # imports and first-use costs count in no figure
        _timed_init(stack, (2, 2))
    init_results = []
    for shape in shapes:
        init_results.append(measure_init(shape, args.repeats))
        print(f"init {_shape_text(shape)}: x{init_results[-1].time_ratio:.2f}", file=sys.stderr, flush=True)
    plan_results = [] if args.skip_planning else [measure_planning(shape, args.plan_repeats) for shape in shapes]
    if dist.is_initialized():
        dist.destroy_process_group()

    print()
    for line in format_init(init_results):
        print(line)
    largest = [result for result in init_results if result.world_size == max(r.world_size for r in init_results)]
    print("largest world: " + ", ".join(f"{_shape_text(r.shape)} x{r.time_ratio:.2f}" for r in largest))
    if plan_results:
        print()
        for line in format_planning(plan_results):
            print(line)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"init": [asdict(r) for r in init_results], "planning": [asdict(r) for r in plan_results]}, handle, indent=1)
    if args.png:
        write_plot(init_results, plan_results, args.png)
        print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
