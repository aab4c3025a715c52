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

__all__ = ["RANK_CACHES", "SHARED_CACHES", "RankCaches", "SharedCaches", "clear_all_caches"]


class RankCaches:
    """This rank's own caches (see the module docstring); each field a dict."""

    __slots__ = ("decisions", "propagation_counts", "programs", "one_dim_gathers")

    def __init__(self) -> None:
        # (op, key parts...) -> OpDecision: the one decision cache (``_decision_cache``).
        self.decisions: dict[Hashable, Any] = {}
        # {"hits", "misses"} of the decision pipeline's entries (``_decision_pipeline``).
        self.propagation_counts: dict[str, int] = {}
        # (src spec, dst spec) -> compiled redistribution program of this rank (``_redistribute``).
        self.programs: dict[Any, Any] = {}
        # strided gathers of one mesh dim (``_strided_redistribute``).
        self.one_dim_gathers: dict[Any, Any] = {}

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
        "simulated_programs",
        "draw_carriers",
    )

    def __init__(self) -> None:
        # op -> SchemaFacts (``_schema``).
        self.schema_facts: dict[Any, Any] = {}
        # op -> whether its decision reads float argument values (``_decision_cache``).
        self.float_values_matter: dict[Any, bool] = {}
        # (mesh, dtype) -> replicated spec of a 0-dim tensor (``_dispatch``).
        self.scalar_specs: dict[Any, Any] = {}
        # planner problems and (src, dst, ...) -> cheapest plan (``_redistribute_plan``).
        self.plans_by_problem: dict[Any, Any] = {}
        self.plans_by_specs: dict[Any, Any] = {}
        # (src, dst, simulated rank) -> that rank's program under LocalTensorMode (``_redistribute``).
        self.simulated_programs: dict[Any, Any] = {}
        # device -> the tensor random draws are carried on (``_random``).
        self.draw_carriers: dict[Any, Any] = {}

    def clear(self) -> None:
        for name in self.__slots__:
            getattr(self, name).clear()


RANK_CACHES = RankCaches()
SHARED_CACHES = SharedCaches()


def clear_all_caches() -> None:
    """Forget every cached decision, plan, program and schema fact of dtensor_ops."""
    RANK_CACHES.clear()
    SHARED_CACHES.clear()
