"""Helpers shared by the redistribute tests: coordinates, Partial inputs, logical values.

The value checks never trust the code under test to say what a Partial means: source
contributions are built here so that their reduction (last mesh dim first) is the full
tensor, and results are reduced here before being compared with the full tensor.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.dtensor_ops._planner import StepKind
from shardwise.placement import Partial, Placement, Replicate, Shard, select_local_shard
from shardwise.testing import priced_by as priced_by  # re-exported for the tests that import it here

Coordinate = tuple[int, ...]

PLACEMENTS_1D: tuple[Placement, ...] = (
    Shard(0),
    Shard(1),
    Replicate(),
    Partial("sum"),
    Partial("avg"),
    Partial("max"),
    Partial("min"),
)


def all_coordinates(mesh_shape: Sequence[int]) -> list[Coordinate]:
    return list(itertools.product(*(range(extent) for extent in mesh_shape)))


def placement_tuples(mesh_ndim: int) -> Iterator[tuple[Placement, ...]]:
    return itertools.product(PLACEMENTS_1D, repeat=mesh_ndim)


def full_tensor(shape: Sequence[int], seed: int) -> torch.Tensor:
    """Small integers as float32, so sums, averages over 2 or 4 and maxima are exact."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-9, 10, tuple(shape), generator=generator).to(torch.float32)


def _split_into_contributions(
    value: torch.Tensor, reduce_op: str, count: int, generator: torch.Generator
) -> list[torch.Tensor]:
    """``count`` tensors whose ``reduce_op`` reduction is exactly ``value``."""
    if count == 1:
        return [value.clone()]
    noise = [torch.randint(0, 6, value.shape, generator=generator).to(value.dtype) for _ in range(count)]
    if reduce_op in ("sum", "avg"):
        others = [n - 3 for n in noise[1:]]
        total = value * count if reduce_op == "avg" else value
        return [total - sum(others, torch.zeros_like(value)), *others]
    sign = -1 if reduce_op == "max" else 1
    parts = [value + sign * n for n in noise]
    # One contribution per element carries the value itself, so the max (min) is exact.
    owner = torch.randint(0, count, value.shape, generator=generator)
    for index, part in enumerate(parts):
        part[owner == index] = value[owner == index]
    return parts


def source_locals(
    full: torch.Tensor, mesh_shape: Sequence[int], placements: Sequence[Placement], seed: int
) -> dict[Coordinate, torch.Tensor]:
    """Every coordinate's local shard for ``placements``; Partial dims get contributions.

    Contributions are split outermost mesh dim first, so that reducing the last mesh dim
    first gives back ``full`` (the meaning of mixed Partial placements).
    """
    generator = torch.Generator().manual_seed(seed)
    values: dict[Coordinate, torch.Tensor] = {(): full}
    for mesh_dim, placement in enumerate(placements):
        extent = mesh_shape[mesh_dim]
        refined: dict[Coordinate, torch.Tensor] = {}
        for prefix, value in values.items():
            if isinstance(placement, Partial):
                parts = _split_into_contributions(value, placement.reduce_op, extent, generator)
            else:
                parts = [value] * extent
            for index, part in enumerate(parts):
                refined[prefix + (index,)] = part
        values = refined
    return {
        coordinate: select_local_shard(value, mesh_shape, coordinate, placements).clone()
        for coordinate, value in values.items()
    }


def _reduce(tensors: Sequence[torch.Tensor], reduce_op: str) -> torch.Tensor:
    stacked = torch.stack(list(tensors))
    if reduce_op == "sum":
        return stacked.sum(0)
    if reduce_op == "avg":
        if stacked.is_floating_point():
            return stacked.sum(0) / len(tensors)
        return torch.div(stacked.sum(0), len(tensors), rounding_mode="trunc")
    if reduce_op == "max":
        return stacked.amax(0)
    return stacked.amin(0)


def check_locals(
    full: torch.Tensor,
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    locals_by_coordinate: dict[Coordinate, torch.Tensor],
) -> list[str]:
    """Problems with ``locals_by_coordinate`` as a layout of ``full`` (empty when it is right).

    Partial dims are reduced last mesh dim first; every coordinate's result must then be
    its shard of ``full`` for the placements with Partial replaced by Replicate.
    """
    problems: list[str] = []
    values = dict(locals_by_coordinate)
    for coordinate, local in values.items():
        expected_shape = select_local_shard(full, mesh_shape, coordinate, placements).shape
        if local.dtype != full.dtype:
            problems.append(f"coordinate {coordinate}: local dtype {local.dtype}, expected {full.dtype}")
        elif local.shape != expected_shape:
            problems.append(f"coordinate {coordinate}: local shape {tuple(local.shape)}, expected {tuple(expected_shape)}")
    if problems:
        return problems
    for mesh_dim in reversed(range(len(mesh_shape))):
        placement = placements[mesh_dim]
        if not isinstance(placement, Partial):
            continue
        reduced: dict[Coordinate, torch.Tensor] = {}
        for coordinate in values:
            if coordinate[mesh_dim] != 0:
                continue
            group = [coordinate[:mesh_dim] + (index,) + coordinate[mesh_dim + 1 :] for index in range(mesh_shape[mesh_dim])]
            result = _reduce([values[member] for member in group], placement.reduce_op)
            for member in group:
                reduced[member] = result
        values = reduced
    logical = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
    for coordinate, value in sorted(values.items()):
        expected = select_local_shard(full, mesh_shape, coordinate, logical)
        # Averages over a mesh dim of 3 are not exact in float32; every real mistake is off
        # by at least 1 (the inputs are small integers).
        if not torch.allclose(value, expected, rtol=0.0, atol=1e-4):
            problems.append(f"coordinate {coordinate}: got {value.tolist()}, expected {expected.tolist()}")
    return problems


def describe(placements: Sequence[Placement]) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"


_functional = torch.ops._c10d_functional
_COLLECTIVE_NAMES = {
    _functional.all_gather_into_tensor: "all_gather",
    _functional.reduce_scatter_tensor: "reduce_scatter",
    _functional.all_reduce: "all_reduce",
    _functional.all_to_all_single: "all_to_all",
    _functional.wait_tensor: "wait",
}


def collective_name(kind: StepKind) -> str:
    """The collective a plan step issues, as CollectiveLog names it (a joint step's runs over its joint group)."""
    return {
        StepKind.JOINT_ALL_TO_ALL: "all_to_all",
        StepKind.JOINT_ALL_TO_ALL_REDUCE: "all_to_all",
        StepKind.JOINT_REDUCE_SCATTER: "reduce_scatter",
        StepKind.JOINT_ALL_REDUCE: "all_reduce",
    }.get(kind, kind.value)


class CollectiveLog(TorchDispatchMode):
    """Records the functional collectives (and waits) run inside it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        name = _COLLECTIVE_NAMES.get(func.overloadpacket)
        if name is not None:
            self.names.append(name)
        return func(*args, **(kwargs or {}))

    @property
    def collectives(self) -> list[str]:
        return [name for name in self.names if name != "wait"]


def expected_1d_collectives(src: Placement, dst: Placement, shape: Sequence[int]) -> list[str]:
    """What a 1-D transition must issue on a mesh of 4, worked out by hand (shapes with at least one
    element per rank somewhere)."""
    if src == dst or isinstance(src, Replicate):
        return []
    if isinstance(src, Shard):
        return {Replicate: ["all_gather"], Shard: ["all_to_all"]}.get(type(dst), [])  # S -> P: local
    if isinstance(dst, Replicate):
        return ["all_reduce"]
    if isinstance(dst, Shard) or shape[0] % 4 == 0:
        # P -> S; and P(a) -> S(0) -> P(b): half an all-reduce's bytes, where no piece is padded.
        return ["reduce_scatter"]
    # P(a) -> P(b) of rows that do not divide by 4: padding the pieces and zero-filling the parent
    # around a reduce-scatter cost more local copies than the all-reduce's extra bytes on these
    # small tensors (priced by the cost model's local_copy), so all-reduce, then split locally.
    return ["all_reduce"]
