"""Mesh argument validation, without processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardwise.mesh import MeshDimError, MeshError
from shardwise.mesh._validation import (
    RankGrid,
    check_device_type,
    check_fits_world,
    check_mesh_shape,
    check_world_size_matches,
    normalize_dim_names,
    rank_grid_from,
    resolve_dim_index,
    resolve_slice,
)


def test_errors_are_caught_as_the_types_pytorch_raised() -> None:
    assert issubclass(MeshError, ValueError) and issubclass(MeshError, RuntimeError)
    assert issubclass(MeshDimError, KeyError) and issubclass(MeshDimError, MeshError)
    # KeyError would show repr(message); ours shows the message itself.
    assert str(MeshDimError("dim 'x' is unknown")) == "dim 'x' is unknown"


@pytest.mark.parametrize(
    "mesh",
    [
        [[0, 1], [2, 3]],
        ((0, 1), (2, 3)),
        torch.tensor([[0, 1], [2, 3]]),
        torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        torch.tensor([[0, 2], [1, 3]]).t(),  # non-contiguous tensor: read in index order
        np.array([[0, 1], [2, 3]]),
        [range(0, 2), range(2, 4)],
        [[np.int64(0), 1], [2, np.int32(3)]],
    ],
)
def test_rank_grid_accepts_tensors_arrays_and_nested_sequences(mesh: object) -> None:
    assert rank_grid_from(mesh) == RankGrid(shape=(2, 2), ranks=(0, 1, 2, 3))


def test_rank_grid_keeps_arbitrary_rank_order() -> None:
    grid = rank_grid_from([[3, 1], [2, 0]])
    assert grid.shape == (2, 2) and grid.ranks == (3, 1, 2, 0)
    assert rank_grid_from([5]).ranks == (5,)  # bigger than any world: that is check_fits_world's call


@pytest.mark.parametrize(
    ("mesh", "message"),
    [
        (torch.tensor([0.0, 1.0]), r"dtype torch\.float32; expected an integer tensor"),
        (torch.tensor([True, False]), r"dtype torch\.bool"),
        (torch.tensor(3), r"0-dimensional; expected at least one dim, e\.g\. \[3\]"),
        (np.array([0.0, 1.5]), r"non-integer entry 0\.0 \(float\) at \[0\]"),
        ([0, 1.5], r"non-integer entry 1\.5 \(float\) at \[1\]"),
        ([[0, 1], [2, "3"]], r"non-integer entry '3' \(str\) at \[1, 1\]"),
        ([True, False], r"non-integer entry True \(bool\)"),
        ([[0, 1], [2]], r"ragged: the entry at \[1\] has shape \[1\] but the entry at \[0\] has shape \[2\]"),
        ([], r"no ranks \(shape \[0\]\)"),
        ([[], []], r"no ranks \(shape \[2, 0\]\)"),
        (4, r"got 4 \(int\)"),
        ("0123", r"got '0123' \(str\)"),
        ([[0, -1], [2, 3]], r"negative ranks \(-1 at \[0, 1\]\)"),
    ],
)
def test_rank_grid_rejects_bad_meshes(mesh: object, message: str) -> None:
    with pytest.raises(MeshError, match=message):
        rank_grid_from(mesh)


def test_duplicate_ranks_are_named_with_their_positions() -> None:
    with pytest.raises(MeshError) as raised:
        rank_grid_from([[0, 1], [1, 0]])
    text = str(raised.value)
    assert "ranks [0, 1] more than once" in text
    assert "rank 0 at [0, 0], [1, 1]" in text and "rank 1 at [0, 1], [1, 0]" in text


def test_mesh_may_cover_part_of_the_world_but_not_more() -> None:
    check_fits_world(rank_grid_from([1, 3]), world_size=4)
    with pytest.raises(MeshError, match=r"has 8 ranks but the world has only 4"):
        check_fits_world(rank_grid_from(list(range(8))), world_size=4)
    with pytest.raises(MeshError, match=r"ranks outside the world \(4 at \[1, 1\]\); with world size 4 valid ranks are 0\.\.3"):
        check_fits_world(rank_grid_from([[0, 1], [2, 4]]), world_size=4)


def test_mesh_shape_checks() -> None:
    assert check_mesh_shape((2, 2)) == (2, 2)
    assert check_mesh_shape([4]) == (4,)
    assert check_mesh_shape(torch.Size([1, 4])) == (1, 4)
    with pytest.raises(MeshError, match=r"tuple of ints such as \(4,\)"):
        check_mesh_shape(4)
    with pytest.raises(MeshError, match="empty"):
        check_mesh_shape(())
    with pytest.raises(MeshError, match=r"invalid sizes \[0\]"):
        check_mesh_shape((2, 0))
    with pytest.raises(MeshError, match=r"invalid sizes \[2\.0\]"):
        check_mesh_shape((2.0, 2))
    check_world_size_matches((2, 2), 4)
    with pytest.raises(MeshError, match=r"mesh_shape \(2, 4\) has 8 ranks but the world size is 4"):
        check_world_size_matches((2, 4), 4)


@pytest.mark.parametrize("device_type", ["cuda:0", "", "cpu ", 3])
def test_device_type_must_be_a_bare_type(device_type: object) -> None:
    with pytest.raises(MeshError, match="device"):
        check_device_type(device_type)
    assert check_device_type("cuda") == "cuda"


def test_dim_names() -> None:
    assert normalize_dim_names(None, 2) is None
    assert normalize_dim_names((), 1) is None
    assert normalize_dim_names(["dp", "tp"], 2) == ("dp", "tp")
    with pytest.raises(MeshError, match=r"has 1 names but the mesh has 2 dims"):
        normalize_dim_names(("dp",), 2)
    with pytest.raises(MeshError, match=r"repeats \['dp'\]"):
        normalize_dim_names(("dp", "dp"), 2)
    with pytest.raises(MeshError, match=r"e\.g\. \('tp',\); got the str 'tp'"):
        normalize_dim_names("tp", 1)
    with pytest.raises(MeshError, match=r"non-str entries \[1\]"):
        normalize_dim_names(("dp", 1), 2)


def test_resolve_dim_index() -> None:
    names = ("dp", "tp")
    assert resolve_dim_index(0, 2, names) == 0
    assert resolve_dim_index(-1, 2, names) == 1
    assert resolve_dim_index("tp", 2, names) == 1
    with pytest.raises(MeshDimError, match=r"mesh dim 2 is out of range for a 2-D mesh; expected an index in \[-2, 2\) or one of the names \('dp', 'tp'\)"):
        resolve_dim_index(2, 2, names)
    with pytest.raises(MeshDimError, match=r"'pp' does not exist"):
        resolve_dim_index("pp", 2, names)
    with pytest.raises(MeshDimError, match="has no mesh_dim_names"):
        resolve_dim_index("tp", 2, None)
    with pytest.raises(MeshDimError, match="must be an int or a str"):
        resolve_dim_index(True, 2, names)


ROOT_NAMES = ("dp", "cp", "tp")
ROOT_DIMS = ((0,), (1,), (2,))


def test_slice_resolves_names_to_root_dims() -> None:
    assert resolve_slice("tp", ROOT_NAMES, ROOT_DIMS, {}, ROOT_NAMES) == (("tp",), ((2,),))
    assert resolve_slice(("dp", "tp"), ROOT_NAMES, ROOT_DIMS, {}, ROOT_NAMES) == (("dp", "tp"), ((0,), (2,)))
    flattened = {"dp_cp": (0, 1)}
    assert resolve_slice(("dp_cp", "tp"), ROOT_NAMES, ROOT_DIMS, flattened, ROOT_NAMES) == (
        ("dp_cp", "tp"),
        ((0, 1), (2,)),
    )


@pytest.mark.parametrize(
    ("requested", "error", "message"),
    [
        ("pp", MeshDimError, r"\['pp'\] is not a mesh dim of this mesh; valid names are \('dp', 'cp', 'tp'\) and the flattened dims \('dp_cp',\)"),
        (("tp", "dp"), MeshDimError, r"must be given in the order they have in the mesh, i\.e\. mesh\['dp', 'tp'\]"),
        (("dp", "dp"), MeshDimError, r"names \['dp'\] more than once"),
        (("dp_cp", "cp"), MeshDimError, r"'dp_cp' and 'cp' overlap \(both cover the root mesh dim 'cp'\)"),
        (("tp", "dp_cp"), MeshDimError, r"in the order they have in the mesh, i\.e\. mesh\['dp_cp', 'tp'\]"),
        ((), MeshDimError, r"names no mesh dims"),
        (0, TypeError, r"sliced by mesh dim names"),
        (["dp"], TypeError, r"sliced by mesh dim names"),
    ],
)
def test_slice_errors(requested: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        resolve_slice(requested, ROOT_NAMES, ROOT_DIMS, {"dp_cp": (0, 1)}, ROOT_NAMES)


def test_slicing_needs_dim_names() -> None:
    with pytest.raises(MeshError, match="no mesh_dim_names"):
        resolve_slice("dp", None, ROOT_DIMS, {}, None)
