"""What every rank runs (started by torch.distributed.run): tensor-parallel training, then on rank 0
the single-process reference run, the parity check and the report."""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
from typing import Callable, ContextManager, NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn
from shardwise.dtensor_ops import DTensor
from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.tp_styles import loss_parallel

from ._checkpoint import load_checkpoint, save_checkpoint
from ._config import ConfigError, TrainConfig
from ._data import CharCorpus, load_default_corpus
from ._loop import StepRecord, train_loop
from ._model import (
    build_any_model,
    build_model,
    build_auto_parallel_model,
    build_optimizer,
    fully_shard_transformer,
    model_args,
    parallelize_llama,
    parallelize_transformer,
)
from shardwise.testing import Llama
from ._parity import compare_runs
from ._report import (
    PLOT_FILE_NAME,
    SUMMARY_FILE_NAME,
    format_collectives,
    format_summary,
    plot_losses,
    summary_dict,
    write_summary,
)

__all__ = ["InjectedFault", "PARITY_FAILED_EXIT_CODE", "is_worker_process", "leave_at_once_after_failure", "run_worker"]

# Rank 0 exits with this when training worked but the parity check failed; the launcher tells it
# apart from a crash.
PARITY_FAILED_EXIT_CODE = 3

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class InjectedFault(RuntimeError):
    """The error ``--fail-at-step N --fail-rank R`` raises on rank R in step N (between forward and backward)."""


def _fault_injector(config: TrainConfig, rank: int) -> Callable[[int], None]:
    def after_forward(step: int) -> None:
        if config.fail_at_step and step == config.fail_at_step and rank == config.fail_rank:
            # The wall-clock time lets a benchmark measure from the raise to the job's end.
            print(f"injected fault: rank {rank} raises in step {step} at {time.time():.6f}", file=sys.stderr, flush=True)
            raise InjectedFault(
                f"injected fault (--fail-at-step {config.fail_at_step} --fail-rank {config.fail_rank}): rank {rank} "
                f"raises in step {step} after its forward, while the other ranks run the backward's collectives"
            )

    return after_forward


def is_worker_process() -> bool:
    """True inside a process started by torch.distributed.run (torchrun sets these for each worker)."""
    return all(name in os.environ for name in _TORCHRUN_VARIABLES)


def _say(text: str) -> None:
    print(text, flush=True)


def _device_for_rank(config: TrainConfig, local_rank: int) -> torch.device:
    if config.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            "--device cuda: CUDA is not available to this process (no GPU visible or a CPU-only PyTorch build)"
        )
    if config.shares_gpus:
        # gloo moves CUDA tensors through host memory, so ranks may share a device.
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"--device cuda: local rank {local_rank} needs GPU {local_rank}, but this machine shows "
            f"{torch.cuda.device_count()} GPU(s); start at most that many ranks per machine"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _dtype(config: TrainConfig) -> torch.dtype:
    return {"float64": torch.float64, "float32": torch.float32}[config.training_dtype]


def _full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a whole tensor on every rank (collectives: all ranks must call this)."""
    full: dict[str, torch.Tensor] = {}
    for name, parameter in model.named_parameters():
        value = parameter.full_tensor() if isinstance(parameter, DTensor) else parameter
        full[name] = value.detach().to("cpu").clone()
    return full


def _count_parameters(parameters: dict[str, torch.Tensor]) -> int:
    return sum(tensor.numel() for tensor in parameters.values())


def _progress_printer(label: str, steps: int, tokens_per_step: int, log_every: int) -> Callable[[StepRecord], None]:
    width = len(str(steps))

    def report(record: StepRecord) -> None:
        if record.collectives is None and record.step % log_every != 0 and record.step not in (1, steps):
            return
        tokens_per_second = tokens_per_step / record.seconds if record.seconds > 0 else 0.0
        line = (
            f"{label} step {record.step:>{width}}/{steps}  loss {record.loss:.4f}  "
            f"{tokens_per_second:>9,.0f} tok/s  {record.seconds * 1e3:7.1f} ms"
        )
        if record.collectives is not None:
            line += f"  [counted, {record.total_collectives} collectives: {format_collectives(record.collectives)}]"
        _say(line)

    return report


def run_worker(config: TrainConfig) -> int:
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if world_size != config.world_size:
        # Every rank sees the same numbers and stops here, before any collective.
        raise ConfigError(
            f"the launcher started {world_size} ranks, but --tp {config.tp} x --dp {config.dp} x --cp {config.cp} needs "
            f"{config.world_size}; start {config.world_size} ranks in total (nproc-per-node x nnodes)"
        )
    device = _device_for_rank(config, local_rank)
    dist.init_process_group(backend=config.process_group_backend, timeout=datetime.timedelta(minutes=5))
    try:
        status = _train_and_check(config, rank, world_size, device)
        # The other ranks wait for rank 0's reference run: no rank tears the group down while
        # another may still use it (see also __main__.py on leaving without teardown).
        dist.barrier()
    except ConfigError:
        # A flag the run cannot honour (--resume past the checkpoint): every rank refuses alike, and main()
        # prints the message without a traceback and exits 2.
        dist.destroy_process_group()
        raise
    except Exception as failure:
        leave_at_once_after_failure(rank, failure)
    dist.destroy_process_group()
    return status


def leave_at_once_after_failure(rank: int, failure: BaseException) -> NoReturn:
    """Prints ``failure``'s traceback, records it for torchrun, and ends this process without teardown (exit 1).

    Why not let the exception end the interpreter: Python's finalisation with torch imported takes 3-6 s on
    a loaded 2-core machine (a full garbage collection over every module's objects; gdb showed the
    failed rank there, in ``finalize_modules``), and ``destroy_process_group`` does not close a gloo
    group that something below Python still holds. The peers blocked in collectives with this rank
    only fail when its connections close, and torchrun only stops the job when a rank exits: both wait
    on that teardown. Ending the process closes every connection at once, so the peers' collectives
    fail ("Connection closed by peer") and torchrun stops the rest within its monitor interval (0.1 s).
    The traceback is written before anything closes, so the failed rank's comes out first.
    """
    import traceback

    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    text = "".join(traceback.format_exception(failure))
    sys.stderr.write("".join(f"[rank{rank}]: {line}\n" for line in text.rstrip("\n").splitlines()))
    sys.stderr.flush()
    sys.stdout.flush()
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        # torchrun's failure summary (and our launcher's) then names this error and when it was raised.
        try:
            get_error_handler().record_exception(failure)
        except Exception:  # noqa: BLE001 - the summary is a nicety; leaving promptly is the point
            pass
    os._exit(1)


def _train_and_check(config: TrainConfig, rank: int, world_size: int, device: torch.device) -> int:
    is_reporter = rank == 0
    data_parallel = config.dp > 1
    names = tuple(name for name, _ in config.mesh_dims)
    mesh: DeviceMesh = init_device_mesh(device.type, tuple(size for _, size in config.mesh_dims), mesh_dim_names=names)
    tp_mesh = mesh["tp"] if mesh.ndim > 1 else mesh
    corpus = load_default_corpus(vocab_multiple=config.tp)
    model: nn.Module
    auto_plan_used = None
    if config.plan == "auto":
        model, auto_plan_used = build_auto_parallel_model(config, mesh, corpus.vocab_size, device, _dtype(config))
    elif config.model == "llama":
        llama = build_any_model(config, corpus.vocab_size, device, _dtype(config))
        assert isinstance(llama, Llama)
        model = parallelize_llama(llama, tp_mesh) if config.tp > 1 else llama
    else:
        transformer = build_model(model_args(config, corpus.vocab_size), config.seed, device, _dtype(config))
        model = parallelize_transformer(
            transformer, tp_mesh, seq_parallel=config.uses_seq_parallel, loss_parallel=config.uses_loss_parallel
        )
    if data_parallel and auto_plan_used is None:
        model = fully_shard_transformer(model, mesh["dp"])
    optimizer = build_optimizer(config, list(model.parameters()))
    first_step = 1
    if config.resume:
        resumed_at = load_checkpoint(config.resolved_checkpoint_dir(), model, optimizer, config.optimizer)
        first_step = resumed_at + 1
        if first_step > config.steps:
            raise ConfigError(
                f"--resume: the checkpoint is at step {resumed_at} already; expected --steps above it "
                "(the total number of steps, counting those before the checkpoint)"
            )
    if is_reporter:
        _say(
            f"shardwise trainer: {world_size} ranks ({device.type}, {dist.get_backend()}), mesh "
            f"{f'dp={config.dp} (FSDP) x ' if data_parallel else ''}"
            f"{f'cp={config.cp} (context parallel, ring attention) x ' if config.cp > 1 else ''}tp={config.tp}; "
            + (
                "plan: auto (below)"
                if auto_plan_used is not None
                else f"sequence parallel {'on' if config.uses_seq_parallel else 'off'}, loss parallel "
                f"{'on' if config.uses_loss_parallel else 'off'}"
            )
        )
        _say(
            f"model: {'Llama' if config.model == 'llama' else 'Transformer'} dim={config.dim} layers={config.n_layers} "
            f"heads={config.n_heads}{f' kv_heads={config.n_kv_heads}' if config.model == 'llama' and config.n_kv_heads else ''} "
            f"vocab={corpus.vocab_size} ({len(corpus.characters)} characters); data: {len(corpus.text):,} characters, "
            f"batch {config.batch_size} x {config.seq_len}; {config.training_dtype}; {config.optimizer} lr={config.lr:g}, "
            f"{config.steps} steps"
        )
        if auto_plan_used is not None:
            _say(f"--plan auto: the plan auto_parallelize chose\n{auto_plan_used}")
        if config.resume:
            _say(f"resumed from {config.resolved_checkpoint_dir()} at step {first_step - 1}")
        if config.compile:
            _say(
                f"forward and loss compiled with torch.compile(fullgraph=True, backend={config.compile_backend!r}); "
                "collectives are not counted (CommDebugMode cannot run around a compiled graph)"
            )
        else:
            _say("collectives are counted with CommDebugMode on the first and the last step")
    uses_loss_parallel = auto_plan_used.loss_parallel if auto_plan_used is not None else config.uses_loss_parallel
    loss_context: Callable[[], ContextManager[object]] = loss_parallel if uses_loss_parallel else contextlib.nullcontext
    # Tokens per step count every token once, however many ranks share a sequence (cp) or a batch (dp).
    progress = _progress_printer("tp ", config.steps, config.tokens_per_step, config.log_every)
    tp_records = train_loop(
        model,
        optimizer,
        corpus,
        steps=config.steps,
        batch_size=config.batch_size,
        seq_len=config.seq_len,
        seed=config.seed,
        device=device,
        dtype=_dtype(config),
        clip_grad_norm=config.clip_grad_norm,
        loss_context=loss_context,
        compile_backend=config.compile_backend if config.compile else None,
        # CommDebugMode (a dispatch mode) cannot run around a compiled graph: no counts under --compile.
        count_collectives_at=frozenset() if config.compile else frozenset({first_step, config.steps}),
        first_step=first_step,
        on_step=progress if is_reporter else (lambda _: None),
        data_parallel=(mesh.get_local_rank("dp"), config.dp, mesh.get_group("dp")) if data_parallel else None,
        context_parallel_mesh=mesh["cp"] if config.cp > 1 else None,
        after_forward=_fault_injector(config, rank),
    )
    if config.checkpoint_dir:
        save_checkpoint(config.resolved_checkpoint_dir(), model, optimizer, config.optimizer, config.steps)
        if is_reporter:
            _say(f"checkpoint at step {config.steps} written to {config.resolved_checkpoint_dir()}")
    tp_parameters = _full_parameters(model)
    if not is_reporter:
        return 0
    return _reference_and_report(config, corpus, device, world_size, tp_records, tp_parameters)


def _reference_and_report(
    config: TrainConfig,
    corpus: CharCorpus,
    device: torch.device,
    world_size: int,
    tp_records: list[StepRecord],
    tp_parameters: dict[str, torch.Tensor],
) -> int:
    _say("\nsingle-process reference: the same model, seed, data and steps with plain torch (no DTensor)")
    reference_model = build_any_model(config, corpus.vocab_size, device, _dtype(config))
    reference_optimizer = build_optimizer(config, list(reference_model.parameters()))
    reference_records = train_loop(
        reference_model,
        reference_optimizer,
        corpus,
        steps=config.steps,
        batch_size=config.batch_size,
        seq_len=config.seq_len,
        seed=config.seed,
        device=device,
        dtype=_dtype(config),
        clip_grad_norm=config.clip_grad_norm,
        on_step=_progress_printer(
            "ref", config.steps, config.tokens_per_step, max(config.log_every, config.steps // 5 or 1)
        ),
    )
    reference_parameters = {name: p.detach().to("cpu").clone() for name, p in reference_model.named_parameters()}
    # A resumed run is compared with the same steps of the uninterrupted reference run.
    reference_records = reference_records[len(reference_records) - len(tp_records) :]
    parity = compare_runs(
        [record.loss for record in tp_records],
        [record.loss for record in reference_records],
        tp_parameters,
        reference_parameters,
        rtol=config.rtol,
        atol=config.atol,
    )

    output_dir = config.resolved_output_dir()
    output_dir.mkdir(parents=True, exist_ok=True)
    plot_path = output_dir / PLOT_FILE_NAME
    plot_error: str | None = None
    try:
        plot_losses(
            plot_path,
            [record.loss for record in tp_records],
            [record.loss for record in reference_records],
            title=(
                f"shardwise {f'FSDP={config.dp} x ' if config.dp > 1 else ''}{f'CP={config.cp} x ' if config.cp > 1 else ''}"
                f"TP={config.tp}{' + SP' if config.uses_seq_parallel else ''}"
                f"{' + loss parallel' if config.uses_loss_parallel and config.plan == 'manual' else ''}"
                f"{' (auto plan)' if config.plan == 'auto' else ''}: "
                f"{'Llama' if config.model == 'llama' else 'Transformer'} dim={config.dim}, "
                f"{config.n_layers} layers, batch {config.batch_size}x{config.seq_len}, parity {parity.verdict}"
            ),
        )
    except ImportError as error:
        plot_error = f"matplotlib is not installed ({error}); pip install matplotlib to get the loss plot"
        plot_path_or_none = None
    else:
        plot_path_or_none = plot_path
    summary = summary_dict(
        config,
        world_size=world_size,
        mesh_shape=tuple(size for _, size in config.mesh_dims),
        vocab_size=corpus.vocab_size,
        corpus_characters=len(corpus.text),
        parameter_count=_count_parameters(reference_parameters),
        tp_records=tp_records,
        reference_records=reference_records,
        parity=parity,
        plot_path=plot_path_or_none,
        plot_error=plot_error,
    )
    summary_path = output_dir / SUMMARY_FILE_NAME
    write_summary(summary_path, summary)
    _say(format_summary(summary, summary_path))
    sys.stdout.flush()
    return 0 if parity.passed else PARITY_FAILED_EXIT_CODE
