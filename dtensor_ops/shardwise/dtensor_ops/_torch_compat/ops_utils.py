"""PyTorch's ``torch.distributed.tensor._ops.utils`` helpers that tests and users import."""

from __future__ import annotations

from typing import Any, Iterable

from shardwise.placement import DTensorSpec, Placement, Replicate
from shardwise.placement import normalize_dim as _normalize_dim

from .op_schema import (
    OpSchema,
    OpStrategy,
    StrategyType,
    expand_to_full_mesh_op_strategy,
    generate_redistribute_costs,
    is_tensor_shardable,
    register_op_strategy,
    register_prop_rule,
)

__all__ = [
    "expand_to_full_mesh_op_strategy",
    "generate_redistribute_costs",
    "is_tensor_partial",
    "is_tensor_shardable",
    "normalize_dim",
    "prod",
    "register_op_strategy",
    "register_prop_rule",
    "replicate_op_strategy",
]


def prod(xs: Iterable[int]) -> int:
    """The product of ``xs`` (1 for none): PyTorch's helper, which its LocalTensorMode imports from here."""
    result = 1
    for x in xs:
        result = result * x
    return result


def normalize_dim(dim: int, ndim: int) -> int:
    """``dim`` counted from the front (``dim + ndim`` for negative dims); raises for dims out of range."""
    return _normalize_dim(dim, ndim)


def is_tensor_partial(spec: DTensorSpec[Any]) -> bool:
    """Whether any mesh dim of ``spec`` holds a ``Partial`` placement."""
    return any(placement.is_partial() for placement in spec.placements)


def replicate_op_strategy(op_schema: OpSchema) -> StrategyType:
    """A strategy for any op: every input and every tensor output replicated on every mesh dim.

    Refused for view ops (a replicated view would not alias the sharded input) and for ops returning a
    list of tensors (how many depends on the values), as PyTorch's.
    """
    inputs = [*op_schema.args_strategy, *op_schema.kwargs_strategy]
    returns = [str(ret.type) for ret in op_schema.op._schema.returns]
    if op_schema.op.is_view:
        raise RuntimeError(f"replicate_op_strategy: {op_schema.op} is a view op; a replicated result would not be a view of its input")
    if "List[Tensor]" in returns:
        raise RuntimeError(
            f"replicate_op_strategy: {op_schema.op} returns a list of tensors, whose length may depend on the input values"
        )
    if not inputs:
        raise RuntimeError(f"replicate_op_strategy: {op_schema.op} has no DTensor input to take the mesh from")
    tensor_outputs = returns.count("Tensor")
    all_replicated: list[Placement | None] = [Replicate() for _ in range(tensor_outputs + len(inputs))]
    strategy: OpStrategy = expand_to_full_mesh_op_strategy(inputs[0].mesh, op_schema, [all_replicated], input_index=tensor_outputs)
    return strategy
