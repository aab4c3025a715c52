"""Mesh queries while torch traces: under fake and proxy modes, on meshes built there (nothing cached).

A mesh's ranks are static data. AOTAutograd prints what it traced (the DTensor metadata, so the mesh's
repr) while its fake and proxy modes are still on; a rank listing kept as a tensor was then fake, and
reading it back was a data-dependent guard (``GuardOnDataDependentSymNode``). Every question asked
here must answer from plain Python, the same as eagerly. The compiled DTensor case is
compile_support/tests/test_trace_log_ranks.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from shardwise.mesh import DeviceMesh


def _fresh_meshes() -> list[DeviceMesh]:
    """Layout-only meshes (no process group needed), including slices, built anew each call (nothing cached)."""
    # Rank lists, not tensors: a tensor made under fake mode would be fake itself.
    grid = DeviceMesh("cpu", [[[0, 1], [2, 3]], [[4, 5], [6, 7]]], mesh_dim_names=("dp", "cp", "tp"), _init_backend=False, _rank=5)
    reversed_ranks = DeviceMesh("cpu", [3, 2, 1, 0], _init_backend=False, _rank=1)
    large = DeviceMesh("cpu", [list(range(row * 16 + 15, row * 16 - 1, -1)) for row in range(8)], _init_backend=False, _rank=7)
    return [grid, grid["tp"], grid["dp", "tp"], grid["dp", "cp"]._flatten(), reversed_ranks, large]


def _answers(mesh: DeviceMesh) -> tuple[Any, ...]:
    return (
        repr(mesh),
        mesh.mesh.tolist() if not isinstance(mesh.mesh, torch._subclasses.FakeTensor) else None,
        tuple(mesh.mesh.shape),
        mesh.get_coordinate(),
        tuple(mesh.get_local_rank(dim) for dim in range(mesh.ndim)),
        mesh.size(),
        tuple(mesh.size(dim) for dim in range(mesh.ndim)),
        mesh.get_rank(),
    )


def test_mesh_queries_under_fake_tensor_mode_answer_as_eagerly() -> None:
    eager = [_answers(mesh) for mesh in _fresh_meshes()]
    with FakeTensorMode():
        traced = [_answers(mesh) for mesh in _fresh_meshes()]
    # ``mesh.mesh`` is a fake tensor there (its values unreadable); everything else is identical.
    assert [answer[:1] + answer[2:] for answer in traced] == [answer[:1] + answer[2:] for answer in eager]


def test_mesh_queries_under_symbolic_proxy_tracing_answer_as_eagerly() -> None:
    seen: list[tuple[Any, ...]] = []

    def uses_the_mesh(x: torch.Tensor) -> torch.Tensor:
        meshes = _fresh_meshes()
        seen.extend(_answers(mesh)[:1] + _answers(mesh)[2:] for mesh in meshes)
        return x * meshes[0].size() + meshes[0].mesh.sum()

    graph = make_fx(uses_the_mesh, tracing_mode="symbolic")(torch.ones(3))
    eager = [_answers(mesh)[:1] + _answers(mesh)[2:] for mesh in _fresh_meshes()]
    assert seen == eager
    torch.testing.assert_close(graph(torch.ones(3)), uses_the_mesh(torch.ones(3)))
