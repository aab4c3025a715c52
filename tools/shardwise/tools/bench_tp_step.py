"""A tensor-parallel training step: shardwise vs PyTorch's DTensor, same model, mesh and data, one run.

Run (from the repository root)::

    PYTHONPATH=mesh:placement:dtensor_ops:testing:tp_styles:tools python -m shardwise.tools.bench_tp_step
    ... --steps 30 --warmup 3           # timed rounds and untimed warm-up steps per implementation
    ... --model mlp                     # an MLP stack instead of the Transformer
    ... --no-seq-parallel --no-loss-parallel
    ... --json out.json                 # everything, per step
    ... --gloo-all-to-all               # shardwise with SHARDWISE_GLOO_ALL_TO_ALL=1 (see below)

It starts ``--world-size`` (default 4) gloo ranks on this machine.  Every rank builds the
model of the demo trainer (``shardwise.testing.Transformer`` with the trainer's initialisation;
or, with ``--model mlp``, a stack of Linear-GELU-Linear blocks) once per implementation from
the same seed, lays it out with that implementation's ``parallelize_module`` and the same plan
(the trainer's: attention by heads, feed-forward by hidden unit, embedding/output by
vocabulary, optionally sequence parallel and loss parallel), and trains it with AdamW on the
same batches:

* ``torch``: PyTorch's ``torch.distributed.tensor`` + ``torch.distributed.tensor.parallel``.
  PyTorch's DTensor has no sharding rule for the CPU flash-attention kernel that
  ``F.scaled_dot_product_attention`` picks on CPU, so its steps run under
  ``sdpa_kernel(SDPBackend.MATH)`` (attention decomposed into matmul/softmax ops), and inside
  ``implicit_replication()``, because the math kernel adds a causal mask that it builds as a plain
  tensor to the DTensor attention scores, which DTensor otherwise refuses;
* ``shardwise-math``: shardwise under the same ``SDPBackend.MATH`` and ``implicit_replication()``: the same aten ops as
  ``torch``, so the ratio of the two is the cost of the two DTensor stacks;
* ``shardwise``: shardwise with the default kernel (what a user gets).

Step time (wall): a step is what the demo trainer does: forward, loss, backward, one reduction of
the ``Partial`` gradients of the sequence-parallel norms, clipping of the global gradient norm
(``--clip-grad-norm``), ``optimizer.step()`` and ``zero_grad``.  After
``--warmup`` steps of each implementation, ``--steps`` rounds run one step of each
implementation in turn (the order rotates every round); each step starts after a barrier and
ends after a barrier, so rank 0's wall-clock time of it is the slowest rank's step.  The figure
is the median over the rounds.  On a shared, loaded machine wall time mostly measures the
other load, so each rank also measures its process CPU time over the step (``time.process_time``,
all threads, gloo's included; blocking waits cost none) and the table shows the median over the
rounds of its sum over ranks: the CPU cost of a step, robust to load.

Peak memory: one more step of each implementation runs under ``torch.profiler`` with
``profile_memory=True``, which records every allocation and free made through PyTorch's CPU
allocator (all tensor storage: activations, gradients, optimizer temporaries, collective
buffers) in order.  The transient peak is the highest running total of bytes allocated minus
bytes freed since the step began; the resident state is the bytes of the storages of this
rank's local parameter shards and optimizer states at the start of the step (gradients are
``None`` then).  Peak = state + transient peak, per rank; the table shows the largest rank.
Python objects and gloo's own buffers are not tensor storage and are not counted (the same
for both stacks).  Process RSS is not used: it only grows, and is dominated by the libraries.

The losses of the implementations are compared step by step: they train the same model on the
same data, so they must agree to float32 round-off, or the timings would not compare the same work.

``--gloo-all-to-all`` runs the shardwise implementations with ``SHARDWISE_GLOO_ALL_TO_ALL=1``:
their redistributions' reduce-scatters and all-gathers go as one ``all_to_all_single`` each (the same
bytes per rank, one round of direct sends instead of gloo's all-reduce-based reduce-scatter and ring
all-gather), so the collective counts show all-to-alls in their place.  Off by default: PyTorch's
collective kinds are part of the drop-in contract (``CommDebugMode`` counts).

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
import warnings
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any, Callable, ContextManager, Iterator, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shardwise.tools.train._loop import clip_gradients, reduce_partial_gradients

__all__ = ["BenchConfig", "ImplementationResult", "main", "run", "format_report", "transient_peak_bytes"]

IMPLEMENTATIONS = ("torch", "shardwise-math", "shardwise")
MODELS = ("transformer", "mlp")


@dataclass(frozen=True)
class BenchConfig:
    world_size: int = 4
    model: str = "transformer"
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 32
    batch_size: int = 8
    vocab_size: int = 64
    steps: int = 20
    warmup: int = 3
    seq_parallel: bool = True
    loss_parallel: bool = True
    foreach: bool = True
    lr: float = 3e-3
    clip_grad_norm: float = 1.0
    seed: int = 0
    implementations: tuple[str, ...] = IMPLEMENTATIONS
    gloo_all_to_all: bool = False


@dataclass
class ImplementationResult:
    name: str
    error: str | None = None
    step_seconds: list[float] = field(default_factory=list)  # wall clock, barrier to barrier, per round
    step_cpu_seconds: list[float] = field(default_factory=list)  # CPU time of all ranks together, per round
    losses: list[float] = field(default_factory=list)
    state_bytes: list[int] = field(default_factory=list)  # per rank
    transient_peak_bytes: list[int] = field(default_factory=list)  # per rank
    collectives_per_step: dict[str, int] = field(default_factory=dict)

    @property
    def median_step_seconds(self) -> float:
        return statistics.median(self.step_seconds) if self.step_seconds else float("nan")

    @property
    def median_step_cpu_seconds(self) -> float:
        return statistics.median(self.step_cpu_seconds) if self.step_cpu_seconds else float("nan")

    @property
    def peak_bytes(self) -> int:
        """The largest rank's resident state + transient peak."""
        if not self.state_bytes:
            return 0
        return max(state + peak for state, peak in zip(self.state_bytes, self.transient_peak_bytes))


# -- the two stacks behind one interface -------------------------------------------------------


@dataclass
class _Stack:
    name: str
    tensor: ModuleType  # DTensor, Shard, Replicate, init_device_mesh
    parallel: ModuleType  # parallel styles, parallelize_module, loss_parallel
    comm_debug_mode: Callable[[], Any]
    implicit_replication: Callable[[], ContextManager[object]]
    attention_backend: SDPBackend | None  # None: PyTorch's choice

    @contextlib.contextmanager
    def attention_context(self) -> Iterator[None]:
        if self.attention_backend is None:
            yield
            return
        # The math backend builds the causal mask as a plain tensor and adds it to the DTensor
        # scores; implicit replication lets that plain tensor (equal on every rank) take part.
        with sdpa_kernel(self.attention_backend), self.implicit_replication():
            yield


def _stack(name: str) -> _Stack:
    if name == "torch":
        import torch.distributed.tensor as torch_tensor
        import torch.distributed.tensor.parallel as torch_parallel
        from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode
        from torch.distributed.tensor.experimental import implicit_replication as torch_implicit_replication

        return _Stack(
            name, torch_tensor, torch_parallel, TorchCommDebugMode, torch_implicit_replication, SDPBackend.MATH
        )
    import shardwise.dtensor_ops as shardwise_tensor
    import shardwise.tp_styles as shardwise_parallel
    from shardwise.dtensor_ops.debug import CommDebugMode
    from shardwise.dtensor_ops.experimental import implicit_replication

    backend = SDPBackend.MATH if name == "shardwise-math" else None
    return _Stack(name, shardwise_tensor, shardwise_parallel, CommDebugMode, implicit_replication, backend)


def _init_device_mesh(stack: _Stack, world_size: int) -> Any:
    if stack.name == "torch":
        from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

        return torch_init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    from shardwise.mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))


def _transformer_plan(stack: _Stack, seq_parallel: bool, loss_parallel: bool) -> dict[str, Any]:
    # The plan of the demo trainer (shardwise.testing.Transformer.parallelize), spelled with
    # whichever stack's classes so that both get exactly the same layout.
    Shard, Replicate = stack.tensor.Shard, stack.tensor.Replicate
    styles = stack.parallel
    residual = Shard(1) if seq_parallel else Replicate()
    plan: dict[str, Any] = {
        "tok_embeddings": styles.RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "pos_embeddings": styles.ColwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(0) if seq_parallel else Replicate()
        ),
    }
    if seq_parallel:
        plan["layers.*.attention_norm"] = styles.SequenceParallel()
        plan["layers.*.ffn_norm"] = styles.SequenceParallel()
        plan["layers.*.attention"] = styles.PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate()
        )
    plan["layers.*.attention.w[qkv]"] = styles.ColwiseParallel(use_local_output=False)
    plan["layers.*.attention.wo"] = styles.RowwiseParallel(output_layouts=residual)
    plan["layers.*.feed_forward.w1"] = styles.ColwiseParallel(input_layouts=residual)
    plan["layers.*.feed_forward.w2"] = styles.RowwiseParallel(output_layouts=residual)
    if seq_parallel:
        plan["norm"] = styles.SequenceParallel()
    plan["output"] = styles.ColwiseParallel(
        input_layouts=residual,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )
    return plan


class MLPBlock(nn.Module):
    """``x + w2(gelu(w1(x)))`` with ``w1``: dim -> 4 dim."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.gelu(self.w1(x)))


class MLPStack(nn.Module):
    """``n_layers`` MLPBlocks on ``(batch, seq, dim)``."""

    def __init__(self, dim: int, n_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(dim) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _mlp_plan(stack: _Stack) -> dict[str, Any]:
    return {"layers.*.w1": stack.parallel.ColwiseParallel(), "layers.*.w2": stack.parallel.RowwiseParallel()}


def _build_model(config: BenchConfig) -> nn.Module:
    if config.model == "mlp":
        torch.manual_seed(config.seed)
        return MLPStack(config.dim, config.n_layers)
    from shardwise.tools.train._model import build_model
    from shardwise.testing import ModelArgs

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
    return build_model(args, config.seed, torch.device("cpu"))


def _parallelized_model(stack: _Stack, config: BenchConfig, mesh: Any) -> nn.Module:
    model = _build_model(config)
    if config.model == "mlp":
        return stack.parallel.parallelize_module(model, mesh, _mlp_plan(stack))
    stack.parallel.parallelize_module(model, mesh, _transformer_plan(stack, config.seq_parallel, config.loss_parallel))
    # Both styles laid out a copy of the tied weight: tie them again (as the trainer does).
    model.get_submodule("output").weight = model.get_submodule("tok_embeddings").weight
    return model


def _batches(config: BenchConfig, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(config.seed + 1)
    batches = []
    for _ in range(count):
        if config.model == "mlp":
            inputs = torch.randn(config.batch_size, config.seq_len, config.dim, generator=generator)
            targets = torch.randn(config.batch_size, config.seq_len, config.dim, generator=generator)
        else:
            inputs = torch.randint(0, config.vocab_size, (config.batch_size, config.seq_len), generator=generator)
            targets = torch.randint(0, config.vocab_size, (config.batch_size, config.seq_len), generator=generator)
        batches.append((inputs, targets))
    return batches


class _Trainer:
    """One implementation's model, optimizer and step."""

    def __init__(self, stack: _Stack, config: BenchConfig, mesh: Any) -> None:
        self.stack = stack
        self.config = config
        self.model = _parallelized_model(stack, config, mesh)
        # DTensor and plain parameters (the norms without sequence parallelism) in separate groups:
        # one foreach call cannot take both kinds (as in the trainer's build_optimizer).
        parameters = list(self.model.parameters())
        distributed = [p for p in parameters if isinstance(p, stack.tensor.DTensor)]
        plain = [p for p in parameters if not isinstance(p, stack.tensor.DTensor)]
        groups: list[dict[str, Any]] = [{"params": group} for group in (distributed, plain) if group]
        self.optimizer = torch.optim.AdamW(groups, lr=config.lr, foreach=config.foreach)

    def _loss_context(self) -> ContextManager[object]:
        if self.config.model == "transformer" and self.config.loss_parallel:
            return self.stack.parallel.loss_parallel()
        return contextlib.nullcontext()

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        inputs, targets = batch
        with self.stack.attention_context(), self._loss_context():
            output = self.model(inputs)
            if self.config.model == "mlp":
                loss = F.mse_loss(output, targets)
            else:
                loss = F.cross_entropy(output.flatten(0, 1), targets.flatten())
            loss.backward()
        # As the trainer does: the sequence-parallel norms' Partial gradients are reduced once (not
        # once per optimizer op that reads them), then the global gradient norm is clipped.
        dtensor_class = self.stack.tensor.DTensor
        reduce_partial_gradients(self.model, dtensor_class)
        if self.config.clip_grad_norm > 0:
            clip_gradients(list(self.model.parameters()), self.config.clip_grad_norm, dtensor_class)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.item())

    def state_bytes(self) -> int:
        """Bytes of this rank's parameter shards and optimizer states (each storage once)."""
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


def transient_peak_bytes(allocation_sizes: list[int]) -> int:
    """The highest running total of a sequence of allocations (+bytes) and frees (-bytes), at least 0."""
    running = peak = 0
    for size in allocation_sizes:
        running += size
        peak = max(peak, running)
    return peak


def _profiled_allocation_sizes(run_step: Callable[[], object]) -> list[int]:
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        run_step()

    def walk(nodes: list[Any]) -> Iterator[Any]:
        for node in nodes:
            yield node
            yield from walk(node.children)

    events = [
        event
        for event in walk(profiler.profiler.kineto_results.experimental_event_tree())
        if event.tag == _EventType.Allocation and str(event.extra_fields.device) == "cpu"
    ]
    events.sort(key=lambda event: event.start_time_ns)
    return [int(event.extra_fields.alloc_size) for event in events]


def _count_collectives(stack: _Stack, run_step: Callable[[], object]) -> dict[str, int]:
    mode = stack.comm_debug_mode()
    with warnings.catch_warnings():
        # PyTorch's CommDebugMode tracks modules with full backward hooks, which warn when a
        # module's inputs (token ids) need no gradient; irrelevant to the counts.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        with mode:
            run_step()
    counts: dict[str, int] = {}
    for key, count in mode.get_comm_counts().items():
        if count:
            name = str(key).rsplit(".", 1)[-1]
            counts[name] = counts.get(name, 0) + int(count)
    return dict(sorted(counts.items()))


class _Steps(Protocol):
    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float: ...


def _timed_step(trainer: _Steps, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float, float]:
    """(wall seconds of the slowest rank, this rank's CPU seconds, loss)."""
    dist.barrier()
    started, cpu_started = time.perf_counter(), time.process_time()
    loss = trainer.step(batch)
    cpu_seconds = time.process_time() - cpu_started
    dist.barrier()
    return time.perf_counter() - started, cpu_seconds, loss


Guard = Callable[[str, Callable[[], None]], None]


def _guard(results: dict[str, ImplementationResult], trainers: dict[str, Any]) -> Guard:
    """``guarded(name, action)``: runs ``action``; if it raised on any rank, every rank drops ``name``."""

    def guarded(name: str, action: Callable[[], None]) -> None:
        # Errors in one implementation are deterministic (the same on every rank), so the ranks
        # agree to drop it and go on with the others.
        try:
            action()
            failed = 0
        except Exception:  # noqa: BLE001 - reported in the table, not hidden
            results[name].error = traceback.format_exc(limit=-3).strip().splitlines()[-1]
            failed = 1
        flags = torch.tensor([failed])
        dist.all_reduce(flags)
        if int(flags.item()):
            trainers.pop(name, None)
            results[name].error = results[name].error or "failed on another rank"

    return guarded


def _time_rounds(
    trainers: dict[str, Any],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    config: BenchConfig,
    results: dict[str, ImplementationResult],
    guarded: Guard,
) -> None:
    """``config.steps`` timed rounds, one step per implementation each, the order rotating every round."""
    for round_index in range(config.steps):
        order = list(trainers)
        shift = round_index % max(len(order), 1)
        for name in order[shift:] + order[:shift]:
            def timed(name: str = name) -> None:
                seconds, cpu_seconds, loss = _timed_step(trainers[name], batches[config.warmup + round_index])
                all_ranks = torch.tensor([cpu_seconds], dtype=torch.float64)
                dist.all_reduce(all_ranks)
                results[name].step_seconds.append(seconds)
                results[name].step_cpu_seconds.append(float(all_ranks.item()))
                results[name].losses.append(loss)

            if name in trainers:
                guarded(name, timed)


def _rank_main(rank: int, world_size: int, port: int, config: BenchConfig, out_path: str) -> None:
    torch.set_num_threads(1)  # the ranks share this machine's cores
    if config.gloo_all_to_all:
        # Read by shardwise when it compiles a redistribution; PyTorch's DTensor ignores it.
        os.environ["SHARDWISE_GLOO_ALL_TO_ALL"] = "1"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        results = _run_on_rank(rank, world_size, config)
        if rank == 0:
            with open(out_path, "w", encoding="utf-8") as handle:
                json.dump([asdict(result) for result in results], handle)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # No interpreter teardown for a rank that succeeded: shardwise.mesh keeps its c10d groups
    # referenced after destroy_process_group, so they would be destroyed during teardown, where a
    # gloo group whose peers are still exiting can abort the process (SIGABRT) after a good run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_on_rank(rank: int, world_size: int, config: BenchConfig) -> list[ImplementationResult]:
    batches = _batches(config, config.warmup + config.steps + 2)
    results = {name: ImplementationResult(name) for name in config.implementations}
    trainers: dict[str, _Trainer] = {}
    guarded = _guard(results, trainers)

    for name in config.implementations:
        def build(name: str = name) -> None:
            trainers[name] = _Trainer(_stack(name), config, _init_device_mesh(_stack(name), world_size))
            for step in range(config.warmup):
                results[name].losses.append(trainers[name].step(batches[step]))

        guarded(name, build)

    _time_rounds(trainers, batches, config, results, guarded)

    memory_batch = batches[config.warmup + config.steps]
    for name in list(trainers):
        def measure(name: str = name) -> None:
            trainer = trainers[name]
            state = trainer.state_bytes()
            peak = transient_peak_bytes(_profiled_allocation_sizes(lambda: trainer.step(memory_batch)))
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, (state, peak))
            results[name].state_bytes = [int(item[0]) for item in gathered]
            results[name].transient_peak_bytes = [int(item[1]) for item in gathered]
            results[name].collectives_per_step = _count_collectives(
                trainer.stack, lambda: trainer.step(batches[config.warmup + config.steps + 1])
            )

        guarded(name, measure)
    return [results[name] for name in config.implementations]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run(config: BenchConfig) -> list[ImplementationResult]:
    port = _free_port()
    with tempfile.TemporaryDirectory() as scratch:
        out_path = os.path.join(scratch, "results.json")
        mp.spawn(_rank_main, args=(config.world_size, port, config, out_path), nprocs=config.world_size)
        with open(out_path, encoding="utf-8") as handle:
            raw = json.load(handle)
    return [ImplementationResult(**item) for item in raw]


def _mib(size: int) -> str:
    return f"{size / 2**20:8.2f}"


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def format_report(config: BenchConfig, results: list[ImplementationResult]) -> str:
    model = (
        f"Transformer dim={config.dim} layers={config.n_layers} heads={config.n_heads} vocab={config.vocab_size}"
        if config.model == "transformer"
        else f"MLP stack dim={config.dim} layers={config.n_layers}"
    )
    features = []
    if config.model == "transformer":
        features.append(f"sequence parallel {'on' if config.seq_parallel else 'off'}")
        features.append(f"loss parallel {'on' if config.loss_parallel else 'off'}")
    lines = [
        f"TP training step on {config.world_size} CPU ranks (gloo): {model}, batch {config.batch_size}x{config.seq_len}, "
        f"AdamW ({'foreach' if config.foreach else 'for-loop'}){'; ' + ', '.join(features) if features else ''}"
        f"{'; shardwise with SHARDWISE_GLOO_ALL_TO_ALL=1' if config.gloo_all_to_all else ''}",
        f"medians of {config.steps} rounds after {config.warmup} warm-up steps each; wall: slowest rank, "
        "CPU: all ranks together; memory: largest rank, tensor storage",
        "",
        f"{'implementation':<15} {'wall ms':>8} {'(p10-p90)':>15} {'CPU ms':>8} {'state MiB':>9} {'transient':>9} "
        f"{'peak MiB':>8}  collectives/step",
    ]
    reference = next((result for result in results if result.name == "torch" and result.error is None), None)
    for result in results:
        if result.error is not None:
            lines.append(f"{result.name:<15} failed: {result.error}")
            continue
        low, high = _percentile(result.step_seconds, 0.1), _percentile(result.step_seconds, 0.9)
        worst_rank = max(
            range(len(result.state_bytes)), key=lambda rank: result.state_bytes[rank] + result.transient_peak_bytes[rank]
        ) if result.state_bytes else 0
        collectives = ", ".join(f"{name} {count}" for name, count in result.collectives_per_step.items()) or "none"
        lines.append(
            f"{result.name:<15} {result.median_step_seconds * 1e3:>8.1f} {f'({low * 1e3:.0f}-{high * 1e3:.0f})':>15} "
            f"{result.median_step_cpu_seconds * 1e3:>8.1f} "
            f"{_mib(result.state_bytes[worst_rank]) if result.state_bytes else '-':>9} "
            f"{_mib(result.transient_peak_bytes[worst_rank]) if result.state_bytes else '-':>9} "
            f"{_mib(result.peak_bytes):>8}  {collectives}"
        )
    if reference is not None:
        lines.append("")
        for result in results:
            if result.error is not None or result is reference:
                continue
            wall_ratio = result.median_step_seconds / reference.median_step_seconds
            cpu_ratio = result.median_step_cpu_seconds / reference.median_step_cpu_seconds
            memory_ratio = result.peak_bytes / reference.peak_bytes if reference.peak_bytes else float("nan")
            count = min(len(result.losses), len(reference.losses))
            loss_diff = max((abs(result.losses[i] - reference.losses[i]) for i in range(count)), default=0.0)
            lines.append(
                f"{result.name} / torch: step time x{wall_ratio:.2f} wall, x{cpu_ratio:.2f} CPU; peak memory "
                f"x{memory_ratio:.2f} (losses agree to {loss_diff:.2g} over {count} steps)"
            )
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> tuple[BenchConfig, str | None]:
    defaults = BenchConfig()
    parser = argparse.ArgumentParser(prog="python -m shardwise.tools.bench_tp_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=defaults.world_size)
    parser.add_argument("--model", choices=MODELS, default=defaults.model)
    for name in ("dim", "n_layers", "n_heads", "seq_len", "batch_size", "vocab_size", "steps", "warmup", "seed"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument(
        "--clip-grad-norm", type=float, default=defaults.clip_grad_norm, help="0: no gradient clipping"
    )
    parser.add_argument("--seq-parallel", action=argparse.BooleanOptionalAction, default=defaults.seq_parallel)
    parser.add_argument("--loss-parallel", action=argparse.BooleanOptionalAction, default=defaults.loss_parallel)
    parser.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=defaults.foreach)
    parser.add_argument(
        "--gloo-all-to-all", action="store_true", default=defaults.gloo_all_to_all,
        help="shardwise's reduce-scatters and all-gathers as one all-to-all each (SHARDWISE_GLOO_ALL_TO_ALL=1)",
    )
    parser.add_argument(
        "--implementations", nargs="+", choices=IMPLEMENTATIONS, default=list(defaults.implementations),
        help="which to run (torch is the reference of the ratios)",
    )
    parser.add_argument("--json", default=None, help="write the configuration and every figure to this file")
    namespace = parser.parse_args(argv)
    values = vars(namespace)
    json_path = values.pop("json")
    values["implementations"] = tuple(values["implementations"])
    config = BenchConfig(**values)
    if config.world_size < 1 or config.steps < 1 or config.warmup < 0:
        parser.error("--world-size and --steps must be >= 1, --warmup >= 0")
    if config.model == "transformer":
        if config.n_heads % config.world_size or config.dim % config.n_heads:
            parser.error(
                f"--n-heads {config.n_heads} must be a multiple of --world-size {config.world_size} "
                f"and divide --dim {config.dim}"
            )
        if config.vocab_size % config.world_size:
            parser.error(f"--vocab-size {config.vocab_size} must be a multiple of --world-size {config.world_size}")
        if config.seq_parallel and config.seq_len % config.world_size:
            parser.error(
                f"--seq-len {config.seq_len} must be a multiple of --world-size {config.world_size} with --seq-parallel"
            )
    return config, json_path


def main(argv: list[str] | None = None) -> int:
    config, json_path = _parse(argv)
    results = run(config)
    print(format_report(config, results))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as handle:
            json.dump({"config": asdict(config), "results": [asdict(result) for result in results]}, handle, indent=2)
    return 0 if all(result.error is None for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
