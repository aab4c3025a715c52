"""Test helpers for shardwise: run test bodies on several ranks from pytest.

``multi_rank`` / ``run_on_ranks`` run a module-level function on every rank of a pooled set of
processes, each test with a fresh default process group (gloo on CPU, or NCCL with one GPU per
rank).
"""

from shardwise.testing._multi_rank import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_WORLD_SIZE,
    TIMEOUT_ENV_VAR,
    multi_rank,
    run_on_ranks,
)
from shardwise.testing._protocol import RemoteError
from shardwise.testing._rank_pool import MultiRankError, MultiRankTimeout, shutdown_pools

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_WORLD_SIZE",
    "TIMEOUT_ENV_VAR",
    "MultiRankError",
    "MultiRankTimeout",
    "RemoteError",
    "multi_rank",
    "run_on_ranks",
    "shutdown_pools",
]
