"""The tensor-parallel training step of the model zoo Transformer, eager vs ``torch.compile``, ours vs PyTorch's.

Run (from the repository root)::

    PYTHONPATH=mesh:placement:dtensor_ops:testing:tp_styles:compile_support:fsdp_ext:tools \\
        python -m shardwise.tools.bench_compile_step
    ... --world-size 2 --steps 10 --warmup 2 --backend inductor
    ... --implementations torch shardwise-math shardwise
    ... --json out.json

``--world-size`` gloo ranks on this machine (default 2: inductor compiles on every rank, and these
machines have 2 cores).  Every rank builds the same Transformer (``bench_tp_step``'s model and
tensor-parallel plan, without sequence and loss parallelism so that the compiled region is the whole
forward and the loss), once per implementation and mode:

* implementations (``bench_tp_step``'s): ``torch`` (PyTorch's DTensor and parallel styles, attention
  decomposed with ``SDPBackend.MATH`` inside ``implicit_replication()``), ``shardwise-math`` (ours with the
  same attention, so the same aten ops: the ratio to ``torch`` is the cost of the two stacks),
  ``shardwise`` (ours with PyTorch's default attention kernel);
* modes: ``eager``, and ``compiled``: forward and loss under ``torch.compile(fullgraph=True,
  backend=--backend)``; backward runs the compiled backward graph; the optimizer (SGD) stays eager.

Per implementation and mode: compile time (the first step's wall time minus the median step: dynamo,
AOTAutograd and the backend for forward and backward; the backend is warmed up first on a small plain
function, so its one-time start is charged to no implementation; inductor's on-disk graph caches are
off, so each compile is done in full), the median wall time of a step over ``--steps``
rounds after ``--warmup`` steps (each step between barriers, so rank 0's time is the slowest rank's),
its CPU time summed over ranks (``time.process_time``: robust to the other load of a shared machine),
frames compiled, and the losses, which must agree between all four runs of the same model.  The report
gives the ratios compiled/eager per stack and ours/PyTorch per mode.

PyTorch's DTensor stack is imported here only to compare against (benchmarks may; product code may not).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from shardwise.tools.bench_tp_step import IMPLEMENTATIONS, BenchConfig, _batches, _init_device_mesh, _parallelized_model, _stack

__all__ = ["CompileBenchConfig", "RunResult", "main", "format_report"]

MODES = ("eager", "compiled")


@dataclass(frozen=True)
class CompileBenchConfig:
    world_size: int = 2
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 16
    batch_size: int = 4
    vocab_size: int = 32
    steps: int = 10
    warmup: int = 2
    backend: str = "inductor"
    lr: float = 0.05
    seed: int = 0
    implementations: tuple[str, ...] = ("torch", "shardwise-math")

    def model_config(self) -> BenchConfig:
        return BenchConfig(
            world_size=self.world_size,
            model="transformer",
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            vocab_size=self.vocab_size,
            seq_parallel=False,
            loss_parallel=False,
            seed=self.seed,
        )


@dataclass
class RunResult:
    implementation: str
    mode: str
    error: str | None = None
    guarded_call_micros: float = float("nan")  # compiled `t * 2` on one DTensor input: guards + call
    first_step_seconds: float = float("nan")
    step_seconds: list[float] = field(default_factory=list)  # wall clock, barrier to barrier
    step_cpu_seconds: list[float] = field(default_factory=list)  # CPU time of all ranks together
    frames: int = 0
    losses: list[float] = field(default_factory=list)

    @property
    def median_step_seconds(self) -> float:
        return statistics.median(self.step_seconds) if self.step_seconds else float("nan")

    @property
    def median_step_cpu_seconds(self) -> float:
        return statistics.median(self.step_cpu_seconds) if self.step_cpu_seconds else float("nan")

    @property
    def compile_seconds(self) -> float:
        if self.mode != "compiled":
            return 0.0
        return self.first_step_seconds - self.median_step_seconds


def _run_one(implementation: str, mode: str, config: CompileBenchConfig, world_size: int) -> RunResult:
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    result = RunResult(implementation, mode)
    stack = _stack(implementation)
    model_config = config.model_config()
    mesh = _init_device_mesh(stack, world_size)
    model = _parallelized_model(stack, model_config, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    batches = _batches(model_config, 1 + config.warmup + config.steps)

    def forward_and_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())

    counter: Any = None
    step_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = forward_and_loss
    if mode == "compiled":
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(config.backend)
        step_loss = torch.compile(forward_and_loss, backend=counter, fullgraph=True)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
        dist.barrier()
        start = time.perf_counter()
        cpu_start = time.process_time()
        with stack.attention_context():
            loss = step_loss(*batch)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        cpu = torch.tensor([time.process_time() - cpu_start], dtype=torch.float64)
        dist.barrier()
        wall = time.perf_counter() - start
        dist.all_reduce(cpu)  # outside the timed region: the sum over ranks
        result.losses.append(loss.item())
        return wall, float(cpu.item())

    result.first_step_seconds = step(batches[0])[0]
    for batch in batches[1 : 1 + config.warmup]:
        step(batch)
    for batch in batches[1 + config.warmup :]:
        wall, cpu = step(batch)
        result.step_seconds.append(wall)
        result.step_cpu_seconds.append(cpu)
    result.frames = counter.frame_count if counter is not None else 0
    if mode == "compiled":
        result.guarded_call_micros = _guarded_call_micros(stack, mesh)
    return result


def _guarded_call_micros(stack: Any, mesh: Any, calls: int = 300) -> float:
    """µs per call of a compiled ``t * 2`` on one small DTensor (backend eager): mostly dynamo's guards.

    PyTorch's own DTensor has guards special-cased in dynamo (a spec-equality guard); ours goes
    through the generic traceable-subclass guards with a Python ``__metadata_guard__``.
    """
    import torch._dynamo

    torch._dynamo.reset()
    value = stack.tensor.distribute_tensor(torch.ones(4, 4), mesh, [stack.tensor.Shard(0)])
    doubled = torch.compile(lambda t: t * 2, backend="eager", fullgraph=True)
    for _ in range(10):
        doubled(value)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            doubled(value)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def _warm_up_backend(backend: str) -> None:
    """Compile a small plain function once, so that the backend's one-time start (inductor's imports,
    its C++ toolchain probe) is not charged to whichever implementation is compiled first."""
    import torch._dynamo
    import torch._functorch.config
    import torch._inductor.config

    # Compile times are measured cold: no reuse of graphs compiled by an earlier run of this benchmark.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch._dynamo.reset()
    warm = torch.compile(lambda a, b: torch.relu(a @ b).sum(), backend=backend, fullgraph=True)
    a = torch.randn(4, 4, requires_grad=True)
    warm(a, torch.randn(4, 4)).backward()
    torch._dynamo.reset()


def _rank_main(rank: int, world_size: int, port: int, config: CompileBenchConfig, out_path: str) -> None:
    torch.set_num_threads(1)  # the ranks share this machine's cores
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=600),
    )
    results: list[RunResult] = []
    try:
        _warm_up_backend(config.backend)
        for implementation in config.implementations:
            for mode in MODES:
                try:
                    results.append(_run_one(implementation, mode, config, world_size))
                except Exception:  # noqa: BLE001 - reported in the table, not hidden
                    results.append(RunResult(implementation, mode, error=traceback.format_exc(limit=8)))
                    dist.barrier()
        if rank == 0:
            with open(out_path, "w", encoding="utf-8") as handle:
                json.dump([asdict(result) for result in results], handle)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see bench_tp_step: no interpreter teardown after a good run


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run(config: CompileBenchConfig) -> list[RunResult]:
    with tempfile.TemporaryDirectory() as folder:
        out_path = os.path.join(folder, "results.json")
        mp.start_processes(
            _rank_main,
            args=(config.world_size, _free_port(), config, out_path),
            nprocs=config.world_size,
            start_method="spawn",
        )
        with open(out_path, encoding="utf-8") as handle:
            loaded = json.load(handle)
    return [RunResult(**item) for item in loaded]


def _by_key(results: list[RunResult]) -> dict[tuple[str, str], RunResult]:
    return {(result.implementation, result.mode): result for result in results}


def format_report(results: list[RunResult], config: CompileBenchConfig) -> str:
    lines = [
        f"Transformer TP step, {config.world_size} gloo ranks, dim {config.dim}, {config.n_layers} layers, "
        f"batch {config.batch_size}x{config.seq_len}, backend {config.backend}; median of {config.steps} steps",
        "",
        f"{'implementation':<16}{'mode':<10}{'step ms':>10}{'cpu ms':>10}{'compile s':>11}{'frames':>8}  losses (first, last)",
    ]
    guard_notes: list[str] = []
    for result in results:
        if result.error is not None:
            lines.append(f"{result.implementation:<16}{result.mode:<10}  FAILED: {result.error.strip().splitlines()[-1]}")
            continue
        compile_text = f"{result.compile_seconds:>11.1f}" if result.mode == "compiled" else f"{'-':>11}"
        if result.mode == "compiled":
            guard_notes.append(f"{result.implementation}: {result.guarded_call_micros:.1f} µs")
        lines.append(
            f"{result.implementation:<16}{result.mode:<10}{result.median_step_seconds * 1e3:>10.2f}"
            f"{result.median_step_cpu_seconds * 1e3:>10.2f}{compile_text}"
            f"{result.frames:>8}  {result.losses[0]:.5f}, {result.losses[-1]:.5f}"
        )
    table = _by_key(results)
    if guard_notes:
        lines.append("compiled `t * 2` on one DTensor input (guards + call), per call: " + ", ".join(guard_notes))
    lines.append("")
    for implementation in config.implementations:
        eager, compiled = table.get((implementation, "eager")), table.get((implementation, "compiled"))
        if eager and compiled and not eager.error and not compiled.error:
            lines.append(
                f"{implementation}: compiled/eager step time = "
                f"{compiled.median_step_seconds / eager.median_step_seconds:.2f} (wall), "
                f"{compiled.median_step_cpu_seconds / eager.median_step_cpu_seconds:.2f} (cpu)"
            )
    reference = "torch"
    for implementation in config.implementations:
        if implementation == reference:
            continue
        for mode in MODES:
            ours, theirs = table.get((implementation, mode)), table.get((reference, mode))
            if ours and theirs and not ours.error and not theirs.error:
                text = (
                    f"{implementation}/{reference} {mode}: step time "
                    f"{ours.median_step_seconds / theirs.median_step_seconds:.2f} (wall), "
                    f"{ours.median_step_cpu_seconds / theirs.median_step_cpu_seconds:.2f} (cpu)"
                )
                if mode == "compiled":
                    text += f", compile time {ours.compile_seconds / theirs.compile_seconds:.2f}"
                lines.append(text)
    finished = [result for result in results if result.error is None]
    if finished:
        reference_losses = finished[0].losses
        worst = max(
            max(abs(a - b) for a, b in zip(result.losses, reference_losses)) for result in finished
        )
        lines.append(f"largest loss difference between runs: {worst:.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=CompileBenchConfig.world_size)
    parser.add_argument("--steps", type=int, default=CompileBenchConfig.steps)
    parser.add_argument("--warmup", type=int, default=CompileBenchConfig.warmup)
    parser.add_argument("--backend", default=CompileBenchConfig.backend, help="torch.compile backend (inductor, aot_eager, eager)")
    parser.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS, default=list(CompileBenchConfig.implementations))
    parser.add_argument("--json", help="write every result (per step) to this file")
    options = parser.parse_args(argv)
    if options.steps < 1 or options.warmup < 0 or options.world_size < 1:
        parser.error("--steps must be at least 1, --warmup and --world-size non-negative and positive")
    config = CompileBenchConfig(
        world_size=options.world_size,
        steps=options.steps,
        warmup=options.warmup,
        backend=options.backend,
        implementations=tuple(options.implementations),
    )
    results = run(config)
    print(format_report(results, config))
    if options.json:
        with open(options.json, "w", encoding="utf-8") as handle:
            json.dump({"config": asdict(config), "results": [asdict(result) for result in results]}, handle, indent=1)
    return 1 if any(result.error for result in results) else 0


if __name__ == "__main__":
    sys.exit(main())
