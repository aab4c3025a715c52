"""Shard layout properties, checked exhaustively over small shapes and meshes."""

from __future__ import annotations

import itertools
from typing import Iterator, Sequence

import pytest
import torch

from shardwise.placement import (
    Partial,
    Placement,
    Replicate,
    Shard,
    chunk_size_and_offset,
    chunk_sizes,
    compute_local_shape,
    compute_local_shape_and_global_offset,
    contiguous_strides,
    even_global_shape,
    select_local_shard,
    shard_sizes_along_mesh_dim,
    strides_in_local_dim_order,
)

MESH_SHAPES_1D: list[tuple[int, ...]] = [(1,), (2,), (3,), (4,), (5,)]
MESH_SHAPES_2D: list[tuple[int, ...]] = [(1, 4), (2, 2), (2, 3), (3, 2)]
MESH_SHAPES_3D: list[tuple[int, ...]] = [(2, 2, 2), (2, 1, 3)]


def all_coordinates(mesh_shape: Sequence[int]) -> Iterator[tuple[int, ...]]:
    return itertools.product(*(range(extent) for extent in mesh_shape))


def chunks_padded_to(tensor: torch.Tensor, dim: int, num_chunks: int) -> list[torch.Tensor]:
    """torch.chunk, topped up with empty pieces at the end when it returns fewer than asked."""
    pieces = list(torch.chunk(tensor, num_chunks, dim))
    while len(pieces) < num_chunks:
        pieces.append(tensor.narrow(dim, tensor.size(dim), 0))
    return pieces


def placement_choices(ndim: int) -> list[Placement]:
    shards: list[Placement] = [Shard(d) for d in range(-ndim, ndim)]
    return shards + [Replicate(), Partial()]


def layouts(ndim: int, mesh_shapes: Sequence[tuple[int, ...]]) -> Iterator[tuple[tuple[int, ...], tuple[Placement, ...]]]:
    for mesh_shape in mesh_shapes:
        for placements in itertools.product(placement_choices(ndim), repeat=len(mesh_shape)):
            yield mesh_shape, placements


# -- the 1-D core --------------------------------------------------------------


@pytest.mark.parametrize("num_chunks", range(1, 9))
def test_chunk_core_agrees_with_torch_chunk(num_chunks: int) -> None:
    for dim_size in range(0, 21):
        full = torch.arange(dim_size)
        expected = chunks_padded_to(full, 0, num_chunks)
        assert chunk_sizes(dim_size, num_chunks) == tuple(len(piece) for piece in expected)
        for index, piece in enumerate(expected):
            size, offset = chunk_size_and_offset(dim_size, num_chunks, index)
            assert size == len(piece)
            assert torch.equal(full[offset : offset + size], piece)


def test_chunk_core_always_gives_exactly_k_chunks_unlike_torch_chunk() -> None:
    # torch.chunk(arange(5), 4) returns only 3 pieces (2, 2, 1): we keep a fourth, empty one.
    assert len(torch.chunk(torch.arange(5), 4)) == 3
    assert chunk_sizes(5, 4) == (2, 2, 1, 0)
    assert chunk_sizes(2, 4) == (1, 1, 0, 0)
    assert chunk_sizes(0, 3) == (0, 0, 0)
    assert chunk_sizes(6, 4) == (2, 2, 2, 0)
    assert [chunk_size_and_offset(5, 4, i)[1] for i in range(4)] == [0, 2, 4, 5]


def test_chunk_core_agrees_with_tensor_split_at_its_boundaries() -> None:
    for dim_size in range(0, 12):
        for num_chunks in range(1, 7):
            full = torch.arange(dim_size)
            starts = [chunk_size_and_offset(dim_size, num_chunks, i)[1] for i in range(1, num_chunks)]
            pieces = torch.tensor_split(full, starts)
            assert len(pieces) == num_chunks
            for index, piece in enumerate(pieces):
                size, offset = chunk_size_and_offset(dim_size, num_chunks, index)
                assert piece.tolist() == list(range(offset, offset + size))


def test_chunk_core_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_chunks must be >= 1, got 0"):
        chunk_size_and_offset(4, 0, 0)
    with pytest.raises(IndexError, match=r"chunk index 3 is out of range for 3 chunks; expected \[0, 2\]"):
        chunk_size_and_offset(4, 3, 3)
    with pytest.raises(IndexError, match="chunk index -1"):
        chunk_size_and_offset(4, 3, -1)
    with pytest.raises(ValueError, match="dim_size must be >= 0, got -2"):
        chunk_size_and_offset(-2, 3, 0)


# -- tiling: every element held by exactly one shard ------------------------------


def assert_shards_tile_global_tensor(
    global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]
) -> None:
    """Shards over the sharding mesh dims cover each element once; the other mesh dims hold copies."""
    ndim = len(global_shape)
    copies_per_shard = 1
    for extent, placement in zip(mesh_shape, placements):
        if not isinstance(placement, Shard):
            copies_per_shard *= extent
    cover_count = torch.zeros(global_shape, dtype=torch.int32)
    full = torch.arange(cover_count.numel()).reshape(global_shape)
    box_of_shard: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for coordinate in all_coordinates(mesh_shape):
        local_shape, offset = compute_local_shape_and_global_offset(global_shape, mesh_shape, coordinate, placements)
        assert len(local_shape) == len(offset) == ndim
        for size, start, extent in zip(local_shape, offset, global_shape):
            assert 0 <= size and 0 <= start and start + size <= extent
        region = tuple(slice(start, start + size) for start, size in zip(offset, local_shape))
        cover_count[region] += 1
        shard = select_local_shard(full, mesh_shape, coordinate, placements)
        assert tuple(shard.shape) == local_shape
        assert torch.equal(shard, full[region])
        # Replicas (coordinates differing only on non-sharding mesh dims) hold the same box.
        shard_key = tuple(c for c, p in zip(coordinate, placements) if isinstance(p, Shard))
        box = (local_shape, offset)
        assert box_of_shard.setdefault(shard_key, box) == box, (coordinate, box_of_shard[shard_key], box)
    assert bool((cover_count == copies_per_shard).all()), (global_shape, mesh_shape, placements, cover_count)


@pytest.mark.parametrize("mesh_shapes", [MESH_SHAPES_1D, MESH_SHAPES_2D, MESH_SHAPES_3D], ids=["1d", "2d", "3d"])
def test_shards_tile_1d_tensors(mesh_shapes: list[tuple[int, ...]]) -> None:
    for mesh_shape, placements in layouts(1, mesh_shapes):
        for size in range(0, 10):
            assert_shards_tile_global_tensor((size,), mesh_shape, placements)


@pytest.mark.parametrize("mesh_shapes", [MESH_SHAPES_1D, MESH_SHAPES_2D], ids=["1d", "2d"])
def test_shards_tile_2d_tensors(mesh_shapes: list[tuple[int, ...]]) -> None:
    for mesh_shape, placements in layouts(2, mesh_shapes):
        for global_shape in itertools.product(range(0, 10), (0, 2, 5, 7)):
            assert_shards_tile_global_tensor(global_shape, mesh_shape, placements)


def test_shards_tile_3d_tensor_on_3d_mesh() -> None:
    for mesh_shape, placements in layouts(3, [(2, 2, 2)]):
        for global_shape in [(3, 4, 5), (1, 0, 7)]:
            assert_shards_tile_global_tensor(global_shape, mesh_shape, placements)


def test_scalar_tensor_is_never_split() -> None:
    for mesh_shape in [(1,), (3,), (2, 2)]:
        placements = tuple(Replicate() if i % 2 else Partial() for i in range(len(mesh_shape)))
        for coordinate in all_coordinates(mesh_shape):
            assert compute_local_shape_and_global_offset((), mesh_shape, coordinate, placements) == ((), ())


# -- nesting and agreement with torch.chunk on the full tensor --------------------


def nested_torch_chunk(full: torch.Tensor, mesh_shape: Sequence[int], coordinate: Sequence[int],
                       placements: Sequence[Placement]) -> torch.Tensor:
    piece = full
    for extent, index, placement in zip(mesh_shape, coordinate, placements):
        if isinstance(placement, Shard):
            piece = chunks_padded_to(piece, placement.dim % full.dim(), extent)[index]
    return piece


def test_local_shards_equal_torch_chunk_applied_mesh_dim_by_mesh_dim() -> None:
    full = torch.arange(7 * 10).reshape(7, 10)
    for mesh_shape, placements in layouts(2, MESH_SHAPES_1D + MESH_SHAPES_2D + MESH_SHAPES_3D):
        for coordinate in all_coordinates(mesh_shape):
            expected = nested_torch_chunk(full, mesh_shape, coordinate, placements)
            assert torch.equal(select_local_shard(full, mesh_shape, coordinate, placements), expected)


def test_nested_sharding_splits_left_mesh_dim_first() -> None:
    # 10 elements, mesh dim 0 (size 2) first: [0..5) and [5..10); mesh dim 1 (size 3) then cuts 5 into 2, 2, 1.
    expected = {
        (0, 0): ((2,), (0,)), (0, 1): ((2,), (2,)), (0, 2): ((1,), (4,)),
        (1, 0): ((2,), (5,)), (1, 1): ((2,), (7,)), (1, 2): ((1,), (9,)),
    }
    for coordinate, layout in expected.items():
        assert compute_local_shape_and_global_offset((10,), (2, 3), coordinate, (Shard(0), Shard(0))) == layout
    # The other nesting order (3 first, then 2) gives different pieces: 4 -> 2+2, 4 -> 2+2, 2 -> 1+1.
    assert compute_local_shape_and_global_offset((10,), (3, 2), (2, 1), (Shard(0), Shard(0))) == ((1,), (9,))
    assert compute_local_shape_and_global_offset((10,), (3, 2), (1, 1), (Shard(0), Shard(0))) == ((2,), (6,))


def test_negative_shard_dims_count_from_the_end() -> None:
    for coordinate in all_coordinates((2, 3)):
        negative = compute_local_shape_and_global_offset((4, 5, 7), (2, 3), coordinate, (Shard(-1), Shard(-3)))
        positive = compute_local_shape_and_global_offset((4, 5, 7), (2, 3), coordinate, (Shard(2), Shard(0)))
        assert negative == positive


def test_uneven_and_empty_shards_on_trailing_ranks() -> None:
    local = [compute_local_shape_and_global_offset((2, 3), (4,), (i,), (Shard(0),)) for i in range(4)]
    assert local == [((1, 3), (0, 0)), ((1, 3), (1, 0)), ((0, 3), (2, 0)), ((0, 3), (2, 0))]


def test_empty_shard_offset_is_the_global_size_even_when_nested() -> None:
    # 2 elements on (2, 2) nested: mesh dim 0 gives [0] and [1]; mesh dim 1 splits [0] into [0] and nothing.
    assert compute_local_shape_and_global_offset((2,), (2, 2), (0, 1), (Shard(0), Shard(0))) == ((0,), (2,))
    assert compute_local_shape_and_global_offset((2,), (2, 2), (1, 0), (Shard(0), Shard(0))) == ((1,), (1,))


def test_coordinate_none_means_rank_outside_the_mesh_holds_nothing() -> None:
    assert compute_local_shape_and_global_offset((4, 6), (2,), None, (Shard(0),)) == ((0, 0), (4, 6))
    assert compute_local_shape((4, 6), (2, 2), None, (Replicate(), Replicate())) == (0, 0)
    assert select_local_shard(torch.ones(4, 6), (2,), None, (Shard(1),)).shape == (0, 0)


def test_agrees_with_pytorch_layout_on_its_placements() -> None:
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    torch_utils = pytest.importorskip("torch.distributed.tensor._utils")
    torch_layout = getattr(torch_utils, "_compute_local_shape_and_global_offset", None)
    if torch_layout is None:
        pytest.skip("this PyTorch has no _compute_local_shape_and_global_offset to compare with")

    def to_torch(placement: Placement) -> object:
        if isinstance(placement, Shard):
            return TorchShard(placement.dim)
        return TorchReplicate() if isinstance(placement, Replicate) else TorchPartial()

    for mesh_shape, placements in layouts(2, MESH_SHAPES_1D + MESH_SHAPES_2D + MESH_SHAPES_3D):
        if any(isinstance(p, Shard) and p.dim < 0 for p in placements):
            continue
        torch_placements = [to_torch(p) for p in placements]
        for global_shape in [(5, 0), (3, 7), (9, 2)]:
            for coordinate in all_coordinates(mesh_shape):
                ours = compute_local_shape_and_global_offset(global_shape, mesh_shape, coordinate, placements)
                theirs = torch_layout(global_shape, mesh_shape, list(coordinate), torch_placements)
                assert ours == (tuple(theirs[0]), tuple(theirs[1])), (global_shape, mesh_shape, placements, coordinate)


# -- per-group shard sizes for padded collectives ----------------------------------


def test_shard_sizes_along_mesh_dim_match_each_group_members_local_size() -> None:
    for mesh_shape, placements in layouts(2, MESH_SHAPES_2D + MESH_SHAPES_3D):
        for global_shape in [(7, 3), (2, 5)]:
            for coordinate in all_coordinates(mesh_shape):
                for mesh_dim in range(len(mesh_shape)):
                    for tensor_dim in range(2):
                        sizes = shard_sizes_along_mesh_dim(
                            global_shape, mesh_shape, coordinate, placements, mesh_dim=mesh_dim, tensor_dim=tensor_dim
                        )
                        assert len(sizes) == mesh_shape[mesh_dim]
                        member = list(coordinate)
                        for index, size in enumerate(sizes):
                            member[mesh_dim] = index
                            assert size == compute_local_shape(global_shape, mesh_shape, member, placements)[tensor_dim]


def test_shard_sizes_along_mesh_dim_examples() -> None:
    both = (Shard(0), Shard(0))
    # Gathering over mesh dim 1 inside the second half (5 elements) of a 10-element dim.
    assert shard_sizes_along_mesh_dim((10,), (2, 3), (1, 0), both, mesh_dim=1, tensor_dim=0) == (2, 2, 1)
    # Gathering over mesh dim 0 with mesh dim 1 still splitting afterwards: each half's piece at index 2.
    assert shard_sizes_along_mesh_dim((10,), (2, 3), (0, 2), both, mesh_dim=0, tensor_dim=0) == (1, 1)
    assert shard_sizes_along_mesh_dim((5, 4), (4,), (0,), (Shard(0),), mesh_dim=-1, tensor_dim=0) == (2, 2, 1, 0)
    assert shard_sizes_along_mesh_dim((5, 4), (4,), (0,), (Shard(0),), mesh_dim=0, tensor_dim=-1) == (4, 4, 4, 4)


def test_shard_sizes_along_mesh_dim_rejects_bad_dims() -> None:
    with pytest.raises(IndexError, match=r"mesh_dim=2 is out of range for a mesh of shape \(2, 3\)"):
        shard_sizes_along_mesh_dim((4,), (2, 3), (0, 0), (Shard(0), Replicate()), mesh_dim=2, tensor_dim=0)
    with pytest.raises(IndexError, match=r"tensor_dim=1 is out of range for a tensor with 1 dims"):
        shard_sizes_along_mesh_dim((4,), (2,), (0,), (Shard(0),), mesh_dim=0, tensor_dim=1)


# -- errors ------------------------------------------------------------------------


def test_layout_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"got 1 placements \(Shard\(dim=0\),\) for a 2-D mesh of shape \(2, 2\)"):
        compute_local_shape_and_global_offset((4,), (2, 2), (0, 0), (Shard(0),))
    with pytest.raises(ValueError, match=r"coordinate \(0,\) has 1 entries but the mesh of shape \(2, 2\) has 2 dims"):
        compute_local_shape_and_global_offset((4,), (2, 2), (0,), (Shard(0), Replicate()))
    with pytest.raises(IndexError, match=r"mesh dim 1 has size 2, got index 2"):
        compute_local_shape_and_global_offset((4,), (2, 2), (0, 2), (Shard(0), Replicate()))
    with pytest.raises(ValueError, match=r"Shard\(dim=2\) on mesh dim 0 is out of range for a tensor with 2 dims \(shape \(4, 4\)\); expected a dim in \[-2, 1\]"):
        compute_local_shape_and_global_offset((4, 4), (2,), (0,), (Shard(2),))
    with pytest.raises(ValueError, match=r"Shard\(dim=-3\) on mesh dim 1 is out of range"):
        compute_local_shape_and_global_offset((4, 4), (1, 2), (0, 0), (Replicate(), Shard(-3)))
    with pytest.raises(ValueError, match="a 0-dim tensor cannot be sharded"):
        compute_local_shape_and_global_offset((), (2,), (0,), (Shard(0),))


# -- strides and even shapes (the layout helpers DTensor construction uses) -----------------------------


@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (4, 0, 3), (1, 6, 1), (2, 3, 4, 5)])
def test_contiguous_strides_are_torchs(shape: tuple[int, ...]) -> None:
    assert contiguous_strides(shape) == torch.empty(shape).stride()


def test_strides_in_local_dim_order_keep_the_memory_order_of_the_shard_for_the_global_shape() -> None:
    assert strides_in_local_dim_order(torch.empty(2, 3), (8, 3)) == (3, 1)
    transposed = torch.empty(3, 2).t()  # shape (2, 3), dim 0 innermost
    assert strides_in_local_dim_order(transposed, (8, 3)) == torch.empty(3, 8).t().stride()
    # A contiguous shard with a size-1 dim (strides there are arbitrary) still gives the contiguous stride.
    assert strides_in_local_dim_order(torch.empty(1, 4).as_strided((1, 4), (99, 1)), (4, 4)) == (4, 1)


def test_even_global_shape_multiplies_each_sharded_dim_by_its_mesh_dims() -> None:
    assert even_global_shape((2, 3), (4,), (Shard(0),)) == (8, 3)
    assert even_global_shape((2, 3), (2, 2), (Shard(0), Shard(0))) == (8, 3)
    assert even_global_shape((2, 3), (2, 3), (Shard(1), Replicate())) == (2, 6)
    assert even_global_shape((2, 3), (2, 2), (Shard(-1), Partial())) == (2, 6)
