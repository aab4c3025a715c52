"""Measure alpha (latency) and beta (bus bandwidth) of each collective on your own mesh; write a cost profile.

    # on local ranks this command starts (gloo on CPU by default):
    python -m shardwise.tools.calibrate --nproc 4 --mesh 2x2 --dim-names dp,tp --output my_profile.json
    # on a real cluster, under torchrun (every rank runs it; rank 0 writes the file):
    torchrun --nnodes 2 --nproc-per-node 8 -m shardwise.tools.calibrate --backend nccl --mesh 2x8 \\
        --dim-names dp,tp --output my_profile.json
    # then use it:
    SHARDWISE_COST_PROFILE=my_profile.json python train.py

For every mesh dim and every kind (all_gather, reduce_scatter, all_reduce, all_to_all) it times the
collective over that dim's process group at several sizes (``--sizes``: bytes each rank *receives*,
counted as the redistribute planner counts a step's bytes, which makes beta nccl-tests' "busbw"),
takes per size the median over ``--iters`` runs of the slowest rank, and fits
``time = alpha + bytes / beta`` (beta: least squares over all sizes; alpha: what the smallest size
takes beyond its bytes). ``local_copy`` is a ``Tensor.copy_`` on the rank's device. The profile holds
these per dim (by name and index) and dim 0's as its defaults; ``ranks_per_node`` is
``LOCAL_WORLD_SIZE`` under torchrun. The printed table also gives, per kind, ``alpha * beta``: the
message size at which the bytes take as long as the latency (bandwidth dominates well above it).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.mesh._cost_profile import COLLECTIVE_KINDS, CollectiveCost, CostProfile

_FLOAT = torch.float32
_ITEMSIZE = 4
_DEFAULT_SIZES = "4K,64K,1M,4M"
_WARMUP_ITERS = 2


@dataclass(frozen=True)
class CalibrateConfig:
    mesh_shape: tuple[int, ...]
    dim_names: tuple[str, ...] | None
    sizes: tuple[int, ...]
    iters: int
    backend: str
    device_type: str
    output: str
    name: str


def parse_size(text: str) -> int:
    """'4K' -> 4096, '1M' -> 1048576, '512' -> 512 (bytes)."""
    units = {"K": 1024, "M": 1024**2, "G": 1024**3}
    stripped = text.strip().upper().removesuffix("B")
    factor = units.get(stripped[-1:], 1)
    number = stripped[:-1] if stripped[-1:] in units else stripped
    try:
        value = int(float(number) * factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r} is not a byte count like 4096, 64K or 4M") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive")
    return value


def fit_alpha_beta(received_bytes: Sequence[float], seconds: Sequence[float]) -> CollectiveCost:
    """time = alpha + bytes / beta: beta from the least-squares slope, alpha from the smallest size."""
    if len(received_bytes) != len(seconds) or len(seconds) < 2:
        raise ValueError(f"need at least 2 (bytes, seconds) points, got {len(seconds)}")
    mean_x, mean_y = statistics.fmean(received_bytes), statistics.fmean(seconds)
    spread = sum((x - mean_x) ** 2 for x in received_bytes)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(received_bytes, seconds)) / spread if spread else 0.0
    # A flat or falling line (noise on tiny sizes) means no measurable bandwidth limit: say so with
    # a huge beta rather than a negative one.
    beta = 1.0 / slope if slope > 0 else 1e15
    smallest = min(range(len(seconds)), key=lambda index: received_bytes[index])
    alpha = max(seconds[smallest] - received_bytes[smallest] / beta, 0.0)
    return CollectiveCost(alpha_s=alpha, beta_bytes_per_s=beta)


def _operation(kind: str, received_bytes: int, group: dist.ProcessGroup, device: torch.device) -> tuple[Callable[[], object], int]:
    """A closure running one collective of ``kind`` in which each rank receives about ``received_bytes``.

    Returns it and the bytes received exactly as the planner counts them.
    """
    peers = group.size() - 1
    size = group.size()
    if kind == "all_gather":
        elements = max(received_bytes // (peers * _ITEMSIZE), 1)
        source = torch.ones(elements, dtype=_FLOAT, device=device)
        target = torch.empty(elements * size, dtype=_FLOAT, device=device)
        return (lambda: dist.all_gather_into_tensor(target, source, group=group)), peers * elements * _ITEMSIZE
    if kind == "reduce_scatter":
        elements = max(received_bytes // (peers * _ITEMSIZE), 1)
        source = torch.ones(elements * size, dtype=_FLOAT, device=device)
        target = torch.empty(elements, dtype=_FLOAT, device=device)
        return (lambda: dist.reduce_scatter_single(target, source, group=group)), peers * elements * _ITEMSIZE
    if kind == "all_reduce":
        elements = max(received_bytes * size // (2 * peers * _ITEMSIZE), 1)
        tensor = torch.ones(elements, dtype=_FLOAT, device=device)
        return (lambda: dist.all_reduce(tensor, group=group)), 2 * peers * -(-elements // size) * _ITEMSIZE
    if kind == "all_to_all":
        block = max(received_bytes // (peers * _ITEMSIZE), 1)
        source = torch.ones(block * size, dtype=_FLOAT, device=device)
        target = torch.empty(block * size, dtype=_FLOAT, device=device)
        return (lambda: dist.all_to_all_single(target, source, group=group)), peers * block * _ITEMSIZE
    raise ValueError(f"unknown collective kind {kind!r}")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest_median(samples: list[float], group: dist.ProcessGroup, device: torch.device) -> float:
    """The median of this rank's samples, maximised over the group (the collective ends with its slowest member)."""
    value = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value.item())


def measure_collectives(
    kinds: Sequence[str], group: dist.ProcessGroup, sizes: Sequence[int], iters: int, device: torch.device
) -> dict[str, CollectiveCost]:
    """alpha and beta of every kind over ``group``.

    Per size, the kinds take turns within each iteration (one run of each, then the next
    iteration), so a change in machine load lands on every kind alike and their order is measured
    in the same conditions; timed one kind after another, a loaded machine swapped them.
    """
    points: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
    for size in sizes:
        operations = {kind: _operation(kind, size, group, device) for kind in kinds}
        for run, _ in operations.values():
            for _ in range(_WARMUP_ITERS):
                run()
        samples: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(iters):
            for kind, (run, _) in operations.items():
                dist.barrier(group=group)
                _synchronize(device)
                start = time.perf_counter()
                run()
                _synchronize(device)
                samples[kind].append(time.perf_counter() - start)
        for kind, (_, counted_bytes) in operations.items():
            points[kind].append((counted_bytes, _slowest_median(samples[kind], group, device)))
    return {kind: fit_alpha_beta([x for x, _ in found], [y for _, y in found]) for kind, found in points.items()}


def measure_local_copy(sizes: Sequence[int], iters: int, device: torch.device) -> CollectiveCost:
    points = []
    for size in sizes:
        elements = max(size // _ITEMSIZE, 1)
        source = torch.ones(elements, dtype=_FLOAT, device=device)
        target = torch.empty_like(source)
        target.copy_(source)
        samples = []
        for _ in range(iters):
            _synchronize(device)
            start = time.perf_counter()
            target.copy_(source)
            _synchronize(device)
            samples.append(time.perf_counter() - start)
        points.append((float(elements * _ITEMSIZE), statistics.median(samples)))
    return fit_alpha_beta([x for x, _ in points], [y for _, y in points])


def calibrate_mesh(mesh: DeviceMesh, config: CalibrateConfig, device: torch.device) -> CostProfile:
    """Every rank measures; returns the profile (the same on every rank: every figure is a group maximum)."""
    dim_costs: dict[str, dict[str, CollectiveCost]] = {}
    for dim in range(mesh.ndim):
        if mesh.size(dim) < 2:
            continue  # a dim of size 1 moves nothing: no collective to time
        group = mesh.get_group(dim)
        costs = measure_collectives([kind for kind in COLLECTIVE_KINDS if kind != "local_copy"], group, config.sizes, config.iters, device)
        keys = [str(dim)] + ([config.dim_names[dim]] if config.dim_names else [])
        for key in keys:
            dim_costs[key] = costs
    copy = measure_local_copy(config.sizes, config.iters, device)
    # The world's slowest copy, so every rank writes the same profile.
    copy_time = torch.tensor([copy.alpha_s, 1.0 / copy.beta_bytes_per_s], dtype=torch.float64, device=device)
    dist.all_reduce(copy_time, op=dist.ReduceOp.MAX)
    local_copy = CollectiveCost(alpha_s=float(copy_time[0]), beta_bytes_per_s=1.0 / float(copy_time[1]))
    if not dim_costs:
        raise SystemExit("calibrate: every mesh dim has size 1; there is no collective to measure")
    first = next(iter(dim_costs.values()))
    local_world = os.environ.get("LOCAL_WORLD_SIZE", "")
    return CostProfile(
        name=config.name,
        source=(
            f"measured by shardwise.tools.calibrate on {dist.get_world_size()} ranks, backend {config.backend}, mesh "
            f"{'x'.join(map(str, config.mesh_shape))}, sizes {list(config.sizes)} B, {config.iters} iterations, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
        ),
        costs={**first, "local_copy": local_copy},
        dim_costs={key: {**costs, "local_copy": local_copy} for key, costs in dim_costs.items()},
        ranks_per_node=int(local_world) if local_world.isdigit() else None,
    )


def format_profile(profile: CostProfile) -> list[str]:
    lines = [f"profile {profile.name!r}: {profile.source}", f"{'dim':>6} {'kind':>15} {'alpha us':>9} {'beta GB/s':>10} {'alpha*beta':>11}"]
    for dim, costs in profile.dim_costs.items():
        for kind, cost in costs.items():
            crossover = cost.alpha_s * cost.beta_bytes_per_s
            lines.append(
                f"{dim:>6} {kind:>15} {cost.alpha_s * 1e6:>9.1f} {cost.beta_bytes_per_s / 1e9:>10.3f} {_bytes_text(crossover):>11}"
            )
    return lines


def _bytes_text(value: float) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def _device_for(config: CalibrateConfig) -> torch.device:
    if config.device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def run_worker(config: CalibrateConfig) -> None:
    """One rank: the default group from the environment (torchrun or the spawner), measure, rank 0 writes."""
    if not dist.is_initialized():
        dist.init_process_group(config.backend)
    try:
        device = _device_for(config)
        mesh = init_device_mesh(config.device_type, config.mesh_shape, mesh_dim_names=config.dim_names)
        profile = calibrate_mesh(mesh, config, device)
        if dist.get_rank() == 0:
            profile.save(config.output)
            print("\n".join(format_profile(profile)))
            print(f"wrote {config.output}; select it with SHARDWISE_COST_PROFILE={config.output}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawned_rank(rank: int, world_size: int, port: int, config: CalibrateConfig) -> None:
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
         "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)}
    )
    # Local ranks share few cores: one intra-op thread each keeps them from fighting over them.
    torch.set_num_threads(1)
    run_worker(config)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def parse_args(argv: Sequence[str] | None) -> tuple[CalibrateConfig, int | None]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, help="start this many local ranks (default: run as a torchrun worker if "
                        "RANK is set, else 2)")
    parser.add_argument("--mesh", help="mesh shape, e.g. 2x4 (default: 1-D over the world)")
    parser.add_argument("--dim-names", help="comma-separated mesh dim names, e.g. dp,tp")
    parser.add_argument("--backend", default="gloo", help="c10d backend (gloo, nccl)")
    parser.add_argument("--sizes", default=_DEFAULT_SIZES, help=f"bytes received per rank, comma-separated (default {_DEFAULT_SIZES})")
    parser.add_argument("--iters", type=int, default=10, help="timed runs per size")
    parser.add_argument("--output", default="shardwise_cost_profile.json")
    parser.add_argument("--name", default="calibrated")
    args = parser.parse_args(argv)
    sizes = tuple(sorted({parse_size(text) for text in args.sizes.split(",") if text.strip()}))
    if len(sizes) < 2:
        parser.error("--sizes needs at least two different sizes to fit alpha and beta")
    if args.iters < 1:
        parser.error("--iters must be at least 1")
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and args.nproc is None
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun else (args.nproc or 2)
    if world_size < 2:
        parser.error("calibration needs at least 2 ranks")
    try:
        shape = tuple(int(part) for part in args.mesh.lower().split("x")) if args.mesh else (world_size,)
    except ValueError:
        parser.error(f"--mesh {args.mesh!r} is not a shape like 2x4")
    if math.prod(shape) != world_size or any(size < 1 for size in shape):
        parser.error(f"--mesh {args.mesh!r} has {math.prod(shape)} ranks but the world has {world_size}")
    names = tuple(name.strip() for name in args.dim_names.split(",")) if args.dim_names else None
    if names is not None and len(names) != len(shape):
        parser.error(f"--dim-names gives {len(names)} names for a {len(shape)}-D mesh")
    device_type = "cuda" if args.backend == "nccl" else "cpu"
    config = CalibrateConfig(shape, names, sizes, args.iters, args.backend, device_type, args.output, args.name)
    return config, None if under_torchrun else world_size


def main(argv: Sequence[str] | None = None) -> int:
    config, spawn_world_size = parse_args(argv)
    if spawn_world_size is None:
        run_worker(config)
        return 0
    mp.spawn(_spawned_rank, args=(spawn_world_size, _free_port(), config), nprocs=spawn_world_size, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
