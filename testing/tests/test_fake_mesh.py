"""FakeMesh: the process-free mesh of pure tests models what the engine reads from a DeviceMesh."""

from __future__ import annotations

import inspect
import pickle

import pytest
import torch

from shardwise.mesh import DeviceMesh, MeshDimError, MeshError
from shardwise.placement import DTensorSpec, MeshLike, Shard, TensorMeta
from shardwise.testing import FakeMesh


def test_defaults_are_the_origin_of_a_cpu_mesh_with_one_group_per_dim() -> None:
    mesh = FakeMesh((2, 3))
    assert isinstance(mesh, MeshLike)
    assert mesh.shape == (2, 3) and mesh.ndim == 2 and mesh.size() == 6 and mesh.size(1) == 3
    assert mesh.get_coordinate() == (0, 0) and mesh.get_rank() == 0
    assert mesh.device_type == "cpu" and mesh.mesh_dim_names is None
    assert mesh._dim_group_names == ("fake-group-0", "fake-group-1")


def test_a_coordinate_is_a_rank_of_the_row_major_grid() -> None:
    mesh = FakeMesh([2, 3], [1, 2], dim_names=("dp", "tp"))
    assert mesh.shape == (2, 3) and mesh.get_coordinate() == (1, 2)
    assert torch.equal(mesh.mesh, torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int))
    assert mesh.get_rank() == 5
    assert mesh.get_local_rank("dp") == 1 and mesh.get_local_rank(-1) == 2
    assert mesh.size("tp") == 3 and mesh.mesh_dim_names == ("dp", "tp")


def test_group_names_by_index_name_or_default_dim() -> None:
    mesh = FakeMesh((2, 2), (0, 1), ("rows", "cols"), dim_names=("dp", "tp"))
    assert mesh._dim_group_names == ("rows", "cols")
    assert mesh.get_group_name(0) == "rows" and mesh.get_group_name("tp") == "cols" and mesh.get_group_name(-2) == "rows"
    assert FakeMesh((4,)).get_group_name() == "fake-group-0"
    with pytest.raises(MeshError, match=r"get_group_name\(\) on a 2-D mesh needs mesh_dim"):
        mesh.get_group_name()
    with pytest.raises(MeshDimError, match=r"mesh dim 2 is out of range .*expected an index in \[-2, 2\) or one of the names \('dp', 'tp'\)"):
        mesh.get_group_name(2)
    with pytest.raises(MeshDimError, match=r"mesh dim 'pp' does not exist"):
        mesh.get_group_name("pp")
    with pytest.raises(MeshDimError, match="this mesh has no dim names"):
        FakeMesh((4,)).get_group_name("tp")
    with pytest.raises(MeshDimError, match="must be an int or a str"):
        mesh.get_group_name(1.0)  # type: ignore[arg-type]


def test_a_mesh_without_group_names_refuses_to_name_a_group() -> None:
    mesh = FakeMesh((4,), (1,), ())
    assert mesh._dim_group_names == ()
    with pytest.raises(MeshError, match=r"built without process group names"):
        mesh.get_group_name(0)


def test_a_rank_outside_the_mesh_has_no_coordinate_and_no_groups() -> None:
    outside = FakeMesh((2, 2), None)
    assert outside.get_coordinate() is None and not outside._is_current_rank_part_of_mesh()
    assert outside._dim_group_names == () and outside.get_rank() == 4
    with pytest.raises(MeshError, match="not part of"):
        outside.get_group_name(0)
    with pytest.raises(MeshError, match="not part of"):
        outside.get_local_rank(0)
    with pytest.raises(MeshError, match="rank outside the mesh"):
        FakeMesh((4,), None, ("g",))


def test_equal_by_layout_and_coordinate_but_not_by_group_names() -> None:
    mesh = FakeMesh((4,), (1,), ("first",))
    same = FakeMesh((4,), (1,), ("second",))
    assert mesh == same and hash(mesh) == hash(same)
    for other in (
        FakeMesh((4,), (2,)),
        FakeMesh((2, 2), (0, 1)),
        FakeMesh((4,), (1,), device_type="cuda"),
        FakeMesh((4,), (1,), dim_names=("tp",)),
        FakeMesh((4,), None),
    ):
        assert mesh != other
    assert len({mesh, same, FakeMesh((4,), (2,))}) == 2
    assert mesh != (4,)


def test_specs_on_equal_meshes_are_equal_cache_keys() -> None:
    meta = TensorMeta(torch.Size([8]), (1,), torch.float32)
    assert DTensorSpec(FakeMesh((4,)), (Shard(0),), meta) == DTensorSpec(FakeMesh((4,), (0,)), (Shard(0),), meta)
    assert DTensorSpec(FakeMesh((4,)), (Shard(0),), meta) != DTensorSpec(FakeMesh((4,), (3,)), (Shard(0),), meta)


def test_immutable_picklable_and_readable() -> None:
    mesh = FakeMesh((2, 2), (1, 0), ("a", "b"), device_type="cuda", dim_names=("dp", "tp"))
    restored = pickle.loads(pickle.dumps(mesh))
    assert restored == mesh and restored._dim_group_names == ("a", "b") and restored.device_type == "cuda"
    with pytest.raises(AttributeError, match="FakeMesh is immutable"):
        mesh._coordinate = (0, 0)
    assert repr(mesh) == "FakeMesh(shape=(2, 2), coordinate=(1, 0), device_type='cuda', dim_names=('dp', 'tp'))"
    assert repr(FakeMesh((4,), None)) == "FakeMesh(shape=(4,), coordinate=None)"


def test_bad_construction_names_what_was_expected() -> None:
    with pytest.raises(MeshError, match="at least one dim"):
        FakeMesh(())
    with pytest.raises(MeshError, match="at least one dim, each of extent >= 1"):
        FakeMesh((2, 0))
    with pytest.raises(TypeError, match="sequence of ints"):
        FakeMesh((2.0,))  # type: ignore[arg-type]
    with pytest.raises(MeshError, match=r"coordinate \(2,\) does not fit shape \(2,\)"):
        FakeMesh((2,), (2,))
    with pytest.raises(MeshError, match=r"coordinate \(0,\) does not fit shape \(2, 2\)"):
        FakeMesh((2, 2), (0,))
    with pytest.raises(MeshError, match="got 1 group_names"):
        FakeMesh((2, 2), (0, 0), ("only-one",))
    with pytest.raises(MeshDimError, match="expected 2 distinct strings"):
        FakeMesh((2, 2), dim_names=("tp", "tp"))
    with pytest.raises(TypeError, match="device_type"):
        FakeMesh((2,), device_type="")


def test_the_modelled_members_have_the_device_mesh_signatures() -> None:
    """What FakeMesh models exists on DeviceMesh with the same kind and parameters (no drift)."""
    # Plain instance attributes on DeviceMesh (torch.compile reads those of opaque value types, not properties).
    for name in ("shape", "ndim", "device_type", "mesh_dim_names"):
        assert name in DeviceMesh.__annotations__, name
        assert isinstance(inspect.getattr_static(FakeMesh, name), property), name
    assert isinstance(inspect.getattr_static(DeviceMesh, "mesh"), property)
    assert isinstance(inspect.getattr_static(FakeMesh, "mesh"), property)
    for name in ("size", "get_coordinate", "get_rank", "get_local_rank", "get_group_name", "_is_current_rank_part_of_mesh"):
        real, fake = inspect.signature(getattr(DeviceMesh, name)), inspect.signature(getattr(FakeMesh, name))
        assert list(real.parameters) == list(fake.parameters), name
        assert [p.default for p in real.parameters.values()] == [p.default for p in fake.parameters.values()], name
    assert "_dim_group_names" in DeviceMesh.__annotations__
