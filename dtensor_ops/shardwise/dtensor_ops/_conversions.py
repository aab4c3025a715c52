"""The differentiable conversions between local tensors and DTensors, and ``from_local``'s checks.

``from_local``, ``to_local``, ``redistribute`` and ``full_tensor`` are autograd Functions so
that gradients flow back with the right placements (:func:`gradient_placements` of
``_redistribute`` is the one rule for where a gradient goes back to).  They sit below the
DTensor class and build their results as the class of their input (``cls``), so the class
module imports this one and not the other way round.
"""

from __future__ import annotations

from typing import Any, Sequence, TypeVar, cast

import torch
from shardwise.mesh import DeviceMesh
from shardwise.mesh._simulation import first_simulated_piece, run_for_each_simulated_rank, simulated_view
from shardwise.placement import (
    DTensorSpec,
    Placement,
    Replicate,
    TensorMeta,
    compute_local_shape,
    even_global_shape,
    strides_in_local_dim_order,
)

from ._collectives import launch_all_reduce, mesh_dim_group_name, wait
from ._placement_args import normalize_placements, resolve_device_mesh
from ._planner import StepKind, plan_redistribute
from ._plan_executor import gradient_placements, gradient_placements_for, redistribute_local_tensor
from ._src_data import check_and_sync_from_local
from ._wrapper import wrap_local_tensor

__all__ = ["from_local", "full_tensor", "redistribute", "redistribute_together", "to_local"]

_DTensorT = TypeVar("_DTensorT", bound=torch.Tensor)


def from_local(
    cls: type[_DTensorT],
    local_tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    run_check: bool = False,
    shape: Sequence[int] | None = None,
    stride: Sequence[int] | None = None,
    grad_placements: Sequence[Placement] | None = None,
) -> _DTensorT:
    """``cls.from_local``: a DTensor of class ``cls`` from each rank's local piece (see ``DTensor.from_local``).

    The arguments are checked and normalised here; the global layout is worked out inside the
    autograd Function, called with PyTorch's positional arguments (code that intercepts
    ``_FromTorchTensor.apply``, as spmd_types' checker does, sees what it sees on PyTorch) and the class.
    """
    mesh = resolve_device_mesh(device_mesh, "DTensor.from_local")
    if not isinstance(local_tensor, torch.Tensor) or hasattr(local_tensor, "_spec"):
        raise TypeError(
            f"DTensor.from_local expects a plain torch.Tensor as local_tensor, got {type(local_tensor).__name__}"
        )
    placement_tuple = normalize_placements(placements, mesh, local_tensor.ndim, "DTensor.from_local")
    grad_tuple = None
    if grad_placements is not None:
        grad_tuple = normalize_placements(
            grad_placements, mesh, local_tensor.ndim, "DTensor.from_local(grad_placements=...)"
        )
    if (shape is None) != (stride is None):
        # PyTorch's words first (code may match on them), then which one is missing.
        given, missing = ("shape", "stride") if stride is None else ("stride", "shape")
        raise RuntimeError(
            f"Please pass both shape and stride at the same time. DTensor.from_local got {given} without "
            f"{missing}: the global {missing} cannot be told from one rank's local tensor"
        )
    if mesh.device_type != local_tensor.device.type and not local_tensor.is_meta:
        local_tensor = local_tensor.to(mesh.device_type)
    return cast(
        _DTensorT,
        _FromTorchTensor.apply(local_tensor, mesh, placement_tuple, run_check, shape, stride, grad_tuple, cls),
    )


def _local_spec(
    local_tensor: torch.Tensor,
    mesh: DeviceMesh,
    placement_tuple: tuple[Placement, ...],
    run_check: bool,
    shape: Sequence[int] | None,
    stride: Sequence[int] | None,
) -> tuple[torch.Tensor, DTensorSpec[DeviceMesh], bool]:
    """The local tensor to wrap (synchronised by ``run_check``, empty outside the mesh), its global spec,
    and whether this rank is outside the mesh."""
    global_shape: tuple[int, ...] | None = tuple(shape) if shape is not None else None
    if run_check:
        local_tensor, global_shape = check_and_sync_from_local(
            local_tensor, mesh, placement_tuple, global_shape
        )
    elif global_shape is not None:
        # Per simulated rank under torch's LocalTensorMode (each checks its own piece); a plain call otherwise.
        run_for_each_simulated_rank(_check_local_shape_matches, local_tensor, mesh, placement_tuple, global_shape)
    else:
        global_shape = even_global_shape(local_tensor.shape, mesh.shape, placement_tuple)
    if len(global_shape) != local_tensor.ndim:
        raise ValueError(
            f"DTensor.from_local: shape {global_shape} has {len(global_shape)} dims but the local tensor "
            f"has {local_tensor.ndim} (shape {tuple(local_tensor.shape)})"
        )
    if stride is not None:
        global_stride = tuple(stride)
        if len(global_stride) != len(global_shape):
            raise ValueError(
                f"DTensor.from_local: stride {global_stride} and shape {global_shape} have different lengths"
            )
    else:
        # Under LocalTensorMode the pieces' layouts are read from one rank (every rank holds its piece alike).
        global_stride = strides_in_local_dim_order(first_simulated_piece(local_tensor), global_shape)
    meta = TensorMeta(torch.Size(global_shape), global_stride, local_tensor.dtype)
    spec = DTensorSpec(mesh, placement_tuple, meta)
    if simulated_view() is None and mesh.get_coordinate() is None:
        # A rank outside the mesh holds nothing (as PyTorch): an empty local tensor.
        return local_tensor.new_empty(0), spec, True
    return local_tensor, spec, False


def to_local(dtensor: Any, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
    """``dtensor.to_local()`` (see ``DTensor.to_local``).

    The local tensor of an ``nn.Parameter(DTensor)`` is marked as a parameter too (PyTorch 2.13:
    ``isinstance(p.to_local(), nn.Parameter)``), on a fresh view so the DTensor's own is not marked.
    """
    if not torch.is_grad_enabled():
        result = cast(torch.Tensor, dtensor._local_tensor)
    else:
        grad_tuple = None
        if grad_placements is not None:
            grad_tuple = normalize_placements(
                grad_placements, dtensor._spec.mesh, dtensor.ndim, "to_local(grad_placements=...)"
            )
        result = cast(torch.Tensor, _ToTorchTensor.apply(dtensor, grad_tuple))
    if getattr(dtensor, "_is_param", False) and not getattr(result, "_is_param", False):
        if result is dtensor._local_tensor:
            result = result.view_as(result)
        result._is_param = True
    return result


def redistribute(
    dtensor: _DTensorT,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    async_op: bool = False,
    forward_dtype: torch.dtype | None = None,
    backward_dtype: torch.dtype | None = None,
    allow_partial_targets: bool = False,
) -> _DTensorT:
    """``dtensor.redistribute(...)`` (see ``DTensor.redistribute``).

    ``allow_partial_targets``: users may not redistribute a non-Partial mesh dim to ``Partial``
    (the values would be split in a way they did not ask for); code that builds partial values on
    purpose (PyTorch's ``Redistribute.apply``) passes True: Replicate -> Partial is then a local step
    for every reduce op.

    ``forward_dtype``: the local tensor is cast to it before the collectives and the result
    has it. ``backward_dtype``: the gradient is cast to it before the backward collectives and
    back to this DTensor's dtype after them (default: this DTensor's dtype).
    """
    spec: DTensorSpec[DeviceMesh] = dtensor._spec  # type: ignore[attr-defined]
    mesh = spec.mesh
    if device_mesh is not None and device_mesh != mesh:
        raise NotImplementedError(
            f"redistribute across meshes is not supported: this DTensor lives on {mesh} and the target "
            f"mesh is {device_mesh}; use the same mesh (or to_local()/from_local() to move data yourself)"
        )
    if placements is None:
        # PyTorch's words first: code matching on them keeps working.
        raise RuntimeError("placements is needed for redistribute! DTensor.redistribute needs the target placements (one per mesh dim)")
    for name, dtype in (("forward_dtype", forward_dtype), ("backward_dtype", backward_dtype)):
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"DTensor.redistribute: {name} must be a torch.dtype or None, got {dtype!r}")
    target = normalize_placements(placements, mesh, dtensor.ndim, "DTensor.redistribute")
    current = spec.placements
    for mesh_dim, placement in enumerate(target):
        if placement.is_partial() and current[mesh_dim] != placement and not (
            allow_partial_targets and not current[mesh_dim].is_partial()
        ):
            raise RuntimeError(
                f"Can not redistribute from {current[mesh_dim]} to {placement}, redistributing to Partial is for "
                f"internal use only! (DTensor.redistribute, mesh dim {mesh_dim}, target placements {target})"
            )
    target_spec = DTensorSpec(mesh, target, spec.tensor_meta)
    if forward_dtype is None and backward_dtype is None:
        return cast(_DTensorT, _Redistribute.apply(dtensor, target_spec, async_op))
    input_dtype = spec.tensor_meta.dtype if spec.tensor_meta is not None else dtensor.dtype
    return cast(
        _DTensorT,
        _RedistributeInDtype.apply(
            dtensor, target_spec, async_op, forward_dtype or input_dtype, backward_dtype or input_dtype
        ),
    )


# Reduce ops whose all-reduce of a concatenation is the concatenation of the all-reduces, with no
# per-tensor step after the collective (avg divides afterwards; it goes one by one).
_COALESCED_REDUCE_OPS = frozenset({"sum", "max", "min"})


def redistribute_together(
    dtensors: Sequence[_DTensorT], placements: Sequence[Sequence[Placement]]
) -> list[_DTensorT]:
    """``[t.redistribute(t.device_mesh, p) for t, p in zip(dtensors, placements)]``, with fewer collectives.

    Where collectives are latency-bound (small tensors: the Partial gradients of norms, biases),
    one collective over the tensors' concatenation costs about one latency instead of one per
    tensor. Tensors whose whole plan is one all-reduce (``Partial`` -> ``Replicate`` on one mesh dim)
    over the same mesh dim and reduce op (sum, max, min), dtype and device run as ONE all-reduce of
    their flattened concatenation; every other tensor is redistributed on its own, in order. Every rank
    must call it with the same tensors' specs, as ``redistribute``. Not differentiable: for tensors
    that do not require grad (gradients, optimizer state), refused before any collective otherwise.
    A shardwise extension (PyTorch's DTensor has no such call).
    """
    if len(dtensors) != len(placements):
        raise ValueError(
            f"redistribute_together: {len(dtensors)} DTensors but {len(placements)} placement lists; give one per DTensor"
        )
    targets: list[DTensorSpec[DeviceMesh]] = []
    for index, dtensor in enumerate(dtensors):
        spec = getattr(dtensor, "_spec", None)
        if not isinstance(spec, DTensorSpec):
            raise TypeError(f"redistribute_together: item {index} is a {type(dtensor).__name__}, expected a DTensor")
        if dtensor.requires_grad:
            raise RuntimeError(
                f"redistribute_together: item {index} requires grad; it is not differentiable (use "
                "DTensor.redistribute for tensors in the autograd graph, or pass .detach())"
            )
        wanted = normalize_placements(placements[index], spec.mesh, dtensor.ndim, "redistribute_together")
        targets.append(DTensorSpec(spec.mesh, wanted, spec.tensor_meta))
    results: list[_DTensorT | None] = [None] * len(dtensors)
    buckets: dict[tuple[Any, ...], list[int]] = {}
    simulated = simulated_view() is not None
    for index, (dtensor, target) in enumerate(zip(dtensors, targets)):
        spec = dtensor._spec  # type: ignore[attr-defined]
        plan = () if simulated or spec.placements == target.placements else plan_redistribute(spec, target)
        if len(plan) == 1 and plan[0].kind is StepKind.ALL_REDUCE and not plan[0].joint:
            reduce_op = getattr(plan[0].before, "reduce_op", None)
            local = dtensor._local_tensor  # type: ignore[attr-defined]
            if reduce_op in _COALESCED_REDUCE_OPS:
                key = (spec.mesh, plan[0].mesh_dim, reduce_op, local.dtype, local.device)
                buckets.setdefault(key, []).append(index)
                continue
        results[index] = redistribute(dtensor, spec.mesh, target.placements)
    for (mesh, mesh_dim, reduce_op, _, _), members in buckets.items():
        if len(members) == 1:
            only = members[0]
            results[only] = redistribute(dtensors[only], mesh, targets[only].placements)
            continue
        locals_ = [dtensors[index]._local_tensor for index in members]  # type: ignore[attr-defined]
        flat = torch.cat([local.reshape(-1) for local in locals_])
        reduced = wait(launch_all_reduce(flat, reduce_op, mesh_dim_group_name(mesh, mesh_dim)))
        for index, piece in zip(members, reduced.split([local.numel() for local in locals_])):
            local = dtensors[index]._local_tensor  # type: ignore[attr-defined]
            shaped = piece.view(local.shape) if local.is_contiguous() else piece.reshape(local.shape)
            results[index] = wrap_local_tensor(type(dtensors[index]), shaped, targets[index])
    return [cast(_DTensorT, result) for result in results]


def full_tensor(dtensor: Any, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
    """``dtensor.full_tensor()`` (see ``DTensor.full_tensor``)."""
    replicated = redistribute(dtensor, placements=(Replicate(),) * dtensor._spec.mesh.ndim, async_op=False)
    return to_local(replicated, grad_placements=grad_placements)


def _check_local_shape_matches(
    local_tensor: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...], global_shape: tuple[int, ...]
) -> None:
    if len(global_shape) != local_tensor.ndim:
        raise ValueError(
            f"DTensor.from_local: shape {global_shape} has {len(global_shape)} dims but the local tensor has "
            f"{local_tensor.ndim} (shape {tuple(local_tensor.shape)})"
        )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return
    expected = compute_local_shape(global_shape, mesh.shape, coordinate, placements)
    if tuple(local_tensor.shape) != tuple(expected):
        raise ValueError(
            f"DTensor.from_local: the local tensor of shape {tuple(local_tensor.shape)} on mesh coordinate "
            f"{tuple(coordinate)} does not match global shape {global_shape} with placements {placements}: "
            f"expected local shape {tuple(expected)} (torch.chunk layout)"
        )


def _grad_to_spec(grad: Any, target_placements: tuple[Placement, ...]) -> torch.Tensor:
    """Local tensor of ``grad`` redistributed to ``target_placements`` (grad's own tensor_meta)."""
    current = grad._spec
    if current.placements == target_placements:
        return grad._local_tensor
    target = DTensorSpec(current.mesh, target_placements, current.tensor_meta)
    return redistribute_local_tensor(grad._local_tensor, current, target)


# -- autograd Functions ---------------------------------------------------------------


# The class ``_FromTorchTensor`` builds when called with PyTorch's seven arguments (no class): the
# DTensor class sits above this module, so it names itself here when it is defined.
_DEFAULT_DTENSOR_CLASS: list[type[torch.Tensor]] = []


def set_default_dtensor_class(cls: type[torch.Tensor]) -> None:
    """Called once by ``_dtensor`` with ``DTensor``: what ``_FromTorchTensor.apply`` builds without a class."""
    _DEFAULT_DTENSOR_CLASS[:] = [cls]


class _FromTorchTensor(torch.autograd.Function):
    """``DTensor.from_local`` as an autograd Function, with PyTorch's name and positional arguments.

    ``apply(local_tensor, device_mesh, placements, run_check, shape=None, stride=None,
    grad_placements=None, cls=None)``: ``placements`` (and ``grad_placements``) a tuple, normalised;
    ``cls`` (shardwise's addition, last) the DTensor class to build, ``DTensor`` when left out.
    Backward: the gradient DTensor is moved to ``grad_placements``, by default to the forward
    placements with ``Partial`` as ``Replicate``, and its local tensor returned.
    """

    @staticmethod
    def forward(
        ctx: Any,
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh,
        placements: tuple[Placement, ...],
        run_check: bool,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
        grad_placements: tuple[Placement, ...] | None = None,
        cls: type[torch.Tensor] | None = None,
    ) -> Any:
        result_class = cls if cls is not None else _DEFAULT_DTENSOR_CLASS[0]
        local, spec, outside_mesh = _local_spec(local_tensor, device_mesh, tuple(placements), run_check, shape, stride)
        ctx.spec = spec
        ctx.cls = result_class
        ctx.grad_placements = grad_placements
        # A rank outside the mesh holds an empty tensor, not linked to the caller's (it gets no gradient).
        ctx.outside_mesh = outside_mesh
        ctx.set_materialize_grads(False)
        # An alias, not the input itself: the DTensor must not share the caller's autograd identity.
        return wrap_local_tensor(result_class, local.view_as(local), spec)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        nothing = (None,) * 7
        if grad_output is None or ctx.outside_mesh:
            return (None, *nothing)
        spec: DTensorSpec[DeviceMesh] = ctx.spec
        if not isinstance(grad_output, ctx.cls):
            # Only reachable when a plain tensor gradient is handed straight back (e.g. a custom Function).
            return (grad_output, *nothing)
        target = ctx.grad_placements if ctx.grad_placements is not None else gradient_placements(spec.placements)
        return (_grad_to_spec(grad_output, tuple(target)), *nothing)


class _ToTorchTensor(torch.autograd.Function):
    """``DTensor.to_local`` as an autograd Function, with PyTorch's name and arguments:
    ``apply(dtensor, grad_placements)``.

    Backward: the local gradient is wrapped as a DTensor laid out by ``grad_placements``, by default
    the DTensor's own placements with ``Partial`` as ``Replicate`` (PyTorch 2.13: a rank's gradient
    of its partial value is the whole gradient, so ``from_local(x, [Partial()]).to_local()`` is the
    identity for gradients too).
    """

    @staticmethod
    def forward(ctx: Any, dtensor: Any, grad_placements: tuple[Placement, ...] | None) -> torch.Tensor:
        ctx.spec = dtensor._spec
        ctx.cls = type(dtensor)
        ctx.grad_placements = grad_placements
        ctx.set_materialize_grads(False)
        local = dtensor._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        if grad_output is None:
            return None, None
        spec: DTensorSpec[DeviceMesh] = ctx.spec
        placements: tuple[Placement, ...] = (
            tuple(ctx.grad_placements) if ctx.grad_placements is not None else gradient_placements(spec.placements)
        )
        meta = cast(TensorMeta, spec.tensor_meta)
        if isinstance(grad_output, ctx.cls):
            raise RuntimeError(
                "to_local(): the gradient flowing into the local tensor is itself a DTensor; the local tensor "
                "must only be used in plain-tensor computations"
            )
        grad_spec = DTensorSpec(
            spec.mesh,
            placements,
            # The gradient of a tensor has that tensor's global layout; the local gradient's strides can
            # differ per rank (size-1 dims), so they must not decide it.
            TensorMeta(meta.shape, meta.stride, grad_output.dtype),
        )
        run_for_each_simulated_rank(_check_local_gradient_shape, grad_output, grad_spec)
        return wrap_local_tensor(ctx.cls, _laid_out_like(grad_output, meta.stride), grad_spec), None


def _check_local_gradient_shape(grad_output: torch.Tensor, grad_spec: DTensorSpec[DeviceMesh]) -> None:
    coordinate = grad_spec.mesh.get_coordinate()
    if coordinate is None:
        return
    expected = grad_spec.local_shape(coordinate)
    if tuple(grad_output.shape) != tuple(expected):
        meta = cast(TensorMeta, grad_spec.tensor_meta)
        raise RuntimeError(
            f"to_local(): the local gradient has shape {tuple(grad_output.shape)} but gradient placements "
            f"{grad_spec.placements} of the global shape {tuple(meta.shape)} give local shape {tuple(expected)} on "
            f"mesh coordinate {tuple(coordinate)}; pass grad_placements that describe the gradient"
        )


def _laid_out_like(local: torch.Tensor, global_stride: Sequence[int]) -> torch.Tensor:
    """``local`` with its dims in memory in the order ``global_stride`` gives them (a copy only if they differ).

    The gradient takes its tensor's global stride on every rank, and views of the DTensor are checked
    against that stride, so its local piece must be laid out the same way.
    """
    if len(global_stride) <= 1:
        return local
    outer_to_inner = sorted(range(len(global_stride)), key=lambda dim: (-global_stride[dim], dim))
    in_order = local.permute(outer_to_inner)
    if in_order.is_contiguous():
        return local
    inverse = [0] * len(outer_to_inner)
    for position, dim in enumerate(outer_to_inner):
        inverse[dim] = position
    return in_order.contiguous().permute(inverse)


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, dtensor: Any, target_spec: DTensorSpec[DeviceMesh], async_op: bool) -> Any:
        source_spec = dtensor._spec
        cls = type(dtensor)
        ctx.source_spec = source_spec
        ctx.target_spec = target_spec
        ctx.cls = cls
        if source_spec.placements == target_spec.placements:
            local = dtensor._local_tensor
            # A fresh alias so the output is a distinct autograd node from the input.
            return wrap_local_tensor(cls, local.view_as(local), source_spec)
        local = redistribute_local_tensor(
            dtensor._local_tensor, source_spec, target_spec, async_op=async_op, is_explicit=True
        )
        return wrap_local_tensor(cls, local, target_spec)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        if not isinstance(grad_output, ctx.cls):
            raise RuntimeError(
                f"DTensor.redistribute backward expected a DTensor gradient, got {type(grad_output).__name__}"
            )
        source_spec: DTensorSpec[DeviceMesh] = ctx.source_spec
        target_spec: DTensorSpec[DeviceMesh] = ctx.target_spec
        grad_spec = grad_output._spec
        placements = gradient_placements_for(source_spec.placements, grad_spec.placements)
        if grad_spec.placements == placements:
            return grad_output, None, None
        local = _grad_to_spec(grad_output, placements)
        return wrap_local_tensor(ctx.cls, local, DTensorSpec(grad_spec.mesh, placements, grad_spec.tensor_meta)), None, None


def _with_dtype(spec: DTensorSpec[DeviceMesh], dtype: torch.dtype) -> DTensorSpec[DeviceMesh]:
    meta = spec.tensor_meta
    if meta is None or meta.dtype == dtype:
        return spec
    return spec.with_tensor_meta(TensorMeta(meta.shape, meta.stride, dtype))


class _RedistributeInDtype(torch.autograd.Function):
    """``redistribute`` with casts: collectives in ``forward_dtype``, the gradient's in ``backward_dtype``.

    Kept apart from ``_Redistribute`` so the common call (no dtypes) pays nothing for them.
    """

    @staticmethod
    def forward(
        ctx: Any,
        dtensor: Any,
        target_spec: DTensorSpec[DeviceMesh],
        async_op: bool,
        forward_dtype: torch.dtype,
        backward_dtype: torch.dtype,
    ) -> Any:
        source_spec: DTensorSpec[DeviceMesh] = dtensor._spec
        cls = type(dtensor)
        ctx.source_spec = source_spec
        ctx.cls = cls
        ctx.backward_dtype = backward_dtype
        local = dtensor._local_tensor
        if local.dtype != forward_dtype:
            local = local.to(forward_dtype)
        cast_source = _with_dtype(source_spec, forward_dtype)
        cast_target = _with_dtype(target_spec, forward_dtype)
        if cast_source.placements == cast_target.placements:
            result = local.view_as(local) if local is dtensor._local_tensor else local
            return wrap_local_tensor(cls, result, cast_source)
        local = redistribute_local_tensor(local, cast_source, cast_target, async_op=async_op)
        return wrap_local_tensor(cls, local, cast_target)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        if not isinstance(grad_output, ctx.cls):
            raise RuntimeError(
                f"DTensor.redistribute backward expected a DTensor gradient, got {type(grad_output).__name__}"
            )
        source_spec: DTensorSpec[DeviceMesh] = ctx.source_spec
        input_dtype = source_spec.tensor_meta.dtype if source_spec.tensor_meta is not None else grad_output.dtype
        grad_spec: DTensorSpec[DeviceMesh] = grad_output._spec
        local: torch.Tensor = grad_output._local_tensor
        if local.dtype != ctx.backward_dtype:
            local = local.to(ctx.backward_dtype)
        placements = gradient_placements_for(source_spec.placements, grad_spec.placements)
        in_flight = _with_dtype(grad_spec, ctx.backward_dtype)
        if in_flight.placements != placements:
            local = redistribute_local_tensor(local, in_flight, in_flight.with_placements(placements))
        if local.dtype != input_dtype:
            local = local.to(input_dtype)
        grad_meta = grad_spec.tensor_meta
        assert grad_meta is not None
        result_spec = DTensorSpec(grad_spec.mesh, placements, TensorMeta(grad_meta.shape, grad_meta.stride, input_dtype))
        return wrap_local_tensor(ctx.cls, local, result_spec), None, None, None, None
