"""PyTorch's ``torch.distributed.tensor._ops._matrix_ops`` single-dim strategy vocabulary.

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

from shardwise.placement import Partial, Placement, Replicate

from .op_schema import _ShardingPlaceholder

__all__ = ["gen_single_dim_einsum_strategies", "mm_single_dim_strategy"]

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
