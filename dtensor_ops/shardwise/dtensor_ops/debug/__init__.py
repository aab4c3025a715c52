"""shardwise.dtensor_ops.debug: drop-in for ``torch.distributed.tensor.debug``.

* :class:`CommDebugMode` counts (and traces, per module and pass) the collectives
  run inside a ``with`` block, including those DTensor issues internally.
* :func:`visualize_sharding` prints which device holds which region of a 1-D or
  2-D DTensor.
"""

from typing import Any

from ._comm_keys import CommCounts, canonical_comm_key
from ._comm_mode import CommDebugMode
from ._visualize_sharding import format_sharding_table, visualize_sharding

__all__ = ["CommDebugMode", "CommCounts", "canonical_comm_key", "visualize_sharding", "format_sharding_table"]


def _get_python_sharding_prop_cache_info() -> Any:
    """(hits, misses, maxsize, currsize) of the sharding propagator's cache (PyTorch's debug helper).

    Dispatch consults the propagator only when its own lookup misses, so these count propagator
    calls, not dispatch's fast path (as in PyTorch).
    """
    from .._sharding_prop import sharding_propagator

    return sharding_propagator.propagate_op_sharding.cache_info()


def _clear_python_sharding_prop_cache() -> None:
    """Forget every cached sharding decision (the propagator and dispatch share one cache here)."""
    from .._sharding_prop import sharding_propagator

    sharding_propagator.propagate_op_sharding.cache_clear()


def _clear_fast_path_sharding_prop_cache() -> None:
    """Same cache as the propagator's: forget every cached sharding decision."""
    _clear_python_sharding_prop_cache()


def _clear_sharding_prop_cache() -> None:
    """Forget every cached sharding decision, so the next op of each kind decides afresh (PyTorch's debug helper)."""
    _clear_python_sharding_prop_cache()
