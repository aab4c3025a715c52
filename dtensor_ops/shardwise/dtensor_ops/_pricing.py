"""Read-only pricing: what an op call would decide and what moving a tensor between layouts would cost.

For planners outside the engine (``shardwise.tp_styles``' automatic planner) that must price a plan the way
dispatch would run it, from sizes alone: no DTensor, no process group, no collective. Two questions:

- ``decide(op, args, kwargs)``: the decision dispatch takes for the call (DTensors given as their specs):
  ``_decision_pipeline.propagate_op_sharding``, the same cached decision object dispatch uses.
- ``price_redistribution(...)`` / ``price_move(src_spec, dst_spec)``: the plan the planner makes for that
  move (``_planner``: the same search ``plan_redistribute`` runs, size-one mesh dims relabelled)
  priced by the calibrated cost model (``_cost_model.StepPricer``), as seconds, bytes one rank receives,
  the number of collectives and their kinds (the planner's step kinds).

The mesh may be a ``DeviceMesh`` or anything with its shape, dim names and device type (``FakeMesh``);
a ``profile`` given here overrides the ``cost_profile`` option for these prices only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch

from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, TensorMeta

from ._cost_model import StepPricer, pricer_for_mesh
from ._decision import OpDecision
from ._decision_pipeline import propagate_op_sharding
from ._planner import find_cheapest_plan_without_size_one_dims, mesh_supports_joint_steps

__all__ = ["Movement", "NO_MOVEMENT", "decide", "gradient_placements", "price_move", "price_redistribution", "spec_of"]


@dataclasses.dataclass(frozen=True)
class Movement:
    """What one or more redistributions cost one rank: seconds, bytes received, collectives and their kinds."""

    seconds: float = 0.0
    bytes_received: float = 0.0
    collectives: int = 0
    kinds: tuple[str, ...] = ()  # one entry per collective, the planner's step kind

    def __add__(self, other: Movement) -> Movement:
        return Movement(
            self.seconds + other.seconds,
            self.bytes_received + other.bytes_received,
            self.collectives + other.collectives,
            self.kinds + other.kinds,
        )

    def times(self, count: int) -> Movement:
        if count <= 0:
            return NO_MOVEMENT
        return Movement(self.seconds * count, self.bytes_received * count, self.collectives * count, self.kinds * count)


NO_MOVEMENT = Movement()


def spec_of(mesh: Any, placements: Sequence[Placement], shape: Sequence[int], dtype: torch.dtype,
            stride: Sequence[int] | None = None) -> DTensorSpec[Any]:
    """The spec of a tensor of global ``shape`` laid out by ``placements`` over ``mesh`` (contiguous by default)."""
    size = torch.Size([int(extent) for extent in shape])
    if stride is None:
        steps: list[int] = []
        running = 1
        for extent in reversed(size):
            steps.append(running)
            running *= max(int(extent), 1)
        stride = tuple(reversed(steps))
    return DTensorSpec(mesh, tuple(placements), TensorMeta(size, tuple(int(step) for step in stride), dtype))


def decide(op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object] | None = None) -> OpDecision:
    """The decision dispatch takes for ``op(*args, **kwargs)`` with every DTensor given as its spec (cached;
    raises as dispatch would for an op without a rule)."""
    return propagate_op_sharding(op, tuple(args), dict(kwargs or {}))


def gradient_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """The layout a redistribution's gradient goes back to: its source's, Partial dims as Replicate."""
    return tuple(Replicate() if isinstance(placement, Partial) else placement for placement in placements)


def price_move(
    src: DTensorSpec[Any], dst: DTensorSpec[Any], *, profile: Any = None, allow_joint_steps: bool | None = None
) -> Movement:
    """The cost of redistributing a tensor from ``src`` to ``dst`` (same mesh and global shape).

    ``allow_joint_steps``: None plans as ``plan_redistribute`` does on this mesh (joint steps where the mesh has
    the groups); False plans one mesh dim at a time, as on the one-dim sub-meshes styles and FSDP run on."""
    if src.placements == dst.placements:
        return NO_MOVEMENT
    assert src.tensor_meta is not None
    return price_redistribution(
        src.mesh, tuple(src.tensor_meta.shape), src.tensor_meta.dtype, src.placements, dst.placements, profile=profile,
        allow_joint_steps=allow_joint_steps,
    )


def price_redistribution(
    mesh: Any,
    shape: Sequence[int],
    dtype: torch.dtype,
    src: Sequence[Placement],
    dst: Sequence[Placement],
    *,
    profile: Any = None,
    allow_joint_steps: bool | None = None,
) -> Movement:
    """The cost of the planner's plan from ``src`` to ``dst`` for a tensor of global ``shape`` and ``dtype``
    (``allow_joint_steps``: see ``price_move``)."""
    src, dst = tuple(src), tuple(dst)
    if src == dst:
        return NO_MOVEMENT
    pricer = pricer_for_mesh(mesh) if profile is None else _pricer(mesh, profile)
    joint = mesh_supports_joint_steps(mesh) if allow_joint_steps is None else bool(allow_joint_steps and mesh_supports_joint_steps(mesh))
    key = (mesh, tuple(int(extent) for extent in shape), dtype.itemsize, src, dst, pricer.cache_key, joint)
    movement = _MOVEMENTS.get(key)
    if movement is None:
        if len(_MOVEMENTS) >= _MAX_MOVEMENTS:
            _MOVEMENTS.clear()
        movement = _MOVEMENTS[key] = _priced(mesh, key[1], key[2], src, dst, pricer, joint)
    return movement


_MAX_MOVEMENTS = 8192
_MOVEMENTS: dict[tuple[Any, ...], Movement] = {}
_PRICERS: dict[tuple[Any, Any], StepPricer] = {}


def _pricer(mesh: Any, profile: Any) -> StepPricer:
    key = (mesh, profile if isinstance(profile, (str, type(None))) else id(profile))
    pricer = _PRICERS.get(key)
    if pricer is None:
        if len(_PRICERS) >= 64:
            _PRICERS.clear()
        pricer = _PRICERS[key] = StepPricer.for_mesh(mesh, profile)
    return pricer


def _priced(
    mesh: Any, shape: tuple[int, ...], itemsize: int, src: tuple[Placement, ...], dst: tuple[Placement, ...], pricer: StepPricer,
    joint: bool,
) -> Movement:
    plan = find_cheapest_plan_without_size_one_dims(
        shape,
        tuple(int(size) for size in mesh.shape),
        src,
        dst,
        itemsize,
        allow_joint_steps=joint,
        step_price=pricer,
    )
    seconds = 0.0
    received = 0.0
    kinds: list[str] = []
    for step in plan:
        seconds += pricer.step_time(step.kind, step.mesh_dims, step.bytes_per_rank, step.local_copy_bytes)
        if step.kind.is_collective:
            received += step.bytes_per_rank
            kinds.append(step.kind.value)
    return Movement(seconds, received, len(kinds), tuple(kinds))
