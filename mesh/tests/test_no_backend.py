"""``DeviceMesh(..., _init_backend=False, _rank=r)``: a mesh that describes a layout and has no process groups.

spmd-types' type checker builds ``DeviceMesh("cpu", torch.arange(n), _init_backend=False, _rank=0)``
to run DTensor's sharding propagation on meta tensors, with or without a process group. Such a mesh
must answer everything about its layout (for the rank ``_rank``) and create, need or hand out no
group. PyTorch's DeviceMesh with the same arguments is the oracle where it answers (it cannot
slice, flatten or unflatten such a mesh).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed.device_mesh as torch_device_mesh
from group_creation_helpers import count_group_constructions

from shardwise.mesh import DeviceMesh, MeshError, get_current_mesh
from shardwise.mesh._device_mesh import _METHODS_LOCAL_TENSOR_MODE_PATCHES, _live_mesh_by_digest
from shardwise.mesh._simulation import as_simulated_rank
from shardwise.testing import multi_rank

GRID = [[0, 1, 2], [3, 4, 5]]


def _layout_mesh(rank: int, mesh: object = None, names: tuple[str, ...] | None = ("dp", "tp")) -> DeviceMesh:
    return DeviceMesh("cpu", GRID if mesh is None else mesh, mesh_dim_names=names, _init_backend=False, _rank=rank)


# ----------------------------------------------------------------------- no process group at all


def test_spmd_types_propagation_mesh_needs_no_process_group() -> None:
    assert not dist.is_initialized(), "this test checks a mesh built with no default process group"
    for size in (1, 2, 4, 7):  # spmd_types caches one per axis size, any size, no world needed
        mesh = DeviceMesh("cpu", torch.arange(size), _init_backend=False, _rank=0)
        assert (mesh.shape, mesh.ndim, mesh.size(), mesh.size(0), mesh.device_type) == ((size,), 1, size, size, "cpu")
        assert mesh.mesh_dim_names is None
        assert mesh.get_coordinate() == (0,) and mesh._is_current_rank_part_of_mesh()
        assert mesh.get_rank() == 0 and mesh.get_local_rank() == 0
        assert mesh.mesh.tolist() == list(range(size)) and mesh.mesh.dtype == torch.int32
        assert mesh._dim_group_names == ()
        assert not mesh._supports_joint_groups() and mesh._joint_group([0]) is None
        again = DeviceMesh("cpu", list(range(size)), _init_backend=False, _rank=0)
        assert again == mesh and hash(again) == hash(mesh) and again._stable_hash() == mesh._stable_hash()
        assert {mesh: "cached"}[again] == "cached"  # what spmd_types' and DTensor's caches rely on
        assert repr(mesh).endswith("_init_backend=False, _rank=0)")
    # Nothing was created or initialised on the way.
    assert not dist.is_initialized()


def test_coordinates_are_those_of_the_rank_given_as_pytorch_reports_them() -> None:
    for rank in range(6):
        ours = _layout_mesh(rank)
        theirs = torch_device_mesh.DeviceMesh(
            "cpu", GRID, mesh_dim_names=("dp", "tp"), _init_backend=False, _rank=rank
        )
        assert ours.get_coordinate() == theirs.get_coordinate() == divmod(rank, 3)
        assert ours.mesh.tolist() == theirs.mesh.tolist() == GRID
        assert (ours.shape, ours.ndim, ours.size(), ours.size("tp")) == (tuple(theirs.shape), theirs.ndim, 6, 3)
        # PyTorch asks the (absent) default group here; the rank given answers it.
        assert ours.get_rank() == rank
        assert [ours.get_local_rank(dim) for dim in ("dp", "tp")] == list(divmod(rank, 3))
    # A rank the mesh does not hold, and ranks no world need contain (labels only).
    for rank in (6, 100, -1):
        outside = _layout_mesh(rank)
        assert outside.get_coordinate() is None is torch_device_mesh.DeviceMesh(
            "cpu", GRID, _init_backend=False, _rank=rank
        ).get_coordinate()
        with pytest.raises(MeshError, match=f"rank {rank} is not part of"):
            outside.get_local_rank("dp")
    assert DeviceMesh("cpu", [10, 11], _init_backend=False, _rank=11).get_coordinate() == (1,)


def test_slicing_flatten_and_unflatten_work_without_groups() -> None:
    mesh = _layout_mesh(4)  # row 1, column 1
    tp, dp = mesh["tp"], mesh["dp"]
    assert tp.mesh.tolist() == [3, 4, 5] and tp.get_coordinate() == (1,) and tp.get_rank() == 4
    assert dp.mesh.tolist() == [1, 4] and dp.get_coordinate() == (1,)
    assert mesh["tp"] is tp and mesh["dp", "tp"] is mesh and tp._get_root_mesh() is mesh
    assert tp == _layout_mesh(4)["tp"] and tp != _layout_mesh(3)["tp"]

    flat = mesh._flatten("dp_tp")
    assert flat.shape == (6,) and flat.get_coordinate() == (4,) and flat.mesh.tolist() == list(range(6))
    assert mesh["dp_tp"] is flat and mesh.size("dp_tp") == 6 and mesh._flatten("dp_tp") is flat
    # A backend override is checked, and there is no group to give it to.
    assert mesh["dp"]._flatten("dp_only", backend_override="gloo").get_coordinate() == (1,)
    with pytest.raises(MeshError, match="backend"):
        mesh._flatten("bad", backend_override=3.5)

    split = mesh._unflatten("tp", (3, 1), ("tp", "pad"))
    assert split.shape == (2, 3, 1) and split.get_coordinate() == (1, 1, 0) and split._get_root_mesh() is mesh
    regrouped = flat._unflatten(0, (3, 2), ("a", "b"))
    assert regrouped.get_coordinate() == (2, 0) and regrouped.mesh.tolist() == [[0, 1], [2, 3], [4, 5]]
    joined = DeviceMesh._concatenate([split["dp"], split["tp"]])
    assert joined.get_coordinate() == (1, 1) and joined == mesh["dp", "tp"]
    assert all(view._dim_group_names == () for view in (tp, dp, flat, split, regrouped, joined))


def test_asking_for_a_group_says_there_is_no_backend() -> None:
    mesh = _layout_mesh(0)
    views = [mesh, mesh["tp"], mesh._flatten(), DeviceMesh("cpu", torch.arange(4), _init_backend=False, _rank=0)]
    for view in views:
        calls = [view.get_all_groups]
        for dim in range(view.ndim):
            calls += [lambda d=dim: view.get_group(d), lambda d=dim: view.get_group_name(d)]  # type: ignore[misc]
        for call in calls:
            with pytest.raises(MeshError, match="_init_backend=False, so no process group was initialised") as raised:
                call()
            # PyTorch raises RuntimeError("DeviceMesh process groups not initialized!") here.
            assert isinstance(raised.value, RuntimeError)
    with pytest.raises(MeshError, match="_init_backend=False"):
        mesh.get_group("dp_tp")  # a flattened dim, by name from the root
    # Also for a rank outside the mesh: what is missing first is the backend.
    with pytest.raises(MeshError, match="_init_backend=False"):
        _layout_mesh(9).get_group("dp")
    theirs = torch_device_mesh.DeviceMesh("cpu", torch.arange(4), _init_backend=False, _rank=0)
    with pytest.raises(RuntimeError, match="not initialized"):
        theirs.get_group()


def test_bad_arguments_are_named() -> None:
    assert not dist.is_initialized()
    with pytest.raises(MeshError, match="without _rank needs the default process group"):
        DeviceMesh("cpu", [0, 1], _init_backend=False)
    with pytest.raises(MeshError, match="_init_backend must be a bool"):
        DeviceMesh("cpu", [0, 1], _init_backend=0, _rank=0)  # type: ignore[arg-type]
    for bad_rank in (1.0, True, "0"):
        with pytest.raises(MeshError, match="_rank must be an int"):
            DeviceMesh("cpu", [0, 1], _init_backend=False, _rank=bad_rank)  # type: ignore[arg-type]
    # The layout itself is checked as for any mesh.
    with pytest.raises(MeshError, match="more than once"):
        DeviceMesh("cpu", [0, 0], _init_backend=False, _rank=0)
    with pytest.raises(MeshError):
        DeviceMesh("cpu", [[0, 1]], mesh_dim_names=("only",), _init_backend=False, _rank=0)


def test_identity_copy_pickle_and_context() -> None:
    mesh = _layout_mesh(2)
    assert mesh == _layout_mesh(2) and hash(mesh) == hash(_layout_mesh(2))
    # The rank sets every coordinate such a mesh reports, so it is part of what the mesh is
    # (PyTorch's meshes compare equal across _rank): a cache never hands one rank's mesh to another.
    assert mesh != _layout_mesh(3) and mesh._stable_hash() != _layout_mesh(3)._stable_hash()
    assert copy.copy(mesh) is mesh and copy.deepcopy(mesh) is mesh
    restored = pickle.loads(pickle.dumps(mesh["tp"]))
    assert restored == mesh["tp"] and restored.get_coordinate() == (2,) and restored.get_rank() == 2
    assert restored.mesh.tolist() == [0, 1, 2]
    with pytest.raises(MeshError, match="_init_backend=False"):
        restored.get_group()
    with mesh:
        assert get_current_mesh() is mesh


def _per_rank(value: object) -> dict[int, int]:
    """The per-rank ints of a simulated (LocalTensorMode) SymInt."""
    return dict(value.node._local_ints)  # type: ignore[attr-defined]


def test_local_tensor_mode_patching_this_class_keeps_its_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    # With shardwise standing in for torch (shardwise.torch_switch), the DeviceMesh that torch's
    # LocalTensorMode patches on entry is ours; spmd-types' tests run its checker under that mode.
    local_tensor = pytest.importorskip("torch.distributed._local_tensor")
    monkeypatch.setattr(local_tensor, "DeviceMesh", DeviceMesh)
    own = {name: DeviceMesh.__dict__[name] for name in _METHODS_LOCAL_TENSOR_MODE_PATCHES}
    mesh = _layout_mesh(0, [[0, 1], [2, 3]])
    with local_tensor.LocalTensorMode(4):
        assert {name: DeviceMesh.__dict__[name] for name in own} == own
        dp, tp = mesh.get_coordinate()  # type: ignore[misc]
        assert (_per_rank(dp), _per_rank(tp)) == ({0: 0, 1: 0, 2: 1, 3: 1}, {0: 0, 1: 1, 2: 0, 3: 1})
        assert _per_rank(mesh._sym_get_coordinate(1)) == _per_rank(mesh["tp"].get_local_rank()) == _per_rank(tp)
        assert _per_rank(mesh.get_rank()) == {rank: rank for rank in range(4)}
        # The pinned rank that dtensor_ops' per-rank code relies on, which torch's replacements ignore.
        with as_simulated_rank(3):
            assert mesh.get_coordinate() == (1, 1) and mesh._sym_get_coordinate(0) == 1
    assert {name: DeviceMesh.__dict__[name] for name in own} == own
    assert mesh.get_coordinate() == (0, 0) and mesh._sym_get_coordinate(1) == 0
    with pytest.raises(MeshError, match="rank 7 is not part of"):
        _layout_mesh(7)._sym_get_coordinate(0)


# ----------------------------------------------------------------- beside real meshes, 4 gloo ranks


@multi_rank(world_size=4)
def test_layout_mesh_beside_a_real_mesh() -> None:
    rank = dist.get_rank()
    real = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    with count_group_constructions() as constructions:
        layout = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"), _init_backend=False, _rank=rank)
        flat = layout._flatten()
        split = layout._unflatten("tp", (2, 1), ("tp", "pad"))
        spmd_types_mesh = DeviceMesh("cpu", torch.arange(4), _init_backend=False, _rank=0)
        wider_than_world = DeviceMesh("cpu", torch.arange(8), _init_backend=False, _rank=0)
    assert constructions.calls == 0  # no group made, no rendezvous joined
    assert split.get_coordinate() == (*divmod(rank, 2), 0) and wider_than_world.size() == 8

    # Same answers as the real mesh for this rank, but never the same mesh: DTensor caches keyed by
    # meshes must not give the group-less one to a computation that communicates.
    assert layout.get_coordinate() == real.get_coordinate() == divmod(rank, 2)
    assert layout["tp"].mesh.tolist() == real["tp"].mesh.tolist()
    assert flat.get_coordinate() == (rank,)
    assert layout != real and layout["tp"] != real["tp"] and layout._stable_hash() != real._stable_hash()
    world_1d = DeviceMesh("cpu", torch.arange(4))
    assert world_1d != spmd_types_mesh
    assert spmd_types_mesh.get_coordinate() == (0,)  # rank 0's answer on every rank, as spmd_types asks
    # Compiled graphs find meshes by digest: the layout meshes built after the real ones did not
    # take their place.
    assert _live_mesh_by_digest(real._stable_hash()) is real
    assert _live_mesh_by_digest(world_1d._stable_hash()) is world_1d

    # A _rank=0 mesh is the same mesh on every rank (hash and digest too), as the real ones are.
    digests: list[object] = [None] * 4
    dist.all_gather_object(digests, (spmd_types_mesh._stable_hash(), hash(spmd_types_mesh), real._stable_hash()))
    assert len(set(digests)) == 1

    # The real mesh's groups work; the layout mesh has none to give.
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=real.get_group("tp"))
    assert total.item() == (1.0 if rank < 2 else 5.0)
    with pytest.raises(MeshError, match="_init_backend=False"):
        layout.get_group("tp")
    with pytest.raises(MeshError, match="mix meshes with process groups"):
        DeviceMesh._concatenate([layout["dp"], real["tp"]])

    # With process groups, _rank may only name this process's rank (the groups are this rank's).
    assert DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"), _rank=rank) == real
    with count_group_constructions() as constructions:
        with pytest.raises(MeshError, match=f"in the process of rank {rank}"):
            DeviceMesh("cpu", [[3, 2], [1, 0]], mesh_dim_names=("dp", "tp"), _rank=(rank + 1) % 4)
    assert constructions.calls == 0

    # Without _rank, the default group says which rank the layout mesh answers for.
    assert DeviceMesh("cpu", [3, 2, 1, 0], _init_backend=False).get_coordinate() == (3 - rank,)
