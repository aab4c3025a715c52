"""``local_map``: run a function written for plain tensors on the local shards of DTensors."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence, Union

import torch
from torch.utils import _pytree as pytree

from shardwise.mesh import DeviceMesh
from shardwise.placement import Placement, Shard, _StridedShard, has_uneven_shards, strides_in_local_dim_order

from .._collectives import wait_local_tensor
from .._dtensor import DTensor
from .._src_data import check_and_sync_from_local

__all__ = ["local_map"]

PlacementType = Union[Sequence[Placement], None]
InputPlacements = Union[tuple[PlacementType, ...], None]
OutputPlacements = Union[PlacementType, tuple[PlacementType, ...]]


def local_map(
    func: Callable[..., Any] | None = None,
    out_placements: OutputPlacements = None,
    in_placements: InputPlacements = None,
    in_grad_placements: InputPlacements = None,
    device_mesh: DeviceMesh | None = None,
    *,
    redistribute_inputs: bool = False,
) -> Any:
    """Call ``func`` on the local pieces of its DTensor arguments and wrap its outputs as DTensors.

    As ``torch.distributed.tensor.experimental.local_map``: ``in_placements`` gives one entry per
    flattened argument (placements for a DTensor, ``None`` for anything else); a DTensor laid out
    otherwise is an error unless ``redistribute_inputs=True`` (then it is redistributed first).
    ``in_grad_placements`` are the gradient layouts handed to ``to_local``. ``out_placements``
    gives the placements of each flattened output (``None`` for a non-tensor); outputs are wrapped
    with ``DTensor.from_local`` on ``device_mesh`` (default: the DTensor arguments' mesh). When no argument is
    a DTensor, ``func``'s result is returned as it is. Without ``func``, returns a decorator.

    Uneven shards: when an input DTensor is unevenly sharded, the sharded outputs' pieces may differ in size
    between ranks too, so their global shapes are agreed from every rank's local shape (one small all-gather
    per sharded output, of each rank's dims, dtype and shape; a piece that does not fit the placements' ``torch.chunk`` layout is a
    ValueError on every rank, before any collective on the data).  PyTorch assumes even shards there, so
    each rank gets a different global shape and the next collective hangs or aborts.  With even inputs
    outputs are taken to be even, as in PyTorch (no communication).
    """
    if func is None:
        return functools.partial(
            local_map,
            out_placements=out_placements,
            in_placements=in_placements,
            in_grad_placements=in_grad_placements,
            device_mesh=device_mesh,
            redistribute_inputs=redistribute_inputs,
        )
    if not callable(func):
        raise TypeError(f"local_map: func must be callable, got {func!r}")

    @functools.wraps(func)
    def on_local_shards(*args: Any, **kwargs: Any) -> Any:
        return _call_on_local_shards(
            func, out_placements, in_placements, in_grad_placements, device_mesh, redistribute_inputs, args, kwargs
        )

    return on_local_shards


def _as_placements(value: PlacementType, what: str) -> tuple[Placement, ...]:
    if value is None:
        raise AssertionError(f"local_map: {what} expects placements but received None")
    return tuple(value)


def _call_on_local_shards(
    func: Callable[..., Any],
    out_placements: OutputPlacements,
    in_placements: InputPlacements,
    in_grad_placements: InputPlacements,
    device_mesh: DeviceMesh | None,
    redistribute_inputs: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    flat_args, args_spec = pytree.tree_flatten(args)
    for name, given in (("in_placements", in_placements), ("in_grad_placements", in_grad_placements)):
        if given is not None and len(given) != len(flat_args):
            raise AssertionError(
                f"local_map: {name} length {len(given)} does not match the number of input args {len(flat_args)}!"
            )
    mesh = device_mesh
    saw_dtensor = False
    uneven_inputs = False
    local_args: list[Any] = []
    for index, arg in enumerate(flat_args):
        if not isinstance(arg, DTensor):
            if in_placements is not None and not isinstance(arg, torch.Tensor) and in_placements[index] is not None:
                raise AssertionError(
                    f"local_map: non-Tensor input {arg!r} expects None placements but received {in_placements[index]}!"
                )
            local_args.append(arg)
            continue
        saw_dtensor = True
        if mesh is None:
            mesh = arg.device_mesh
        if in_placements is not None:
            wanted = _as_placements(in_placements[index], f"DTensor input {index}")
            if tuple(arg.placements) != wanted:
                if not redistribute_inputs:
                    raise ValueError(
                        f"local_map: arg {index} has a mismatched placements: arg placements is {arg.placements} "
                        f"but the input placements is {wanted}! If redistribute_inputs is wanted, set "
                        "redistribute_inputs=True to local_map."
                    )
                arg = arg.redistribute(placements=wanted)
        uneven_inputs = uneven_inputs or has_uneven_shards(arg.shape, arg.device_mesh.shape, arg.placements)
        if in_grad_placements is not None:
            grad = _as_placements(in_grad_placements[index], f"in_grad_placements of DTensor input {index}")
            local = arg.to_local(grad_placements=grad)
        else:
            local = arg.to_local()
        local = wait_local_tensor(local)
        local_args.append(local)
    result = func(*pytree.tree_unflatten(local_args, args_spec), **kwargs)
    if not saw_dtensor or mesh is None:
        return result
    flat_out, out_spec = pytree.tree_flatten(result)
    placements_per_output: tuple[Any, ...] = out_placements if isinstance(out_placements, tuple) else (out_placements,)
    if len(flat_out) != len(placements_per_output):
        raise AssertionError(
            "local_map requires one PlacementType be provided for each output value, received "
            f"{len(placements_per_output)} out_placements but {len(flat_out)} is expected!"
        )
    wrapped: list[Any] = []
    for index, (value, placements) in enumerate(zip(flat_out, placements_per_output)):
        if isinstance(value, torch.Tensor):
            if isinstance(value, DTensor):
                raise AssertionError(
                    f"local_map: output {index} of the function is a DTensor; it must return plain torch.Tensors"
                )
            output_placements = _as_placements(placements, f"tensor output {index}")
            if uneven_inputs and any(isinstance(p, (Shard, _StridedShard)) for p in output_placements):
                _, shape = check_and_sync_from_local(
                    value, mesh, output_placements, None, where=f"local_map output {index}", sync_replicated=False
                )
                stride = strides_in_local_dim_order(value, shape)
                wrapped.append(DTensor.from_local(value, mesh, output_placements, shape=shape, stride=stride))
            else:
                wrapped.append(DTensor.from_local(value, mesh, output_placements))
        else:
            if placements is not None:
                raise AssertionError(
                    f"local_map: non-tensor output {value!r} expects None placements but received {placements}!"
                )
            wrapped.append(value)
    return pytree.tree_unflatten(wrapped, out_spec)
