"""Public entry points that build DTensors from plain tensors and modules.

``distribute_tensor`` scatters a global tensor to its shards (data taken from
``src_data_rank``), ``distribute_module`` turns a module's parameters and
buffers into DTensors and installs input/output hooks, and
``implicit_replication`` lets plain tensors mix with DTensors.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from shardwise.mesh import DeviceMesh
from shardwise.mesh import _simulation as simulation
from shardwise.placement import (
    DTensorSpec,
    Placement,
    Replicate,
    TensorMeta,
    _StridedShard,
    select_local_shard,
    strides_in_local_dim_order,
)

from ._conversions import _FromTorchTensor, _ToTorchTensor
from ._dtensor import DTensor, new_dtensor
from ._plan_executor import gradient_placements
from ._implicit_replication import implicit_replication
from ._placement_args import normalize_placements, resolve_device_mesh
from ._src_data import agree_on_source_meta, distribute_local_data, distribute_simulated

__all__ = [
    "distribute_tensor",
    "distribute_module",
    "implicit_replication",
    "resolve_device_mesh",
]


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Lay the global ``tensor`` out over ``device_mesh`` with ``placements`` (default: all Replicate).

    The data comes from the rank at index ``src_data_rank`` along each mesh dim
    (scattered for ``Shard``, broadcast for ``Replicate``), so every rank ends up
    with consistent pieces even if their inputs differ.  With ``src_data_rank=None``
    every rank cuts its own ``tensor`` without communicating.  A tensor that
    requires grad must be a leaf; the result is then a leaf DTensor requiring
    grad.  Uneven shards follow ``torch.chunk``.  Meta tensors are laid out
    without communication.

    With ``src_data_rank`` set the result is the source's tensor, its shape, stride and dtype
    included (one small broadcast per mesh dim tells every rank what they are): a rank passing
    a tensor of another shape or dtype gets a warning and the source's data, never memory that
    nobody wrote.
    """
    torch._C._log_api_usage_once("shardwise.dtensor_ops.distribute_tensor")
    mesh = resolve_device_mesh(device_mesh, "distribute_tensor")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"distribute_tensor expects a torch.Tensor, got {type(tensor).__name__}")
    # The leaf check first, as PyTorch's: code matching on its error sees it even with bad placements.
    if tensor.requires_grad and not tensor.is_leaf:
        raise RuntimeError(
            "`distribute_tensor` should be used to distribute leaf tensors! but found a non-leaf tensor "
            f"(grad_fn={type(tensor.grad_fn).__name__}); distribute the leaf and run the computation on the "
            "DTensor, or call .detach() first"
        )
    target = normalize_placements(placements, mesh, tensor.ndim, "distribute_tensor")
    if src_data_rank is not None:
        for mesh_dim, size in enumerate(mesh.shape):
            if not 0 <= src_data_rank < size:
                raise ValueError(
                    f"distribute_tensor: src_data_rank={src_data_rank} is not a valid index along mesh dim "
                    f"{mesh_dim} of size {size} (mesh {mesh}); expected 0 <= src_data_rank < {size}, or None"
                )

    if isinstance(tensor, DTensor):
        if tensor.device_mesh != mesh:
            raise ValueError(
                f"Cannot distribute a DTensor with device mesh {tensor.device_mesh} to a different device mesh "
                f"{mesh}."
            )
        if tensor.placements != target:
            raise ValueError(
                f"Cannot distribute a DTensor with placements {tensor.placements} to a different placements "
                f"{target}. Do you want to call `redistribute` instead?"
            )
        return tensor

    requires_grad = tensor.requires_grad
    data = tensor.detach()
    if data.device.type != mesh.device_type and not data.is_meta:
        data = data.to(mesh.device_type)
    simulated = simulation.simulated_view()
    if isinstance(simulated, frozenset) and not data.is_meta:
        # Every rank simulated in this process (torch's LocalTensorMode): no collective needed.
        local, meta = distribute_simulated(data, mesh, target, src_data_rank, simulated)
        return new_dtensor(local.requires_grad_(requires_grad), DTensorSpec(mesh, target, meta), requires_grad=requires_grad)
    source_meta: TensorMeta | None = None
    if src_data_rank is not None and not data.is_meta and mesh.get_coordinate() is not None:
        # The result is the source's tensor: its shape, stride and dtype too, on every rank.
        source_meta = agree_on_source_meta(data, mesh, src_data_rank)
        meta = source_meta
        if len(meta.shape) != data.ndim:
            # This rank's tensor has another number of dims than the source's (a user error, warned
            # about): negative Shard dims must count from the source's dims, as on the source.
            target = normalize_placements(placements, mesh, len(meta.shape), "distribute_tensor")
    else:
        # The global stride follows the layout of the tensor being distributed, which every rank holds with
        # the same layout; a shard's own strides can differ per rank where it has a size-1 or empty dim.
        meta = TensorMeta(data.shape, strides_in_local_dim_order(data, data.shape), data.dtype)
    # Built before the data moves: a placement that cannot hold this dtype fails here, on every rank.
    spec = DTensorSpec(mesh, target, meta)
    if any(type(p) is _StridedShard for p in target):
        # A strided piece is several ranges, which a scatter cannot send: replicate the source's
        # tensor (a broadcast per mesh dim), then select this rank's piece locally.
        replicated = distribute_local_data(data, mesh, (Replicate(),) * mesh.ndim, src_data_rank, source_meta)
        coordinate = mesh.get_coordinate()
        local = (
            replicated.new_empty(0)  # outside the mesh: nothing (PyTorch's tensor([]))
            if coordinate is None
            else select_local_shard(replicated, mesh.shape, coordinate, target).contiguous()
        )
    else:
        local = distribute_local_data(data, mesh, target, src_data_rank, source_meta)
    return new_dtensor(local.requires_grad_(requires_grad), spec, requires_grad=requires_grad)


# -- distribute_module ----------------------------------------------------------------------

InputFn = Callable[..., Any]
OutputFn = Callable[..., Any]
PartitionFn = Callable[[str, nn.Module, DeviceMesh], None]

_DISTRIBUTED_MARK = "_shardwise_distribute_module_applied"


def _replicate_remaining_state(module: nn.Module, mesh: DeviceMesh) -> None:
    """Every parameter and buffer of ``module`` itself that is not a DTensor yet becomes a replicated one."""
    replicate = (Replicate(),) * mesh.ndim
    for name, param in list(module._parameters.items()):
        if param is not None and not isinstance(param, DTensor):
            module.register_parameter(
                name,
                nn.Parameter(distribute_tensor(param.data, mesh, replicate), requires_grad=param.requires_grad),
            )
    for name, buffer in list(module._buffers.items()):
        if buffer is not None and not isinstance(buffer, DTensor):
            module._buffers[name] = distribute_tensor(buffer, mesh, replicate)


def _positional_parameter_count(fn: Callable[..., Any]) -> int:
    return len(inspect.signature(fn).parameters)


def distribute_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    partition_fn: PartitionFn | None = None,
    input_fn: InputFn | None = None,
    output_fn: OutputFn | None = None,
) -> nn.Module:
    """Turn ``module``'s parameters and buffers into DTensors and hook its inputs/outputs.

    ``partition_fn(name, submodule, device_mesh)`` is called on every submodule
    (``named_modules()`` order) to lay out its parameters as it likes; whatever is
    still a plain tensor afterwards is replicated.  ``input_fn(module, inputs,
    device_mesh)`` runs as a forward pre-hook and ``output_fn(module, outputs,
    device_mesh)`` as a forward hook; the older two-argument forms
    ``(inputs, device_mesh)`` / ``(outputs, device_mesh)`` still work with a
    FutureWarning.  Returns ``module`` (modified in place).
    """
    torch._C._log_api_usage_once("shardwise.dtensor_ops.distribute_module")
    mesh = resolve_device_mesh(device_mesh, "distribute_module")
    if getattr(module, _DISTRIBUTED_MARK, False):
        raise RuntimeError(
            f"distribute_module should only be called once on a module, but it was already applied to this "
            f"{type(module).__name__}"
        )
    input_arity = _checked_hook_arity(input_fn, "input_fn", "inputs")
    output_arity = _checked_hook_arity(output_fn, "output_fn", "outputs")

    for name, submodule in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, submodule, mesh)
        _replicate_remaining_state(submodule, mesh)

    if input_fn is not None:
        if input_arity == 2:
            module.register_forward_pre_hook(_LegacyInputHook(input_fn, mesh))
        else:
            module.register_forward_pre_hook(_InputHook(input_fn, mesh))
    if output_fn is not None:
        if output_arity == 2:
            module.register_forward_hook(_LegacyOutputHook(output_fn, mesh))
        else:
            module.register_forward_hook(_OutputHook(output_fn, mesh))
    setattr(module, _DISTRIBUTED_MARK, True)
    return module


def _checked_hook_arity(fn: Callable[..., Any] | None, what: str, values: str) -> int:
    if fn is None:
        return 0
    arity = _positional_parameter_count(fn)
    if arity == 2:
        warnings.warn(
            f"Deprecating {what} that takes two arguments ({values}, device_mesh); please use a {what} that "
            f"takes (module, {values}, device_mesh) instead!",
            FutureWarning,
            stacklevel=3,
        )
    elif arity != 3:
        raise ValueError(
            f"distribute_module: {what} must take (module, {values}, device_mesh) (or the deprecated "
            f"({values}, device_mesh)); got a callable with {arity} parameters"
        )
    return arity


class _InputHook:
    """Forward pre-hook calling ``input_fn(module, inputs, mesh)`` (a class, so modules stay picklable)."""

    def __init__(self, fn: InputFn, mesh: DeviceMesh) -> None:
        self.fn = fn
        self.mesh = mesh

    def __call__(self, module: nn.Module, inputs: Any) -> Any:
        return self.fn(module, inputs, self.mesh)


class _LegacyInputHook(_InputHook):
    def __call__(self, module: nn.Module, inputs: Any) -> Any:
        return self.fn(inputs, self.mesh)


class _OutputHook:
    def __init__(self, fn: OutputFn, mesh: DeviceMesh) -> None:
        self.fn = fn
        self.mesh = mesh

    def __call__(self, module: nn.Module, inputs: Any, outputs: Any) -> Any:
        return self.fn(module, outputs, self.mesh)


class _LegacyOutputHook(_OutputHook):
    def __call__(self, module: nn.Module, inputs: Any, outputs: Any) -> Any:
        return self.fn(outputs, self.mesh)



def _normalize_placements_for_grad(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """PyTorch's private helper: where a gradient goes back to by default, ``Partial`` as ``Replicate``.

    ``_FromTorchTensor`` (``DTensor.from_local``) and ``_ToTorchTensor`` (``to_local``) use this rule
    when no ``grad_placements`` are given.
    """
    return tuple(gradient_placements(tuple(placements)))


def _shard_tensor(
    full_tensor: torch.Tensor, placements: Sequence[Placement], device_mesh: DeviceMesh | None = None
) -> DTensor:
    """PyTorch's private ``_shard_tensor``: cut this rank's shard out of ``full_tensor``, no communication.

    Every rank must pass the same full tensor; ``distribute_tensor(..., src_data_rank=None)``.
    """
    return distribute_tensor(full_tensor, device_mesh, placements, src_data_rank=None)
