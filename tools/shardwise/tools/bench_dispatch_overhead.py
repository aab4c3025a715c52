"""Eager per-op overhead: shardwise's DTensor vs PyTorch's DTensor vs plain torch, in one process.

    python -m shardwise.tools.bench_dispatch_overhead [--world-sizes 1 4] [--iters 2000] [--repeats 15]

For every case (``add``, ``mm``, ``linear`` forward, an ``nn.Linear`` forward +
backward) both DTensor implementations get the same global shapes and placements
(activations ``Shard(0)``, weights ``Replicate()``: no communication, so the
figures are dispatch overhead, not network time), and plain torch runs the same
calls on the local shapes.  World size 1 runs in this process (single-process
gloo group); larger world sizes spawn that many ranks, all build the meshes and
tensors, rank 0 times while the others wait (so the ranks do not compete for
the CPU) and rank 0's figures are reported.

Timing: CPU time of the timing thread (``time.thread_time``), so that other load
on a shared machine does not count as ours (``--clock wall`` for wall time).  The
implementations are timed in turn within each repeat, each repeat is
``--iters`` calls, and the table shows the best repeat in µs per call (medians in
``--json`` output).  Overhead = DTensor time - plain time.

``floor``: the least any Python ``__torch_dispatch__`` wrapper subclass costs, the lower
limit of a third-party DTensor (PyTorch's own DTensor is dispatched by a C++ fast path inside
torch's dispatcher, which other subclasses cannot use): a bare wrapper that unwraps its
arguments, runs the op and wraps each tensor result (``_BareWrapper``), with no key, no
cache and no layout, on the local shapes.  ``floor/torch`` is its overhead over PyTorch's:
no subclass written in Python gets below that ratio.

PyTorch's DTensor is imported here only to compare speed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

CASES = ("add", "mm", "linear", "Linear fwd+bwd")
IMPLEMENTATIONS = ("plain", "torch", "shardwise", "floor")


@dataclass
class CaseResult:
    case: str
    world_size: int
    best_us: dict[str, float]
    median_us: dict[str, float]

    def overhead(self, implementation: str) -> float:
        return self.best_us[implementation] - self.best_us["plain"]


_make_wrapper_subclass = torch.Tensor._make_wrapper_subclass


class _BareWrapper(torch.Tensor):
    """A wrapper subclass whose ``__torch_dispatch__`` only unwraps, runs the op and wraps the results."""

    _inner: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # as DTensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, requires_grad: bool = False) -> "_BareWrapper":
        wrapper = _make_wrapper_subclass(
            cls, inner.shape, inner.stride(), None, None, inner.dtype, inner.layout, inner.device, False,
            requires_grad,
        )
        wrapper._inner = inner
        return wrapper

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        inner_args = [arg._inner if type(arg) is cls else arg for arg in args]
        if kwargs:
            result = func(*inner_args, **{name: _unwrap(value) for name, value in kwargs.items()})
        else:
            result = func(*inner_args)
        if type(result) is torch.Tensor:
            wrapper = _make_wrapper_subclass(
                cls, result.shape, result.stride(), None, None, result.dtype, result.layout, result.device
            )
            wrapper._inner = result
            return wrapper
        return _wrap(result)


class _EntryOnly(torch.Tensor):
    """Enters ``__torch_dispatch__`` and returns its first argument: the dispatcher's round trip into Python alone."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> "_EntryOnly":
        wrapper = _make_wrapper_subclass(cls, inner.shape, inner.stride(), None, None, inner.dtype, inner.layout, inner.device)
        return wrapper

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        return args[0]


def _unwrap(value: Any) -> Any:
    if type(value) is _BareWrapper:
        return value._inner
    if type(value) is list:
        return [_unwrap(item) for item in value]
    return value


def _wrap(result: Any) -> Any:
    if isinstance(result, torch.Tensor):
        return _BareWrapper(result)
    if isinstance(result, (tuple, list)):
        return type(result)(_wrap(item) for item in result)
    return result


def dispatch_entry_us(iters: int = 20000, repeats: int = 7) -> float:
    """µs per ``x + y`` on ``_EntryOnly`` tensors (thread CPU time, best repeat): the floor before any work."""
    x, y = _EntryOnly(torch.randn(8, 8)), _EntryOnly(torch.randn(8, 8))
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(iters):
            x + y
        best = min(best, (time.thread_time() - start) / iters * 1e6)
    return best


def _floor_cases() -> dict[str, Callable[[], object]]:
    """The calls of ``_build_cases`` on bare wrappers of the local (per-rank) tensors."""
    rows = 8
    generator = torch.Generator().manual_seed(0)
    x = _BareWrapper(torch.randn(rows, 8, generator=generator))
    y = _BareWrapper(torch.randn(rows, 8, generator=generator))
    w = _BareWrapper(torch.randn(8, 8, generator=generator))
    b = _BareWrapper(torch.randn(8, generator=generator))
    grad_out = _BareWrapper(torch.ones(rows, 8))
    model = nn.Linear(8, 8)
    for name, parameter in list(model.named_parameters()):
        setattr(model, name, nn.Parameter(_BareWrapper(parameter.detach().clone())))
    return _cases_on(x, y, w, b, grad_out, model)


def _cases_on(
    x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, b: torch.Tensor, grad_out: torch.Tensor, model: nn.Module
) -> dict[str, Callable[[], object]]:
    """The four timed calls on given operands, whatever tensor type they are."""

    def linear_step() -> None:
        model(x).backward(grad_out)
        model.weight.grad = None
        model.bias.grad = None

    return {
        "add": lambda: x + y,
        "mm": lambda: torch.mm(x, w),
        "linear": lambda: F.linear(x, w, b),
        "Linear fwd+bwd": linear_step,
    }


class _Api:
    """What a case needs from a DTensor implementation."""

    def __init__(self, name: str) -> None:
        if name == "torch":
            import torch.distributed.tensor as tensor_api
            from torch.distributed.device_mesh import init_device_mesh
        else:
            import shardwise.dtensor_ops as tensor_api  # type: ignore[no-redef]
            from shardwise.dtensor_ops import init_device_mesh  # type: ignore[assignment]
        self.name = name
        self.distribute_tensor: Callable[..., Any] = tensor_api.distribute_tensor
        self.distribute_module: Callable[..., Any] = tensor_api.distribute_module
        self.shard: Any = tensor_api.Shard(0)
        self.replicate: Any = tensor_api.Replicate()
        self.mesh: Any = init_device_mesh("cpu", (dist.get_world_size(),))


def _build_cases(api: _Api | None, world_size: int) -> dict[str, Callable[[], object]]:
    """The calls to time; ``api=None`` builds plain torch on the local (per-rank) shapes."""
    rows = 8  # local rows per rank; the global activation has 8 * world_size rows
    generator = torch.Generator().manual_seed(0)
    x_full = torch.randn(rows * world_size, 8, generator=generator)
    y_full = torch.randn(rows * world_size, 8, generator=generator)
    w_full = torch.randn(8, 8, generator=generator)
    b_full = torch.randn(8, generator=generator)
    model = nn.Linear(8, 8)
    if api is None:
        x, y, w, b = x_full[:rows].clone(), y_full[:rows].clone(), w_full, b_full
        grad_out = torch.ones(rows, 8)
    else:
        x = api.distribute_tensor(x_full, api.mesh, [api.shard])
        y = api.distribute_tensor(y_full, api.mesh, [api.shard])
        w = api.distribute_tensor(w_full, api.mesh, [api.replicate])
        b = api.distribute_tensor(b_full, api.mesh, [api.replicate])
        grad_out = api.distribute_tensor(torch.ones(rows * world_size, 8), api.mesh, [api.shard])
        api.distribute_module(model, api.mesh)
    return _cases_on(x, y, w, b, grad_out, model)


_CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.thread_time, "wall": time.perf_counter}


def _time_cases(
    world_size: int, iters: int, repeats: int, cases: tuple[str, ...], clock_name: str
) -> list[CaseResult]:
    torch.set_num_threads(1)
    clock = _CLOCKS[clock_name]
    builders = {
        "plain": _build_cases(None, world_size),
        "torch": _build_cases(_Api("torch"), world_size),
        "shardwise": _build_cases(_Api("shardwise"), world_size),
        "floor": _floor_cases(),
    }
    results = []
    for case in cases:
        samples: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
        for name in IMPLEMENTATIONS:
            for _ in range(max(50, iters // 10)):  # warm caches and allocators
                builders[name][case]()
        for _ in range(repeats):
            for name in IMPLEMENTATIONS:
                call = builders[name][case]
                start = clock()
                for _ in range(iters):
                    call()
                samples[name].append((clock() - start) / iters * 1e6)
        results.append(
            CaseResult(
                case=case,
                world_size=world_size,
                best_us={name: min(values) for name, values in samples.items()},
                median_us={name: statistics.median(values) for name, values in samples.items()},
            )
        )
    return results


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    iters: int,
    repeats: int,
    cases: tuple[str, ...],
    clock_name: str,
    out_path: str,
) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        if rank == 0:
            results = _time_cases(world_size, iters, repeats, cases, clock_name)
        else:
            # Build the same meshes and DTensors (collectives), then stay out of rank 0's way.
            torch.set_num_threads(1)
            _build_cases(None, world_size)
            _build_cases(_Api("torch"), world_size)
            _build_cases(_Api("shardwise"), world_size)
            results = []
        dist.barrier()
        if rank == 0:
            with open(out_path, "w") as handle:
                json.dump([asdict(result) for result in results], handle)
    finally:
        dist.destroy_process_group()


def run(
    world_size: int, iters: int, repeats: int, cases: tuple[str, ...], clock_name: str = "cpu"
) -> list[CaseResult]:
    """Time ``cases`` at ``world_size`` (1: in this process; more: spawned ranks, rank 0 reported)."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as scratch:
        out_path = os.path.join(scratch, "results.json")
        if world_size == 1:
            _rank_main(0, 1, port, iters, repeats, cases, clock_name, out_path)
        else:
            mp.spawn(
                _rank_main, args=(world_size, port, iters, repeats, cases, clock_name, out_path), nprocs=world_size
            )
        with open(out_path) as handle:
            raw = json.load(handle)
    return [CaseResult(**item) for item in raw]


def format_table(results: list[CaseResult]) -> str:
    header = (
        f"{'case':<16} {'ws':>2} {'plain':>8} {'torch':>8} {'shardwise':>10} {'floor':>8} "
        f"{'ovh torch':>10} {'ovh ours':>9} {'ovh floor':>10} {'ours/torch':>10} {'floor/torch':>11}"
    )
    lines = [header, "-" * len(header)]
    for result in results:
        torch_overhead = result.overhead("torch")
        our_overhead = result.overhead("shardwise")
        floor_overhead = result.overhead("floor")
        ratio = our_overhead / torch_overhead if torch_overhead > 0 else float("nan")
        floor_ratio = floor_overhead / torch_overhead if torch_overhead > 0 else float("nan")
        lines.append(
            f"{result.case:<16} {result.world_size:>2} {result.best_us['plain']:>8.2f} "
            f"{result.best_us['torch']:>8.2f} {result.best_us['shardwise']:>10.2f} {result.best_us['floor']:>8.2f} "
            f"{torch_overhead:>10.2f} {our_overhead:>9.2f} {floor_overhead:>10.2f} {ratio:>10.2f} {floor_ratio:>11.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--iters", type=int, default=2000, help="calls per repeat")
    parser.add_argument("--repeats", type=int, default=15, help="repeats per implementation (best one shown)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--clock", choices=sorted(_CLOCKS), default="cpu", help="thread CPU time or wall time")
    parser.add_argument("--json", dest="json_path", help="also write all figures (best and median) here")
    options = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results: list[CaseResult] = []
    for world_size in options.world_sizes:
        results.extend(run(world_size, options.iters, options.repeats, tuple(options.cases), options.clock))
    print(f"µs per call ({options.clock} clock), best of {options.repeats} repeats x {options.iters} calls (rank 0);")
    print("plain = torch on the local shapes; ovh = DTensor - plain; ours/torch = overhead ratio;")
    print("floor = a bare Python __torch_dispatch__ wrapper (unwrap, op, wrap): the least any Python subclass costs\n")
    print(format_table(results))
    torch_overheads = [result.overhead("torch") for result in results]
    if all(overhead > 0 for overhead in torch_overheads):
        ours = statistics.median(result.overhead("shardwise") / result.overhead("torch") for result in results)
        floor = statistics.median(result.overhead("floor") / result.overhead("torch") for result in results)
        print(f"\nmedian over the rows: ours/torch {ours:.2f}, floor/torch {floor:.2f}")
    print(f"entering a Python __torch_dispatch__ and returning (x + y, no op, no wrapper): {dispatch_entry_us():.2f} µs")
    if options.json_path:
        with open(options.json_path, "w") as handle:
            json.dump([asdict(result) for result in results], handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
