"""An FSDP x TP training step: shardwise's ``fully_shard`` vs PyTorch's, same model, mesh and data, one run.

Run (from the repository root)::

    PYTHONPATH=mesh:placement:dtensor_ops:testing:tp_styles:fsdp_ext:tools python -m shardwise.tools.bench_fsdp_step
    ... --steps 20 --warmup 3 --dp 2 --tp 2

It starts ``dp * tp`` gloo ranks on this machine.  Every rank builds the demo trainer's
Transformer once per implementation from the same seed, lays it out with that implementation's
tensor parallelism on ``mesh["tp"]`` (the plan of ``bench_tp_step``, which is the trainer's) and
then applies that implementation's ``fully_shard`` to every block and to the root on
``mesh["dp"]`` of a ``(dp, tp)`` mesh; each dp rank trains on its share of every batch:

* ``torch``: ``torch.distributed.tensor`` + ``.parallel`` + ``torch.distributed.fsdp.fully_shard``
  (attention under ``SDPBackend.MATH`` and ``implicit_replication``: PyTorch's DTensor has no rule
  for the CPU flash-attention kernel, see ``bench_tp_step``);
* ``shardwise-math``: shardwise (``shardwise.fsdp_ext.fully_shard``) under the same attention backend;
* ``shardwise``: shardwise with the default kernel.

Step time, CPU time and peak memory are measured exactly as in ``bench_tp_step`` (wall time of
the slowest rank between barriers, median over rounds that rotate the implementations; CPU time
summed over ranks; peak = this rank's parameter shards and optimizer state + the transient peak
of PyTorch's CPU allocator over one profiled step, largest rank).  The table gives ratios to
``torch``.  PyTorch's stack is imported here only to compare against.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import tempfile
import traceback
from dataclasses import asdict, replace
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from shardwise.tools.bench_tp_step import (
    BenchConfig,
    ImplementationResult,
    _batches,
    _build_model,
    _count_collectives,
    _free_port,
    _guard,
    _profiled_allocation_sizes,
    _Stack,
    _stack,
    _time_rounds,
    _transformer_plan,
    transient_peak_bytes,
)
from shardwise.tools.train._loop import clip_gradients, reduce_partial_gradients

IMPLEMENTATIONS = ("torch", "shardwise-math", "shardwise")


def _mesh_2d(stack: _Stack, dp: int, tp: int) -> Any:
    if stack.name == "torch":
        from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

        return torch_init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    from shardwise.mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def _fully_shard(stack: _Stack) -> Callable[..., nn.Module]:
    if stack.name == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        return torch_fully_shard  # type: ignore[return-value]
    from shardwise.fsdp_ext import fully_shard

    return fully_shard


class _FSDPTrainer:
    def __init__(self, stack: _Stack, config: BenchConfig, dp: int, tp: int) -> None:
        self.stack = stack
        self.config = config
        mesh = _mesh_2d(stack, dp, tp)
        self.dp_rank, self.dp = mesh.get_local_rank("dp"), dp
        model = _build_model(config)
        stack.parallel.parallelize_module(
            model, mesh["tp"], _transformer_plan(stack, config.seq_parallel, config.loss_parallel)
        )
        model.get_submodule("output").weight = model.get_submodule("tok_embeddings").weight
        fully_shard = _fully_shard(stack)
        for block in model.get_submodule("layers").children():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, foreach=config.foreach)

    def _loss_context(self) -> ContextManager[object]:
        if self.config.loss_parallel:
            return self.stack.parallel.loss_parallel()
        return contextlib.nullcontext()

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        inputs, targets = batch
        share = inputs.shape[0] // self.dp
        rows = slice(self.dp_rank * share, (self.dp_rank + 1) * share)
        with self.stack.attention_context(), self._loss_context():
            output = self.model(inputs[rows])
            loss = F.cross_entropy(output.flatten(0, 1), targets[rows].flatten())
            loss.backward()
        dtensor_class = self.stack.tensor.DTensor
        reduce_partial_gradients(self.model, dtensor_class)
        if self.config.clip_grad_norm > 0:
            clip_gradients(list(self.model.parameters()), self.config.clip_grad_norm, dtensor_class)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        value = loss.full_tensor() if isinstance(loss, dtensor_class) else loss
        return float(value.detach().item())

    def state_bytes(self) -> int:
        seen: dict[int, int] = {}

        def add(tensor: torch.Tensor) -> None:
            local = getattr(tensor, "_local_tensor", tensor)
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()

        for parameter in self.model.parameters():
            add(parameter)
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    add(value)
        return sum(seen.values())


def _run_on_rank(config: BenchConfig, dp: int, tp: int) -> list[ImplementationResult]:
    world_size = dp * tp
    batches = _batches(config, config.warmup + config.steps + 2)
    results = {name: ImplementationResult(name) for name in config.implementations}
    trainers: dict[str, _FSDPTrainer] = {}
    guarded = _guard(results, trainers)

    for name in config.implementations:
        def build(name: str = name) -> None:
            trainers[name] = _FSDPTrainer(_stack(name), config, dp, tp)
            for step in range(config.warmup):
                results[name].losses.append(trainers[name].step(batches[step]))

        guarded(name, build)

    _time_rounds(trainers, batches, config, results, guarded)

    for name in list(trainers):
        def measure(name: str = name) -> None:
            trainer = trainers[name]
            state = trainer.state_bytes()
            batch = batches[config.warmup + config.steps]
            peak = transient_peak_bytes(_profiled_allocation_sizes(lambda: trainer.step(batch)))
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, (state, peak))
            results[name].state_bytes = [int(item[0]) for item in gathered]
            results[name].transient_peak_bytes = [int(item[1]) for item in gathered]
            results[name].collectives_per_step = _count_collectives(
                trainer.stack, lambda: trainer.step(batches[config.warmup + config.steps + 1])
            )

        guarded(name, measure)
    return [results[name] for name in config.implementations]


def _rank_main(rank: int, port: int, config: BenchConfig, dp: int, tp: int, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=dp * tp,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        results = _run_on_rank(config, dp, tp)
        if rank == 0:
            with open(out_path, "w", encoding="utf-8") as handle:
                json.dump([asdict(result) for result in results], handle)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as bench_tp_step: no teardown of c10d groups whose peers may be exiting


def run(config: BenchConfig, dp: int, tp: int) -> list[ImplementationResult]:
    port = _free_port()
    with tempfile.TemporaryDirectory() as scratch:
        out_path = os.path.join(scratch, "results.json")
        mp.spawn(_rank_main, args=(port, config, dp, tp, out_path), nprocs=dp * tp)
        with open(out_path, encoding="utf-8") as handle:
            raw = json.load(handle)
    return [ImplementationResult(**item) for item in raw]


def format_report(config: BenchConfig, dp: int, tp: int, results: list[ImplementationResult]) -> str:
    lines = [
        f"FSDP x TP step, mesh dp={dp} x tp={tp} (gloo, CPU); Transformer dim={config.dim} layers={config.n_layers} "
        f"heads={config.n_heads} vocab={config.vocab_size}, batch {config.batch_size}x{config.seq_len} "
        f"({config.batch_size // dp} per dp rank); {config.steps} timed rounds after {config.warmup} warm-up steps",
        f"{'implementation':<16}{'step ms':>10}{'cpu ms':>10}{'peak MiB':>10}{'state MiB':>11}"
        f"{'step/torch':>12}{'cpu/torch':>11}{'peak/torch':>12}",
    ]
    by_name = {result.name: result for result in results}
    torch_result = by_name.get("torch")
    for result in results:
        if result.error is not None:
            lines.append(f"{result.name:<16}failed: {result.error}")
            continue

        def ratio(mine: float, theirs: float | None) -> str:
            return f"{mine / theirs:.2f}" if theirs else "-"

        lines.append(
            f"{result.name:<16}{result.median_step_seconds * 1e3:>10.1f}{result.median_step_cpu_seconds * 1e3:>10.1f}"
            f"{result.peak_bytes / 2**20:>10.2f}{max(result.state_bytes) / 2**20:>11.2f}"
            f"{ratio(result.median_step_seconds, torch_result.median_step_seconds if torch_result and not torch_result.error else None):>12}"
            f"{ratio(result.median_step_cpu_seconds, torch_result.median_step_cpu_seconds if torch_result and not torch_result.error else None):>11}"
            f"{ratio(result.peak_bytes, torch_result.peak_bytes if torch_result and not torch_result.error else None):>12}"
        )
    for result in results:
        if result.error is None:
            lines.append(f"  {result.name} collectives/step: {result.collectives_per_step}")
    finished = [result for result in results if result.error is None and result.losses]
    if len(finished) > 1:
        first = finished[0]
        worst = max(
            abs(a - b) for other in finished[1:] for a, b in zip(first.losses, other.losses)
        )
        lines.append(f"  losses agree across implementations to {worst:.2e} (max |difference| over all steps)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardwise.tools.bench_fsdp_step", description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--json", default=None, help="write every figure to this file")
    options = parser.parse_args(argv)
    config = replace(
        BenchConfig(),
        world_size=options.dp * options.tp,
        steps=options.steps,
        warmup=options.warmup,
        dim=options.dim,
        n_layers=options.n_layers,
        batch_size=options.batch_size,
        seq_len=options.seq_len,
        implementations=IMPLEMENTATIONS,
    )
    results = run(config, options.dp, options.tp)
    print(format_report(config, options.dp, options.tp, results))
    if options.json:
        with open(options.json, "w", encoding="utf-8") as handle:
            json.dump([asdict(result) for result in results], handle, indent=2)
    return 0 if all(result.error is None for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
