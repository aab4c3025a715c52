"""The one decision cache and its one key builder.

Every path that decides an op on DTensors (dispatch's flat fast path and its general path,
``propagate_op_sharding`` called directly, the per-element decisions of ``_foreach_*`` ops) keys
the same cache with the same key: ``(op, part, part, ...)`` with one part per positional argument
and, when there are keyword arguments, ``KWARGS_MARK`` followed by ``name, part`` pairs.  A part is
:func:`key_part` of the argument with DTensors already replaced by their specs:

* specs, ints, strings, None, dtypes, devices, layouts, memory formats: the value itself;
* bools: ``(bool, value)`` (``True == 1`` but they can give different result dtypes);
* floats and complex numbers: ``(type, value)``, or just the type for rules that say values cannot
  change their decision (pointwise ops, fills, foreach ops: an optimizer passes new step sizes every
  step, which would otherwise add an entry per step);
* lists, tuples and sizes: ``(list, part, ...)`` (a list and a tuple of the same items are the same
  argument to an aten op);
* a plain tensor (only when propagation is called directly): ``(torch.Tensor, dtype, shape)``.

Decisions may carry this rank's local sizes, so the cache is rank-local (see ``_caches``). It is a
plain dict cleared when full: a hit must stay one dict lookup, and a training loop uses a handful of
layouts, so eviction order does not matter.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, NamedTuple, Sequence

import torch

from shardwise.placement import DTensorSpec

from ._caches import RANK_CACHES, SHARED_CACHES, SYMBOLIC, lookup, store
from ._decision import OpDecision
from ._rules import rule_for

__all__ = [
    "DISPATCH_LOOKUPS",
    "KWARGS_MARK",
    "MAX_CACHED_DECISIONS",
    "SELF_KEYED_TYPES",
    "call_key",
    "decision_cache_size",
    "float_values_matter",
    "PropagationCacheInfo",
    "clear_decisions",
    "propagation_cache_info",
    "key_part",
    "lookup_decision",
    "remember_decision",
]

MAX_CACHED_DECISIONS = 1 << 16


# [hits, misses] of dispatch's lookups in RANK_CACHES.decisions.  debug._get_fast_path_sharding_prop_cache_stats
# reports them and the debug clear functions zero them.  Process-wide (rank threads share the counts):
# a list bumped in place costs a few tens of ns per op, a per-rank mapping would cost a lookup.
DISPATCH_LOOKUPS: list[int] = [0, 0]



# Non-tensor argument types whose value is its own key part.
SELF_KEYED_TYPES: frozenset[type] = frozenset(
    {int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
)


class _KwargsMark:
    """Separates positional from keyword parts, so op(x, "a", "b") and op(x, a="b") never share a key."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "KWARGS_MARK"


KWARGS_MARK = _KwargsMark()



def float_values_matter(op: torch._ops.OpOverload) -> bool:
    """Whether ``op``'s decision may depend on the values of its float arguments (not only their type)."""
    matters = SHARED_CACHES.float_values_matter.get(op)
    if matters is None:
        rule = rule_for(op)
        matters = rule is None or rule.scalar_values_matter
        SHARED_CACHES.float_values_matter[op] = matters
    return matters


def key_part(value: Any, keep_float_values: bool) -> Hashable:
    """The key part of one argument (DTensors already replaced by their specs)."""
    value_type = type(value)
    if value_type is DTensorSpec or value_type in SELF_KEYED_TYPES:
        return value
    if value_type is float or value_type is complex:
        return (value_type, value) if keep_float_values else value_type  # type: ignore[return-value]
    if value_type is bool:
        return (bool, value)
    if value_type is list or value_type is tuple or value_type is torch.Size:
        parts: list[Hashable] = [list]
        for item in value:
            # Ints (sizes, dims) are their own part: no call for them.
            parts.append(item if type(item) is int else key_part(item, keep_float_values))
        return tuple(parts)
    if isinstance(value, torch.Tensor):
        return (torch.Tensor, value.dtype, tuple(value.shape))
    return value


def call_key(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> Hashable:
    """The cache key of ``op(*args, **kwargs)`` (DTensors replaced by their specs)."""
    keep = float_values_matter(op)
    parts: list[Hashable] = [op]
    parts.extend([key_part(arg, keep) for arg in args])
    if kwargs:
        parts.append(KWARGS_MARK)
        for name, value in kwargs.items():
            parts.append(name)
            parts.append(key_part(value, keep))
    return tuple(parts)


def lookup_decision(key: Hashable) -> OpDecision | None:
    """The cached decision under ``key``, or None (also when ``key`` holds symbolic sizes, which do not hash:
    torch.compile tracing with dynamic shapes decides such calls afresh, which costs nothing in eager)."""
    found = lookup(RANK_CACHES.decisions, key)
    return None if found is SYMBOLIC else found


def remember_decision(key: Hashable, decision: OpDecision) -> None:
    store(RANK_CACHES.decisions, key, decision, MAX_CACHED_DECISIONS)


def decision_cache_size() -> int:
    return len(RANK_CACHES.decisions)


class PropagationCacheInfo(NamedTuple):
    """functools' cache statistics, for the decision pipeline's own entries (PyTorch's debug helpers)."""

    hits: int
    misses: int
    maxsize: int
    currsize: int


def propagation_cache_info() -> PropagationCacheInfo:
    """(hits, misses) of the decision pipeline's entries: a dispatch miss it decides, a direct
    ``propagate_op_sharding`` call (what PyTorch's ``ShardingPropagator.cache_info`` counts)."""
    counts = RANK_CACHES.propagation_counts
    return PropagationCacheInfo(
        counts.get("hits", 0), counts.get("misses", 0), MAX_CACHED_DECISIONS, len(RANK_CACHES.decisions)
    )


def clear_decisions() -> None:
    """Forget every cached decision and the pipeline's counts (dispatch's counts: see ``debug``)."""
    RANK_CACHES.decisions.clear()
    RANK_CACHES.propagation_counts.clear()
