"""PyTorch's ``torch.distributed.tensor._ops._matrix_ops`` strategy vocabulary.

``mm_strategy``/``bmm_strategy``/``addmm_strategy`` are PyTorch's full-mesh strategy functions
(``OpSchema`` of ``OpStrategy`` arguments -> ``OpStrategy`` with per-input redistribution costs, from
``einsum_strategy.gen_einsum_strategies``, unshardable candidates dropped); shardwise's dispatch
decides matrix products with its own rule (``_ops.matrix``), these list PyTorch's candidates.

``gen_single_dim_einsum_strategies(equation)`` lists, for ONE mesh dim, the placements an einsum-style
product may take, each row ``[output, (bias,) input 0, input 1, ...]`` with ``_ShardingPlaceholder(d)``
for "sharded on dim d" (see ``single_dim_strategy``). The rows are the ones shardwise's matrix rule
(``_ops.matrix``) chooses among: a dim shared by output and every input is sharded everywhere; a
contracted dim sharded on both inputs gives a Partial output; a dim of one input and the output is
sharded there with the other input replicated; and the product is linear in each input (a linear
Partial input with the other replicated gives the same Partial output; with no contraction or free
dims, in all inputs at once).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard

from .einsum_strategy import EinsumDims, gen_einsum_strategies
from .op_schema import OpSchema, OpSpec, OpStrategy, _ShardingPlaceholder, generate_redistribute_costs, is_tensor_shardable

__all__ = ["addmm_strategy", "bmm_strategy", "gen_single_dim_einsum_strategies", "mm_single_dim_strategy", "mm_strategy"]

_LINEAR_REDUCE_OPS = ("sum", "avg")

Row = list[Placement | _ShardingPlaceholder]


def _parse(equation: str) -> tuple[list[str], str]:
    left, arrow, output = equation.replace(" ", "").partition("->")
    if not arrow:
        raise ValueError(f"einsum equation {equation!r}: expected 'inputs->output', e.g. 'mk,kn->mn'")
    inputs = left.split(",")
    for labels in (*inputs, output):
        if len(set(labels)) != len(labels) or not all(c.isalpha() for c in labels):
            raise ValueError(f"einsum equation {equation!r}: expected distinct letters per operand, got {labels!r}")
    return inputs, output


def gen_single_dim_einsum_strategies(equation: str, *, bias_shape: torch.Size | None = None) -> list[Row]:
    """One mesh dim's placement rows for the product ``equation`` (``bias_shape``: an added, broadcast tensor)."""
    inputs, output = _parse(equation)
    if len(inputs) not in (1, 2):
        raise NotImplementedError(f"einsum equation {equation!r}: one or two inputs supported, got {len(inputs)}")
    labels_in = set("".join(inputs))
    shared = [c for c in output if all(c in labels for labels in inputs)]
    contracted = [c for c in sorted(labels_in, key="".join(inputs).index) if c not in output and all(c in x for x in inputs)]
    first_only = [c for c in inputs[0] if c in output and c not in shared] if len(inputs) == 2 else []
    second_only = [c for c in inputs[1] if c in output and c not in shared] if len(inputs) == 2 else []

    bias_dim_of_output: list[int | None] | None = None
    if bias_shape is not None:
        pad = len(output) - len(bias_shape)
        bias_dim_of_output = [
            None if i < pad or bias_shape[i - pad] == 1 else i - pad for i in range(len(output))
        ]

    def with_bias(row: Row) -> Row:
        if bias_dim_of_output is None:
            return row
        head = row[0]
        bias: Placement | _ShardingPlaceholder
        if isinstance(head, _ShardingPlaceholder):
            bias_dim = bias_dim_of_output[head.dim]
            bias = Replicate() if bias_dim is None else _ShardingPlaceholder(bias_dim)
        elif isinstance(head, Partial):
            bias = Partial(head.reduce_op)
        else:
            bias = Replicate()
        return [head, bias, *row[1:]]

    rows: list[Row] = []
    for c in shared:
        rows.append(with_bias([_ShardingPlaceholder(output.index(c)), *(_ShardingPlaceholder(x.index(c)) for x in inputs)]))
    for c in contracted:
        rows.append(with_bias([Partial(), *(_ShardingPlaceholder(x.index(c)) for x in inputs)]))
    for c in first_only:
        rows.append(with_bias([_ShardingPlaceholder(output.index(c)), _ShardingPlaceholder(inputs[0].index(c)), Replicate()]))
    for c in second_only:
        rows.append(with_bias([_ShardingPlaceholder(output.index(c)), Replicate(), _ShardingPlaceholder(inputs[1].index(c))]))
    for reduce_op in _LINEAR_REDUCE_OPS:
        for position in range(len(inputs)):
            operands: Row = [Replicate() for _ in inputs]
            operands[position] = Partial(reduce_op)
            rows.append(with_bias([Partial(reduce_op), *operands]))
    if not contracted and not first_only and not second_only and len(inputs) > 1:
        for reduce_op in _LINEAR_REDUCE_OPS:
            rows.append(with_bias([Partial(reduce_op), *(Partial(reduce_op) for _ in inputs)]))
    return rows


def mm_single_dim_strategy(op: torch._ops.OpOverload, args_schema: Sequence[Any], kwargs_schema: Mapping[str, Any]) -> list[Row]:
    """``aten.mm``'s single-dim rows: ``mk,kn->mn``."""
    return gen_single_dim_einsum_strategies("mk,kn->mn")


def _with_meta(spec: DTensorSpec[Any], source: OpStrategy) -> DTensorSpec[Any]:
    meta = source.strategies[0].output_spec.tensor_meta
    return DTensorSpec(spec.mesh, tuple(spec.placements), tensor_meta=meta)


def _einsum_strategy(equation: str, operands: Sequence[OpStrategy], bias: OpStrategy | None = None) -> OpStrategy:
    """PyTorch's candidates for ``equation`` over ``operands`` (and an added, broadcast ``bias`` first), with costs."""
    mesh = operands[0].mesh
    kept: list[OpSpec] = []
    for candidate in gen_einsum_strategies(equation, mesh).strategies:
        assert candidate.input_specs is not None
        inputs = [_with_meta(spec, source) for spec, source in zip(candidate.input_specs, operands)]
        sources = list(operands)
        if bias is not None:
            output_shape = _product_shape(equation, operands)
            inputs.insert(0, _broadcast_spec(candidate.output_spec, output_shape, bias))
            sources.insert(0, bias)
        if not all(spec.tensor_meta is None or is_tensor_shardable(spec.tensor_meta.shape, spec) for spec in inputs):
            continue
        costs = [generate_redistribute_costs(source, spec) for source, spec in zip(sources, inputs)]
        kept.append(OpSpec(output_specs=candidate.output_spec, input_specs=inputs, redistribute_cost=costs))
    return OpStrategy(kept)


def _product_shape(equation: str, operands: Sequence[OpStrategy]) -> list[int]:
    inputs, output = EinsumDims.parse_equation(equation)
    extents: dict[str, int] = {}
    for labels, operand in zip(inputs, operands):
        meta = operand.strategies[0].output_spec.tensor_meta
        assert meta is not None, "matrix strategies need the operands' tensor_meta"
        extents.update(zip(labels, meta.shape))
    return [extents[label] for label in output]


def _broadcast_spec(output: DTensorSpec[Any], output_shape: Sequence[int], bias: OpStrategy) -> DTensorSpec[Any]:
    """The bias laid out as the output is, through broadcasting: a sharded output dim the bias lacks (or
    has as 1) leaves the bias replicated on that mesh dim; a Partial output asks for a Partial bias."""
    meta = bias.strategies[0].output_spec.tensor_meta
    assert meta is not None, "addmm's bias needs its tensor_meta"
    pad = len(output_shape) - len(meta.shape)
    placements: list[Placement] = []
    for placement in output.placements:
        if isinstance(placement, Shard):
            bias_dim = placement.dim - pad
            keeps = bias_dim >= 0 and meta.shape[bias_dim] != 1
            placements.append(Shard(bias_dim) if keeps else Replicate())
        else:
            placements.append(placement)
    return DTensorSpec(output.mesh, tuple(placements), tensor_meta=meta)


def _operand_strategies(op_schema: OpSchema, count: int) -> list[OpStrategy]:
    found = [arg for arg in op_schema.args_schema if isinstance(arg, OpStrategy)]
    if len(found) < count:
        raise ValueError(f"{op_schema.op}: expected {count} OpStrategy arguments, got {len(found)}")
    return found[:count]


def mm_strategy(op_schema: OpSchema) -> OpStrategy:
    """``aten.mm``'s candidates: ``mk,kn->mn``."""
    return _einsum_strategy("mk,kn->mn", _operand_strategies(op_schema, 2))


def bmm_strategy(op_schema: OpSchema) -> OpStrategy:
    """``aten.bmm``'s candidates: ``bmk,bkn->bmn``."""
    return _einsum_strategy("bmk,bkn->bmn", _operand_strategies(op_schema, 2))


def addmm_strategy(op_schema: OpSchema) -> OpStrategy:
    """``aten.addmm(bias, mat1, mat2)``'s candidates: ``mk,kn->mn`` with the bias laid out as the output, broadcast."""
    bias, first, second = _operand_strategies(op_schema, 3)
    return _einsum_strategy("mk,kn->mn", [first, second], bias=bias)
