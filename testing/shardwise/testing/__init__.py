"""Test helpers for shardwise: run test bodies on several ranks from pytest.

``multi_rank`` / ``run_on_ranks`` run a module-level function on every rank of a pooled set of
processes, each test with a fresh default process group (gloo on CPU, or NCCL with one GPU per
rank). ``DTensorTestBase`` / ``DTensorOpTestBase`` / ``DTensorConverter`` and the model zoo follow
PyTorch's ``common_dtensor`` API. ``FakeMesh`` is a process-free stand-in for ``DeviceMesh`` for pure
tests of layouts, the planner and the sharding rules.
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
from shardwise.testing._converter import DTensorConverter
from shardwise.testing._fake_mesh import FakeMesh
from shardwise.testing._dtensor_test_base import (
    DEVICE_TYPE,
    NUM_DEVICES,
    DTensorOpTestBase,
    DTensorTestBase,
    run_subtests,
    skip_unless_torch_gpu,
    with_comms,
)
from shardwise.testing._model_zoo import (
    Attention,
    FeedForward,
    MLPModule,
    MLPStacked,
    ModelArgs,
    RMSNormPython,
    Transformer,
    TransformerBlock,
)
from shardwise.testing._threaded import run_on_threads

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
    "DEVICE_TYPE",
    "NUM_DEVICES",
    "DTensorConverter",
    "DTensorOpTestBase",
    "DTensorTestBase",
    "FakeMesh",
    "run_subtests",
    "run_on_threads",
    "skip_unless_torch_gpu",
    "with_comms",
    "Attention",
    "FeedForward",
    "MLPModule",
    "MLPStacked",
    "ModelArgs",
    "RMSNormPython",
    "Transformer",
    "TransformerBlock",
]
