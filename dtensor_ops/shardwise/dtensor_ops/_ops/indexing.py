"""Indexing ops: select, slice (and narrow), their backwards and scatters, index_select / index_add,
gather / scatter / scatter_add, advanced indexing (``index.Tensor``, ``index_put``).

What every rule here relies on:

* A dim the op does not index keeps its shard: every rank applies the same
  indexing to its own rows (``x[:, 2]`` of a row-sharded ``x`` is row-sharded).
* The dim being sliced, selected or gathered from must be whole on every rank
  (the local tensor does not hold the global positions), except where the slice
  is the whole dim.  Such inputs are redistributed (all-gather, or an
  all-to-all to another dim when that moves fewer bytes).
* An index tensor may carry the shard instead: each rank then picks its own
  share of the positions from a replicated source, and the output is sharded
  like the index.
* Picking or overwriting elements keeps every Partial kind (the picked parts
  still reduce to the picked value); adding into a tensor (``index_add``,
  ``scatter_add``, ``index_put(accumulate=True)``) keeps the linear kinds; and
  adding with a *sharded* index gives ``Partial(sum)`` from a ``Partial(sum)``
  destination (each rank adds its share of the updates; a replicated
  destination, e.g. the zeros of a gradient, becomes partial locally).  That is
  what the backward of a lookup with a sharded index (``gather``,
  ``index_select``, ``x[idx]``) produces instead of gathering the gradient.

Boolean-mask indexing ``x[mask]`` has a result whose size depends on the mask's
values, which no rank knows alone: it is refused with an error suggesting
``masked_fill`` / ``torch.where``.  Writing a scalar through a mask
(``x[mask] = 0.0``) is supported: it is elementwise.

``masked_fill`` and ``where`` are pointwise (see :mod:`.pointwise`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import torch

from shardwise.placement import (
    DTensorSpec,
    Partial,
    Placement,
    Replicate,
    Shard,
    TensorMeta,
    _MaskPartial,
    normalize_dim,
)

from ._shapes import (
    contiguous_meta,
    input_meta,
    is_contiguous,
)
from .._call_schema import schema_facts
from .._rules import (
    ArgPosition,
    OneDimStrategy,
    OpCall,
    ShardingRule,
    aten_overloads,
    broadcast_input_placement,
    register_rule,
)

__all__ = [
    "ADVANCED_INDEX_RULE",
    "GATHER_RULE",
    "INDEX_ADD_RULE",
    "INDEX_PUT_RULE",
    "INDEX_SELECT_RULE",
    "SCATTER_RULE",
    "SELECT_BACKWARD_RULE",
    "SELECT_RULE",
    "SELECT_SCATTER_RULE",
    "SLICE_BACKWARD_RULE",
    "SLICE_RULE",
    "SLICE_SCATTER_RULE",
    "advanced_index_layout",
]

aten = torch.ops.aten

_MASK_DTYPES = (torch.bool, torch.uint8)


# --------------------------------------------------------------------------- helpers


def _arg(args: Sequence[object], kwargs: Mapping[str, object], index: int, name: str, default: object) -> object:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _dim_of(call: OpCall, index: int, name: str, ndim: int, default: object = None) -> int:
    dim = call.arg(index, name, default)
    assert isinstance(dim, int), f"{call.op}: {name} must be an int, got {dim!r}"
    return normalize_dim(dim, max(ndim, 1))


def _tensor_input(call: OpCall, position: int, name: str) -> int:
    """Rule input index of the tensor argument at ``position`` (or passed as ``name``)."""
    index = call.input_index_at(position)
    if index is None:
        index = call.input_index_at(name)
    if index is None:
        raise TypeError(f"{call.op}: argument {name!r} must be a tensor (a DTensor, or a scalar tensor)")
    return index


def _partials(count: int, kinds: Sequence[str]) -> list[OneDimStrategy]:
    """Every input and the output Partial of the same kind, for each kind in ``kinds``."""
    return [OneDimStrategy((Partial(kind),), (Partial(kind),) * count) for kind in kinds]


def _replicated(count: int) -> OneDimStrategy:
    return OneDimStrategy((Replicate(),), (Replicate(),) * count)


def _is_dense(meta: TensorMeta) -> bool:
    """No gaps and no overlaps (any dim order): what clone(preserve_format) copies stride for stride."""
    sized = sorted((stride, size) for size, stride in zip(meta.shape, meta.stride) if size != 1)
    expected = 1
    for stride, size in sized:
        if stride != expected:
            return False
        expected *= size
    return True


def _like_self_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    """Ops returning a copy of ``self`` written into (index_put, slice_scatter): dense strides are kept."""
    meta = input_meta(args[0]) if args else None
    if meta is None or schema_facts(op).out_names:
        return None  # out= variants: the meta run reports torch's own checks of the out tensor
    if schema_facts(op).writes_first_argument or is_contiguous(meta):
        return meta
    return meta if _is_dense(meta) else None


def _local_input_sizes_override(
    call: OpCall, output_specs: tuple[DTensorSpec[Any] | None, ...]
) -> tuple[tuple[ArgPosition, object], ...]:
    """slice_backward / select_backward build a zero tensor of ``input_sizes``: each rank builds its shard."""
    output = output_specs[0]
    assert output is not None
    if not output.is_sharded():
        return ()
    return ((1 if len(call.args) > 1 else "input_sizes", tuple(output.local_shape())),)


def _sizes_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    """A fresh contiguous tensor of ``input_sizes`` with the gradient's dtype."""
    grad = input_meta(args[0]) if args else None
    sizes = _arg(args, kwargs, 1, "input_sizes", None)
    if grad is None or not isinstance(sizes, (list, tuple)) or not all(isinstance(s, int) and s >= 0 for s in sizes):
        return None
    return contiguous_meta(sizes, grad.dtype)


# --------------------------------------------------------------------------- select


def _select_strategies(call: OpCall) -> list[OneDimStrategy]:
    ndim = len(call.input_shape(0))
    dim = _dim_of(call, 1, "dim", ndim)
    strategies = [
        OneDimStrategy((Shard(d if d < dim else d - 1),), (Shard(d),)) for d in range(ndim) if d != dim
    ]
    strategies.append(_replicated(1))
    strategies.extend(_partials(1, call.every_reduce_op()))
    return strategies


def _select_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    meta = input_meta(args[0]) if args else None
    dim = _arg(args, kwargs, 1, "dim", None)
    index = _arg(args, kwargs, 2, "index", None)
    if meta is None or not isinstance(dim, int) or not isinstance(index, int):
        return None
    ndim = len(meta.shape)
    if not -ndim <= dim < ndim:
        return None
    dim %= ndim
    if not -meta.shape[dim] <= index < meta.shape[dim]:
        return None  # the meta run raises torch's IndexError, before any collective
    kept = [d for d in range(ndim) if d != dim]
    return TensorMeta(torch.Size([meta.shape[d] for d in kept]), tuple(meta.stride[d] for d in kept), meta.dtype)


SELECT_RULE = ShardingRule(family="select", one_dim_strategies=_select_strategies, output_meta=_select_output_meta)


def _check_gradient_shape(op: torch._ops.OpOverload, grad: TensorMeta, expected: Sequence[int]) -> None:
    # Autograd always passes matching shapes; a direct call with others would fail only in the local op.
    if tuple(grad.shape) != tuple(expected):
        raise RuntimeError(
            f"{op}: the size of grad_output {list(grad.shape)} must match the size of the slice {list(expected)}"
        )


def _select_backward_strategies(call: OpCall) -> list[OneDimStrategy]:
    sizes = call.arg(1, "input_sizes")
    assert isinstance(sizes, (list, tuple))
    dim = _dim_of(call, 2, "dim", len(sizes))
    _check_gradient_shape(call.op, call.input_meta(0), [size for d, size in enumerate(sizes) if d != dim])
    grad_ndim = len(call.input_shape(0))
    strategies = [OneDimStrategy((Shard(d if d < dim else d + 1),), (Shard(d),)) for d in range(grad_ndim)]
    strategies.append(_replicated(1))
    # Zeros everywhere but the selected slice reduce to zeros under every kind.
    strategies.extend(_partials(1, call.every_reduce_op()))
    return strategies


SELECT_BACKWARD_RULE = ShardingRule(
    family="select_backward",
    one_dim_strategies=_select_backward_strategies,
    local_arg_overrides=_local_input_sizes_override,
    output_meta=_sizes_meta,
)


# --------------------------------------------------------------------------- slice


class SliceBounds(NamedTuple):
    start: int
    end: int
    step: int

    @property
    def length(self) -> int:
        return max(0, (self.end - self.start + self.step - 1) // self.step)


def slice_bounds(size: int, start: object, end: object, step: object) -> SliceBounds | None:
    """torch's clamping of ``x[start:end:step]`` on a dim of ``size``; None for a bad step or argument."""
    if step is None:
        step = 1
    if not isinstance(step, int) or step <= 0:
        return None
    if start is None:
        start = 0
    if end is None:
        end = size
    if not isinstance(start, int) or not isinstance(end, int):
        return None
    if start < 0:
        start += size
    if end < 0:
        end += size
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return SliceBounds(start, end, step)


def _slice_is_whole(size: int, bounds: SliceBounds) -> bool:
    # The same arguments on any shard then also take that whole shard (clamping works the same way).
    return bounds.start == 0 and bounds.end == size and bounds.step == 1


def _slice_args(call: OpCall, first: int) -> tuple[object, object, object]:
    return call.arg(first, "start"), call.arg(first + 1, "end"), call.arg(first + 2, "step", 1)


def _slice_strategies(call: OpCall) -> list[OneDimStrategy]:
    shape = call.input_shape(0)
    dim = _dim_of(call, 1, "dim", len(shape), 0)
    bounds = slice_bounds(shape[dim], *_slice_args(call, 2))
    assert bounds is not None, "the output metadata check rejects a bad slice first"
    strategies = [
        OneDimStrategy((Shard(d),), (Shard(d),))
        for d in range(len(shape))
        if d != dim or _slice_is_whole(shape[d], bounds)
    ]
    strategies.append(_replicated(1))
    strategies.extend(_partials(1, call.every_reduce_op()))
    return strategies


def _slice_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    meta = input_meta(args[0]) if args else None
    dim = _arg(args, kwargs, 1, "dim", 0)
    if meta is None or not isinstance(dim, int) or not meta.shape:
        return None
    ndim = len(meta.shape)
    if not -ndim <= dim < ndim:
        return None
    dim %= ndim
    bounds = slice_bounds(
        meta.shape[dim],
        _arg(args, kwargs, 2, "start", None),
        _arg(args, kwargs, 3, "end", None),
        _arg(args, kwargs, 4, "step", 1),
    )
    if bounds is None:
        return None
    shape, stride = list(meta.shape), list(meta.stride)
    shape[dim] = bounds.length
    stride[dim] *= bounds.step
    return TensorMeta(torch.Size(shape), tuple(stride), meta.dtype)


SLICE_RULE = ShardingRule(family="slice", one_dim_strategies=_slice_strategies, output_meta=_slice_output_meta)


def _check_slice_backward(call: OpCall, sizes: Sequence[int], dim: int, bounds: SliceBounds | None) -> None:
    if bounds is None:
        raise ValueError(f"{call.op}: the slice step must be a positive int, got {call.arg(5, 'step')!r}")
    expected = list(sizes)
    expected[dim] = bounds.length
    _check_gradient_shape(call.op, call.input_meta(0), expected)


def _slice_backward_strategies(call: OpCall) -> list[OneDimStrategy]:
    sizes = call.arg(1, "input_sizes")
    assert isinstance(sizes, (list, tuple))
    dim = _dim_of(call, 2, "dim", len(sizes))
    bounds = slice_bounds(sizes[dim], *_slice_args(call, 3))
    _check_slice_backward(call, sizes, dim, bounds)
    whole = bounds is not None and _slice_is_whole(sizes[dim], bounds)
    strategies = [
        OneDimStrategy((Shard(d),), (Shard(d),)) for d in range(len(sizes)) if d != dim or whole
    ]
    strategies.append(_replicated(1))
    strategies.extend(_partials(1, call.every_reduce_op()))
    return strategies


SLICE_BACKWARD_RULE = ShardingRule(
    family="slice_backward",
    one_dim_strategies=_slice_backward_strategies,
    local_arg_overrides=_local_input_sizes_override,
    output_meta=_sizes_meta,
)


def _slice_scatter_strategies(call: OpCall) -> list[OneDimStrategy]:
    shape = call.input_shape(0)
    dim = _dim_of(call, 2, "dim", len(shape), 0)
    bounds = slice_bounds(shape[dim], *_slice_args(call, 3))
    if bounds is None:
        raise ValueError(f"{call.op}: the slice step must be a positive int, got {call.arg(5, 'step')!r}")
    expected = list(shape)
    expected[dim] = bounds.length
    _check_scatter_source(call.input_meta(_tensor_input(call, 1, "src")), expected)
    whole = _slice_is_whole(shape[dim], bounds)
    count = len(call.input_specs)
    strategies = [
        OneDimStrategy((Shard(d),), (Shard(d),) * count) for d in range(len(shape)) if d != dim or whole
    ]
    strategies.append(_replicated(count))
    strategies.extend(_partials(count, call.every_reduce_op()))
    return strategies


def _check_scatter_source(source: TensorMeta, expected: Sequence[int]) -> None:
    # Meta tensors do not check it; the local op would, after the inputs were redistributed.
    if tuple(source.shape) != tuple(expected):
        raise RuntimeError(
            "expected src to have a size equal to the slice of self. "
            f"src size = {list(source.shape)}, slice size = {list(expected)}"
        )


SLICE_SCATTER_RULE = ShardingRule(
    family="slice_scatter", one_dim_strategies=_slice_scatter_strategies, output_meta=_like_self_meta
)


def _select_scatter_strategies(call: OpCall) -> list[OneDimStrategy]:
    shape = call.input_shape(0)
    dim = _dim_of(call, 2, "dim", len(shape))
    index = call.arg(3, "index")
    assert isinstance(index, int)
    if not -shape[dim] <= index < shape[dim]:
        raise IndexError(
            f"select_scatter(): index {index} out of range for tensor of size {list(shape)} at dimension {dim}"
        )
    _check_scatter_source(
        call.input_meta(_tensor_input(call, 1, "src")), [size for d, size in enumerate(shape) if d != dim]
    )
    count = len(call.input_specs)
    strategies = []
    for d in range(len(shape)):
        if d == dim:
            continue
        placements: list[Placement] = [Shard(d)] * count
        source = call.input_index_at(1)
        if source is not None:
            placements[source] = Shard(d if d < dim else d - 1)
        strategies.append(OneDimStrategy((Shard(d),), tuple(placements)))
    strategies.append(_replicated(count))
    strategies.extend(_partials(count, call.every_reduce_op()))
    return strategies


SELECT_SCATTER_RULE = ShardingRule(
    family="select_scatter", one_dim_strategies=_select_scatter_strategies, output_meta=_like_self_meta
)


# --------------------------------------------------------------------------- index_select / index_add


def _index_select_strategies(call: OpCall) -> list[OneDimStrategy]:
    ndim = len(call.input_shape(0))
    dim = _dim_of(call, 1, "dim", ndim)
    index = _tensor_input(call, 2, "index")
    assert index == 1
    # Meta tensors do not check these; the local op would, but only after the inputs were redistributed.
    if len(call.input_shape(1)) > 1:
        raise IndexError("index_select(): Index is supposed to be a vector")
    if call.input_meta(1).dtype not in (torch.int64, torch.int32):
        raise RuntimeError("index_select(): Expected dtype int32 or int64 for index")
    strategies = [OneDimStrategy((Shard(d),), (Shard(d), Replicate())) for d in range(ndim) if d != dim]
    if len(call.input_shape(1)) == 1:
        strategies.append(OneDimStrategy((Shard(dim),), (Replicate(), Shard(0))))
    strategies.append(_replicated(2))
    strategies.extend(OneDimStrategy((Partial(k),), (Partial(k), Replicate())) for k in call.every_reduce_op())
    return strategies


def _index_select_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    meta = input_meta(args[0]) if args else None
    index = input_meta(_arg(args, kwargs, 2, "index", None))
    dim = _arg(args, kwargs, 1, "dim", None)
    if meta is None or index is None or not isinstance(dim, int) or not meta.shape:
        return None
    if len(index.shape) > 1 or index.dtype not in (torch.int64, torch.int32):
        return None
    if not -len(meta.shape) <= dim < len(meta.shape):
        return None
    shape = list(meta.shape)
    shape[dim % len(shape)] = math.prod(index.shape)
    return contiguous_meta(shape, meta.dtype)


INDEX_SELECT_RULE = ShardingRule(
    family="index_select", one_dim_strategies=_index_select_strategies, output_meta=_index_select_output_meta
)


def _index_add_strategies(call: OpCall) -> list[OneDimStrategy]:
    ndim = len(call.input_shape(0))
    dim = _dim_of(call, 1, "dim", ndim)
    assert _tensor_input(call, 2, "index") == 1 and _tensor_input(call, 3, "source") == 2
    index_dtype = call.input_meta(1).dtype
    if index_dtype not in (torch.int64, torch.int32):
        # Meta tensors do not check it; the local op would, after the inputs were redistributed.
        raise RuntimeError(f"index_add_(): Expected dtype int32/int64 for index but got: {_dtype_name(index_dtype)}")
    source_ndim = len(call.input_shape(2))
    strategies: list[OneDimStrategy] = []
    if source_ndim == ndim:
        strategies.extend(
            OneDimStrategy((Shard(d),), (Shard(d), Replicate(), Shard(d))) for d in range(ndim) if d != dim
        )
    strategies.append(_replicated(3))
    strategies.extend(
        OneDimStrategy((Partial(k),), (Partial(k), Replicate(), Partial(k))) for k in call.linear_reduce_ops()
    )
    if len(call.input_shape(1)) == 1 and source_ndim == ndim:
        # Each rank adds its share of the rows: the sum over ranks adds them all.
        strategies.append(OneDimStrategy((Partial("sum"),), (Partial("sum"), Shard(0), Shard(dim))))
    return strategies


# No output_meta: the meta run checks the sizes and gives torch's strides (a fresh contiguous result).
INDEX_ADD_RULE = ShardingRule(family="index_add", one_dim_strategies=_index_add_strategies)


# --------------------------------------------------------------------------- gather / scatter


def _gather_strategies(call: OpCall) -> list[OneDimStrategy]:
    self_shape = call.input_shape(0)
    dim = _dim_of(call, 1, "dim", len(self_shape))
    assert _tensor_input(call, 2, "index") == 1
    index_shape = call.input_shape(1)
    strategies: list[OneDimStrategy] = []
    if len(index_shape) == len(self_shape):
        strategies.extend(
            OneDimStrategy((Shard(d),), (Shard(d), Shard(d)))
            for d in range(len(self_shape))
            if d != dim and self_shape[d] == index_shape[d]
        )
    if len(index_shape) > 0:
        # The other dims address self by position, so only the gathered dim's rows of index can be spread.
        strategies.append(OneDimStrategy((Shard(dim),), (Replicate(), Shard(dim))))
    strategies.append(_replicated(2))
    strategies.extend(OneDimStrategy((Partial(k),), (Partial(k), Replicate())) for k in call.every_reduce_op())
    if call.op is aten.gather.default and len(index_shape) == len(self_shape) and index_shape[dim] == 1:
        # One position per row along dim (PyTorch's masked case): self keeps its shards of dim, each rank
        # picks the positions it holds and zeros elsewhere, and the sum over ranks is the gather
        # (_MaskPartial, as PyTorch names this pending sum; any op takes it as Partial("sum")).
        masked = _MaskPartial(offset_shape=torch.Size(self_shape), offset_dim=dim)
        strategies.append(OneDimStrategy((masked,), (Shard(dim), Replicate())))
    return strategies


@dataclass(frozen=True)
class ShardedDimGather:
    """``aten.gather`` on this rank's range ``[start, start + local extent)`` of a ``dim`` sharded self.

    Positions outside the range give zeros, so summing the ranks' results (``Partial(sum)``) is the
    plain gather: exactly one rank holds each position.  ``extent`` (the whole dim) lets every rank
    reject bad positions as the plain op does, instead of silently returning zeros for them.
    """

    dim: int
    start: int
    extent: int

    def __call__(self, input: torch.Tensor, dim: int, index: torch.Tensor, *, sparse_grad: bool = False) -> torch.Tensor:
        if index.numel() and index.device.type == "cpu" and type(index) is torch.Tensor:
            if not bool(((index >= 0) & (index < self.extent)).all()):
                raise RuntimeError(f"gather: index out of bounds for dimension {self.dim} with size {self.extent}")
        local_extent = input.shape[self.dim]
        if local_extent == 0:  # an empty shard (more ranks than positions) holds none of them
            return input.new_zeros(index.shape)
        local = index - self.start
        outside = (local < 0) | (local >= local_extent)
        picked = aten.gather.default(input, self.dim, local.masked_fill(outside, 0), sparse_grad=sparse_grad)
        return picked.masked_fill_(outside, 0)


def _gather_kernel(
    call: OpCall, inputs: tuple[tuple[Placement, ...], ...], outputs: tuple[DTensorSpec[Any] | None, ...]
) -> ShardedDimGather | None:
    dim = _dim_of(call, 1, "dim", len(call.input_shape(0)))
    if not any(placement == Shard(dim) for placement in inputs[0]):
        return None  # self whole along dim: the plain op (only the masked strategy shards self's dim)
    _, offset = call.input_specs[0].with_placements(inputs[0]).local_shape_and_offset()
    return ShardedDimGather(dim=dim, start=offset[dim], extent=call.input_shape(0)[dim])


def _gather_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    meta = input_meta(args[0]) if args else None
    index = input_meta(_arg(args, kwargs, 2, "index", None))
    if meta is None or index is None or index.dtype != torch.int64 or len(index.shape) != len(meta.shape):
        return None
    dim = _arg(args, kwargs, 1, "dim", None)
    if not isinstance(dim, int) or not -len(meta.shape) <= dim < max(len(meta.shape), 1):
        return None
    dim %= max(len(meta.shape), 1)
    if any(index.shape[d] > meta.shape[d] for d in range(len(meta.shape)) if d != dim):
        return None
    return contiguous_meta(index.shape, meta.dtype)


GATHER_RULE = ShardingRule(
    family="gather",
    one_dim_strategies=_gather_strategies,
    output_meta=_gather_output_meta,
    local_kernel=_gather_kernel,
)

# Scatter overloads by how a Partial destination may pass through them (index replicated).
_SCATTER_OVERWRITES_WITH_SOURCE = ("aten::scatter.src", "aten::scatter_.src", "aten::scatter.src_out")
_SCATTER_OVERWRITES_WITH_VALUE = ("aten::scatter.value", "aten::scatter_.value", "aten::scatter.value_out")
_SCATTER_ADDS = ("aten::scatter_add", "aten::scatter_add_")


def _overload_key(op: torch._ops.OpOverload) -> str:
    name = op._schema.name
    return f"{name}.{op._overloadname}" if op._overloadname != "default" else name


def _scatter_strategies(call: OpCall) -> list[OneDimStrategy]:
    self_shape = call.input_shape(0)
    dim = _dim_of(call, 1, "dim", len(self_shape))
    assert _tensor_input(call, 2, "index") == 1
    index_shape = call.input_shape(1)
    source = call.input_index_at(3) if call.input_index_at(3) is not None else call.input_index_at("src")
    source_shape = call.input_shape(source) if source is not None else None
    count = len(call.input_specs)

    def placements(self_p: Placement, index_p: Placement, source_p: Placement) -> tuple[Placement, ...]:
        return (self_p, index_p, source_p)[:count]

    strategies = []
    same_rank = len(index_shape) == len(self_shape) and (source_shape is None or len(source_shape) == len(self_shape))
    if same_rank:
        for d in range(len(self_shape)):
            lined_up = self_shape[d] == index_shape[d] and (source_shape is None or source_shape[d] == index_shape[d])
            if d != dim and lined_up:
                strategies.append(OneDimStrategy((Shard(d),), placements(Shard(d), Shard(d), Shard(d))))
    strategies.append(_replicated(count))
    key = _overload_key(call.op)
    kinds: Sequence[str] = ()
    if key in _SCATTER_OVERWRITES_WITH_SOURCE:
        kinds = call.every_reduce_op()  # overwritten entries take the source's parts, the rest keep self's
    elif key in _SCATTER_OVERWRITES_WITH_VALUE:
        # n copies of the value reduce to it by avg/max/min only (not by sum or product)
        kinds = tuple(k for k in call.every_reduce_op() if k not in ("sum", "product"))
    elif call.op._schema.name in _SCATTER_ADDS:
        kinds = call.linear_reduce_ops()
    for kind in kinds:
        strategies.append(OneDimStrategy((Partial(kind),), placements(Partial(kind), Replicate(), Partial(kind))))
    if (
        call.op._schema.name in _SCATTER_ADDS
        and source_shape is not None
        and len(index_shape) == len(source_shape) > 0
        and index_shape[dim] == source_shape[dim]
    ):
        # Each rank adds its share of the updates (rows along dim: the other dims address self by position).
        strategies.append(OneDimStrategy((Partial("sum"),), (Partial("sum"), Shard(dim), Shard(dim))))
    return strategies


# No output_meta: the meta run checks index and source (meta kernels do for scatter) and gives the strides.
SCATTER_RULE = ShardingRule(family="scatter", one_dim_strategies=_scatter_strategies)


# --------------------------------------------------------------------------- advanced indexing


class AdvancedIndexLayout(NamedTuple):
    """Where the dims of ``self[indices]`` come from.

    ``broadcast_shape``: the index tensors' common shape; its dims sit at
    ``broadcast_start`` in the result.  ``result_dim_of_self_dim`` maps each
    dim of self that is not indexed to its result dim.
    """

    broadcast_shape: tuple[int, ...]
    broadcast_start: int
    result_dim_of_self_dim: dict[int, int]
    result_shape: tuple[int, ...]


def advanced_index_layout(
    self_shape: Sequence[int], index_shapes: Sequence[Sequence[int] | None]
) -> AdvancedIndexLayout | None:
    """numpy's rule: adjacent indexed dims are replaced in place, separated ones move to the front.

    ``index_shapes`` has one entry per leading dim of self (None: not indexed).
    None when the shapes do not broadcast or there are more indices than dims.
    """
    if len(index_shapes) > len(self_shape):
        return None
    indexed = [dim for dim, shape in enumerate(index_shapes) if shape is not None]
    if not indexed:
        return None
    broadcast: list[int] = []
    for shape in index_shapes:
        if shape is None:
            continue
        padded_self = [1] * (len(shape) - len(broadcast)) + broadcast
        padded_other = [1] * (len(broadcast) - len(shape)) + list(shape)
        merged = []
        for have, other in zip(padded_self, padded_other):
            if have != other and 1 not in (have, other):
                return None
            merged.append(other if have == 1 else have)
        broadcast = merged
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    start = indexed[0] if adjacent else 0
    remaining = [dim for dim in range(len(self_shape)) if dim not in indexed]
    mapping: dict[int, int] = {}
    for dim in remaining:
        if adjacent and dim < start:
            mapping[dim] = dim
        elif adjacent:
            mapping[dim] = dim - len(indexed) + len(broadcast)
        else:
            mapping[dim] = len(broadcast) + remaining.index(dim)
    result = [0] * (len(broadcast) + len(remaining))
    for position, extent in enumerate(broadcast):
        result[start + position] = extent
    for dim, position in mapping.items():
        result[position] = self_shape[dim]
    return AdvancedIndexLayout(tuple(broadcast), start, mapping, tuple(result))


def _index_list(args: Sequence[object], kwargs: Mapping[str, object]) -> Sequence[object] | None:
    indices = _arg(args, kwargs, 1, "indices", None)
    return indices if isinstance(indices, (list, tuple)) else None


def _index_metas(call: OpCall) -> list[TensorMeta | None]:
    indices = _index_list(call.args, call.kwargs)
    assert indices is not None
    return [input_meta(entry) if entry is not None else None for entry in indices]


def _refuse_mask_indices(op: torch._ops.OpOverload, metas: Sequence[TensorMeta | None]) -> None:
    if any(meta is not None and meta.dtype in _MASK_DTYPES for meta in metas):
        raise NotImplementedError(
            f"{op} on a DTensor with a boolean (mask) index: the result's size depends on how many entries "
            "the mask selects, which no rank knows alone. Use masked_fill / torch.where to keep the shape, or "
            "index a full_tensor()"
        )


def _index_placements_for_broadcast_dim(
    layout: AdvancedIndexLayout, metas: Sequence[TensorMeta | None], broadcast_dim: int
) -> list[Placement] | None:
    """Placement of each index tensor when the result is sharded on broadcast dim ``broadcast_dim``."""
    placed: list[Placement] = []
    for meta in metas:
        if meta is None:
            continue
        placed.append(broadcast_input_placement(layout.broadcast_shape, meta.shape, broadcast_dim))
    return placed if any(isinstance(p, Shard) for p in placed) else None


def _advanced_index_strategies(call: OpCall) -> list[OneDimStrategy]:
    metas = _index_metas(call)
    _refuse_mask_indices(call.op, metas)
    self_shape = call.input_shape(0)
    layout = advanced_index_layout(self_shape, [None if m is None else m.shape for m in metas])
    assert layout is not None, "the meta run rejects indices that do not fit first"
    index_count = sum(1 for meta in metas if meta is not None)
    replicated_indices: tuple[Placement, ...] = (Replicate(),) * index_count
    strategies = [
        OneDimStrategy((Shard(result_dim),), (Shard(dim), *replicated_indices))
        for dim, result_dim in sorted(layout.result_dim_of_self_dim.items())
    ]
    for broadcast_dim in range(len(layout.broadcast_shape)):
        placed = _index_placements_for_broadcast_dim(layout, metas, broadcast_dim)
        if placed is not None:
            strategies.append(OneDimStrategy((Shard(layout.broadcast_start + broadcast_dim),), (Replicate(), *placed)))
    strategies.append(_replicated(1 + index_count))
    strategies.extend(
        OneDimStrategy((Partial(k),), (Partial(k), *replicated_indices)) for k in call.every_reduce_op()
    )
    return strategies


def _advanced_index_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    indices = _index_list(args, kwargs)
    if indices is not None:
        _refuse_mask_indices(op, [input_meta(entry) for entry in indices])
    return None  # the result's strides follow torch's iterator rules: the meta run computes them


ADVANCED_INDEX_RULE = ShardingRule(
    family="index", one_dim_strategies=_advanced_index_strategies, output_meta=_advanced_index_output_meta
)


def _accumulates(call: OpCall) -> bool:
    return bool(call.arg(3, "accumulate", False))


def _mask_put_strategies(call: OpCall, metas: Sequence[TensorMeta | None]) -> list[OneDimStrategy]:
    """``self[mask] = scalar``: elementwise, so a shard of self meets the same shard of the mask."""
    self_shape = call.input_shape(0)
    starts: list[int] = []
    position = 0
    for meta in metas:
        starts.append(position)
        position += 1 if meta is None or meta.dtype not in _MASK_DTYPES else len(meta.shape)
    # Only one mask alone is elementwise: torch pairs the entries a second mask or an integer index
    # selects with this mask's entries by their global order.
    elementwise = sum(1 for meta in metas if meta is not None) == 1
    strategies = []
    for dim in range(len(self_shape) if elementwise else 0):
        placed: list[Placement] = [Shard(dim)]
        for meta, start in zip(metas, starts):
            if meta is None:
                continue
            covered = start <= dim < start + len(meta.shape) and meta.dtype in _MASK_DTYPES
            if covered and meta.shape[dim - start] != self_shape[dim]:
                break
            placed.append(Shard(dim - start) if covered else Replicate())
        else:
            placed.append(Replicate())  # the scalar value
            strategies.append(OneDimStrategy((Shard(dim),), tuple(placed)))
    strategies.append(_replicated(len(call.input_specs)))
    masks: tuple[Placement, ...] = (Replicate(),) * sum(1 for meta in metas if meta is not None)
    kinds = call.linear_reduce_ops() if _accumulates(call) else call.every_reduce_op()
    # The written scalar is split into parts like self: the parts written at a position reduce to it.
    strategies.extend(OneDimStrategy((Partial(k),), (Partial(k), *masks, Partial(k))) for k in kinds)
    return strategies


def _index_put_strategies(call: OpCall) -> list[OneDimStrategy]:
    metas = _index_metas(call)
    values = _tensor_input(call, 2, "values")
    values_shape = call.input_shape(values)
    _check_index_put(call, metas, call.input_meta(values))
    uses_mask = any(meta is not None and meta.dtype in _MASK_DTYPES for meta in metas)
    if uses_mask:
        if len(values_shape) != 0:
            _refuse_mask_indices(call.op, metas)
        return _mask_put_strategies(call, metas)
    self_shape = call.input_shape(0)
    layout = advanced_index_layout(self_shape, [None if m is None else m.shape for m in metas])
    assert layout is not None, "the meta run rejects indices that do not fit first"
    index_count = sum(1 for meta in metas if meta is not None)
    replicated_indices: tuple[Placement, ...] = (Replicate(),) * index_count
    strategies = []
    for dim, result_dim in sorted(layout.result_dim_of_self_dim.items()):
        values_placement = broadcast_input_placement(layout.result_shape, values_shape, result_dim)
        strategies.append(OneDimStrategy((Shard(dim),), (Shard(dim), *replicated_indices, values_placement)))
    strategies.append(_replicated(2 + index_count))
    kinds = call.linear_reduce_ops() if _accumulates(call) else call.every_reduce_op()
    strategies.extend(
        OneDimStrategy((Partial(k),), (Partial(k), *replicated_indices, Partial(k))) for k in kinds
    )
    if _accumulates(call):
        for broadcast_dim in range(len(layout.broadcast_shape)):
            placed = _index_placements_for_broadcast_dim(layout, metas, broadcast_dim)
            if placed is None:
                continue
            values_placement = broadcast_input_placement(
                layout.result_shape, values_shape, layout.broadcast_start + broadcast_dim
            )
            # Each rank adds its share of the updates: the sum over ranks adds them all.
            strategies.append(OneDimStrategy((Partial("sum"),), (Partial("sum"), *placed, values_placement)))
    return strategies


def _check_index_put(call: OpCall, index_metas: Sequence[TensorMeta | None], values: TensorMeta) -> None:
    """What meta tensors do not check (the local op would, but only after a redistribution)."""
    meta = call.input_meta(0)
    if any(index is not None and index.dtype not in (*_MASK_DTYPES, torch.int64, torch.int32) for index in index_metas):
        raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
    indexed_dims = sum(
        0 if index is None else len(index.shape) if index.dtype in _MASK_DTYPES else 1 for index in index_metas
    ) + sum(1 for index in index_metas if index is None)
    if indexed_dims > len(meta.shape):
        raise IndexError(f"too many indices for tensor of dimension {len(meta.shape)} (got {indexed_dims})")
    if values.dtype != meta.dtype:
        raise RuntimeError(
            f"Index put requires the source and destination dtypes match, got {_dtype_name(meta.dtype)} for the "
            f"destination and {_dtype_name(values.dtype)} for the source."
        )
    if not any(index is not None and index.dtype in _MASK_DTYPES for index in index_metas):
        layout = advanced_index_layout(meta.shape, [None if index is None else index.shape for index in index_metas])
        if layout is None:
            shapes = ", ".join(str(list(index.shape)) for index in index_metas if index is not None)
            raise IndexError(f"shape mismatch: indexing tensors could not be broadcast together with shapes {shapes}")
        padded = (1,) * (len(layout.result_shape) - len(values.shape)) + tuple(values.shape)
        fits = len(values.shape) <= len(layout.result_shape) and all(
            have in (1, want) for have, want in zip(padded, layout.result_shape)
        )
        if not fits:
            raise RuntimeError(
                f"shape mismatch: value tensor of shape {list(values.shape)} cannot be broadcast to indexing "
                f"result of shape {list(layout.result_shape)}"
            )


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


INDEX_PUT_RULE = ShardingRule(family="index_put", one_dim_strategies=_index_put_strategies, output_meta=_like_self_meta)

register_rule((aten.select.int,), SELECT_RULE)
register_rule((aten.select_backward.default,), SELECT_BACKWARD_RULE)
register_rule((aten.slice.Tensor,), SLICE_RULE)
register_rule((aten.slice_backward.default,), SLICE_BACKWARD_RULE)
register_rule(aten_overloads(("slice_scatter",), with_inplace=False), SLICE_SCATTER_RULE)
register_rule(aten_overloads(("select_scatter",), with_inplace=False), SELECT_SCATTER_RULE)
register_rule((aten.index_select.default, aten.index_select.out), INDEX_SELECT_RULE)
register_rule((aten.index_add.default, aten.index_add.out, aten.index_add_.default), INDEX_ADD_RULE)
register_rule((aten.gather.default, aten.gather.out), GATHER_RULE)
register_rule(aten_overloads(("scatter", "scatter_add", "scatter_reduce")), SCATTER_RULE)
register_rule((aten.index.Tensor, aten.index.Tensor_out), ADVANCED_INDEX_RULE)
register_rule(
    (aten.index_put.default, aten.index_put.out, aten.index_put_.default, aten._index_put_impl_.default),
    INDEX_PUT_RULE,
)
