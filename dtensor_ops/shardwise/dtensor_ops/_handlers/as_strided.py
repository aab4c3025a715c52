"""``as_strided``, ``as_strided_copy`` and ``as_strided_scatter`` on DTensors.

``as_strided`` addresses the *storage* of the whole tensor by sizes, strides and an offset, which
no shard can interpret alone. What holds:

* the identity (the tensor's own sizes, strides and offset) is an alias, whatever the placements
  (as PyTorch's DTensor allows);
* a DTensor whose every placement is ``Replicate()`` and whose local tensor lays the whole tensor out
  as the global strides say (storage offset 0: the wrapper's) runs the plain op on its local tensor:
  the same storage arithmetic as plain torch on the full tensor;
* ``as_strided_copy`` and ``as_strided_scatter`` (results are new tensors) gather a sharded or
  Partial input first, when the global layout is row-major (the gathered tensor's layout);
* ``as_strided`` itself on a non-replicated row-major DTensor goes to its rule (``_ops/shape_extra``:
  inputs gathered), whose result dispatch marks as a view of a redistributed copy, so that in-place
  writes through it raise instead of being lost; on a non-row-major one it raises before any
  collective (the gathered tensor's storage would not be the one as_strided addresses).
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.mesh import DeviceMesh, MeshError
from shardwise.placement import DTensorSpec, Replicate, TensorMeta, contiguous_strides

from .._dtensor import DTensor, new_dtensor
from .._op_handlers import OpHandler
from .._ops.nn_ops import bound_arguments
from .._plan_executor import redistribute_local_tensor

__all__ = ["AS_STRIDED_HANDLERS"]

aten = torch.ops.aten


def _replicated(spec: DTensorSpec[DeviceMesh]) -> bool:
    return all(placement.is_replicate() for placement in spec.placements)


def _whole_local(op: torch._ops.OpOverload, tensor: DTensor, *, gather: bool) -> torch.Tensor:
    """This DTensor's whole tensor laid out as its global strides say, without communication when it is
    replicated; gathered when ``gather`` (else the view error)."""
    spec = tensor._spec
    meta = spec.tensor_meta
    assert meta is not None
    local = tensor._local_tensor
    if _replicated(spec):
        if tuple(local.stride()) == tuple(meta.stride) and local.storage_offset() == 0:
            return local
        if tuple(meta.stride) == contiguous_strides(meta.shape):
            return local.contiguous()
        raise RuntimeError(
            f"{op}: this replicated DTensor's local tensor has strides {tuple(local.stride())} and storage offset "
            f"{local.storage_offset()}, its global strides are {tuple(meta.stride)}: the storage positions as_strided "
            "addresses would not be plain torch's. Expected a row-major DTensor (call .contiguous() first)"
        )
    if tuple(meta.stride) != contiguous_strides(meta.shape):
        raise RuntimeError(
            f"{op}: the DTensor's global strides {tuple(meta.stride)} are not row-major, so the storage positions "
            "as_strided addresses are not those of the gathered tensor. Expected a row-major DTensor (call "
            ".contiguous() first)"
        )
    if not gather:
        raise RuntimeError(
            f"{op}: as_strided addresses the storage of the whole tensor, which a DTensor with placements "
            f"{spec.placements} does not hold on any rank; its result would be a view of a gathered copy, where "
            "in-place writes are lost. Expected replicated placements: redistribute to Replicate() first, or use "
            "as_strided_copy"
        )
    target = DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim, meta)
    return redistribute_local_tensor(local, spec, target)


def _wrap_replicated(mesh: DeviceMesh, out: torch.Tensor) -> DTensor:
    meta = TensorMeta(out.shape, tuple(out.stride()), out.dtype)
    return new_dtensor(out, DTensorSpec(mesh, (Replicate(),) * mesh.ndim, meta))


def _as_strided(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensor, size, stride, storage_offset = bound_arguments(op, args, kwargs)
    if not isinstance(tensor, DTensor):
        return NotImplemented
    offset = 0 if storage_offset is None else int(storage_offset)
    if tuple(tensor.shape) == tuple(size) and tuple(tensor.stride()) == tuple(stride) and offset == 0:
        alias = aten.alias.default if op is aten.as_strided.default else aten.clone.default
        return alias(tensor)
    meta = tensor._spec.tensor_meta
    assert meta is not None
    if (
        op is aten.as_strided.default
        and not _replicated(tensor._spec)
        and tuple(meta.stride) == contiguous_strides(meta.shape)
    ):
        # The gathered view: the rule's decision (cached by spec, as this choice is), so that dispatch marks
        # the result as a view of a redistributed copy (in-place writes into it raise instead of being lost).
        return NotImplemented
    whole = _whole_local(op, tensor, gather=op is not aten.as_strided.default)
    return _wrap_replicated(tensor._spec.mesh, op(whole, size, stride, storage_offset))


def _as_strided_scatter(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensor, source, size, stride, storage_offset = bound_arguments(op, args, kwargs)
    if not isinstance(tensor, DTensor):
        return NotImplemented
    if not isinstance(source, DTensor):
        raise RuntimeError(
            f"{op}: got mixed torch.Tensor and DTensor arguments (src is a {type(source).__name__}); "
            "expected src as a DTensor on the same mesh"
        )
    if source._spec.mesh != tensor._spec.mesh:
        raise MeshError(f"{op}: self and src live on different meshes; expected one mesh")
    # Both checked before either is gathered (so that no rank enters a collective alone).
    for value in (tensor, source):
        meta = value._spec.tensor_meta
        assert meta is not None
        if not _replicated(value._spec) and tuple(meta.stride) != contiguous_strides(meta.shape):
            _whole_local(op, value, gather=True)  # raises the row-major error
    whole_self = _whole_local(op, tensor, gather=True)
    whole_source = _whole_local(op, source, gather=True)
    return _wrap_replicated(tensor._spec.mesh, op(whole_self, whole_source, size, stride, storage_offset))


AS_STRIDED_HANDLERS: dict[torch._ops.OpOverload, OpHandler] = {
    aten.as_strided.default: _as_strided,
    aten.as_strided_copy.default: _as_strided,
    aten.as_strided_scatter.default: _as_strided_scatter,
}
