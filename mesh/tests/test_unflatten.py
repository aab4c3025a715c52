"""Splitting mesh dims (``_unflatten``), joining meshes (``_concatenate``) and per-dim backends, as torchtitan uses them.

Multi-rank tests run on 4 gloo ranks; where PyTorch's DeviceMesh shares the behaviour it is the oracle.
"""

from __future__ import annotations

import datetime
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.device_mesh as torch_device_mesh
import torch.distributed.distributed_c10d as c10d
from group_creation_helpers import count_group_constructions

import shardwise.mesh as shardwise_mesh
from shardwise.mesh import DeviceMesh, MeshDimError, MeshError, init_device_mesh
from shardwise.mesh._layout import MeshLayout
from shardwise.mesh._validation import rank_grid_from
from shardwise.testing import multi_rank

# ---------------------------------------------------------------------------------------- helpers


def _observe(mesh: Any) -> dict[str, Any]:
    """What a program can read off a mesh on this rank, in a form both implementations share."""
    seen: dict[str, Any] = {
        "shape": tuple(mesh.shape),
        "names": mesh.mesh_dim_names,
        "size": mesh.size(),
        "coordinate": None if mesh.get_coordinate() is None else tuple(mesh.get_coordinate()),
    }
    if mesh.get_coordinate() is not None:
        seen["grid"] = mesh.mesh.tolist()
        seen["local_ranks"] = [mesh.get_local_rank(dim) for dim in range(mesh.ndim)]
        groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
        seen["group_ranks"] = [dist.get_process_group_ranks(group) for group in groups]
        seen["group_backends"] = [dist.get_backend(group) for group in groups]
        seen["dim_group_names_resolve"] = [
            c10d._resolve_process_group(name) is group for name, group in zip(mesh._dim_group_names, groups)
        ]
    return seen


def _compare_with_pytorch(build: Callable[[Any, Any], list[Any]]) -> None:
    # PyTorch's DeviceMesh finds c10d's "fake" backend only once torch's module registering it is imported.
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = build(torch_device_mesh.DeviceMesh, torch_device_mesh.init_device_mesh)
    ours = build(DeviceMesh, init_device_mesh)
    assert len(ours) == len(theirs)
    for position, (our_mesh, their_mesh) in enumerate(zip(ours, theirs)):
        assert _observe(our_mesh) == _observe(their_mesh), f"mesh #{position} ({our_mesh!r}) differs"


def _torchtitan_like_meshes(mesh_class: Any, init: Any) -> dict[str, Any]:
    """torchtitan's build_mesh on 4 ranks with pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2, ep=1."""
    del mesh_class
    world = init("cpu", (4,), mesh_dim_names=("world",))
    dataloading = world._unflatten(
        0, (1, 2, 1, 2), ("pp", "batch", "cp", "tp"), backend_override={"pp": "fake", "cp": "fake"}
    )
    loss = dataloading["batch", "cp"]._flatten("loss_mesh")
    dense = world._unflatten(
        0,
        (1, 1, 2, 1, 2),
        ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
        backend_override={"pp": "fake", "dp_replicate": "fake", "cp": "fake"},
    )
    # efsdp has degree 4 but torchtitan marks it fake when ep == 1: a fake group of 4 ranks.
    sparse = world._unflatten(
        "world",
        (1, 1, 4, 1),
        ("pp", "dp_replicate", "efsdp", "ep"),
        backend_override={"pp": "fake", "dp_replicate": "fake", "efsdp": "fake", "ep": "fake"},
    )
    return {"world": world, "dataloading": dataloading, "loss": loss, "dense": dense, "sparse": sparse}


def _sum_of_ranks(group_name: str) -> int:
    """All-reduce of the global ranks through the functional collective (what torch does with ``_dim_group_names``)."""
    value = torch.tensor([dist.get_rank()], dtype=torch.int64)
    reduced = torch.ops._c10d_functional.all_reduce(value, "sum", group_name)
    return int(torch.ops._c10d_functional.wait_tensor(reduced).item())


# ------------------------------------------------------------------------- against PyTorch (oracle)


@multi_rank
def test_torchtitan_meshes_match_pytorch() -> None:
    def build(mesh_class: Any, init: Any) -> list[Any]:
        meshes = _torchtitan_like_meshes(mesh_class, init)
        dataloading, dense, sparse = meshes["dataloading"], meshes["dense"], meshes["sparse"]
        return [
            dataloading,
            dataloading["batch"],
            dataloading["tp"],
            dataloading["pp"],
            dataloading["batch", "tp"],
            meshes["loss"],
            dense,
            dense["dp_shard", "cp"],
            dense["dp_replicate", "dp_shard", "cp", "tp"],
            sparse,
            sparse["efsdp"],
            meshes["world"],
        ]

    _compare_with_pytorch(build)


@multi_rank
def test_unflatten_of_an_nd_mesh_and_concatenate_match_pytorch() -> None:
    def build(mesh_class: Any, init: Any) -> list[Any]:
        grid = init("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        split = grid._unflatten("dp", (2, 1), ("dp_replicate", "dp_shard"))
        # Ranks in column order (PyTorch sorts a group's ranks, we keep coordinate order: increasing here).
        odd = mesh_class("cpu", [[0, 2], [1, 3]], mesh_dim_names=("x", "y"))
        odd_split = odd._unflatten(1, (2, 1), ("y0", "y1"))
        world = init("cpu", (4,), mesh_dim_names=("w",))
        first = world._unflatten(0, (2, 2), ("a", "b"))
        second = world._unflatten(0, (2, 1, 2), ("c", "d", "e"))
        return [
            split,
            split["dp_shard", "tp"],
            odd_split,
            odd_split["x", "y1"],
            mesh_class._concatenate([first["a"], second["e"]]),
            mesh_class._concatenate([split["dp_replicate"], split["tp"]]),
        ]

    _compare_with_pytorch(build)


# ------------------------------------------------------------------------------- groups, collectives


@multi_rank
def test_collectives_over_unflattened_and_flattened_dims() -> None:
    rank = dist.get_rank()
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    mesh = world._unflatten(0, (2, 1, 2), ("dp", "cp", "tp"), backend_override={"cp": "fake"})
    dp, _, tp = mesh.get_coordinate()  # type: ignore[misc]
    assert (dp, tp) == divmod(rank, 2)
    # tp: {0, 1} and {2, 3}; dp: {0, 2} and {1, 3}.
    assert _sum_of_ranks(mesh._dim_group_names[2]) == (1 if rank < 2 else 5)
    assert _sum_of_ranks(mesh.get_group_name("dp")) == (2 if rank % 2 == 0 else 4)
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=mesh.get_group("tp"))
    assert value.item() == (1.0 if rank < 2 else 5.0)
    # Flattened after unflattening: dp x cp is dp's ranks; registered on the root (the world mesh), as PyTorch.
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    assert dp_cp._get_root_mesh() is world and mesh._get_root_mesh() is world
    assert world["dp_cp"] is dp_cp and world.get_group("dp_cp") is dp_cp.get_group()
    assert dist.get_process_group_ranks(dp_cp.get_group()) == [rank % 2, rank % 2 + 2]
    assert _sum_of_ranks(dp_cp._dim_group_names[0]) == (2 if rank % 2 == 0 else 4)
    # The flattened dp x cp walks dp's ranks, so it shares dp's group.
    assert dp_cp.get_group() is mesh.get_group("dp")
    everything = mesh._flatten("everything")
    assert everything.get_group() is dist.group.WORLD and _sum_of_ranks(everything._dim_group_names[0]) == 6


@multi_rank
def test_fake_dims_create_no_real_group_and_same_ranks_share_groups() -> None:
    rank = dist.get_rank()
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    with count_group_constructions() as first:
        dataloading = world._unflatten(
            0, (1, 2, 1, 2), ("pp", "batch", "cp", "tp"), backend_override={"pp": "fake", 2: "fake"}
        )
    pp = dataloading.get_group("pp")
    # A fake dim has a usable group of its size (here 1) holding this rank, of c10d's fake backend.
    assert dist.get_backend(pp) == "fake" and pp.size() == 1 and pp.rank() == 0
    assert dist.get_process_group_ranks(pp) == [rank] and dataloading["pp"].get_group() is pp
    assert c10d._resolve_process_group(dataloading._dim_group_names[0]) is pp
    cp = dataloading.get_group("cp")
    # One fake group per dim name: code naming axes by group_desc (spmd_types) tells pp from cp.
    assert dist.get_backend(cp) == "fake" and cp is not pp and (pp.group_desc, cp.group_desc) == ("mesh_pp", "mesh_cp")
    assert dist.get_backend(dataloading.get_group("tp")) == "gloo"
    # Every group here is this rank's own: fakes are made locally, the real ones by their members only.
    assert all(rank in ranks for ranks in first.ranks)
    # The same dims again, as torchtitan unflattens the world several times: no real group is created twice.
    with count_group_constructions() as again:
        dense = world._unflatten(
            0,
            (1, 1, 2, 1, 2),
            ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
            backend_override={"pp": "fake", "dp_replicate": "fake", "cp": "fake"},
        )
    assert again.ranks == [[rank]]  # only dp_replicate's fake group (a new dim name); every real group is reused
    assert dense.get_group("tp") is dataloading.get_group("tp")
    assert dense.get_group("dp_shard") is dataloading.get_group("batch")
    assert dense.get_group("pp") is pp and dense.get_group("cp") is cp
    # A degree-1 dim without "fake" gets a real (gloo) group of one rank; with it, a fake one.
    real_single = world._unflatten(0, (4, 1), ("all", "single"))
    assert dist.get_backend(real_single.get_group("single")) == "gloo"
    assert real_single.get_group("single") is not pp
    # Equal meshes whatever unflatten they came from (same ranks walked, same names).
    assert dataloading["tp"] == dense["tp"] and hash(dataloading["tp"]) == hash(dense["tp"])
    assert dataloading["batch"] != dense["dp_shard"]  # names differ


@multi_rank
def test_backend_override_with_a_backend_name_and_options() -> None:
    rank = dist.get_rank()
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=123)
    mesh = world._unflatten(0, (2, 2), ("dp", "tp"), backend_override={"dp": "gloo", "tp": ("gloo", options)})
    tp = mesh.get_group("tp")
    assert dist.get_backend(tp) == "gloo" and dist.get_process_group_ranks(tp) == [rank - rank % 2, rank - rank % 2 + 1]
    # The options reached the backend (their timeout, which c10d would otherwise replace with its default).
    assert tp._get_backend(torch.device("cpu")).options._timeout == options._timeout
    assert _sum_of_ranks(mesh.get_group_name("tp")) == (1 if rank < 2 else 5)
    assert _sum_of_ranks(mesh.get_group_name("dp")) == (2 if rank % 2 == 0 else 4)
    # An override never stands for the default group, even over the whole world.
    whole = world._unflatten(0, (4,), ("again",), backend_override={"again": "gloo"})
    assert whole.get_group() is not dist.group.WORLD and _sum_of_ranks(whole.get_group_name()) == 6
    flat = mesh._flatten("fake_everything", backend_override="fake")
    assert dist.get_backend(flat.get_group()) == "fake" and flat.get_group().size() == 4


@multi_rank
def test_concatenate_meshes_of_one_root() -> None:
    rank = dist.get_rank()
    meshes = _torchtitan_like_meshes(DeviceMesh, init_device_mesh)
    dataloading, dense = meshes["dataloading"], meshes["dense"]
    # FSDP's dp dim from one unflattening, TP's from another (torchtitan's full_dtensor / spmd_types).
    joined = DeviceMesh._concatenate([dense["dp_shard"], dataloading["tp"]])
    assert joined == dense["dp_shard", "tp"] and joined.mesh_dim_names == ("dp_shard", "tp")
    assert joined.mesh.tolist() == [[0, 1], [2, 3]] and joined.get_coordinate() == divmod(rank, 2)
    assert joined.get_group("tp") is dataloading.get_group("tp")
    assert joined._get_root_mesh() is meshes["world"]
    assert _sum_of_ranks(joined._dim_group_names[0]) == (2 if rank % 2 == 0 else 4)
    with pytest.raises(MeshError, match="overlap"):
        DeviceMesh._concatenate([dataloading["batch"], dense["dp_shard"]])  # the same ranks under two names
    with pytest.raises(MeshError, match="order"):
        DeviceMesh._concatenate([dataloading["tp"], dense["dp_shard"]])
    other = DeviceMesh("cpu", [3, 2, 1, 0], mesh_dim_names=("reversed",))
    with pytest.raises(MeshError, match="not views of one root mesh"):
        DeviceMesh._concatenate([other, dataloading["tp"]])
    with pytest.raises(MeshError, match="repeating"):
        DeviceMesh._concatenate([dense["tp"], dense["pp"]._unflatten(0, (1,), ("tp",))])
    with pytest.raises(MeshError, match="non-empty list"):
        DeviceMesh._concatenate([])


@multi_rank
def test_ranks_outside_the_mesh_unflatten_it_without_groups() -> None:
    rank = dist.get_rank()
    pair = DeviceMesh("cpu", [1, 3], mesh_dim_names=("x",))
    with count_group_constructions() as constructions:
        split = pair._unflatten(0, (2, 1), ("a", "b"), backend_override={"b": "fake"})
    if rank in (1, 3):
        assert split.get_coordinate() == (rank // 2, 0) and len(split._dim_group_names) == 2
        assert dist.get_process_group_ranks(split.get_group("a")) == [1, 3]
        assert dist.get_backend(split.get_group("b")) == "fake"
    else:
        assert split.get_coordinate() is None and split._dim_group_names == () and constructions.calls == 0
        with pytest.raises(MeshError, match="not part of"):
            split.get_group("a")
    assert split.mesh.tolist() == [[1], [3]]  # one grid: every rank can read it


@multi_rank
def test_world_ordered_creation_unflattens_with_every_rank_and_fakes_locally() -> None:
    """Device-bound (NCCL split) worlds: every rank calls new_group for every real sub-group; fakes stay local."""
    from shardwise.mesh import _process_groups as process_groups

    rank = dist.get_rank()
    original = process_groups.member_only_creation
    setattr(process_groups, "member_only_creation", lambda: False)
    try:
        world = DeviceMesh("cpu", [3, 2, 1, 0], mesh_dim_names=("w",))
        with count_group_constructions() as constructions:
            mesh = world._unflatten(0, (2, 1, 2), ("dp", "cp", "tp"), backend_override={"cp": "fake"})
        # dp and tp: 2 sub-groups each, called on every rank; cp: this rank's own fake group only.
        real_calls = [ranks for ranks in constructions.ranks if len(ranks) == 2]
        assert real_calls == [[3, 1], [2, 0], [3, 2], [1, 0]]
        assert [ranks for ranks in constructions.ranks if len(ranks) == 1] == [[rank]]
        dp, _, tp = mesh.get_coordinate()  # type: ignore[misc]
        assert dist.get_rank(mesh.get_group("dp")) == dp and dist.get_rank(mesh.get_group("tp")) == tp
        assert _sum_of_ranks(mesh.get_group_name("tp")) == (5 if rank >= 2 else 1)
    finally:
        setattr(process_groups, "member_only_creation", original)


# ------------------------------------------------------------------------------------------ errors


@multi_rank
def test_bad_unflatten_arguments_fail_before_any_group_is_created() -> None:
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    grid = world._unflatten(0, (2, 2), ("dp", "tp"))
    cases: list[tuple[Callable[[], Any], type[Exception], str]] = [
        (lambda: world._unflatten(0, (2, 3), ("a", "b")), ValueError, r"multiply to 6, but dim 'world' \(index 0\) has size 4"),
        (lambda: world._unflatten(0, (2, 2), ("a", "a")), ValueError, r"repeating \['a'\]"),
        (lambda: grid._unflatten("dp", (2, 1), ("tp", "x")), ValueError, r"repeating \['tp'\]"),
        (lambda: world._unflatten(1, (2, 2), ("a", "b")), KeyError, r"dim 1 is out of range for a 1-D mesh"),
        (lambda: grid._unflatten(-3, (2,), ("a",)), KeyError, r"dim -3 is out of range for a 2-D mesh"),
        (lambda: grid._unflatten("pp", (2,), ("a",)), KeyError, r"'pp' is not a dim of the mesh"),
        (lambda: world._unflatten(0, (2, 2), ("a",)), RuntimeError, r"1 mesh_dim_names \('a',\) for 2 mesh_sizes"),
        (lambda: world._unflatten(0, (4,), "a"), ValueError, r"got the str 'a'"),
        (lambda: world._unflatten(0, (0, 4), ("a", "b")), ValueError, r"expected positive ints"),
        (lambda: world._unflatten(0, (2, 2), ("a", "b"), backend_override={"c": "fake"}), ValueError, r"keys \['c'\]"),
        (lambda: world._unflatten(0, (2, 2), ("a", "b"), backend_override={"a": "fake", 0: "gloo"}), ValueError, "twice"),
        (lambda: world._unflatten(0, (2, 2), ("a", "b"), backend_override={"a": 3}), ValueError, "not a backend override"),
        (lambda: init_device_mesh("cpu", (4,))._unflatten(0, (2, 2), ("a", "b")), ValueError, "no mesh_dim_names"),
    ]
    for call, kind, message in cases:
        with count_group_constructions() as constructions:
            with pytest.raises(kind, match=message) as raised:
                call()
        assert isinstance(raised.value, MeshError)
        assert constructions.calls == 0, f"{message}: a group was created before the error"
    assert isinstance(pytest.raises(MeshDimError, lambda: world._unflatten(2, (4,), ("a",))).value, KeyError)


# -------------------------------------------------------------------------------- without processes


def test_unflattened_layouts_walk_the_ranks_as_the_original() -> None:
    root = MeshLayout.root(rank_grid_from([[0, 1, 2], [3, 4, 5]]))
    whole = root.view(((0, 1),))
    assert whole.unflatten(0, (2, 3)).signature == root.signature  # unflatten undoes flatten
    three_two = whole.unflatten(0, (3, 2))
    assert [three_two.group_through(0, rank) for rank in (0, 1)] == [(0, 2, 4), (1, 3, 5)]
    # A dim flattened over two root dims that are not neighbours (3 ranks apart by 4, then 2 by 1)
    # splits 3 x 2 but not 2 x 3, which would cut the 3 in two.
    gapped = MeshLayout.root(rank_grid_from(list(range(12)))).unflatten(0, (3, 2, 2)).view(((0, 2),))
    assert gapped.unflatten(0, (3, 2)).group_through(1, 0) == (0, 1)
    with pytest.raises(ValueError, match="cannot be cut"):
        gapped.unflatten(0, (2, 3))
    line = MeshLayout.root(rank_grid_from(list(range(8))))
    split = line.unflatten(0, (1, 2, 1, 4))
    assert split.shape == (1, 2, 1, 4) and split.coordinate(6) == (0, 1, 0, 2)
    assert split.strides == ((), 4, (), 1)
    joined = MeshLayout.concatenate((split.view((split.dims[1],)), line.unflatten(0, (2, 2, 2)).view(((2,),))))
    assert joined.shape == (2, 2) and joined.group_through(1, 5) == (4, 5) and joined.group_through(0, 5) == (1, 5)


def test_register_distributed_opaque_types_runs_the_registrations_added_above_this_layer() -> None:
    calls: list[str] = []

    def registration() -> None:
        calls.append("registered")

    shardwise_mesh._register_opaque_type_registration(registration)
    shardwise_mesh._register_opaque_type_registration(registration)  # added once
    try:
        shardwise_mesh._register_distributed_opaque_types()
        assert calls == ["registered"]
    finally:
        shardwise_mesh._device_mesh._opaque_type_registrations.remove(registration)
