"""DeviceMesh on 4 gloo ranks: groups, coordinates, slicing, flattening, identity, errors."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
from group_creation_helpers import count_group_constructions as count_new_group_calls

from shardwise.mesh import DeviceMesh, MeshDimError, MeshError, get_current_mesh, init_device_mesh
from shardwise.testing import multi_rank, run_on_ranks


def _ranks_of(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)


def _gather_ranks_over(group_name: str, size: int) -> list[int]:
    """Each member contributes its global rank through the functional collective dtensor_ops uses."""
    mine = torch.tensor([dist.get_rank()], dtype=torch.int64)
    gathered = torch.ops._c10d_functional.all_gather_into_tensor(mine, size, group_name)
    return torch.ops._c10d_functional.wait_tensor(gathered).tolist()


def _sum_of_ranks_over(group: dist.ProcessGroup) -> int:
    value = torch.tensor([dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(value, group=group)
    return int(value.item())


@multi_rank
def test_1d_mesh_over_the_world_reuses_the_default_group() -> None:
    rank = dist.get_rank()
    with count_new_group_calls() as calls:
        mesh = init_device_mesh("cpu", (4,))
    assert calls.calls == 0
    assert mesh.get_group() is dist.group.WORLD
    assert mesh._dim_group_names == (dist.group.WORLD.group_name,)
    assert mesh.ndim == 1 and mesh.shape == (4,) and mesh.size() == 4 and mesh.size(0) == 4
    assert mesh.mesh.tolist() == [0, 1, 2, 3] and mesh.mesh.dtype == torch.int32
    assert mesh.mesh_dim_names is None and mesh.device_type == "cpu"
    assert mesh.get_coordinate() == (rank,)
    assert mesh.get_local_rank() == rank and mesh.get_rank() == rank
    assert mesh.get_all_groups() == [dist.group.WORLD]


@multi_rank
def test_2d_mesh_makes_one_group_per_dim_for_each_rank() -> None:
    rank = dist.get_rank()
    with count_new_group_calls() as calls:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # Each rank creates its own 2 groups and takes no part in the other 2 (member-only creation).
    assert calls.calls == 2
    assert calls.created == 2
    assert sorted(calls.member_ranks) == sorted([[2 * (rank // 2), 2 * (rank // 2) + 1], [rank % 2, rank % 2 + 2]])
    row, column = divmod(rank, 2)
    assert mesh.get_coordinate() == (row, column)
    assert mesh.get_local_rank("dp") == row and mesh.get_local_rank(0) == row
    assert mesh.get_local_rank("tp") == column and mesh.get_local_rank(-1) == column
    assert mesh.shape == (2, 2) and mesh.size() == 4 and mesh.size(1) == 2 and mesh.size("dp") == 2
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]]

    tp_ranks = [2 * row, 2 * row + 1]
    dp_ranks = [column, column + 2]
    assert _ranks_of(mesh.get_group("tp")) == tp_ranks
    assert _ranks_of(mesh.get_group(0)) == dp_ranks
    assert mesh.get_all_groups() == [mesh.get_group("dp"), mesh.get_group("tp")]
    assert _sum_of_ranks_over(mesh.get_group("tp")) == sum(tp_ranks)
    assert _sum_of_ranks_over(mesh.get_group("dp")) == sum(dp_ranks)

    dp_name, tp_name = mesh._dim_group_names
    assert (dp_name, tp_name) == (mesh.get_group("dp").group_name, mesh.get_group("tp").group_name)
    # The public accessor the collectives use: by index (negative too) or by name.
    assert (mesh.get_group_name(0), mesh.get_group_name("tp"), mesh.get_group_name(-1)) == (dp_name, tp_name, tp_name)
    assert mesh["tp"].get_group_name() == tp_name
    with pytest.raises(MeshError, match=r"get_group_name\(\) on a 2-D mesh needs mesh_dim"):
        mesh.get_group_name()
    with pytest.raises(MeshDimError):
        mesh.get_group_name("cp")
    assert _gather_ranks_over(tp_name, 2) == tp_ranks
    assert _gather_ranks_over(dp_name, 2) == dp_ranks

    with pytest.raises(MeshError, match=r"get_group\(\) on a 2-D mesh needs mesh_dim .* use get_all_groups\(\)"):
        mesh.get_group()
    with pytest.raises(MeshError, match=r"get_local_rank\(\) on a 2-D mesh needs mesh_dim"):
        mesh.get_local_rank()


@multi_rank
def test_meshes_over_the_same_rank_lists_share_groups() -> None:
    first = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with count_new_group_calls() as calls:
        again = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        renamed = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("a", "b"))
        transposed = DeviceMesh("cpu", torch.tensor([[0, 1], [2, 3]]).t(), mesh_dim_names=("tp", "dp"))
        whole = first._flatten("world")
    assert calls.calls == 0
    assert again == first and again.get_group("tp") is first.get_group("tp")
    assert renamed.get_group("b") is first.get_group("tp")
    # [[0, 2], [1, 3]] with dims (tp, dp) is the same layout as [[0, 1], [2, 3]] with (dp, tp).
    assert transposed.get_group("tp") is first.get_group("tp")
    assert transposed.get_group("dp") is first.get_group("dp")
    assert whole.get_group() is dist.group.WORLD


@multi_rank
def test_group_rank_is_the_mesh_coordinate_whatever_the_rank_order() -> None:
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", [[3, 2], [1, 0]], mesh_dim_names=("a", "b"))
    grid = mesh.mesh.tolist()
    a, b = mesh.get_coordinate()  # type: ignore[misc]
    assert grid[a][b] == rank
    # c10d would sort [3, 2] to [2, 3]; the mesh keeps its order, so group rank == coordinate.
    assert dist.get_rank(mesh.get_group("b")) == b == mesh.get_local_rank("b")
    assert dist.get_rank(mesh.get_group("a")) == a == mesh.get_local_rank("a")
    assert _gather_ranks_over(mesh._dim_group_names[1], 2) == grid[a]
    assert _gather_ranks_over(mesh._dim_group_names[0], 2) == [grid[0][b], grid[1][b]]


@multi_rank
def test_submeshes_see_the_slice_holding_this_rank_and_reuse_root_groups() -> None:
    rank = dist.get_rank()
    row, column = divmod(rank, 2)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with count_new_group_calls() as calls:
        tp = mesh["tp"]
        dp = mesh["dp"]
        both = mesh["dp", "tp"]
    assert calls.calls == 0
    assert both is mesh
    assert tp.mesh.tolist() == [2 * row, 2 * row + 1] and dp.mesh.tolist() == [column, column + 2]
    assert tp.mesh_dim_names == ("tp",) and tp.ndim == 1 and tp.size() == 2
    assert tp.get_coordinate() == (column,) and dp.get_coordinate() == (row,)
    assert tp.get_local_rank() == column and dp.get_local_rank("dp") == row
    assert tp.get_group() is mesh.get_group("tp") and dp.get_group(0) is mesh.get_group("dp")
    assert tp._dim_group_names == (mesh._dim_group_names[1],)
    assert tp._get_root_mesh() is mesh and dp._get_root_mesh() is mesh and mesh._get_root_mesh() is mesh
    assert tp["tp"] is tp
    assert mesh["tp"] is tp  # slices are cached on their parent
    assert tp != dp and tp != mesh


@multi_rank
def test_flattening_dims_registers_a_sliceable_dim_on_the_root() -> None:
    rank = dist.get_rank()
    dp_index, tp_index = divmod(rank, 2)
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "cp", "tp"))
    with count_new_group_calls() as calls:
        dp_cp = mesh["dp", "cp"]._flatten()
        cp_tp = mesh["cp", "tp"]._flatten("cp_tp")
    # Flattened rank lists equal the dp and tp ones: the existing groups are reused.
    assert calls.calls == 0
    assert dp_cp.mesh_dim_names == ("dp_cp",) and dp_cp.shape == (2,)
    assert dp_cp.mesh.tolist() == [tp_index, tp_index + 2]
    assert dp_cp.get_group() is mesh.get_group("dp")
    assert cp_tp.get_group() is mesh.get_group("tp")
    assert dp_cp.get_local_rank() == dp_index
    assert mesh["dp_cp"] is dp_cp and mesh.get_group("dp_cp") is dp_cp.get_group()
    assert mesh.get_local_rank("dp_cp") == dp_index and mesh.size("dp_cp") == 2
    assert mesh["tp"].get_group("dp_cp") is dp_cp.get_group()  # flattened names resolve through the root
    dp_cp_tp = mesh["dp_cp", "tp"]
    assert dp_cp_tp.shape == (2, 2) and dp_cp_tp.mesh.tolist() == [[0, 1], [2, 3]]
    assert dp_cp_tp.get_coordinate() == (dp_index, tp_index)
    assert dp_cp_tp.get_all_groups() == [mesh.get_group("dp"), mesh.get_group("tp")]
    assert mesh["dp", "cp"]._flatten() is dp_cp  # same name over the same dims: the same mesh
    assert mesh["tp"]._flatten("tp") is mesh["tp"]  # a 1-D mesh flattened to its own name is itself

    with pytest.raises(MeshError, match=r"already has a dim named 'cp'"):
        mesh["dp", "tp"]._flatten("cp")
    with pytest.raises(MeshError, match=r"flattened dim named 'dp_cp' already exists over different mesh dims"):
        mesh["dp", "tp"]._flatten("dp_cp")
    with pytest.raises(MeshDimError, match=r"'dp_cp' and 'dp' overlap"):
        mesh["dp_cp", "dp"]
    with pytest.raises(MeshDimError, match=r"i\.e\. mesh\['dp_cp', 'tp'\]"):
        mesh["tp", "dp_cp"]
    with pytest.raises(MeshDimError, match=r"\['dp_cp'\] is not a mesh dim of this mesh; valid names are \('dp', 'tp'\)"):
        mesh["dp", "tp"]["dp_cp"]  # as in PyTorch, flattened dims are sliced from the root only


@multi_rank
def test_flattening_the_whole_2d_mesh_gives_the_world() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    flat = mesh._flatten()
    assert flat.mesh_dim_names == ("dp_tp",) and flat.mesh.tolist() == [0, 1, 2, 3]
    assert flat.get_group() is dist.group.WORLD
    assert flat.get_local_rank() == dist.get_rank()
    with pytest.raises(MeshError, match="no mesh_dim_names"):
        init_device_mesh("cpu", (2, 2))._flatten()


def _identity_of_meshes() -> list[tuple[str, int, str]]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    unnamed = DeviceMesh("cpu", [[0, 2], [1, 3]])
    meshes = [mesh, mesh["tp"], mesh["dp"], mesh._flatten(), unnamed, DeviceMesh("cpu", [1, 2])]
    meshes += [DeviceMesh("cpu", [0, 1, 2, 3]), DeviceMesh("cpu", [3, 2, 1, 0])]
    return [(repr(m), hash(m), m._stable_hash()) for m in meshes]


def test_eq_hash_and_repr_are_the_same_on_every_rank() -> None:
    per_rank = run_on_ranks(_identity_of_meshes)
    assert all(identity == per_rank[0] for identity in per_rank[1:])
    reprs = [text for text, _, _ in per_rank[0]]
    assert reprs[:4] == [
        "DeviceMesh((dp=2, tp=2), 'cpu', stride=(2, 1), ranks=[[0, 1], [2, 3]])",
        "DeviceMesh((tp=2), 'cpu', stride=(1,), submeshes=[[0, 1], [2, 3]])",
        "DeviceMesh((dp=2), 'cpu', stride=(2,), submeshes=[[0, 2], [1, 3]])",
        "DeviceMesh((dp_tp=4), 'cpu', stride=(1,), ranks=[0, 1, 2, 3])",
    ]
    assert reprs[4] == "DeviceMesh((2, 2), 'cpu', stride=(2, 1), ranks=[[0, 2], [1, 3]])"
    assert reprs[5] == "DeviceMesh((2,), 'cpu', stride=(1,), ranks=[1, 2])"
    # Same sizes and strides, other rank order: PyTorch prints these two alike, we must not.
    assert reprs[6:] == [
        "DeviceMesh((4,), 'cpu', stride=(1,), ranks=[0, 1, 2, 3])",
        "DeviceMesh((4,), 'cpu', stride=(1,), ranks=[3, 2, 1, 0])",
    ]
    hashes = [mesh_hash for _, mesh_hash, _ in per_rank[0]]
    assert len(set(hashes)) == len(hashes)


@multi_rank
def test_equality_is_by_value() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    same = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    assert mesh == same and hash(mesh) == hash(same) and len({mesh, same}) == 1
    assert mesh["tp"] == same["tp"] and hash(mesh["tp"]) == hash(same["tp"])
    assert mesh != DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("a", "b"))
    assert mesh != DeviceMesh("cpu", [[0, 1], [2, 3]])
    assert mesh != DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("dp", "tp"))
    assert mesh != DeviceMesh("meta", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    assert mesh["tp"] != DeviceMesh("cpu", mesh["tp"].mesh, mesh_dim_names=("tp",))  # different root
    assert mesh != "mesh" and mesh != object()


@multi_rank
def test_rank_outside_the_mesh() -> None:
    rank = dist.get_rank()
    with count_new_group_calls() as calls:
        mesh = DeviceMesh("cpu", [1, 3], mesh_dim_names=("x",))
    # Only the members construct the group; the other ranks take no part at all.
    assert calls.calls == (1 if rank in (1, 3) else 0)
    assert mesh.mesh.tolist() == [1, 3] and mesh.size() == 2
    if rank in (1, 3):
        assert calls.created == 1
        assert mesh.get_coordinate() == ((rank - 1) // 2,)
        assert _sum_of_ranks_over(mesh.get_group()) == 4
        assert mesh._is_current_rank_part_of_mesh()
        return
    assert calls.created == 0
    assert mesh.get_coordinate() is None and not mesh._is_current_rank_part_of_mesh()
    assert mesh._dim_group_names == ()
    with pytest.raises(MeshError, match=rf"get_group\(None\): rank {rank} is not part of DeviceMesh\(\(x=2\).*ranks \[1, 3\]"):
        mesh.get_group()
    with pytest.raises(MeshError, match=rf"get_local_rank\('x'\): rank {rank} is not part of"):
        mesh.get_local_rank("x")
    with pytest.raises(MeshError, match="is not part of"):
        mesh.get_all_groups()

    grid = DeviceMesh("cpu", [[1], [3]], mesh_dim_names=("a", "b"))
    column = grid["b"]
    assert column.get_coordinate() is None and column._dim_group_names == ()
    with pytest.raises(MeshError, match=rf"rank {rank} is not part of .* one of several sub-meshes"):
        column.mesh


@multi_rank
def test_from_group_wraps_existing_groups() -> None:
    rank = dist.get_rank()
    row, column = divmod(rank, 2)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    with count_new_group_calls() as calls:
        tp = DeviceMesh.from_group(tp_group, "cpu", mesh_dim_names=("tp",))
        rebuilt = DeviceMesh.from_group(
            [dp_group, tp_group], "cpu", mesh=[[0, 1], [2, 3]], mesh_dim_names=("dp", "tp")
        )
        unnamed = DeviceMesh.from_group(tp_group, "cpu", mesh=torch.tensor([2 * row, 2 * row + 1]))
    assert calls.calls == 0
    assert tp.mesh.tolist() == [2 * row, 2 * row + 1] and tp.get_group() is tp_group
    assert tp.get_local_rank() == column and tp._dim_group_names == (tp_group.group_name,)
    assert unnamed.mesh_dim_names is None and unnamed.get_group() is tp_group
    assert rebuilt == mesh and rebuilt.get_group("dp") is dp_group and rebuilt["tp"].get_group() is tp_group
    world = DeviceMesh.from_group(dist.group.WORLD, "cpu")  # type: ignore[arg-type]
    assert world.mesh.tolist() == [0, 1, 2, 3] and world.get_group() is dist.group.WORLD

    with pytest.raises(MeshError, match=r"does not match the process group, whose ranks in group rank order are \[\d, \d\]"):
        DeviceMesh.from_group(tp_group, "cpu", mesh=[3, 2])
    with pytest.raises(MeshError, match="needs mesh, the n-D grid"):
        DeviceMesh.from_group([dp_group, tp_group], "cpu", mesh_dim_names=("dp", "tp"))
    with pytest.raises(MeshError, match="needs mesh_dim_names"):
        DeviceMesh.from_group([dp_group, tp_group], "cpu", mesh=[[0, 1], [2, 3]])
    with pytest.raises(MeshError, match=r"mesh has 1 dims \(shape \[4\]\) but 2 process groups"):
        DeviceMesh.from_group([dp_group, tp_group], "cpu", mesh=[0, 1, 2, 3], mesh_dim_names=("dp", "tp"))
    with pytest.raises(MeshError, match=r"process group for mesh dim 0 has ranks \[\d, \d\] .* but the mesh has"):
        DeviceMesh.from_group([tp_group, dp_group], "cpu", mesh=[[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    with pytest.raises(MeshError, match="non-empty list"):
        DeviceMesh.from_group([], "cpu")


def _error_messages_before_any_group_call() -> list[str]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    bad_calls: list[tuple[type[BaseException], Any]] = [
        (MeshError, lambda: DeviceMesh("cpu", [[0, 1], [1, 2]])),
        (MeshError, lambda: DeviceMesh("cpu", [0, 4])),
        (MeshError, lambda: DeviceMesh("cpu", list(range(8)))),
        (MeshError, lambda: DeviceMesh("cpu", [0.0, 1.0])),
        (MeshError, lambda: DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp",))),
        (MeshError, lambda: DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "dp"))),
        (MeshError, lambda: DeviceMesh("cpu:0", [0, 1])),
        (RuntimeError, lambda: init_device_mesh("cpu", (2, 4))),
        (RuntimeError, lambda: init_device_mesh("cpu", (5,))),
        (RuntimeError, lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp",))),
        (KeyError, lambda: mesh["pp"]),
        (KeyError, lambda: mesh["tp", "dp"]),
        (MeshDimError, lambda: mesh.get_group(2)),
        (MeshDimError, lambda: mesh.get_group("pp")),
        (MeshDimError, lambda: mesh.get_local_rank(-3)),
        (MeshDimError, lambda: mesh.size(2)),
        (MeshError, lambda: mesh["dp", "tp"]._flatten("tp")),
        (MeshError, lambda: init_device_mesh("cpu", (4,))["x"]),
    ]
    messages = []
    with count_new_group_calls() as calls:
        for expected, call in bad_calls:
            with pytest.raises(expected) as raised:
                call()
            messages.append(f"{type(raised.value).__name__}: {raised.value}")
    assert calls.calls == 0, calls.ranks
    return messages


def test_bad_input_fails_on_every_rank_with_the_same_message_before_any_collective() -> None:
    per_rank = run_on_ranks(_error_messages_before_any_group_call)
    assert all(messages == per_rank[0] for messages in per_rank[1:])
    messages = per_rank[0]
    assert "ranks [1] more than once (rank 1 at [0, 1], [1, 0])" in messages[0]
    assert "ranks outside the world (4 at [1]); with world size 4 valid ranks are 0..3" in messages[1]
    assert "has 8 ranks but the world has only 4" in messages[2]
    assert "dtype torch.float32" in messages[3] or "non-integer entry 0.0" in messages[3]
    assert "has 1 names but the mesh has 2 dims" in messages[4]
    assert "repeats ['dp']" in messages[5]
    assert "'cpu:0' is not a plain device type" in messages[6]
    assert "mesh_shape (2, 4) has 8 ranks but the world size is 4" in messages[7]
    assert "mesh_shape (5,) has 5 ranks" in messages[8]
    assert "has 1 names but the mesh has 2 dims" in messages[9]
    assert messages[10].startswith("MeshDimError: mesh['pp']: ['pp'] is not a mesh dim")
    assert "in the order they have in the mesh, i.e. mesh['dp', 'tp']" in messages[11]
    assert "mesh dim 2 is out of range for a 2-D mesh" in messages[12]
    assert "mesh dim 'pp' does not exist" in messages[13]
    assert "mesh dim -3 is out of range" in messages[14]
    assert "mesh dim 2 is out of range" in messages[15]
    assert "the root mesh already has a dim named 'tp'" in messages[16]
    assert "cannot slice a DeviceMesh that has no mesh_dim_names" in messages[17]


@multi_rank
def test_copies_and_pickles_keep_the_process_groups() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh._flatten()
    assert copy.deepcopy(mesh) is mesh and copy.copy(mesh["tp"]) is mesh["tp"]
    restored = pickle.loads(pickle.dumps(mesh))
    assert restored == mesh and restored is not mesh
    assert restored.get_group("tp") is mesh.get_group("tp")
    assert restored.get_coordinate() == mesh.get_coordinate()
    restored_tp = pickle.loads(pickle.dumps(mesh["tp"]))
    assert restored_tp == mesh["tp"] and restored_tp.get_group() is mesh.get_group("tp")
    assert restored_tp._get_root_mesh() == mesh
    assert restored["dp_tp"].get_group() is dist.group.WORLD
    # Groups that shardwise did not create are not found again by name after unpickling.
    foreign = DeviceMesh.from_group(dist.new_group(list(range(4))), "cpu")
    unpickled = pickle.loads(pickle.dumps(foreign))
    assert unpickled == foreign and unpickled.get_coordinate() == (dist.get_rank(),)
    with pytest.raises(MeshError, match=r"get_group\(None\): .* was unpickled in a process that does not have its process groups"):
        unpickled.get_group()


@multi_rank
def test_mesh_as_context_manager() -> None:
    outer = init_device_mesh("cpu", (4,))
    inner = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with outer:
        assert get_current_mesh() is outer
        with inner["tp"] as tp:
            assert get_current_mesh() is tp
        assert get_current_mesh() is outer
    with pytest.raises(MeshError, match="no DeviceMesh is active"):
        get_current_mesh()


@multi_rank(timeout=60)
def test_meshes_after_asymmetric_group_history_do_not_hang() -> None:
    # After these, ranks 0/1 belong to more groups than ranks 2/3. c10d's use_local_synchronization
    # would then name the next shared group differently on its members, and they would wait for
    # each other until the timeout; names derived from the ranks alone are unaffected.
    DeviceMesh("cpu", [0, 1], mesh_dim_names=("pair",))
    dist.new_group([0, 1])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    assert _sum_of_ranks_over(mesh.get_group("dp")) == 2 * (rank % 2) + 2
    assert _sum_of_ranks_over(mesh.get_group("tp")) == 4 * (rank // 2) + 1


@multi_rank
def test_meshes_do_not_keep_process_groups_alive_after_destroy() -> None:
    # A gloo group kept alive past destroy_process_group keeps its worker threads into interpreter
    # shutdown, where one may abort the process (SIGABRT) after a good run: c10d must be the only
    # owner of the groups, so destroying them really frees them even while meshes live on.
    import gc
    import weakref

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, flat = mesh["tp"], mesh._flatten()
    line = DeviceMesh("cpu", [3, 2, 1, 0])
    groups = [*mesh.get_all_groups(), tp.get_group(), flat.get_group(), line.get_group(), dist.group.WORLD]
    assert all(isinstance(group, dist.ProcessGroup) for group in groups)
    references = [weakref.ref(group) for group in groups]
    del groups
    dist.destroy_process_group()
    gc.collect()
    alive = [reference() for reference in references if reference() is not None]
    assert alive == [], f"still alive after destroy_process_group: {[group.group_name for group in alive if group is not None]}"
    # The meshes still describe their layout and say clearly that their groups are gone.
    assert mesh.shape == (2, 2) and mesh.get_coordinate() is not None
    with pytest.raises(MeshError, match=r"were destroyed \(destroy_process_group\)"):
        mesh.get_group("tp")
    with pytest.raises(MeshError, match="were destroyed"):
        line.get_all_groups()


# -- member-only group creation, lazy joint groups ------------------------------------------------


def _names_on_every_rank(name: str | None) -> list[str | None]:
    names: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(names, name)
    return names


@multi_rank
def test_joint_groups_are_made_when_first_asked_for_and_reuse_equal_rank_sets() -> None:
    with count_new_group_calls() as calls:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert calls.created == calls.calls == 2  # one per dim, none for joint dims
    assert mesh._joint_groups == {} and mesh._supports_joint_groups() and mesh["tp"]._supports_joint_groups()
    with count_new_group_calls() as calls:
        joint = mesh._joint_group((0, 1))
        from_slice = mesh["dp", "tp"]._joint_group((0, 1))
        single = mesh._joint_group((1,))
    # All four ranks in increasing order are the world: its group is reused, nothing is created.
    assert calls.calls == 0
    world = dist.group.WORLD
    assert world is not None and joint == from_slice == (world.group_name, (0, 1, 2, 3))
    assert single == (mesh.get_group_name("tp"), (0, 1))

    # A flattened dim whose ranks are not increasing gets its own group, created by its members
    # (here all ranks) under the same name on every rank, with group rank = flattened coordinate.
    backwards = DeviceMesh("cpu", [[3, 2], [1, 0]], mesh_dim_names=("a", "b"))
    with count_new_group_calls() as calls:
        flat = backwards._flatten()
    assert calls.member_ranks == [[3, 2, 1, 0]]
    assert len(set(_names_on_every_rank(flat.get_group_name()))) == 1
    assert _gather_ranks_over(flat.get_group_name(), 4) == [3, 2, 1, 0]
    assert backwards.get_group("a_b") is flat.get_group()


_FIVE_RANKS = 5


@multi_rank(world_size=_FIVE_RANKS, timeout=120)
def test_groups_are_created_by_their_members_only_whatever_each_rank_did_before() -> None:
    rank = dist.get_rank()
    # Different histories: ranks 1 and 2 hold one group more than ranks 3 and 4 (c10d's hashed
    # local-synchronization names would differ between them and their rendezvous would hang), and
    # user code's world-ordered new_group keeps working in between (we never advance its counter).
    if rank in (1, 2):
        DeviceMesh("cpu", [1, 2], mesh_dim_names=("pair",))
    user_group = dist.new_group([0, 4])
    with count_new_group_calls() as calls:
        mesh = DeviceMesh("cpu", [[4, 3], [2, 1]], mesh_dim_names=("dp", "tp"))
    joint_name: str | None = None
    if rank == 0:
        # Outside the mesh: no group construction at all, now or when the others redistribute.
        assert calls.calls == 0 and mesh.get_coordinate() is None and mesh._joint_group((0, 1)) is None
    else:
        assert calls.created == calls.calls == 2
        assert mesh["tp"].get_group() is mesh.get_group("tp")
        flat = mesh._flatten()
        assert _gather_ranks_over(flat.get_group_name(), 4) == [4, 3, 2, 1]
        assert mesh._joint_groups == {}
        # What a redistribution over both dims asks for (dtensor_ops' joint steps): made now, by the
        # 4 members only, ordered by rank, each member told its row-major index.
        with count_new_group_calls() as calls:
            joint = mesh._joint_group((0, 1))
        assert calls.member_ranks == [[1, 2, 3, 4]] and calls.calls == 1
        assert joint is not None and joint[1] == (3, 2, 1, 0)  # group ranks 1, 2, 3, 4 sit at row-major 3, 2, 1, 0
        assert _gather_ranks_over(joint[0], 4) == [1, 2, 3, 4]
        with count_new_group_calls() as calls:
            assert mesh["dp", "tp"]._joint_group((0, 1)) == joint
        assert calls.calls == 0
        joint_name = joint[0]
    if rank in (0, 4):
        assert _sum_of_ranks_over(user_group) == 4
    names = _names_on_every_rank(joint_name)
    assert names[0] is None and len(set(names[1:])) == 1


@multi_rank
def test_device_bound_worlds_create_groups_world_ordered_and_joint_groups_at_construction() -> None:
    # A default group bound to a device (NCCL with device_id) splits every communicator from the
    # world's, so there every rank calls c10d for every sub-group. gloo cannot bind a device; the
    # mode is forced here to keep that path exercised.
    from shardwise.mesh import _process_groups as process_groups

    rank = dist.get_rank()
    original = process_groups.member_only_creation
    setattr(process_groups, "member_only_creation", lambda: False)
    try:
        with count_new_group_calls() as calls:
            mesh = DeviceMesh("cpu", [[3, 2], [1, 0]], mesh_dim_names=("a", "b"))
        # 2 sub-groups per dim, every rank calling for all 4 (the joint group is the world's ranks).
        assert calls.calls == 4 and calls.created == 2
        # One joint group, keyed by how it walks the root's rank list: both dims together, 4 ranks at stride 1.
        assert set(mesh._joint_groups) == {((4, 1),)}
        a, b = mesh.get_coordinate()  # type: ignore[misc]
        assert _gather_ranks_over(mesh.get_group_name("b"), 2) == [[3, 2], [1, 0]][a]
        assert dist.get_rank(mesh.get_group("a")) == a and dist.get_rank(mesh.get_group("b")) == b
        with count_new_group_calls() as calls:
            outside = DeviceMesh("cpu", [0, 2], mesh_dim_names=("x",))
        assert calls.calls == 1 and calls.created == (1 if rank in (0, 2) else 0)
        assert (outside.get_coordinate() is None) == (rank in (1, 3))
    finally:
        setattr(process_groups, "member_only_creation", original)
