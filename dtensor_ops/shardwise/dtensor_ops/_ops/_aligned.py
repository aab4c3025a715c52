"""Small helpers shared by the op families added for op coverage: strategies that keep chosen dims
aligned across inputs and outputs, the all-replicated strategy, and the exactness check for kernels
that refuse empty inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta

from .._rules import OneDimStrategy, OpCall, PlacementsPerTensor
from .reduction import every_sharded_piece_nonempty

__all__ = [
    "EmptyPieceResult",
    "aligned_strategy",
    "argument_location",
    "empty_piece_kernel",
    "free_dim_strategies",
    "outputs_on",
    "pieces_nonempty",
    "replicated_strategy",
    "shard_or_replicate",
]


def shard_or_replicate(dim: int | None) -> Placement:
    return Replicate() if dim is None else Shard(dim)


def replicated_strategy(call: OpCall) -> OneDimStrategy:
    """Every input replicated, every tensor output replicated (None for a non-tensor output)."""
    outputs = tuple(None if meta is None else Replicate() for meta in call.output_metas)
    return OneDimStrategy(outputs, (Replicate(),) * len(call.input_specs))


def aligned_strategy(
    call: OpCall, input_dims: Sequence[int | None], output_dims: Sequence[int | None]
) -> OneDimStrategy:
    """Shard(d) where a dim is named, Replicate where None; non-tensor outputs stay None."""
    outputs = tuple(
        None if meta is None else shard_or_replicate(dim) for meta, dim in zip(call.output_metas, output_dims)
    )
    return OneDimStrategy(outputs, tuple(shard_or_replicate(dim) for dim in input_dims))


def free_dim_strategies(call: OpCall, free_dims: Sequence[int], offset_outputs: int = 0) -> list[OneDimStrategy]:
    """For a single-input op: each ``free`` input dim ``d`` sharded gives every tensor output sharded on
    ``d + offset_outputs``; then all replicated."""
    strategies = [
        aligned_strategy(call, (dim,), (dim + offset_outputs,) * len(call.output_metas)) for dim in free_dims
    ]
    strategies.append(replicated_strategy(call))
    return strategies


def pieces_nonempty(call: OpCall, inputs: PlacementsPerTensor, outputs: object = None) -> bool:
    """Whether no rank gets an empty piece of a sharded dim of any input (for kernels that reject
    empty inputs: a rank with an empty shard would raise while the others wait in a collective)."""
    mesh_shape = tuple(call.mesh.shape)
    for index, placements in enumerate(inputs):
        sharded = frozenset(p.dim for p in placements if isinstance(p, Shard))
        if sharded and not every_sharded_piece_nonempty(call.input_shape(index), mesh_shape, placements, sharded):
            return False
    return True


def argument_location(call: OpCall, position: int, name: str) -> int | str:
    """Where the local call takes a *required* argument: its position when given positionally, else its
    name (an optional argument left out has no slot to override: use a local kernel for those)."""
    return position if position < len(call.args) else name


@dataclass(frozen=True)
class EmptyPieceResult:
    """Stands in for an op on a rank whose piece of a sharded input is empty.

    Many kernels (FFT, pooling, batch norm) reject empty inputs although the global tensors are not
    empty; this rank's outputs are then empty too, of known local shapes, so they are made here
    instead (every other rank runs the op itself).  They hold zeros: a Partial(sum) output of a
    contraction over an empty piece is zero.  (No family using this gives Partial(max/min) outputs.)
    """

    local_shapes: tuple[tuple[int, ...] | None, ...]
    dtypes: tuple[torch.dtype | None, ...]
    single: bool

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        device = next(
            (value.device for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)),
            torch.device("cpu"),
        )
        outputs = [
            # zeros, not empty memory: an output that is Partial(sum) on this mesh dim (a contraction over the
            # empty piece) must contribute nothing to the sum
            None if shape is None or dtype is None else torch.zeros(shape, dtype=dtype, device=device)
            for shape, dtype in zip(self.local_shapes, self.dtypes)
        ]
        return outputs[0] if self.single else tuple(outputs)


def empty_piece_kernel(
    call: OpCall, inputs: PlacementsPerTensor, outputs: tuple[DTensorSpec[Any] | None, ...]
) -> EmptyPieceResult | None:
    """``EmptyPieceResult`` for this rank when sharding left it an empty piece of a dim that is not
    empty globally (the plain op on the global tensors does not see such an empty dim)."""
    for spec, placements in zip(call.input_specs, inputs):
        if not any(isinstance(p, Shard) for p in placements):
            continue
        local = spec.with_placements(placements).local_shape()
        if any(size == 0 and whole > 0 for size, whole in zip(local, spec.shape)):
            break
    else:
        return None
    for output in outputs:
        # Only outputs this rank holds nothing of, or its (zero) share of a sum, can be made up; a replicated
        # output (a bias gradient summed over the batch) needs the real op.
        if output is None:
            continue
        holds_elements = 0 not in output.local_shape()
        if holds_elements and not any(p == Partial("sum") for p in output.placements):
            return None
    shapes = tuple(None if spec is None else tuple(spec.local_shape()) for spec in outputs)
    dtypes = tuple(None if spec is None or spec.tensor_meta is None else spec.tensor_meta.dtype for spec in outputs)
    return EmptyPieceResult(shapes, dtypes, call.structure == "single")


def _as_tensor(value: object, device: str) -> object:
    if isinstance(value, DTensorSpec):
        meta = value.tensor_meta
        assert meta is not None
        if device == "meta":
            return torch.empty_strided(tuple(meta.shape), tuple(meta.stride), dtype=meta.dtype, device="meta")
        return torch.zeros(tuple(meta.shape), dtype=meta.dtype).as_strided(tuple(meta.shape), tuple(meta.stride))
    if isinstance(value, torch.Tensor):
        return value.to("meta") if device == "meta" else value
    if isinstance(value, list):
        return [_as_tensor(item, device) for item in value]
    if isinstance(value, tuple):
        return tuple(_as_tensor(item, device) for item in value)
    return value


def _metas_of(result: object) -> TensorMeta | tuple[TensorMeta | None, ...] | None:
    if isinstance(result, torch.Tensor):
        return TensorMeta(result.shape, tuple(result.stride()), result.dtype)
    if isinstance(result, (list, tuple)):
        return tuple(
            TensorMeta(item.shape, tuple(item.stride()), item.dtype) if isinstance(item, torch.Tensor) else None
            for item in result
        )
    return None


def outputs_on(
    op: torch._ops.OpOverload, args: Sequence[object], kwargs: Mapping[str, object], device: str
) -> TensorMeta | tuple[TensorMeta | None, ...] | None:
    """Output metadata of ``op`` run once on ``device`` tensors of the inputs' global shapes (``"meta"``;
    or ``"cpu"`` zeros for ops without a meta kernel whose output shapes do not depend on values)."""
    result = op(*[_as_tensor(arg, device) for arg in args], **{k: _as_tensor(v, device) for k, v in kwargs.items()})
    return _metas_of(result)
