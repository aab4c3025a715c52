"""One training loop for both runs: tensor-parallel (DTensor) and the single-process reference."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Mapping, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from shardwise.dtensor_ops import DTensor, redistribute_together
from shardwise.dtensor_ops._cost_model import received_bytes
from shardwise.dtensor_ops.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

from ._data import CharCorpus

__all__ = [
    "PHASES",
    "StepRecord",
    "train_loop",
    "comm_counts_by_name",
    "language_model_loss",
    "reduce_partial_gradients",
    "clip_gradients",
    "sum_gradients_over",
]

# A step's collectives are counted separately in each of these phases.
PHASES = ("forward", "backward", "optimizer")


@dataclass
class StepRecord:
    step: int  # 1-based
    loss: float
    seconds: float
    # {phase: {collective name: count}}; only for the steps whose collectives were counted.
    collectives: dict[str, dict[str, int]] | None = field(default=None)
    # Bytes one rank received in those collectives (the cost model's convention); counted steps only.
    bytes_received: float | None = field(default=None)

    @property
    def total_collectives(self) -> int | None:
        if self.collectives is None:
            return None
        return sum(sum(counts.values()) for counts in self.collectives.values())


def comm_counts_by_name(counts: Mapping[Any, int]) -> dict[str, int]:
    """``{"all_reduce": 2, ...}`` from CommDebugMode's counts keyed by op packets."""
    by_name: dict[str, int] = {}
    for key, count in counts.items():
        if count:
            name = str(key).rsplit(".", 1)[-1]
            by_name[name] = by_name.get(name, 0) + int(count)
    return dict(sorted(by_name.items()))


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Mean next-character cross-entropy in ``dtype``; ``logits`` is ``(batch, seq, vocab)``, possibly a
    vocabulary-sharded DTensor.

    The model hands back float32 logits whatever its dtype.  Taking the loss in the training
    dtype matters for the parity check under ``loss_parallel``: its log-softmax over vocabulary
    shards rounds differently from the fused single-device kernel, by ~1e-7 in float32, which
    AdamW then amplifies; in float64 the difference is ~1e-16.
    """
    return F.cross_entropy(logits.to(dtype).flatten(0, 1), targets.flatten())


def reduce_partial_gradients(model: nn.Module, distributed_type: type[torch.Tensor] = DTensor) -> None:
    """Turns each gradient that is a ``Partial`` DTensor into its parameter's placements, once.

    Parameters replicated over sequence-parallel activations (the norms' weights and biases) get
    ``Partial`` gradients: each rank holds the contribution of its part of the sequence.  Left
    as they are, every optimizer op that reads such a gradient reduces it again (AdamW reads it
    three times, so three all-reduces per parameter per step, as with PyTorch's DTensor).
    With shardwise's DTensor they go through ``redistribute_together``: the gradients are small, so
    their all-reduces are latency-bound, and it runs those of one mesh dim as one all-reduce.
    ``distributed_type``: the DTensor class (the benchmark passes PyTorch's, which has no such call:
    there each gradient is redistributed on its own).
    """
    partial: list[tuple[nn.Parameter, Any]] = []
    for parameter in model.parameters():
        if not (isinstance(parameter.grad, distributed_type) and isinstance(parameter, distributed_type)):
            continue
        # Typed as plain tensors here; both DTensor classes have these attributes.
        gradient = cast(Any, parameter.grad)
        if any(placement.is_partial() for placement in gradient.placements):
            partial.append((parameter, gradient))
    if distributed_type is DTensor:
        reduced = redistribute_together(
            [gradient for _, gradient in partial], [cast(Any, parameter).placements for parameter, _ in partial]
        )
        for (parameter, _), gradient in zip(partial, reduced):
            parameter.grad = gradient
        return
    for parameter, gradient in partial:
        target = cast(Any, parameter)
        parameter.grad = gradient.redistribute(target.device_mesh, target.placements)


def clip_gradients(
    parameters: list[nn.Parameter], max_norm: float, distributed_type: type[torch.Tensor] = DTensor
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a mix of DTensor and plain parameters; returns the norm.

    One multi-tensor call cannot take both kinds (without sequence parallelism the norms keep
    plain parameters), nor DTensors of different meshes (Llama's plain norms become DTensors on the
    dp mesh under FSDP, its tensor-parallel weights live on (dp, tp)), so each kind, and each mesh
    of DTensors, has its norm taken on its own, the global norm is combined from them, and each
    group is scaled on its own.  ``distributed_type``: the DTensor class.
    """
    with_gradients = [parameter for parameter in parameters if parameter.grad is not None]
    kinds: list[list[nn.Parameter]] = []
    meshes: list[Any] = []
    for parameter in with_gradients:
        if not isinstance(parameter.grad, distributed_type):
            continue
        mesh = cast(Any, parameter.grad).device_mesh
        if mesh not in meshes:
            meshes.append(mesh)
            kinds.append([])
        kinds[meshes.index(mesh)].append(parameter)
    kinds.append([parameter for parameter in with_gradients if not isinstance(parameter.grad, distributed_type)])
    norms = []
    for kind in kinds:
        if kind:
            norm = torch.nn.utils.get_total_norm([cast(torch.Tensor, parameter.grad) for parameter in kind])
            # A DTensor norm is replicated (every shard counted once): any rank's value is the whole.
            norms.append(cast(Any, norm).full_tensor() if isinstance(norm, distributed_type) else norm)
    if not norms:
        return torch.zeros(())
    total_norm = torch.linalg.vector_norm(torch.stack(norms))
    for kind in kinds:
        if kind:
            torch.nn.utils.clip_grads_with_norm_(kind, max_norm, total_norm)
    return total_norm


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    corpus: CharCorpus,
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    clip_grad_norm: float = 0.0,
    loss_context: Callable[[], ContextManager[object]] = contextlib.nullcontext,
    count_collectives_at: frozenset[int] = frozenset(),
    on_step: Callable[[StepRecord], None] = lambda record: None,
    data_parallel: tuple[int, int, Any] | None = None,
    first_step: int = 1,
    compile_backend: str | None = None,
    context_parallel_mesh: Any = None,
    after_forward: Callable[[int], None] = lambda step: None,
) -> list[StepRecord]:
    """Trains ``steps`` steps on ``corpus.batch(step, ...)`` and returns one record per step.

    ``loss_context`` wraps forward and backward (``loss_parallel`` must see both).  Steps in
    ``count_collectives_at`` run each phase under its own ``CommDebugMode``; counting slows a
    step down, so callers keep those steps out of throughput figures.

    ``first_step``: continue a run (from a checkpoint) at this step; the batches are those of
    an uninterrupted run.
    ``compile_backend``: run forward and loss as one ``torch.compile(fullgraph=True)`` graph with this
    backend (the first step compiles it; a later graph break or recompilation raises or shows in the times).
    ``data_parallel``: ``(dp rank, dp size, dp process group)``: this rank trains on its equal
    share of each batch (FSDP averages the gradients over dp), and the recorded loss is the mean
    of the ranks' losses (one all-reduce per step, after the step, for the log only).
    ``context_parallel_mesh``: the 1-D cp mesh: every sequence is sharded over it by
    ``context_parallel`` (head-tail balanced; inputs, targets and the rotary positions alike) and
    forward and backward run inside it, so attention is ring attention.  Each rank's loss is its
    tokens' share of the mean (their cross-entropy sum over the tokens of the whole sequences),
    so the cp ranks' gradients add up to the gradient: they are summed over cp in one all-reduce
    before the optimizer, and the recorded loss is the sum of the cp ranks' losses (so each
    token is counted once, in the loss and in tokens/s).
    ``after_forward(step)``: called between a step's forward and its backward (the trainer's fault
    injection raises there, while the other ranks are inside the step's collectives).
    """
    model.train()

    def forward_and_loss(
        inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None, denominator: int
    ) -> torch.Tensor:
        if positions is None:
            return language_model_loss(model(inputs), targets, dtype)
        logits = model(inputs, positions).to(dtype)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / denominator

    step_loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor] = forward_and_loss
    if compile_backend is not None:
        step_loss = torch.compile(forward_and_loss, backend=compile_backend, fullgraph=True)
    records: list[StepRecord] = []
    for step in range(first_step, steps + 1):
        inputs, targets = corpus.batch(step, batch_size, seq_len, seed)
        if data_parallel is not None:
            dp_rank, dp_size, _ = data_parallel
            share = batch_size // dp_size
            inputs, targets = inputs[dp_rank * share : (dp_rank + 1) * share], targets[dp_rank * share : (dp_rank + 1) * share]
        inputs, targets = inputs.to(device), targets.to(device)
        counting = step in count_collectives_at
        collectives: dict[str, dict[str, int]] | None = {} if counting else None
        received = CollectiveBytes() if counting else contextlib.nullcontext()
        _synchronize(device)
        started = time.perf_counter()
        positions: torch.Tensor | None = None
        sharding: ContextManager[object] = contextlib.nullcontext()
        denominator = targets.numel()  # this rank's sequences, whole: what its cp share is a share of
        if context_parallel_mesh is not None:
            from shardwise.dtensor_ops.experimental import context_parallel

            positions = torch.arange(seq_len, device=device)
            buffers = [inputs, targets, positions]
            sharding = context_parallel(
                context_parallel_mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0], no_restore_buffers=set(buffers)
            )
        with received, sharding, loss_context():
            with _phase_counter("forward", collectives):
                loss = step_loss(inputs, targets, positions, denominator)
            after_forward(step)
            with _phase_counter("backward", collectives):
                loss.backward()
        with received, _phase_counter("optimizer", collectives):
            if context_parallel_mesh is not None:
                sum_gradients_over(model, context_parallel_mesh.get_group())
            reduce_partial_gradients(model)
            if clip_grad_norm > 0:
                clip_gradients(list(model.parameters()), clip_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        # .item() of a replicated DTensor reads the local value: no collective.
        loss_value = float(loss.item())
        if context_parallel_mesh is not None:
            loss_value = _mean_over_group(loss_value, 1, context_parallel_mesh.get_group(), device)  # the sum
        if data_parallel is not None:
            loss_value = _mean_over_group(loss_value, data_parallel[1], data_parallel[2], device)
        _synchronize(device)
        record = StepRecord(
            step, loss_value, time.perf_counter() - started, collectives,
            received.total if isinstance(received, CollectiveBytes) else None,
        )  # fmt: skip
        records.append(record)
        on_step(record)
    return records


def sum_gradients_over(model: nn.Module, group: Any) -> None:
    """Adds up every parameter's (local) gradient over ``group`` in one all-reduce of one flat buffer.

    Under context parallelism the weights are replicated over cp and each cp rank's gradient is
    its tokens' contribution; FSDP's reduce-scatter has already averaged over dp, and a
    tensor-parallel gradient's local tensor is this rank's shard, the same shard on every cp rank.
    """
    import torch.distributed as dist

    locals_: list[torch.Tensor] = []
    for parameter in model.parameters():
        gradient = parameter.grad
        if gradient is None:
            continue
        locals_.append(cast(Any, gradient)._local_tensor if isinstance(gradient, DTensor) else gradient)
    if not locals_:
        return
    flat = torch.cat([local.reshape(-1) for local in locals_])
    dist.all_reduce(flat, group=group)
    offset = 0
    for local in locals_:
        local.copy_(flat[offset : offset + local.numel()].view_as(local))
        offset += local.numel()


def _mean_over_group(value: float, group_size: int, group: Any, device: torch.device) -> float:
    import torch.distributed as dist

    total = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(total, group=group)
    return float(total.item()) / group_size


class CollectiveBytes(TorchDispatchMode):
    """Adds up the bytes this rank receives in the collectives run inside it, as the cost model counts them:
    an all-reduce 2(p-1)/p of its tensor, an all-gather (p-1)/p of the gathered tensor, a reduce-scatter
    (p-1)/p of its input, an all-to-all (p-1)/p of the rank's tensor. Re-enterable: counts accumulate."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace in ("_c10d_functional", "c10d_functional", "c10d"):
            self.total += _received_bytes(name, args)
        return func(*args, **kwargs)


def _group_size(group: Any) -> int:
    import torch.distributed as dist

    if isinstance(group, str):
        return int(dist.distributed_c10d._resolve_process_group(cast(Any, group)).size())
    if isinstance(group, torch.ScriptObject):  # c10d ops (dist.all_reduce) pass the group boxed
        group = dist.ProcessGroup.unbox(group)
    return int(group.size())


def _received_bytes(name: str, args: Any) -> float:
    tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
    nbytes = float(sum(tensor.numel() * tensor.element_size() for tensor in tensors if isinstance(tensor, torch.Tensor)))
    base = name.removesuffix("_").removesuffix("_coalesced")
    if base in ("all_reduce", "allreduce"):
        return received_bytes("all_reduce", nbytes, _group_size(args[-1] if isinstance(args[-1], str) else args[1]))
    if base == "all_gather_into_tensor":  # the input is one rank's piece: the gathered tensor is group_size of them
        return received_bytes("all_gather", nbytes * int(args[1]), int(args[1]))
    if base == "reduce_scatter_tensor":
        return received_bytes("reduce_scatter", nbytes, int(args[2]))
    if base == "all_to_all_single":
        return received_bytes("all_to_all", nbytes, _group_size(args[-1]))
    return 0.0


@contextlib.contextmanager
def _phase_counter(phase: str, into: dict[str, dict[str, int]] | None) -> Iterator[None]:
    if into is None:
        yield
        return
    mode = CommDebugMode()
    with mode:
        yield
    into[phase] = comm_counts_by_name(mode.get_comm_counts())
