"""The ``DTensor`` wrapper subclass and its differentiable conversions.

A DTensor is a ``torch.Tensor`` wrapper (no storage of its own) that reports the
*global* shape, stride, dtype and device, and holds this rank's piece in
``_local_tensor`` and the layout in ``_spec`` (a :class:`DTensorSpec` with
``tensor_meta`` always set).  Every aten op on it goes through
``__torch_dispatch__`` (see ``_op_runner.py``).

The conversions between local tensors and DTensors (``from_local``,
``to_local``, ``redistribute``, ``full_tensor``) are autograd Functions that live
below the class, in ``_conversions``; dispatch is installed on the class by the
package ``__init__``.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence, cast

import warnings

import torch
from shardwise.mesh import DeviceMesh, unwrap_traced_mesh
from shardwise.placement import (
    DTensorSpec,
    Partial,
    Placement,
    Replicate,
    Shard,
    ShardOrder,
    TensorMeta,
    _StridedShard,
)

from . import _checkpoint, _conversions
from ._plan_executor import gradient_placements
from ._wrapper import wrap_local_tensor

__all__ = ["DTensor", "new_dtensor"]

# DTensor.__tensor_flatten__'s context, PyTorch 2.13's: placements, global metadata, shard order, requires_grad.
_FlattenContext = tuple[tuple[Placement, ...], TensorMeta | None, ShardOrder | None, bool]


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
    @torch._disable_dynamo  # (as PyTorch's) a direct construction under compile runs eagerly
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
            # (Under no_grad, e.g. inside autograd Functions, nothing would have reached it anyway.)
            if torch.is_grad_enabled():
                warnings.warn(
                    "To construct a DTensor from a local tensor that requires grad, use DTensor.from_local "
                    "(differentiable); DTensor(local_tensor, spec, requires_grad=False) detaches it, so no "
                    "gradient reaches local_tensor",
                    UserWarning,
                    stacklevel=2,
                )
            local_tensor = local_tensor.detach()
        return wrap_local_tensor(cls, local_tensor, spec, requires_grad)

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
    #
    # The contract is PyTorch 2.13's for its own DTensor, because dynamo checks it by name: under
    # shardwise.torch_switch, ``torch.distributed.tensor.DTensor`` is this class, and dynamo's builder then
    # insists on the inner attributes ``["_local_tensor", "device_mesh"]`` and this context, and guards on
    # ``_spec`` with ``DTensorSpec._check_equals(skip_shapes=True)`` and on ``requires_grad``. The mesh is
    # an inner attribute (an opaque reference type, shardwise.compile_support): a graph input, guarded on
    # its layout, rank and process groups.

    def __tensor_flatten__(self) -> tuple[list[str], _FlattenContext]:
        spec = self._spec
        return ["_local_tensor", "device_mesh"], (spec.placements, spec.tensor_meta, spec.shard_order, self.requires_grad)

    @staticmethod
    def __tensor_unflatten__(
        inner_tensors: dict[str, Any],
        flatten_spec: _FlattenContext,
        outer_size: Sequence[int],
        outer_stride: Sequence[int],
    ) -> DTensor:
        placements, old_meta, shard_order, requires_grad = flatten_spec
        local_tensor = inner_tensors["_local_tensor"]
        # While AOTAutograd traces, the mesh arrives as torch's stand-in for it: keep the real one.
        mesh = unwrap_traced_mesh(inner_tensors["device_mesh"])
        # Tracing may hand back symbolic or restrided outer metadata: rebuild the spec around it.
        dtype = old_meta.dtype if old_meta is not None else local_tensor.dtype
        meta = TensorMeta(torch.Size(outer_size), tuple(outer_stride), dtype)
        # _StridedShard placements spell their order themselves (the spec takes no second one).
        strided = any(isinstance(p, _StridedShard) for p in placements)
        spec = DTensorSpec(mesh, placements, meta, shard_order=None if strided else shard_order)
        return DTensor(local_tensor, spec, requires_grad=requires_grad)

    @classmethod
    def __metadata_guard__(cls, traced: _FlattenContext, current: _FlattenContext) -> bool:
        """Whether a compiled graph traced for ``traced`` (flatten context) fits a DTensor with ``current``.

        Used where dynamo guards a DTensor as any traceable subclass (shardwise's DTensor without the
        switch). Shapes and strides are left out: torch.compile guards them on the tensor itself (so
        dynamic shapes do not recompile per shape); the mesh is an inner attribute with its own guard.
        """
        traced_placements, traced_meta, traced_order, traced_requires_grad = traced
        placements, meta, order, requires_grad = current
        if traced_requires_grad != requires_grad or traced_placements != placements or traced_order != order:
            return False
        if traced_meta is None or meta is None:
            return traced_meta is meta
        return bool(traced_meta.dtype == meta.dtype)

    def __coerce_tangent_metadata__(self) -> DTensor:
        """A tangent must not be Partial (compiled backward graphs expect reduced values)."""
        placements = self._spec.placements
        if not any(isinstance(p, Partial) for p in placements):
            return self
        return self.redistribute(device_mesh=self.device_mesh, placements=gradient_placements(placements))

    def __coerce_same_metadata_as_tangent__(
        self, flatten_spec: _FlattenContext, expected_type: type | None = None
    ) -> DTensor | None:
        """A tangent with other placements than the traced one is redistributed to them."""
        if expected_type is not None:
            return None
        placements = flatten_spec[0]
        return self.redistribute(device_mesh=self.device_mesh, placements=placements)

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
        result = wrap_local_tensor(type(self), local_copy, self._spec, self.requires_grad)
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
        grad_placements: Sequence[Placement] | None = None,
    ) -> DTensor:
        """Build a DTensor from each rank's local piece (differentiable).

        Without ``shape``/``stride`` the global shape assumes even shards (each
        sharded dim is ``local size * number of shards``); pass both ``shape`` and
        ``stride`` for uneven shards (one without the other is refused, as in
        PyTorch), or ``run_check=True``, which gathers every rank's local shape,
        infers the global shape from them (uneven shards included), checks that
        they agree with the placements and broadcasts the data of replicated mesh
        dims from their first rank. ``grad_placements``: where the gradient goes back to
        (default: these placements, ``Partial`` ones as ``Replicate``).
        """
        return _conversions.from_local(
            DTensor,
            local_tensor,
            device_mesh,
            placements,
            run_check=run_check,
            shape=shape,
            stride=stride,
            grad_placements=grad_placements,
        )

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's piece (differentiable).

        ``grad_placements`` says how the gradient that will flow into the
        returned tensor is laid out (default: this DTensor's placements, ``Partial``
        ones as ``Replicate``, as PyTorch 2.13), e.g.
        ``[Partial()]`` when each rank's local gradient is a partial sum.
        """
        return _conversions.to_local(self, grad_placements=grad_placements)

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> DTensor:
        """The same global tensor laid out with ``placements`` on the same mesh (differentiable).

        The gradient goes back to this tensor's placements, except that a
        ``Partial`` placement gets its gradient as ``Replicate``. ``forward_dtype``: cast before
        the collectives (the result has that dtype); ``backward_dtype``: the gradient's
        collectives run in it, and the gradient comes back in this tensor's dtype.
        """
        return _conversions.redistribute(
            self, device_mesh, placements, async_op=async_op, forward_dtype=forward_dtype, backward_dtype=backward_dtype
        )

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global tensor on every rank (differentiable; collectives as needed)."""
        return _conversions.full_tensor(self, grad_placements=grad_placements)

    # -- torch.distributed.checkpoint (DCP) protocol: see _checkpoint -------------------------

    def __create_write_items__(self, fqn: str, object: Any) -> list[Any]:
        return _checkpoint.create_write_items(self, fqn)

    def __create_chunk_list__(self) -> list[Any]:
        return _checkpoint.create_chunk_list(self)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return _checkpoint.get_tensor_shard(self, index)


def new_dtensor(
    local_tensor: torch.Tensor,
    spec: DTensorSpec[DeviceMesh],
    requires_grad: bool = False,
) -> DTensor:
    """Wrap ``local_tensor`` as a DTensor without argument checks (spec.tensor_meta must be set)."""
    return wrap_local_tensor(DTensor, local_tensor, spec, requires_grad)


# ``_FromTorchTensor.apply`` called with PyTorch's arguments alone (no class) builds this class.
_conversions.set_default_dtensor_class(DTensor)
