"""PyTorch's ``torch.distributed.tensor._redistribute`` names over shardwise's redistribution.

``redistribute_local_tensor`` is the executor (``_plan_executor``) under PyTorch's contract for the
name: a change from one Partial reduce op to another is refused (shardwise's engine, which may route
one through Replicate, calls the executor itself); ``Redistribute`` is PyTorch's autograd-function
spelling of ``DTensor.redistribute``.

PyTorch's planner vocabulary reads shardwise's plan: ``_gen_transform_infos(src, dst)`` is
``plan_redistribute(src, dst)`` (the cheapest plan, joint steps included) written as PyTorch's
``_TransformInfo`` list, a joint step (one collective over several mesh dims) as a
``_FlattenedTransformInfo``. shardwise always plans at minimum cost, so
``use_min_cost_redistribution_plan`` changes nothing (PyTorch's greedy planner does not exist here);
``_optimize_transform_infos`` merges consecutive same-collective steps into flattened ones, as
PyTorch's pass does, unless ``disable_redistribute_transform_optimization`` is in force.
``get_redistribute_planner(mesh, tensor_meta)`` gives PyTorch's planner object over the same plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from typing import Any, Iterator, Mapping, Sequence

import torch

from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, _StridedShard

from .._conversions import redistribute as redistribute_dtensor
from .._planner import plan_states
from .._plan_executor import (
    RedistributeStep,
    StepKind,
    grad_target_spec,
    gradient_placements,
    plan_bytes_per_rank,
    plan_redistribute,
    redistribute_cost_bytes,
    redistribute_lower_bound_bytes,
)
from .._plan_executor import redistribute_local_tensor as _run_redistribution

__all__ = [
    "_FlattenedTransformInfo",
    "_TransformInfo",
    "_gen_transform_infos",
    "_gen_transform_infos_non_cached",
    "_optimize_transform_infos",
    "disable_redistribute_transform_optimization",
    "DTensorRedistributePlanner",
    "PartialConversionError",
    "get_redistribute_planner",
    "use_min_cost_redistribution_plan",
    "Redistribute",
    "RedistributeStep",
    "StepKind",
    "grad_target_spec",
    "gradient_placements",
    "plan_bytes_per_rank",
    "plan_redistribute",
    "redistribute_cost_bytes",
    "redistribute_local_tensor",
    "redistribute_lower_bound_bytes",
]


class Redistribute:
    """PyTorch's ``Redistribute`` autograd function: ``Redistribute.apply(input, device_mesh, placements, ...)``.

    The same as ``input.redistribute(device_mesh, placements, async_op=..., forward_dtype=...,
    backward_dtype=...)`` (differentiable, twice over). ``apply`` also takes PyTorch 2.13's fifth
    positional argument, the ``{"op_dtype", "out_dtype", "backward_options"}`` dtype configuration.
    """

    @staticmethod
    def apply(
        input: torch.Tensor,
        device_mesh: Any,
        placements: Sequence[Placement],
        async_op: bool = False,
        dtype_config: Mapping[str, Any] | torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        forward_dtype: torch.dtype | None
        if isinstance(dtype_config, Mapping):
            forward_dtype = dtype_config.get("op_dtype")
            backward_options = dtype_config.get("backward_options") or {}
            backward_dtype = backward_options.get("op_dtype", backward_dtype)
        else:
            forward_dtype = dtype_config
        if not hasattr(input, "_spec") or not hasattr(input, "redistribute"):
            raise TypeError(f"Redistribute.apply expects a DTensor, got {type(input).__name__}")
        # PyTorch's internal entry point: unlike DTensor.redistribute it may turn a Replicate or Shard
        # mesh dim into Partial (a local step).
        result: torch.Tensor = redistribute_dtensor(
            input,
            device_mesh,
            placements,
            async_op=async_op,
            forward_dtype=forward_dtype,
            backward_dtype=backward_dtype,
            allow_partial_targets=True,
        )
        return result


# PyTorch's module-level switches, read by the functions below.
_DISABLE_REDISTRIBUTE_TRANSFORM_OPTIMIZATION = False
_FORCE_MIN_COST_REDISTRIBUTION_PLAN: bool | None = None


@contextlib.contextmanager
def use_min_cost_redistribution_plan(enabled: bool = True) -> Iterator[None]:
    """PyTorch's switch between its greedy and min-cost planners; shardwise's one planner is always min-cost."""
    global _FORCE_MIN_COST_REDISTRIBUTION_PLAN
    previous = _FORCE_MIN_COST_REDISTRIBUTION_PLAN
    _FORCE_MIN_COST_REDISTRIBUTION_PLAN = enabled
    try:
        yield
    finally:
        _FORCE_MIN_COST_REDISTRIBUTION_PLAN = previous


@contextlib.contextmanager
def disable_redistribute_transform_optimization(disabled: bool = True) -> Iterator[None]:
    """Inside: :func:`_optimize_transform_infos` returns its input unchanged."""
    global _DISABLE_REDISTRIBUTE_TRANSFORM_OPTIMIZATION
    previous = _DISABLE_REDISTRIBUTE_TRANSFORM_OPTIMIZATION
    _DISABLE_REDISTRIBUTE_TRANSFORM_OPTIMIZATION = disabled
    try:
        yield
    finally:
        _DISABLE_REDISTRIBUTE_TRANSFORM_OPTIMIZATION = previous


@dataclasses.dataclass(frozen=True, slots=True)
class _TransformInfo:
    """One step of a plan: mesh dim ``mesh_dim`` goes from ``src_dst_placements[0]`` to ``[1]``.

    ``logical_shape``: the extent of the tensor that this mesh dim cuts at that point (the global
    shape cut by the mesh dims before it).
    """

    mesh_dim: int
    src_dst_placements: tuple[Placement, Placement]
    logical_shape: Sequence[int]

    def __post_init__(self) -> None:
        if self.mesh_dim < 0:
            raise AssertionError(f"_TransformInfo: mesh_dim must be >= 0, got {self.mesh_dim}")
        if self.src_dst_placements[0] == self.src_dst_placements[1]:
            raise AssertionError(f"_TransformInfo for a step that changes nothing ({self.src_dst_placements[0]})")

    def _comm_type_key(self) -> str | None:
        """The collective this step needs (None: local)."""
        return _comm_type(*self.src_dst_placements)


@dataclasses.dataclass(frozen=True, slots=True)
class _FlattenedTransformInfo(_TransformInfo):
    """Several mesh dims changed by one collective over their flattened group."""

    mesh: Any
    original_mesh_dims: tuple[int, ...]
    avg_scale: int | None = None

    def __post_init__(self) -> None:
        _TransformInfo.__post_init__(self)
        if self.avg_scale is not None and self.avg_scale <= 1:
            raise AssertionError(f"_FlattenedTransformInfo: avg_scale must be > 1 when given, got {self.avg_scale}")


def _is_cut(placement: Placement) -> bool:
    return isinstance(placement, (Shard, _StridedShard))


def _comm_type(src: Placement, dst: Placement) -> str | None:
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return "all_reduce"
        if _is_cut(dst):
            return "reduce_scatter"
        return None
    if _is_cut(src):
        if isinstance(dst, Replicate):
            return "all_gather"
        if _is_cut(dst):
            return "all_to_all"
    return None


def _logical_shape(global_shape: Sequence[int], mesh_shape: Sequence[int], state: Sequence[Placement], mesh_dim: int) -> list[int]:
    """The extent mesh dim ``mesh_dim`` works on in ``state``: the largest piece the mesh dims before it leave."""
    shape = list(global_shape)
    for earlier in range(mesh_dim):
        placement = state[earlier]
        if _is_cut(placement):
            dim = placement.dim  # type: ignore[attr-defined]
            shape[dim] = -(-shape[dim] // mesh_shape[earlier])
    return shape


def _flattened_mesh(mesh: Any, mesh_dims: tuple[int, ...]) -> Any:
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None:
        return mesh
    return mesh[tuple(names[d] for d in mesh_dims)]._flatten()


def _gen_transform_infos_non_cached(
    src_spec: DTensorSpec[Any], dst_spec: DTensorSpec[Any], use_graph_based_transform: bool | None = None
) -> list[_TransformInfo]:
    """shardwise's plan from ``src_spec`` to ``dst_spec`` in PyTorch's form (one planner: the cheapest plan)."""
    src_layout, dst_layout = src_spec.as_layout_spec(), dst_spec.as_layout_spec()
    plan = plan_redistribute(src_layout, dst_layout)
    mesh_shape = tuple(src_spec.mesh.shape)
    global_shape = tuple(src_spec.shape)
    infos: list[_TransformInfo] = []
    for step, state in zip(plan, plan_states(src_layout.placements, plan)):
        if step.joint:
            dims = step.mesh_dims
            infos.append(
                _FlattenedTransformInfo(
                    mesh_dim=dims[0],
                    src_dst_placements=(step.before, step.after),
                    logical_shape=_logical_shape(global_shape, mesh_shape, state, dims[0]),
                    mesh=_flattened_mesh(src_spec.mesh, dims),
                    original_mesh_dims=dims,
                )
            )
        else:
            infos.append(
                _TransformInfo(
                    mesh_dim=step.mesh_dim,
                    src_dst_placements=(step.before, step.after),
                    logical_shape=_logical_shape(global_shape, mesh_shape, state, step.mesh_dim),
                )
            )
    return infos


@functools.cache
def _gen_transform_infos(
    src_spec: DTensorSpec[Any], dst_spec: DTensorSpec[Any], use_graph_based_transform: bool | None = None
) -> list[_TransformInfo]:
    """:func:`_gen_transform_infos_non_cached`, cached per spec pair (``cache_clear()`` empties it)."""
    return _gen_transform_infos_non_cached(src_spec, dst_spec, use_graph_based_transform)


class PartialConversionError(ValueError, AssertionError):
    """A change from one Partial reduce op to another asked of ``redistribute_local_tensor`` (PyTorch raises
    AssertionError there; both types catch it)."""


def redistribute_local_tensor(
    local_tensor: torch.Tensor,
    current_spec: DTensorSpec[Any],
    target_spec: DTensorSpec[Any],
    *,
    async_op: bool = False,
    is_backward: bool = False,
    use_graph_based_transform: bool | None = None,
    is_explicit: bool = False,
) -> torch.Tensor:
    """This rank's piece of ``target_spec`` from its piece of ``current_spec`` (PyTorch's function).

    ``is_backward`` (PyTorch before 2.13) and ``use_graph_based_transform`` change nothing (one planner,
    the cheapest plan); ``is_explicit`` (2.13): the user asked for it, as torch's ``DebugMode`` records it.
    """
    for mesh_dim, (current, target) in enumerate(zip(current_spec.placements, target_spec.placements)):
        if isinstance(current, Partial) and isinstance(target, Partial) and current.reduce_op != target.reduce_op:
            raise PartialConversionError(
                f"Redistribution from one partial type ({current}) to another ({target}) is unsupported "
                f"(mesh dim {mesh_dim}): reduce to Replicate or Shard first"
            )
    return _run_redistribution(local_tensor, current_spec, target_spec, async_op=async_op, is_explicit=is_explicit)


class DTensorRedistributePlanner:
    """PyTorch's planner object for one mesh and tensor, over shardwise's one planner.

    ``generate_graph_based_transform_infos(src_spec, dst_spec, full_tensor_shape)`` and
    ``generate_greedy_transform_infos(src_spec, dst_spec)`` both give :func:`_gen_transform_infos`'s
    plan (the cheapest; shardwise has no greedy planner). ``partial_reduce_ops_in_target`` collects
    the reduce ops of the Partials at the ends of the plans asked for: the only Partials the search
    passes through (a mesh dim goes through Replicate, every Shard and its two ends' placements).
    """

    def __init__(self, device_mesh: Any, dtensor_meta: Any) -> None:
        self.device_mesh = device_mesh
        self.dtensor_meta = dtensor_meta
        self.partial_reduce_ops_in_target: set[str] = set()

    def _checked(self, src_spec: DTensorSpec[Any], dst_spec: DTensorSpec[Any]) -> None:
        for name, spec in (("src_spec", src_spec), ("dst_spec", dst_spec)):
            if spec.mesh != self.device_mesh:
                raise ValueError(f"{name} is on {spec.mesh}, this planner plans on {self.device_mesh}")
        for placement in (*src_spec.placements, *dst_spec.placements):
            if isinstance(placement, Partial):
                self.partial_reduce_ops_in_target.add(placement.reduce_op)

    def generate_graph_based_transform_infos(
        self, src_spec: DTensorSpec[Any], dst_spec: DTensorSpec[Any], full_tensor_shape: Sequence[int] | None = None
    ) -> list[_TransformInfo]:
        if full_tensor_shape is not None and tuple(full_tensor_shape) != tuple(src_spec.shape):
            raise ValueError(f"full_tensor_shape {tuple(full_tensor_shape)} is not the specs' {tuple(src_spec.shape)}")
        self._checked(src_spec, dst_spec)
        return _gen_transform_infos_non_cached(src_spec, dst_spec)

    def generate_greedy_transform_infos(self, src_spec: DTensorSpec[Any], dst_spec: DTensorSpec[Any]) -> list[_TransformInfo]:
        self._checked(src_spec, dst_spec)
        return _gen_transform_infos_non_cached(src_spec, dst_spec)


@functools.lru_cache(maxsize=256)
def get_redistribute_planner(device_mesh: Any, dtensor_meta: Any) -> DTensorRedistributePlanner:
    """The planner for ``device_mesh`` and ``dtensor_meta`` (the same object for the same pair, as PyTorch's)."""
    return DTensorRedistributePlanner(device_mesh, dtensor_meta)


_MERGEABLE = frozenset({"all_gather", "all_reduce", "reduce_scatter"})
_LINEAR = frozenset({"sum", "avg"})

# PyTorch's module path in shardwise: code that listens to PyTorch's logger name, translated, hears these.
_logger = logging.getLogger("shardwise.dtensor_ops._redistribute")
# (comm type, mesh dims, reason) already warned about: each missed merge is reported once per process.
_warned_flatten_issues: set[tuple[str, tuple[int, ...], str]] = set()


def _same_collective(first: _TransformInfo, other: _TransformInfo) -> bool:
    """Whether ``other`` is the same collective as ``first`` with compatible placements (mergeable)."""
    if isinstance(other, _FlattenedTransformInfo) or other._comm_type_key() != first._comm_type_key():
        return False
    (src_a, dst_a), (src_b, dst_b) = first.src_dst_placements, other.src_dst_placements
    if dst_a != dst_b:
        return False
    if isinstance(src_a, Partial) and isinstance(src_b, Partial):
        # sum and avg both reduce by summing (avg scales afterwards): they share one collective.
        return src_a == src_b or (src_a.reduce_op in _LINEAR and src_b.reduce_op in _LINEAR)
    return src_a == src_b


def _dim_names(mesh: Any, dims: Sequence[int]) -> str:
    names = getattr(mesh, "mesh_dim_names", None)
    return ", ".join(f'"{names[d]}"' if names else str(d) for d in dims)


def _warn_once(reason: str, comm: str, dims: tuple[int, ...], message: str) -> None:
    key = (comm, dims, reason)
    if key in _warned_flatten_issues:
        return
    _warned_flatten_issues.add(key)
    _logger.warning(message)


def _merge_run(
    run: list[_TransformInfo], device_mesh: Any, src_placements: tuple[Placement, ...], dst_placements: tuple[Placement, ...]
) -> list[_TransformInfo]:
    """One flattened step for ``run`` (>= 2 steps of one collective), or ``run`` itself where that is not exact."""
    first = run[0]
    comm = first._comm_type_key()
    assert comm is not None
    order = tuple(info.mesh_dim for info in run)
    dims = tuple(sorted(order))
    context = (
        f"While redistributing from {tuple(src_placements)!r} to {tuple(dst_placements)!r}, {len(run)} sequential "
        f"{comm} operations on mesh dims {_dim_names(device_mesh, dims)}"
    )
    # A gather undoes cuts innermost first, a reduce-scatter makes them outermost first: only then is
    # one collective over the flattened group the same layout.
    exact_order = order == tuple(sorted(order, reverse=True)) if comm == "all_gather" else True
    if comm == "reduce_scatter" and order != dims:
        exact_order = False
    if not exact_order:
        _warn_once("order", comm, order, f"{context} run in non-ascending order {order}; they stay separate {comm}s")
        return run
    outermost = min(run, key=lambda info: info.mesh_dim)
    group = math.prod(device_mesh.size(d) for d in dims)
    dst = first.src_dst_placements[1]
    if comm == "reduce_scatter" and _is_cut(dst):
        extent = outermost.logical_shape[dst.dim]  # type: ignore[attr-defined]
        if extent % group != 0:
            _warn_once(
                "uneven",
                comm,
                dims,
                f"{context}: tensor dim of size {extent} is not evenly divisible by the flattened group of {group} "
                "ranks, so merging would move elements to other ranks; they stay separate (suboptimal)",
            )
            return run
    flattened_over = getattr(device_mesh, "_flattened_over", None)
    flattened = flattened_over(dims) if flattened_over is not None else None
    if flattened is None:
        _warn_once(
            "no flattened mesh",
            comm,
            dims,
            f"{context} could be one {comm} over their flattened mesh, but none exists (create it with "
            f"mesh[...]._flatten()); running them one by one is suboptimal",
        )
        return run
    avg_dims = [
        info.mesh_dim
        for info in run
        if isinstance(info.src_dst_placements[0], Partial) and info.src_dst_placements[0].reduce_op == "avg"
    ]
    mixed = avg_dims and len(avg_dims) < len(run)
    avg_scale = math.prod(device_mesh.size(d) for d in avg_dims) if mixed else None
    source = Partial("sum") if mixed else first.src_dst_placements[0]
    return [
        _FlattenedTransformInfo(
            mesh_dim=dims[0],
            src_dst_placements=(source, dst),
            logical_shape=outermost.logical_shape,
            mesh=flattened,
            original_mesh_dims=dims,
            avg_scale=avg_scale if avg_scale is not None and avg_scale > 1 else None,
        )
    ]


def _optimize_transform_infos(
    transform_infos: list[_TransformInfo],
    device_mesh: Any,
    src_placements: tuple[Placement, ...],
    dst_placements: tuple[Placement, ...],
) -> list[_TransformInfo]:
    """Merge each run of consecutive steps doing the same collective into one step over their flattened mesh.

    Merged when a flattened mesh over exactly those mesh dims exists (``mesh[...]._flatten()``), the
    steps run in the order the flattened group lays ranks out (a gather innermost first, a
    reduce-scatter outermost first) and, for a reduce-scatter, the cut dim divides evenly by the
    group; a missed merge is logged once. Partial sum and avg share a collective (``avg_scale``: the
    divisor the avg dims need afterwards). Unchanged (the same list) under
    :func:`disable_redistribute_transform_optimization`.
    """
    if len(transform_infos) < 2 or _DISABLE_REDISTRIBUTE_TRANSFORM_OPTIMIZATION:
        return transform_infos
    merged: list[_TransformInfo] = []
    index = 0
    while index < len(transform_infos):
        first = transform_infos[index]
        end = index + 1
        if first._comm_type_key() in _MERGEABLE and not isinstance(first, _FlattenedTransformInfo):
            while end < len(transform_infos) and _same_collective(first, transform_infos[end]):
                end += 1
        run = list(transform_infos[index:end])
        merged.extend(run if len(run) < 2 else _merge_run(run, device_mesh, src_placements, dst_placements))
        index = end
    return merged
