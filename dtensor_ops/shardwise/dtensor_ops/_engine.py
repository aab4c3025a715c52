"""The one engine object: what every decision of dtensor_ops depends on, owned in one place.

:data:`ENGINE` holds the sharding rules (``_rules``), the op handlers (``_op_handlers``), the caches
(``_caches``: this rank's and the shared ones), the statistics (dispatch's lookups, the pipeline's
counts), the installed random-number tracker (``_shard_rng``) and a **generation**: a number that
changes whenever something a cached decision or program was made from changes (a rule, the options
that decisions and programs read: ``cost_profile`` and through it the backend's profile,
``replicate_fallback``, ``gloo_all_to_all``).  Changing one goes through :meth:`Engine.changed`,
which forgets every cache made from the old state, so no decision outlives what it was made from and
no caller has to remember to clear caches.  A handler change forgets its op's memoised answers only
(:meth:`Engine.forget_op`: handlers come and go with ``loss_parallel`` every step).

The registries are plain dicts held here and read by their modules under the names they always had
(``_rules._RULES``, ``_op_handlers.CACHEABLE_HANDLERS`` / ``ASKED_EVERY_CALL``, the pipeline's
``DISPATCH_LOOKUPS``): the per-op hit reads them without going through this object.  Caches of rank
threads (``shardwise.testing``'s threaded world swaps the fields of ``RANK_CACHES`` per thread) are
cleared for the thread that changed something; options changed in a ``use_options`` block are
per thread too.  A leaf: imports only ``_caches``.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ._caches import RANK_CACHES, SHARED_CACHES, RankCaches, SharedCaches

__all__ = ["ENGINE", "Engine"]


class Engine:
    """See the module docstring."""

    __slots__ = (
        "rules",
        "cacheable_handlers",
        "asked_every_call",
        "rank_caches",
        "shared_caches",
        "dispatch_lookups",
        "random_state",
        "generation",
        "_lock",
    )

    def __init__(self, rank_caches: RankCaches, shared_caches: SharedCaches) -> None:
        # op -> its ShardingRule (``_rules``).
        self.rules: dict[torch._ops.OpOverload, Any] = {}
        # id(op) -> the op's handlers, most recent first; and the same for ops with a handler that is not
        # cacheable (``_op_handlers``; dispatch checks the second before its lookup).
        self.cacheable_handlers: dict[int, tuple[Any, ...]] = {}
        self.asked_every_call: dict[int, tuple[Any, ...]] = {}
        self.rank_caches = rank_caches
        self.shared_caches = shared_caches
        # [hits, misses] of dispatch's lookups (``debug._get_fast_path_sharding_prop_cache_stats``).
        self.dispatch_lookups: list[int] = [0, 0]
        # The installed RNG tracker holder (``_shard_rng.INSTALLED_RNG_TRACKER``), set when that module loads.
        self.random_state: Any = None
        self.generation = 0
        self._lock = threading.Lock()

    def changed(self, what: str) -> int:
        """Something decisions or programs depend on changed (``what``: ``"rules"``, ``"options"``): forget
        every cache made from the old state and start a new generation, which is returned."""
        with self._lock:
            self.generation += 1
            generation = self.generation
        self.rank_caches.clear()
        self.shared_caches.clear()
        return generation

    def forget_op(self, op: torch._ops.OpOverload) -> None:
        """``op``'s handlers changed: forget this rank's memoised answers for it (an algorithm names its
        handlers) and start a new generation."""
        with self._lock:
            self.generation += 1
        decisions = self.rank_caches.decisions
        for key in [key for key in decisions if isinstance(key, tuple) and key and key[0] is op]:
            del decisions[key]


ENGINE = Engine(RANK_CACHES, SHARED_CACHES)
