"""PyTorch's ``torch.distributed.tensor._op_schema`` names, and their adapters into shardwise's rules: one place to import them.

This module serves the path ``shardwise.dtensor_ops._op_schema`` (``pytorch_paths``) and offers every name
of PyTorch's strategy vocabulary; each is defined in one of these modules:

``strategy_types``         the data classes: :class:`OpSchema`, :class:`OpStrategy`, :class:`OpSpec`,
                           :class:`TupleStrategy`, :class:`OutputSharding`, :class:`OpInfo`, :class:`RuntimeSchemaInfo`
``strategy_expansion``     candidate costs, :func:`is_tensor_shardable`, single-dim strategies expanded over the mesh
                           (:func:`expand_single_dim_strategy`, :func:`expand_to_full_mesh_op_strategy`)
``strategy_choice``        strategy functions and sharding-prop rules as :class:`ShardingRule` s of the engine: the
                           cheapest candidate wins, as PyTorch picks it
``strategy_registration``  ``register_op_strategy`` and its siblings over the per-op registries the engine owns
                           (``OP_STRATEGY_FUNCS``...: ``ShardingPropagator.op_strategy_funcs``...)

When an op has several registrations, the single-dim strategy wins over the op strategy, which wins over
the sharding-prop rule (PyTorch's order).  These types are plain data over ``shardwise.placement`` specs;
nothing here communicates.
"""

from __future__ import annotations

from shardwise.placement import DTensorSpec, Placement, TensorMeta

from . import strategy_choice, strategy_expansion, strategy_registration, strategy_types
from .strategy_choice import *  # noqa: F403
from .strategy_expansion import *  # noqa: F403
from .strategy_registration import *  # noqa: F403
from .strategy_registration import _RULES_BEFORE_REGISTRATION
from .strategy_types import *  # noqa: F403

# PyTorch's _op_schema also offers the spec types.
__all__ = ["DTensorSpec", "Placement", "TensorMeta", "_RULES_BEFORE_REGISTRATION"]
__all__ += strategy_types.__all__
__all__ += strategy_expansion.__all__
__all__ += strategy_choice.__all__
__all__ += strategy_registration.__all__
