"""The time a redistribution step or plan takes on a mesh: alpha + bytes / beta per collective.

Pure pricing over a ``shardwise.mesh`` cost profile (``shardwise.mesh._cost_profile``); nothing here
communicates.

Units: ``nbytes`` is what one rank *receives* in the collective, exactly as the planner counts a
step's ``bytes_per_rank`` (so beta is nccl-tests' bus bandwidth), or, for ``local_copy``, the bytes
a rank copies locally (chunking, padding, trimming, zero-filling).

Which profile: the ``profile`` argument (a ``CostProfile``, a built-in name or a JSON path) if
given, else ``$SHARDWISE_COST_PROFILE``, else the default of the mesh's backend (``gloo-loopback``
for gloo, ``nccl`` for NCCL: intra-node figures, inter-node ones for groups that span nodes);
``shardwise.mesh._cost_profile.active_cost_profile`` is the one place that decides.

Where it is used
----------------

* **Planner**: ``_planner.plan_redistribute`` searches with ``pricer_for_mesh(mesh)``
  (``step_picoseconds``) as the edge weight and ranks plans by (time, collectives, joint steps,
  bytes, steps); the pricer's ``cache_key`` is part of the cached problem's key. A one-dim step is
  priced with the local copies the executor makes around it (``_planner.local_copy_bytes``:
  padding uneven pieces, regrouping when the collective's tensor dim is not the outermost, trimming,
  non-leading chunks, a sum's split, a shard's zero-filled parent) as ``local_copy`` time; joint
  steps by their collective alone.
* **Strategy choice**: ``_propagation`` ranks a rule's candidate input placements by
  ``redistribute_cost_picoseconds`` (the fastest plan's time), not by bytes.
* Byte figures (``plan_bytes_per_rank``, ``redistribute_cost_bytes``, the lower bound) are kept for
  what the tests and benchmarks report; ``find_cheapest_plan`` without ``step_price`` still gives the
  fewest-bytes plan (bandwidth alone).

When the bytes lower bound is also the time optimum
---------------------------------------------------

A plan with fewer bytes but ``k`` more collectives beats the alternative iff the bytes it saves
exceed ``k * alpha * beta`` (``bytes_worth_one_collective``). So the fewest-bytes plan is also the
fastest once the saved bytes per extra collective exceed alpha * beta; the alternatives the planner
weighs differ by a fixed fraction of the tensor (typically (p-1)/p of a local shard), so from a
tensor size of about ``alpha * beta * p / (p - 1)`` per extra collective on bandwidth decides:

* gloo on loopback (the built-in profile, measured here): alpha * beta ~ 0.23 MB (all-gather,
  all-to-all), 0.24 MB (all-reduce), 0.27 MB (reduce-scatter); so below a few hundred KB per rank
  fewer collectives win, and almost every tensor of the toy Transformer is below.
* NCCL within an H100 node (published busbw, assumed alphas): 8 ranks, all-gather 15 us x 360 GB/s
  ~ 5.4 MB; all-reduce 17 us x 460 GB/s ~ 7.8 MB.
* NCCL across nodes (NDR InfiniBand, 40 GB/s busbw): 8 ranks 29 us x 40 GB/s ~ 1.2 MB.

``crossover_table`` prints these for any profile and group size.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch.distributed as dist

from shardwise.mesh._cost_profile import COLLECTIVE_KINDS, CostProfile, active_cost_profile

from ._caches import SHARED_CACHES, store
from ._options import current_options

__all__ = [
    "StepPricer",
    "bytes_worth_one_collective",
    "collective_time",
    "crossover_table",
    "plan_time",
    "pricer_for_mesh",
    "priced_kind",
    "received_bytes",
]

# The planner's step kinds (``StepKind.value``), priced as the collective that runs them.
_KIND_OF_STEP = {
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_to_all": "all_to_all",
    "local_copy": "local_copy",
    "joint_all_to_all": "all_to_all",
    "joint_reduce_scatter": "reduce_scatter",
    "joint_all_to_all_reduce": "all_to_all",
    "joint_all_reduce": "all_reduce",
    # _StridedShard layouts: one all-gather over one mesh dim; an all-gather over each of several
    # mesh dims in turn (priced per dim, see StepPricer.step_time); a local selection.
    "strided_all_gather": "all_gather",
    "gather_whole": "all_gather",
    "select_local": "local_copy",
    # Local steps copy (or zero-fill) their output on the rank's device.
    "local_chunk": "local_copy",
    "local_partial": "local_copy",
    "shard_to_partial": "local_copy",
}
_MAX_PRICERS = 256
# Changes nothing but the label (a mesh dim of size 1): free.
_FREE_KINDS = frozenset({"relabel"})
# Steps that run their collective once per mesh dim they change, one after another.
_PER_DIM_KINDS = frozenset({"gather_whole"})


def priced_kind(kind: object) -> str | None:
    """The collective kind that prices a step kind (a ``StepKind`` or its value); None for free steps."""
    value = str(getattr(kind, "value", kind))
    if value in _FREE_KINDS:
        return None
    priced = _KIND_OF_STEP.get(value)
    if priced is None:
        raise ValueError(f"no price for step kind {value!r}; known: {sorted(_KIND_OF_STEP) + sorted(_FREE_KINDS)}")
    return priced


def _mesh_backend(mesh: Any) -> str | None:
    """The c10d backend the mesh's device type uses in the default group, or None without one.

    Read from the default group's backend config (``cpu:gloo,cuda:nccl``), never from the mesh's
    own groups: those may be created lazily, and pricing must not create a group.
    """
    if not dist.is_initialized():
        return None
    device_type = str(getattr(mesh, "device_type", "cpu"))
    try:
        config = str(dist.get_backend_config())
    except (RuntimeError, ValueError):
        return None
    for entry in config.split(","):
        device, _, backend = entry.partition(":")
        if device.strip() == device_type and backend:
            return backend.strip()
    return None


def _profile_for(mesh: Any, profile: CostProfile | str | os.PathLike[str] | None) -> CostProfile:
    if isinstance(profile, CostProfile):
        return profile
    return active_cost_profile(profile, backend=_mesh_backend(mesh))


def _dims(mesh_dim: int | Sequence[int]) -> tuple[int, ...]:
    return (mesh_dim,) if isinstance(mesh_dim, int) else tuple(mesh_dim)


def collective_time(
    kind: object,
    nbytes: float,
    mesh: Any,
    mesh_dim: int | Sequence[int],
    *,
    profile: CostProfile | str | os.PathLike[str] | None = None,
) -> float:
    """Seconds one ``kind`` collective over ``mesh_dim`` (a dim, or several jointly) takes when a rank receives ``nbytes``.

    ``kind``: a collective kind (``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``,
    ``local_copy``) or a planner step kind. A group of one rank moves nothing: only a local copy costs.
    """
    if nbytes < 0:
        raise ValueError(f"collective_time: nbytes must be >= 0, got {nbytes}")
    priced = priced_kind(kind)
    if priced is None:
        return 0.0
    chosen = _profile_for(mesh, profile)
    cost, group_size = chosen.cost(priced, mesh, _dims(mesh_dim))
    if priced != "local_copy" and group_size <= 1:
        return 0.0
    return cost.time(nbytes, group_size)


# What one rank receives in a collective over a group of p, as a share of the tensor's bytes: the gathered
# tensor of an all-gather, the input of a reduce-scatter or an all-reduce, one rank's tensor of an all-to-all.
_RECEIVED_SHARE = {
    "all_gather": lambda p: (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "all_to_all": lambda p: (p - 1) / p,
}


def received_bytes(kind: str, full_bytes: float, group_size: int) -> float:
    """The bytes one rank receives in a ``kind`` collective on a tensor of ``full_bytes`` (see ``_RECEIVED_SHARE``):
    the units of ``collective_time`` and of the planner's ``bytes_per_rank``."""
    return _RECEIVED_SHARE[kind](group_size) * full_bytes


def bytes_worth_one_collective(
    kind: str, mesh: Any, mesh_dim: int | Sequence[int], *, profile: CostProfile | str | os.PathLike[str] | None = None
) -> float:
    """alpha * beta: the received bytes that take as long as one collective's latency on that dim.

    A plan that saves more bytes than this per extra collective it issues is the faster one.
    """
    chosen = _profile_for(mesh, profile)
    cost, group_size = chosen.cost(kind, mesh, _dims(mesh_dim))
    return cost.alpha(group_size) * cost.beta_bytes_per_s


@dataclass(frozen=True)
class StepPricer:
    """Prices planner steps on one mesh under one profile (built once per mesh and reused).

    Called as ``pricer(kind, mesh_dims, bytes_per_rank, local_copy_bytes)`` it is ``step_picoseconds``: the
    ``step_price`` the planner's search takes.
    """

    mesh: Any
    profile: CostProfile
    # What chose the profile (a built-in name or a file path; None: the backend's default): part of cache keys.
    setting: str | None = None
    # (priced kind, mesh dims) -> (the cost that applies, group size): the profile's lookup, done once.
    _costs: dict[tuple[str, tuple[int, ...]], tuple[Any, int]] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )

    @staticmethod
    def for_mesh(mesh: Any, profile: CostProfile | str | os.PathLike[str] | None = None) -> StepPricer:
        setting = None if profile is None or isinstance(profile, CostProfile) else os.fspath(profile)
        return StepPricer(mesh, _profile_for(mesh, profile), setting)

    @functools.cached_property
    def _one_dim_costs(self) -> tuple[dict[str, tuple[Any, int]], ...]:
        return self.profile.one_dim_costs(self.mesh)

    def _cost(self, priced: str, mesh_dims: tuple[int, ...]) -> tuple[Any, int]:
        if len(mesh_dims) == 1 and 0 <= mesh_dims[0] < len(self._one_dim_costs):
            return self._one_dim_costs[mesh_dims[0]][priced]
        key = (priced, mesh_dims)
        found = self._costs.get(key)
        if found is None:
            found = self.profile.cost(priced, self.mesh, mesh_dims)
            self._costs[key] = found
        return found

    def step_time(self, kind: object, mesh_dims: int | Sequence[int], bytes_per_rank: float, local_copy_bytes: float = 0.0) -> float:
        """Seconds one step of ``kind`` over ``mesh_dims`` takes when a rank receives ``bytes_per_rank``."""
        if bytes_per_rank < 0:
            raise ValueError(f"step_time: bytes_per_rank must be >= 0, got {bytes_per_rank}")
        priced = priced_kind(kind)
        if priced is None:
            return 0.0
        dims = _dims(mesh_dims)
        if priced == "local_copy":
            cost, group_size = self._cost("local_copy", dims)
            return float(cost.time(bytes_per_rank + local_copy_bytes, group_size))
        if str(getattr(kind, "value", kind)) in _PER_DIM_KINDS:
            # One collective per mesh dim, in turn: a latency for each, the bytes over the first's bandwidth.
            costs = [self._cost(priced, (dim,)) for dim in dims]
            seconds = sum(float(cost.alpha(size)) for cost, size in costs if size > 1)
            if seconds:
                seconds += bytes_per_rank / float(costs[0][0].beta_bytes_per_s)
        else:
            cost, group_size = self._cost(priced, dims)
            seconds = 0.0 if group_size <= 1 else float(cost.time(bytes_per_rank, group_size))
        if local_copy_bytes:
            copy, copy_group = self._cost("local_copy", dims)
            seconds += float(copy.time(local_copy_bytes, copy_group))
        return seconds

    def step_picoseconds(
        self, kind: object, mesh_dims: tuple[int, ...], bytes_per_rank: int, local_copy_bytes: int = 0
    ) -> int:
        """``step_time`` as whole picoseconds: what the planner adds up, so equal plans tie exactly."""
        return round(self.step_time(kind, mesh_dims, bytes_per_rank, local_copy_bytes) * 1e12)

    __call__ = step_picoseconds

    @functools.cached_property
    def _one_dim_terms(self) -> tuple[dict[str, tuple[float, float] | None], ...]:
        """Per mesh dim, per collective kind: (alpha, beta) there, or None where it moves nothing (one rank):
        what a plan priced on this mesh depends on (``cache_key``)."""
        # Dims that share a cost table (one_dim_costs gives equal dims one object) share their terms.
        by_table: dict[int, dict[str, tuple[float, float] | None]] = {}
        rows = []
        for per_kind in self._one_dim_costs:
            row = by_table.get(id(per_kind))
            if row is None:
                row = by_table[id(per_kind)] = {
                    kind: (
                        None
                        if kind != "local_copy" and group_size <= 1
                        else (float(cost.alpha(group_size)), float(cost.beta_bytes_per_s))
                    )
                    for kind, (cost, group_size) in per_kind.items()
                }
            rows.append(row)
        return tuple(rows)

    @functools.cached_property
    def cache_key(self) -> tuple[object, ...]:
        """What a cached plan priced by this pricer depends on besides the specs."""
        return (self.profile.name, tuple(tuple(per_kind.items()) for per_kind in self._one_dim_terms))


def pricer_for_mesh(mesh: Any) -> StepPricer:
    """The pricer the planner uses for ``mesh``: the ``cost_profile`` option (``_options``;
    ``$SHARDWISE_COST_PROFILE``) if set, else the mesh backend's default; cached per mesh and setting.

    Plans are cached per setting; decisions and redistribution programs already cached keep the
    profile they were made with: choose the profile before the first redistribution, or clear the
    caches (``_caches.clear_all_caches``) after changing it.
    """
    setting = current_options().cost_profile
    key = (mesh, setting)
    pricer = SHARED_CACHES.step_pricers.get(key)
    if pricer is None:
        pricer = StepPricer.for_mesh(mesh, setting)
        store(SHARED_CACHES.step_pricers, key, pricer, _MAX_PRICERS)
    return pricer


def plan_time(plan: Iterable[Any], mesh: Any, *, profile: CostProfile | str | os.PathLike[str] | None = None) -> float:
    """Seconds a redistribution plan takes: the sum of its steps' times.

    A step is read by duck typing (the planner's ``RedistributeStep``): ``kind``, ``bytes_per_rank``,
    ``mesh_dims`` (joint steps) or ``mesh_dim``, and ``local_copy_bytes`` if it has them.
    """
    pricer = StepPricer.for_mesh(mesh, profile)
    total = 0.0
    for step in plan:
        dims = getattr(step, "mesh_dims", None) or (step.mesh_dim,)
        total += pricer.step_time(step.kind, tuple(dims), step.bytes_per_rank, getattr(step, "local_copy_bytes", 0))
    return total


def crossover_table(profile: CostProfile, group_sizes: Sequence[int], mesh: Any | None = None) -> list[tuple[str, int, float]]:
    """(kind, group size, alpha * beta bytes) for each collective kind and group size, on a 1-D mesh of that size."""
    rows = []
    for size in group_sizes:
        line = mesh if mesh is not None else _LineMesh(size)
        for kind in COLLECTIVE_KINDS:
            if kind == "local_copy":
                continue
            rows.append((kind, size, bytes_worth_one_collective(kind, line, 0, profile=profile)))
    return rows


@dataclass(frozen=True)
class _LineMesh:
    """A 1-D mesh shape without processes, for pricing by group size alone."""

    size: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.size,)

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        return None
