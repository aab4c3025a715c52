"""Pointwise ops: unary, binary (with broadcasting and Python scalars), their in-place and out= forms.

On one mesh dim a pointwise op can run on matching shards of every input
(inputs broadcast along the sharded dim stay replicated), on replicas, or on
partial values where the op is linear in them:

* additive ops (``add``/``sub``/``rsub`` of two tensors, ``neg``) keep
  ``Partial(sum)`` / ``Partial(avg)`` when *every* operand is partial of that kind
  (``sum_i a_i + sum_i b_i == sum_i (a_i + b_i)``); a Python number or plain
  tensor operand would be added once per rank, so then no Partial strategy exists;
* adding a Python number or a replicated tensor to one partial operand
  (``add``/``sub``/``rsub``, in place too) keeps ``Partial(avg)``, and
  ``Partial(max)``/``Partial(min)`` where the partial operand is not negated
  (``avg_i(x_i + c) == avg_i(x_i) + c``, same for max/min; a sum would get ``c``
  once per rank);
* multiplicative ops (``mul``, ``div`` by a divisor, the ``*_backward`` ops that
  scale the incoming gradient) keep it for one partial operand when all other
  operands are replicated;
* everything else is nonlinear: a Partial input is reduced to Replicate first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta

from ._shapes import (
    all_row_major,
    broadcast_shapes,
    contiguous_meta,
    dtype_on_empty_tensors,
)
from .._call_schema import schema_facts
from .._rules import (
    OneDimStrategy,
    OpCall,
    PlacementsPerTensor,
    ShardingRule,
    aten_overloads,
    broadcast_input_placement,
    register_rule,
)

__all__ = ["MULTI_OUTPUT_POINTWISE_RULE", "POINTWISE_RULE", "pointwise_output_meta", "pointwise_strategies"]

aten = torch.ops.aten

_UNARY = (
    "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "bitwise_not", "ceil", "cos", "cosh",
    "deg2rad", "digamma", "erf", "erfc", "erfinv", "exp", "exp2", "expm1", "floor", "frac", "isinf",
    "isnan", "lgamma", "log", "log10", "log1p", "log2", "logical_not", "logit", "nan_to_num", "neg",
    "rad2deg", "reciprocal", "relu", "round", "rsqrt", "sigmoid", "sign", "sgn", "signbit", "sin", "sinc",
    "sinh", "sqrt", "square", "tan", "tanh", "trunc", "gelu", "silu", "mish", "hardsigmoid", "hardswish",
    "hardtanh", "leaky_relu", "elu", "softplus", "threshold", "clamp", "clamp_min", "clamp_max", "pow",
    "hardshrink", "softshrink", "angle", "i0", "isneginf", "isposinf", "celu", "mvlgamma", "polygamma",
    "conj_physical", "_conj_physical", "special_airy_ai", "special_bessel_j0", "special_bessel_j1",
    "special_bessel_y0", "special_bessel_y1", "special_entr", "special_erfcx", "special_i0e", "special_i1",
    "special_i1e", "special_log_ndtr", "special_modified_bessel_i0", "special_modified_bessel_i1",
    "special_modified_bessel_k0", "special_modified_bessel_k1", "special_ndtri", "special_ndtr",
    "special_scaled_modified_bessel_k0", "special_scaled_modified_bessel_k1", "special_spherical_bessel_j0",
)  # fmt: skip
_BINARY = (
    "add", "sub", "rsub", "mul", "div", "floor_divide", "remainder", "fmod", "maximum", "minimum", "fmax",
    "fmin", "eq", "ne", "lt", "le", "gt", "ge", "atan2", "hypot", "copysign", "logical_and", "logical_or",
    "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "xlogy", "where", "addcmul",
    "addcdiv", "lerp", "heaviside", "igamma", "igammac", "ldexp", "logaddexp", "logaddexp2", "nextafter",
    "special_xlog1py", "special_zeta", "special_chebyshev_polynomial_t", "special_chebyshev_polynomial_u",
    "special_chebyshev_polynomial_v", "special_chebyshev_polynomial_w", "special_shifted_chebyshev_polynomial_t",
    "special_shifted_chebyshev_polynomial_u", "special_shifted_chebyshev_polynomial_v",
    "special_shifted_chebyshev_polynomial_w", "special_hermite_polynomial_h", "special_hermite_polynomial_he",
    "special_laguerre_polynomial_l", "special_legendre_polynomial_p", "complex", "polar", "float_power",
    "_prelu_kernel",
)  # fmt: skip
_GRADIENT_SCALING_BACKWARDS = (
    "sigmoid_backward", "tanh_backward", "threshold_backward", "gelu_backward", "silu_backward",
    "hardtanh_backward", "leaky_relu_backward", "hardsigmoid_backward", "hardswish_backward",
    "softplus_backward", "mish_backward", "elu_backward", "logit_backward", "hardshrink_backward",
    "softshrink_backward", "log_sigmoid_backward",
)  # fmt: skip

# Ops whose result is linear in all tensor operands together: operand positions.
_ADDITIVE: dict[torch._ops.OpOverload, tuple[int, ...]] = {}
for _op in (aten.add.Tensor, aten.add.out, aten.add_.Tensor, aten.sub.Tensor, aten.sub.out, aten.sub_.Tensor,
            aten.rsub.Tensor):  # fmt: skip
    _ADDITIVE[_op] = (0, 1)
for _op in (aten.neg.default, aten.neg.out, aten.neg_.default):
    _ADDITIVE[_op] = (0,)

# Ops adding something replicated to one operand: its position -> the Partial kinds that shift with it.
# Avg commutes with any affine map; max/min only where the operand keeps its sign (not the subtrahend,
# not an ``alpha``-scaled operand, whose alpha the cache key holds by type only).
_SHIFT_KINDS = ("avg", "max", "min")
_SHIFTED: dict[torch._ops.OpOverload, tuple[tuple[int, tuple[str, ...]], ...]] = {}
for _name, _overloads, _shifts in (
    ("add", ("Tensor", "out"), ((0, _SHIFT_KINDS), (1, ("avg",)))),
    ("add_", ("Tensor",), ((0, _SHIFT_KINDS), (1, ("avg",)))),
    ("add", ("Scalar", "Scalar_out"), ((0, _SHIFT_KINDS),)),
    ("add_", ("Scalar",), ((0, _SHIFT_KINDS),)),
    ("sub", ("Tensor", "out"), ((0, _SHIFT_KINDS), (1, ("avg",)))),
    ("sub_", ("Tensor",), ((0, _SHIFT_KINDS), (1, ("avg",)))),
    ("sub", ("Scalar", "Scalar_out"), ((0, _SHIFT_KINDS),)),
    ("sub_", ("Scalar",), ((0, _SHIFT_KINDS),)),
    ("rsub", ("Tensor", "Tensor_out"), ((0, ("avg",)), (1, _SHIFT_KINDS))),  # other - alpha * self
    ("rsub", ("Scalar", "Scalar_out"), ((0, ("avg",)),)),
):
    for _overload in _overloads:
        _SHIFTED[getattr(getattr(aten, _name), _overload)] = _shifts

# Ops linear in one operand while the others stay fixed: the positions it may be.
_LINEAR_IN_ONE: dict[torch._ops.OpOverload, tuple[int, ...]] = {}
for _op in (aten.mul.Tensor, aten.mul.out, aten.mul_.Tensor):
    _LINEAR_IN_ONE[_op] = (0, 1)
for _op in (aten.mul.Scalar, aten.mul_.Scalar, aten.mul.Scalar_out, aten.div.Tensor, aten.div.out, aten.div_.Tensor,
            aten.div.Scalar, aten.div_.Scalar, aten.div.Scalar_out):  # fmt: skip
    _LINEAR_IN_ONE[_op] = (0,)
for _op in aten_overloads(_GRADIENT_SCALING_BACKWARDS, with_inplace=False):
    _LINEAR_IN_ONE[_op] = (0,)  # grad_output is argument 0; the mask/scale depends only on the others


# Ops non-decreasing in every tensor operand: with one operand Partial(max) or Partial(min) and the others
# replicated, the reduction over ranks passes through (max_i maximum(a_i, b) = maximum(max_i a_i, b)).
# With every operand partial only the op's own kind does: max_i maximum(a_i, b_i) = maximum(max_i a_i,
# max_i b_i), whereas min_i maximum(a_i, b_i) is not maximum(min_i a_i, min_i b_i).
_MONOTONE: dict[torch._ops.OpOverload, str] = {
    aten.maximum.default: "max", aten.maximum.out: "max", aten.minimum.default: "min", aten.minimum.out: "min",
}  # fmt: skip
_ORDER_KINDS = ("max", "min")


def pointwise_strategies(call: OpCall) -> list[OneDimStrategy]:
    out_shape = call.output_shape(0)
    in_shapes = [call.input_shape(index) for index in range(len(call.input_specs))]
    strategies: list[OneDimStrategy] = []
    for out_dim in range(len(out_shape)):
        inputs = tuple(broadcast_input_placement(out_shape, in_shape, out_dim) for in_shape in in_shapes)
        # With every input replicated along out_dim each rank would compute the full extent, not a shard.
        if any(isinstance(placement, Shard) for placement in inputs):
            strategies.append(OneDimStrategy((Shard(out_dim),), inputs))
    replicated: tuple[Placement, ...] = (Replicate(),) * len(in_shapes)
    strategies.append(OneDimStrategy((Replicate(),), replicated))

    additive_positions = _ADDITIVE.get(call.op)
    if additive_positions is not None:
        operand_inputs = [call.input_index_at(position) for position in additive_positions]
        if all(index is not None for index in operand_inputs) and len(operand_inputs) == len(in_shapes):
            for reduce_op in call.linear_reduce_ops():
                partial = Partial(reduce_op)
                strategies.append(OneDimStrategy((partial,), (partial,) * len(in_shapes)))
    one_partial: list[tuple[int, tuple[str, ...]]] = [
        (position, call.linear_reduce_ops()) for position in _LINEAR_IN_ONE.get(call.op, ())
    ]
    for position, kinds in _SHIFTED.get(call.op, ()):
        one_partial.append((position, tuple(kind for kind in kinds if kind in call.partial_reduce_ops)))
    for position, kinds in one_partial:
        partial_index = call.input_index_at(position)
        if partial_index is None:
            continue
        for reduce_op in kinds:
            partial = Partial(reduce_op)
            inputs = tuple(partial if index == partial_index else Replicate() for index in range(len(in_shapes)))
            strategy = OneDimStrategy((partial,), inputs)
            if strategy not in strategies:
                strategies.append(strategy)
    own_kind = _MONOTONE.get(call.op)
    if own_kind is not None:
        for reduce_op in (kind for kind in _ORDER_KINDS if kind in call.partial_reduce_ops):
            partial = Partial(reduce_op)
            choices: list[tuple[Placement, ...]] = [(partial,) * len(in_shapes)] if reduce_op == own_kind else []
            choices.extend(
                tuple(partial if index == kept else Replicate() for index in range(len(in_shapes)))
                for kept in range(len(in_shapes))
            )
            for inputs in dict.fromkeys(choices):  # in order, without repeats
                strategies.append(OneDimStrategy((partial,), inputs))
    return strategies


def pointwise_output_meta(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object]
) -> TensorMeta | None:
    """Broadcast shape of all tensor operands; contiguous when they all have a row-major layout."""
    written = schema_facts(op).out_names
    keyword_operands = [value for name, value in kwargs.items() if name not in written]
    operands = [value for value in (*args, *keyword_operands) if isinstance(value, (DTensorSpec, torch.Tensor))]
    shapes = []
    for operand in operands:
        if isinstance(operand, DTensorSpec):
            assert operand.tensor_meta is not None
            shapes.append(operand.tensor_meta.shape)
        else:
            shapes.append(operand.shape)
    shape = broadcast_shapes(*shapes)
    if shape is None:
        return None
    if schema_facts(op).writes_first_argument and shapes and shape != shapes[0]:
        return None  # self cannot be broadcast in place; the meta run raises torch's error
    if not all_row_major(operands):
        return None
    dtype = dtype_on_empty_tensors(op, args, kwargs)
    return None if dtype is None else contiguous_meta(shape, dtype)


POINTWISE_RULE = ShardingRule(
    family="pointwise",
    one_dim_strategies=pointwise_strategies,
    scalar_values_matter=False,
    output_meta=pointwise_output_meta,
)

register_rule(aten_overloads(_UNARY + _BINARY + _GRADIENT_SCALING_BACKWARDS), POINTWISE_RULE)


def _multi_output_pointwise_strategies(call: OpCall) -> list[OneDimStrategy]:
    """One input, several outputs of its shape (``frexp``: mantissa and exponent; ``log_sigmoid_forward``:
    output and buffer): every output sharded like the input.  An output of another shape (an empty
    buffer) can only be replicated, and then so is everything."""
    in_shape = call.input_shape(0)
    outputs = len(call.output_metas)
    strategies: list[OneDimStrategy] = []
    if all(meta is not None and meta.shape == in_shape for meta in call.output_metas):
        strategies.extend(OneDimStrategy((Shard(dim),) * outputs, (Shard(dim),)) for dim in range(len(in_shape)))
    strategies.append(OneDimStrategy((Replicate(),) * outputs, (Replicate(),)))
    return strategies


MULTI_OUTPUT_POINTWISE_RULE = ShardingRule(
    family="pointwise with several outputs", one_dim_strategies=_multi_output_pointwise_strategies
)

register_rule(
    (aten.frexp.Tensor, aten.frexp.Tensor_out, aten.log_sigmoid_forward.default, aten.log_sigmoid_forward.output),
    MULTI_OUTPUT_POINTWISE_RULE,
)


@dataclass(frozen=True)
class PhysicalConjugate:
    """``_conj`` on a local piece: the conjugated values themselves rather than a lazily conjugated view.

    A DTensor does not carry torch's conjugate bit through its own metadata, so the bit set on a local
    piece could be lost or applied twice by the ops that follow; materialising it keeps the values right.
    """

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return aten._conj_physical.default(tensor)


def _physical_conjugate_kernel(call: OpCall, inputs: object, outputs: object) -> PhysicalConjugate:
    return PhysicalConjugate()


register_rule(
    (aten._conj.default,),
    ShardingRule(
        family="conj (materialised)",
        one_dim_strategies=pointwise_strategies,
        output_meta=pointwise_output_meta,
        local_kernel=_physical_conjugate_kernel,
    ),
)


# --------------------------------------------------------------------------- masked_fill on partial values


@dataclass(frozen=True)
class FillOnOneRank:
    """``masked_fill`` of a ``Partial(sum)`` piece: the ranks add their pieces, so the filled value is written on
    one rank (coordinate 0 on every summed mesh dim) and zero on the others; the masked places then sum to the
    value, the others to the partial sum, which is ``masked_fill`` of the whole."""

    writes_value: bool

    def __call__(self, op: torch._ops.OpOverload, *args: object, **kwargs: object) -> object:
        if self.writes_value:
            return op(*args, **kwargs)
        if "value" in kwargs:
            value = kwargs["value"]
            kwargs = {**kwargs, "value": torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0}
            return op(*args, **kwargs)
        value = args[2]
        zero = torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0
        return op(*args[:2], zero, *args[3:], **kwargs)


@dataclass(frozen=True)
class _BoundFill:
    op: torch._ops.OpOverload
    fill: FillOnOneRank

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self.fill(self.op, *args, **kwargs)


def _masked_fill_strategies(call: OpCall) -> list[OneDimStrategy]:
    """Pointwise, and also partial values of every kind with a replicated mask (and value): the masked places
    take the value (on every rank for avg/max/min, whose reduction of equal values is that value; on one rank
    for sum, zero elsewhere), the others keep their partial values. So an in-place fill of a partial result
    (the count in scatter_reduce's 'mean' backward, a norm's zero guard) needs no reduction. (Not products:
    mixed with sums on other mesh dims, no one-rank rule writes the value.)"""
    strategies = pointwise_strategies(call)
    others: tuple[Placement, ...] = (Replicate(),) * (len(call.input_specs) - 1)
    for reduce_op in (kind for kind in call.every_reduce_op() if kind != "product"):
        strategy = OneDimStrategy((Partial(reduce_op),), (Partial(reduce_op), *others))
        if strategy not in strategies:
            strategies.append(strategy)
    return strategies


def _masked_fill_kernel(
    call: OpCall, inputs: PlacementsPerTensor, outputs: tuple[DTensorSpec[Any] | None, ...]
) -> _BoundFill | None:
    summed = [mesh_dim for mesh_dim, placement in enumerate(inputs[0]) if placement == Partial("sum")]
    spec = outputs[0]
    if not summed or spec is None:
        return None
    coordinate = spec.mesh.get_coordinate()
    assert coordinate is not None, "a rank outside the mesh runs no local op"
    return _BoundFill(call.op, FillOnOneRank(all(coordinate[mesh_dim] == 0 for mesh_dim in summed)))


MASKED_FILL_RULE = ShardingRule(
    family="masked_fill (pointwise, partial values)",
    one_dim_strategies=_masked_fill_strategies,
    scalar_values_matter=False,
    output_meta=pointwise_output_meta,
    local_kernel=_masked_fill_kernel,
)
register_rule(aten_overloads(("masked_fill",)), MASKED_FILL_RULE)
