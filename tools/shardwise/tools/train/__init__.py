"""The demo trainer: a character-level Transformer trained with shardwise tensor parallelism.

    python -m shardwise.tools.train [flags]          # or: ./tools/bazel run //tools:train -- [flags]

With no flags it starts 4 local CPU ranks through PyTorch's elastic launcher
(``torch.distributed.run``), trains the toy Transformer of ``shardwise.testing`` with tensor and
sequence parallelism on a small shipped corpus, prints progress and the collectives of a step
(``CommDebugMode``), then trains the same model in one process without DTensor and checks that
losses and final parameters agree.  The loss plot and ``summary.json`` go to ``--output-dir``.
Started by ``torchrun ... -m shardwise.tools.train`` directly, it runs as a worker.
"""

from __future__ import annotations

import sys
from typing import Sequence

from ._config import ConfigError, TrainConfig, build_parser, parse_config
from ._data import CharCorpus, load_default_corpus
from ._model import build_model, model_args, parallelize_transformer
from ._parity import ParityResult, compare_runs

__all__ = [
    "CharCorpus",
    "ConfigError",
    "ParityResult",
    "TrainConfig",
    "build_model",
    "build_parser",
    "compare_runs",
    "load_default_corpus",
    "main",
    "model_args",
    "parallelize_transformer",
    "parse_config",
]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the trainer; the exit status is 0 on success, 1 on a failed run or parity check, 2 on bad flags."""
    from ._launch import launch
    from ._worker import is_worker_process, run_worker

    config = parse_config(sys.argv[1:] if argv is None else argv)
    try:
        return run_worker(config) if is_worker_process() else launch(config)
    except ConfigError as error:
        print(f"{build_parser().prog}: error: {error}", file=sys.stderr, flush=True)
        return 2
