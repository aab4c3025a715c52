"""Every cache of dtensor_ops, held by two named objects; one function clears them all.

* :data:`RANK_CACHES` (:class:`RankCaches`): what this rank computed for itself (entries depend
  on a mesh coordinate or a shard's local sizes): sharding decisions, the pipeline's counts,
  redistribution programs, strided gathers.
* :data:`SHARED_CACHES` (:class:`SharedCaches`): facts the same on every rank: schema facts,
  which ops' decisions read float values, replicated specs of scalars, redistribution plans
  (global: they depend on the specs only), per-simulated-rank programs, random-draw carriers.

Modules read a cache through its object at call time (``RANK_CACHES.decisions.get(key)``) and
never bind a cache dict at import: so the threaded test world of ``shardwise.testing`` gives each
rank thread its own caches by swapping the fields of ``RANK_CACHES`` (:func:`RankCaches.fields`),
nothing else, and :func:`clear_all_caches` reaches whatever the fields hold now.  Values are
typed ``Any`` here (this leaf module cannot name the planner's or the executor's types); each
owner documents what its cache holds.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch

from shardwise.placement import DTensorSpec

__all__ = [
    "RANK_CACHES",
    "SHARED_CACHES",
    "SYMBOLIC",
    "RankCaches",
    "SharedCaches",
    "clear_all_caches",
    "has_symbolic_value",
    "lookup",
    "store",
]


class RankCaches:
    """This rank's own caches (see the module docstring); each field a dict."""

    __slots__ = ("decisions", "propagation_counts", "programs")

    def __init__(self) -> None:
        # (op, key parts...) -> OpDecision or Algorithm: the one memo of decisions (``_decision_pipeline``).
        self.decisions: dict[Hashable, Any] = {}
        # {"hits", "misses"} of the decision pipeline's entries (``_decision_pipeline``).
        self.propagation_counts: dict[str, int] = {}
        # (src spec, dst spec) -> compiled redistribution program of this rank (``_redistribute``).
        self.programs: dict[Any, Any] = {}

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return cls.__slots__

    def clear(self) -> None:
        for name in self.__slots__:
            getattr(self, name).clear()


class SharedCaches:
    """Facts the same on every rank (see the module docstring); each field a dict."""

    __slots__ = (
        "schema_facts",
        "float_values_matter",
        "scalar_specs",
        "plans_by_problem",
        "plans_by_specs",
        "step_pricers",
        "simulated_programs",
        "draw_carriers",
        "strided_piece_sizes",
    )

    def __init__(self) -> None:
        # op -> SchemaFacts (``_call_schema``).
        self.schema_facts: dict[Any, Any] = {}
        # op -> whether its decision reads float argument values (``_decision_pipeline``).
        self.float_values_matter: dict[Any, bool] = {}
        # (mesh, dtype) -> replicated spec of a 0-dim tensor (``_op_runner``).
        self.scalar_specs: dict[Any, Any] = {}
        # planner problems and (src, dst, ...) -> cheapest plan (``_planner``).
        self.plans_by_problem: dict[Any, Any] = {}
        self.plans_by_specs: dict[Any, Any] = {}
        # (mesh, cost profile setting) -> the planner's step pricer for that mesh (``_cost_model``).
        self.step_pricers: dict[Any, Any] = {}
        # (src, dst, simulated rank) -> that rank's program under LocalTensorMode (``_redistribute``).
        self.simulated_programs: dict[Any, Any] = {}
        # device -> the tensor random draws are carried on (``_shard_rng``).
        self.draw_carriers: dict[Any, Any] = {}
        # (global shape, mesh shape, placements with _StridedShard) -> whether every coordinate's piece has
        # the sizes of the Shard equivalent's (``_propagation``).
        self.strided_piece_sizes: dict[Any, bool] = {}

    def clear(self) -> None:
        for name in self.__slots__:
            getattr(self, name).clear()


RANK_CACHES = RankCaches()
SHARED_CACHES = SharedCaches()


def clear_all_caches() -> None:
    """Forget every cached decision, plan, program and schema fact of dtensor_ops."""
    RANK_CACHES.clear()
    SHARED_CACHES.clear()


class _Symbolic:
    __slots__ = ()

    def __repr__(self) -> str:
        return "SYMBOLIC"


# What lookup() answers for a key holding symbolic sizes (SymInt/SymFloat/SymBool: torch.compile tracing with
# dynamic shapes), which cannot be hashed: the caller decides, plans or compiles afresh and caches nothing.
SYMBOLIC = _Symbolic()


def lookup(cache: dict[Any, Any], key: Hashable, default: Any = None) -> Any:
    """``cache.get(key, default)``, or :data:`SYMBOLIC` when ``key`` holds symbolic sizes.

    The one rule for keys that cannot be hashed: symbolic ones are decided afresh (free in eager, where
    there are none); any other unhashable key is a bug and raises, naming it.  Dispatch's per-op lookup
    applies the same rule inline (a call costs more than the lookup there).
    """
    try:
        return cache.get(key, default)
    except TypeError:
        if has_symbolic_value(key):
            return SYMBOLIC
        raise TypeError(f"a cache key is not hashable (an argument that cannot be cached?): {key!r}") from None


def store(cache: dict[Any, Any], key: Hashable, value: Any, limit: int) -> None:
    """``cache[key] = value``, the cache emptied first when it holds ``limit`` entries (a training loop uses
    a handful of layouts, so eviction order does not matter); a key that cannot be hashed (symbolic sizes,
    or an argument dispatch could not key) is not stored: its call is decided afresh each time."""
    if len(cache) >= limit:
        cache.clear()
    try:
        cache[key] = value
    except TypeError:
        pass


def has_symbolic_value(value: object) -> bool:
    """Whether ``value`` holds a SymInt/SymFloat/SymBool (directly, in a spec's metadata, in a list or tuple)."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(value, DTensorSpec):
        meta = value.tensor_meta
        return meta is not None and has_symbolic_value((*meta.shape, *meta.stride))
    if isinstance(value, (tuple, list)):
        return any(has_symbolic_value(item) for item in value)
    return False
