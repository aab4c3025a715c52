"""The registry of dtensor_ops's caches: one function clears them all.

Every module-level cache of the package (decisions, plans, per-rank programs, schema facts)
registers here at import with whether it holds data computed for *this rank* (a mesh
coordinate, a shard's local sizes). ``clear_all_caches`` empties every one of them (tests, a
rule changed, meshes torn down); the threaded test world of ``shardwise.testing`` gives each
rank thread its own copy of the rank-local ones, found through :func:`rank_local_caches`.

A cache is registered by (module name, attribute name) rather than by object because the
threaded test world swaps the attribute for a per-thread mapping: clearing must reach whatever
object the attribute holds now.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["RegisteredCache", "clear_all_caches", "rank_local_caches", "register_cache", "registered_caches"]

_CacheT = TypeVar("_CacheT", bound=dict[Any, Any])


@dataclass(frozen=True)
class RegisteredCache:
    module: str
    attribute: str
    rank_local: bool


_REGISTERED: dict[tuple[str, str], RegisteredCache] = {}


def register_cache(cache: _CacheT, *, module: str, attribute: str, rank_local: bool) -> _CacheT:
    """Register ``module.attribute`` (which holds ``cache``) and return ``cache``.

    ``rank_local``: its entries depend on the calling rank (mesh coordinate, local sizes), so ranks
    sharing a process (threads) must not share it.
    """
    if not isinstance(cache, dict):
        raise TypeError(f"register_cache: {module}.{attribute} must be a dict, got {type(cache).__name__}")
    _REGISTERED[(module, attribute)] = RegisteredCache(module, attribute, rank_local)
    return cache


def registered_caches() -> tuple[RegisteredCache, ...]:
    return tuple(_REGISTERED.values())


def rank_local_caches() -> tuple[tuple[str, str], ...]:
    """``(module, attribute)`` of every cache whose entries depend on the calling rank."""
    return tuple((entry.module, entry.attribute) for entry in _REGISTERED.values() if entry.rank_local)


def clear_all_caches() -> None:
    """Forget every cached decision, plan, program and schema fact of dtensor_ops."""
    for entry in _REGISTERED.values():
        module = sys.modules.get(entry.module)
        if module is not None:
            getattr(module, entry.attribute).clear()
