"""In-place view ops (``squeeze_``, ``unsqueeze_``, ``transpose_``, ``t_``): the DTensor changes shape in place.

These ops rewrite the tensor's own sizes and strides rather than its values, so the DTensor keeps
its data and takes the spec of the matching view op (``squeeze_.dim`` -> ``squeeze.dim``): the
placements follow the moved dims (``Shard(2)`` becomes ``Shard(1)`` when dim 0 is squeezed). The
view op's rule decides; when it would need the input moved (squeezing a sharded dim of size 1),
the call raises before any collective, as every in-place op whose argument would need moving does.

Three things change, together: the local tensor (the same in-place op, with the dims the *global*
shape selects: an uneven shard may hold a dim of local size 1 that is not a global singleton), the
DTensor's spec, and the wrapper's own sizes and strides (the op replayed on it as a meta tensor,
without dispatch, as ``return_and_correct_aliasing`` does for wrapper subclasses).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._mode_utils import no_dispatch

from shardwise.placement import DTensorSpec

from .._dtensor import DTensor
from .._op_handlers import OpHandler
from .._decision_pipeline import propagate_op_sharding

__all__ = ["INPLACE_VIEW_HANDLERS"]

aten = torch.ops.aten

_VIEW_OP_OF: dict[torch._ops.OpOverload, torch._ops.OpOverload] = {
    aten.squeeze_.default: aten.squeeze.default,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.transpose_.default: aten.transpose.int,
    aten.t_.default: aten.t.default,
}
_SQUEEZES = frozenset({aten.squeeze_.default, aten.squeeze_.dim, aten.squeeze_.dims})


def _positional(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """``args`` followed by the keyword arguments in schema order (these ops have no defaults to fill)."""
    if not kwargs:
        return args
    names = [argument.name for argument in op._schema.arguments]
    extra = tuple(kwargs[name] for name in names[len(args) :] if name in kwargs)
    unknown = set(kwargs) - set(names)
    if unknown:
        raise TypeError(f"{op}: unexpected keyword arguments {sorted(unknown)}; the schema takes {names}")
    return args + extra


def _global_singleton_dims(op: torch._ops.OpOverload, shape: torch.Size, rest: tuple[Any, ...]) -> list[int]:
    """The dims ``op`` (a squeeze) removes from a tensor of global ``shape``."""
    ndim = len(shape)
    if op is aten.squeeze_.default:
        requested = list(range(ndim))
    else:
        dims = rest[0] if op is aten.squeeze_.dims else [rest[0]]
        requested = [int(dim) % max(ndim, 1) for dim in dims]
    return sorted({dim for dim in requested if ndim > 0 and shape[dim] == 1})


def _inplace_view(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    call_args = _positional(op, args, kwargs)
    target = call_args[0] if call_args else None
    if not isinstance(target, DTensor):
        return NotImplemented
    rest = call_args[1:]
    view_op, view_rest = _VIEW_OP_OF[op], rest
    squeezed: list[int] = []
    if op in _SQUEEZES:
        # Decided as squeeze.dims of the global singletons: what the op removes is fixed by the global shape.
        squeezed = _global_singleton_dims(op, target.shape, rest)
        view_op, view_rest = aten.squeeze.dims, (squeezed,)
    decision = propagate_op_sharding(view_op, (target._spec, *view_rest), {})
    if decision.input_specs[0] != target._spec:
        raise RuntimeError(
            f"{op}: the rule of {view_op} needs this DTensor moved from placements "
            f"{target._spec.placements} to {decision.input_specs[0].placements}, which an in-place op cannot do "
            "(in-place operations that require placement changes are not supported); redistribute it first "
            f"(e.g. to Replicate() on the mesh dims that shard the changed dims) or use the out-of-place {view_op}"
        )
    new_spec = decision.output_specs
    if not isinstance(new_spec, DTensorSpec):
        raise RuntimeError(f"{op}: the rule of {_VIEW_OP_OF[op]} gave {new_spec!r}, expected one DTensorSpec")
    local = target._local_tensor
    if op in _SQUEEZES:
        if squeezed:
            aten.squeeze_.dims(local, squeezed)
    else:
        op(local, *rest)
    # The wrapper's sizes and strides: replay the op on it as a meta tensor, outside dispatch.
    with no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            op(target, *rest)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)
    target._spec = new_spec
    return target


INPLACE_VIEW_HANDLERS: dict[torch._ops.OpOverload, OpHandler] = {op: _inplace_view for op in _VIEW_OP_OF}
