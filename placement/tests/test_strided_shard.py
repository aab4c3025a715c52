"""_StridedShard: the placement FSDP uses on top of tensor parallelism, and its exact layout."""

from __future__ import annotations

import itertools
import pickle
from typing import Sequence

import pytest
import torch
from torch.distributed.tensor import _utils as torch_dtensor_utils
from torch.distributed.tensor import placement_types as torch_placements

from shardwise.placement import (
    DTensorSpec,
    Placement,
    Replicate,
    Shard,
    TensorMeta,
    _StridedShard,
    compute_local_shape_and_global_offset,
    even_global_shape,
    local_index_runs,
    select_local_shard,
)
from shardwise.testing import FakeMesh


def test_identity_repr_and_equality_follow_pytorch() -> None:
    strided = _StridedShard(0, split_factor=2)
    assert repr(strided) == "_StridedShard(dim=0, sf=2)"
    assert str(strided) == "_S(0, 2)"
    assert strided == _StridedShard(0, sf=2)
    assert strided != _StridedShard(0, split_factor=3)
    assert strided != _StridedShard(1, split_factor=2)
    assert strided != Shard(0) and Shard(0) != strided
    assert _StridedShard(0, split_factor=1) != Shard(0)
    assert not strided.is_shard() and not strided.is_shard(0)
    assert not strided.is_replicate() and not strided.is_partial()
    assert len({strided, _StridedShard(0, sf=2), Shard(0)}) == 2
    assert pickle.loads(pickle.dumps(strided)) == strided
    torch_strided = torch_placements._StridedShard(0, split_factor=2)
    assert (repr(strided), str(strided)) == (repr(torch_strided), str(torch_strided))


def test_bad_arguments_name_what_was_expected() -> None:
    with pytest.raises(TypeError, match="both split_factor=2 and sf=3"):
        _StridedShard(0, split_factor=2, sf=3)
    with pytest.raises(ValueError, match="must be >= 1"):
        _StridedShard(0, split_factor=0)
    with pytest.raises(TypeError, match="expects an int >= 1, got str"):
        _StridedShard(0, split_factor="2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expects an int tensor dimension"):
        _StridedShard(0.5)  # type: ignore[arg-type]
    with pytest.raises(AttributeError, match="immutable"):
        _StridedShard(0).dim = 1  # type: ignore[misc]


def _torch_placement(placement: Placement) -> torch_placements.Placement:
    if isinstance(placement, _StridedShard):
        return torch_placements._StridedShard(placement.dim, split_factor=placement.split_factor)
    if isinstance(placement, Shard):
        return torch_placements.Shard(placement.dim)
    return torch_placements.Replicate()


def _torch_local_piece(full: torch.Tensor, mesh_shape: Sequence[int], coordinate: Sequence[int],
                       placements: Sequence[Placement]) -> torch.Tensor:
    """PyTorch's own split, mesh dim by mesh dim, left to right (the oracle)."""
    piece = full
    for mesh_dim, placement in enumerate(placements):
        torch_placement = _torch_placement(placement)
        if isinstance(torch_placement, torch_placements.Replicate):
            continue
        pieces, _ = torch_placement._split_tensor(piece, mesh_shape[mesh_dim], with_padding=False)
        piece = pieces[coordinate[mesh_dim]]
    return piece


LAYOUTS: list[tuple[tuple[int, ...], tuple[Placement, ...]]] = [
    ((2, 2), (_StridedShard(0, split_factor=2), Shard(0))),
    ((2, 3), (_StridedShard(0, split_factor=3), Shard(0))),
    ((3, 2), (_StridedShard(0, split_factor=2), Shard(0))),
    ((4, 2), (_StridedShard(0, split_factor=2), Shard(0))),
    ((2, 2), (_StridedShard(1, split_factor=2), Shard(1))),
    ((2, 2), (_StridedShard(0, split_factor=2), Shard(1))),
    ((2, 2), (Shard(0), _StridedShard(0, split_factor=2))),
    ((2, 2), (_StridedShard(0, split_factor=3), Replicate())),
    ((3,), (_StridedShard(0, split_factor=2),)),
    ((2, 2, 2), (_StridedShard(0, split_factor=4), Shard(0), Shard(0))),
]


@pytest.mark.parametrize("mesh_shape,placements", LAYOUTS)
def test_layout_matches_pytorch_exactly_on_even_and_uneven_shapes(
    mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]
) -> None:
    for rows, cols in itertools.product(range(0, 14), (1, 5)):
        global_shape = (rows, cols)
        full = torch.arange(rows * cols).reshape(global_shape)
        torch_placements_ = [_torch_placement(p) for p in placements]
        for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
            expected = _torch_local_piece(full, mesh_shape, coordinate, placements)
            ours = select_local_shard(full, mesh_shape, coordinate, placements)
            assert torch.equal(ours, expected), (global_shape, coordinate)
            shape, offset = compute_local_shape_and_global_offset(global_shape, mesh_shape, coordinate, placements)
            assert shape == tuple(expected.shape)
            torch_shape, torch_offset = torch_dtensor_utils._compute_local_shape_and_global_offset(
                global_shape, mesh_shape, list(coordinate), torch_placements_
            )
            assert (shape, offset) == (tuple(torch_shape), tuple(torch_offset)), (global_shape, coordinate)
            runs = local_index_runs(global_shape, mesh_shape, coordinate, placements)
            rebuilt = full
            for dim, dim_runs in enumerate(runs):
                index = [i for start, length in dim_runs for i in range(start, start + length)]
                rebuilt = rebuilt.index_select(dim, torch.tensor(index, dtype=torch.long))
            assert torch.equal(rebuilt, expected)


@pytest.mark.parametrize("dp,tp", [(2, 2), (2, 3), (4, 2), (3, 2)])
def test_fsdp_over_tp_is_tp_first_then_dp_on_a_dp_tp_mesh(dp: int, tp: int) -> None:
    """The reason the placement exists: (dp, tp) mesh, TP cuts first, FSDP cuts each TP piece."""
    placements = (_StridedShard(0, split_factor=tp), Shard(0))
    for rows in range(0, 4 * dp * tp + 1):
        full = torch.arange(rows * 2).reshape(rows, 2)
        tp_pieces = [full.narrow(0, *_chunk(rows, tp, j)[::-1]) for j in range(tp)]
        for i, j in itertools.product(range(dp), range(tp)):
            piece = tp_pieces[j]
            right_to_left = piece.narrow(0, *_chunk(piece.size(0), dp, i)[::-1])
            ours = select_local_shard(full, (dp, tp), (i, j), placements)
            if all(_chunk(rows, tp, k)[0] % dp == 0 for k in range(tp)):
                assert torch.equal(ours, right_to_left), (rows, i, j)
        # Whatever the sizes, the shards tile the tensor: every row held exactly once.
        held = sorted(
            start + k
            for i, j in itertools.product(range(dp), range(tp))
            for start, length in local_index_runs((rows, 2), (dp, tp), (i, j), placements)[0]
            for k in range(length)
        )
        assert held == list(range(rows))


def _chunk(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    full = -(-size // num_chunks)
    offset = min(index * full, size)
    return min(full, size - offset), offset


def test_strided_piece_lists_every_range_it_holds() -> None:
    # 9 rows, split_factor 2 then 4 ranks: [0..4] -> [0,1][2,3][4][]; [5..8] -> [5][6][7][8].
    placements = (_StridedShard(0, split_factor=2),)
    expected = [((0, 2), (5, 1)), ((2, 2), (6, 1)), ((4, 1), (7, 1)), ((8, 1),)]
    for rank, runs in enumerate(expected):
        assert local_index_runs((9,), (4,), (rank,), placements) == (runs,)
    assert local_index_runs((9,), (4,), None, placements) == ((),)


def test_spec_counts_strided_shards_and_normalises_their_dim() -> None:
    mesh = FakeMesh((2, 2))
    meta = TensorMeta(torch.Size((8, 4)), (4, 1), torch.float32)
    spec = DTensorSpec(mesh, (_StridedShard(-2, split_factor=2), Shard(0)), meta)
    assert spec.placements == (_StridedShard(0, split_factor=2), Shard(0))
    assert spec.num_shards == 4 and spec.num_shards_per_dim == (4, 1)
    assert spec.is_sharded() and not spec.is_replicated()
    assert spec.local_shape((1, 0)) == (2, 4)
    assert spec.local_shape_and_offset((1, 0))[1] == (2, 0)
    assert even_global_shape((2, 4), (2, 2), spec.placements) == (8, 4)
