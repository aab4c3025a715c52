"""Mesh layout math, without processes, checked against brute-force enumeration."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from shardwise.mesh._layout import MeshLayout
from shardwise.mesh._validation import RankGrid


def _root(shape: tuple[int, ...], ranks: list[int] | None = None) -> MeshLayout:
    ranks = ranks if ranks is not None else list(range(math.prod(shape)))
    return MeshLayout.root(RankGrid(shape, tuple(ranks)))


def _rank_at(layout: MeshLayout, root_index: tuple[int, ...]) -> int:
    position = 0
    for size, value in zip(layout.root_shape, root_index):
        position = position * size + value
    return layout.root_ranks[position]


def _brute_groups(layout: MeshLayout, dim: int) -> set[tuple[int, ...]]:
    """Rank lists that vary only the root dims of ``dim``, ordered row-major over those dims."""
    spanned = layout.dims[dim]
    others = [d for d in range(len(layout.root_shape)) if d not in spanned]
    groups = set()
    for fixed in itertools.product(*(range(layout.root_shape[d]) for d in others)):
        ranks = []
        for varying in itertools.product(*(range(layout.root_shape[d]) for d in spanned)):
            index = [0] * len(layout.root_shape)
            for d, value in zip(others, fixed):
                index[d] = value
            for d, value in zip(spanned, varying):
                index[d] = value
            ranks.append(_rank_at(layout, tuple(index)))
        groups.add(tuple(ranks))
    return groups


VIEWS = [
    ((4,), [3, 0, 2, 1], ((0,),)),
    ((2, 2), None, ((0,), (1,))),
    ((2, 2), [3, 1, 2, 0], ((0,), (1,))),
    ((2, 2), None, ((1,),)),
    ((2, 2), None, ((0, 1),)),
    ((2, 3, 2), None, ((0,), (2,))),
    ((2, 3, 2), None, ((0, 1), (2,))),
    ((2, 3, 2), None, ((0, 2),)),
    ((2, 3, 2), [11 - r for r in range(12)], ((1,),)),
]


@pytest.mark.parametrize(("shape", "ranks", "dims"), VIEWS)
def test_groups_along_each_dim_match_enumeration(
    shape: tuple[int, ...], ranks: list[int] | None, dims: tuple[tuple[int, ...], ...]
) -> None:
    layout = _root(shape, ranks).view(dims)
    for dim in range(layout.ndim):
        groups = layout.groups_along(dim)
        assert set(groups) == _brute_groups(layout, dim)
        assert len(groups) == len(layout.root_ranks) // layout.shape[dim]
        assert sorted(r for group in groups for r in group) == sorted(layout.root_ranks)


@pytest.mark.parametrize(("shape", "ranks", "dims"), VIEWS)
def test_the_group_through_a_rank_is_its_group_along_the_dim(
    shape: tuple[int, ...], ranks: list[int] | None, dims: tuple[tuple[int, ...], ...]
) -> None:
    layout = _root(shape, ranks).view(dims)
    for dim in range(layout.ndim):
        groups = layout.groups_along(dim)
        for rank in layout.root_ranks:
            assert layout.group_through(dim, rank) == next(group for group in groups if rank in group)
    assert layout.group_through(0, max(layout.root_ranks) + 1) is None


@pytest.mark.parametrize(("shape", "ranks", "dims"), VIEWS)
def test_coordinate_and_submesh_agree(shape: tuple[int, ...], ranks: list[int] | None, dims: tuple[tuple[int, ...], ...]) -> None:
    layout = _root(shape, ranks).view(dims)
    for rank in layout.root_ranks:
        members = layout.submesh_ranks(rank)
        coordinate = layout.coordinate(rank)
        assert members is not None and coordinate is not None
        grid = torch.tensor(members).reshape(layout.shape)
        assert tuple(grid.shape) == layout.shape
        assert int(grid[coordinate]) == rank
        # Along each dim, the sub-mesh's line through the rank is that rank's process group, in order.
        for dim in range(layout.ndim):
            line = grid.movedim(dim, -1)[tuple(c for d, c in enumerate(coordinate) if d != dim)]
            assert tuple(line.tolist()) in layout.groups_along(dim)


def test_2x2_root_and_slices() -> None:
    root = _root((2, 2))
    assert root.shape == (2, 2) and root.numel == 4 and root.strides == (2, 1)
    assert root.groups_along(0) == ((0, 2), (1, 3))
    assert root.groups_along(1) == ((0, 1), (2, 3))
    assert root.coordinate(2) == (1, 0)
    tp = root.view(((1,),))
    assert tp.submesh_ranks(2) == (2, 3)
    assert tp.coordinate(2) == (0,)
    dp = root.view(((0,),))
    assert dp.submesh_ranks(3) == (1, 3)
    assert dp.coordinate(3) == (1,)


def test_flattened_dims_count_row_major_over_their_root_dims() -> None:
    root = _root((2, 2, 2))
    dp_cp = root.view(((0, 1),))
    assert dp_cp.shape == (4,)
    assert dp_cp.strides == (2,)
    assert dp_cp.groups_along(0) == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert dp_cp.coordinate(6) == (3,)
    dp_tp = root.view(((0, 2),))
    assert dp_tp.strides == ((4, 1),)
    assert dp_tp.submesh_ranks(2) == (2, 3, 6, 7)


def test_size_one_dims_take_no_stride_as_in_pytorch_repr() -> None:
    root = _root((2, 1, 2))
    assert root.strides == (2, (), 1)
    assert root.view(((0, 2),)).strides == (1,)  # 2 x 2 stepping evenly through [0, 1, 2, 3]
    assert root.view(((0, 1),)).strides == (2,)


def test_rank_listing_tells_layouts_apart() -> None:
    root = _root((2, 2))
    assert root.rank_listing == "ranks=[[0, 1], [2, 3]]"
    assert _root((2, 2), [0, 2, 1, 3]).rank_listing == "ranks=[[0, 2], [1, 3]]"
    # A slice has one sub-mesh per index of the dims it leaves out: all of them, in that order.
    assert root.view(((1,),)).rank_listing == "submeshes=[[0, 1], [2, 3]]"
    assert root.view(((0,),)).rank_listing == "submeshes=[[0, 2], [1, 3]]"
    assert root.view(((0, 1),)).rank_listing == "ranks=[0, 1, 2, 3]"
    assert _root((4,), [3, 2, 1, 0]).rank_listing == "ranks=[3, 2, 1, 0]"


def test_rank_listing_of_large_meshes_is_bounded_and_still_distinct() -> None:
    in_order = _root((16, 16))
    assert in_order.rank_listing == "ranks=range(0, 256)"
    assert in_order.view(((1,),)).rank_listing == "submeshes=range(0, 256)"
    by_column = in_order.view(((0,),)).rank_listing
    reversed_ranks = _root((16, 16), list(range(255, -1, -1))).rank_listing
    shuffled = list(range(256))
    shuffled[0], shuffled[1] = shuffled[1], shuffled[0]
    swapped_pair = _root((16, 16), shuffled).rank_listing
    for listing in (by_column, reversed_ranks, swapped_pair):
        assert len(listing) < 120 and "256 ranks, digest" in listing
    assert by_column.startswith("submeshes=[0, 16, 32, 48, 64, 80, 96, 112, ...]")
    assert reversed_ranks.startswith("ranks=[255, 254, 253, 252, 251, 250, 249, 248, ...]")
    assert len({by_column, reversed_ranks, swapped_pair}) == 3
    # Printed in full up to 64 ranks.
    assert _root((8, 8), list(range(63, -1, -1))).rank_listing.startswith("ranks=[[63, 62, 61, 60, 59, 58, 57, 56], ")


def test_rank_outside_the_root() -> None:
    root = _root((2,), [1, 3])
    assert not root.contains(0) and root.coordinate(0) is None
    assert root.submesh_ranks(0) == (1, 3)  # one sub-mesh: the root
    sliced = _root((2, 1), [1, 3]).view(((1,),))
    assert sliced.submesh_ranks(0) is None  # two sub-meshes, none holds rank 0


@pytest.mark.parametrize("dims", [((1,), (0,)), ((0,), (0,)), ((0, 0),), (), ((),), ((2,),)])
def test_invalid_views_are_rejected(dims: tuple[tuple[int, ...], ...]) -> None:
    with pytest.raises(ValueError):
        _root((2, 2)).view(dims)
