"""Test helpers for shardwise: run test bodies on several ranks from pytest.

``multi_rank`` / ``run_on_ranks`` run a module-level function on every rank of a pooled set of
processes, each test with a fresh default process group (gloo on CPU, or NCCL with one GPU per
rank). ``DTensorTestBase`` / ``DTensorOpTestBase`` / ``DTensorConverter`` and the model zoo follow
PyTorch's ``common_dtensor`` API. ``FakeMesh`` is a process-free stand-in for ``DeviceMesh`` for pure
tests of layouts, the planner and the sharding rules.
"""

import importlib
from typing import TYPE_CHECKING, Any

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
from shardwise.testing._pricing import priced_by
from shardwise.testing._llama import Llama, LlamaArgs
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

if TYPE_CHECKING:
    from shardwise.testing._dtensor_test_base import (
        DEVICE_COUNT,
        DEVICE_TYPE,
        NUM_DEVICES,
        PG_BACKEND,
        DTensorContinuousTestBase,
        DTensorOpTestBase,
        DTensorTestBase,
        DTensorTestMixin,
        TestFunc,
        run_subtests,
        skip_if_lt_x_gpu,
        skip_unless_torch_gpu,
        with_comms,
    )
    from shardwise.testing._local_tensor import (
        LocalDTensorContinuousTestBase,
        LocalDTensorOpTestBase,
        LocalDTensorTestBase,
        ThreadedLocalDTensorContinuousTestBase,
        ThreadedLocalDTensorOpTestBase,
        ThreadedLocalDTensorTestBase,
        create_local_tensor_test_class,
        make_full_tensor,
        make_wrapped,
        map_local_for_rank,
        map_local_tensor_for_rank,
        reduce_local_int,
    )
    from shardwise.testing._shard_orders import (
        _convert_shard_order_dict_to_ShardOrder,
        generate_shard_orders,
        patched_distribute_tensor,
        redistribute,
        shard_order_to_placement,
    )

# The test bases build on torch's common_utils.TestCase, whose import costs about 2 s of CPU: only
# test files that use them (and their rank processes) pay for it.
_LAZY_MODULES = {
    "shardwise.testing._dtensor_test_base": (
        "DEVICE_COUNT",
        "DEVICE_TYPE",
        "NUM_DEVICES",
        "PG_BACKEND",
        "DTensorContinuousTestBase",
        "DTensorOpTestBase",
        "DTensorTestBase",
        "DTensorTestMixin",
        "TestFunc",
        "run_subtests",
        "skip_if_lt_x_gpu",
        "skip_unless_torch_gpu",
        "with_comms",
    ),
    "shardwise.testing._local_tensor": (
        "LocalDTensorContinuousTestBase",
        "LocalDTensorOpTestBase",
        "LocalDTensorTestBase",
        "ThreadedLocalDTensorContinuousTestBase",
        "ThreadedLocalDTensorOpTestBase",
        "ThreadedLocalDTensorTestBase",
        "create_local_tensor_test_class",
        "make_full_tensor",
        "make_wrapped",
        "map_local_for_rank",
        "map_local_tensor_for_rank",
        "reduce_local_int",
    ),
    "shardwise.testing._shard_orders": (
        "_convert_shard_order_dict_to_ShardOrder",
        "generate_shard_orders",
        "patched_distribute_tensor",
        "redistribute",
        "shard_order_to_placement",
    ),
}
_LAZY_NAMES = {name: module for module, names in _LAZY_MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    module_name = _LAZY_NAMES.get(name)
    if module_name is None:
        raise AttributeError(f"module 'shardwise.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value

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
    "DTensorConverter",
    "FakeMesh",
    "priced_by",
    "run_on_threads",
    *_LAZY_NAMES,
    "Attention",
    "Llama",
    "LlamaArgs",
    "FeedForward",
    "MLPModule",
    "MLPStacked",
    "ModelArgs",
    "RMSNormPython",
    "Transformer",
    "TransformerBlock",
]
