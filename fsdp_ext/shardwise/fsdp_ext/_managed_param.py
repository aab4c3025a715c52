"""One managed parameter of a ``fully_shard`` unit: its layouts, its slots in the unit's flat buffers.

``FSDPParam`` knows where one parameter's rows live in the unit's flat sharded and unsharded
buffers (the layout is described in ``_param_group``, which owns the buffers and their
collectives), its sharded DTensor layout (next to tensor parallelism's, checked to be exact),
and what the module computes with around its unsharded piece.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, Sequence

import torch
import torch.nn as nn

from shardwise.dtensor_ops import DTensor
from shardwise.mesh import DeviceMesh
from shardwise.placement import (
    DTensorSpec,
    Partial,
    Placement,
    Replicate,
    Shard,
    TensorMeta,
    _StridedShard,
    chunk_size_and_offset,
    contiguous_strides,
    local_index_runs,
)

from ._errors import FSDPError
from ._mesh_info import combine_meshes
from ._spmd_annotations import PlainAnnotation

__all__ = ["FSDPParam", "ParamOwner", "SpmdLayout"]


class PartialGradRecorder(Protocol):
    """Where a unit collects, per backward, the gradients left Partial over tp (its ``FSDPParamGroup``;
    named by this protocol so that this module does not import the group's)."""

    # id(FSDPParam) -> tp mesh dims over which this backward's gradient is still a Partial sum.
    partial_grad_dims: dict[int, tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class SpmdLayout:
    """A parameter that is a DTensor on a full SPMD mesh (``fully_shard(..., dp_mesh_dims=...)``).

    ``tp_spec``: its layout over the mesh's other (non data-parallel) dims, the piece FSDP shards further
    (None when the mesh has no other dim); ``compute_spec``: its original spec on the full mesh (Replicate
    on the dp dims), which the module computes with; ``dp_dims``: the indices of the dp dims in that mesh,
    where a gradient's placement is left as it is for the reduce-scatter (a Partial sum over the batch).
    """

    tp_spec: DTensorSpec[DeviceMesh] | None
    compute_spec: DTensorSpec[DeviceMesh]
    dp_dims: frozenset[int]
    # A plain parameter annotated with spmd_types' per-axis types: the module computes with the plain piece,
    # annotated again (``compute_spec`` then describes the piece, it is never built as a DTensor).
    plain: PlainAnnotation | None = None


@dataclasses.dataclass(frozen=True)
class ParamOwner:
    """A module attribute that holds a managed parameter (a tied parameter has several)."""

    module: nn.Module
    name: str


class FSDPParam:
    """One managed parameter: its original layout, its slot in the flat buffers, its sharded DTensor."""

    def __init__(
        self,
        fqn: str,
        param: nn.Parameter,
        owners: list[ParamOwner],
        dp_mesh: DeviceMesh,
        sharded_offset: int,
        unsharded_offset: int,
        shard_dim: int = 0,
        spmd: SpmdLayout | None = None,
    ) -> None:
        self.fqn = fqn
        self.shard_dim = shard_dim
        self.owners = owners
        self.requires_grad = param.requires_grad
        self.orig_dtype = param.dtype
        # What the module computed with before: a plain tensor, or a DTensor of tensor parallelism.
        self.tp_spec: DTensorSpec[DeviceMesh] | None = param._spec if isinstance(param, DTensor) else None
        # What the module computes with around the unsharded piece: TP's spec, or the full SPMD mesh's.
        self.compute_spec = self.tp_spec
        self.compute_dp_dims: frozenset[int] = frozenset()
        self.plain: PlainAnnotation | None = None
        self.global_shape = tuple(param.shape)
        if spmd is not None:
            self.tp_spec, self.compute_spec, self.compute_dp_dims = spmd.tp_spec, spmd.compute_spec, spmd.dp_dims
            self.plain = spmd.plain
            assert spmd.compute_spec.tensor_meta is not None
            self.global_shape = tuple(spmd.compute_spec.tensor_meta.shape)
        local = param._local_tensor if isinstance(param, DTensor) else param.data
        self.unsharded_shape = tuple(local.shape)  # the tensor-parallel piece (or the whole parameter)
        # The layout inside the flat buffers: the shard dim first, so that a rank's piece is contiguous.
        self.moved_shape = tuple(local.movedim(shard_dim, 0).shape)
        self.rows = self.moved_shape[0]
        self.row_numel = math.prod(self.moved_shape[1:])
        # The last dim of the dp mesh shards; on a 2-D (replicate, shard) mesh (HSDP) the first replicates.
        self.dp_size = dp_mesh.shape[-1]
        self.padded_rows = -(-self.rows // self.dp_size)
        self.sharded_offset = sharded_offset
        self.padded_numel = self.padded_rows * self.row_numel
        self.unsharded_offset = unsharded_offset
        self.unsharded_numel = self.rows * self.row_numel
        coordinate = dp_mesh.get_coordinate()
        assert coordinate is not None  # fully_shard checks the rank is in the mesh
        self.dp_rank = coordinate[-1]
        self.local_rows, self.local_row_offset = chunk_size_and_offset(self.rows, self.dp_size, self.dp_rank)
        self.sharded_spec = self._sharded_spec(dp_mesh)
        self.sharded_param: nn.Parameter | None = None
        self._sharded_local_ptr = 0

    def _sharded_spec(self, dp_mesh: DeviceMesh) -> DTensorSpec[DeviceMesh]:
        """Shard(shard dim) over dp (after Replicate over the replicas with HSDP), next to TP's placements."""
        meta = TensorMeta(torch.Size(self.global_shape), contiguous_strides(self.global_shape), self.orig_dtype)
        replicated: tuple[Placement, ...] = (Replicate(),) * (dp_mesh.ndim - 1)
        tp_spec = self.tp_spec
        if tp_spec is None:
            return DTensorSpec(dp_mesh, (*replicated, Shard(self.shard_dim)), meta)
        mesh_nd, names = _mesh_with_dp(dp_mesh, tp_spec.mesh, self.fqn)
        tp_shards_dim = 1
        for tp_dim, placement in enumerate(tp_spec.placements):
            if isinstance(placement, Shard) and placement.dim == self.shard_dim:
                tp_shards_dim *= tp_spec.mesh.shape[tp_dim]
        dp_placement: Placement = (
            _StridedShard(self.shard_dim, split_factor=tp_shards_dim) if tp_shards_dim > 1 else Shard(self.shard_dim)
        )
        dp_names = dp_mesh.mesh_dim_names
        tp_names = tp_spec.mesh.mesh_dim_names
        assert dp_names is not None and tp_names is not None  # _mesh_with_dp checked
        by_name: dict[str, Placement] = dict(zip(tp_names, tp_spec.placements))
        by_name.update(zip(dp_names[:-1], replicated))
        by_name[dp_names[-1]] = dp_placement
        spec = DTensorSpec(mesh_nd, tuple(by_name[name] for name in names), meta)
        self._check_layout_is_exact(spec, names, dp_names, tp_names)
        return spec

    def _check_layout_is_exact(
        self,
        spec: DTensorSpec[DeviceMesh],
        names: tuple[str, ...],
        dp_names: tuple[str, ...],
        tp_names: tuple[str, ...],
    ) -> None:
        """Every rank's rows (TP piece, then its dp chunk) must be what the placements say.

        With both TP and FSDP cutting dim 0 and uneven sizes, chunking a TP piece over dp can
        differ from every left-to-right reading of the placements; refuse rather than give the
        parameter a layout that redistribution and checkpoints would read wrongly.
        """
        assert self.tp_spec is not None
        tp_mesh_shape = self.tp_spec.mesh.shape
        for tp_coordinate in _coordinates(tp_mesh_shape):
            tp_runs = local_index_runs(self.global_shape, tp_mesh_shape, tp_coordinate, self.tp_spec.placements)[
                self.shard_dim
            ]
            tp_rows = [start + k for start, length in tp_runs for k in range(length)]
            for dp_index in range(self.dp_size):
                size, offset = chunk_size_and_offset(len(tp_rows), self.dp_size, dp_index)
                # The replicas (HSDP) hold the same rows: replica 0 stands for all.
                by_name = dict(zip(tp_names, tp_coordinate)) | {name: 0 for name in dp_names[:-1]}
                by_name[dp_names[-1]] = dp_index
                coordinate = [by_name[name] for name in names]
                runs = local_index_runs(self.global_shape, spec.mesh.shape, coordinate, spec.placements)[self.shard_dim]
                said = [start + k for start, length in runs for k in range(length)]
                if said != tp_rows[offset : offset + size]:
                    raise FSDPError(
                        f"fully_shard: parameter {self.fqn!r} of shape {self.global_shape} is cut along dim "
                        f"{self.shard_dim} "
                        f"by tensor parallelism ({self.tp_spec.placements} on mesh shape {tuple(tp_mesh_shape)}) "
                        f"and by FSDP over {self.dp_size} ranks, with sizes for which no placement describes the "
                        f"result ({spec.placements} would put other rows on mesh coordinate {tuple(coordinate)}); "
                        "expected dim 0 to divide evenly over the tensor-parallel ranks, with each piece divisible "
                        "by the data-parallel size (or a model whose dim-0 sizes allow it)"
                    )

    def sharded_local_view(self, sharded_flat: torch.Tensor) -> torch.Tensor:
        """This rank's real rows inside the unit's flat sharded buffer."""
        padded = sharded_flat.narrow(0, self.sharded_offset, self.padded_numel).view(
            (self.padded_rows, *self.moved_shape[1:])
        )
        return padded.narrow(0, 0, self.local_rows).movedim(0, self.shard_dim)

    def unsharded_view(self, unsharded_flat: torch.Tensor) -> torch.Tensor:
        flat = unsharded_flat.narrow(0, self.unsharded_offset, self.unsharded_numel)
        return flat.view(self.moved_shape).movedim(0, self.shard_dim)

    def copy_out_gathered(self, gathered: torch.Tensor, unsharded_flat: torch.Tensor) -> None:
        """Rows of the gathered ``(dp, per-rank flat)`` buffer into this parameter's unsharded view."""
        if self.rows == 0 or self.row_numel == 0:
            return
        pieces = gathered.narrow(1, self.sharded_offset, self.padded_numel).view(
            self.dp_size, self.padded_rows, self.row_numel
        )
        target = unsharded_flat.narrow(0, self.unsharded_offset, self.unsharded_numel).view(self.rows, self.row_numel)
        _copy_rows(target, pieces, self.padded_rows, self.rows, into_pieces=False)

    def copy_in_gradient(self, grad: torch.Tensor, reduce_input: torch.Tensor) -> None:
        """This parameter's unsharded gradient into its slots of the ``(dp, per-rank flat)`` buffer."""
        if self.rows == 0 or self.row_numel == 0:
            return
        pieces = reduce_input.narrow(1, self.sharded_offset, self.padded_numel).view(
            self.dp_size, self.padded_rows, self.row_numel
        )
        rows = grad.movedim(self.shard_dim, 0).reshape(self.rows, self.row_numel)
        _copy_rows(rows, pieces, self.padded_rows, self.rows, into_pieces=True)

    def unsharded_for_module(self, unsharded: torch.Tensor, group: PartialGradRecorder) -> torch.Tensor:
        """What the module computes with: the plain tensor (annotated again if it came annotated), or the
        tensor-parallel DTensor over it."""
        if self.plain is not None:
            return self.plain.apply_to(unsharded)
        if self.compute_spec is None:
            return unsharded
        if unsharded.requires_grad:
            return _TensorParallelParam.apply(unsharded, self, group)
        return self.tp_dtensor_around(unsharded)

    def tp_dtensor_around(self, unsharded: torch.Tensor) -> DTensor:
        """``DTensor.from_local`` of ``unsharded`` with the parameter's tensor-parallel (or SPMD) spec."""
        tp_spec = self.compute_spec
        assert tp_spec is not None and tp_spec.tensor_meta is not None
        return DTensor.from_local(
            unsharded,
            tp_spec.mesh,
            tp_spec.placements,
            shape=tp_spec.tensor_meta.shape,
            stride=tp_spec.tensor_meta.stride,
        )

    def traced_padded_piece(self) -> torch.Tensor:
        """This rank's rows of the sharded parameter, flat and padded to ``padded_rows`` rows (traceable ops).

        Its slot of the unit's flat send buffer in the compiled path; the sharded parameter's gradient
        comes back through these ops (the padding's is dropped).
        """
        sharded = self.sharded_param
        assert isinstance(sharded, DTensor)
        rows = sharded.to_local().movedim(self.shard_dim, 0).reshape(self.local_rows, self.row_numel)
        padding = self.padded_rows - self.local_rows
        if padding:
            rows = torch.cat([rows, rows.new_zeros(padding, self.row_numel)])
        return rows.reshape(-1)

    def traced_unsharded_from_gathered(self, gathered: torch.Tensor) -> torch.Tensor:
        """This parameter's unsharded piece out of the gathered ``(dp, per-rank flat)`` buffer (traceable views).

        torch.chunk pieces put the padding after the last real row, so the first ``rows`` rows of the
        ``dp`` padded pieces in rank order are the parameter's rows in order.
        """
        pieces = gathered.narrow(1, self.sharded_offset, self.padded_numel)
        rows = pieces.reshape(self.dp_size * self.padded_rows, self.row_numel).narrow(0, 0, self.rows)
        return rows.reshape(self.moved_shape).movedim(0, self.shard_dim)

    def traced_for_module(self, unsharded: torch.Tensor) -> torch.Tensor:
        """What the module computes with in the compiled path: the plain tensor or the TP DTensor around it.

        ``from_local``'s backward all-reduces a gradient left Partial over tp (sequence parallelism's
        norms) for this parameter alone (eager batches them per unit).
        """
        if self.plain is not None:
            return self.plain.apply_to(unsharded)
        if self.compute_spec is None:
            return unsharded
        return self.tp_dtensor_around(unsharded)

    def tp_spec_for(self, dtype: torch.dtype) -> DTensorSpec[DeviceMesh]:
        tp_spec = self.compute_spec
        assert tp_spec is not None and tp_spec.tensor_meta is not None
        if tp_spec.tensor_meta.dtype == dtype:
            return tp_spec
        meta = TensorMeta(tp_spec.tensor_meta.shape, tp_spec.tensor_meta.stride, dtype)
        return DTensorSpec(tp_spec.mesh, tp_spec.placements, meta)


def _deferrable_partial_dims(grad: DTensor, param_spec: DTensorSpec[DeviceMesh]) -> tuple[int, ...] | None:
    """Mesh dims where ``grad`` is a Partial sum of a parameter replicated there (else it equals the
    parameter's layout); None when the gradient needs another redistribution."""
    if grad.device_mesh != param_spec.mesh:
        return None
    dims: list[int] = []
    for mesh_dim, (have, want) in enumerate(zip(grad.placements, param_spec.placements)):
        if have == want:
            continue
        if isinstance(have, Partial) and have.reduce_op == "sum" and isinstance(want, Replicate):
            dims.append(mesh_dim)
            continue
        return None
    return tuple(dims)


class _TensorParallelParam(torch.autograd.Function):
    """The tensor-parallel DTensor around a unit's unsharded parameter piece.

    Like ``DTensor.from_local``, except in backward: a gradient that is a Partial sum over tp where
    the parameter is replicated (sequence parallelism's norms) comes back unreduced, and the unit
    all-reduces all such gradients together, one collective per unit and mesh dim, before its
    reduce-scatter (``from_local`` would all-reduce each parameter's gradient on its own).
    """

    @staticmethod
    def forward(ctx: Any, unsharded: torch.Tensor, fsdp_param: FSDPParam, group: PartialGradRecorder) -> Any:
        ctx.fsdp_param = fsdp_param
        ctx.group = group
        spec = fsdp_param.tp_spec_for(unsharded.dtype)
        ctx.spec = spec
        return DTensor(unsharded.view_as(unsharded), spec, requires_grad=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        spec: DTensorSpec[DeviceMesh] = ctx.spec
        if not isinstance(grad, DTensor):
            return grad, None, None
        dp_dims = ctx.fsdp_param.compute_dp_dims
        if dp_dims and grad.device_mesh == spec.mesh:
            # Full SPMD mesh: on the dp dims the gradient keeps its placement (a Partial sum over the
            # batch, or Replicate), which the unit's reduce-scatter sums; a Shard there is gathered.
            placements = tuple(
                (Replicate() if isinstance(have, Shard) else have) if mesh_dim in dp_dims else want
                for mesh_dim, (have, want) in enumerate(zip(grad.placements, spec.placements))
            )
            spec = DTensorSpec(spec.mesh, placements, spec.tensor_meta)
        partial_dims = _deferrable_partial_dims(grad, spec)
        if partial_dims is None:
            return grad.redistribute(spec.mesh, spec.placements).to_local(), None, None
        if partial_dims:
            ctx.group.partial_grad_dims[id(ctx.fsdp_param)] = partial_dims
        return grad._local_tensor, None, None


def _copy_rows(rows_view: torch.Tensor, pieces: torch.Tensor, padded_rows: int, rows: int, *, into_pieces: bool) -> None:
    """Copy between ``rows`` rows and ``dp`` torch.chunk pieces of ``padded_rows`` rows (two copies at most)."""
    full_pieces = rows // padded_rows
    if full_pieces:
        whole = rows_view.narrow(0, 0, full_pieces * padded_rows).view(full_pieces, padded_rows, -1)
        if into_pieces:
            pieces.narrow(0, 0, full_pieces).copy_(whole)
        else:
            whole.copy_(pieces.narrow(0, 0, full_pieces))
    remaining = rows - full_pieces * padded_rows
    if remaining:
        tail = rows_view.narrow(0, full_pieces * padded_rows, remaining)
        if into_pieces:
            pieces[full_pieces].narrow(0, 0, remaining).copy_(tail)
        else:
            tail.copy_(pieces[full_pieces].narrow(0, 0, remaining))


def _coordinates(mesh_shape: Sequence[int]) -> list[list[int]]:
    coordinates: list[list[int]] = [[]]
    for extent in mesh_shape:
        coordinates = [c + [i] for c in coordinates for i in range(extent)]
    return coordinates


def _mesh_with_dp(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, fqn: str) -> tuple[DeviceMesh, tuple[str, ...]]:
    """The mesh over the dp dim(s) and the parameter's tensor-parallel dims, and its dim names in order.

    Both meshes are views of one root mesh; a dim of either may be a flattening of several root dims
    (torchtitan's ``dp_shard_cp`` = ``root["dp_shard", "cp"]._flatten(...)``) or come from ``_unflatten``
    (torchtitan's dataloading and dense meshes), so dims are ordered and checked for overlap by the ranks
    they walk, not by their names (see ``combine_meshes``).
    """
    root = dp_mesh._get_root_mesh()
    dp_names = dp_mesh.mesh_dim_names
    tp_names = tp_mesh.mesh_dim_names
    if tp_mesh._get_root_mesh() != root or not dp_names or not tp_names:
        raise FSDPError(
            f"fully_shard: parameter {fqn!r} is a DTensor on {tp_mesh!r}, which is not a named dim of the "
            f"same mesh as the data-parallel mesh {dp_mesh!r}; expected both to be slices of one mesh, "
            'e.g. mesh = init_device_mesh(..., mesh_dim_names=("dp", "tp")), TP on mesh["tp"], '
            'fully_shard(..., mesh=mesh["dp"])'
        )
    same_grid = dp_mesh._layout.root_shape == tp_mesh._layout.root_shape == root._layout.root_shape
    dp_root_dims = {d for dims in dp_mesh._layout.dims for d in dims}
    tp_root_dims = {d for dims in tp_mesh._layout.dims for d in dims}
    already = f"fully_shard: parameter {fqn!r} is already laid out over the data-parallel mesh dim(s) {dp_names} "
    if set(dp_names) & set(tp_names) or (same_grid and dp_root_dims & tp_root_dims):
        raise FSDPError(
            f"{already}({tp_mesh!r}); expected parameters that are plain tensors or DTensors on other mesh dims "
            "(is fully_shard applied twice, or tensor parallelism on the dp dim?)"
        )
    try:
        combined = combine_meshes([dp_mesh, tp_mesh])
    except (KeyError, ValueError) as error:
        if "overlap" in str(error):
            raise FSDPError(
                f"{already}({tp_mesh!r}: {error}); expected parameters that are plain tensors or DTensors on other "
                "mesh dims (is fully_shard applied twice, or tensor parallelism on the dp dim?)"
            ) from error
        raise FSDPError(
            f"fully_shard: parameter {fqn!r} is a DTensor on {tp_mesh!r} and the data-parallel mesh is "
            f"{dp_mesh!r}; their dims cannot be joined into one mesh ({error}); expected dims of one root mesh "
            "(sliced, flattened or unflattened from it) that do not overlap"
        ) from error
    names = combined.mesh_dim_names
    assert names is not None
    return combined, names
