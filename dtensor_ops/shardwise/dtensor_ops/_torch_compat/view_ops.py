"""PyTorch's dim-map vocabulary for view ops (``torch.distributed.tensor._ops._view_ops``).

A *dim map* says, for each output dim of a view-like op, where it comes from in the input:
``InputDim(i)`` (input dim ``i`` as it is), ``Flatten(dims)`` (several input dims merged),
``Split(dim, group_shape, split_id)`` (piece ``split_id`` of a dim cut into ``group_shape``),
``Singleton()`` (a new size-1 dim), ``Broadcast(dim, size)`` (a size-1 dim expanded),
``NewDim(size)`` (a new dim), ``Repeat(dim, times)``. ``dim_maps`` gives the dim map of the
torch functions PyTorch's tests look up, ``view_groups(from_size, to_size)`` that of a
reshape. shardwise's own view rules (``_ops/reshaping.py``) decide shardings from
``view_dim_groups``; ``view_groups`` is built on the same grouping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor

from shardwise.placement import normalize_dim

from .._ops.reshaping import view_dim_groups

__all__ = [
    "Broadcast",
    "DimMap",
    "DimSpec",
    "Flatten",
    "InputDim",
    "NewDim",
    "Repeat",
    "Singleton",
    "Split",
    "dim_maps",
    "infer_size",
    "view_groups",
]

Shape = tuple[int, ...]


class DimSpec:
    """Where one output dim of a view comes from."""

    def inputs(self) -> Iterable[DimSpec]:
        return ()


DimMap = tuple[DimSpec, ...]


@dataclass
class Singleton(DimSpec):
    """A size-1 output dim that no input dim feeds."""


@dataclass
class InputDim(DimSpec):
    """Input dim ``input_dim``, unchanged."""

    input_dim: int

    def __eq__(self, other: object) -> bool:
        if isinstance(other, InputDim):
            return self.input_dim == other.input_dim
        if not isinstance(other, DimSpec):
            # `shard.dim == InputDim(0)` is a bug (`.input_dim` was meant): say so.
            raise TypeError(f"Cannot compare InputDim with {type(other).__name__}. Did you mean to use .input_dim?")
        return NotImplemented

    def __hash__(self) -> int:
        return hash((InputDim, self.input_dim))


@dataclass
class Broadcast(DimSpec):
    """A size-1 dim ``dim`` expanded to ``dim_size``."""

    dim: DimSpec
    dim_size: int

    @classmethod
    def new(cls, dim: DimSpec, dim_size: int) -> DimSpec:
        return Broadcast(dim, dim_size)

    def inputs(self) -> Iterable[DimSpec]:
        return (self.dim,)


@dataclass
class NewDim(DimSpec):
    """A dim of ``size`` the op creates."""

    size: int

    @classmethod
    def new(cls, size: int) -> DimSpec:
        return Singleton() if size == 1 else NewDim(size)


@dataclass
class Repeat(DimSpec):
    """Dim ``input_dim`` repeated ``times`` times."""

    input_dim: DimSpec
    times: int

    @classmethod
    def new(cls, dim: DimSpec, times: int) -> DimSpec:
        if times == 1:
            return dim
        if isinstance(dim, Singleton):
            return Broadcast(dim, times)  # repeating a size-1 dim is broadcasting it
        return Repeat(dim, times)

    def inputs(self) -> Iterable[DimSpec]:
        return (self.input_dim,)


@dataclass
class Flatten(DimSpec):
    """Several input dims merged into one, row-major."""

    input_dims: Sequence[DimSpec]

    @classmethod
    def new(cls, dims: Sequence[DimSpec]) -> DimSpec:
        if not dims:
            return Singleton()
        if len(dims) == 1:
            return dims[0]
        return Flatten(dims)

    def inputs(self) -> Iterable[DimSpec]:
        return self.input_dims


@dataclass
class Split(DimSpec):
    """Piece ``split_id`` of ``input_dim`` cut row-major into ``group_shape``."""

    input_dim: DimSpec
    group_shape: Shape
    split_id: int

    @classmethod
    def new(cls, dim: DimSpec, group_shape: tuple[int, ...], idx: int) -> DimSpec:
        if not group_shape:
            raise AssertionError("Split.new needs a non-empty group_shape")
        if len(group_shape) == 1:
            if idx != 0:
                raise AssertionError(f"Split.new of a one-dim group takes idx 0, got {idx}")
            return dim
        if group_shape[idx] == 1:
            return Singleton()
        # Size-1 pieces carry nothing: the split is over the others, re-indexed.
        kept = [position for position, size in enumerate(group_shape) if size != 1]
        return Split(dim, tuple(group_shape[position] for position in kept), kept.index(idx))

    def inputs(self) -> Iterable[DimSpec]:
        return (self.input_dim,)


def _sizes(sizes: Sequence[Any]) -> Shape:
    """``view(2, 3)`` and ``view((2, 3))`` alike."""
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        return tuple(int(size) for size in sizes[0])
    return tuple(int(size) for size in sizes)


def infer_size(total_size: int, sizes: Sequence[int]) -> Shape:
    """``sizes`` with its one ``-1`` (if any) replaced by what makes ``total_size`` elements.

    As PyTorch's: more than one ``-1`` is an ``AssertionError``; a ``-1`` that cannot be a whole
    number, or sizes without ``-1`` whose product is not ``total_size``, a ``RuntimeError``.
    """
    shape = tuple(sizes)
    inferred = [position for position, size in enumerate(shape) if size == -1]
    if len(inferred) > 1:
        raise AssertionError(f"can only infer one size: view shape {shape} has {len(inferred)} dims of -1")
    known = math.prod(size for size in shape if size != -1)
    if inferred:
        if known == 0 or total_size % known != 0:
            raise RuntimeError(
                f"size inferred for -1 is not integral {shape} should have {total_size} elements."
            )
        return tuple(total_size // known if size == -1 else size for size in shape)
    if known != total_size:
        raise RuntimeError(f"sizes do not match {total_size} vs {known}: view shape {shape}")
    return shape


# Stands for a size-0 dim when grouping the dims of an empty reshape: a prime no real size shares a factor with.
_ZERO_STAND_IN = 2**61 - 1


def _with_zero_sizes(spec: DimSpec) -> DimSpec:
    """``spec`` with the stand-in size written back as 0 (view maps hold sizes only in ``Split``)."""
    if isinstance(spec, Split):
        shape = tuple(0 if size == _ZERO_STAND_IN else size for size in spec.group_shape)
        return Split(_with_zero_sizes(spec.input_dim), shape, spec.split_id)
    return spec


def _empty_view_groups(source: Shape, target: Shape) -> DimMap:
    """The dim map of a reshape between shapes holding no element, where products say nothing.

    Each size-0 dim stands for one and the same large prime on both sides, so the dims group as they
    would for a non-empty tensor of those sizes (``(0, 4) -> (0, 2, 2)`` as ``(3, 4) -> (3, 2, 2)``:
    a rank holding an empty shard gets the map the other ranks get). Where that does not make the two
    shapes the same size, the whole input is flattened and split into the target, which describes any
    reshape.
    """
    stand_in_source = tuple(_ZERO_STAND_IN if size == 0 else size for size in source)
    stand_in_target = tuple(_ZERO_STAND_IN if size == 0 else size for size in target)
    if math.prod(stand_in_source) == math.prod(stand_in_target):
        return tuple(_with_zero_sizes(spec) for spec in view_groups(stand_in_source, stand_in_target))
    whole = Flatten.new(tuple(InputDim(dim) for dim in range(len(source))))
    return tuple(Split.new(whole, target, index) for index in range(len(target)))


def view_groups(from_size: Sequence[int], to_size: Sequence[int]) -> DimMap:
    """The dim map of viewing a tensor of shape ``from_size`` as ``to_size`` (``-1`` allowed)."""
    source = tuple(int(size) for size in from_size)
    numel = math.prod(source)
    target = infer_size(numel, _sizes(tuple(to_size)))
    groups = view_dim_groups(source, target)
    if groups is None:
        # No element: sizes cannot say which dims correspond (a rank holding an empty shard asks too).
        return _empty_view_groups(source, target)
    result: list[DimSpec] = []
    for in_dims, out_dims in groups:
        if not out_dims:
            continue  # a size-1 input dim that disappears
        merged = Flatten.new(tuple(InputDim(dim) for dim in in_dims))
        group_shape = tuple(target[dim] for dim in out_dims)
        result.extend(Split.new(merged, group_shape, index) for index in range(len(out_dims)))
    return tuple(result)


def _pad_left(ndim: int, min_dims: int) -> DimMap:
    return (Singleton(),) * max(0, min_dims - ndim) + tuple(InputDim(dim) for dim in range(ndim))


def _atleast_3d(ndim: int) -> DimMap:
    if ndim == 0:
        return (Singleton(), Singleton(), Singleton())
    if ndim == 1:
        return (Singleton(), InputDim(0), Singleton())
    if ndim == 2:
        return (InputDim(0), InputDim(1), Singleton())
    return tuple(InputDim(dim) for dim in range(ndim))


def _expand(input_shape: Sequence[int], shape: Sequence[int]) -> DimMap:
    if len(shape) < len(input_shape):
        raise AssertionError(f"cannot expand shape {tuple(input_shape)} to fewer dims {tuple(shape)}")
    leading = len(shape) - len(input_shape)
    result: list[DimSpec] = []
    for out_dim, size in enumerate(shape):
        in_dim = out_dim - leading
        if in_dim < 0:
            result.append(Broadcast.new(Singleton(), size) if size != 1 else Singleton())
            continue
        in_size = input_shape[in_dim]
        if size == -1 or size == in_size:
            result.append(InputDim(in_dim))
        elif in_size == 1:
            result.append(Broadcast.new(InputDim(in_dim), size))
        else:
            raise AssertionError(f"cannot expand dim {in_dim} of size {in_size} to {size}")
    return tuple(result)


def _flatten(ndim: int, start_dim: int = 0, end_dim: int = -1) -> DimMap:
    if ndim == 0:
        return (Singleton(),)
    if ndim == 1:
        return (InputDim(0),)
    start, end = normalize_dim(start_dim, ndim), normalize_dim(end_dim, ndim)
    merged = Flatten.new(tuple(InputDim(dim) for dim in range(start, end + 1)))
    return (
        tuple(InputDim(dim) for dim in range(start))
        + (merged,)
        + tuple(InputDim(dim) for dim in range(end + 1, ndim))
    )


def _as_dims(value: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    dims = (value,) if isinstance(value, int) else tuple(value)
    return tuple(normalize_dim(dim, ndim) for dim in dims)


def _movedim(ndim: int, source: int | Sequence[int], destination: int | Sequence[int]) -> DimMap:
    sources, destinations = _as_dims(source, ndim), _as_dims(destination, ndim)
    if len(sources) != len(destinations):
        raise AssertionError(f"movedim: {len(sources)} source dims but {len(destinations)} destination dims")
    order: list[int | None] = [None] * ndim
    for src, dst in zip(sources, destinations):
        order[dst] = src
    remaining = iter(dim for dim in range(ndim) if dim not in sources)
    return tuple(InputDim(next(remaining) if src is None else src) for src in order)


def _repeat(ndim: int, sizes: Sequence[int]) -> DimMap:
    repeats = _sizes(sizes)
    if len(repeats) < ndim:
        raise AssertionError(f"repeat takes at least {ndim} sizes for a {ndim}-d tensor, got {repeats}")
    leading = len(repeats) - ndim
    result: list[DimSpec] = [Repeat.new(Singleton(), times) for times in repeats[:leading]]
    result.extend(Repeat.new(InputDim(dim), times) for dim, times in enumerate(repeats[leading:]))
    return tuple(result)


def _tile(ndim: int, dims: Sequence[int]) -> DimMap:
    repeats = tuple(dims)
    if len(repeats) < ndim:
        repeats = (1,) * (ndim - len(repeats)) + repeats
    return _repeat(ndim, repeats)


def _transpose(ndim: int, dim0: int, dim1: int) -> DimMap:
    first, second = normalize_dim(dim0, ndim), normalize_dim(dim1, ndim)
    order = list(range(ndim))
    order[first], order[second] = order[second], order[first]
    return tuple(InputDim(dim) for dim in order)


def _squeeze(shape: Sequence[int], dim: int | Sequence[int] | None = None) -> DimMap:
    ndim = len(shape)
    squeezable = set(range(ndim)) if dim is None else set(_as_dims(dim, max(ndim, 1)))
    return tuple(InputDim(d) for d in range(ndim) if not (d in squeezable and shape[d] == 1))


def _unsqueeze(ndim: int, dim: int) -> DimMap:
    position = normalize_dim(dim, ndim + 1)
    dims: list[DimSpec] = [InputDim(d) for d in range(ndim)]
    dims.insert(position, Singleton())
    return tuple(dims)


def _view_as_real(shape: Sequence[int]) -> DimMap:
    ndim = len(shape)
    leading: list[DimSpec] = [InputDim(dim) for dim in range(ndim - 1)]
    last = InputDim(ndim - 1)
    # The complex last dim becomes (size, 2): its real and imaginary parts are a split of it.
    return tuple(leading) + (Split(last, (shape[-1], 2), 0), Split(last, (shape[-1], 2), 1))


def _permute(ndim: int, dims: Sequence[int]) -> DimMap:
    return tuple(InputDim(dim) for dim in _as_dims(tuple(dims), ndim))


DimMapFn = Callable[..., DimMap]

dim_maps: dict[Callable[..., Any], DimMapFn] = {
    torch.atleast_1d: lambda x: _pad_left(x.ndim, 1),
    torch.atleast_2d: lambda x: _pad_left(x.ndim, 2),
    torch.atleast_3d: lambda x: _atleast_3d(x.ndim),
    torch.broadcast_to: lambda input, shape: _expand(input.shape, shape),
    Tensor.expand: lambda self, *sizes: _expand(self.shape, _sizes(sizes)),
    torch.flatten: lambda tensor: _flatten(tensor.ndim),
    torch.movedim: lambda input, source, destination: _movedim(input.ndim, source, destination),
    torch.permute: lambda input, dims: _permute(input.ndim, dims),
    torch.ravel: lambda tensor: _flatten(tensor.ndim),
    Tensor.repeat: lambda self, *sizes: _repeat(self.ndim, sizes),
    torch.reshape: lambda input, shape: view_groups(input.shape, shape),
    torch.squeeze: lambda input, dim=None: _squeeze(input.shape, dim),
    torch.tile: lambda input, dims: _tile(input.ndim, dims),
    torch.transpose: lambda input, dim0, dim1: _transpose(input.ndim, dim0, dim1),
    torch.unsqueeze: lambda input, dim: _unsqueeze(input.ndim, dim),
    Tensor.view: lambda input, *shape: view_groups(input.shape, _sizes(shape)),
    torch.view_as_complex: lambda input: _flatten(input.ndim, input.ndim - 2),
    torch.view_as_real: lambda input: _view_as_real(input.shape),
}

