"""shardwise.dtensor_ops: the distributed tensor (drop-in for ``torch.distributed.tensor``, PyTorch 2.13).

``DTensor`` is a ``torch.Tensor`` laid out over a :class:`DeviceMesh` by one
placement per mesh dim (``Shard``, ``Replicate``, ``Partial``).  Build one with
``distribute_tensor``, ``DTensor.from_local``, ``distribute_module`` or the
factories (``zeros``, ``ones``, ``empty``, ``full``, ``rand``, ``randn``); aten ops
on it run shard by shard with the communication their sharding rules require.

``DeviceMesh``/``init_device_mesh`` (from ``shardwise.mesh``) and the placements
(from ``shardwise.placement``) are re-exported, as PyTorch does.
"""

from typing import Any

import shardwise.placement as placement_types
import torch
import torch.optim.optimizer as optimizer
import torch.utils._foreach_utils as foreach_utils
from shardwise.mesh import DeviceMesh as DeviceMesh
from shardwise.mesh import init_device_mesh as init_device_mesh
from shardwise.placement import Partial, Placement, Replicate, Shard
# PyTorch's torch.distributed.tensor has these under private names; torch's own code imports them from
# there (DCP's _pg_transport: _DTensorSpec).
from shardwise.placement import DTensorSpec as _DTensorSpec
from shardwise.placement import ShardOrderEntry as _ShardOrderEntry
from shardwise.placement import TensorMeta as _TensorMeta
from shardwise.mesh import _layout as _mesh_layout
from shardwise.placement import _mask_partial, _placements, _shard_order
from shardwise.placement import _spec as _placement_spec
from shardwise.placement._placements import install_mesh_dim_gather

from ._api import distribute_module, distribute_tensor
from ._conversions import redistribute_together
from ._op_runner import torch_dispatch
from ._dtensor import DTensor
from ._extensions import load_extensions
from ._factories import empty, full, ones, rand, randn, zeros
from ._handlers import BUILTIN_OP_HANDLERS
from ._op_handlers import register_op_handler
from ._plan_executor import gather_along_mesh_dim
from ._torch_compat.op_dispatch import op_dispatcher
from ._torch_compat.pytorch_paths import install_finder


_SAVED_DTENSOR_CLASSES: list[Any] = [
    DTensor,
    DeviceMesh,
    _mesh_layout.MeshLayout,
    _mesh_layout._RankPositions,
    _placement_spec.DTensorSpec,
    _placement_spec.TensorMeta,
    _placements.Shard,
    _placements.Replicate,
    _placements.Partial,
    _placements._StridedShard,
    _placements._make_strided_shard,
    _mask_partial._MaskPartial,
    _shard_order.ShardOrderEntry,
]


def _wire() -> None:
    """Connect the layers: dispatch into the class, the built-in op handlers, torch's foreach paths.

    The class sits below dispatch (dispatch wraps results in it), so dispatch is installed here,
    once, after both are imported.  Binding the entry point as the classmethod itself saves a Python
    frame on every op.
    """
    DTensor.__torch_dispatch__ = classmethod(torch_dispatch)  # type: ignore[assignment]
    # PyTorch's module paths here (``_op_schema``, ``_ops.utils``, ``placement_types``, ...) are no files:
    # the alias table's finder serves each with the module that holds its names.
    install_finder()
    for op, handler in BUILTIN_OP_HANDLERS.items():
        # Each declines (hands the call to the rule) by the op's arguments and specs alone: dispatch asks
        # it on a decision-cache miss only, so no other op pays for it.
        register_op_handler(op, handler, declines_by_key=True)
    # torch's optimizers and clip_grad_norm_ pick their foreach paths by checking type(t) against these
    # lists (PyTorch's own DTensor appends itself too).
    for supported in (optimizer._foreach_supported_types, foreach_utils._foreach_supported_types):
        if DTensor not in supported:
            supported.append(DTensor)  # type: ignore[arg-type]
    # PyTorch code reaches the strategy registries as DTensor._op_dispatcher.sharding_propagator.
    DTensor._op_dispatcher = op_dispatcher  # type: ignore[attr-defined]
    # Placements are pure layout; their PyTorch-style _to_replicate_tensor needs this layer's collective.
    install_mesh_dim_gather(gather_along_mesh_dim)
    # torch.load(weights_only=True) loads only allowlisted classes: a saved DTensor needs these (as
    # PyTorch registers its own when torch.distributed.tensor is imported).
    torch.serialization.add_safe_globals(_SAVED_DTENSOR_CLASSES)


_wire()
# PyTorch's torch.distributed.tensor.placement_types is shardwise.placement: reachable from here as an
# attribute (`from torch.distributed.tensor import placement_types`); its path is the alias table's.
# Packages above this one that hook in when installed (shardwise.compile_support): found, not named.
load_extensions()

# DeviceMesh and init_device_mesh are importable from here but, as in torch.distributed.tensor,
# not part of __all__.
__all__ = [
    "DTensor",
    "distribute_tensor",
    "distribute_module",
    "Shard",
    "Replicate",
    "Partial",
    "Placement",
    "ones",
    "empty",
    "full",
    "rand",
    "randn",
    "zeros",
]
