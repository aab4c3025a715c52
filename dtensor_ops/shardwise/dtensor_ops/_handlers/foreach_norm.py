"""``_foreach_norm`` on DTensors: the norm of every (whole, global) tensor of a list, for ``clip_grad_norm_``.

A 2-norm of a sharded tensor is not any reduction of its shards' 2-norms, so this is an op
handler, not a sharding rule: each rank sums ``|x|^p`` of its shards (max/min of ``|x|`` for
``p = ±inf``, the count of non-zeros for ``p = 0``), the values of all tensors sharded on the same
mesh dims are reduced together in ONE all_reduce per such mesh dim (``_collectives``), and the
p-th root is taken; mesh dims where a tensor is replicated take no part (nothing is counted
twice).  ``clip_grad_norm_`` costs one all_reduce on a tensor-parallel model.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from shardwise.mesh import MeshError
from shardwise.placement import DTensorSpec, Partial, Replicate, Shard, TensorMeta, _StridedShard

from .._collectives import all_reduce_along_mesh_dim
from .._dtensor import DTensor, new_dtensor
from .._implicit_replication import is_implicit_replication_enabled
from .._ops.foreach_ops import named_arguments
from .._plan_executor import redistribute_local_tensor

__all__ = ["FOREACH_NORM_HANDLERS", "norms_across_shards"]

aten = torch.ops.aten
OpOverload = torch._ops.OpOverload


def _real_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype.to_real() if dtype.is_complex else dtype


def _accumulation_dtype(dtype: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    if requested is not None:
        return requested
    real = _real_dtype(dtype)
    # Half-precision partial sums lose digits at every step of the cross-rank sum: accumulate in float32.
    return torch.float32 if real in (torch.float16, torch.bfloat16) else real


_EMPTY_NORM_MESSAGE = "cannot compute the {} norm of an empty tensor (global shape {}): the operation has no identity"


def norms_across_shards(
    tensors: Sequence[torch.Tensor], ord: float = 2.0, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """The vector ``ord``-norm of each (whole, global) tensor, as a 0-dim replicated DTensor.

    ``tensors`` are DTensors on one mesh (0-dim plain tensors, and any plain tensor inside
    ``implicit_replication()``, count as replicated).  Partial inputs are reduced first (the norm
    is not linear).  Each rank sums ``|x|^ord`` over its shards (max/min of ``|x|`` for
    ``ord = ±inf``, the count of non-zeros for ``ord = 0``); the values of all tensors sharded on
    the same mesh dims are reduced together, one all_reduce per such mesh dim; replicated mesh
    dims are not reduced (no tensor is counted twice).  Errors are raised before any collective.
    """
    if not tensors:
        raise ValueError("norms_across_shards: expected at least one tensor, got an empty list")
    mesh = next((tensor._spec.mesh for tensor in tensors if isinstance(tensor, DTensor)), None)
    if mesh is None:
        raise TypeError("norms_across_shards: expected DTensors, got only plain tensors")
    order = float(ord)
    reduce_op = "max" if order == math.inf else "min" if order == -math.inf else "sum"

    specs: list[DTensorSpec[Any]] = []
    locals_: list[torch.Tensor] = []
    for index, tensor in enumerate(tensors):
        if isinstance(tensor, DTensor):
            if tensor._spec.mesh != mesh:
                raise MeshError(
                    f"norms_across_shards: tensor {index} lives on {tensor._spec.mesh!r}, tensor 0 on {mesh!r}; "
                    "expected every DTensor on the same device mesh"
                )
            specs.append(tensor._spec)
            locals_.append(tensor._local_tensor)
        elif isinstance(tensor, torch.Tensor) and (tensor.dim() == 0 or is_implicit_replication_enabled()):
            replicated = (Replicate(),) * mesh.ndim
            specs.append(DTensorSpec(mesh, replicated, TensorMeta(tensor.shape, tuple(tensor.stride()), tensor.dtype)))
            locals_.append(tensor)
        else:
            raise RuntimeError(
                f"norms_across_shards: tensor {index} is a plain torch.Tensor of shape {tuple(tensor.shape)} mixed "
                "with DTensors; convert it with distribute_tensor / DTensor.from_local or use implicit_replication()"
            )
        if reduce_op != "sum" and math.prod(specs[-1].shape) == 0:
            raise RuntimeError(_EMPTY_NORM_MESSAGE.format(order, tuple(specs[-1].shape)))

    # Partial parts must be summed (or maxed) before a norm can be taken.
    for index, spec in enumerate(specs):
        if spec.has_partial():
            reduced = tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)
            target = spec.with_placements(reduced)
            locals_[index] = redistribute_local_tensor(locals_[index], spec, target)
            specs[index] = target

    output_dtypes = [dtype if dtype is not None else _real_dtype(spec.dtype) for spec in specs]
    values = [
        _local_norm_part(local, order, _accumulation_dtype(spec.dtype, dtype)) for local, spec in zip(locals_, specs)
    ]

    groups: dict[tuple[tuple[int, ...], torch.dtype], list[int]] = {}
    for index, spec in enumerate(specs):
        sharded_mesh_dims = tuple(dim for dim, p in enumerate(spec.placements) if isinstance(p, (Shard, _StridedShard)))
        if sharded_mesh_dims:
            groups.setdefault((sharded_mesh_dims, values[index].dtype), []).append(index)
    for (mesh_dims, _), members in groups.items():
        stacked = torch.stack([values[index] for index in members])
        for mesh_dim in mesh_dims:
            stacked = all_reduce_along_mesh_dim(stacked, reduce_op, mesh, mesh_dim)
        for position, index in enumerate(members):
            values[index] = stacked[position]

    results: list[torch.Tensor] = []
    for value, output_dtype in zip(values, output_dtypes):
        if reduce_op == "sum" and order not in (0.0, 1.0):
            value = value.pow(1.0 / order)
        local = value.to(output_dtype)
        results.append(new_dtensor(local, _replicated_scalar_spec(mesh, output_dtype)))
    return results


def _local_norm_part(local: torch.Tensor, order: float, accumulate_in: torch.dtype) -> torch.Tensor:
    """This rank's contribution: sum |x|^p, the count of non-zeros (p = 0), or max/min |x| (p = ±inf)."""
    if order in (math.inf, -math.inf):
        if local.numel() == 0:  # an empty shard: the reduction's identity (norms are never negative)
            return torch.tensor(0.0 if order > 0 else math.inf, dtype=accumulate_in, device=local.device)
        return torch.linalg.vector_norm(local, order, dtype=accumulate_in)
    if order == 0.0:
        return torch.linalg.vector_norm(local, 0.0, dtype=accumulate_in)
    (part,) = torch._foreach_powsum([local], order, dtype=accumulate_in)
    return part


def _replicated_scalar_spec(mesh: Any, dtype: torch.dtype) -> DTensorSpec[Any]:
    return DTensorSpec(mesh, (Replicate(),) * mesh.ndim, TensorMeta(torch.Size(()), (), dtype))


def _foreach_norm_handler(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    named = named_arguments(op, args, kwargs)
    tensors = named["self"]
    order = named.get("ord", 2)
    dtype = named.get("dtype")
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{op}: expected a list of tensors, got {type(tensors).__name__}")
    if not isinstance(order, (int, float)) or isinstance(order, bool):
        raise TypeError(f"{op}: ord must be a real number, got {order!r}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"{op}: dtype must be a torch.dtype or None, got {dtype!r}")
    # As PyTorch's: the tensors may live on different meshes (parameters of an FSDP x TP model that are
    # not tensor-parallel live on the data-parallel mesh alone); each mesh's tensors are reduced together.
    by_mesh: dict[Any, list[int]] = {}
    for index, tensor in enumerate(tensors):
        if isinstance(tensor, DTensor):
            by_mesh.setdefault(tensor._spec.mesh, []).append(index)
    if len(by_mesh) <= 1:
        return norms_across_shards(list(tensors), float(order), dtype)
    first_group = next(iter(by_mesh.values()))
    first_group.extend(index for index, tensor in enumerate(tensors) if not isinstance(tensor, DTensor))
    results: list[torch.Tensor | None] = [None] * len(tensors)
    for members in by_mesh.values():
        members.sort()
        for index, norm in zip(members, norms_across_shards([tensors[i] for i in members], float(order), dtype)):
            results[index] = norm
    return results


FOREACH_NORM_HANDLERS = {aten._foreach_norm.Scalar: _foreach_norm_handler}
