"""Global output metadata (shape, stride, dtype) by shape rules, without meta tensors.

Running an op on meta tensors gives exact metadata, but many aten ops reach
meta through Python decompositions (hundreds of microseconds per call, and the
first one imports torch._dynamo, seconds).  For the common, unambiguous cases
the families compute the metadata directly here:

* the shape from the op's shape rule (broadcasting, matrix product, reduction,
  view, ...);
* the stride as contiguous, and only when that is certain (the inputs are
  contiguous), else ``None``;
* the dtype by running the op on *empty* CPU tensors with the inputs' dtypes and
  numbers of dims (so type promotion, comparison -> bool, int -> float are the
  op's own; no element is computed).

Every function returns ``None`` when it is not sure (non-contiguous input,
shapes that do not fit, an exception): propagation then runs the op on meta
tensors, which also produces PyTorch's own error message for bad calls.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import torch

from shardwise.placement import DTensorSpec, TensorMeta, contiguous_strides

__all__ = [
    "broadcast_shapes",
    "all_row_major",
    "contiguous_meta",
    "contiguous_strides",
    "dtype_on_empty_tensors",
    "has_row_major_layout",
    "input_meta",
    "is_contiguous",
    "resolve_view_size",
    "same_as_input_meta",
]

# (op, args, kwargs without out=) -> metadata of the single output, or of each output (a tuple, None for a
# non-tensor one) for ops returning several; None to fall back to meta tensors.


def is_contiguous(meta: TensorMeta) -> bool:
    """Whether the strides are exactly the row-major ones (stricter than Tensor.is_contiguous() on size-1 dims)."""
    return tuple(meta.stride) == contiguous_strides(meta.shape)


def _empty_like_input(value: object) -> object:
    if isinstance(value, DTensorSpec):
        meta = value.tensor_meta
        assert meta is not None
        return torch.empty((0,) * len(meta.shape), dtype=meta.dtype)
    if isinstance(value, torch.Tensor):
        return torch.empty((0,) * value.dim(), dtype=value.dtype)
    if isinstance(value, list):
        return [_empty_like_input(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_empty_like_input(item) for item in value)
    return value


def dtype_on_empty_tensors(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> torch.dtype | None:
    """The dtype ``op`` gives for these input dtypes, from a run on element-free CPU tensors."""
    try:
        result = op(*[_empty_like_input(arg) for arg in args], **{k: _empty_like_input(v) for k, v in kwargs.items()})
    except Exception:  # noqa: BLE001 - any failure means "not sure": the meta run reports the real error
        return None
    return result.dtype if isinstance(result, torch.Tensor) else None


def input_meta(value: object) -> TensorMeta | None:
    if isinstance(value, DTensorSpec):
        return value.tensor_meta
    return None


def same_as_input_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    """Output metadata of ops returning a tensor just like argument 0 (detach, alias, in-place fills)."""
    return input_meta(args[0]) if args else None


def contiguous_meta(shape: Sequence[int], dtype: torch.dtype) -> TensorMeta:
    return TensorMeta(torch.Size(shape), contiguous_strides(shape), dtype)


def has_row_major_layout(meta: TensorMeta) -> bool:
    """Whether ops that lay out their result like their inputs give a row-major (contiguous) result for it.

    True for exactly contiguous tensors, and for tensors without size-1 dims whose
    strides, ignoring broadcast (stride 0) dims, strictly decrease: expanded and
    sliced row-major tensors.  (With size-1 dims or any other order torch may keep
    the input's own strides; the caller then asks meta tensors.)
    """
    if is_contiguous(meta):
        return True
    if 1 in meta.shape:
        return False
    strides = [stride for stride in meta.stride if stride != 0]
    return all(outer > inner for outer, inner in zip(strides, strides[1:]))


def all_row_major(values: Sequence[object]) -> bool:
    """:func:`has_row_major_layout` for every DTensor among ``values`` (other values are ignored)."""
    for value in values:
        meta = input_meta(value)
        if meta is not None and not has_row_major_layout(meta):
            return False
    return True


def resolve_view_size(size: Sequence[int], numel: int) -> tuple[int, ...] | None:
    """``size`` with its one ``-1`` inferred from ``numel``; None if it cannot hold ``numel`` elements."""
    sizes = [int(extent) for extent in size]
    unknown = [index for index, extent in enumerate(sizes) if extent == -1]
    if len(unknown) > 1 or any(extent < -1 for extent in sizes):
        return None
    known = math.prod(extent for extent in sizes if extent != -1)
    if unknown:
        if known == 0 or numel % known != 0:
            return None
        sizes[unknown[0]] = numel // known
    elif known != numel:
        return None
    return tuple(sizes)


def broadcast_shapes(*shapes: Sequence[int]) -> torch.Size | None:
    """NumPy-style broadcast of ``shapes``; None when they do not broadcast.

    Written out because ``torch.broadcast_shapes`` imports sympy on first use.
    """
    ndim = max((len(shape) for shape in shapes), default=0)
    result = [1] * ndim
    for shape in shapes:
        offset = ndim - len(shape)
        for dim, size in enumerate(shape):
            current = result[offset + dim]
            if size == current or size == 1:
                continue
            if current == 1:
                result[offset + dim] = size
            else:
                return None
    return torch.Size(result)
