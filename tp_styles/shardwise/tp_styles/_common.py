"""Helpers shared by the styles: describing modules in errors, checking meshes and layouts,
and turning a module's tensors into DTensors with the layout a style expects."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn as nn
from shardwise.dtensor_ops import DTensor
from shardwise.mesh import DeviceMesh
from shardwise.placement import Placement, Shard, normalize_dim

__all__ = [
    "describe_module",
    "require_1d_mesh",
    "check_placement",
    "check_shard_dim_fits",
    "same_layout",
    "as_dtensor",
    "to_layout",
]


def describe_module(module: nn.Module, module_path: str | None) -> str:
    """``'layers.0.wq' (Linear)``; the root module (path ``""``) or an unknown path reads ``the module (Linear)``."""
    kind = type(module).__name__
    if module_path:
        return f"module '{module_path}' ({kind})"
    return f"the module ({kind})"


def require_1d_mesh(device_mesh: object, style_name: str) -> DeviceMesh:
    """The mesh a style is applied on: a 1-D :class:`DeviceMesh` (the tensor-parallel dim)."""
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"{style_name}: device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
    if device_mesh.ndim != 1:
        raise ValueError(
            f"{style_name} lays tensors out on a 1-D device mesh (the tensor-parallel dim), but got a "
            f"{device_mesh.ndim}-D mesh {device_mesh}; pass its tensor-parallel sub-mesh (e.g. mesh['tp']), or call "
            "parallelize_module, which takes the dim named 'tp' of an n-D mesh"
        )
    return device_mesh


def check_placement(value: object, argument: str, style_name: str, *, allow_none: bool = False) -> None:
    """Raise a TypeError unless ``value`` is one Placement (or None when allowed)."""
    if value is None and allow_none:
        return
    if not isinstance(value, Placement):
        expected = "a Placement (Shard(d), Replicate() or Partial()) or None" if allow_none else (
            "a Placement (Shard(d), Replicate() or Partial())"
        )
        raise TypeError(
            f"{style_name}: {argument} must be {expected} describing the layout on the tensor-parallel mesh dim, "
            f"got {value!r} of type {type(value).__name__}"
        )


def _normalized(placement: Placement, ndim: int) -> Placement:
    if isinstance(placement, Shard) and placement.dim < 0:
        return Shard(normalize_dim(placement.dim, ndim))
    return placement


def same_layout(current: Sequence[Placement], wanted: Sequence[Placement], ndim: int) -> bool:
    """Whether two placement tuples are equal once negative Shard dims are resolved for ``ndim``."""
    if len(current) != len(wanted):
        return False
    return all(_normalized(a, ndim) == _normalized(b, ndim) for a, b in zip(current, wanted))


def check_shard_dim_fits(placement: Placement, tensor: torch.Tensor, where: str, what: str) -> None:
    """A Shard layout must name a dim the tensor has (checked before any collective)."""
    if isinstance(placement, Shard) and not -tensor.ndim <= placement.dim < tensor.ndim:
        raise ValueError(
            f"{where}: {what} is {placement!r}, which does not fit a tensor of shape {tuple(tensor.shape)} "
            f"({tensor.ndim} dims); expected a dim in [{-tensor.ndim}, {tensor.ndim - 1}]"
        )


def as_dtensor(value: Any, mesh: DeviceMesh, layout: Placement, where: str, what: str) -> DTensor:
    """``value`` as a DTensor on ``mesh``: a plain tensor is taken as this rank's piece laid out as ``layout``.

    A DTensor keeps its own placements (it knows its layout better than any declaration)
    but must live on ``mesh``.
    """
    if isinstance(value, DTensor):
        if value.device_mesh != mesh:
            raise ValueError(
                f"{where}: {what} is a DTensor on {value.device_mesh}, but the module is parallelized on {mesh}; "
                "redistribute it onto that mesh (or pass the local tensor)"
            )
        return value
    if isinstance(value, torch.Tensor):
        check_shard_dim_fits(layout, value, where, f"the layout of {what}")
        return DTensor.from_local(value, mesh, (layout,), run_check=False)
    raise TypeError(f"{where}: {what} must be a torch.Tensor or DTensor, got {type(value).__name__}")


def to_layout(tensor: DTensor, layout: Placement, *, async_op: bool) -> DTensor:
    """``tensor`` redistributed to ``(layout,)``; the same DTensor when it already is laid out so."""
    if same_layout(tensor.placements, (layout,), tensor.ndim):
        return tensor
    return tensor.redistribute(placements=(layout,), async_op=async_op)
