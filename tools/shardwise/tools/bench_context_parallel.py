"""Context-parallel attention: peak memory and step time per rank against one process, per method, one run.

Run (from the repository root)::

    PYTHONPATH=mesh:placement:dtensor_ops:tp_styles:testing:tools python -m shardwise.tools.bench_context_parallel
    ... --seq-len 8192 --world-size 4        # the defaults
    ... --methods alltoall allgather ulysses # which ways of crossing ranks (the default: all three)
    ... --kernel math                        # the math path (scores materialised) instead of the CPU flash kernel
    ... --json out.json

One attention call, forward and backward (``F.scaled_dot_product_attention(q, k, v, is_causal=True)``
on ``(batch, heads, seq, head_dim)`` float32 tensors, then ``out.backward(grad)``), is timed in one
process on the whole sequence and on ``--world-size`` gloo ranks under ``context_parallel`` (the
sequence head-tail balanced over the ranks) with each method: ``alltoall`` (ring, key/value blocks
handed on), ``allgather`` (key/value gathered once), ``ulysses`` (all-to-all to head-sharded, local
attention, all-to-all back).

Step time: after one untimed call, ``--repeats`` calls; each starts and ends with a barrier, so a
rank's time is the slowest rank's; the figure is the median.  All ranks share this machine's cores,
so the CP/one-process time ratio on a small machine measures total work plus communication, not the
speed-up ``W`` devices would give.

Peak memory: one more call runs under ``torch.profiler`` with ``profile_memory=True``; the figure is
the highest running total of bytes allocated minus freed through PyTorch's CPU allocator during
the call (activations, gradients, received blocks, collective buffers), per rank, largest rank
shown, plus the bytes of the call's inputs (q, k, v and the incoming gradient).  The goal is close
to 1/W of one process's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shardwise.dtensor_ops import init_device_mesh
from shardwise.dtensor_ops.experimental._attention import _cp_options, context_parallel, set_rotate_method
from shardwise.testing import run_on_ranks
from shardwise.tools.bench_tp_step import _profiled_allocation_sizes, transient_peak_bytes

__all__ = ["BenchConfig", "MethodResult", "run", "main"]

METHODS = ("alltoall", "allgather", "ulysses")
KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


@dataclass(frozen=True)
class BenchConfig:
    seq_len: int = 8192
    world_size: int = 4
    batch: int = 1
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    repeats: int = 3
    kernel: str = "flash"
    methods: tuple[str, ...] = METHODS


@dataclass
class MethodResult:
    method: str  # "one process" or a CP method
    step_seconds: float  # median over the repeats
    peak_bytes: int  # largest rank


def _inputs(config: BenchConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shape_q = (config.batch, config.heads, config.seq_len, config.head_dim)
    shape_kv = (config.batch, config.kv_heads, config.seq_len, config.head_dim)
    return (
        torch.randn(shape_q, generator=generator),
        torch.randn(shape_kv, generator=generator),
        torch.randn(shape_kv, generator=generator),
        torch.randn(shape_q, generator=generator),
    )


def _attention_step(config: BenchConfig, tensors: list[torch.Tensor], grad: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        query, key, value = (t.detach().requires_grad_(True) for t in tensors)
        with sdpa_kernel(KERNELS[config.kernel]):
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=config.heads != config.kv_heads)
        out.backward(grad)

    return step


def _measure(config: BenchConfig, step: Callable[[], None], synchronize: Callable[[], None]) -> tuple[float, int]:
    step()  # warm-up
    times = []
    for _ in range(config.repeats):
        synchronize()
        started = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - started)
    peak = transient_peak_bytes(_profiled_allocation_sizes(step))
    return statistics.median(times), peak


def _rank_main(config_fields: dict[str, Any]) -> dict[str, tuple[float, int]]:
    """On every rank: each method's median step time and this rank's peak bytes.

    The config travels as a dict: run as ``python -m``, this module is ``__main__`` here and not on the ranks.
    """
    config = BenchConfig(**{**config_fields, "methods": tuple(config_fields["methods"])})
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    results: dict[str, tuple[float, int]] = {}
    for method in config.methods:
        _cp_options.enable_load_balance = True
        set_rotate_method(method)
        query, key, value, grad = _inputs(config)
        with context_parallel(mesh, buffers=[query, key, value, grad], buffer_seq_dims=[2, 2, 2, 2]):
            inputs_bytes = sum(t.numel() * t.element_size() for t in (query, key, value, grad))
            seconds, peak = _measure(config, _attention_step(config, [query, key, value], grad), dist.barrier)
        results[method] = (seconds, peak + inputs_bytes)
    set_rotate_method("allgather")
    return results


def run(config: BenchConfig) -> list[MethodResult]:
    query, key, value, grad = _inputs(config)
    inputs_bytes = sum(t.numel() * t.element_size() for t in (query, key, value, grad))
    seconds, peak = _measure(config, _attention_step(config, [query, key, value], grad), lambda: None)
    del query, key, value, grad
    results = [MethodResult("one process", seconds, peak + inputs_bytes)]
    per_rank = run_on_ranks(_rank_main, asdict(config), world_size=config.world_size, timeout=3600)
    for method in config.methods:
        results.append(
            MethodResult(
                method,
                max(rank_result[method][0] for rank_result in per_rank),
                max(rank_result[method][1] for rank_result in per_rank),
            )
        )
    return results


def format_table(config: BenchConfig, results: list[MethodResult]) -> str:
    baseline = results[0]
    lines = [
        f"attention forward+backward, causal, batch {config.batch} x {config.heads} heads ({config.kv_heads} kv) x "
        f"{config.seq_len} tokens x {config.head_dim}, float32, kernel {config.kernel}; CP on {config.world_size} gloo ranks "
        "sharing this machine's cores",
        f"{'method':<12} {'step ms':>10} {'time / one process':>20} {'peak MiB/rank':>15} {'memory / one process':>22}",
    ]
    for result in results:
        lines.append(
            f"{result.method:<12} {result.step_seconds * 1e3:>10.1f} {result.step_seconds / baseline.step_seconds:>20.2f} "
            f"{result.peak_bytes / 2**20:>15.1f} {result.peak_bytes / baseline.peak_bytes:>22.3f}"
        )
    lines.append(f"(1/W = {1 / config.world_size:.3f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    defaults = BenchConfig()
    parser = argparse.ArgumentParser(prog="python -m shardwise.tools.bench_context_parallel", description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--world-size", type=int, default=defaults.world_size)
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    parser.add_argument("--head-dim", type=int, default=defaults.head_dim)
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--kernel", choices=sorted(KERNELS), default=defaults.kernel)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(defaults.methods))
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args(argv)
    config = BenchConfig(
        seq_len=args.seq_len, world_size=args.world_size, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
        head_dim=args.head_dim, repeats=args.repeats, kernel=args.kernel, methods=tuple(args.methods),
    )  # fmt: skip
    if config.repeats < 1 or config.world_size < 2 or config.seq_len < 1:
        parser.error("--repeats and --seq-len must be >= 1 and --world-size >= 2")
    results = run(config)
    print(format_table(config, results))
    if args.json:
        payload: dict[str, Any] = {"config": asdict(config), "results": [asdict(result) for result in results]}
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=2)


if __name__ == "__main__":
    main()
