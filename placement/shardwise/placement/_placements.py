"""Placement types: how one mesh dimension lays out a tensor.

Placements sit inside cache keys on every dispatched op, so they precompute
their hash and compare with a handful of attribute reads.  They are immutable
(assignment raises) and pickle by value.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Final, NoReturn, Sequence

import torch

from ._simulated import any_per_rank_int, for_each_simulated_rank

__all__ = ["Placement", "Shard", "_StridedShard", "Replicate", "Partial", "SUPPORTED_REDUCE_OPS"]

SUPPORTED_REDUCE_OPS: Final[frozenset[str]] = frozenset({"sum", "avg", "max", "min", "product"})
# Other spellings PyTorch code uses for a supported op (c10d's ``ReduceOp.PRODUCT`` is "product").
_REDUCE_OP_ALIASES: Final[dict[str, str]] = {"prod": "product"}


def _as_tensor_dim(dim: object) -> int:
    """Accept int-like dims (numpy ints, SymInt-free index types); reject bools and everything else."""
    if not isinstance(dim, bool):
        try:
            return operator.index(dim)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise TypeError(f"Shard(dim=...) expects an int tensor dimension, got {type(dim).__name__} {dim!r}")


class Placement:
    """Base of all placements.  Subclasses answer the three questions below."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False

    def __fx_repr__(self) -> tuple[str, dict[str, Any]]:
        """Source text that rebuilds this placement, and the globals it names (torch.compile's FX codegen).

        Built from ``__reduce__`` (every placement pickles by value), so a placement baked into a
        compiled graph as a constant is printed as the call that recreates it.
        """
        reduced: Any = self.__reduce__()
        rebuild, args = reduced
        name = rebuild.__name__
        return f"{name}{args!r}", {name: rebuild}

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(
            f"{type(self).__name__} is immutable; cannot set attribute {name!r}. "
            "Create a new placement instead."
        )

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"{type(self).__name__} is immutable; cannot delete attribute {name!r}.")


class Shard(Placement):
    """Split tensor dim ``dim`` into ``mesh.size(mesh_dim)`` torch.chunk-style pieces.

    ``dim`` may be negative; a :class:`DTensorSpec` stores it normalised once the
    tensor's number of dims is known.
    """

    __slots__ = ("dim", "_hash")
    dim: int
    _hash: int

    def __init__(self, dim: int) -> None:
        if type(dim) is not int:
            dim = _as_tensor_dim(dim)
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "_hash", hash((Shard, dim)))

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or self.dim == dim

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not Shard:
            return NotImplemented if not isinstance(other, Placement) else False
        return self.dim == other.dim

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (Shard, (self.dim,))

    # PyTorch's private helpers that its tests call on a placement (torch.chunk layout, pure).

    @staticmethod
    def local_shard_size_and_offset(curr_local_size: int, num_chunks: int, rank: int) -> tuple[int, int]:
        """Size and offset of piece ``rank`` when ``curr_local_size`` is cut into ``num_chunks`` torch.chunk pieces.

        A per-rank ``rank`` (LocalTensorMode's ``LocalIntNode`` SymInt) gives every simulated rank's answer.
        """
        if any_per_rank_int((curr_local_size, num_chunks, rank)):
            size, offset = for_each_simulated_rank(_piece_size_and_offset, curr_local_size, num_chunks, rank)
            return size, offset  # type: ignore[return-value]
        return _piece_size_and_offset(curr_local_size, num_chunks, rank)

    def _local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int, rank: int) -> tuple[int, int]:
        return Shard.local_shard_size_and_offset(curr_local_size, num_chunks, rank)

    def _to_replicate_tensor(
        self, local_tensor: torch.Tensor, mesh: Any, mesh_dim: int, current_logical_shape: list[int]
    ) -> torch.Tensor:
        """Gather every rank's piece along ``mesh_dim`` back into the ``current_logical_shape`` extent (a collective)."""
        return _gather_along_mesh_dim(self, local_tensor, mesh, mesh_dim, current_logical_shape)

    def _split_tensor(
        self, tensor: torch.Tensor, num_chunks: int, *, with_padding: bool = True, contiguous: bool = True
    ) -> tuple[list[torch.Tensor], list[int]]:
        """``num_chunks`` torch.chunk pieces of ``tensor`` along ``self.dim`` (trailing ones maybe empty).

        ``with_padding``: each piece is zero-padded to the largest piece's size and the pad sizes
        are returned (otherwise an empty list), as collectives need equal pieces.
        """
        dim = self.dim + tensor.ndim if self.dim < 0 else self.dim
        if not 0 <= dim < tensor.ndim:
            raise AssertionError(f"Sharding dim {self.dim} out of range for a tensor with {tensor.ndim} dims")
        dim_size = tensor.size(dim)
        full_chunk = -(-dim_size // num_chunks)
        pieces: list[torch.Tensor] = []
        pad_sizes: list[int] = []
        for index in range(num_chunks):
            size, offset = Shard.local_shard_size_and_offset(dim_size, num_chunks, index)
            piece = tensor.narrow(dim, offset, size)
            if with_padding:
                pad_size = full_chunk - size
                pad_sizes.append(pad_size)
                if pad_size:
                    widths = [0, 0] * (tensor.ndim - 1 - dim) + [0, pad_size]
                    piece = torch.nn.functional.pad(piece, widths)
            pieces.append(piece.contiguous() if contiguous else piece)
        return pieces, pad_sizes

    def _select_split_tensor(
        self,
        tensor: torch.Tensor,
        num_chunks: int,
        index: Any,
        *,
        with_padding: bool = True,
        contiguous: bool = True,
        clone: bool = True,
    ) -> torch.Tensor:
        """Piece ``index`` of :meth:`_split_tensor`'s ``num_chunks`` pieces, without making the others.

        ``index`` may be a SymInt (a rank read while tracing): the piece is then narrowed out with
        symbolic bounds. Padding needs the piece's concrete size, so a symbolic ``index`` with
        ``with_padding`` guards on it (an unbacked one raises torch's data-dependent guard error).
        ``clone`` copies the piece; otherwise ``contiguous`` makes it contiguous.
        """
        if isinstance(index, int) or with_padding:
            pieces, _ = self._split_tensor(tensor, num_chunks, with_padding=with_padding, contiguous=False)
            piece = pieces[index]
        else:
            dim = self.dim + tensor.ndim if self.dim < 0 else self.dim
            if not 0 <= dim < tensor.ndim:
                raise AssertionError(f"Sharding dim {self.dim} out of range for a tensor with {tensor.ndim} dims")
            dim_size = tensor.size(dim)
            full_chunk = -(-dim_size // num_chunks)
            # torch.chunk's layout: full pieces first, then what is left, then empty ones.
            start = torch.sym_min(full_chunk * index, dim_size)
            piece = tensor.narrow(dim, start, torch.sym_min(full_chunk, dim_size - start))
        if clone:
            return piece.clone()
        return piece.contiguous() if contiguous else piece


class _StridedShard(Placement):
    """Shard tensor dim ``dim`` along a mesh dim as if ``split_factor`` pieces had been cut first.

    FSDP on top of tensor parallelism shards a parameter right to left: TP cuts dim 0
    into ``tp`` pieces, then FSDP cuts each rank's TP piece into ``dp`` pieces.  With the
    mesh ordered ``(dp, tp)`` and placements read left to right, that layout is
    ``(_StridedShard(0, split_factor=tp), Shard(0))``: on its mesh dim, a
    ``_StridedShard`` cuts the current extent into ``split_factor`` torch.chunk pieces,
    cuts each of those into ``mesh size`` torch.chunk pieces, and rank ``i`` holds the
    ``i``-th piece of every one of them, concatenated in order.  So its local piece is
    in general not one contiguous range of the global tensor;
    :func:`~shardwise.placement.local_index_runs` lists the ranges exactly.

    Same meaning, names, repr (``_StridedShard(dim=0, sf=2)``), str (``_S(0, 2)``) and
    equality as PyTorch's ``torch.distributed.tensor.placement_types._StridedShard``,
    which (in 2.13) is not a ``Shard``: ``is_shard()`` is False and it never equals a
    ``Shard``.  ``split_factor=1`` has the layout of ``Shard(dim)`` but is still a
    different placement, as in PyTorch.
    """

    __slots__ = ("dim", "split_factor", "_hash")
    dim: int
    split_factor: int
    _hash: int

    def __init__(self, dim: int, *, split_factor: int = 1, sf: int | None = None) -> None:
        if sf is not None:
            if split_factor != 1:
                raise TypeError(
                    f"_StridedShard got both split_factor={split_factor!r} and sf={sf!r}; expected only one of them"
                )
            split_factor = sf
        if type(dim) is not int:
            dim = _as_tensor_dim(dim)
        if isinstance(split_factor, bool) or not isinstance(split_factor, int):
            try:
                split_factor = operator.index(split_factor)
            except TypeError:
                raise TypeError(
                    f"_StridedShard(split_factor=...) expects an int >= 1, got "
                    f"{type(split_factor).__name__} {split_factor!r}"
                ) from None
        if split_factor < 1:
            raise ValueError(f"_StridedShard(split_factor={split_factor}) must be >= 1 (the pieces cut before it)")
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "split_factor", int(split_factor))
        object.__setattr__(self, "_hash", hash((_StridedShard, dim, int(split_factor))))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not _StridedShard:
            return NotImplemented if not isinstance(other, Placement) else False
        return self.dim == other.dim and self.split_factor == other.split_factor

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"_StridedShard(dim={self.dim}, sf={self.split_factor})"

    def __str__(self) -> str:
        return f"_S({self.dim}, {self.split_factor})"

    def __reduce__(self) -> tuple[Any, tuple[int, int, int | None]]:
        return (_make_strided_shard, (self.dim, self.split_factor, None))

    def _split_tensor(
        self, tensor: torch.Tensor, num_chunks: int, *, with_padding: bool = True, contiguous: bool = True
    ) -> tuple[list[torch.Tensor], list[int]]:
        """Each of the ``num_chunks`` ranks' pieces of ``tensor`` along ``self.dim`` (see the class docstring).

        ``with_padding``: each piece is zero-padded to the largest piece's size and the pad sizes
        returned (otherwise an empty list).
        """
        dim = self.dim + tensor.ndim if self.dim < 0 else self.dim
        if not 0 <= dim < tensor.ndim:
            raise AssertionError(f"Sharding dim {self.dim} out of range for a tensor with {tensor.ndim} dims")
        outer_pieces, _ = Shard(dim)._split_tensor(tensor, self.split_factor, with_padding=False, contiguous=False)
        per_rank: list[list[torch.Tensor]] = [[] for _ in range(num_chunks)]
        for outer in outer_pieces:
            inner, _ = Shard(dim)._split_tensor(outer, num_chunks, with_padding=False, contiguous=False)
            for rank, piece in enumerate(inner):
                per_rank[rank].append(piece)
        pieces = [torch.cat(parts, dim) for parts in per_rank]
        pad_sizes: list[int] = []
        if with_padding:
            largest = max(piece.size(dim) for piece in pieces)
            padded = []
            for piece in pieces:
                pad_size = largest - piece.size(dim)
                pad_sizes.append(pad_size)
                if pad_size:
                    piece = torch.nn.functional.pad(piece, [0, 0] * (tensor.ndim - 1 - dim) + [0, pad_size])
                padded.append(piece)
            pieces = padded
        return [piece.contiguous() if contiguous else piece for piece in pieces], pad_sizes

    def _to_replicate_tensor(
        self, local_tensor: torch.Tensor, mesh: Any, mesh_dim: int, current_logical_shape: list[int]
    ) -> torch.Tensor:
        """Gather every rank's piece along ``mesh_dim`` back into the ``current_logical_shape`` extent (a collective)."""
        return _gather_along_mesh_dim(self, local_tensor, mesh, mesh_dim, current_logical_shape)


# Placements are pure layout: the one collective their PyTorch-style helpers need is installed by
# shardwise.dtensor_ops when it is imported (see install_mesh_dim_gather).
_MeshDimGather = Callable[[Placement, torch.Tensor, Any, int, Sequence[int]], torch.Tensor]
_mesh_dim_gather: list[_MeshDimGather] = []


def install_mesh_dim_gather(gather: _MeshDimGather) -> None:
    """Give placements the collective behind ``_to_replicate_tensor`` (called by shardwise.dtensor_ops)."""
    _mesh_dim_gather[:] = [gather]


def _gather_along_mesh_dim(
    placement: Placement, local: torch.Tensor, mesh: Any, mesh_dim: int, logical_shape: Sequence[int]
) -> torch.Tensor:
    if not _mesh_dim_gather:
        raise RuntimeError(
            f"{placement}._to_replicate_tensor needs a collective; import shardwise.dtensor_ops, which provides it"
        )
    return _mesh_dim_gather[0](placement, local, mesh, mesh_dim, logical_shape)


def _make_strided_shard(dim: int, split_factor: int, _unused: int | None) -> _StridedShard:
    # Pickling needs a positional constructor; _StridedShard's split_factor is keyword-only.
    return _StridedShard(dim, split_factor=split_factor)


class Replicate(Placement):
    """Every rank along the mesh dim holds the full extent of the tensor."""

    __slots__ = ()

    _HASH: Final[int] = hash("shardwise.placement.Replicate")

    def is_replicate(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        if type(other) is Replicate:
            return True
        return NotImplemented if not isinstance(other, Placement) else False

    def __hash__(self) -> int:
        return Replicate._HASH

    def __repr__(self) -> str:
        return "Replicate()"

    def __str__(self) -> str:
        return "R"

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (Replicate, ())


class Partial(Placement):
    """Each rank along the mesh dim holds a partial value; the true value is their reduction.

    ``reduce_op`` is one of ``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"`` (``"prod"`` is
    read as ``"product"``).
    """

    __slots__ = ("reduce_op", "_hash")
    reduce_op: str
    _hash: int

    def __init__(self, reduce_op: str = "sum") -> None:
        if isinstance(reduce_op, str):
            reduce_op = _REDUCE_OP_ALIASES.get(reduce_op, reduce_op)
        if not isinstance(reduce_op, str) or reduce_op not in SUPPORTED_REDUCE_OPS:
            raise ValueError(
                f"Partial(reduce_op={reduce_op!r}) is not supported; expected one of "
                f"{sorted(SUPPORTED_REDUCE_OPS)}"
            )
        object.__setattr__(self, "reduce_op", reduce_op)
        object.__setattr__(self, "_hash", hash((Partial, reduce_op)))

    def is_partial(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not Partial:
            return NotImplemented if not isinstance(other, Placement) else False
        return self.reduce_op == other.reduce_op

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"  # PyTorch's repr: messages and tests match on it

    def __str__(self) -> str:
        return f"P({self.reduce_op})"

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (Partial, (self.reduce_op,))


def holds_same_values(held: Placement, wanted: Placement) -> bool:
    """Whether a tensor laid out as ``held`` on a mesh dim already is laid out as ``wanted`` there.

    Equal placements, or Partials of one reduce op: the subclasses that carry extra bookkeeping
    (``_MaskPartial``'s masked rows, ...) hold pending reductions of the same values, so moving
    between them is a relabel, not a collective.
    """
    return held == wanted or (isinstance(held, Partial) and isinstance(wanted, Partial) and held.reduce_op == wanted.reduce_op)


def _piece_size_and_offset(curr_local_size: int, num_chunks: int, rank: int) -> tuple[int, int]:
    full_chunk = -(-curr_local_size // num_chunks)
    offset = min(rank * full_chunk, curr_local_size)
    return max(0, min(full_chunk, curr_local_size - offset)), offset
