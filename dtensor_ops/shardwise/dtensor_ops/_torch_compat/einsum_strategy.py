"""PyTorch's ``torch.distributed.tensor._ops._einsum_strategy``: einsum labels and full-mesh einsum strategies.

``EinsumDims`` sorts the labels of an ``"lhs,rhs->out"`` equation into contracted, batch (in every
input and the output) and free (in one input and the output) labels, each list in alphabetical order.
``gen_einsum_strategies(equation, mesh, linearity=False)`` is PyTorch's older, full-mesh enumeration:
per mesh dim the same candidates (everything replicated; a batch label sharded everywhere; a contracted
label sharded on both inputs with a ``Partial`` output; a free label sharded on its input and the
output; with ``linearity``, everything ``Partial``), and every combination of one candidate per mesh
dim as an ``OpSpec``.  shardwise's own matrix rule chooses among the single-dim rows of
``matrix_ops.gen_single_dim_einsum_strategies`` instead; this module lists PyTorch's form.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard

from .op_schema import OpSpec, OpStrategy

__all__ = ["EinsumDims", "gen_einsum_strategies"]


@dataclass
class EinsumDims:
    contracting_dims: list[str]
    batch_dims: list[str]
    lhs_out_only_dims: list[str]
    rhs_out_only_dims: list[str]

    @classmethod
    def parse_equation(cls, equation: str) -> tuple[list[str], str]:
        """``"lhs,rhs->out"`` as ``(["lhs", "rhs"], "out")``: one or two inputs, one output."""
        operands, arrow, result = equation.partition("->")
        if not arrow:
            raise AssertionError(f"einsum equation {equation!r}: expected 'inputs->output'")
        inputs, outputs = operands.split(","), result.split(",")
        if len(inputs) > 2:
            raise AssertionError(f"einsum equation {equation!r}: at most two inputs are supported")
        if len(outputs) != 1:
            raise AssertionError(f"einsum equation {equation!r}: exactly one output is supported")
        return inputs, outputs[0]

    @classmethod
    def parse_dims(cls, input_dims: list[str], output_dim: str) -> EinsumDims:
        """Each input label's role, in alphabetical order of labels."""
        roles: dict[str, list[str]] = {"contracting": [], "batch": [], "lhs": [], "rhs": []}
        for label in sorted(set("".join(input_dims))):
            holders = [index for index, labels in enumerate(input_dims) if label in labels]
            if label not in output_dim:
                roles["contracting"].append(label)
            elif len(holders) == len(input_dims):
                roles["batch"].append(label)
            elif len(input_dims) != 2:
                raise AssertionError(f"label {label!r}: a free dimension needs two inputs")
            else:
                roles["lhs" if holders == [0] else "rhs"].append(label)
        return cls(roles["contracting"], roles["batch"], roles["lhs"], roles["rhs"])


def _one_mesh_dim_candidates(input_dims: list[str], output_dim: str, linearity: bool) -> list[list[Placement]]:
    """Rows ``[output, input 0, input 1]`` one mesh dim may take."""
    dims = EinsumDims.parse_dims(input_dims, output_dim)
    rows: list[list[Placement]] = [[Replicate() for _ in range(len(input_dims) + 1)]]
    rows += [[Shard(output_dim.index(c)), *(Shard(x.index(c)) for x in input_dims)] for c in dims.batch_dims]
    rows += [[Partial(), *(Shard(x.index(c)) for x in input_dims)] for c in dims.contracting_dims]
    rows += [[Shard(output_dim.index(c)), Shard(input_dims[0].index(c)), Replicate()] for c in dims.lhs_out_only_dims]
    rows += [[Shard(output_dim.index(c)), Replicate(), Shard(input_dims[1].index(c))] for c in dims.rhs_out_only_dims]
    if linearity:
        rows.append([Partial() for _ in range(len(input_dims) + 1)])
    return rows


def gen_einsum_strategies(equation: str, mesh: Any, *, linearity: bool = False) -> OpStrategy:
    """Every combination, one candidate row per mesh dim, as PyTorch's ``OpStrategy`` (output spec first)."""
    input_dims, output_dim = EinsumDims.parse_equation(equation)
    candidates = _one_mesh_dim_candidates(input_dims, output_dim, linearity)
    strategies: list[OpSpec] = []
    for per_mesh_dim in itertools.product(candidates, repeat=mesh.ndim):
        # per_mesh_dim[d][t]: tensor t's placement on mesh dim d.
        specs = [DTensorSpec(mesh, tuple(row[t] for row in per_mesh_dim)) for t in range(len(input_dims) + 1)]
        strategies.append(OpSpec(output_specs=specs[0], input_specs=specs[1:]))
    return OpStrategy(strategies)
