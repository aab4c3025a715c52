"""The one engine object: what every decision of dtensor_ops depends on, owned in one place.

:data:`ENGINE` holds the sharding rules (``_rules``), the op handlers (``_op_handlers``), the caches
(``_caches``: this rank's and the shared ones), the PyTorch-style registrations (``registrations``: what
users registered through PyTorch's API, which the compat layer makes into rules), the statistics
(dispatch's lookups, the pipeline's counts), the installed random-number tracker (``_shard_rng``) and a
**generation**: a number that changes whenever something a cached decision or program was made from
changes (a rule, a registration, the options that decisions and programs read: ``cost_profile`` and
through it the backend's profile, ``replicate_fallback``, ``gloo_all_to_all``).  Changing one goes
through :meth:`Engine.changed`, which forgets every cache made from the old state, so no decision
outlives what it was made from and no caller has to remember to clear caches.  A handler change
forgets its op's memoised answers only (:meth:`Engine.forget_op`: handlers come and go with
``loss_parallel`` every step).

The registries are plain dicts held here and read by their modules under the names they always had
(``_rules._RULES``, ``_op_handlers.CACHEABLE_HANDLERS`` / ``ASKED_EVERY_CALL``, the pipeline's
``DISPATCH_LOOKUPS``): the per-op hit reads them without going through this object.  The registrations
are :class:`RegistryMap` s (PyTorch's ``ShardingPropagator.op_strategy_funcs`` and its siblings are
these very objects): every change to one (``[]=``, ``del``, ``pop``, any other mutator) goes through
:meth:`Engine.registration_changed`, which has the compat layer bring the op's rule in line
(``Registrations.sync_rule``, installed when that layer loads: this module cannot import it) and
forgets every cache.  Caches of rank threads (``shardwise.testing``'s threaded world swaps the fields
of ``RANK_CACHES`` per thread) are cleared for the thread that changed something; options changed in
a ``use_options`` block are per thread too.  A leaf: imports only ``_caches``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, TypeVar

import torch

from ._caches import RANK_CACHES, SHARED_CACHES, RankCaches, SharedCaches

__all__ = ["ENGINE", "Engine", "RegistryMap", "Registrations"]

_Key = TypeVar("_Key")
_Value = TypeVar("_Value")


class RegistryMap(dict[_Key, _Value]):
    """A per-op registry whose every change reports the ops it touched to ``on_change`` (after the change).

    PyTorch's users and tests register by ``[]=`` and unregister by ``del`` / ``pop``, so the dict's own
    mutators are the change path.  ``fallback`` (optional) answers for an op with no entry: ``[]``, ``in``
    and ``get`` ask it, None from it meaning absent (``op_to_schema_info`` derives infos this way).
    """

    def __init__(self, on_change: Callable[[Iterable[_Key]], None]) -> None:
        super().__init__()
        self._on_change = on_change
        self.fallback: Callable[[_Key], _Value | None] | None = None

    def __setitem__(self, key: _Key, value: _Value) -> None:
        super().__setitem__(key, value)
        self._on_change((key,))

    def __delitem__(self, key: _Key) -> None:
        super().__delitem__(key)
        self._on_change((key,))

    def pop(self, key: _Key, *default: Any) -> Any:
        present = dict.__contains__(self, key)
        value = super().pop(key, *default)
        if present:
            self._on_change((key,))
        return value

    def popitem(self) -> tuple[_Key, _Value]:
        key, value = super().popitem()
        self._on_change((key,))
        return key, value

    def setdefault(self, key: _Key, default: Any = None) -> Any:
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        self[key] = default
        return default

    def update(self, *args: Any, **kwargs: Any) -> None:
        added = dict(*args, **kwargs)
        for key, value in added.items():
            super().__setitem__(key, value)
        if added:
            self._on_change(added)

    def __ior__(self, other: Any) -> "RegistryMap[_Key, _Value]":  # type: ignore[override,misc]
        self.update(other)
        return self

    def clear(self) -> None:
        removed = list(self.keys())
        super().clear()
        if removed:
            self._on_change(removed)

    def __reduce_ex__(self, protocol: Any) -> tuple[type[dict[_Key, _Value]], tuple[dict[_Key, _Value]]]:
        # A copy (copy, deepcopy, pickle) is a plain dict of the entries: only the engine's maps are registries.
        return dict, (dict(self),)

    def __missing__(self, key: _Key) -> _Value:
        found = None if self.fallback is None else self.fallback(key)
        if found is None:
            raise KeyError(key)
        return found

    def __contains__(self, key: object) -> bool:
        if dict.__contains__(self, key):
            return True
        return self.fallback is not None and self.fallback(key) is not None  # type: ignore[arg-type]

    def get(self, key: _Key, default: Any = None) -> Any:
        return self[key] if key in self else default


class Registrations:
    """PyTorch-style registrations per op (``ShardingPropagator``'s maps, filled by the compat layer):
    single-dim strategies, op strategies, sharding-prop rules and the two schema-info maps; and the engine's
    rule of each op before its first such registration (None: it had none), to restore on the last removal.

    ``sync_rule(op)`` gives ``op`` the rule its registrations call for (PyTorch's precedence: single-dim
    strategy, op strategy, sharding-prop rule; or the rule from before); installed by the compat layer.
    """

    __slots__ = (
        "single_dim_strategy_funcs",
        "strategy_funcs",
        "prop_rules",
        "schema_info",
        "schema_info_for_single_dim_strategy",
        "rules_before_registration",
        "sync_rule",
    )

    def __init__(self, on_change: Callable[[Iterable[torch._ops.OpOverload]], None]) -> None:
        self.single_dim_strategy_funcs: RegistryMap[torch._ops.OpOverload, Any] = RegistryMap(on_change)
        self.strategy_funcs: RegistryMap[torch._ops.OpOverload, Any] = RegistryMap(on_change)
        self.prop_rules: RegistryMap[torch._ops.OpOverload, Any] = RegistryMap(on_change)
        self.schema_info: RegistryMap[torch._ops.OpOverload, Any] = RegistryMap(on_change)
        self.schema_info_for_single_dim_strategy: RegistryMap[torch._ops.OpOverload, Any] = RegistryMap(on_change)
        # Bookkeeping of sync_rule, changed only with the rules themselves (which forget caches).
        self.rules_before_registration: dict[torch._ops.OpOverload, Any] = {}
        self.sync_rule: Callable[[torch._ops.OpOverload], None] | None = None


class Engine:
    """See the module docstring."""

    __slots__ = (
        "rules",
        "cacheable_handlers",
        "asked_every_call",
        "rank_caches",
        "shared_caches",
        "registrations",
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
        self.registrations = Registrations(self.registration_changed)
        # [hits, misses] of dispatch's lookups (``debug._get_fast_path_sharding_prop_cache_stats``).
        self.dispatch_lookups: list[int] = [0, 0]
        # The installed RNG tracker holder (``_shard_rng.INSTALLED_RNG_TRACKER``), set when that module loads.
        self.random_state: Any = None
        self.generation = 0
        self._lock = threading.Lock()

    def changed(self, what: str) -> int:
        """Something decisions or programs depend on changed (``what``: ``"rules"``, ``"registrations"``,
        ``"options"``): forget
        every cache made from the old state and start a new generation, which is returned."""
        with self._lock:
            self.generation += 1
            generation = self.generation
        self.rank_caches.clear()
        self.shared_caches.clear()
        return generation

    def registration_changed(self, ops: Iterable[torch._ops.OpOverload]) -> None:
        """PyTorch-style registrations of ``ops`` changed: bring each op's rule in line with them, and forget
        every cache (a schema info alone changes what a strategy function is shown)."""
        sync_rule = self.registrations.sync_rule
        if sync_rule is not None:
            for op in list(ops):
                sync_rule(op)
        self.changed("registrations")

    def forget_op(self, op: torch._ops.OpOverload) -> None:
        """``op``'s handlers changed: forget this rank's memoised answers for it (an algorithm names its
        handlers) and start a new generation."""
        with self._lock:
            self.generation += 1
        decisions = self.rank_caches.decisions
        for key in [key for key in decisions if isinstance(key, tuple) and key and key[0] is op]:
            del decisions[key]


ENGINE = Engine(RANK_CACHES, SHARED_CACHES)
