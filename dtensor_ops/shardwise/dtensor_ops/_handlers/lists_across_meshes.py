"""List ops (``_foreach_*``, fused optimizers) whose list elements live on different meshes.

An optimizer steps every parameter in one call: with expert parallelism the experts' parameters live on
their own mesh (torchtitan's ``(efsdp, ep)``) beside the dense ones (``dp_shard``), and one
``_fused_adamw_`` or ``_foreach_add_`` gets both. The elements are independent, so the call is the same
op run once per mesh on the elements of that mesh (every list cut alike), the results put back in order.
Every list argument of the same length is cut alike (tensor lists, Scalar lists). Elements at one index must share a mesh (a parameter and its gradient and state); a DTensor that is not
in a list (a tensor ``lr``) must be replicated, and is handed to every mesh's call as its local value.
One mesh: the handler declines (the op's rule decides), so only calls that mix meshes pay for it.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.mesh import MeshError

from .._dtensor import DTensor
from .._ops.foreach_ops import ELEMENT_OPS
from .._op_handlers import OpHandler

__all__ = ["LIST_MESH_HANDLERS"]

aten = torch.ops.aten
OpOverload = torch._ops.OpOverload


def _is_tensor_list(value: object) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(
        isinstance(item, torch.Tensor) or item is None for item in value
    )


def _element_meshes(op: OpOverload, lists: list[tuple[str, list[Any]]]) -> list[Any]:
    """The mesh of each list index (None where no list holds a DTensor there), checked alike across lists."""
    length = len(lists[0][1])
    meshes: list[Any] = [None] * length
    for name, items in lists:
        if len(items) != length:
            return []  # not aligned lists: not this handler's call
        for index, item in enumerate(items):
            if not isinstance(item, DTensor):
                continue
            mesh = item._spec.mesh
            if meshes[index] is None:
                meshes[index] = mesh
            elif meshes[index] != mesh:
                raise MeshError(
                    f"{op}: element {index} of its lists lives on {meshes[index]!r} in one list and on {mesh!r} in "
                    f"{name!r}; expected the elements at one index (a parameter, its gradient and its state) on one mesh"
                )
    return meshes


def _per_mesh_handler(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    schema = op._schema
    names = [argument.name for argument in schema.arguments]
    bound: dict[str, Any] = dict(zip(names, args))
    bound.update(kwargs)
    lists = [(name, list(value)) for name, value in bound.items() if _is_tensor_list(value)]
    if not lists:
        return NotImplemented
    meshes = _element_meshes(op, lists)
    distinct = []
    for mesh in meshes:
        if mesh is not None and mesh not in distinct:
            distinct.append(mesh)
    if len(distinct) <= 1:
        return NotImplemented
    groups: list[list[int]] = [[i for i, mesh in enumerate(meshes) if mesh == each] for each in distinct]
    # Indices holding no DTensor (plain tensors, replicated by the rule) go with the first mesh's call.
    groups[0].extend(i for i, mesh in enumerate(meshes) if mesh is None)
    groups[0].sort()
    shared = {name: value for name, value in bound.items() if isinstance(value, DTensor)}
    for name, value in shared.items():
        if not all(placement.is_replicate() for placement in value.placements):
            raise MeshError(
                f"{op}: its lists span {len(distinct)} meshes and {name!r} is a DTensor with {value.placements}; "
                "expected an argument shared by every element to be replicated (or a plain tensor or number)"
            )
    # Every list argument aligned with the tensor lists is cut alike (Adam's per-parameter step sizes, a
    # ScalarList, too).
    list_names = {
        argument.name
        for argument in schema.arguments
        if isinstance(argument.type, torch.ListType)
        and isinstance(bound.get(argument.name), (list, tuple))
        and len(bound[argument.name]) == len(meshes)
    }
    results: list[tuple[list[int], Any]] = []
    for indices in groups:
        call = {
            name: [value[i] for i in indices] if name in list_names else (
                value.to_local() if name in shared else value
            )
            for name, value in bound.items()
        }
        positional = [call[name] for name in names[: len(args)]]
        keywords = {name: call[name] for name in names[len(args):] if name in call}
        results.append((indices, op(*positional, **keywords)))
    first = results[0][1]
    if first is None:
        return None
    length = len(meshes)
    if isinstance(first, (list, tuple)) and first and isinstance(first[0], (list, tuple)):
        # Several output lists (out-of-place fused optimizers): each scattered back.
        outputs: list[list[Any]] = [[None] * length for _ in first]
        for indices, result in results:
            for out_list, part in zip(outputs, result):
                for i, value in zip(indices, part):
                    out_list[i] = value
        return tuple(outputs)
    merged: list[Any] = [None] * length
    for indices, result in results:
        for i, value in zip(indices, result):
            merged[i] = value
    return merged


def _fused_optimizer_ops() -> list[OpOverload]:
    found = []
    for name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_", "_fused_adam", "_fused_adamw"):
        packet = getattr(aten, name, None)
        for overload in ("default", "tensor_lr"):
            if packet is not None and hasattr(packet, overload):
                found.append(getattr(packet, overload))
    return found


LIST_MESH_HANDLERS: dict[OpOverload, OpHandler] = {
    op: _per_mesh_handler
    for op in [*ELEMENT_OPS, *_fused_optimizer_ops(), aten._foreach_powsum.Scalar]
}
