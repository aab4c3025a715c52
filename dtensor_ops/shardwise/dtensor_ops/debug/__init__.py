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
    from .._decision_pipeline import propagation_cache_info

    return propagation_cache_info()


def _clear_python_sharding_prop_cache() -> None:
    """Forget every cached sharding decision (the propagator and dispatch share one cache here)."""
    from .._decision_pipeline import clear_decisions

    clear_decisions()


def _get_fast_path_sharding_prop_cache_stats() -> tuple[int, int]:
    """(hits, misses) of DTensor dispatch's decision cache since the last clear (PyTorch's debug helper).

    Every op dispatched on DTensors looks its answer up once: a hit is executed (a decision, or a
    memoised algorithm such as ``_foreach_norm``'s run again), a miss is decided by the decision
    pipeline's walk and its answer stored.  Calls of
    ``ShardingPropagator.propagate_op_sharding`` made outside dispatch are not counted here (see
    :func:`_get_python_sharding_prop_cache_info`).  Reset by :func:`_clear_fast_path_sharding_prop_cache`
    and :func:`_clear_sharding_prop_cache`.  Counted per process: ranks run as threads share them.
    """
    from .._decision_pipeline import DISPATCH_LOOKUPS

    return DISPATCH_LOOKUPS[0], DISPATCH_LOOKUPS[1]


def _clear_fast_path_sharding_prop_cache() -> None:
    """Forget every cached sharding decision (one cache serves dispatch and the propagator here) and
    start :func:`_get_fast_path_sharding_prop_cache_stats` from (0, 0)."""
    from .._caches import RANK_CACHES
    from .._decision_pipeline import DISPATCH_LOOKUPS

    RANK_CACHES.decisions.clear()
    DISPATCH_LOOKUPS[0] = DISPATCH_LOOKUPS[1] = 0


def _clear_sharding_prop_cache() -> None:
    """Forget every cached sharding decision, so the next op of each kind decides afresh, and reset both
    caches' statistics (PyTorch's debug helper)."""
    _clear_python_sharding_prop_cache()
    _clear_fast_path_sharding_prop_cache()
