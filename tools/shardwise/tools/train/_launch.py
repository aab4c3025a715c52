"""The launcher: starts the workers through PyTorch's elastic launcher (torch.distributed.run)."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from ._config import ConfigError, TrainConfig
from ._worker import PARITY_FAILED_EXIT_CODE

__all__ = ["WORKER_MODULE", "launch", "torchrun_argv", "check_launch_environment"]

# The workers run this package again as a module; they recognise themselves by torchrun's variables.
WORKER_MODULE = "shardwise.tools.train"


def torchrun_argv(config: TrainConfig) -> list[str]:
    """Arguments for ``torch.distributed.run`` (``torchrun``) that start this trainer's workers."""
    argv = ["--nproc-per-node", str(config.nproc_per_node), "--nnodes", str(config.nnodes), "--max-restarts", "0"]
    if config.nnodes == 1 and not config.rdzv_endpoint:
        argv.append("--standalone")
    else:
        # Static rendezvous: machine --node-rank runs global ranks [node_rank * n, (node_rank + 1) * n),
        # so rank 0 (which writes the report) is on --node-rank 0, the machine at --rdzv-endpoint.
        argv += ["--rdzv-backend", "static", "--rdzv-endpoint", config.rdzv_endpoint]
        argv += ["--node-rank", str(config.node_rank)]
    output_dir = str(config.resolved_output_dir())
    worker_config = TrainConfig(**{**config.as_dict(), "output_dir": output_dir})
    argv += ["--module", WORKER_MODULE, *worker_config.to_argv()]
    return argv


def check_launch_environment(config: TrainConfig) -> None:
    """What can be known before starting anything: the devices this machine must provide."""
    if config.device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                "--device cuda: CUDA is not available (no GPU visible, or this PyTorch is a CPU-only build: "
                f"torch {torch.__version__}); use --device cpu"
            )
        if not config.shares_gpus and torch.cuda.device_count() < config.nproc_per_node:
            raise ConfigError(
                f"--device cuda: {config.nproc_per_node} ranks on this machine need one GPU each, but only "
                f"{torch.cuda.device_count()} GPU(s) are visible; lower --tp, spread the ranks over --nnodes machines, or "
                "share the GPUs with --backend gloo"
            )


def _export_import_path() -> None:
    # The workers are new interpreters: give them the import path this one was started with
    # (under `bazel run` it is the runfiles tree, which a plain interpreter would not find).
    entries = [entry for entry in sys.path if entry]
    existing = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(entries + ([existing] if existing else []))


# What a rank's error says when it only lost a peer: gloo's and NCCL's words for a closed connection.
_LOST_PEER_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


def _describe_failures(failures: dict[int, Any]) -> str:
    """The failed ranks, the likely cause first: a rank that raised its own error, then ranks that lost a peer,
    then ranks the launcher stopped (killed by a signal)."""

    def message(failure: Any) -> str:
        text = getattr(failure, "message", "")
        if isinstance(text, dict):  # an error file's record: {"message": "Type: text", "extraInfo": {...}}
            text = text.get("message", "")
        return text if isinstance(text, str) else str(text)

    def kind(failure: Any) -> int:
        if failure.exitcode < 0:
            return 2
        return 1 if any(marker in message(failure) for marker in _LOST_PEER_MARKERS) else 0

    ordered = sorted(failures.items(), key=lambda item: (kind(item[1]), getattr(item[1], "timestamp", 0), item[0]))
    parts = []
    for rank, failure in ordered:
        text = message(failure).splitlines()[0] if message(failure) else ""
        shown = f" ({text[:160]})" if text and not text.startswith(("To enable traceback", "Signal ")) else ""
        parts.append(f"rank {rank} exit code {failure.exitcode}{shown}")
    return ", ".join(parts)


def launch(config: TrainConfig) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    check_launch_environment(config)
    _export_import_path()
    # One thread per rank: the ranks share this machine's cores (torchrun would pick 1 as well, with a banner).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    argv = torchrun_argv(config)
    print(
        f"launching {config.nproc_per_node} rank(s) on this machine ({config.world_size} in all) with "
        f"python -m torch.distributed.run {' '.join(argv[: argv.index('--module')])} ...",
        flush=True,
    )
    try:
        torchrun.run(torchrun.parse_args(argv))
    except ChildFailedError as error:
        failures = error.failures
        if set(failures) == {0} and failures[0].exitcode == PARITY_FAILED_EXIT_CODE:
            print(
                "parity check FAILED: the tensor-parallel run does not match the single-process run (see above)",
                file=sys.stderr,
            )
            return 1
        print(f"training failed: {_describe_failures(failures)}; the workers' tracebacks are above", file=sys.stderr)
        return 1
    if config.node_rank != 0:
        print(
            f"this machine's {config.nproc_per_node} rank(s) finished; rank 0, on the machine with --node-rank 0, "
            "ran the parity check and wrote the report",
            flush=True,
        )
    return 0
