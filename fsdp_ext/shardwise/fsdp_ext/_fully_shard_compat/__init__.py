"""``torch.distributed.fsdp._fully_shard`` (PyTorch 2.13's FSDP2 package) for ``shardwise.fsdp_ext``.

Thin modules under PyTorch's submodule names (``_fsdp_api``, ``_fsdp_common``, ``_fsdp_init``,
``_fully_shard``) over our implementation, for programs that import FSDP2's semi-private names (torchtitan
imports ``_fsdp_common.FSDPMeshInfo`` / ``ShardPlacementResult`` and ``_fsdp_init._get_mesh_info``). An
alias table may map ``torch.distributed.fsdp._fully_shard`` to this package.
"""

from .._fully_shard import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method, share_comm_ctx
from .._policies import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "fully_shard",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "UnshardHandle",
]


def __getattr__(name: str) -> object:
    # torch's code probes FSDP2's private submodules (dynamo: `from torch.distributed.fsdp._fully_shard
    # import _fsdp_param_group`, guarded by `except ModuleNotFoundError`). A submodule shardwise has no
    # counterpart of is missing in exactly that way, not an AttributeError turned into ImportError.
    if name.startswith("_fsdp_"):
        import importlib

        try:
            return importlib.import_module(f"{__name__}.{name}")  # one of ours, not imported yet
        except ModuleNotFoundError as missing:
            raise ModuleNotFoundError(
                f"shardwise.fsdp_ext has no counterpart of torch.distributed.fsdp._fully_shard.{name}",
                name=f"{__name__}.{name}",
            ) from missing
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
