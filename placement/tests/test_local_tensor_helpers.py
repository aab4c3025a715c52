from __future__ import annotations

import pytest
import torch

from shardwise.placement import Shard, chunk_sizes, pad_dim, split_tensor, unpad_dim


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_split_tensor_gives_exactly_k_views_with_torch_chunk_sizes(dim: int) -> None:
    for dim_size in range(0, 10):
        shape = [3, 3]
        shape[dim] = dim_size
        full = torch.arange(3 * dim_size).reshape(shape)
        for num_chunks in range(1, 6):
            pieces = split_tensor(full, dim, num_chunks)
            assert len(pieces) == num_chunks
            assert tuple(p.size(dim) for p in pieces) == chunk_sizes(dim_size, num_chunks)
            assert torch.equal(torch.cat(pieces, dim), full)
            for piece, reference in zip(pieces, torch.chunk(full, num_chunks, dim)):
                assert torch.equal(piece, reference)
            for piece in pieces:
                if piece.numel():
                    assert piece.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()


def test_split_tensor_keeps_trailing_empty_pieces() -> None:
    pieces = split_tensor(torch.arange(5.0), 0, 4)
    assert [p.tolist() for p in pieces] == [[0.0, 1.0], [2.0, 3.0], [4.0], []]
    assert pieces[3].dtype == torch.float32


def test_split_tensor_errors() -> None:
    with pytest.raises(ValueError, match="num_chunks must be >= 1, got 0"):
        split_tensor(torch.ones(3), 0, 0)
    with pytest.raises(IndexError, match=r"dim=2 is out of range for a tensor with 2 dims; expected a dim in \[-2, 1\]"):
        split_tensor(torch.ones(3, 3), 2, 2)
    with pytest.raises(IndexError, match="0-dimensional"):
        split_tensor(torch.tensor(1.0), 0, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.bfloat16])
def test_pad_then_unpad_round_trips_and_pads_with_zeros(dtype: torch.dtype) -> None:
    original = torch.ones(2, 3, dtype=dtype)
    padded = pad_dim(original, 1, 5)
    assert padded.shape == (2, 5) and padded.dtype == dtype
    assert torch.equal(padded[:, :3], original)
    assert not padded[:, 3:].any()
    assert torch.equal(unpad_dim(padded, 1, 3), original)
    assert torch.equal(unpad_dim(pad_dim(original, -2, 4), -2, 2), original)


def test_pad_and_unpad_empty_shards() -> None:
    empty = torch.ones(0, 4)
    assert pad_dim(empty, 0, 2).tolist() == [[0.0] * 4] * 2
    assert unpad_dim(torch.ones(3, 4), 0, 0).shape == (0, 4)


def test_pad_and_unpad_return_input_when_already_that_size() -> None:
    tensor = torch.ones(2, 3)
    assert pad_dim(tensor, 0, 2) is tensor
    assert unpad_dim(tensor, 1, 3) is tensor


def test_pad_and_unpad_carry_gradients() -> None:
    source = torch.arange(3.0, requires_grad=True)
    (unpad_dim(pad_dim(source, 0, 5), 0, 3) * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert source.grad is not None and source.grad.tolist() == [1.0, 2.0, 3.0]


def test_pad_and_unpad_reject_wrong_sizes() -> None:
    with pytest.raises(ValueError, match=r"cannot pad dim 0 of a tensor of shape \(4, 2\) to 3: it already has 4"):
        pad_dim(torch.ones(4, 2), 0, 3)
    with pytest.raises(ValueError, match=r"cannot unpad dim 1 of a tensor of shape \(4, 2\) to 3: expected a size in \[0, 2\]"):
        unpad_dim(torch.ones(4, 2), 1, 3)
    with pytest.raises(ValueError, match="to -1"):
        unpad_dim(torch.ones(4, 2), 1, -1)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("size,chunks", [(16, 4), (17, 4), (7, 4), (3, 4), (8, 1), (8, 16)])
def test_select_split_tensor_is_one_piece_of_split_tensor(dim: int, size: int, chunks: int) -> None:
    tensor = torch.arange(size * 3).reshape((size, 3) if dim == 0 else (3, size))
    for with_padding in (False, True):
        pieces, _ = Shard(dim)._split_tensor(tensor, chunks, with_padding=with_padding)
        for index, piece in enumerate(pieces):
            selected = Shard(dim)._select_split_tensor(tensor, chunks, index, with_padding=with_padding)
            assert torch.equal(selected, piece)
            assert selected.data_ptr() != tensor.data_ptr() or selected.numel() == 0  # cloned by default
    view = Shard(dim)._select_split_tensor(tensor, chunks, 0, with_padding=False, contiguous=False, clone=False)
    assert view.numel() == 0 or view.data_ptr() == tensor.data_ptr()


def test_select_split_tensor_with_padding_needs_a_concrete_index() -> None:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

    tensor = torch.arange(40).reshape(10, 4)
    unbacked = ShapeEnv().create_unbacked_symint()
    # Padding needs the piece's concrete size: an index only known at run time cannot give it.
    with pytest.raises(GuardOnDataDependentSymNode):
        Shard(0)._select_split_tensor(tensor, 4, unbacked, with_padding=True)
