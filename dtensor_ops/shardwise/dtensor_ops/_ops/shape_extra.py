"""More shape ops: tril/triu, diagonal / diag_embed / diagonal_scatter / trace, repeat, roll, rot90,
unfold, glu, view_as_complex, narrow_copy, fill, and the ``*_copy`` variants of the view ops.

All of them move (or zero) elements without combining them, so where they keep values apart
every Partial kind passes through (``tril`` zeroes the same elements of every part, and any
reduction of zeros is zero).  On one mesh dim:

* ``tril``/``triu``: every dim may stay sharded; a rank holding rows from ``r0`` and columns from
  ``c0`` keeps its part of the triangle with the diagonal shifted by ``r0 - c0`` (local argument);
* ``diagonal`` keeps shards of the dims it does not take the diagonal of (they move in front of the
  new last dim); ``diag_embed`` the reverse; ``diagonal_scatter`` keeps shards of ``self``'s other
  dims with ``src`` sharded alike; ``trace`` runs replicated (Partial sum/avg pass through: linear);
* ``repeat`` keeps shards of dims repeated once; ``roll``/``rot90``/``unfold``/``glu``/``narrow_copy``
  keep shards of the dims they do not work along; ``view_as_complex`` of every dim but the last;
* the ``*_copy`` variants (``view_copy``, ``permute_copy``, ``squeeze_copy``, ...) are decided by
  the rule of their view op (same arguments, same local arguments), the result is a fresh tensor;
* ``fill`` (out of place) keeps the input's shards, replicated where the input is Partial.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, normalize_dim

from .._rules import (
    OneDimStrategy,
    OpCall,
    PlacementsPerTensor,
    ShardingRule,
    register_rule,
    rule_for,
)
# Their rules are lent to the *_copy variants below, so they must be registered first.
from . import concat_split, reshaping, tensor_basics  # noqa: F401
from ._aligned import aligned_strategy, free_dim_strategies, replicated_strategy

__all__ = ["TRIANGLE_RULE", "copy_variant_rule"]

aten = torch.ops.aten


def _moving_partials(call: OpCall) -> list[OneDimStrategy]:
    """Partial in, the same Partial out, for ops that only move elements (one tensor input)."""
    extra: tuple[Placement, ...] = (Replicate(),) * (len(call.input_specs) - 1)
    return [
        OneDimStrategy((Partial(kind),) * len(call.output_metas), (Partial(kind),) + extra)
        for kind in call.every_reduce_op()
    ]


def _int_arg(call: OpCall, position: int, name: str, default: int) -> int:
    value = call.arg(position, name, default)
    if not isinstance(value, int):
        raise TypeError(f"{call.op}: {name} must be an int, got {value!r}")
    return value


# ---------------------------------------------------------------------------------- tril / triu


def _triangle_strategies(call: OpCall) -> list[OneDimStrategy]:
    return free_dim_strategies(call, range(len(call.input_shape(0)))) + _moving_partials(call)


@dataclass(frozen=True)
class ShiftedTriangle:
    """``tril``/``triu`` on a piece whose first row is global row ``r0`` and first column ``c0``: the
    diagonal ``k`` of the whole tensor is the diagonal ``k + r0 - c0`` of the piece."""

    op: torch._ops.OpOverload
    diagonal: int

    def __call__(self, tensor: torch.Tensor, diagonal: int = 0, **out: Any) -> torch.Tensor:
        result: torch.Tensor = self.op(tensor, self.diagonal, **out)
        return result


def _triangle_kernel(
    call: OpCall, inputs: PlacementsPerTensor, outputs: tuple[DTensorSpec[Any] | None, ...]
) -> ShiftedTriangle | None:
    spec = outputs[0]
    if spec is None or len(spec.shape) < 2:
        return None
    _, offset = spec.local_shape_and_offset()
    shift = offset[-2] - offset[-1]
    if shift == 0:
        return None
    return ShiftedTriangle(call.op, _int_arg(call, 1, "diagonal", 0) + shift)


TRIANGLE_RULE = ShardingRule(
    family="tril/triu", one_dim_strategies=_triangle_strategies, local_kernel=_triangle_kernel
)


# ----------------------------------------------------------------------------------- diagonals


def _diagonal_dims(
    call: OpCall, ndim: int, first_default: int, second_default: int, position: int = 2
) -> tuple[int, int]:
    dim1 = normalize_dim(_int_arg(call, position, "dim1", first_default), ndim)
    dim2 = normalize_dim(_int_arg(call, position + 1, "dim2", second_default), ndim)
    return dim1, dim2


def _diagonal_strategies(call: OpCall) -> list[OneDimStrategy]:
    ndim = len(call.input_shape(0))
    taken = _diagonal_dims(call, ndim, 0, 1)
    kept = [dim for dim in range(ndim) if dim not in taken]
    strategies = [aligned_strategy(call, (dim,), (position,)) for position, dim in enumerate(kept)]
    return strategies + [replicated_strategy(call)] + _moving_partials(call)


def _diagonal_backward_strategies(call: OpCall) -> list[OneDimStrategy]:
    """``diagonal_backward(grad, input_sizes, offset, dim1, dim2)``: the gradient's leading dims are the
    input's dims other than ``dim1``/``dim2`` (in order), its last dim the diagonal; the result holds
    ``grad`` on that diagonal and zeros elsewhere, so it is linear in ``grad``."""
    sizes = call.arg(1, "input_sizes")
    assert isinstance(sizes, (list, tuple))
    ndim = len(sizes)
    taken = _diagonal_dims(call, ndim, 0, 1, position=3)
    kept = [dim for dim in range(ndim) if dim not in taken]
    strategies = [aligned_strategy(call, (position,), (dim,)) for position, dim in enumerate(kept)]
    strategies.append(replicated_strategy(call))
    strategies.extend(OneDimStrategy((Partial(kind),), (Partial(kind),)) for kind in call.linear_reduce_ops())
    return strategies


def _diag_embed_strategies(call: OpCall) -> list[OneDimStrategy]:
    in_ndim = len(call.input_shape(0))
    out_ndim = in_ndim + 1
    placed = _diagonal_dims(call, out_ndim, -2, -1)
    others = [dim for dim in range(out_ndim) if dim not in placed]
    strategies = [aligned_strategy(call, (dim,), (others[dim],)) for dim in range(in_ndim - 1)]
    return strategies + [replicated_strategy(call)] + _moving_partials(call)


def _diagonal_scatter_strategies(call: OpCall) -> list[OneDimStrategy]:
    ndim = len(call.input_shape(0))
    taken = _diagonal_dims(call, ndim, 0, 1, position=3)
    kept = [dim for dim in range(ndim) if dim not in taken]
    strategies = [aligned_strategy(call, (dim, position), (dim,)) for position, dim in enumerate(kept)]
    return strategies + [replicated_strategy(call)]


def _trace_strategies(call: OpCall) -> list[OneDimStrategy]:
    strategies = [replicated_strategy(call)]
    strategies.extend(OneDimStrategy((Partial(kind),), (Partial(kind),)) for kind in call.linear_reduce_ops())
    return strategies


# ------------------------------------------------------------------------ repeat, roll, rot90, ...


def _repeat_strategies(call: OpCall) -> list[OneDimStrategy]:
    ndim = len(call.input_shape(0))
    repeats = call.arg(1, "repeats")
    assert isinstance(repeats, (list, tuple))
    lead = len(repeats) - ndim
    strategies = [
        aligned_strategy(call, (dim,), (dim + lead,)) for dim in range(ndim) if lead >= 0 and repeats[dim + lead] == 1
    ]
    return strategies + [replicated_strategy(call)] + _moving_partials(call)


def _dims_list(call: OpCall, position: int, name: str, default: list[int]) -> list[int]:
    value = call.arg(position, name, default)
    if isinstance(value, int):
        return [value]
    assert isinstance(value, (list, tuple))
    return [int(v) for v in value]


def _roll_strategies(call: OpCall) -> list[OneDimStrategy]:
    ndim = len(call.input_shape(0))
    dims = _dims_list(call, 2, "dims", [])
    if not dims:  # rolls the flattened tensor
        return [replicated_strategy(call)] + _moving_partials(call)
    rolled = {normalize_dim(dim, ndim) for dim in dims}
    return free_dim_strategies(call, [dim for dim in range(ndim) if dim not in rolled]) + _moving_partials(call)


def _rot90_strategies(call: OpCall) -> list[OneDimStrategy]:
    ndim = len(call.input_shape(0))
    turns = _int_arg(call, 1, "k", 1)
    dims = _dims_list(call, 2, "dims", [0, 1])
    rotated = {normalize_dim(dim, ndim) for dim in dims} if turns % 4 else set()
    return free_dim_strategies(call, [dim for dim in range(ndim) if dim not in rotated]) + _moving_partials(call)


def _one_dim_op_strategies(call: OpCall, position: int, name: str, default: int, partials: bool) -> list[OneDimStrategy]:
    ndim = len(call.input_shape(0))
    if ndim == 0:
        return [replicated_strategy(call)]
    worked = normalize_dim(_int_arg(call, position, name, default), ndim)
    strategies = free_dim_strategies(call, [dim for dim in range(ndim) if dim != worked])
    return strategies + (_moving_partials(call) if partials else [])


def _unfold_strategies(call: OpCall) -> list[OneDimStrategy]:
    return _one_dim_op_strategies(call, 1, "dimension", 0, partials=True)


def _glu_strategies(call: OpCall) -> list[OneDimStrategy]:
    return _one_dim_op_strategies(call, 1, "dim", -1, partials=False)


def _glu_backward_strategies(call: OpCall) -> list[OneDimStrategy]:
    """``glu_backward(grad_output, self, dim)``: both halves of ``self``'s ``dim`` are read together;
    every other dim stays sharded in the gradient, ``self`` and the result alike."""
    ndim = len(call.input_shape(1))
    if ndim == 0:
        return [replicated_strategy(call)]
    worked = normalize_dim(_int_arg(call, 2, "dim", -1), ndim)
    strategies = [aligned_strategy(call, (dim, dim), (dim,)) for dim in range(ndim) if dim != worked]
    return strategies + [replicated_strategy(call)]


def _narrow_copy_strategies(call: OpCall) -> list[OneDimStrategy]:
    return _one_dim_op_strategies(call, 1, "dim", 0, partials=True)


def _view_as_real_strategies(call: OpCall) -> list[OneDimStrategy]:
    """``view_as_real`` adds a last dim of 2 (real, imaginary): every input dim keeps its shard, and the
    view is linear over the reals (a Partial sum or average stays one)."""
    strategies = free_dim_strategies(call, range(len(call.input_shape(0))))
    strategies.extend(OneDimStrategy((Partial(kind),), (Partial(kind),)) for kind in call.linear_reduce_ops())
    return strategies


def _view_as_complex_strategies(call: OpCall) -> list[OneDimStrategy]:
    return free_dim_strategies(call, range(len(call.input_shape(0)) - 1))


@dataclass(frozen=True)
class ViewAsComplexOfPiece:
    """``view_as_complex`` of a local piece, copied to a row-major layout first when the piece's strides
    (after a redistribution, or of an empty piece) are not the (…, 2, 1) layout the view needs."""

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.stride(-1) != 1 or any(stride % 2 for stride in tensor.stride()[:-1]):
            # Not .contiguous(): an empty piece counts as contiguous whatever its strides, and is returned as is.
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        return aten.view_as_complex.default(tensor)


def _view_as_complex_kernel(
    call: OpCall, inputs: PlacementsPerTensor, outputs: tuple[DTensorSpec[Any] | None, ...]
) -> ViewAsComplexOfPiece | None:
    return ViewAsComplexOfPiece() if any(isinstance(p, Shard) for p in inputs[0]) else None


def _fill_strategies(call: OpCall) -> list[OneDimStrategy]:
    """fill.Scalar / fill.Tensor: a new tensor shaped like self holding the value; self's values unread."""
    extra: tuple[Placement, ...] = (Replicate(),) * (len(call.input_specs) - 1)
    strategies = []
    for placement in call.placements_keeping_values_unread(len(call.input_shape(0))):
        output: Placement = Replicate() if isinstance(placement, Partial) else placement
        strategies.append(OneDimStrategy((output,), (placement,) + extra))
    return strategies


# -------------------------------------------------------------------------- the *_copy variants


@dataclass(frozen=True)
class _AsViewOp:
    """Asks a view op's rule hook (strategies, validity, local arguments) about its ``*_copy`` variant:
    same arguments, same layouts; only the result is a fresh tensor."""

    view_op: torch._ops.OpOverload
    hook: str

    def __call__(self, call: OpCall, *rest: Any) -> Any:
        rule = rule_for(self.view_op)
        assert rule is not None
        return getattr(rule, self.hook)(dataclasses.replace(call, op=self.view_op), *rest)


def copy_variant_rule(view_op: torch._ops.OpOverload) -> ShardingRule:
    """The rule of ``view_op`` for its ``*_copy`` variant (output metadata from a meta run of the copy)."""
    rule = rule_for(view_op)
    if rule is None or rule.one_dim_strategies is None:
        raise ValueError(f"{view_op} has no one-dim sharding rule to lend its *_copy variant")
    return ShardingRule(
        family=f"{rule.family} (copy)",
        one_dim_strategies=_AsViewOp(view_op, "one_dim_strategies"),
        is_valid=None if rule.is_valid is None else _AsViewOp(view_op, "is_valid"),
        local_arg_overrides=None if rule.local_arg_overrides is None else _AsViewOp(view_op, "local_arg_overrides"),
        validity_reads_strided_shards=rule.validity_reads_strided_shards,
    )


def _register(strategies: Any, family: str, ops: tuple[torch._ops.OpOverload, ...]) -> ShardingRule:
    rule = ShardingRule(family=family, one_dim_strategies=strategies)
    register_rule(ops, rule)
    return rule


# tril_/triu_ write in place with the same shifted diagonal (the written DTensor keeps its placements). A
# write into a view that had to be redistributed (a diagonal of a sharded matrix in householder_product's
# backward) raises in dispatch instead of being lost.
register_rule(
    (aten.tril.default, aten.tril.out, aten.triu.default, aten.triu.out, aten.tril_.default, aten.triu_.default),
    TRIANGLE_RULE,
)
_register(
    _diagonal_backward_strategies, "diagonal_backward", (aten.diagonal_backward.default, aten.diagonal_backward.out)
)
_register(_glu_backward_strategies, "glu_backward", (aten.glu_backward.default, aten.glu_backward.grad_input))
_register(_view_as_real_strategies, "view_as_real", (aten.view_as_real.default,))
_register(_diagonal_strategies, "diagonal", (aten.diagonal.default, aten.diagonal_copy.default))
_register(_diag_embed_strategies, "diag_embed", (aten.diag_embed.default, aten.diag_embed.out))
_register(_diagonal_scatter_strategies, "diagonal_scatter", (aten.diagonal_scatter.default,))
_register(_trace_strategies, "trace", (aten.trace.default, aten.trace.out))
_register(_repeat_strategies, "repeat", (aten.repeat.default, aten.repeat.out))
_register(_roll_strategies, "roll", (aten.roll.default, aten.roll.out))
_register(_rot90_strategies, "rot90", (aten.rot90.default, aten.rot90.out))
_register(_unfold_strategies, "unfold", (aten.unfold.default, aten.unfold_copy.default))
_register(_glu_strategies, "glu", (aten.glu.default, aten.glu.out))
_register(_narrow_copy_strategies, "narrow_copy", (aten.narrow_copy.default,))
register_rule(
    (aten.view_as_complex.default,),
    ShardingRule(
        family="view_as_complex", one_dim_strategies=_view_as_complex_strategies, local_kernel=_view_as_complex_kernel
    ),
)
_register(_fill_strategies, "fill", (aten.fill.Scalar, aten.fill.Tensor))

for _copy_op, _view_op in (
    (aten.alias_copy.default, aten.alias.default),
    (aten.expand_copy.default, aten.expand.default),
    (aten.permute_copy.default, aten.permute.default),
    (aten.t_copy.default, aten.t.default),
    (aten.transpose_copy.int, aten.transpose.int),
    (aten.unsqueeze_copy.default, aten.unsqueeze.default),
    (aten.view_copy.default, aten.view.default),
    (aten.squeeze_copy.default, aten.squeeze.default),
    (aten.squeeze_copy.dim, aten.squeeze.dim),
    (aten.squeeze_copy.dims, aten.squeeze.dims),
    (aten.split_with_sizes_copy.default, aten.split_with_sizes.default),
    (aten.unbind_copy.int, aten.unbind.int),
):
    register_rule((_copy_op,), copy_variant_rule(_view_op))


# --------------------------------------------------------------------------- as_strided (gathered)


def _as_strided_strategies(call: OpCall) -> list[OneDimStrategy]:
    # as_strided addresses the storage of the whole tensor: only the whole (row-major) tensor can answer. The
    # op handler (_handlers/as_strided.py) serves identities and replicated inputs and sends only row-major
    # non-replicated ones here, whose gathered copy is laid out as the global strides say; dispatch marks the
    # result as a view of a redistributed copy, so an in-place write into it raises instead of being lost.
    return [replicated_strategy(call)]


AS_STRIDED_RULE = ShardingRule(family="as_strided (whole tensor)", one_dim_strategies=_as_strided_strategies)
register_rule((aten.as_strided.default,), AS_STRIDED_RULE)
