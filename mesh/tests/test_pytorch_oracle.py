"""Our DeviceMesh against PyTorch's, side by side on the same 4 gloo ranks (PyTorch as an oracle only)."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.device_mesh as torch_device_mesh

from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.testing import multi_rank


def _observe(mesh: Any) -> dict[str, Any]:
    """What a user can observe of a mesh on this rank, in a form both implementations share."""
    observed: dict[str, Any] = {
        "shape": tuple(mesh.shape),
        "ndim": mesh.ndim,
        "size": mesh.size(),
        "names": mesh.mesh_dim_names,
        "coordinate": None if mesh.get_coordinate() is None else tuple(mesh.get_coordinate()),
        "repr": _pytorch_repr_part(repr(mesh)),
    }
    if mesh.get_coordinate() is not None:
        observed["grid"] = mesh.mesh.tolist()
        observed["sizes"] = [mesh.size(dim) for dim in range(mesh.ndim)]
        observed["local_ranks"] = [mesh.get_local_rank(dim) for dim in range(mesh.ndim)]
        observed["group_ranks"] = [dist.get_process_group_ranks(mesh.get_group(dim)) for dim in range(mesh.ndim)]
    return observed


def _pytorch_repr_part(text: str) -> str:
    """Our repr less the rank listing we add (PyTorch's does not tell rank layouts apart)."""
    for label in (", ranks=", ", submeshes="):
        start = text.find(label)
        if start >= 0:
            end = text.find(", Mesh: ", start)
            return text[:start] + (text[end:] if end >= 0 else ")")
    return text


def _compare(build: Callable[[Any, Any], list[Any]]) -> None:
    with warnings.catch_warnings():
        # PyTorch warns that slicing a flattened dim from the root will be deprecated.
        warnings.simplefilter("ignore")
        theirs = build(torch_device_mesh.DeviceMesh, torch_device_mesh.init_device_mesh)
    ours = build(DeviceMesh, init_device_mesh)
    assert len(ours) == len(theirs)
    for position, (our_mesh, their_mesh) in enumerate(zip(ours, theirs)):
        assert _observe(our_mesh) == _observe(their_mesh), f"mesh #{position} differs"


@multi_rank
def test_1d_and_2d_meshes_and_their_slices() -> None:
    def build(mesh_class: Any, init: Any) -> list[Any]:
        line = init("cpu", (4,), mesh_dim_names=("world",))
        grid = init("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        unnamed = init("cpu", (2, 2))
        return [line, grid, grid["dp"], grid["tp"], unnamed, mesh_class("cpu", [[0, 2], [1, 3]], mesh_dim_names=("x", "y"))]

    _compare(build)


@multi_rank
def test_3d_mesh_slices_and_flattened_dims() -> None:
    def build(mesh_class: Any, init: Any) -> list[Any]:
        mesh = init("cpu", (2, 1, 2), mesh_dim_names=("dp", "cp", "tp"))
        dp_cp = mesh["dp", "cp"]._flatten()
        cp_tp = mesh["cp", "tp"]._flatten("cp_tp")
        dp_tp = mesh["dp", "tp"]._flatten()
        return [mesh, mesh["dp", "tp"], mesh["cp"], dp_cp, cp_tp, dp_tp, mesh["dp_cp", "tp"], mesh["dp_tp"]]

    _compare(build)


@multi_rank
def test_mesh_over_part_of_the_world() -> None:
    def build(mesh_class: Any, init: Any) -> list[Any]:
        pair = mesh_class("cpu", [1, 3], mesh_dim_names=("x",))
        column = mesh_class("cpu", [[0, 1], [2, 3]], mesh_dim_names=("a", "b"))
        return [pair, column["a"]]

    _compare(build)
