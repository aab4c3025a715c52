"""The ``DTensor`` wrapper subclass and its differentiable conversions.

A DTensor is a ``torch.Tensor`` wrapper (no storage of its own) that reports the
*global* shape, stride, dtype and device, and holds this rank's piece in
``_local_tensor`` and the layout in ``_spec`` (a :class:`DTensorSpec` with
``tensor_meta`` always set).  Every aten op on it goes through
``__torch_dispatch__`` (see ``_dispatch.py``).

The conversions between local tensors and DTensors (``from_local``,
``to_local``, ``redistribute``, ``full_tensor``) are autograd Functions so that
gradients flow back with the right placements.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence, cast

import torch
from shardwise.mesh import DeviceMesh
from shardwise.placement import DTensorSpec, Partial, Placement, Replicate, Shard, TensorMeta

from ._redistribute import grad_placements_for_backward, redistribute_local_tensor

__all__ = ["DTensor", "new_dtensor"]

_make_wrapper_subclass = torch.Tensor._make_wrapper_subclass
_STRIDED = torch.strided


class DTensor(torch.Tensor):
    """A tensor laid out over a :class:`DeviceMesh` by a tuple of placements.

    Build one with :func:`distribute_tensor`, :meth:`DTensor.from_local` or the
    factory functions; ``DTensor(local_tensor, spec, requires_grad=...)`` wraps a
    local tensor as is (no communication, no checks beyond the spec).
    """

    _local_tensor: torch.Tensor
    _spec: DTensorSpec[DeviceMesh]
    __slots__ = ("_local_tensor", "_spec")

    # Skip the Python __torch_function__ layer: every op goes straight to __torch_dispatch__.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(
        cls,
        local_tensor: torch.Tensor,
        spec: DTensorSpec[DeviceMesh],
        *,
        requires_grad: bool,
    ) -> DTensor:
        if not isinstance(spec, DTensorSpec):
            raise TypeError(f"DTensor(local_tensor, spec, ...) expects a DTensorSpec as spec, got {type(spec).__name__}")
        meta = spec.tensor_meta
        if meta is None:
            raise ValueError(
                f"DTensor needs a spec with tensor_meta (the global shape, stride and dtype); got {spec!r}"
            )
        if local_tensor.requires_grad and not requires_grad:
            # The wrapper is what autograd sees; a local tensor carrying its own graph would be ignored.
            local_tensor = local_tensor.detach()
        return new_dtensor(local_tensor, spec, requires_grad, cls)

    # -- metadata --------------------------------------------------------------

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh this tensor is laid out on."""
        return self._spec.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        """One placement per mesh dim."""
        return self._spec.placements

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"DTensor(local_tensor={self._local_tensor}, device_mesh={self._spec.mesh}, "
            f"placements={self._spec.placements})"
        )

    # -- torch.compile support: what tracing sees inside the wrapper -------------------

    def __tensor_flatten__(self) -> tuple[list[str], tuple[DTensorSpec[DeviceMesh], bool]]:
        return ["_local_tensor"], (self._spec, self.requires_grad)

    @staticmethod
    def __tensor_unflatten__(
        inner_tensors: dict[str, torch.Tensor],
        flatten_spec: tuple[DTensorSpec[DeviceMesh], bool],
        outer_size: Sequence[int],
        outer_stride: Sequence[int],
    ) -> DTensor:
        spec, requires_grad = flatten_spec
        local_tensor = inner_tensors["_local_tensor"]
        # Tracing may hand back symbolic or restrided outer metadata: rebuild the spec around it.
        old_meta = spec.tensor_meta
        dtype = old_meta.dtype if old_meta is not None else local_tensor.dtype
        meta = TensorMeta(torch.Size(outer_size), tuple(outer_stride), dtype)
        return DTensor(local_tensor, DTensorSpec(spec.mesh, spec.placements, meta), requires_grad=requires_grad)

    def __coerce_tangent_metadata__(self) -> DTensor:
        """A tangent must not be Partial (compiled backward graphs expect reduced values)."""
        placements = self._spec.placements
        if not any(isinstance(p, Partial) for p in placements):
            return self
        return self.redistribute(device_mesh=self.device_mesh, placements=gradient_placements(placements))

    def __coerce_same_metadata_as_tangent__(
        self, flatten_spec: tuple[DTensorSpec[DeviceMesh], bool], expected_type: type | None = None
    ) -> DTensor | None:
        """A tangent with other placements than the traced one is redistributed to them."""
        if expected_type is not None:
            return None
        spec = flatten_spec[0]
        return self.redistribute(device_mesh=self.device_mesh, placements=spec.placements)

    # -- copies ----------------------------------------------------------------

    def __deepcopy__(self, memo: dict[int, Any]) -> DTensor:
        existing = memo.get(id(self))
        if existing is not None:
            return cast(DTensor, existing)
        if not self.is_leaf:
            raise RuntimeError(
                "Only DTensors created explicitly by the user (graph leaves) support the deepcopy protocol; "
                "detach() it first"
            )
        # The mesh and placements are shared (a mesh owns process groups); only the data is copied.
        local_copy = copy.deepcopy(self._local_tensor, memo)
        if local_copy.requires_grad:
            local_copy = local_copy.detach()
        result = new_dtensor(local_copy, self._spec, requires_grad=self.requires_grad)
        memo[id(self)] = result
        if self.grad is not None:
            result.grad = copy.deepcopy(self.grad, memo)
        extra_state = getattr(self, "__dict__", None)
        if extra_state:
            # e.g. nn.Parameter(DTensor) marks the instance with _is_param.
            result.__dict__.update(copy.deepcopy(extra_state, memo))
        return result

    # -- conversions -------------------------------------------------------------

    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        run_check: bool = False,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
    ) -> DTensor:
        """Build a DTensor from each rank's local piece (differentiable).

        Without ``shape``/``stride`` the global shape assumes even shards (each
        sharded dim is ``local size * number of shards``); pass ``shape`` for uneven
        shards, or ``run_check=True``, which gathers every rank's local shape,
        infers the global shape from them (uneven shards included), checks that
        they agree with the placements and broadcasts the data of replicated mesh
        dims from their first rank.
        """
        from ._api import resolve_device_mesh
        from ._src_data import check_and_sync_from_local

        mesh = resolve_device_mesh(device_mesh, "DTensor.from_local")
        if not isinstance(local_tensor, torch.Tensor) or isinstance(local_tensor, DTensor):
            raise TypeError(
                f"DTensor.from_local expects a plain torch.Tensor as local_tensor, got {type(local_tensor).__name__}"
            )
        placement_tuple = normalize_placements(placements, mesh, local_tensor.ndim, "DTensor.from_local")
        if (shape is None) != (stride is None) and shape is None:
            raise ValueError("DTensor.from_local got stride without shape; pass shape (and optionally stride)")
        if mesh.device_type != local_tensor.device.type and not local_tensor.is_meta:
            local_tensor = local_tensor.to(mesh.device_type)
        global_shape: tuple[int, ...] | None = tuple(shape) if shape is not None else None
        if run_check:
            local_tensor, global_shape = check_and_sync_from_local(
                local_tensor, mesh, placement_tuple, global_shape
            )
        elif global_shape is not None:
            _check_local_shape_matches(local_tensor, mesh, placement_tuple, global_shape)
        else:
            global_shape = _even_global_shape(local_tensor.shape, mesh, placement_tuple)
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
            global_stride = global_stride_like(local_tensor, global_shape)
        meta = TensorMeta(torch.Size(global_shape), global_stride, local_tensor.dtype)
        spec = DTensorSpec(mesh, placement_tuple, meta)
        return cast(DTensor, _FromLocal.apply(local_tensor, spec))

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's piece (differentiable).

        ``grad_placements`` says how the gradient that will flow into the
        returned tensor is laid out (default: this DTensor's placements), e.g.
        ``[Partial()]`` when each rank's local gradient is a partial sum.
        """
        if not torch.is_grad_enabled():
            return self._local_tensor
        grad_tuple = None
        if grad_placements is not None:
            grad_tuple = normalize_placements(grad_placements, self._spec.mesh, self.ndim, "to_local(grad_placements=...)")
        return cast(torch.Tensor, _ToLocal.apply(self, grad_tuple))

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
    ) -> DTensor:
        """The same global tensor laid out with ``placements`` on the same mesh (differentiable).

        The gradient goes back to this tensor's placements, except that a
        ``Partial`` placement gets its gradient as ``Replicate``.
        """
        mesh = self._spec.mesh
        if device_mesh is not None and device_mesh != mesh:
            raise NotImplementedError(
                f"redistribute across meshes is not supported: this DTensor lives on {mesh} and the target "
                f"mesh is {device_mesh}; use the same mesh (or to_local()/from_local() to move data yourself)"
            )
        if placements is None:
            raise RuntimeError("DTensor.redistribute needs the target placements (one per mesh dim)")
        target = normalize_placements(placements, mesh, self.ndim, "DTensor.redistribute")
        current = self._spec.placements
        for mesh_dim, placement in enumerate(target):
            if placement.is_partial() and current[mesh_dim] != placement:
                raise RuntimeError(
                    f"DTensor.redistribute cannot go from {current[mesh_dim]} to {placement} on mesh dim "
                    f"{mesh_dim}: redistributing to Partial is for internal use only (target placements {target})"
                )
        target_spec = DTensorSpec(mesh, target, self._spec.tensor_meta)
        return cast(DTensor, _Redistribute.apply(self, target_spec, async_op))

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global tensor on every rank (differentiable; collectives as needed)."""
        replicated = self.redistribute(placements=(Replicate(),) * self._spec.mesh.ndim, async_op=False)
        return replicated.to_local(grad_placements=grad_placements)


def new_dtensor(
    local_tensor: torch.Tensor,
    spec: DTensorSpec[DeviceMesh],
    requires_grad: bool = False,
    cls: type[DTensor] | None = None,
) -> DTensor:
    """Wrap ``local_tensor`` without argument checks (spec.tensor_meta must be set)."""
    meta = cast(TensorMeta, spec.tensor_meta)
    result = _make_wrapper_subclass(
        cls or DTensor,
        meta.shape,
        meta.stride,
        None,
        None,
        local_tensor.dtype,
        local_tensor.layout,
        local_tensor.device,
        False,
        requires_grad,
    )
    result._local_tensor = local_tensor
    result._spec = spec
    return result


# -- placement and metadata helpers ------------------------------------------------


def normalize_placements(
    placements: Sequence[Placement] | None, mesh: DeviceMesh, tensor_ndim: int, where: str
) -> tuple[Placement, ...]:
    """Placements as a tuple with non-negative Shard dims; defaults to all Replicate.

    Raises before any communication when the count or a shard dim is wrong.
    """
    if placements is None:
        return (Replicate(),) * mesh.ndim
    if isinstance(placements, Placement):
        raise TypeError(f"{where}: placements must be a sequence of Placement (one per mesh dim), got {placements!r}")
    result = tuple(placements)
    if len(result) != mesh.ndim:
        raise ValueError(
            f"{where}: `placements` must have the same length as `device_mesh.ndim`! Found placements length: "
            f"{len(result)}, and device_mesh.ndim: {mesh.ndim} (placements {result}, mesh {mesh})"
        )
    normalized: list[Placement] | None = None
    for mesh_dim, placement in enumerate(result):
        if not isinstance(placement, Placement):
            raise TypeError(
                f"{where}: placements[{mesh_dim}] is {placement!r} of type {type(placement).__name__}; "
                "expected Shard, Replicate or Partial"
            )
        if isinstance(placement, Shard):
            dim = placement.dim
            if not -tensor_ndim <= dim < tensor_ndim:
                raise ValueError(
                    f"{where}: {placement!r} on mesh dim {mesh_dim} is out of range for a tensor with "
                    f"{tensor_ndim} dims; expected a dim in [{-tensor_ndim}, {tensor_ndim - 1}]"
                )
            if dim < 0:
                if normalized is None:
                    normalized = list(result)
                normalized[mesh_dim] = Shard(dim + tensor_ndim)
    return result if normalized is None else tuple(normalized)


def global_stride_like(local_tensor: torch.Tensor, global_shape: Sequence[int]) -> tuple[int, ...]:
    """Contiguous strides for ``global_shape`` that keep the local tensor's dim order in memory.

    A contiguous local shard gives a contiguous global stride; a transposed one
    a transposed global stride.  Ties (size-1 dims) keep the logical order.
    """
    ndim = len(global_shape)
    if local_tensor.is_contiguous():
        # Strides of size-0/1 dims are arbitrary and shard sizes differ between ranks, so the contiguous
        # case must not look at them: every rank has to report the same global stride.
        return _contiguous_stride(global_shape)
    local_stride = local_tensor.stride()
    outer_to_inner = sorted(range(ndim), key=lambda dim: (-local_stride[dim], dim))
    stride = [0] * ndim
    running = 1
    for dim in reversed(outer_to_inner):
        stride[dim] = running
        running *= max(int(global_shape[dim]), 1)
    return tuple(stride)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride = [0] * len(shape)
    running = 1
    for dim in range(len(shape) - 1, -1, -1):
        stride[dim] = running
        running *= max(int(shape[dim]), 1)
    return tuple(stride)


def _even_global_shape(
    local_shape: Sequence[int], mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> tuple[int, ...]:
    shape = list(local_shape)
    mesh_shape = mesh.shape
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            shape[placement.dim] *= mesh_shape[mesh_dim]
    return tuple(shape)


def _check_local_shape_matches(
    local_tensor: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...], global_shape: tuple[int, ...]
) -> None:
    from shardwise.placement import compute_local_shape

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


def gradient_placements(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """Where a gradient goes back to for a tensor laid out with ``placements``.

    The adjoint of summing partial values is handing every rank the whole
    gradient, so ``Partial`` becomes ``Replicate``; everything else is kept.
    """
    if not any(isinstance(p, Partial) for p in placements):
        return placements
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def _grad_to_spec(grad: DTensor, target_placements: tuple[Placement, ...]) -> torch.Tensor:
    """Local tensor of ``grad`` redistributed to ``target_placements`` (grad's own tensor_meta)."""
    current = grad._spec
    if current.placements == target_placements:
        return grad._local_tensor
    target = DTensorSpec(current.mesh, target_placements, current.tensor_meta)
    return redistribute_local_tensor(grad._local_tensor, current, target)


# -- autograd Functions ---------------------------------------------------------------


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local_tensor: torch.Tensor, spec: DTensorSpec[DeviceMesh]) -> DTensor:
        ctx.spec = spec
        # An alias, not the input itself: the DTensor must not share the caller's autograd identity.
        return new_dtensor(local_tensor.view_as(local_tensor), spec)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        spec: DTensorSpec[DeviceMesh] = ctx.spec
        if not isinstance(grad_output, DTensor):
            # Only reachable when a plain tensor gradient is handed straight back (e.g. a custom Function).
            return grad_output, None
        return _grad_to_spec(grad_output, gradient_placements(spec.placements)), None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, dtensor: DTensor, grad_placements: tuple[Placement, ...] | None
    ) -> torch.Tensor:
        ctx.spec = dtensor._spec
        ctx.grad_placements = grad_placements
        local = dtensor._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[DTensor, None]:
        spec: DTensorSpec[DeviceMesh] = ctx.spec
        placements: tuple[Placement, ...] = ctx.grad_placements or spec.placements
        meta = cast(TensorMeta, spec.tensor_meta)
        if isinstance(grad_output, DTensor):
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
        coordinate = spec.mesh.get_coordinate()
        if coordinate is not None:
            expected = grad_spec.local_shape(coordinate)
            if tuple(grad_output.shape) != tuple(expected):
                raise RuntimeError(
                    f"to_local(): the local gradient has shape {tuple(grad_output.shape)} but gradient placements "
                    f"{placements} of the global shape {tuple(meta.shape)} give local shape {tuple(expected)} on "
                    f"mesh coordinate {tuple(coordinate)}; pass grad_placements that describe the gradient"
                )
        return new_dtensor(_laid_out_like(grad_output, meta.stride), grad_spec), None


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
    def forward(
        ctx: Any, dtensor: DTensor, target_spec: DTensorSpec[DeviceMesh], async_op: bool
    ) -> DTensor:
        source_spec = dtensor._spec
        ctx.source_spec = source_spec
        ctx.target_spec = target_spec
        if source_spec.placements == target_spec.placements:
            local = dtensor._local_tensor
            # A fresh alias so the output is a distinct autograd node from the input.
            return new_dtensor(local.view_as(local), source_spec)
        local = redistribute_local_tensor(dtensor._local_tensor, source_spec, target_spec, async_op=async_op)
        return new_dtensor(local, target_spec)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[DTensor | None, None, None]:
        if not isinstance(grad_output, DTensor):
            raise RuntimeError(
                f"DTensor.redistribute backward expected a DTensor gradient, got {type(grad_output).__name__}"
            )
        source_spec: DTensorSpec[DeviceMesh] = ctx.source_spec
        target_spec: DTensorSpec[DeviceMesh] = ctx.target_spec
        grad_target = grad_placements_for_backward(source_spec, target_spec)
        placements = grad_target.placements
        grad_spec = grad_output._spec
        if grad_spec.placements == placements:
            return grad_output, None, None
        local = _grad_to_spec(grad_output, placements)
        return new_dtensor(local, DTensorSpec(grad_spec.mesh, placements, grad_spec.tensor_meta)), None, None


# Imported last: the dispatcher needs the DTensor class defined above.  Binding its entry point
# as the classmethod itself saves a Python frame on every op.
from ._dispatch import torch_dispatch as _torch_dispatch  # noqa: E402

DTensor.__torch_dispatch__ = classmethod(_torch_dispatch)  # type: ignore[assignment]
