"""Ops whose output size depends on the values: ``nonzero``, ``masked_select``, ``unique`` and friends,
``repeat_interleave`` with a tensor of repeats, ``linalg_lstsq`` (residuals only for full-rank
inputs); indexing with a boolean mask (``x[mask]``, and
``index_put`` with a mask, whose values are consumed in mask order).

No rank can know the output's global shape from its own shard, and a sharding decision is cached
per input layout (so it cannot hold a value-dependent shape). These ops therefore run on the
whole tensors: every DTensor input is redistributed to ``Replicate()`` (the planner's cheapest
way: all-gathers, Partial ones reduced; it shows in ``CommDebugMode``), every rank runs the plain
op and the outputs are replicated DTensors. The same values on every rank give the same output
on every rank, so no collective is needed for the sizes. A real rule with its cost stated, never a
value computed from a part of the data.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from shardwise.mesh import DeviceMesh, MeshError
from shardwise.placement import DTensorSpec, Replicate, TensorMeta

from .._dtensor import DTensor, new_dtensor
from .._implicit_replication import is_implicit_replication_enabled
from .._op_handlers import OpHandler
from .._plan_executor import redistribute_local_tensor

__all__ = ["VALUE_SIZED_HANDLERS"]

aten = torch.ops.aten


def _replicated_spec(mesh: DeviceMesh, tensor: torch.Tensor) -> DTensorSpec[DeviceMesh]:
    return DTensorSpec(mesh, (Replicate(),) * mesh.ndim, TensorMeta(tensor.shape, tuple(tensor.stride()), tensor.dtype))


def _whole_arguments(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[DeviceMesh, tuple[Any, ...], dict[str, Any]] | None:
    """The mesh and the arguments with every DTensor replaced by its whole tensor (a replicated one by its
    own local tensor, the same object); None when no argument is a DTensor."""
    leaves = tree_flatten((args, kwargs))[0]
    dtensors = [leaf for leaf in leaves if isinstance(leaf, DTensor)]
    if not dtensors:
        return None
    mesh = dtensors[0]._spec.mesh
    for other in dtensors[1:]:
        if other._spec.mesh != mesh:
            raise MeshError(
                f"{op}: its DTensor arguments live on different meshes ({mesh} and {other._spec.mesh}); "
                "expected one mesh for every DTensor argument"
            )
    # Checked before the first redistribution, so that no rank enters a collective alone. Plain tensors count
    # as replicated where dispatch counts them so: scalars and one-element tensors, under implicit_replication
    # and in torch's own backward formulas.
    for leaf in leaves if not is_implicit_replication_enabled() else ():
        if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor) and leaf.numel() != 1:
            raise RuntimeError(
                f"{op}: got mixed torch.Tensor and DTensor arguments (a torch.Tensor of shape {tuple(leaf.shape)}); "
                "convert every torch.Tensor to a DTensor first with distribute_tensor(...) or DTensor.from_local(...)"
            )

    if op in _VALUE_CHECKED_OPS:
        # Zeros are not valid repeats for a given output_size; the argument errors these ops raise that do not
        # depend on the values are checked here, the others come from the same gathered values on every rank.
        if op is aten.repeat_interleave.Tensor and args and isinstance(args[0], torch.Tensor) and args[0].ndim != 1:
            raise RuntimeError(f"{op}: repeats must be a 1-D tensor, got {args[0].ndim} dims")
    elif any(not all(p.is_replicate() for p in dtensor._spec.placements) for dtensor in dtensors):
        _dry_run_on_zeros(op, args, kwargs)

    def whole(value: Any) -> Any:
        if not isinstance(value, DTensor):
            return value
        spec = value._spec
        target = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, spec.tensor_meta)
        if spec == target:
            return value._local_tensor
        return redistribute_local_tensor(value._local_tensor, spec, target)

    return mesh, tree_map(whole, args), tree_map(whole, kwargs)


def _dry_run_on_zeros(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Run ``op`` on zeros of the global shapes, so that torch's own argument errors (a mask of the wrong
    shape, repeats of the wrong length) are raised before any rank enters a gather. Meta tensors cannot do
    this: these ops have no meta kernels, their output sizes being value-dependent."""

    def zeros(value: Any) -> Any:
        if isinstance(value, DTensor):
            return torch.zeros(value.shape, dtype=value.dtype, device=value._local_tensor.device)
        return value

    op(*tree_map(zeros, args), **tree_map(zeros, kwargs))


def _on_whole_tensors(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    gathered = _whole_arguments(op, args, kwargs)
    if gathered is None:
        return NotImplemented
    mesh, whole_args, whole_kwargs = gathered
    result = op(*whole_args, **whole_kwargs)
    return tree_map(
        lambda out: new_dtensor(out, _replicated_spec(mesh, out)) if isinstance(out, torch.Tensor) else out, result
    )


_MASK_DTYPES = (torch.bool, torch.uint8)
_VALUE_CHECKED_OPS = frozenset({aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor})
_INDEX_OPS = (aten.index.Tensor, aten.index_put.default)
_INDEX_WRITES = (aten.index_put_.default, aten._index_put_impl_.default)


def _has_mask_index(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    indices = args[1] if len(args) > 1 else kwargs.get("indices")
    return isinstance(indices, (list, tuple)) and any(
        isinstance(index, torch.Tensor) and index.dtype in _MASK_DTYPES for index in indices
    )


def _puts_one_value(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``x[mask] = scalar``: elementwise (like masked_fill), which the indexing rule keeps sharded."""
    values = args[2] if len(args) > 2 else kwargs.get("values")
    return isinstance(values, torch.Tensor) and values.ndim == 0


def _mask_indexing(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``x[mask]`` reads (value-sized) and ``x[mask] = v`` writes: on the whole tensors. Integer indices
    go back to the indexing rules (``NotImplemented``)."""
    if not _has_mask_index(args, kwargs) or (op is aten.index_put.default and _puts_one_value(args, kwargs)):
        return NotImplemented
    return _on_whole_tensors(op, args, kwargs)


def _mask_index_write(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``index_put_`` with a mask: the written DTensor must already be replicated (an in-place op cannot move
    it); the other arguments are gathered and the write runs on the whole tensor on every rank."""
    if not _has_mask_index(args, kwargs) or _puts_one_value(args, kwargs):
        return NotImplemented
    target = args[0] if args else kwargs.get("self")
    if not isinstance(target, DTensor):
        return NotImplemented
    if any(not placement.is_replicate() for placement in target._spec.placements):
        raise RuntimeError(
            f"{op} with a boolean (mask) index writes into a DTensor with placements {target._spec.placements}: "
            "which elements the mask selects is known only on the whole tensor, so the write needs it replicated, "
            "and an in-place op cannot move it (in-place operations that require placement changes are not "
            "supported); redistribute it to Replicate() first or use the out-of-place index_put"
        )
    gathered = _whole_arguments(op, args, kwargs)
    assert gathered is not None, "the written argument is a DTensor"
    _, whole_args, whole_kwargs = gathered
    # The replicated target's whole tensor is its own local tensor: the op writes into it.
    op(*whole_args, **whole_kwargs)
    return target


_VALUE_SIZED_OPS = (
    aten.nonzero.default,
    aten.masked_select.default,
    aten.repeat_interleave.Tensor,
    aten.repeat_interleave.self_Tensor,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default,
    # residuals are returned only for full-rank inputs (gelsy/gelsd/gelss): their size depends on the values
    aten.linalg_lstsq.default,
)

VALUE_SIZED_HANDLERS: dict[torch._ops.OpOverload, OpHandler] = {
    **{op: _on_whole_tensors for op in _VALUE_SIZED_OPS},
    **{op: _mask_indexing for op in _INDEX_OPS},
    **{op: _mask_index_write for op in _INDEX_WRITES},
}
