"""Cold decision costs: 2-D redistribution planning and a TP Transformer step's sharding propagation.

    PYTHONPATH=mesh:placement:dtensor_ops:tp_styles:testing:tools \\
        python -m shardwise.tools.bench_cold_decisions [--plan-repeats 50] [--step-repeats 15] [--json out.json]

Two measurements, in one process, every decision cache cleared (``clear_all_caches()``)
before each cold repeat; figures are medians over repeats:

1. Planning: the redistribute planner's cheapest-plan search (``find_cheapest_plan``,
   pure, called directly: no mesh, no process group) for a dozen transitions on a 2x2
   mesh of a 256x256 float32 tensor.  Reported per transition and per plan.
2. Propagation: one training step (forward, cross-entropy, backward, AdamW) of the model
   zoo's toy Transformer, tensor- and sequence-parallel on a 1-rank mesh (a gloo process
   group of world size 1 on a free localhost port).  Each repeat builds a fresh model and
   optimizer, clears the caches and times a step (cold: every sharding decision and
   redistribution plan is made), then builds another fresh model and optimizer and times
   the same step again (warm: the identical op sequence, every decision a cache hit).
   cold - warm is the cost of deciding; a TorchDispatchMode counts the distinct
   (op, input layouts, other arguments) calls of one cold step, an estimate of the
   decisions made (the caches key on about the same things).

One untimed step runs first so that one-time costs (imports, kernel registration, the
allocator) count in neither figure.  Clock: CPU time of this thread by default (robust on
a shared machine; ``--clock wall`` for wall time).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from shardwise.dtensor_ops import DTensor
from shardwise.dtensor_ops._caches import clear_all_caches
from shardwise.dtensor_ops._planner import find_cheapest_plan
from shardwise.placement import Partial, Placement, Replicate, Shard

MESH_SHAPE_2D = (2, 2)
PLANNED_TENSOR_SHAPE = (256, 256)
FLOAT32_ITEMSIZE = 4

_S0, _S1, _R, _P = Shard(0), Shard(1), Replicate(), Partial()
TRANSITIONS_2D: tuple[tuple[tuple[Placement, ...], tuple[Placement, ...]], ...] = (
    ((_S0, _S1), (_S1, _S0)),
    ((_S0, _S0), (_S1, _S1)),
    ((_P, _P), (_R, _R)),
    ((_S0, _R), (_R, _S1)),
    ((_P, _S0), (_S1, _R)),
    ((_R, _R), (_S0, _S1)),
    ((_S0, _S1), (_R, _R)),
    ((_P, _P), (_S0, _S1)),
    ((_S1, _S0), (_S0, _S0)),
    ((_R, _P), (_S0, _R)),
    ((_S0, _S0), (_R, _R)),
    ((_P, _R), (_R, _S0)),
)

_CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.thread_time, "wall": time.perf_counter}


def placement_label(placement: Placement) -> str:
    if isinstance(placement, Shard):
        return f"S{placement.dim}"
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Partial):
        return "P" if placement.reduce_op == "sum" else f"P({placement.reduce_op})"
    return str(placement)


def transition_label(src: Sequence[Placement], dst: Sequence[Placement]) -> str:
    def state(placements: Sequence[Placement]) -> str:
        return "(" + ",".join(placement_label(p) for p in placements) + ")"

    return f"{state(src)}->{state(dst)}"


# -- 1. planning ---------------------------------------------------------------------------------


@dataclass
class PlanTiming:
    transition: str
    steps: str  # the chosen plan, one step kind per step
    bytes_per_rank: int
    median_us: float
    samples_us: list[float] = field(default_factory=list)


@dataclass
class PlanningResult:
    mesh_shape: tuple[int, ...]
    tensor_shape: tuple[int, ...]
    repeats: int
    transitions: list[PlanTiming]
    median_total_us: float  # median over repeats of the time to plan every transition once

    @property
    def median_us_per_plan(self) -> float:
        return self.median_total_us / len(self.transitions)


def measure_cold_planning(repeats: int, clock: Callable[[], float]) -> PlanningResult:
    samples: list[list[float]] = [[] for _ in TRANSITIONS_2D]
    totals: list[float] = []
    plans = [
        find_cheapest_plan(PLANNED_TENSOR_SHAPE, MESH_SHAPE_2D, src, dst, FLOAT32_ITEMSIZE)
        for src, dst in TRANSITIONS_2D
    ]
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            clear_all_caches()
            total = 0.0
            for index, (src, dst) in enumerate(TRANSITIONS_2D):
                started = clock()
                find_cheapest_plan(PLANNED_TENSOR_SHAPE, MESH_SHAPE_2D, src, dst, FLOAT32_ITEMSIZE)
                elapsed_us = (clock() - started) * 1e6
                samples[index].append(elapsed_us)
                total += elapsed_us
            totals.append(total)
    finally:
        gc.enable()
    timings = [
        PlanTiming(
            transition=transition_label(src, dst),
            steps=" + ".join(step.kind.value for step in plan) or "(none)",
            bytes_per_rank=sum(step.bytes_per_rank for step in plan),
            median_us=statistics.median(transition_samples),
            samples_us=transition_samples,
        )
        for (src, dst), plan, transition_samples in zip(TRANSITIONS_2D, plans, samples)
    ]
    return PlanningResult(
        mesh_shape=MESH_SHAPE_2D,
        tensor_shape=PLANNED_TENSOR_SHAPE,
        repeats=repeats,
        transitions=timings,
        median_total_us=statistics.median(totals),
    )


# -- 2. propagation of a training step -----------------------------------------------------------


@dataclass
class TransformerConfig:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 64
    seq_len: int = 32
    batch_size: int = 8
    seed: int = 0


@dataclass
class StepResult:
    config: TransformerConfig
    repeats: int
    cold_samples_ms: list[float]
    warm_samples_ms: list[float]
    distinct_decisions: int
    dtensor_op_calls: int

    @property
    def cold_median_ms(self) -> float:
        return statistics.median(self.cold_samples_ms)

    @property
    def warm_median_ms(self) -> float:
        return statistics.median(self.warm_samples_ms)

    @property
    def deciding_ms(self) -> float:
        return self.cold_median_ms - self.warm_median_ms

    @property
    def deciding_ms_from_minimums(self) -> float:
        """Less sensitive to a busy machine than the medians' difference."""
        return min(self.cold_samples_ms) - min(self.warm_samples_ms)


def _layout_signature(value: object) -> object:
    """What a sharding decision depends on, for one argument (tensors by layout, not by value)."""
    if isinstance(value, DTensor):
        return ("DTensor", value.placements, tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, torch.Tensor):
        return ("Tensor", tuple(value.shape), value.dtype)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


class DistinctDecisionCounter(TorchDispatchMode):
    """Counts the aten calls that reach DTensor and their distinct (op, argument layouts) keys."""

    def __init__(self) -> None:
        super().__init__()
        self.dtensor_op_calls = 0
        self.distinct_keys: set[tuple[object, ...]] = set()

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        if any(issubclass(tensor_type, DTensor) for tensor_type in types):
            self.dtensor_op_calls += 1
            signature = tree_map(_layout_signature, (args, kwargs))
            self.distinct_keys.add((func, repr(signature)))
        return func(*args, **kwargs)


class TransformerTrainer:
    """A fresh tensor- and sequence-parallel Transformer with its AdamW optimizer and one batch."""

    def __init__(self, config: TransformerConfig, mesh: Any) -> None:
        from shardwise.testing import ModelArgs, Transformer

        torch.manual_seed(config.seed)
        args = ModelArgs(
            n_layers=config.n_layers,
            vocab_size=config.vocab_size,
            max_seq_len=config.seq_len,
            dim=config.dim,
            n_heads=config.n_heads,
            dropout_p=0.0,
            use_attn_mask=True,
            weight_tying=True,
        )
        self.model: nn.Module = Transformer.parallelize(Transformer(args), mesh, use_seq_parallel=True)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True)
        generator = torch.Generator().manual_seed(config.seed + 1)
        shape = (config.batch_size, config.seq_len)
        self.tokens = torch.randint(0, config.vocab_size, shape, generator=generator)
        self.targets = torch.randint(0, config.vocab_size, shape, generator=generator)

    def step(self) -> None:
        logits = self.model(self.tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), self.targets.flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _timed_step_ms(trainer: TransformerTrainer, clock: Callable[[], float]) -> float:
    gc.collect()
    started = clock()
    trainer.step()
    return (clock() - started) * 1e3


def measure_step_propagation(
    repeats: int, clock: Callable[[], float], config: TransformerConfig, mesh: Any
) -> StepResult:
    TransformerTrainer(config, mesh).step()  # one-time costs, counted in neither figure
    cold_samples: list[float] = []
    warm_samples: list[float] = []
    for _ in range(repeats):
        cold_trainer = TransformerTrainer(config, mesh)
        clear_all_caches()
        cold_samples.append(_timed_step_ms(cold_trainer, clock))
        warm_trainer = TransformerTrainer(config, mesh)
        warm_samples.append(_timed_step_ms(warm_trainer, clock))
    counted_trainer = TransformerTrainer(config, mesh)
    clear_all_caches()
    counter = DistinctDecisionCounter()
    with counter:
        counted_trainer.step()
    return StepResult(
        config=config,
        repeats=repeats,
        cold_samples_ms=cold_samples,
        warm_samples_ms=warm_samples,
        distinct_decisions=len(counter.distinct_keys),
        dtensor_op_calls=counter.dtensor_op_calls,
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_step_benchmark(repeats: int, clock: Callable[[], float], config: TransformerConfig) -> StepResult:
    from shardwise.mesh import init_device_mesh

    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        return measure_step_propagation(repeats, clock, config, mesh)
    finally:
        if owns_group:
            dist.destroy_process_group()


# -- report --------------------------------------------------------------------------------------


def format_planning(result: PlanningResult, clock_name: str) -> str:
    lines = [
        f"Cold 2-D redistribution planning: mesh {result.mesh_shape}, tensor {result.tensor_shape} float32, "
        f"median of {result.repeats} repeats ({clock_name} clock), caches cleared before each repeat",
        f"{'transition':<16} {'µs':>8}  {'bytes/rank':>10}  plan",
    ]
    lines.append("-" * len(lines[-1]))
    for timing in result.transitions:
        lines.append(f"{timing.transition:<16} {timing.median_us:>8.1f}  {timing.bytes_per_rank:>10}  {timing.steps}")
    lines.append(
        f"{len(result.transitions)} plans: {result.median_total_us:.1f} µs in all, "
        f"{result.median_us_per_plan:.1f} µs per plan"
    )
    return "\n".join(lines)


def format_step(result: StepResult, clock_name: str) -> str:
    config = result.config
    per_decision_us = result.deciding_ms * 1e3 / result.distinct_decisions if result.distinct_decisions else 0.0
    rows = [
        ("cold step (caches cleared)", result.cold_samples_ms),
        ("warm step (all cached)", result.warm_samples_ms),
    ]
    lines = [
        f"Cold propagation of a TP+SP Transformer training step (forward, backward, AdamW) on a 1-rank mesh: "
        f"dim {config.dim}, {config.n_layers} layers, batch {config.batch_size}x{config.seq_len}, "
        f"{result.repeats} repeats ({clock_name} clock)",
        f"{'':<28} {'median ms':>10} {'min':>8} {'max':>8}",
    ]
    lines.append("-" * len(lines[-1]))
    for name, samples in rows:
        lines.append(f"{name:<28} {statistics.median(samples):>10.2f} {min(samples):>8.2f} {max(samples):>8.2f}")
    lines.append(
        f"{'cold - warm (deciding)':<28} {result.deciding_ms:>10.2f} {result.deciding_ms_from_minimums:>8.2f}"
    )
    lines.append(
        f"distinct (op, layouts) decisions in one cold step: {result.distinct_decisions} "
        f"(of {result.dtensor_op_calls} DTensor op calls); {per_decision_us:.0f} µs per decision"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--plan-repeats", type=int, default=50, help="repeats of the dozen 2-D plans")
    parser.add_argument("--step-repeats", type=int, default=15, help="cold and warm training steps each")
    parser.add_argument("--skip", choices=("planning", "step"), help="leave one measurement out")
    parser.add_argument("--clock", choices=sorted(_CLOCKS), default="cpu", help="thread CPU time or wall time")
    parser.add_argument("--json", dest="json_path", help="also write every figure and sample here")
    options = parser.parse_args(argv)
    if options.plan_repeats < 1 or options.step_repeats < 1:
        parser.error("--plan-repeats and --step-repeats must be at least 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    clock = _CLOCKS[options.clock]
    report: dict[str, Any] = {"clock": options.clock}
    if options.skip != "planning":
        planning = measure_cold_planning(options.plan_repeats, clock)
        print(format_planning(planning, options.clock), end="\n\n")
        report["planning"] = {**asdict(planning), "median_us_per_plan": planning.median_us_per_plan}
    if options.skip != "step":
        step = run_step_benchmark(options.step_repeats, clock, TransformerConfig())
        print(format_step(step, options.clock))
        report["step"] = {
            **asdict(step),
            "cold_median_ms": step.cold_median_ms,
            "warm_median_ms": step.warm_median_ms,
            "deciding_ms": step.deciding_ms,
            "deciding_ms_from_minimums": step.deciding_ms_from_minimums,
        }
    if options.json_path:
        with open(options.json_path, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
